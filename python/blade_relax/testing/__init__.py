"""Testing tools: a random generator of dynamic-shape Relax programs and a differential harness.

``python -m blade_relax.testing.fuzz --long --count 5000`` runs the long fuzzing mode.
"""

from .program_gen import (
    Choices,
    DimRange,
    GeneratedProgram,
    GeneratorConfig,
    RandomChoices,
    generate_program,
    program_from_seed,
    programs,
)

__all__ = [
    "Choices",
    "DimRange",
    "GeneratedProgram",
    "GeneratorConfig",
    "RandomChoices",
    "generate_program",
    "program_from_seed",
    "programs",
]

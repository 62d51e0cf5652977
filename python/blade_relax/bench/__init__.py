"""The benchmark ruler: workloads, configurations side by side, one sequence-length trace.

``python -m blade_relax.bench --workload llama-train --configs tvm-dynamic,torch-eager`` (also
``blade-relax bench``) prints a markdown table and writes JSON (``--out``) and a plot
(``--plot``). Configurations live in a registry (:mod:`.configs`); each memory pass adds its own
``blade-relax*`` configurations there.
"""

from .cli import main
from .configs import (
    TorchConfig,
    TvmConfig,
    available_configs,
    budget_variant,
    get_config,
    register_budget_family,
    register_config,
    register_config_family,
)
from .runner import BenchResult, Measurement, run_benchmark
from .trace import length_trace
from .workloads import REAL, SMALL, WORKLOADS, ModelSizes, Workload, build_workload

__all__ = [
    "REAL",
    "SMALL",
    "WORKLOADS",
    "BenchResult",
    "Measurement",
    "ModelSizes",
    "TorchConfig",
    "TvmConfig",
    "Workload",
    "available_configs",
    "budget_variant",
    "build_workload",
    "get_config",
    "length_trace",
    "main",
    "register_budget_family",
    "register_config",
    "register_config_family",
    "run_benchmark",
]

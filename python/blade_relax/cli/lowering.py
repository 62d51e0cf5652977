"""The memory stage as ``demo`` and ``report`` lower to it and name what they find there.

:func:`blade_flags` asks :func:`blade_relax.pipeline.lower_to_memory_stage` for the passes the
compiled executable runs; :func:`function_label` names the copies those passes make of a
function (range versions, budget copies) as the entry function they stand for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["blade_flags", "function_label"]


def blade_flags() -> dict[str, bool]:
    """The passes :func:`blade_relax.get_pipeline` runs by default, as flags.

    :func:`blade_relax.pipeline.lower_to_memory_stage` turns every pass off unless asked; the
    IR it returns is the one the compiled executable runs only when it is asked for the same
    passes as ``get_pipeline("llvm")`` runs. ``check_dims`` is left off: its range check
    allocates nothing, and its lowered condition would show up as a dim of its own.
    """
    import inspect

    from ..pipeline import get_pipeline

    return {
        name: param.default
        for name, param in inspect.signature(get_pipeline).parameters.items()
        if isinstance(param.default, bool) and name != "check_dims"
    }


def function_label(mod: Any, name: str) -> str:
    """A user-facing name for a function, for copies the memory passes made of an entry.

    ``MemoryAwareSchedule`` may split ``main`` into range copies (``main__s110_inf``), and
    ``Rematerialize`` keeps the function as it was (``main__plain``) next to its rewritten
    copy for calls under a budget (``main__remat``). Those names are internal; this says which
    entry function a copy stands for and when it runs: ``"main for s >= 110"``, ``"main"``
    (what runs without a budget), ``"main under a budget"``.
    """
    from ..transform.dispatch import budget_copy_of, range_of

    ranges: list[str] = []
    budget = False
    current = name
    for _ in range(8):  # copies of copies: a budget copy of a range copy, at most
        if current not in {gv.name_hint for gv in mod.get_global_vars()}:
            break
        func = mod[current]
        if (copy := budget_copy_of(func)) is not None:
            current, budget = copy[0], budget or copy[1]
        elif (version := range_of(func)) is not None:
            current = version[0]
            ranges.append(str(version[1]))
        else:
            break
    label = current
    if ranges:
        label += " for " + " and ".join(ranges)
    if budget:
        label += " under a budget"
    return label

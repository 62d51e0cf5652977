"""``torch.export`` for models with guards that hold over the declared sizes but that torch
cannot prove.

Some models ask torch for a fact about the symbolic length that holds for every length the
import declares but that torch's symbolic reasoning does not simplify: MiniMax clamps a window
to ``min(256, s)`` and then needs ``min(256, s) <= s``. ``torch.export`` refuses such a model
("Constraints violated (s)! Not all values of s ... satisfy the generated guard"). Exported
again with ``prefer_deferred_runtime_asserts_over_guards=True``, each such guard becomes an
``_assert_scalar`` node of the graph instead. TVM's importer drops those nodes (it maps
``_assert_scalar`` to its argument), so a length where one fails would run unchecked: each
assertion is evaluated here at every combination of the declared values of the sizes it reads.
Where every one holds, the assertion nodes are removed (with the size arithmetic only they read,
for which TVM has no converters, ``sym_not`` among them); where one fails at some size, the
import is refused with :class:`GuardError`, naming the condition and the first such size.

torch has no check of its own that a deferred assertion holds over a finite range: its solver
answers "cannot prove", and evaluating each condition at every declared size is what is left
(a few thousand values of one dim at most, for the assertions that read only the length).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

__all__ = ["GuardError", "decompose_checked", "drop_proven_asserts", "export"]

#: Most size combinations an assertion is evaluated at; beyond, the import is refused.
MAX_CHECKED = 1_000_000


class GuardError(ValueError):
    """A deferred guard of the export fails at some declared size, or cannot be checked."""


def export(module: Any, example: tuple, dynamic: Any) -> tuple[Any, bool]:
    """``torch.export.export(module, example, dynamic_shapes=dynamic)``; where torch cannot prove
    a guard over the declared ranges, the export with those guards deferred as assertions.

    Returns
    -------
    (ExportedProgram, deferred)
        ``deferred`` when the guards were deferred: the graph imported from it must then go
        through :func:`drop_proven_asserts`.
    """
    import torch

    try:
        return torch.export.export(module, example, dynamic_shapes=dynamic), False
    except torch._dynamo.exc.UserError as err:
        if "Constraints violated" not in str(err):
            raise
    deferred = torch.export.export(
        module, example, dynamic_shapes=dynamic, prefer_deferred_runtime_asserts_over_guards=True
    )
    return deferred, True


def decompose_checked(program: Any) -> Any:
    """``program.run_decompositions()``, its deferred guards checked and dropped after it.

    The decompositions trace the graph again and put the deferred guards back, new ones among
    them (MiniMax's inference graph gets ``Ne(m, m**2)`` for ``m = min(256, s)``, through
    ``sym_not``, which TVM has no converter for): dropping them before would leave those
    unchecked. Raises :class:`GuardError` as :func:`drop_proven_asserts` does.
    """
    decomposed = program.run_decompositions()
    drop_proven_asserts(decomposed)
    return decomposed


def drop_proven_asserts(program: Any) -> int:
    """Check every ``_assert_scalar`` of ``program`` (an ``ExportedProgram``) at every
    combination of the declared values of the sizes it reads, then remove them (and what only
    they read) from its graph.

    Returns
    -------
    int
        The assertions removed.

    Raises
    ------
    GuardError
        When one fails at some declared size, reads a size without a finite declared range (a
        data-dependent one), or would be evaluated at more than :data:`MAX_CHECKED` sizes.
    """
    import torch

    graph = program.graph_module.graph
    ranges = {sym: (r.lower, r.upper) for sym, r in program.range_constraints.items()}
    asserts = [
        node
        for node in graph.nodes
        if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default
    ]
    for node in asserts:
        _check(_condition(node.args[0]), ranges)
    for node in asserts:
        graph.erase_node(node)
    if asserts:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return len(asserts)


def _condition(argument: Any) -> Any:
    """An assertion's condition as a sympy expression (a constant where torch folded it)."""
    import sympy
    import torch

    value = argument.meta.get("val") if isinstance(argument, torch.fx.Node) else argument
    symbolic = getattr(value, "node", None)
    return symbolic.expr if symbolic is not None else sympy.sympify(bool(value))


def _check(condition: Any, ranges: dict[Any, tuple[Any, Any]]) -> None:
    """Evaluate the sympy ``condition`` at every combination of the declared values of its
    symbols (``ranges``: the program's range constraints); :class:`GuardError` at the first
    that makes it false, or when it reads a size it cannot enumerate."""
    import sympy

    symbols = sorted(condition.free_symbols, key=str)
    bounds = [ranges.get(s, (None, None)) for s in symbols]
    unknown = [str(s) for s, b in zip(symbols, bounds) if not all(map(_is_integer, b))]
    if unknown:
        raise GuardError(
            f"the export needs {condition}, which reads {', '.join(unknown)} (no finite declared "
            "range): it cannot be checked"
        )
    values = [range(int(lower), int(upper) + 1) for lower, upper in bounds]
    count = math.prod(len(v) for v in values)
    if count > MAX_CHECKED:
        raise GuardError(
            f"the export needs {condition} at {count} combinations of sizes, more than the "
            f"{MAX_CHECKED} checked"
        )
    for point in itertools.product(*values):
        held = condition.xreplace({s: sympy.Integer(v) for s, v in zip(symbols, point)})
        if held is not sympy.true:
            at = ", ".join(f"{s} = {v}" for s, v in zip(symbols, point)) or "every size"
            fails = "fails" if held is sympy.false else f"cannot be evaluated ({held})"
            raise GuardError(f"the export needs {condition}, which {fails} at {at}")


def _is_integer(bound: Any) -> bool:
    """Whether a range's bound is a finite integer (not torch's ``int_oo``, not missing)."""
    import sympy

    return isinstance(bound, int | sympy.Integer)

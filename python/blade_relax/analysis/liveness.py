"""Liveness of the variables of a Relax function, over all its binding blocks.

The bindings of every block (dataflow or not) are flattened into one program order. A variable
is *used* by a binding when it occurs free in the bound value (uses inside the branches of an
``If`` count for the ``If`` binding). Variables in the function's result are used "after the
last binding" (index ``len(bindings)``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from tvm import relax

__all__ = ["BindingInfo", "Liveness", "block_liveness", "liveness", "function_outputs"]


@dataclass(frozen=True)
class BindingInfo:
    """One binding in program order.

    Attributes
    ----------
    index
        Position in the flattened program order.
    var
        The bound variable.
    value
        The bound expression.
    uses
        Variables read by the binding, without repeats, in order of first occurrence.
    block_index
        Index of the binding block the binding belongs to.
    is_dataflow
        Whether that block is a dataflow block.
    is_match_cast
        Whether the binding is a ``match_cast`` (the value is re-typed, not computed).
    """

    index: int
    var: relax.Var
    value: relax.Expr
    uses: tuple[relax.Var, ...]
    block_index: int
    is_dataflow: bool
    is_match_cast: bool = False


@dataclass
class Liveness:
    """Definition and use positions of every variable of one function.

    Attributes
    ----------
    params
        The function parameters (defined before the first binding).
    bindings
        Every binding in program order.
    outputs
        Variables that occur in the function's result expression.
    definition
        Binding index that defines each bound variable (params are absent).
    uses
        Sorted binding indices that read each variable; ``len(bindings)`` stands for the result.
    """

    params: list[relax.Var]
    bindings: list[BindingInfo]
    outputs: list[relax.Var]
    definition: dict[relax.Var, int] = field(default_factory=dict)
    uses: dict[relax.Var, list[int]] = field(default_factory=dict)

    @property
    def end(self) -> int:
        """The position of the function's result (after the last binding)."""
        return len(self.bindings)

    def last_use(self, var: relax.Var) -> int | None:
        """Index of the last binding that reads ``var`` (``end`` if it is returned)."""
        positions = self.uses.get(var)
        return positions[-1] if positions else None


def _free_vars_in_order(expr: relax.Expr) -> tuple[relax.Var, ...]:
    seen: dict[relax.Var, None] = {}
    for var in relax.analysis.free_vars(expr):
        seen.setdefault(var, None)
    return tuple(seen)


def _uses(value: relax.Expr, memo: MutableMapping[Any, tuple[relax.Var, ...]] | None):
    if memo is None:
        return _free_vars_in_order(value)
    out = memo.get(value)
    if out is None:
        out = memo[value] = _free_vars_in_order(value)
    return out


def function_outputs(func: relax.Function) -> list[relax.Var]:
    """Variables that occur in the result expression of ``func``'s body."""
    body = func.body
    result = body.body if isinstance(body, relax.SeqExpr) else body
    return list(_free_vars_in_order(result))


def liveness(
    func: relax.Function,
    *,
    uses_memo: MutableMapping[Any, tuple[relax.Var, ...]] | None = None,
    positions: bool = True,
) -> Liveness:
    """Compute definition and use positions for the variables of ``func``.

    Parameters
    ----------
    func
        A normalized Relax function (its body a ``SeqExpr``).
    uses_memo
        The variables each binding value reads, remembered across calls, by value node: an
        analysis that builds the liveness of many rewrites of one function (which keep most
        value nodes) walks each value once.
    positions
        Record where each variable is defined and used (``definition``, ``uses``). A reader of
        the bindings alone passes False (both stay empty; ``last_use`` knows no variable):
        every lookup of a variable there is a comparison of TVM nodes, which for a shape
        variable builds and proves an equation.

    Returns
    -------
    Liveness
    """
    params = list(func.params)
    bindings: list[BindingInfo] = []
    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    for block_index, block in enumerate(blocks):
        is_dataflow = isinstance(block, relax.DataflowBlock)
        for binding in block.bindings:
            bindings.append(
                BindingInfo(
                    index=len(bindings),
                    var=binding.var,
                    value=binding.value,
                    uses=_uses(binding.value, uses_memo),
                    block_index=block_index,
                    is_dataflow=is_dataflow,
                    is_match_cast=isinstance(binding, relax.MatchCast),
                )
            )
    outputs = function_outputs(func)
    info = Liveness(params=params, bindings=bindings, outputs=outputs)
    if not positions:
        return info
    for binding in bindings:
        info.definition[binding.var] = binding.index
        for var in binding.uses:
            info.uses.setdefault(var, []).append(binding.index)
    for var in outputs:
        info.uses.setdefault(var, []).append(len(bindings))
    return info


def block_liveness(block: relax.BindingBlock) -> Liveness:
    """The bindings of one block, as :func:`liveness` lists a function's (without positions):
    for a model of one block, which has no parameters or result of its own (what it reads
    from earlier blocks is outside it, see ``outside`` of
    :func:`blade_relax.analysis.storage_flow`)."""
    is_dataflow = isinstance(block, relax.DataflowBlock)
    bindings = [
        BindingInfo(
            index=index,
            var=binding.var,
            value=binding.value,
            uses=_free_vars_in_order(binding.value),
            block_index=0,
            is_dataflow=is_dataflow,
            is_match_cast=isinstance(binding, relax.MatchCast),
        )
        for index, binding in enumerate(block.bindings)
    ]
    return Liveness(params=[], bindings=bindings, outputs=[])

"""Editing dataflow blocks by inserting copies of bindings: what the passes that recompute or
clone values share.

A *copy* is a new binding of an existing value (with some of its reads renamed to earlier
copies) placed before a given position; the bindings at chosen positions then read the copy
instead of the original. TVM has no Python helper to rename a variable's reads inside one
binding, nor to rebuild a function around new blocks with its types, so both are here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

__all__ = [
    "copy_binding",
    "copy_chain",
    "insert_copies",
    "rewrite_dataflow_blocks",
    "vars_read_after",
    "with_blocks",
]

BlockRewrite = Callable[
    [relax.Function, int, relax.DataflowBlock, list], relax.DataflowBlock | None
]
"""``(func, index, block, blocks) -> new block or None``: ``blocks`` holds the function's blocks
with the earlier ones already rewritten."""


@mutator
class _Renamer(PyExprMutator):
    """Reads of the renamed variables become reads of their copies."""

    def __init__(self, renames: Mapping[relax.Var, relax.Var]) -> None:
        super().__init__()
        self.renames = renames

    def visit_var_(self, var: relax.Var) -> relax.Expr:  # noqa: D102
        return self.renames.get(var, var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:  # noqa: D102
        return self.renames.get(var, var)


def _renamed(value: relax.Expr, renames: Mapping[relax.Var, relax.Var]) -> relax.Expr:
    return _Renamer(renames).visit_expr(value) if renames else value


def copy_binding(
    original: relax.Binding, name: str, renames: Mapping[relax.Var, relax.Var]
) -> relax.VarBinding:
    """A new dataflow binding ``name`` of ``original``'s value, its reads renamed."""
    var = relax.DataflowVar(name, original.var.ty)
    return relax.VarBinding(var, _renamed(original.value, renames))


def copy_chain(
    bindings: Sequence[relax.Binding], chain: Sequence[int], suffix: str
) -> tuple[list[relax.VarBinding], dict[relax.Var, relax.Var]]:
    """Copies of the bindings at positions ``chain`` (in order, each reading the copies before
    it), named ``<name><suffix>``, and the map from each original variable to its copy."""
    copies: list[relax.VarBinding] = []
    renames: dict[relax.Var, relax.Var] = {}
    for position in chain:
        original = bindings[position]
        copy = copy_binding(original, original.var.name + suffix, renames)
        copies.append(copy)
        renames[original.var] = copy.var
    return copies, renames


def insert_copies(
    block: relax.DataflowBlock,
    copies_before: Mapping[int, Sequence[relax.Binding]],
    renames_at: Mapping[int, Mapping[relax.Var, relax.Var]],
) -> relax.DataflowBlock:
    """``block`` with ``copies_before[i]`` bound just before binding ``i``, and the reads of
    binding ``i`` renamed by ``renames_at[i]``."""
    out: list[relax.Binding] = []
    for position, binding in enumerate(block.bindings):
        out += copies_before.get(position, [])
        renames = renames_at.get(position)
        if renames:
            value = _renamed(binding.value, renames)
            if isinstance(binding, relax.MatchCast):
                binding = relax.MatchCast(binding.var, value, binding.ty)
            else:
                binding = relax.VarBinding(binding.var, value)
        out.append(binding)
    return relax.DataflowBlock(out)


def vars_read_after(func: relax.Function, index: int) -> set[relax.Var]:
    """The variables read after block ``index`` of ``func`` (later blocks and the result)."""
    body = func.body
    read = set(relax.analysis.free_vars(body.body))
    for later in body.blocks[index + 1 :]:
        for binding in later.bindings:
            read.update(relax.analysis.free_vars(binding.value))
    return read


def with_blocks(func: relax.Function, blocks: Sequence[relax.BindingBlock]) -> relax.Function:
    """``func`` with ``blocks`` as its body's blocks, normalized (types filled in)."""
    body = func.body
    new_func = relax.Function(
        func.params, relax.SeqExpr(list(blocks), body.body), func.ret_ty, func.is_pure, func.attrs
    )
    return relax.BlockBuilder().normalize(new_func)


def rewrite_dataflow_blocks(
    mod: tvm.IRModule, rewrite: BlockRewrite, builder: relax.BlockBuilder | None = None
) -> tvm.IRModule:
    """``mod`` with ``rewrite`` applied to every dataflow block of every Relax function; the
    functions whose blocks changed are rebuilt (``mod`` itself when none did).

    ``builder``, a ``relax.BlockBuilder(mod)`` the rewrite adds functions to (kernels its new
    bindings call), receives the rebuilt functions too and gives the result."""
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        blocks = list(func.body.blocks)
        changed = False
        for index, block in enumerate(blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            new_block = rewrite(func, index, block, blocks)
            if new_block is not None:
                blocks[index] = new_block
                changed = True
        if changed:
            updates[gv] = with_blocks(func, blocks)
    if not updates:
        return mod
    builder = builder or relax.BlockBuilder(mod)
    for gv, func in updates.items():
        builder.update_func(gv, func)
    return builder.get()

"""CloneGeneratedTensors: tensors generated from inputs alone are built once per reader.

Some large tensors of an imported graph carry no information of their own: the causal mask
``where(iota_row >= iota_col, 0, -inf)`` of shape ``(1, 1, s, s)``, a one-hot target
``-1 * onehot``, position ids. They are computed from the function's parameters, constants and
the symbolic dims only, yet a graph computes each once and reads it in every layer, so it is
live from the first layer to the last (and through the backward). Built again right before
each reader, such a tensor is fused by ``FuseOps`` into the reader's kernel (a mask into the
masked softmax, a one-hot into the loss gradient) and never materialized, or, where the reader
cannot absorb it, lives only next to that reader.

The rule
--------
A binding is *generated* when it is a call of a cheap operator (elementwise and comparison
operators, ``where``, casts, broadcasts, ``expand_dims``/``reshape``/``permute_dims``,
``arange``/``full``/``zeros``/``ones`` and their ``_like`` forms) whose tensor arguments are
parameters, constants or generated bindings (its *tree*, at most ``max_tree`` bindings). A
generated binding with at least two readers in its block keeps its original for the first
reader; before every later reader the whole tree is bound again, and that reader reads the
copy. Bindings read after their block are left alone.

Why it is safe for memory
-------------------------
The original now lives from its definition to its first reader only; each copy lives next to
its reader, where the original was live before, and its tree's leaves are parameters,
constants or scalars (live anyway, or nothing). Intermediate bindings of a tree are transient
and fuse with it (all its operators are injective); ``MemoryAwareSchedule`` and the planners
see the copies as any other kernels. The cost is the copy's elementwise work per reader.

Where it runs
-------------
On high-level Relax before ``LegalizeOps``, so that ``FuseOps`` can fuse each copy into its
reader: in :func:`blade_relax.get_pipeline` after ``FoldZeroScatter`` (which turns one-hot
scatters into such predicates).

What it assumes
---------------
A normalized module with dataflow blocks. Values of other kinds of blocks pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from ..analysis.effects import in_place_writes
from ..util.collection import pauses_collection
from ._block_edit import copy_chain, insert_copies, rewrite_dataflow_blocks, vars_read_after
from .result import PassResult, counted, function_results, publish

__all__ = ["CloneGeneratedTensors", "CloneOptions", "CloneReport"]

#: Operators cheap enough to repeat per reader, producing a tensor from their arguments alone.
GENERATOR_OPS = frozenset(
    {
        "relax.add",
        "relax.subtract",
        "relax.multiply",
        "relax.divide",
        "relax.negative",
        "relax.where",
        "relax.equal",
        "relax.not_equal",
        "relax.less",
        "relax.less_equal",
        "relax.greater",
        "relax.greater_equal",
        "relax.logical_and",
        "relax.logical_or",
        "relax.logical_not",
        "relax.bitwise_and",
        "relax.bitwise_or",
        "relax.bitwise_not",
        "relax.astype",
        "relax.broadcast_to",
        "relax.expand_dims",
        "relax.reshape",
        "relax.permute_dims",
        "relax.index_tensor",
        "relax.arange",
        "relax.full",
        "relax.full_like",
        "relax.zeros",
        "relax.zeros_like",
        "relax.ones",
        "relax.ones_like",
    }
)


@dataclass(frozen=True)
class CloneOptions:
    """Options of :class:`CloneGeneratedTensors`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    max_tree
        The most bindings a generated tensor's tree may have (each copy repeats them all).
    """

    enabled: bool = True
    max_tree: int = 16

    def __post_init__(self) -> None:
        if self.max_tree < 1:
            raise ValueError(f"max_tree must be at least 1, got {self.max_tree}")


@dataclass
class CloneReport:
    """What one run changed: generated tensors ``cloned``, and the ``copies`` made."""

    cloned: int = 0
    copies: int = 0


def _trees(
    bindings: Sequence[relax.Binding], params: set[relax.Var], max_tree: int
) -> dict[relax.Var, tuple[int, ...]]:
    """The generated bindings of a block (see the module docstring) -> the positions of their
    trees (in order, themselves last).

    Parameters
    ----------
    bindings
        The bindings of one dataflow block.
    params
        The function's parameters (live anyway, so a tree may read them).
    max_tree
        The most bindings a tree may have; larger ones are not generated.
    """
    trees: dict[relax.Var, tuple[int, ...]] = {}
    for position, binding in enumerate(bindings):
        value = binding.value
        if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
            continue
        if not isinstance(value.op, tvm.ir.Op) or value.op.name not in GENERATOR_OPS:
            continue
        if not isinstance(binding.var.ty, relax.TensorType):
            continue
        tree: set[int] = {position}
        ok = True
        for var in relax.analysis.free_vars(value):
            if var in params or not isinstance(var.ty, relax.TensorType):
                continue  # parameters are live anyway; shapes and scalars cost nothing
            if var in trees:
                tree.update(trees[var])
            else:
                ok = False
                break
        if ok and len(tree) <= max_tree:
            trees[binding.var] = tuple(sorted(tree))
    return trees


def _clone_block(
    block: relax.DataflowBlock,
    params: set[relax.Var],
    escaping: set[relax.Var],
    options: CloneOptions,
    report: CloneReport,
) -> relax.DataflowBlock | None:
    bindings = list(block.bindings)
    trees = _trees(bindings, params, options.max_tree)
    readers: dict[relax.Var, list[int]] = {}
    for position, binding in enumerate(bindings):
        for var in relax.analysis.free_vars(binding.value):
            if var in trees:
                readers.setdefault(var, []).append(position)
    # A copy reads the tree's inputs again at its reader: not where memory they refer to was
    # written in place since the original (an optimizer's update of a parameter).
    writes = in_place_writes(bindings, None)
    copies_before: dict[int, list[relax.Binding]] = {}
    renames_at: dict[int, dict[relax.Var, relax.Var]] = {}
    for var, tree in trees.items():
        reads = sorted(set(readers.get(var, [])))
        if var in escaping or len(reads) < 2:
            continue
        leaves = {
            v
            for position in tree
            for v in relax.analysis.free_vars(bindings[position].value)
            if isinstance(v.ty, relax.TensorType)
        }
        start = tree[0]
        reads = reads[:1] + [
            r for r in reads[1:] if not any(writes.written_between(v, start, r) for v in leaves)
        ]
        if len(reads) < 2:
            continue
        for reader in reads[1:]:
            copies, renames = copy_chain(bindings, tree, f"_for_{reader}")
            copies_before.setdefault(reader, []).extend(copies)
            renames_at.setdefault(reader, {})[var] = renames[var]
            report.copies += 1
        report.cloned += 1
    if not copies_before:
        return None
    return insert_copies(block, copies_before, renames_at)


@tvm.transform.module_pass(opt_level=0, name="CloneGeneratedTensors")
class CloneGeneratedTensors:
    """Build tensors generated from inputs alone once per reader (see the module docstring).

    Parameters
    ----------
    options
        A :class:`CloneOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`CloneReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs on whole imported graphs before legalization, where a memory
    timeline of each changed function would cost more than the pass; what a copy saves shows
    only once ``FuseOps`` fused it into its reader).
    """

    def __init__(self, options: CloneOptions | None = None) -> None:
        if options is not None and not isinstance(options, CloneOptions):
            raise TypeError(
                f"CloneGeneratedTensors expects CloneOptions, got {type(options).__name__}"
            )
        self.options = options or CloneOptions()
        self.report = CloneReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = CloneReport()
        if not self.options.enabled:
            publish(self, PassResult("CloneGeneratedTensors", notes=("disabled by its options",)))
            return mod
        names = {func: gv.name_hint for gv, func in mod.functions.items()}
        counts: dict[str, list[int]] = {}  # function: tensors cloned, copies made

        def rewrite(func, index, block, _blocks):
            escaping = vars_read_after(func, index)
            before = (self.report.cloned, self.report.copies)
            new_block = _clone_block(block, set(func.params), escaping, self.options, self.report)
            count = counts.setdefault(names[func], [0, 0])
            count[0] += self.report.cloned - before[0]
            count[1] += self.report.copies - before[1]
            return new_block

        out = rewrite_dataflow_blocks(mod, rewrite)
        changes = {
            name: [
                f"{counted(cloned, 'generated tensor')} built again for later readers "
                f"({counted(copies, 'copy', 'copies')})"
            ]
            for name, (cloned, copies) in counts.items()
            if cloned
        }
        functions = function_results(mod, out, changes)
        publish(self, PassResult("CloneGeneratedTensors", functions, detail=self.report))
        return out

"""VectorizeColumnReductions: a reduction over an outer axis runs with its rows inside, as a CPU
vectorizes it, with the same results.

TVM legalizes a reduction over any axis to one block whose loops are the output's axes first
and the reduced axes last, and its CPU pipeline keeps that nest. For a reduction over an outer
axis (``collapse_sum`` of a bias or a norm weight's gradient, ``(s, n) -> (n,)``; ``sum`` over
``axis=0``) every output element is then a chain of dependent adds over a column, each add
reading one element a row away from the last: one element at a time, at the latency of the add.
Measured on the benchmark's mlp-train step at s = 256, its three ``collapse_sum`` kernels took
0.42 of the step's 3.6 ms.

This pass interchanges the loops of each such kernel so that the reduced loops run outside the
innermost output axis (``T.init`` split out first, by ``decompose_reduction``)::

    for j in n: for i in s: y[j] += x[i, j]      ->      for j in n: y[j] = 0
                                                        for i in s: for j in n: y[j] += x[i, j]

The inner loop then runs along a row of ``x`` and of ``y``, contiguous, which LLVM vectorizes.
Each output element still takes its terms in the same order (the reduced loops keep theirs,
only the output loop moved), so every value is the stock kernel's, bit for bit. No buffer is
added, changed or removed.

A kernel is rewritten when it is one reduction block (``InlineKernelIntermediates`` inlines
the elementwise producers of a fused reduction into it) whose loops are its block's iteration
variables one to one, the innermost loop a reduced one, and whose innermost output axis is the
last index of every buffer the block reads and writes (other than scalars) while no reduced
axis is: then moving that one loop inside gives contiguous inner accesses everywhere. Every
other kernel (a row reduction, a kernel of several blocks, a reduction with another layout) is
left as it is.

Where it runs
-------------
On CPU targets, on PrimFuncs, after ``FuseTIR`` and ``InlineKernelIntermediates``; in
:func:`blade_relax.get_pipeline` right after ``VectorizeSoftmax``, before any memory pass
(it changes no buffer, so no memory figure depends on where it runs). On a GPU dlight
schedules reductions.

What it assumes
---------------
Kernels in block form with TVM's reduction blocks (``T.init``); TVM's ``s_tir.Schedule`` does
the interchange, and a kernel where one of its steps fails is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish, with_functions

__all__ = ["ColumnReductionOptions", "VectorizeColumnReductions", "column_reduction_order"]

#: ``IterVar.iter_type`` of a data-parallel (output) axis and of a reduced one.
_SPATIAL, _REDUCED = 0, 2


@dataclass(frozen=True)
class ColumnReductionOptions:
    """Options of :class:`VectorizeColumnReductions`.

    Attributes
    ----------
    min_inner_extent
        Leave a kernel alone when its innermost output axis has a constant extent below this
        (a loop of one or two elements gains nothing from moving inside); symbolic extents
        always qualify.
    """

    min_inner_extent: int = 2

    def __post_init__(self) -> None:
        if self.min_inner_extent < 1:
            raise ValueError(f"min_inner_extent must be at least 1, got {self.min_inner_extent}")


def _only_block(sch: s_tir.Schedule) -> Any | None:
    """The one block under the kernel's root, else ``None``."""
    children = sch.get_child_blocks(sch.get_sblock("root"))
    return children[0] if len(children) == 1 else None


def _last_index_var(region: Any) -> Any | None:
    """The variable a buffer region's last index is, when it is one variable."""
    if not region.region:
        return None
    last = region.region[-1]
    return last.min if isinstance(last.min, tirx.Var) else None


def column_reduction_order(func: tirx.PrimFunc, min_inner_extent: int = 2) -> list[int] | None:
    """The loop order (positions of the current loops) that puts ``func``'s reduced loops
    outside its innermost output loop, when ``func`` is a kernel the pass rewrites (see the
    module docstring), else ``None``."""
    try:
        sch = s_tir.Schedule(func)
        block_rv = _only_block(sch)
    except (RuntimeError, ValueError):  # no root block: not in block form
        return None
    if block_rv is None:
        return None
    block = sch.get(block_rv)
    if block.init is None or len(block.writes) != 1:
        return None
    loops = [sch.get(rv) for rv in sch.get_loops(block_rv)]
    values = list(_realize_of(func, block.name_hint).iter_values)
    iters = list(block.iter_vars)
    # One loop per iteration variable, bound in order: the loop order is the axes' order.
    if len(loops) != len(iters) or not all(
        isinstance(v, tirx.Var) and v.same_as(loop.loop_var) for v, loop in zip(values, loops)
    ):
        return None
    kinds = [int(it.iter_type) for it in iters]
    if kinds[-1] != _REDUCED or _SPATIAL not in kinds or set(kinds) - {_SPATIAL, _REDUCED}:
        return None
    inner = max(k for k, kind in enumerate(kinds) if kind == _SPATIAL)
    extent = loops[inner].extent
    if isinstance(extent, tirx.IntImm) and int(extent) < min_inner_extent:
        return None
    inner_var = iters[inner].var
    for region in [*block.reads, *block.writes]:
        if not region.region:  # a scalar: read once per element wherever the loops are
            continue
        last = _last_index_var(region)
        if last is None or not last.same_as(inner_var):
            return None
    outer = [k for k in range(len(kinds)) if k != inner and kinds[k] == _SPATIAL]
    reduced = [k for k, kind in enumerate(kinds) if kind == _REDUCED]
    return [*outer, *reduced, inner]


def _realize_of(func: tirx.PrimFunc, name: str) -> Any:
    """The ``SBlockRealize`` of the block ``name`` in ``func`` (TVM 0.27's Python has no TIR
    visitor: ``tvm_ffi.structural_map`` walks the tree, each node returned unchanged)."""
    found: list[Any] = []

    def realize(node: Any) -> Any:
        if node.block.name_hint == name:
            found.append(node)
        return node

    tvm_ffi.structural_map(func.body, [(tvm.s_tir.SBlockRealize, realize)])
    return found[0]


def interchanged(func: tirx.PrimFunc, order: list[int]) -> tirx.PrimFunc | None:
    """``func`` with its loops in ``order`` and its init split out before the first reduced
    loop, or ``None`` where a schedule step fails."""
    sch = s_tir.Schedule(func)
    try:
        block = _only_block(sch)
        loops = sch.get_loops(block)
        new_order = [loops[k] for k in order]
        sch.reorder(*new_order)
        first_reduced = next(
            loops[k] for k in order if int(sch.get(block).iter_vars[k].iter_type) == _REDUCED
        )
        sch.decompose_reduction(block, first_reduced)
    except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
        return None
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="VectorizeColumnReductions")
class VectorizeColumnReductions:
    """Run each reduction over an outer axis with its output rows inside, bit for bit (see the
    module docstring).

    Parameters
    ----------
    options
        A :class:`ColumnReductionOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.last_result`` is a
    :class:`~blade_relax.transform.result.PassResult` (no byte figures: no buffer changes) and
    ``pass_obj.kernels`` the number of kernels rewritten.
    """

    name = "VectorizeColumnReductions"

    def __init__(self, options: ColumnReductionOptions | None = None) -> None:
        if options is not None and not isinstance(options, ColumnReductionOptions):
            raise TypeError(
                "VectorizeColumnReductions expects ColumnReductionOptions, got "
                f"{type(options).__name__}"
            )
        self.options = options or ColumnReductionOptions()
        self.kernels = 0
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates: dict[tvm.ir.GlobalVar, tirx.PrimFunc] = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            order = column_reduction_order(func, self.options.min_inner_extent)
            new_func = interchanged(func, order) if order is not None else None
            if new_func is not None:
                updates[gv] = new_func.with_attrs(func.attrs) if func.attrs else new_func
        out = with_functions(mod, updates)
        changes = {
            gv.name_hint: ["reduced loops outside the innermost output loop"] for gv in updates
        }
        self.kernels = len(changes)
        notes = (counted(self.kernels, "column reduction") + " interchanged",)
        publish(
            self,
            PassResult(
                "VectorizeColumnReductions",
                function_results(mod, out, changes, kind=tirx.PrimFunc),
                notes=notes,
            ),
        )
        return out

"""BindElementwiseKernels: GPU threads for the kernels that update buffers in place.

The optimizers' update kernels (:func:`blade_relax.training.update_kernel`) are one block that
reads a parameter, its gradient and its states and writes the parameter and the states back,
each iteration touching only its own elements. dlight cannot schedule them: every schedule
primitive that binds a loop to GPU threads (``bind``, also under ``DefaultGPUSchedule`` and
dlight's ``Fallback``) first checks that the loop's block is a "complete block", and a block
that reads and writes the same buffer never is, although no iteration reads what another
writes. This pass binds them itself: the kernel's loop nest becomes one flat index over all
iterations, split into ``blockIdx.x`` and ``threadIdx.x``, the block's iteration variables
recovered from it (quotients and remainders by the extents), the tail masked by the block's
predicate. The kernel is then marked ``tir.is_scheduled``, so dlight leaves it alone.

Only kernels marked :data:`~blade_relax.contract.ELEMENTWISE_KERNEL_ATTR` are bound: the mark
is the promise that each iteration reads and writes only its own elements, which the binding
relies on (iterations run in any order, concurrently). A marked kernel that is already bound
or scheduled, or whose body is not one block under a nest of serial loops, is left as it is
(dlight then reports it, as without this pass).

Where it runs
-------------
In :func:`blade_relax.get_pipeline` on GPU targets: in the ``legalize`` phase, before dlight's
``ApplyDefaultSchedule``. On CPU targets the kernels need no binding. It changes no
computation and no buffer, only how a marked kernel's iterations map to threads.

What it assumes
---------------
Kernels in block form (``s_tir``), as the optimizers write them.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from ..contract import ELEMENTWISE_KERNEL_ATTR
from .result import with_functions

__all__ = ["BindElementwiseKernels", "BindElementwiseOptions"]


@dataclass(frozen=True)
class BindElementwiseOptions:
    """Options of :class:`BindElementwiseKernels`.

    Attributes
    ----------
    threads_per_block
        The ``threadIdx.x`` extent (256: the optimizers' kernels are memory bound, one element a
        thread).
    """

    threads_per_block: int = 256

    def __post_init__(self) -> None:
        if self.threads_per_block < 1 or self.threads_per_block > 1024:
            raise ValueError(
                f"threads_per_block must be in [1, 1024] (CUDA's limit), not "
                f"{self.threads_per_block}"
            )


def _loop_nest(stmt: tirx.Stmt) -> tuple[list[tirx.For], s_tir.stmt.SBlockRealize] | None:
    """The serial loops around the kernel's one block and that block, or ``None``."""
    loops: list[tirx.For] = []
    while isinstance(stmt, tirx.For):
        if stmt.kind != tirx.ForKind.SERIAL or stmt.thread_binding is not None:
            return None
        loops.append(stmt)
        stmt = stmt.body
    if not isinstance(stmt, s_tir.stmt.SBlockRealize):
        return None
    return loops, stmt


def _unflatten(index: tirx.PrimExpr, extents: list[tirx.PrimExpr]) -> list[tirx.PrimExpr]:
    """The loop variables' values at the flat ``index`` of a row-major nest of ``extents``."""
    values: list[tirx.PrimExpr] = []
    for position, extent in enumerate(reversed(extents)):
        last = position == len(extents) - 1
        values.append(index if last else tirx.floormod(index, extent))
        index = tirx.floordiv(index, extent)
    return values[::-1]


def bind_elementwise(func: tirx.PrimFunc, threads_per_block: int) -> tirx.PrimFunc | None:
    """``func`` with its loop nest bound to GPU threads, or ``None`` when its body is not a
    root block holding one block under serial loops (see the module docstring)."""
    root = func.body
    if not isinstance(root, s_tir.stmt.SBlockRealize):
        return None
    if root.block.iter_vars or isinstance(root.block.body, (tirx.For, s_tir.stmt.SBlockRealize)):
        found = _loop_nest(root.block.body)
    else:  # a kernel of rank 0 is its block alone: one thread, under a root block of its own
        found = [], root
        root = s_tir.stmt.SBlockRealize([], True, s_tir.stmt.SBlock([], [], [], "root", root))
    if found is None:
        return None
    loops, realize = found
    dtype = str(loops[0].loop_var.ty) if loops else "int64"
    extents = [loop.extent for loop in loops]
    total = tirx.const(1, dtype)
    for extent in extents:
        total = total * extent
    threads = tirx.const(threads_per_block, dtype)
    block_x, thread_x = tirx.Var("block_x", dtype), tirx.Var("thread_x", dtype)
    flat = block_x * threads + thread_x
    values = _unflatten(flat, extents)
    # The block's iteration variables are the loop variables themselves (``T.axis.remap``),
    # which is what the optimizers write; anything else is left to dlight.
    positions = {loop.loop_var: k for k, loop in enumerate(loops)}
    if any(v not in positions for v in realize.iter_values):
        return None
    iter_values = [values[positions[v]] for v in realize.iter_values]
    inner = s_tir.stmt.SBlockRealize(
        iter_values, tirx.all(realize.predicate, flat < total), realize.block
    )
    grid = tirx.floordiv(total + tirx.const(threads_per_block - 1, dtype), threads)
    for var, extent, tag in ((thread_x, threads, "threadIdx.x"), (block_x, grid, "blockIdx.x")):
        # 1: a thread index; no domain and a variable of its own, as TVMScript makes them.
        binding = tirx.IterVar(None, tirx.Var("iter", dtype), 1, tag)
        inner = tirx.For(
            var, tirx.const(0, dtype), extent, tirx.ForKind.THREAD_BINDING, inner, binding
        )
    block = root.block
    new_root = s_tir.stmt.SBlockRealize(
        root.iter_values,
        root.predicate,
        s_tir.stmt.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            inner,
            block.init,
            block.alloc_buffers,
            block.match_buffers,
            block.annotations,
        ),
    )
    return func.with_body(new_root).with_attr("tir.is_scheduled", True)


@tvm.transform.module_pass(opt_level=0, name="BindElementwiseKernels")
class BindElementwiseKernels:
    """Bind each marked in-place elementwise kernel to GPU threads (see the module docstring).

    After the pass ran, ``pass_obj.bound`` holds the names of the kernels it bound.
    """

    name = "BindElementwiseKernels"

    def __init__(self, options: BindElementwiseOptions | None = None) -> None:
        self.options = options or BindElementwiseOptions()
        self.bound: tuple[str, ...] = ()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
                continue
            if ELEMENTWISE_KERNEL_ATTR not in func.attrs or "tir.is_scheduled" in func.attrs:
                continue
            bound = bind_elementwise(func, self.options.threads_per_block)
            if bound is not None:
                updates[gv] = bound
        self.bound = tuple(sorted(gv.name_hint for gv in updates))
        return with_functions(mod, updates)

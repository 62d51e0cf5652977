"""One executable with a static copy of a function per length bucket, and the pool they share.

:func:`compile_buckets` specializes the function (:class:`~blade_relax.transform.
SpecializeBuckets`: one copy per bucket length, see its module for why static copies) and
builds the module in one ``tvm.compile`` with blade_relax's pipeline, then reports the pool:
the static storages of each copy are read just before ``RewriteCUDAGraph`` runs (by a pass
instrument, so the pipeline is the project's own, unchanged) and merged as TVM merges them.
``Rematerialize`` is left out: its evictions are decided at run time, by Python packed
functions that a CUDA graph would capture once and never call again. ``DispatchGemm`` is left
out too: inside a captured region it keeps TVM's GEMMs anyway (ATen launches outside the
capture), so with graphs on only the GEMMs between regions would run on cuBLAS, and the graphs'
gain could not be told from cuBLAS's in a comparison with graphs off.

The :class:`BucketedBuild` it returns is what
:class:`blade_relax.runtime.cuda_graphs.BucketedRunner` runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tvm

from ..analysis.cuda_graph_pool import PoolPlan, alloc_function_storages, pool_plan
from ..analysis.workspace import compile_keeping_module
from ..contract import CUDA_GRAPH_OPTION, bucket_function_name
from ..pipeline import as_target, get_pipeline
from ..transform.specialize_buckets import SpecializeBuckets, length_axes

__all__ = ["BucketedBuild", "compile_buckets"]


@dataclass
class BucketedBuild:
    """One executable holding a static copy of a function per length bucket.

    Attributes
    ----------
    executable
        ``tvm.compile``'s result.
    lowered
        The module the Relax pipeline produced (``cuda_graph_alloc`` in it when graphs are on).
    function, dim, lengths
        The specialized function, its symbolic dim, and the bucket lengths.
    input_axes, output_axes
        Per input (parameters excluded) and per flattened output, the axis sized by ``dim``.
    graphs
        Whether the copies' static regions run as CUDA graphs.
    pool
        The static storages of every copy and the pool they share
        (:class:`~blade_relax.analysis.cuda_graph_pool.PoolPlan`).
    compile_s
        Seconds the build took.
    """

    executable: Any
    lowered: tvm.IRModule
    function: str
    dim: str
    lengths: tuple[int, ...]
    input_axes: list[int | None]
    output_axes: list[int | None]
    graphs: bool
    pool: PoolPlan
    compile_s: float

    @property
    def allocated_pool(self) -> list[int]:
        """The storages TVM's ``cuda_graph_alloc`` allocates (empty without graphs)."""
        return alloc_function_storages(self.lowered)


@tvm.ir.instrument.pass_instrument
class _PoolRecorder:
    """Reads the planned static storages right before ``RewriteCUDAGraph`` (on CPU targets,
    where it does not run, before ``LowerAllocTensor``, which follows it)."""

    def __init__(self, functions: Sequence[str]) -> None:
        self.functions = tuple(functions)
        self.plan: PoolPlan | None = None

    def run_before_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if self.plan is None and info.name in ("RewriteCUDAGraph", "LowerAllocTensor"):
            self.plan = pool_plan(mod, self.functions)


def _default_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    return get_pipeline(target, remat=False, dispatch_gemm=False)


def compile_buckets(
    mod: tvm.IRModule,
    target: Any,
    lengths: Sequence[int],
    *,
    dim: str = "s",
    function: str = "main",
    graphs: bool = True,
    pipeline: Callable[[tvm.target.Target], tvm.transform.Pass] | None = None,
) -> BucketedBuild:
    """Build one executable with a static copy of ``function`` per bucket length.

    Parameters
    ----------
    mod
        The module (``function`` with a symbolic ``dim``; its ``num_input`` attribute marks the
        parameters after the inputs as weights, whose addresses a graph may capture).
    target
        A CUDA target (graphs captured when ``graphs``) or ``llvm`` (run plainly: the same
        copies, padding and pool plan, checked on the CPU).
    lengths
        The bucket lengths (:class:`~blade_relax.runtime.cuda_graphs.LengthBuckets`'s).
    dim, function
        The symbolic dim and the function to specialize.
    graphs
        Let ``RewriteCUDAGraph`` capture (CUDA targets; TVM's PassContext option).
    pipeline
        ``target -> Pass``, the whole Relax pipeline; by default blade_relax's without
        ``Rematerialize`` and ``DispatchGemm`` (see the module docstring).

    Returns
    -------
    BucketedBuild
        The executable, the lowered module, the length axes of inputs and outputs, and the
        pool every copy shares.

    Raises
    ------
    ValueError
        From :class:`~blade_relax.transform.SpecializeBuckets`, for a bucket outside the
        declared range.
    """
    tgt = as_target(target)
    func = mod[function]
    attrs = func.attrs if func.attrs is not None else {}
    num_input = int(attrs["num_input"]) if "num_input" in attrs else len(func.params)
    input_axes = [length_axes(p.ty, dim)[0] for p in func.params[:num_input]]
    output_axes = length_axes(func.ret_ty, dim)
    specializer = SpecializeBuckets(dim, lengths, function)
    specialized = specializer(mod)
    names = [bucket_function_name(function, dim, n) for n in specializer.lengths]
    recorder = _PoolRecorder(names)
    capture = bool(graphs and tgt.kind.name == "cuda")
    # The caller's context (its instruments and options) with the graph option and the
    # recorder added.
    current = tvm.transform.PassContext.current()
    config = {**dict(current.config), CUDA_GRAPH_OPTION: capture}
    instruments = [*current.instruments, recorder]
    start = time.perf_counter()
    with tvm.transform.PassContext(
        opt_level=current.opt_level, config=config, instruments=instruments
    ):
        compiled = compile_keeping_module(specialized, tgt, (pipeline or _default_pipeline)(tgt))
    seconds = time.perf_counter() - start
    return BucketedBuild(
        executable=compiled.executable,
        lowered=compiled.module,
        function=function,
        dim=dim,
        lengths=specializer.lengths,
        input_axes=input_axes,
        output_axes=output_axes,
        graphs=capture,
        pool=recorder.plan or PoolPlan({}, ()),
        compile_s=seconds,
    )

"""The blade_relax compilation pipeline: TVM's stock phases with our memory passes in place.

Where each pass runs, and why there:

* ``FuseAttention`` runs first on CPU targets, on the high-level ops: an attention chain
  (``matmul``, scale, mask, ``softmax``, ``matmul`` and the layout operators around it) becomes
  one kernel that ``InlineKernelIntermediates`` later computes row by row. It must see the
  score matmul before ``SimplifyTransposes`` turns it into an ``NT_matmul`` kernel.
* ``SimplifyTransposes`` runs next, on the high-level ops (``relax.permute_dims``,
  ``relax.matmul``) that library dispatch and ``LegalizeOps`` would otherwise lower: it cancels
  the transposes an imported graph is full of and lets matmuls read transposed operands in
  place, before any of them becomes a kernel with a buffer of its own.
* ``FoldZeroScatter`` runs next, also on high-level ops: a scatter into zeros (one-hots,
  embedding gradients) becomes a predicate ``FuseOps`` can fuse, or one reduction kernel, before
  ``LegalizeOps`` turns it into an opaque kernel with a zero buffer and a copy.
* ``CloneGeneratedTensors`` runs after it, still on high-level ops: a tensor computed from
  inputs alone (a causal mask, a one-hot) is built again before each later reader, so that
  ``FuseOps`` fuses it into every reader instead of keeping one copy live across the layers.
* ``InlineKernelIntermediates`` runs right after ``FuseTIR`` on CPU targets: it computes the
  elementwise chains inside fused kernels without scratch buffers (kernel workspaces), which
  dlight's schedules do on GPU targets.
* ``MemoryAwareSchedule`` runs after ``FuseOps``/``FuseTIR`` and before ``ToNonDataflow``: it
  reorders bindings of dataflow blocks, which exist only until ``ToNonDataflow``, and it should
  see the fused kernels whose buffers the VM will really allocate.
* ``RecomputeCheapValues`` runs right after ``MemoryAwareSchedule`` (or where it would run): it
  recomputes elementwise results before their late readers in the order that will run, and
  must insert its copies into dataflow blocks.
* ``Rematerialize`` runs after ``CallTIRRewrite`` and before memory planning: it inserts impure
  ``evict``/``regenerate`` calls, which may not stand in a dataflow block, and the planner must
  see them so that evictable tensors never land in shared storage.
* ``PlanMemory`` takes the place of ``StaticPlanBlockMemory``.
* ``CheckDimRanges`` runs after ``Rematerialize`` and before memory planning: its assertions
  on the declared dim ranges are impure (no dataflow block, no purity checking) and become the
  first bindings of the body, ahead of every allocation and kernel (see check_dim_ranges.py).

The pipeline is registered as the Relax pipeline ``"blade_relax"``, so
``tvm.compile(mod, target, relax_pipeline=relax.get_pipeline("blade_relax", target=target))``
works as well as ``relax_pipeline=blade_relax.get_pipeline(target)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax


def as_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """Normalize a target given as a string, a JSON-like dict or a ``Target``."""
    if isinstance(target, tvm.target.Target):
        return target
    try:
        return tvm.target.Target(target)
    except Exception as err:  # TVM raises its own error types; name the input instead.
        raise ValueError(f"not a valid TVM target: {target!r} ({err})") from err


def is_gpu_target(target: tvm.target.Target) -> bool:
    """Whether kernels for ``target`` run on a CUDA-like GPU."""
    return target.kind.name in ("cuda", "rocm", "vulkan", "metal", "opencl")


def _backend_phases(target: tvm.target.Target):
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as phases
    elif target.kind.name == "llvm":
        from tvm.relax.backend.cpu_generic import pipeline as phases
    else:
        raise ValueError(f"blade_relax supports llvm and cuda targets, not {target.kind.name!r}")
    return phases


def _pass_list(
    target: tvm.target.Target,
    schedule: bool,
    remat: bool,
    plan: bool,
    schedule_options: Any,
    remat_options: Any,
    plan_options: Any,
    *,
    check_dims: bool = False,
    check_options: Any = None,
    simplify: bool = False,
    simplify_options: Any = None,
    fold_scatter: bool = False,
    fold_scatter_options: Any = None,
    inline_kernels: bool = False,
    inline_options: Any = None,
    recompute: bool = False,
    recompute_options: Any = None,
    clone_generated: bool = False,
    clone_options: Any = None,
    fuse_attention: bool = False,
    attention_options: Any = None,
) -> list[tvm.transform.Pass]:
    phases = _backend_phases(target)
    passes: list[tvm.transform.Pass] = []
    if fuse_attention and not is_gpu_target(target):
        from .transform import FuseAttention

        passes.append(FuseAttention(attention_options))
    if simplify:
        from .transform import SimplifyTransposes

        passes.append(SimplifyTransposes(simplify_options))
    if fold_scatter:
        from .transform import FoldZeroScatter

        passes.append(FoldZeroScatter(fold_scatter_options))
    if clone_generated:
        from .transform import CloneGeneratedTensors

        passes.append(CloneGeneratedTensors(clone_options))
    passes += phases.library_dispatch_passes(target)
    passes += phases.legalize_passes(target)
    if inline_kernels and not is_gpu_target(target):
        from .transform import InlineKernelIntermediates

        passes.append(InlineKernelIntermediates(inline_options))
    if schedule:
        from .transform import MemoryAwareSchedule, ScheduleOptions

        if schedule_options is None:
            # Score orders for the planner that follows: PlanMemory frees each tensor after its
            # last use; StaticPlanBlockMemory (the pass's default model) pools equal sizes. With
            # RecomputeCheapValues after it, the chosen order is compared once more, recomputed.
            schedule_options = ScheduleOptions(
                planner="plan" if plan else "static", recompute_after=recompute
            )
        passes.append(MemoryAwareSchedule(schedule_options))
    if recompute:
        from .transform import RecomputeCheapValues

        passes.append(RecomputeCheapValues(recompute_options))
    passes += phases.dataflow_lower_passes(target)
    if remat:
        from .transform import Rematerialize

        passes.append(Rematerialize(remat_options))
    if check_dims:
        from .transform import CheckDimRanges

        passes.append(CheckDimRanges(check_options))
    for finalize_pass in phases.finalize_passes(target):
        if plan and finalize_pass.info.name == "StaticPlanBlockMemory":
            from .transform import PlanMemory

            passes.append(PlanMemory(plan_options))
        else:
            passes.append(finalize_pass)
        if remat and finalize_pass.info.name == "KillAfterLastUse":
            # The remat runtime decides on the timeline of the planned IR (see rematerialize.py).
            from .transform import RematTimeline

            passes.append(RematTimeline())
    return passes


def get_pipeline(
    target: str | dict | tvm.target.Target = "llvm",
    *,
    schedule: bool = True,
    remat: bool = True,
    plan: bool = True,
    simplify: bool = True,
    fold_scatter: bool = True,
    inline_kernels: bool = True,
    recompute: bool = True,
    clone_generated: bool = True,
    fuse_attention: bool = True,
    schedule_options: Any = None,
    remat_options: Any = None,
    plan_options: Any = None,
    simplify_options: Any = None,
    fold_scatter_options: Any = None,
    inline_options: Any = None,
    recompute_options: Any = None,
    clone_options: Any = None,
    attention_options: Any = None,
    check_dims: bool = True,
    check_options: Any = None,
) -> tvm.transform.Pass:
    """The full Relax pipeline for ``target`` with the selected memory passes.

    Parameters
    ----------
    target
        ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}`` or a ``tvm.target.Target``.
    schedule, remat, plan
        Enable ``MemoryAwareSchedule``, ``Rematerialize`` and ``PlanMemory``.
    simplify, fold_scatter, clone_generated, fuse_attention, inline_kernels, recompute
        Enable ``SimplifyTransposes``, ``FoldZeroScatter``, ``CloneGeneratedTensors``,
        ``FuseAttention`` and ``InlineKernelIntermediates`` (both on CPU targets only) and
        ``RecomputeCheapValues``. With these, the three above and ``check_dims`` off, the
        result is TVM's default pipeline for the target.
    check_dims
        Enable ``CheckDimRanges``: a call whose dims lie outside the ranges the function
        declares (``tir_var_lower_bound`` / ``tir_var_upper_bound``) fails before any kernel
        runs, with an error naming the dim, its value and the range.
    schedule_options, remat_options, plan_options, simplify_options, fold_scatter_options,
    inline_options, recompute_options, clone_options, attention_options, check_options
        Option dataclasses handed to the passes (``None`` for their defaults).

    Returns
    -------
    tvm.transform.Pass
        A module pass usable as ``tvm.compile(mod, target, relax_pipeline=...)``.
    """
    tgt = as_target(target)
    passes = _pass_list(
        tgt,
        schedule,
        remat,
        plan,
        schedule_options,
        remat_options,
        plan_options,
        check_dims=check_dims,
        check_options=check_options,
        simplify=simplify,
        simplify_options=simplify_options,
        fold_scatter=fold_scatter,
        fold_scatter_options=fold_scatter_options,
        inline_kernels=inline_kernels,
        inline_options=inline_options,
        recompute=recompute,
        recompute_options=recompute_options,
        clone_generated=clone_generated,
        clone_options=clone_options,
        fuse_attention=fuse_attention,
        attention_options=attention_options,
    )

    @tvm.transform.module_pass(opt_level=0, name="blade_relax_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with tgt:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def stock_pipeline(
    target: str | dict | tvm.target.Target = "llvm",
    *,
    after_fusion: tuple[tvm.transform.Pass, ...] = (),
) -> tvm.transform.Pass:
    """TVM's default pipeline for ``target`` (with fusion): the baseline we compare against.

    ``after_fusion`` passes run after ``FuseTIR`` and before ``ToNonDataflow`` (where
    ``MemoryAwareSchedule`` would run), e.g. ``relax.transform.TopologicalSort(...)``.
    """
    tgt = as_target(target)
    passes = _pass_list(tgt, False, False, False, None, None, None)
    cut = next(i for i, p in enumerate(passes) if p.info.name == "RewriteDataflowReshape")
    passes[cut:cut] = list(after_fusion)

    @tvm.transform.module_pass(opt_level=0, name="stock_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with tgt:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def lower_to_memory_stage(
    mod: tvm.ir.IRModule,
    target: str | dict | tvm.target.Target = "llvm",
    **flags: Any,
) -> tvm.ir.IRModule:
    """Run the pipeline up to, not including, ``VMShapeLower``.

    The result is the IR the VM will execute, with its ``alloc_storage``/``alloc_tensor`` and
    kills still readable by :func:`blade_relax.analysis.memory_timeline` (``VMShapeLower``
    moves symbolic sizes into the VM's shape heap, where no analysis can read them).

    Parameters
    ----------
    mod
        The module to lower (left unchanged).
    target
        As for :func:`get_pipeline`.
    **flags
        ``schedule``, ``remat``, ``plan``, ``simplify``, ``fold_scatter``, ``inline_kernels``,
        ``recompute``, ``clone_generated``, ``fuse_attention``, ``check_dims`` and option
        keywords
        of :func:`get_pipeline`; all passes default to off, which gives the stock pipeline.
    """
    tgt = as_target(target)
    options = {
        "schedule": False,
        "remat": False,
        "plan": False,
        "simplify": False,
        "fold_scatter": False,
        "inline_kernels": False,
        "recompute": False,
        "clone_generated": False,
        "fuse_attention": False,
    }
    options.update(flags)
    passes = _pass_list(
        tgt,
        options.pop("schedule"),
        options.pop("remat"),
        options.pop("plan"),
        options.pop("schedule_options", None),
        options.pop("remat_options", None),
        options.pop("plan_options", None),
        check_dims=options.pop("check_dims", False),
        check_options=options.pop("check_options", None),
        simplify=options.pop("simplify"),
        simplify_options=options.pop("simplify_options", None),
        fold_scatter=options.pop("fold_scatter"),
        fold_scatter_options=options.pop("fold_scatter_options", None),
        inline_kernels=options.pop("inline_kernels"),
        inline_options=options.pop("inline_options", None),
        recompute=options.pop("recompute"),
        recompute_options=options.pop("recompute_options", None),
        clone_generated=options.pop("clone_generated"),
        clone_options=options.pop("clone_options", None),
        fuse_attention=options.pop("fuse_attention"),
        attention_options=options.pop("attention_options", None),
    )
    if options:
        raise TypeError(f"unknown pipeline options: {sorted(options)}")
    cut = next(i for i, p in enumerate(passes) if p.info.name == "VMShapeLower")
    with tgt:
        return tvm.transform.Sequential(passes[:cut])(mod)


def _registered_pipeline(**kwargs: Any) -> tvm.transform.Pass:
    return get_pipeline(**kwargs)


_register: Callable[..., Any] | None = getattr(relax.pipeline, "register_pipeline", None)
if "blade_relax" not in relax.pipeline.PIPELINE_MAP:
    if _register is not None:
        _register("blade_relax")(_registered_pipeline)
    else:  # pragma: no cover - older TVM without the decorator
        relax.pipeline.PIPELINE_MAP["blade_relax"] = _registered_pipeline

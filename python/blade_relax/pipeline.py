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
  embedding gradients) becomes a predicate ``FuseOps`` can fuse, or one kernel (a reduction; on
  CPU targets a loop over the updates), before ``LegalizeOps`` turns it into an opaque kernel
  with a zero buffer and a copy.
* ``CloneGeneratedTensors`` runs after it, still on high-level ops: a tensor computed from
  inputs alone (a causal mask, a one-hot) is built again before each later reader, so that
  ``FuseOps`` fuses it into every reader instead of keeping one copy live across the layers.
* ``DispatchGemm`` (on by default; ``dispatch_gemm=False`` keeps TVM's kernels, bit for bit)
  runs last in the memory stage, after ``KillAfterLastUse`` and ``RematTimeline``: the kernels
  that are a GEMM become calls of ATen's GEMMs with the same arguments (on a CPU, a GEMM fused
  with an elementwise tail too: the GEMM into the kernel's output, then the tail in place),
  once every memory decision was taken on TVM's kernels, so no peak rises (see
  dispatch_gemm.py). On CUDA targets ``MarkGemmKernels`` runs before dlight's
  ``ApplyDefaultSchedule`` in the ``legalize`` phase, so that the scheduled GEMM kernels are
  still known as GEMMs (cuBLAS through ATen).
* ``BindElementwiseKernels`` runs on GPU targets in every pipeline (the stock one too), right
  before dlight's ``ApplyDefaultSchedule``: it binds the in-place update kernels of the
  in-graph optimizers to GPU threads, which no dlight rule can (a block that reads and writes
  one buffer); it touches no other kernel.
* ``ExpandMathIntrinsics`` (on by default, for llvm targets naming their CPU) follows
  ``DispatchGemm``: it rewrites expressions inside kernels only (``exp`` and its kin
  become arithmetic LLVM vectorizes), so no memory decision and no pass's view of a kernel's
  blocks depends on it (see expand_math.py).
* ``InlineKernelIntermediates`` runs right after ``FuseTIR`` on CPU targets: it computes the
  elementwise chains inside fused kernels without scratch buffers (kernel workspaces), which
  dlight's schedules do on GPU targets. ``VectorizeSoftmax``, ``VectorizeScoreGrad`` and
  ``VectorizeColumnReductions`` follow it (CPU targets): TVM's softmax kernels, the score
  gradient of ``RewriteSoftmaxBackward`` and reductions over outer axes become loops the CPU
  vectorizes, before any memory pass reads a kernel.
* ``MemoryAwareSchedule`` runs after ``FuseOps``/``FuseTIR`` and before ``ToNonDataflow``: it
  reorders bindings of dataflow blocks, which exist only until ``ToNonDataflow``, and it should
  see the fused kernels whose buffers the VM will really allocate.
* ``RecomputeCheapValues`` runs right after ``MemoryAwareSchedule`` (or where it would run): it
  recomputes elementwise results before their late readers in the order that will run, and
  must insert its copies into dataflow blocks.
* ``FuseIntoSoleReader`` follows it on CPU targets: an elementwise kernel whose one reader is
  an elementwise kernel (a recomputed copy, or the forward's copy left with one reader) is
  computed inside that reader, which ``FuseOps`` could not decide before the copies existed.
* ``Rematerialize`` runs after ``CallTIRRewrite`` and before memory planning: it inserts impure
  ``evict``/``regenerate`` calls, which may not stand in a dataflow block, and the planner must
  see them so that evictable tensors never land in shared storage.
* ``PlanMemory`` takes the place of ``StaticPlanBlockMemory``.
* ``CheckDimRanges`` runs after ``Rematerialize`` and before memory planning: its assertions
  on the declared dim ranges are impure (no dataflow block, no purity checking) and become the
  first bindings of the body, ahead of every allocation and kernel (see check_dim_ranges.py).

How the pipeline is assembled (the way mlc-llm's ``compiler_pass/pipeline.py`` does it): one
explicit list of phases, :data:`PHASES`, run in order:

``graph``
    Our passes on high-level operators (``FuseAttention``, ``SimplifyTransposes``,
    ``FoldZeroScatter``, ``CloneGeneratedTensors``).
``library_dispatch``, ``legalize``, ``dataflow_lower``
    TVM's phases of the same names for the target, as TVM returns them (``legalize`` ends with
    ``FuseTIR``, and dlight's GPU schedules on CUDA).
``fused``
    Our passes on the fused dataflow graph (``InlineKernelIntermediates``,
    ``VectorizeSoftmax``, ``VectorizeScoreGrad``, ``VectorizeColumnReductions``,
    ``MemoryAwareSchedule``, ``RecomputeCheapValues``, ``FuseIntoSoleReader``).
``finalize``, ``vm_lower``
    TVM's ``finalize_passes`` for the target, written out here with the ``relax.transform``
    constructors and split where the memory stage ends (``vm_lower`` starts at
    ``VMShapeLower``); ``Rematerialize`` and ``CheckDimRanges`` come first, ``PlanMemory`` takes
    the place of ``StaticPlanBlockMemory``, ``RematTimeline`` follows ``KillAfterLastUse`` and
    ``DispatchGemm`` and ``ExpandMathIntrinsics`` follow them.
    :func:`check_tvm_phases` compares the pass names of TVM's list with this copy (once per
    target kind) and raises a ``RuntimeError`` naming the difference when TVM changes it, rather
    than silently dropping a pass placed by position.

The flags that select our passes are the fields of :class:`PipelineFlags`.

The pipeline is registered as the Relax pipeline ``"blade_relax"``, so
``tvm.compile(mod, target, relax_pipeline=relax.get_pipeline("blade_relax", target=target))``
works as well as ``relax_pipeline=blade_relax.get_pipeline(target)``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax


def host_target() -> tvm.target.Target:
    """The llvm target for this machine's CPU: TVM's ``"llvm"`` with the ``mcpu`` and ``mtriple``
    LLVM reports for the host.

    TVM's plain ``"llvm"`` compiles for a generic CPU of the architecture (on x86-64: SSE2, no
    fused multiply-add); naming the CPU lets LLVM use its vector units (AVX2, AVX-512), as
    PyTorch's kernels do by dispatching at run time. A module built for it runs on this CPU and
    its kind, not necessarily on older ones. ``as_target("host")`` is this target.
    """
    from tvm.target import codegen

    return tvm.target.Target(
        {
            "kind": "llvm",
            "mcpu": codegen.llvm_get_system_cpu(),
            "mtriple": codegen.llvm_get_system_triple(),
        }
    )


def as_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """Normalize a target given as a string, a JSON-like dict or a ``Target``; ``"host"`` is
    :func:`host_target` (llvm for this machine's CPU)."""
    if isinstance(target, tvm.target.Target):
        return target
    if target == "host":
        return host_target()
    try:
        return tvm.target.Target(target)
    except Exception as err:  # TVM raises its own error types; name the input instead.
        raise ValueError(f"not a valid TVM target: {target!r} ({err})") from err


def _flag(default: bool, pass_name: str, kind: str, options: str) -> Any:
    """A switch of :class:`PipelineFlags`: the pass it enables, its kind, its options field."""
    return dataclasses.field(
        default=default, metadata={"pass": pass_name, "kind": kind, "options": options}
    )


@dataclasses.dataclass(frozen=True)
class PipelineFlags:
    """Which blade_relax passes the pipeline runs, and the options each one is given.

    The one list of the pipeline's flags: :func:`get_pipeline`'s and
    :func:`lower_to_memory_stage`'s keywords are its fields, and the bench configurations and the
    differential variants enumerate its switches (:meth:`switches`, :meth:`passes`).

    The defaults are :func:`get_pipeline`'s (every pass on); :meth:`stock` has every pass off,
    which is TVM's default pipeline for the target. The switches are declared in the order
    their passes run within each kind: ``"memory"`` (``MemoryAwareSchedule``,
    ``Rematerialize``, ``PlanMemory``), ``"graph"`` (the passes that clean up imported graphs and
    fused kernels) and ``"check"`` (``CheckDimRanges``). ``*_options`` are the option dataclasses
    handed to the passes (``None`` for their defaults).
    """

    # The memory passes.
    schedule: bool = _flag(True, "MemoryAwareSchedule", "memory", "schedule_options")
    remat: bool = _flag(True, "Rematerialize", "memory", "remat_options")
    plan: bool = _flag(True, "PlanMemory", "memory", "plan_options")
    # The graph passes (FuseAttention and InlineKernelIntermediates on CPU targets only).
    fuse_attention: bool = _flag(True, "FuseAttention", "graph", "attention_options")
    fold_broadcast: bool = _flag(True, "FoldBroadcastMatmul", "graph", "fold_broadcast_options")
    # Opt-in: equal to rounding, and the recomputation of attention probabilities, decided
    # before memory planning, does not see that the new kernel writes in place.
    softmax_backward: bool = _flag(
        False, "RewriteSoftmaxBackward", "graph", "softmax_backward_options"
    )
    simplify: bool = _flag(True, "SimplifyTransposes", "graph", "simplify_options")
    fold_scatter: bool = _flag(True, "FoldZeroScatter", "graph", "fold_scatter_options")
    clone_generated: bool = _flag(True, "CloneGeneratedTensors", "graph", "clone_options")
    # ATen's GEMMs sum in another order than TVM's kernels: equal to rounding, not bit for bit.
    dispatch_gemm: bool = _flag(True, "DispatchGemm", "graph", "gemm_options")
    inline_kernels: bool = _flag(True, "InlineKernelIntermediates", "graph", "inline_options")
    vectorize_softmax: bool = _flag(True, "VectorizeSoftmax", "graph", "softmax_options")
    vectorize_score_grad: bool = _flag(True, "VectorizeScoreGrad", "graph", "score_grad_options")
    vectorize_reductions: bool = _flag(
        True, "VectorizeColumnReductions", "graph", "reduction_options"
    )
    # The expanded exp/tanh/sigmoid agree with libm's to rounding, not bit for bit.
    expand_math: bool = _flag(True, "ExpandMathIntrinsics", "graph", "math_options")
    recompute: bool = _flag(True, "RecomputeCheapValues", "graph", "recompute_options")
    fuse_readers: bool = _flag(True, "FuseIntoSoleReader", "graph", "fuse_reader_options")
    # The dim-range check.
    check_dims: bool = _flag(True, "CheckDimRanges", "check", "check_options")
    # The passes' options.
    schedule_options: Any = None
    remat_options: Any = None
    plan_options: Any = None
    attention_options: Any = None
    fold_broadcast_options: Any = None
    softmax_backward_options: Any = None
    simplify_options: Any = None
    fold_scatter_options: Any = None
    clone_options: Any = None
    gemm_options: Any = None
    inline_options: Any = None
    softmax_options: Any = None
    score_grad_options: Any = None
    reduction_options: Any = None
    math_options: Any = None
    recompute_options: Any = None
    fuse_reader_options: Any = None
    check_options: Any = None

    @classmethod
    def switches(cls, kind: str | None = None) -> tuple[str, ...]:
        """The names of the switches (of one ``kind`` when given), in declaration order."""
        return tuple(cls.passes(kind))

    @classmethod
    def passes(cls, kind: str | None = None) -> dict[str, str]:
        """Switch name -> the name of the pass it enables (of one ``kind`` when given)."""
        if kind not in (None, "memory", "graph", "check"):
            raise ValueError(f"switch kinds are 'memory', 'graph' and 'check', not {kind!r}")
        return {
            f.name: f.metadata["pass"]
            for f in dataclasses.fields(cls)
            if "pass" in f.metadata and kind in (None, f.metadata["kind"])
        }

    @classmethod
    def options_field(cls, switch: str) -> str:
        """The name of the field holding the options of ``switch``'s pass."""
        for f in dataclasses.fields(cls):
            if f.name == switch and "options" in f.metadata:
                return f.metadata["options"]
        raise ValueError(f"not a pipeline switch: {switch!r}")

    @classmethod
    def defaults(cls, kind: str | None = None) -> dict[str, bool]:
        """Switch name -> whether :func:`get_pipeline` runs its pass by default (of one
        ``kind`` when given); an opt-in pass's switch is ``False``."""
        default = cls()
        return {name: getattr(default, name) for name in cls.switches(kind)}

    @classmethod
    def stock(cls, **changes: Any) -> PipelineFlags:
        """Every pass off (TVM's default pipeline), then ``changes``."""
        return cls.of({**dict.fromkeys(cls.switches(), False), **changes})

    @classmethod
    def of(cls, values: dict[str, Any]) -> PipelineFlags:
        """``PipelineFlags(**values)``, naming unknown keys in a ``TypeError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown pipeline options: {unknown}")
        return cls(**values)


# The phases of the pipeline, in the order they run (see the module docstring). TVM's phases
# keep TVM's names; ``finalize`` and ``vm_lower`` together are TVM's ``finalize_passes``, split
# where the memory stage ends (``VMShapeLower``).
PHASES: tuple[str, ...] = (
    "graph",
    "library_dispatch",
    "legalize",
    "fused",
    "dataflow_lower",
    "finalize",
    "vm_lower",
)


def _backend_phases(target: tvm.target.Target) -> Any:
    """TVM's pipeline module for ``target``, whose phases blade_relax builds on."""
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as phases
    elif target.kind.name == "llvm":
        from tvm.relax.backend.cpu_generic import pipeline as phases
    else:
        raise ValueError(f"blade_relax supports llvm and cuda targets, not {target.kind.name!r}")
    return phases


def _ours(name: str, *args: Any) -> tvm.transform.Pass:
    """blade_relax's pass ``name`` (imported when first asked for: the stock pipeline has none)."""
    from . import transform

    return getattr(transform, name)(*args)


def finalize_phases(
    target: tvm.target.Target, flags: PipelineFlags, plan_memory: bool = True
) -> tuple[list[tvm.transform.Pass], list[tvm.transform.Pass]]:
    """TVM's ``finalize_passes(target)`` written out, with our passes in place.

    Returned as (``finalize``, ``vm_lower``): the passes up to the memory stage, and those from
    ``VMShapeLower`` on. With every flag off this is TVM's list for the target kind exactly
    (``tvm.relax.backend.cpu_generic.pipeline`` / ``tvm.relax.backend.cuda.pipeline``), which
    :func:`check_tvm_phases` verifies. ``plan_memory=False`` leaves memory planning out.
    """
    cuda = target.kind.name == "cuda"
    finalize: list[tvm.transform.Pass] = []
    if flags.remat:
        finalize.append(_ours("Rematerialize", flags.remat_options))
    if flags.check_dims:
        finalize.append(_ours("CheckDimRanges", flags.check_options))
    if plan_memory:
        if flags.plan:
            finalize.append(_ours("PlanMemory", flags.plan_options))
        else:
            finalize.append(relax.transform.StaticPlanBlockMemory())
    if cuda:
        finalize.append(relax.transform.RewriteCUDAGraph())
    finalize.append(relax.transform.LowerAllocTensor())
    finalize.append(relax.transform.KillAfterLastUse())
    if flags.remat:
        # The remat runtime decides on the timeline of the planned IR (see rematerialize.py).
        finalize.append(_ours("RematTimeline"))
    if flags.dispatch_gemm:
        # Last of the memory stage: every memory decision was taken on TVM's kernels.
        finalize.append(_ours("DispatchGemm", flags.gemm_options))
    if flags.expand_math and not cuda:
        finalize.append(_ours("ExpandMathIntrinsics", flags.math_options))
    finalize.append(relax.transform.LowerRuntimeBuiltin())
    finalize.append(relax.transform.ComputePrimValue())
    vm_lower = [relax.transform.VMShapeLower(), relax.transform.AttachGlobalSymbol()]
    return finalize, vm_lower


def check_tvm_phases(target: str | dict | tvm.target.Target = "llvm") -> None:
    """Check that TVM's finalize phase for ``target`` is the one blade_relax writes out.

    blade_relax places ``PlanMemory`` and ``RematTimeline`` by position in its own copy of
    TVM's ``finalize_passes``; a pass renamed, added, removed or moved in TVM would otherwise
    be silently dropped or misplaced. The pipeline functions run this check once per target
    kind (again whenever TVM's phase function is another object).

    Raises
    ------
    RuntimeError
        Naming the difference between TVM's pass names and blade_relax's.
    """
    tgt = as_target(target)
    phases = _backend_phases(tgt)
    theirs = [p.info.name for p in phases.finalize_passes(tgt)]
    finalize, vm_lower = finalize_phases(tgt, PipelineFlags.stock())
    ours = [p.info.name for p in finalize + vm_lower]
    if theirs == ours:
        return
    changes = []
    matcher = difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "replace":
            changes.append(f"{', '.join(ours[i1:i2])} became {', '.join(theirs[j1:j2])}")
        elif tag == "delete":
            changes.append(f"{', '.join(ours[i1:i2])} missing")
        elif tag == "insert":
            changes.append(f"{', '.join(theirs[j1:j2])} added")
    raise RuntimeError(
        f"TVM's finalize phase for {tgt.kind.name} targets ({phases.__name__}.finalize_passes) "
        f"is no longer the one blade_relax mirrors to place its passes: "
        f"{'; '.join(changes)}. TVM: {theirs}; blade_relax: {ours}. "
        "Update finalize_phases in blade_relax/pipeline.py for this TVM version."
    )


# Target kind -> the TVM phase function last checked for it.
_CHECKED: dict[str, Any] = {}


def _checked_backend_phases(target: tvm.target.Target) -> Any:
    phases = _backend_phases(target)
    if _CHECKED.get(target.kind.name) is not phases.finalize_passes:
        check_tvm_phases(target)
        _CHECKED[target.kind.name] = phases.finalize_passes
    return phases


def derived_schedule_options(flags: PipelineFlags, cpu: bool = True) -> Any:
    """The options ``MemoryAwareSchedule`` runs with in the pipeline of ``flags`` (for a CPU
    target with ``cpu``): the user's (``flags.schedule_options``, else the defaults) with what
    depends on the passes after it derived here, in one place, so that orders are scored on
    the program that will run.

    * ``planner``: the planner that follows (PlanMemory frees each tensor after its last use;
      StaticPlanBlockMemory, without it, pools equal sizes).
    * ``recompute_after``: compare the chosen order once more after ``RecomputeCheapValues``
      only when that pass runs (on by default; a user's ``False`` is kept).
    * ``recompute_options``: the options that pass runs with (``flags.recompute_options``).
    * ``fuse_readers`` / ``fuse_reader_options``: whether ``FuseIntoSoleReader`` follows
      (CPU targets, ``flags.fuse_readers``) and its options, when orders are compared after
      recomputation.
    """
    from .transform import ScheduleOptions

    given = flags.schedule_options
    return dataclasses.replace(
        given if given is not None else ScheduleOptions(),
        planner="plan" if flags.plan else "static",
        recompute_after=flags.recompute and (given is None or given.recompute_after),
        recompute_options=flags.recompute_options,
        fuse_readers=flags.fuse_readers and cpu,
        fuse_reader_options=flags.fuse_reader_options,
    )


def _phases(
    target: tvm.target.Target,
    flags: PipelineFlags,
    *,
    after_fusion: tuple[tvm.transform.Pass, ...] = (),
    plan_memory: bool = True,
) -> dict[str, list[tvm.transform.Pass]]:
    """The pipeline's passes for ``target``, by phase (every name of :data:`PHASES`)."""
    phases = _checked_backend_phases(target)
    cpu = target.kind.name == "llvm"
    graph: list[tvm.transform.Pass] = []
    if flags.fuse_attention and cpu:
        graph.append(_ours("FuseAttention", flags.attention_options))
    if flags.fold_broadcast:
        graph.append(_ours("FoldBroadcastMatmul", flags.fold_broadcast_options))
    if flags.softmax_backward:
        graph.append(_ours("RewriteSoftmaxBackward", flags.softmax_backward_options))
    if flags.simplify:
        graph.append(_ours("SimplifyTransposes", flags.simplify_options))
    if flags.fold_scatter:
        scatter_options = flags.fold_scatter_options
        if scatter_options is None and cpu:
            from .transform.fold_zero_scatter import ZeroScatterOptions

            # On a CPU, an accumulation is a loop over the updates, not over the output.
            scatter_options = ZeroScatterOptions(serial_accumulate=True)
        graph.append(_ours("FoldZeroScatter", scatter_options))
    if flags.clone_generated:
        graph.append(_ours("CloneGeneratedTensors", flags.clone_options))
    fused: list[tvm.transform.Pass] = []
    if flags.inline_kernels and cpu:
        fused.append(_ours("InlineKernelIntermediates", flags.inline_options))
    if flags.vectorize_softmax and cpu:
        fused.append(_ours("VectorizeSoftmax", flags.softmax_options))
    if flags.vectorize_score_grad and cpu:
        fused.append(_ours("VectorizeScoreGrad", flags.score_grad_options))
    if flags.vectorize_reductions and cpu:
        fused.append(_ours("VectorizeColumnReductions", flags.reduction_options))
    if flags.schedule:
        fused.append(_ours("MemoryAwareSchedule", derived_schedule_options(flags, cpu)))
    if flags.recompute:
        fused.append(_ours("RecomputeCheapValues", flags.recompute_options))
    if flags.fuse_readers and cpu:
        fused.append(_ours("FuseIntoSoleReader", flags.fuse_reader_options))
    fused += after_fusion
    finalize, vm_lower = finalize_phases(target, flags, plan_memory)
    legalize = list(phases.legalize_passes(target))
    if not cpu:
        # Every pipeline, the stock one too: no GPU schedule of TVM binds the optimizers'
        # in-place update kernels (see bind_elementwise_kernels.py); other kernels are untouched.
        names = [p.info.name for p in legalize]
        at = names.index("ApplyDefaultSchedule") if "ApplyDefaultSchedule" in names else len(names)
        legalize.insert(at, _ours("BindElementwiseKernels"))
    if flags.dispatch_gemm and not cpu:
        # Before dlight schedules the kernels, while a GEMM still reads as one (see
        # mark_gemm_kernels.py); at the end when the phase has no dlight.
        names = [p.info.name for p in legalize]
        at = names.index("ApplyDefaultSchedule") if "ApplyDefaultSchedule" in names else len(names)
        legalize.insert(at, _ours("MarkGemmKernels"))
    return {
        "graph": graph,
        "library_dispatch": list(phases.library_dispatch_passes(target)),
        "legalize": legalize,
        "fused": fused,
        "dataflow_lower": list(phases.dataflow_lower_passes(target)),
        "finalize": finalize,
        "vm_lower": vm_lower,
    }


def _as_pipeline(
    name: str, target: tvm.target.Target, phases: dict[str, list[tvm.transform.Pass]]
) -> tvm.transform.Pass:
    """One module pass ``name`` that runs the passes of ``phases`` (:func:`_phases`) in order,
    under ``target``."""
    passes = [p for phase in phases.values() for p in phase]

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def pipeline_phases(
    target: str | dict | tvm.target.Target = "llvm", **flags: Any
) -> dict[str, list[tvm.transform.Pass]]:
    """The passes ``get_pipeline(target, **flags)`` runs, by phase, in order.

    The keys are :data:`PHASES`; a phase none of whose passes is selected is an empty list.
    ``flags`` are the keywords of :func:`get_pipeline`, with its defaults (every pass on).
    """
    return _phases(as_target(target), PipelineFlags.of(flags))


def get_pipeline(
    target: str | dict | tvm.target.Target = "llvm",
    *,
    schedule: bool = True,
    remat: bool = True,
    plan: bool = True,
    fold_broadcast: bool = True,
    softmax_backward: bool = False,
    simplify: bool = True,
    fold_scatter: bool = True,
    inline_kernels: bool = True,
    vectorize_softmax: bool = True,
    vectorize_score_grad: bool = True,
    vectorize_reductions: bool = True,
    recompute: bool = True,
    fuse_readers: bool = True,
    clone_generated: bool = True,
    fuse_attention: bool = True,
    dispatch_gemm: bool = True,
    expand_math: bool = True,
    schedule_options: Any = None,
    remat_options: Any = None,
    plan_options: Any = None,
    fold_broadcast_options: Any = None,
    softmax_backward_options: Any = None,
    simplify_options: Any = None,
    fold_scatter_options: Any = None,
    inline_options: Any = None,
    softmax_options: Any = None,
    score_grad_options: Any = None,
    reduction_options: Any = None,
    recompute_options: Any = None,
    fuse_reader_options: Any = None,
    clone_options: Any = None,
    attention_options: Any = None,
    gemm_options: Any = None,
    math_options: Any = None,
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
        ``RecomputeCheapValues``. With these, the three above, ``fuse_readers`` and
        ``check_dims`` off, the result is TVM's default pipeline for the target.
    fold_broadcast
        Enable ``FoldBroadcastMatmul``: a key or value shared by several query heads is read
        once, the heads as rows of one GEMM, without the broadcast copy; bit for bit.
    softmax_backward
        Enable ``RewriteSoftmaxBackward`` (opt-in): attention's score gradient is one kernel
        written over ``P``, one attention matrix live in the softmax's backward instead of
        two; equal to rounding. Off by default (its module docstring says why).
    fuse_readers
        Enable ``FuseIntoSoleReader`` (CPU targets): after ``RecomputeCheapValues``, an
        elementwise kernel whose one reader is elementwise, reading values live there anyway,
        is computed inside that reader (no buffer of its own); bit for bit.
    dispatch_gemm
        Enable ``DispatchGemm``: matmuls run on ATen's GEMMs (PyTorch's BLAS on a CPU, cuBLAS
        on CUDA targets, with ``MarkGemmKernels`` before dlight), writing into the VM's
        tensors; without PyTorch installed the pass logs one line and TVM's kernels compute
        them. On by default (TVM's CPU GEMMs with a symbolic dimension are naive loop nests);
        results agree with TVM's kernels to rounding, not bit for bit (``dispatch_gemm=False``
        for that). On CUDA targets only GEMMs without an elementwise tail are dispatched.
    vectorize_softmax, vectorize_score_grad, vectorize_reductions
        Enable ``VectorizeSoftmax``, ``VectorizeScoreGrad`` and ``VectorizeColumnReductions``
        (CPU targets), each bit for bit: TVM's softmax and log-softmax kernels (each ``exp``
        once, the maximum over 16 lanes), the score gradient of ``softmax_backward`` (tiles of
        16 columns over a transposed copy of ``V``'s tile) and reductions over an outer axis
        (``collapse_sum`` of a bias gradient: output rows inner) become loops a CPU vectorizes.
    expand_math
        Enable ``ExpandMathIntrinsics`` (llvm targets that name their CPU, such as
        :func:`host_target`): float32 ``exp``, ``tanh``, ``sigmoid`` and ``pow(x, 2 | 3)`` in
        the kernels become arithmetic LLVM vectorizes instead of libm calls one element at a
        time. On by default; results agree with libm's to rounding (one unit in the last
        place per function). On a target naming no CPU (``"llvm"``) it changes nothing.
    check_dims
        Enable ``CheckDimRanges``: a call whose dims lie outside the ranges the function
        declares (``tir_var_lower_bound`` / ``tir_var_upper_bound``) fails before any kernel
        runs, with an error naming the dim, its value and the range.
    schedule_options, remat_options, plan_options, and the other ``*_options``
        Option dataclasses handed to the passes (``None`` for their defaults). The keywords
        are the fields of :class:`PipelineFlags`, with its defaults.

    Returns
    -------
    tvm.transform.Pass
        A module pass usable as ``tvm.compile(mod, target, relax_pipeline=...)``.
    """
    values = dict(locals())  # the keywords: nothing else is bound yet
    tgt = as_target(values.pop("target"))
    return _as_pipeline("blade_relax_pipeline", tgt, _phases(tgt, PipelineFlags.of(values)))


def pipeline_keeping_memory_stage(
    target: str | dict | tvm.target.Target, kept: list[tvm.ir.IRModule], **flags: Any
) -> tvm.transform.Pass:
    """:func:`get_pipeline` with ``flags`` that also appends to ``kept`` the module as it
    enters the ``vm_lower`` phase: what :func:`lower_to_memory_stage` gives with the same
    flags, read by :func:`~blade_relax.analysis.memory_timeline`, from the compilation itself
    (lowering a large step a second time to predict its peaks takes minutes)."""
    tgt = as_target(target)
    phases = _phases(tgt, PipelineFlags.of(flags))

    @tvm.transform.module_pass(opt_level=0, name="KeepMemoryStage")
    def keep(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        kept.append(mod)
        return mod

    vm_lower = phases.pop("vm_lower")
    return _as_pipeline(
        "blade_relax_pipeline", tgt, {**phases, "memory_stage": [keep], "vm_lower": vm_lower}
    )


def stock_pipeline(
    target: str | dict | tvm.target.Target = "llvm",
    *,
    after_fusion: tuple[tvm.transform.Pass, ...] = (),
    plan_memory: bool = True,
) -> tvm.transform.Pass:
    """TVM's default pipeline for ``target`` (with fusion): the baseline we compare against.

    ``after_fusion`` passes run after ``FuseTIR`` and before ``ToNonDataflow`` (at the end of
    the ``fused`` phase, where ``MemoryAwareSchedule`` would run), e.g.
    ``relax.transform.TopologicalSort(...)``. ``plan_memory=False`` leaves
    ``StaticPlanBlockMemory`` out: every tensor gets a storage of its own (a reference for the
    numerics of memory planners).
    """
    tgt = as_target(target)
    phases = _phases(
        tgt, PipelineFlags.stock(), after_fusion=tuple(after_fusion), plan_memory=plan_memory
    )
    return _as_pipeline("stock_pipeline", tgt, phases)


def lower_to_memory_stage(
    mod: tvm.ir.IRModule,
    target: str | dict | tvm.target.Target = "llvm",
    *,
    start_at: str = "graph",
    stop_before: str = "vm_lower",
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
    start_at, stop_before
        Run only the phases from ``start_at`` up to, not including, ``stop_before`` (names of
        :data:`PHASES`). ``stop_before="dataflow_lower"`` gives the fused dataflow graph
        (after legalization, fusion and the ``fused`` phase's passes); ``start_at=
        "dataflow_lower"`` lowers such a graph; ``start_at="finalize"`` plans the memory of a
        lowered function (``Rematerialize`` and ``CheckDimRanges`` included, when on).
    **flags
        The keywords of :func:`get_pipeline` (the fields of :class:`PipelineFlags`); all
        passes default to off, which gives the stock pipeline.
    """
    for name in (start_at, stop_before):
        if name not in PHASES:
            raise ValueError(f"unknown pipeline phase {name!r}; the phases are {PHASES}")
    first, end = PHASES.index(start_at), PHASES.index(stop_before)
    if first > end:
        raise ValueError(f"phase {start_at!r} runs after {stop_before!r}")
    tgt = as_target(target)
    phases = _phases(tgt, PipelineFlags.stock(**flags))
    passes = [p for name in PHASES[first:end] for p in phases[name]]
    with tgt:
        return tvm.transform.Sequential(passes)(mod)


def _registered_pipeline(**kwargs: Any) -> tvm.transform.Pass:
    return get_pipeline(**kwargs)


_register: Callable[..., Any] | None = getattr(relax.pipeline, "register_pipeline", None)
if "blade_relax" not in relax.pipeline.PIPELINE_MAP:
    if _register is not None:
        _register("blade_relax")(_registered_pipeline)
    else:  # pragma: no cover - older TVM without the decorator
        relax.pipeline.PIPELINE_MAP["blade_relax"] = _registered_pipeline

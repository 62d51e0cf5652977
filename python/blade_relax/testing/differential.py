"""Differential checking of the blade_relax pipelines against the stock TVM pipeline.

For one program and several admissible shapes, every pipeline variant (``schedule``, ``remat``
at several memory budgets, ``plan``, and all passes together) must

* compile to IR that is well formed before and after every pass of the pipeline (the check of
  ``tvm.relax.ir.instrument.WellFormedInstrument``, from an instrument in the ``PassContext``);
* give outputs identical, bit for bit, to those of the stock pipeline (the kernels are the same:
  every memory pass runs after fusion, so any difference is a bug, never rounding);
* allocate exactly the bytes the symbolic timeline predicts for the IR it runs
  (``memory_timeline`` of the module just before ``VMShapeLower``, evaluated at the dims,
  against ``memory_stats()["peak_bytes"]`` minus the live bytes before the call), kernel
  workspaces included on both sides (the call is measured with the executable's workspace
  table, :attr:`CompiledVariant.workspaces`);
* under a memory budget, peak exactly where the rematerialization runtime's decision said
  (where its metadata claims an exact timeline) and within the budget wherever the decision
  called it reachable;
* release every byte it allocated once its VM is dropped (a VM keeps the registers of its last
  call until the next one).

Variants whose pass is still a placeholder (its constructor raises ``NotImplementedError``) are
left out by :func:`available_variants`, so the harness picks up each pass as it lands.

Known limits of the references, reported as *known*, never as mismatches:

* ``StaticPlanBlockMemory`` shares storage between the two branches of an ``If`` and leaves one
  branch using a storage it never allocated (apache/tvm#17348; the VM then crashes). Where the
  stock pipeline is ill formed after that pass, the reference outputs come from the stock
  pipeline with that pass disabled, and variants that still run it are expected to fail the
  same way.
* The timeline counts an ``If`` or a call of another Relax function as one fresh allocation of
  the result (it does not look inside), so the peak is compared only for functions without
  them (counted as ``peak_skipped_control_flow``).

Usage::

    from blade_relax.testing import program_from_seed
    from blade_relax.testing.differential import check_program

    report = check_program(program_from_seed(27), shapes=3)
    assert report.ok, report.describe()
"""

from __future__ import annotations

import functools
import random
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .. import runtime
from ..analysis import memory_timeline, workspace_table
from ..contract import REMAT_META_ATTR, RematMetadata
from ..pipeline import PipelineFlags, get_pipeline
from ..transform import version_for
from .program_gen import GeneratedProgram

__all__ = [
    "ALL_VARIANTS",
    "STOCK",
    "Builds",
    "CompiledVariant",
    "Finding",
    "ProgramReport",
    "Variant",
    "available_variants",
    "check_program",
    "compile_checked",
    "measure_call",
    "outputs_equal",
    "predicted_peak",
]

#: Upstream issue of the stock planner's handling of ``If`` (see the module docstring).
KNOWN_IF_PLANNING_BUG = "apache/tvm#17348"


@dataclass(frozen=True)
class Variant:
    """One pipeline: which blade_relax passes are on.

    ``pipeline``, when given, builds the pipeline from the target instead of
    :func:`blade_relax.get_pipeline` (to check a pass of one's own, or the harness itself).
    """

    name: str
    schedule: bool = False
    remat: bool = False
    plan: bool = False
    fold_broadcast: bool = False
    softmax_backward: bool = False
    simplify: bool = False
    fold_scatter: bool = False
    inline_kernels: bool = False
    vectorize_softmax: bool = False
    vectorize_score_grad: bool = False
    vectorize_reductions: bool = False
    recompute: bool = False
    fuse_readers: bool = False
    clone_generated: bool = False
    fuse_attention: bool = False
    dispatch_gemm: bool = False
    expand_math: bool = False
    pipeline: Callable[[str], tvm.transform.Pass] | None = field(default=None, compare=False)

    @property
    def flags(self) -> dict[str, bool]:
        """The variant's switches of the memory and graph passes, as ``get_pipeline`` keywords
        (``check_dims`` is left to ``get_pipeline``'s default: every variant checks dims)."""
        return {name: getattr(self, name) for name in _VARIANT_SWITCHES}

    @property
    def replaces_stock_planner(self) -> bool:
        return self.plan


# The switches a Variant has a field for: PipelineFlags' memory and graph passes.
_VARIANT_SWITCHES = PipelineFlags.switches("memory") + PipelineFlags.switches("graph")

# TVM's default pipeline: no blade_relax pass, not even the dim-range check.
STOCK = Variant(
    "stock",
    pipeline=lambda target: get_pipeline(target, **dict.fromkeys(PipelineFlags.switches(), False)),
)
ALL_VARIANTS: tuple[Variant, ...] = (
    Variant("schedule", schedule=True),
    Variant("remat", remat=True),
    Variant("plan", plan=True),
    Variant("fold-broadcast", fold_broadcast=True, simplify=True),
    Variant("softmax-backward", fold_broadcast=True, softmax_backward=True),
    Variant("simplify", simplify=True),
    Variant("fold-scatter", fold_scatter=True),
    Variant("inline-kernels", inline_kernels=True),
    Variant("vectorize-softmax", inline_kernels=True, vectorize_softmax=True),
    Variant(
        "vectorize-score-grad",
        fold_broadcast=True,
        softmax_backward=True,
        inline_kernels=True,
        vectorize_score_grad=True,
    ),
    Variant("vectorize-reductions", inline_kernels=True, vectorize_reductions=True),
    Variant("recompute", schedule=True, recompute=True),
    Variant("fuse-readers", schedule=True, recompute=True, fuse_readers=True),
    Variant("clone-generated", clone_generated=True),
    Variant("fuse-attention", fuse_attention=True, inline_kernels=True),
    Variant(
        "all",
        schedule=True,
        remat=True,
        plan=True,
        fold_broadcast=True,
        simplify=True,
        fold_scatter=True,
        inline_kernels=True,
        vectorize_softmax=True,
        vectorize_score_grad=True,
        vectorize_reductions=True,
        recompute=True,
        fuse_readers=True,
        clone_generated=True,
        fuse_attention=True,
    ),
)


def available_variants(target: str = "llvm") -> tuple[Variant, ...]:
    """The variants whose passes can be built now (placeholders raise NotImplementedError)."""
    out = []
    for variant in ALL_VARIANTS:
        try:
            get_pipeline(target, **variant.flags)
        except NotImplementedError:
            continue
        out.append(variant)
    return tuple(out)


@dataclass(frozen=True)
class Finding:
    """One failed check.

    Attributes
    ----------
    kind
        ``"generator"``, ``"ill_formed"``, ``"compile_error"``, ``"run_error"``, ``"outputs"``,
        ``"peak"``, ``"budget"``, ``"decision"`` or ``"leak"``.
    variant
        The variant's name (``"stock"`` for the reference).
    detail
        What was expected and what came.
    dims, budget
        The shape and budget of the failing run, when it is a run.
    known
        An upstream issue that explains it; such findings are not mismatches.
    """

    kind: str
    variant: str
    detail: str
    dims: dict[str, int] | None = None
    budget: int | None = None
    known: str | None = None

    def __str__(self) -> str:
        where = f" dims={self.dims}" if self.dims is not None else ""
        where += f" budget={self.budget}" if self.budget is not None else ""
        known = f" [known: {self.known}]" if self.known else ""
        return f"{self.kind} in {self.variant}{where}: {self.detail}{known}"


@dataclass
class ProgramReport:
    """Everything checked on one program."""

    program: GeneratedProgram
    variants: list[str] = field(default_factory=list)
    shapes: list[dict[str, int]] = field(default_factory=list)
    runs: int = 0
    checks: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)

    @property
    def mismatches(self) -> list[Finding]:
        return [f for f in self.findings if f.known is None]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def describe(self) -> str:
        """A failure report: the findings, then the program as TVMScript."""
        lines = [repr(self.program), *[f"  {f}" for f in self.findings], self.program.script()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- compiling
class IllFormedIR(Exception):
    """The IR was not well formed around one pass of the pipeline."""

    def __init__(self, pass_name: str, when: str, detail: str) -> None:
        super().__init__(f"IR not well formed {when} {pass_name}: {detail}")
        self.pass_name = pass_name
        self.when = when
        self.detail = detail


# Passes TVM's WellFormedInstrument skips too: they repair what they are given.
_WF_SKIPPED = frozenset({"Normalize", "NormalizeGlobalVar", "ResolveGlobals"})
_PIPELINE_PASS = "blade_relax_pipeline"


@tvm.instrument.pass_instrument
class _PipelineChecker:
    """Checks well-formedness around every pass of the Relax pipeline; keeps the memory stage.

    The check is the one of ``tvm.relax.ir.instrument.WellFormedInstrument``
    (``relax.analysis.well_formed``), applied to the passes the pipeline runs on the module:
    passes nested inside one of them (``FuseTIR``'s helpers, a planner that runs
    ``StaticPlanBlockMemory`` on a module of selected functions) see private intermediate
    modules, which need not be complete.
    """

    def __init__(self, well_formed: bool) -> None:
        self.well_formed = well_formed
        self.depth = 0
        self.pipeline_depth: int | None = None
        self.memory_stage: tvm.IRModule | None = None
        # The FFI re-raises an instrument's exception as its own error type: keep the original.
        self.failure: IllFormedIR | None = None

    def _at_pipeline_level(self) -> bool:
        # blade_relax_pipeline -> Sequential -> the pipeline's passes
        return self.pipeline_depth is not None and self.depth == self.pipeline_depth + 2

    def _check(self, mod: tvm.IRModule, name: str, when: str) -> None:
        if not self.well_formed or name in _WF_SKIPPED or not self._at_pipeline_level():
            return
        try:
            relax.analysis.well_formed(mod)
        except Exception as err:
            self.failure = IllFormedIR(name, when, str(err).strip()[-1500:])
            raise self.failure from None

    def run_before_pass(self, mod: tvm.IRModule, info: Any) -> None:
        self.depth += 1
        if info.name == _PIPELINE_PASS and self.pipeline_depth is None:
            self.pipeline_depth = self.depth
        if info.name == "VMShapeLower" and self._at_pipeline_level():
            self.memory_stage = mod
        self._check(mod, info.name, "before")

    def run_after_pass(self, mod: tvm.IRModule, info: Any) -> None:
        try:
            self._check(mod, info.name, "after")
        finally:
            self.depth -= 1


@dataclass
class CompiledVariant:
    """An executable and the IR it runs (the module just before ``VMShapeLower``)."""

    variant: Variant
    executable: Any
    memory_stage: tvm.IRModule
    target: str = "llvm"

    @functools.cached_property
    def workspaces(self) -> dict[str, Callable[[Sequence[Any]], int]]:
        """The executable's kernel workspace table (what :func:`measure_call` counts)."""
        return workspace_table(self.memory_stage, self.target)

    def vm(self, device: tvm.runtime.Device | None = None) -> relax.VirtualMachine:
        """A VM of the executable; :func:`measure_call` counts its kernels' workspaces."""
        vm = relax.VirtualMachine(self.executable, device or tvm.cpu())
        _VM_WORKSPACES[vm] = self.workspaces
        return vm


class Builds:
    """Executables by the module the Relax pipeline produced, shared between variants.

    Many variants change nothing in a small program (no scatter to fold, no softmax to
    vectorize): their pipelines produce the stock module, and the build after the Relax
    pipeline (TIR lowering, LLVM's code generation, and its JIT when a VM first loads the
    kernels) is most of such a compile. The build of a module is deterministic, so a module
    structurally equal to one built before (function names included) runs that executable;
    the checks still run on each variant's VM.
    """

    def __init__(self) -> None:
        self._by_hash: dict[int, list[tuple[tvm.IRModule, Any]]] = {}

    def build(self, mod: tvm.IRModule, target: str) -> Any:
        """The executable of ``mod``: the one built from a structurally equal module before,
        else ``tvm.compile(mod, target, relax_pipeline=None)``, kept for the next."""
        known = self._by_hash.setdefault(tvm_ffi.structural_hash(mod), [])
        for other, exe in known:
            if tvm_ffi.structural_equal(other, mod):
                return exe
        exe = tvm.compile(mod, target, relax_pipeline=None)
        known.append((mod, exe))
        return exe


# VMs made by CompiledVariant.vm -> their executable's workspace table.
_VM_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_checked(
    mod: tvm.IRModule,
    variant: Variant,
    target: str = "llvm",
    *,
    well_formed: bool = True,
    disabled_pass: Sequence[str] = (),
    builds: Builds | None = None,
) -> CompiledVariant:
    """Compile ``mod`` with ``variant``'s pipeline, checking well-formedness around every pass.

    Parameters
    ----------
    mod
        The module (left unchanged).
    variant
        Which passes are on.
    target
        A target :func:`blade_relax.get_pipeline` accepts.
    well_formed
        Check the IR before and after every pass of the pipeline.
    disabled_pass
        Pass names the ``PassContext`` disables.
    builds
        Executables built before (see :class:`Builds`): a pipeline that produced a module
        structurally equal to one there takes its executable instead of building it again.

    Raises
    ------
    IllFormedIR
        Naming the pass around which the IR was not well formed, and what was wrong.
    """
    checker = _PipelineChecker(well_formed)
    if variant.pipeline is not None:
        pipeline = variant.pipeline(target)
    else:
        pipeline = get_pipeline(target, **variant.flags)
    # The ambient context's level and options, as a user's tvm.compile would see them.
    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(
        opt_level=current.opt_level,
        config=current.config,
        instruments=[*current.instruments, checker],
        disabled_pass=[*current.disabled_pass, *disabled_pass],
    ):
        try:
            # What tvm.compile does, in two steps, so that the build can be shared: the Relax
            # pipeline under the target, then the build of its module (relax_pipeline=None).
            with tvm.target.Target(target):
                lowered = pipeline(mod)
            if builds is None:
                exe = tvm.compile(lowered, target, relax_pipeline=None)
            else:
                exe = builds.build(lowered, target)
        except Exception:
            if checker.failure is not None:
                raise checker.failure from None
            raise
    if checker.memory_stage is None:
        raise RuntimeError("the pipeline never reached VMShapeLower")
    return CompiledVariant(variant, exe, checker.memory_stage, target)


# ----------------------------------------------------------------------------- running
def outputs_equal(expected: Any, got: Any, path: str = "out") -> str | None:
    """``None`` when ``got`` equals ``expected`` bit for bit (NaNs equal), else what differs."""
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return f"{path}: expected a tuple of {len(expected)}, got {type(got).__name__}"
        for i, (e, g) in enumerate(zip(expected, got)):
            diff = outputs_equal(e, g, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(expected, np.ndarray):
        if not isinstance(got, np.ndarray):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.dtype != got.dtype or expected.shape != got.shape:
            return (
                f"{path}: expected {expected.dtype}{list(expected.shape)}, "
                f"got {got.dtype}{list(got.shape)}"
            )
        if not np.array_equal(expected, got, equal_nan=expected.dtype.kind == "f"):
            bad = np.argwhere(
                ~((expected == got) | (np.isnan(expected) & np.isnan(got)))
                if expected.dtype.kind == "f"
                else expected != got
            )
            first = tuple(int(i) for i in bad[0])
            return (
                f"{path}: {len(bad)} of {expected.size} elements differ, first at {first}: "
                f"expected {expected[first]!r}, got {got[first]!r}"
            )
        return None
    return None if expected == got else f"{path}: expected {expected!r}, got {got!r}"


@dataclass(frozen=True)
class Measured:
    """One VM call: outputs (numpy), peak bytes above the entry, and what the runtime did."""

    outputs: Any
    peak: int
    peak_absolute: int
    live_before: int
    evictions: int
    regenerations: int
    budget_warnings: int
    decision: dict[str, Any] | None


def measure_call(
    vm: relax.VirtualMachine,
    args: Sequence[np.ndarray],
    budget: int | None = None,
    device: tvm.runtime.Device | None = None,
    workspaces: Mapping[str, Callable[[Sequence[Any]], int]] | None = None,
) -> Measured:
    """Call ``vm["main"]`` once under ``budget`` and measure its bytes.

    :func:`blade_relax.runtime.measure_call` on ``vm`` itself (the harness checks what a VM
    releases once dropped), with ``budget`` as the runtime takes it (the bytes live before the
    call included), and the warnings the call raises recorded rather than shown. The peak is
    ``memory_stats()["peak_bytes"]`` minus the live bytes before the call; with ``workspaces``
    (the executable's table, :attr:`CompiledVariant.workspaces`; by default that of a VM made
    by :meth:`CompiledVariant.vm`) it includes the workspace of the kernel running at the
    peak, as the timeline does.
    ``decision`` is the rematerialization runtime's decision for this call when ``budget`` is
    set and the function is rematerialized (``None`` otherwise).
    """
    if workspaces is None:
        workspaces = _VM_WORKSPACES.get(vm)
    m = runtime.measure_call(
        vm,
        args,
        runtime_budget=budget,
        workspaces=workspaces,
        device=device,
        collect_garbage=False,
        record_warnings=True,
    )
    return Measured(
        outputs=m.outputs,
        peak=m.peak_bytes,
        peak_absolute=m.peak_absolute,
        live_before=m.live_before,
        evictions=m.evictions,
        regenerations=m.regenerations,
        budget_warnings=m.budget_warnings,
        decision=m.decision,
    )


def _has_control_flow(mod: tvm.IRModule) -> bool:
    """Whether ``main`` holds an ``If`` or calls another Relax function of ``mod``."""
    found = False

    def visit(node: Any) -> None:
        nonlocal found
        if isinstance(node, relax.If):
            found = True
        elif isinstance(node, relax.Call) and isinstance(node.op, relax.GlobalVar):
            callee = mod[node.op] if node.op in mod.functions else None
            if isinstance(callee, relax.Function):
                found = True

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return found


def predicted_peak(memory_stage: tvm.IRModule, dims: dict[str, int]) -> int:
    """The timeline's peak for ``main`` of a module at the memory stage, at ``dims``.

    When ``main`` is a dispatcher (range copies of ``MemoryAwareSchedule``, the plain and
    rewritten copies of ``Rematerialize``), the copy that runs at ``dims`` without a memory
    budget is the one read (a dispatcher allocates nothing).
    """
    func = memory_stage[version_for(memory_stage, "main", dims)]
    timeline = memory_timeline(func, mod=memory_stage)
    known = set(timeline.graph.dims)
    return timeline.evaluate({k: v for k, v in dims.items() if k in known}).peak


# ----------------------------------------------------------------------------- one program
def _budgets(rng: random.Random, unconstrained: int, live_before: int, count: int) -> list[int]:
    """Budgets around the unconstrained peak: far below (unreachable, best effort), just below
    (a few evictions), at and above it (nothing to evict)."""
    if unconstrained <= 0:
        return []
    out = []
    for _ in range(count):
        fraction = rng.choice([0.1, 0.5, 0.7, 0.85, 0.95, 1.0, 1.5, rng.uniform(0.3, 1.1)])
        out.append(max(1, live_before + int(unconstrained * fraction)))
    return out


def check_program(
    program: GeneratedProgram,
    *,
    shapes: int = 3,
    variants: Sequence[Variant] | None = None,
    budgets_per_shape: int = 2,
    target: str = "llvm",
    rng: random.Random | None = None,
) -> ProgramReport:
    """Run every check of the module docstring on ``program``.

    Parameters
    ----------
    program
        The program (from :mod:`blade_relax.testing.program_gen`).
    shapes
        How many random admissible shapes to run.
    variants
        The pipelines to check (default: :func:`available_variants`).
    budgets_per_shape
        How many random memory budgets a rematerializing variant runs under, per shape, besides
        running without a budget (only when the runtime has ``set_memory_budget``).
    target
        Only ``"llvm"`` runs here; the harness runs on the CPU.
    rng
        Source of shapes and budgets (default: seeded with the program's seed).
    """
    rng = rng or random.Random(program.seed if program.seed is not None else 0)
    variants = available_variants(target) if variants is None else tuple(variants)
    report = ProgramReport(program=program, variants=[STOCK.name, *[v.name for v in variants]])
    try:
        relax.analysis.well_formed(program.mod)
    except Exception as err:  # the generator's own output must be well formed
        report.findings.append(Finding("generator", "input", str(err)[-2000:]))
        return report

    # The reference.
    stock_bug: IllFormedIR | None = None
    compiled: dict[str, CompiledVariant] = {}
    builds = Builds()
    try:
        compiled[STOCK.name] = compile_checked(program.mod, STOCK, target, builds=builds)
        reference = compiled[STOCK.name]
    except IllFormedIR as err:
        if err.pass_name != "StaticPlanBlockMemory" or not program.has_control_flow:
            report.findings.append(Finding("ill_formed", STOCK.name, str(err)))
            return report
        stock_bug = err
        report.findings.append(
            Finding("ill_formed", STOCK.name, str(err), known=KNOWN_IF_PLANNING_BUG)
        )
        reference = compile_checked(
            program.mod, STOCK, target, disabled_pass=["StaticPlanBlockMemory"]
        )
    except Exception as err:
        report.findings.append(Finding("compile_error", STOCK.name, _short(err)))
        return report
    report.checks["compile"] += 1

    for variant in variants:
        try:
            compiled[variant.name] = compile_checked(program.mod, variant, target, builds=builds)
            report.checks["compile"] += 1
        except IllFormedIR as err:
            known = None
            if (
                stock_bug is not None
                and not variant.replaces_stock_planner
                and err.pass_name == stock_bug.pass_name
            ):
                known = KNOWN_IF_PLANNING_BUG
            report.findings.append(Finding("ill_formed", variant.name, str(err), known=known))
        except Exception as err:
            report.findings.append(Finding("compile_error", variant.name, _short(err)))

    exact_peak = not _has_control_flow(program.mod)
    device = tvm.cpu()
    cases = []
    for shape_index in range(shapes):
        dims = program.sample_dims(rng)
        report.shapes.append(dims)
        cases.append(_Case(dims, program.arguments(dims, seed=shape_index)))
    if STOCK.name in compiled:
        # The stock executable is the reference: its own checked runs give the outputs.
        stock = compiled.pop(STOCK.name)
        _check_variant(report, stock, cases, exact_peak, rng, budgets_per_shape, device)
    else:
        ref_vm = relax.VirtualMachine(reference.executable, device)
        for case in cases:
            try:
                case.expected = measure_call(ref_vm, case.args, device=device).outputs
            except Exception as err:
                report.findings.append(Finding("run_error", "reference", _short(err), case.dims))
        del ref_vm
    cases = [case for case in cases if case.expected is not None]
    for cv in compiled.values():
        _check_variant(report, cv, cases, exact_peak, rng, budgets_per_shape, device)
    return report


@dataclass
class _Case:
    """One shape: its dims, the arguments, and the reference outputs once known."""

    dims: dict[str, int]
    args: list[np.ndarray]
    expected: Any = None


def _check_variant(
    report: ProgramReport,
    cv: CompiledVariant,
    cases: Sequence[_Case],
    exact_peak: bool,
    rng: random.Random,
    budgets_per_shape: int,
    device: tvm.runtime.Device,
) -> None:
    """All runs of one variant, then the leak check once its VM is gone.

    The VM keeps the registers of its last call (the returned tensors among them) until the
    next call, so a leak shows only once the VM itself is dropped.
    """
    name = cv.variant.name
    runtime.reset_memory_stats()
    live_before = runtime.memory_stats()["live_bytes"]
    vm = cv.vm(device)
    for case in cases:
        _check_runs(report, cv, vm, case, exact_peak, rng, budgets_per_shape)
    del vm
    report.checks["leak"] += 1
    leaked = runtime.memory_stats()["live_bytes"] - live_before
    if leaked:
        report.findings.append(
            Finding("leak", name, f"{leaked} bytes still live once the VM is dropped")
        )


def _check_runs(
    report: ProgramReport,
    cv: CompiledVariant,
    vm: relax.VirtualMachine,
    case: _Case,
    exact_peak: bool,
    rng: random.Random,
    budgets_per_shape: int,
) -> None:
    """Runs of one variant at one shape; a case without outputs yet takes this run's."""
    name = cv.variant.name
    dims, args = case.dims, case.args
    try:
        predicted = predicted_peak(cv.memory_stage, dims)
    except Exception as err:
        report.findings.append(Finding("peak", name, f"timeline failed: {_short(err)}", dims))
        predicted = None
    budgets: list[int | None] = [None]
    # Budgets only matter where the function asks the remat runtime for a decision.
    remat_runtime = (
        cv.variant.remat
        and hasattr(runtime, "set_memory_budget")
        and _remat_metadata(cv.memory_stage, dims) is not None
    )
    index = 0
    while index < len(budgets):
        budget = budgets[index]
        index += 1
        try:
            m = measure_call(vm, args, budget)
        except Exception as err:
            report.findings.append(Finding("run_error", name, _short(err), dims, budget))
            continue
        report.runs += 1
        if case.expected is None:
            case.expected = m.outputs
        diff = outputs_equal(case.expected, m.outputs)
        report.checks["outputs"] += 1
        if diff:
            report.findings.append(Finding("outputs", name, diff, dims, budget))
        if budget is None:
            if remat_runtime:
                # The budgets follow the peak this shape reaches without one.
                budgets += _budgets(rng, m.peak, m.live_before, budgets_per_shape)
            if exact_peak and predicted is not None:
                report.checks["peak"] += 1
                if m.peak != predicted:
                    report.findings.append(
                        Finding(
                            "peak",
                            name,
                            f"timeline predicts {predicted} B, measured {m.peak} B",
                            dims,
                        )
                    )
            else:
                report.checks["peak_skipped_control_flow"] += 1
            continue
        _check_budget(report, name, m, dims, budget, _remat_is_exact(cv.memory_stage, dims))


def _remat_metadata(memory_stage: tvm.IRModule, dims: dict[str, int]) -> RematMetadata | None:
    """The remat metadata of the function that runs ``main`` at ``dims`` under a budget (None
    when the pass left it alone). Metadata the contract cannot read is a bug of the pass: its
    :class:`~blade_relax.contract.RematFormatError` is raised, not taken for no metadata."""
    attrs = memory_stage[version_for(memory_stage, "main", dims, budget=True)].attrs
    if attrs is None or REMAT_META_ATTR not in attrs:
        return None
    return RematMetadata.from_json(str(attrs[REMAT_META_ATTR]))


def _remat_is_exact(memory_stage: tvm.IRModule, dims: dict[str, int]) -> bool:
    """Whether that metadata claims an exact timeline (every allocation on it)."""
    meta = _remat_metadata(memory_stage, dims)
    return meta is not None and meta.exact


def _check_budget(
    report: ProgramReport,
    name: str,
    m: Measured,
    dims: dict[str, int],
    budget: int,
    exact: bool,
) -> None:
    """The remat runtime's own word: a decision says whether the budget is reachable.

    Its predicted peak must be the measured one where its metadata claims an exact timeline;
    a budget it calls reachable must hold in every case.
    """
    decision = m.decision
    if decision is None:
        # No remat_begin ran (nothing to evict in this function): the runtime promised nothing.
        report.checks["budget_no_decision"] += 1
        return
    if decision.get("budget") != budget:
        report.findings.append(
            Finding(
                "decision", name, f"decision made for budget {decision.get('budget')}", dims, budget
            )
        )
        return
    reachable = bool(decision.get("reachable"))
    # An inexact timeline (reason "inexact") warns once per program, not once per decision.
    per_decision = decision.get("reason") != "inexact"
    if not reachable and not decision.get("cached") and per_decision and m.budget_warnings != 1:
        report.findings.append(
            Finding(
                "decision",
                name,
                f"unreachable budget gave {m.budget_warnings} warnings, expected one",
                dims,
                budget,
            )
        )
    predicted = decision.get("predicted_peak")
    if predicted is not None and not exact:
        report.checks["decision_peak_inexact"] += 1
    elif predicted is not None:
        report.checks["decision_peak"] += 1
        if predicted != m.peak_absolute:
            report.findings.append(
                Finding(
                    "decision",
                    name,
                    f"remat decision predicts a peak of {predicted} B (evicting "
                    f"{decision.get('evicted')}), measured {m.peak_absolute} B",
                    dims,
                    budget,
                )
            )
    if m.evictions:
        report.checks["runs_with_evictions"] += 1
    if reachable:
        report.checks["budget"] += 1
        if m.peak_absolute > budget:
            report.findings.append(
                Finding(
                    "budget",
                    name,
                    f"budget called reachable but peak {m.peak_absolute} B > {budget} B",
                    dims,
                    budget,
                )
            )
    else:
        report.checks["budget_unreachable"] += 1


def _short(err: BaseException, limit: int = 1500) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]

"""Symbolic memory timeline of a Relax function: live bytes after every binding, and the peak.

The same analysis reads a function at three stages of the pipeline:

``relax``
    High-level operators (``R.matmul``, ...) and ``call_tir``: every tensor-valued call
    allocates its result; values are freed after their last use (the liveness that
    ``KillAfterLastUse`` will give the VM).
``lowered``
    After ``CallTIRRewrite``: ``R.builtin.alloc_tensor`` allocates, kernels write into their
    arguments and allocate nothing.
``memory``
    After memory planning: ``alloc_storage`` allocates, ``alloc_tensor`` carves a tensor out of
    a storage (which the tensor keeps alive), ``kill_*`` / ``vm.kill_object`` drop a register.
    Once a function holds explicit kills, a register lives until its kill or the return, which
    is what the VM does; this is what lets the prediction equal the measured bytes exactly.

Throughout, an *allocation* lives while any live variable refers to it: directly, through a
tuple, a view (``reshape``, ``vm.builtin.reshape``, ``match_cast``) or a tensor placed in it.
Parameters belong to the caller: their bytes are ``persistent`` and never counted in ``peak``,
so ``peak`` is what the runtime accounting (``blade_relax.runtime.memory_stats``) measures.

Kernel workspaces: when ``mod`` is given, a binding that calls a PrimFunc of the module
(``call_tir`` or, once lowered, a direct call) also holds that kernel's workspace while it runs
(:mod:`blade_relax.analysis.workspace`: the scratch buffers the compiled kernel allocates, over
the caller's dims). It counts in that step's ``live_during`` (and working set), never after it:
the runtime accounting counts the same bytes, from the same description, when the call is
measured with a workspace table (``blade_relax.runtime.measure_memory``).

:class:`SampledTimeline` holds a timeline's live bytes at the shape graph's sample points, for
a pass that screens many variants of a function by numbers before it proves anything about one.

What each binding does to memory is not decided here: :mod:`blade_relax.analysis.effects`
(the op table every memory model reads) gives each binding's :class:`~.effects.ValueEffect`,
and :func:`~.effects.register_timeline_rule` teaches it packed functions and operators it
does not know; :mod:`blade_relax.analysis.storage_flow` follows those effects over the
function (which allocation each variable keeps alive, and when its last holder lets it go).
This module sums the bytes of what that flow leaves live at every step.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import tvm
from tvm import relax

from ..symbolic import Ordering, ShapeGraph, SymbolicExpr, TypeSizes
from .effects import (
    KILLS,
    STORAGE_ALLOCS,
    ValueEffect,
    binding_effect,
    call_name,
)
from .liveness import Liveness, liveness
from .storage_flow import Allocation, storage_flow
from .workspace import called_kernel, kernel_workspace

__all__ = [
    "Allocation",
    "EvaluatedTimeline",
    "MemoryTimeline",
    "SampledTimeline",
    "TimelineMemo",
    "TimelineStep",
    "lowers_peak",
    "memory_timeline",
    "peaks_over_grid",
]

_LOWERED_MARKERS = frozenset({"relax.call_tir", "relax.builtin.alloc_tensor"})


@dataclass(frozen=True)
class TimelineStep:
    """Live bytes around one binding (see the module docstring for the rules).

    ``live_during`` includes ``workspace``, the bytes the binding's kernel holds only while it
    runs; ``live_after`` does not.
    """

    index: int
    var: relax.Var
    allocated: SymbolicExpr
    freed: SymbolicExpr
    live_during: SymbolicExpr
    live_after: SymbolicExpr
    workspace: SymbolicExpr = field(default_factory=lambda: SymbolicExpr.constant(0))

    @property
    def name(self) -> str:
        return self.var.name


@dataclass(frozen=True)
class EvaluatedTimeline:
    """A timeline evaluated at concrete dims (all sizes in bytes).

    ``workspace[i]`` is the kernel workspace included in ``live_during[i]``;
    ``peak_workspace`` the part of ``peak`` that is kernel workspace.
    """

    bindings: dict[str, int]
    names: list[str]
    live_during: list[int]
    live_after: list[int]
    peak: int
    peak_index: int | None
    persistent: int
    lower_bound: int
    output_bytes: int
    workspace: list[int] = field(default_factory=list)
    peak_workspace: int = 0


@dataclass
class MemoryTimeline:
    """The symbolic memory timeline of one function (see :func:`memory_timeline`).

    :attr:`steps` (the running sums of live bytes, one symbolic expression per binding) are
    built when first read: :meth:`evaluate` and :class:`SampledTimeline` need only the
    allocations, the bindings' variables and their workspaces, and a pass that screens many
    variants of a function by numbers would otherwise pay thousands of symbolic additions for
    each one.
    """

    graph: ShapeGraph
    stage: str
    allocations: list[Allocation]
    persistent: SymbolicExpr
    output_bytes: SymbolicExpr
    #: Per binding, the allocations it touches (its result and what its inputs keep alive) and
    #: its workspace; summed only when :attr:`working_sets` is read.
    touched: list[tuple[tuple[int, ...], SymbolicExpr]] = field(repr=False)
    #: Per binding (in order): its variable, and the workspace its kernel holds while it runs.
    step_vars: list[relax.Var] = field(default_factory=list, repr=False)
    workspaces: list[SymbolicExpr] = field(default_factory=list, repr=False)
    #: The memo whose running sums the steps share with other timelines (None: plain sums).
    memo: TimelineMemo | None = field(default=None, repr=False, compare=False)
    _steps: list[TimelineStep] | None = field(default=None, repr=False)
    _peak: SymbolicExpr | None = field(default=None, repr=False)
    _working_sets: list[SymbolicExpr] | None = field(default=None, repr=False)

    @property
    def steps(self) -> list[TimelineStep]:
        """Live bytes around each binding (see :class:`TimelineStep`)."""
        if self._steps is None:
            self._steps = _steps(self)
        return self._steps

    @property
    def working_sets(self) -> list[SymbolicExpr]:
        """Per binding, the bytes it needs at once: its inputs, its result, its workspace."""
        if self._working_sets is None:
            self._working_sets = [
                _sum([*(self.allocations[a].nbytes for a in ids), workspace])
                for ids, workspace in self.touched
            ]
        return self._working_sets

    @property
    def peak(self) -> SymbolicExpr:
        """The largest ``live_during`` of any step, as a symbolic ``Max``.

        Candidates proven no larger than another candidate (``ShapeGraph.compare``) are
        dropped, so the ``Max`` keeps only the steps that can be the peak for some shapes.
        """
        if self._peak is None:
            candidates = [
                s.live_during
                for s in self.steps
                if not (_is_zero(s.allocated) and _is_zero(s.workspace))
            ]
            self._peak = _symbolic_max(self.graph, candidates)
        return self._peak

    @property
    def lower_bound(self) -> SymbolicExpr:
        """Persistent bytes plus the largest single-binding working set (inputs + outputs).

        The function's outputs are all live at its end, so their total counts as a working set
        too. No schedule or rematerialization of this function goes below it.
        """
        return self.persistent + _symbolic_max(self.graph, [*self.working_sets, self.output_bytes])

    def evaluate(self, bindings: Mapping[str, int]) -> EvaluatedTimeline:
        """Evaluate every step at concrete dims.

        Parameters
        ----------
        bindings
            A value for every dim, e.g. ``{"s": 128}``; checked against the dims' ranges.
        """
        sizes = [self.graph.evaluate(a.nbytes, bindings) for a in self.allocations]
        n = len(self.step_vars)
        delta_alloc = [0] * n
        delta_free = [0] * n
        for allocation, size in zip(self.allocations, sizes):
            delta_alloc[allocation.start] += size
            if allocation.end is not None:
                delta_free[allocation.end] += size
        workspace = [
            0 if _is_zero(w) else self.graph.evaluate(w, bindings) for w in self.workspaces
        ]
        live_during: list[int] = []
        live_after: list[int] = []
        live = 0
        peak, peak_index = 0, None
        for i in range(n):
            live += delta_alloc[i]
            during = live + workspace[i]
            live_during.append(during)
            if during > peak:
                peak, peak_index = during, i
            live -= delta_free[i]
            live_after.append(live)
        persistent = self.graph.evaluate(self.persistent, bindings)
        # A working set is a sum of allocations and a workspace: summed from their values.
        working = [
            sum(sizes[a] for a in ids) + workspace[i] for i, (ids, _) in enumerate(self.touched)
        ]
        outputs = self.graph.evaluate(self.output_bytes, bindings)
        return EvaluatedTimeline(
            bindings=dict(bindings),
            names=[v.name for v in self.step_vars],
            live_during=live_during,
            live_after=live_after,
            peak=peak,
            peak_index=peak_index,
            persistent=persistent,
            lower_bound=persistent + max([*working, outputs]),
            output_bytes=outputs,
            workspace=workspace,
            peak_workspace=0 if peak_index is None else workspace[peak_index],
        )


@dataclass(frozen=True)
class SampledTimeline:
    """A timeline's ``live_during`` at the representative points of its graph, in bytes, with
    the running maxima from both ends, so that the peak over the steps outside any window is
    read in constant time.

    A pass that tries many rewrites which each change the live bytes only over a window of
    steps can bound a trial's peak from below by the peak outside that window, without a
    timeline of the trial. The values are exact (every size is evaluated, nothing symbolic is
    compared) and equal :meth:`MemoryTimeline.evaluate` at each point; at every point the
    largest of them is the value of :attr:`MemoryTimeline.peak` there.

    Attributes
    ----------
    points
        The points of :meth:`ShapeGraph.representative_points` that lie within every dim's
        range (those :meth:`ShapeGraph.evaluate` accepts), in order.
    live_during
        Per step, its ``live_during`` at each point.
    """

    points: tuple[dict[str, int], ...]
    live_during: tuple[tuple[int, ...], ...]
    #: ``_before[i]``: per point, the largest ``live_during`` of the steps before ``i`` (0 for
    #: none); ``_from[i]``: of the steps from ``i`` on.
    _before: tuple[tuple[int, ...], ...] = field(repr=False)
    _from: tuple[tuple[int, ...], ...] = field(repr=False)

    @classmethod
    def of(cls, timeline: MemoryTimeline) -> SampledTimeline | None:
        """The sampled ``timeline``, or ``None`` when a size or a workspace cannot be
        evaluated at one of the points (an UNKNOWN part)."""
        graph = timeline.graph
        keep = []
        for k, point in enumerate(graph.representative_points()):
            try:
                graph.evaluate(_ZERO, point)
            except ValueError:  # outside a dim's range: no evaluation counts it
                continue
            keep.append((k, point))
        columns = [k for k, _ in keep]

        def values(expr: SymbolicExpr) -> tuple[int, ...] | None:
            # ``sample`` remembers each distinct expression: allocations share a few sizes.
            sampled = graph.sample(expr)
            return None if sampled is None else tuple(sampled[k] for k in columns)

        width, n = len(columns), len(timeline.step_vars)
        zero = (0,) * width
        delta_alloc = [zero] * n
        delta_free = [zero] * n
        for allocation in timeline.allocations:
            size = values(allocation.nbytes)
            if size is None:
                return None
            delta_alloc[allocation.start] = _add(delta_alloc[allocation.start], size)
            if allocation.end is not None:
                delta_free[allocation.end] = _add(delta_free[allocation.end], size)
        live_during: list[tuple[int, ...]] = []
        live = zero
        for i, step_workspace in enumerate(timeline.workspaces):
            live = _add(live, delta_alloc[i])
            during = live
            if not _is_zero(step_workspace):
                workspace = values(step_workspace)
                if workspace is None:
                    return None
                during = _add(live, workspace)
            live_during.append(during)
            live = tuple(a - b for a, b in zip(live, delta_free[i]))
        before = [zero]
        for during in live_during:
            before.append(tuple(map(max, before[-1], during)))
        after = [zero]
        for during in reversed(live_during):
            after.append(tuple(map(max, after[-1], during)))
        after.reverse()
        return cls(tuple(p for _, p in keep), tuple(live_during), tuple(before), tuple(after))

    @property
    def peak(self) -> tuple[int, ...]:
        """Per point, the largest ``live_during`` (0 without steps)."""
        return self._from[0]

    def peak_outside(self, first: int, last: int) -> tuple[int, ...]:
        """Per point, the largest ``live_during`` of the steps before ``first`` and after
        ``last`` (the steps ``first`` to ``last`` left out; none when ``last < first``)."""
        n = len(self.live_during)
        first, last = max(0, min(first, n)), max(-1, min(last, n - 1))
        if last < first:
            return self.peak
        return tuple(map(max, self._before[first], self._from[last + 1]))


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b))


def _is_zero(expr: SymbolicExpr) -> bool:
    return expr.is_constant and expr.expr == 0


def _symbolic_max(graph: ShapeGraph, candidates: Sequence[SymbolicExpr]) -> SymbolicExpr:
    # The candidates' values at the graph's sample points screen the proofs: a candidate can
    # only be proven no larger than another if it is no larger at every sample point, so most
    # comparisons are skipped, and visiting the largest first keeps the list of maxima short.
    unique: dict[Any, SymbolicExpr] = {}
    for cand in candidates:
        unique.setdefault(cand.expr, cand)
    samples = {key: graph.sample(cand) for key, cand in unique.items()}

    def largest(key: Any) -> tuple[int, int]:
        values = samples[key]
        return (0, 0) if values is None else (1, -max(values, default=0))

    maxima: list[SymbolicExpr] = []
    # Samples of the maxima, one row each (a row of +inf for a maximum without samples, which
    # may cover anything; -inf in ``low`` likewise may be covered by anything).
    width = len(graph.representative_points())
    high = np.empty((0, width))
    low = np.empty((0, width))
    for key in sorted(unique, key=largest):
        cand = unique[key]
        values = samples[key]
        if values is None:
            covering = range(len(maxima))
            covered = np.ones(len(maxima), dtype=bool)
        else:
            row = np.asarray(values, dtype=float)
            covering = np.nonzero((high >= row).all(axis=1))[0]
            covered = (low <= row).all(axis=1)
        if any(graph.compare(maxima[int(i)], cand).holds_ge for i in covering):
            continue
        keep = [
            i
            for i, kept in enumerate(maxima)
            if not (covered[i] and graph.compare(cand, kept).holds_ge)
        ]
        maxima = [maxima[i] for i in keep] + [cand]
        if values is None:
            new_high, new_low = np.full(width, np.inf), np.full(width, -np.inf)
        else:
            new_high = new_low = np.asarray(values, dtype=float)
        high = np.vstack([high[keep], new_high])
        low = np.vstack([low[keep], new_low])
    if not maxima:
        return SymbolicExpr.constant(0)
    return maxima[0] if len(maxima) == 1 else SymbolicExpr.max(*maxima)


def _stage(info: Liveness, mod: tvm.IRModule | None) -> str:
    stage = "relax"
    for binding in info.bindings:
        value = binding.value
        if not isinstance(value, relax.Call):
            continue
        name = call_name(value)
        if name in STORAGE_ALLOCS or name in KILLS:
            return "memory"
        if name in _LOWERED_MARKERS:
            stage = "lowered"
    return stage


@dataclass
class TimelineMemo:
    """What :func:`memory_timeline` derives per binding, shared by the timelines of the
    variants of one function.

    A pass that compares many rewrites of one function (each a copy with one block changed)
    would otherwise rebuild the shape graph and re-derive the effect of every unchanged
    binding, kernel workspaces included, for every trial. A binding's effect depends only on
    the binding (its variable and value, which an unchanged block keeps as the same nodes),
    the graph its sizes are canonical in, the module and the target, so the memo fixes those
    and is keyed by the binding's nodes.

    Attributes
    ----------
    graph
        The shape graph of the function; every variant must have the same dims (rewrites that
        copy or reorder bindings keep them).
    mod, workspaces, target
        As for :func:`memory_timeline`; every timeline built with the memo uses these.
    """

    graph: ShapeGraph
    mod: tvm.IRModule | None = None
    workspaces: bool = True
    target: Any = None
    effects: dict[tuple[Any, Any, bool], ValueEffect] = field(default_factory=dict, repr=False)
    sums: dict[tuple, SymbolicExpr] = field(default_factory=dict, repr=False)
    uses: dict[Any, tuple] = field(default_factory=dict, repr=False)
    stage: str | None = None
    #: Per kernel (``GlobalVar``), whether a call of it may hold a workspace.
    kernels: dict[Any, bool] = field(default_factory=dict, repr=False)
    #: Sizes of result types, see :meth:`bytes_of` (made on first use, over ``graph``).
    sizes: TypeSizes | None = field(default=None, repr=False)

    @classmethod
    def for_function(
        cls,
        func: relax.Function,
        *,
        mod: tvm.IRModule | None = None,
        workspaces: bool = True,
        target: Any = None,
    ) -> TimelineMemo:
        """A memo whose graph is built from ``func``."""
        return cls(ShapeGraph.from_function(func), mod, workspaces, target)

    def plus(self, a: SymbolicExpr, b: SymbolicExpr) -> SymbolicExpr:
        """``a + b``, remembered: trials share the running sums of the bindings before the
        first one they change."""
        key = ("+", a.expr, b.expr)
        out = self.sums.get(key)
        if out is None:
            out = self.sums[key] = a + b
        return out

    def minus(self, a: SymbolicExpr, b: SymbolicExpr) -> SymbolicExpr:
        """``a - b``, remembered (see :meth:`plus`)."""
        key = ("-", a.expr, b.expr)
        out = self.sums.get(key)
        if out is None:
            out = self.sums[key] = a - b
        return out

    def total(self, exprs: list[SymbolicExpr]) -> SymbolicExpr:
        """The sum of ``exprs``, remembered (see :meth:`plus`)."""
        if len(exprs) < 2:
            return _sum(exprs)
        key = ("sum", *(e.expr for e in exprs))
        out = self.sums.get(key)
        if out is None:
            out = self.sums[key] = _sum(exprs)
        return out

    def effect_of(self, binding: Any) -> ValueEffect:
        """The effect of ``binding`` (:func:`~.effects.binding_effect`), remembered."""
        key = (binding.var, binding.value, binding.is_match_cast)
        effect = self.effects.get(key)
        if effect is None:
            workspaces = self.workspaces and self._may_hold_workspace(binding.value)
            effect = binding_effect(
                binding, self.graph, self.mod, workspaces, self.target, self.bytes_of
            )
            self.effects[key] = effect
        return effect

    def bytes_of(self, var: Any) -> SymbolicExpr:
        """``graph.bytes_of(var)``, remembered per type
        (:class:`~blade_relax.symbolic.TypeSizes`)."""
        try:
            ty = var.ty
        except Exception:  # a non-normalized value has no type: as ``graph.bytes_of`` reads it
            ty = None
        if ty is None:
            return self.graph.bytes_of(var)
        if self.sizes is None:
            self.sizes = TypeSizes(self.graph)
        return self.sizes.bytes_of(ty, var)

    def _may_hold_workspace(self, value: Any) -> bool:
        """False for a call of a kernel known to allocate no workspace.

        The effect is then the same without the workspace query, which reads the shapes of
        every argument of the call for each binding; most kernels have none, and whether one
        does is remembered once per kernel here.
        """
        if self.mod is None or not isinstance(value, relax.Call):
            return True
        kernel = called_kernel(value, self.mod)
        if kernel is None:
            return True
        found = self.kernels.get(kernel)
        if found is None:
            func = self.mod[kernel]
            found = not kernel_workspace(func, kernel.name_hint, self.target).is_empty
            self.kernels[kernel] = found
        return found


def peaks_over_grid(timeline: MemoryTimeline, grid: Mapping[str, Any]) -> np.ndarray | None:
    """The peak of ``timeline`` (``live_during``, workspaces included) at every point of
    ``grid`` (:meth:`ShapeGraph.admissible_grid`), as a float64 array; ``None`` where a size
    or a workspace cannot be evaluated there (an UNKNOWN part).

    Over a grid of every admissible point, comparing two timelines' arrays decides what the
    symbolic comparison of their peaks (a ``Max`` over every step) may leave UNKNOWN, when the
    step that holds the peak changes with the dims.
    """
    graph = timeline.graph
    points = len(next(iter(grid.values()))) if grid else 1
    cache: dict[Any, np.ndarray | None] = {}

    def values(expr: SymbolicExpr) -> np.ndarray | None:
        key = expr.expr
        if key not in cache:
            cache[key] = graph.evaluate_grid(expr, grid)
        return cache[key]

    steps = len(timeline.step_vars)
    allocated = [np.zeros(points) for _ in range(steps)]
    freed = [np.zeros(points) for _ in range(steps)]
    for allocation in timeline.allocations:
        size = values(allocation.nbytes)
        if size is None:
            return None
        allocated[allocation.start] += size
        if allocation.end is not None:
            freed[allocation.end] += size
    live, peak = np.zeros(points), np.zeros(points)
    for i, workspace in enumerate(timeline.workspaces):
        live += allocated[i]
        during = live
        if not (workspace.is_constant and int(workspace) == 0):
            extra = values(workspace)
            if extra is None:
                return None
            during = live + extra
        np.maximum(peak, during, out=peak)
        live -= freed[i]
    return peak


def lowers_peak(trial: MemoryTimeline, base: MemoryTimeline) -> bool | None:
    """Whether ``trial``'s peak is no higher than ``base``'s at every admissible value of the
    dims and lower at one, decided value by value where the symbolic comparison of the two
    peaks (a ``Max`` over the steps of each) may not decide it: when the step holding a peak
    moves as a dim grows.

    Where the dims take few values, every one is checked (:meth:`ShapeGraph.admissible_grid`).
    Where one dim is unbounded above, its first values are checked and the rest proven on the
    graph restricted past them (:meth:`ShapeGraph.split_unbounded`), where the steps that hold
    the peaks have settled. Both are proofs. ``None`` when neither applies or a size cannot be
    evaluated; ``False`` when the trial is higher at one value or is not proven below.
    """
    graph = base.graph
    grid, tail = graph.admissible_grid(), None
    if grid is None:
        split = graph.split_unbounded()
        if split is None:
            return None
        grid, tail = split
    trial_peaks, base_peaks = peaks_over_grid(trial, grid), peaks_over_grid(base, grid)
    if trial_peaks is None or base_peaks is None:
        return None
    if not np.all(trial_peaks <= base_peaks):
        return False
    lower_here = bool(np.any(trial_peaks < base_peaks))
    if tail is None:
        return lower_here
    verdict = tail.compare(trial.peak, base.peak)
    return verdict.holds_le and (lower_here or verdict is Ordering.LT)


def memory_timeline(
    func: relax.Function,
    graph: ShapeGraph | None = None,
    *,
    mod: tvm.IRModule | None = None,
    workspaces: bool = True,
    target: Any = None,
    memo: TimelineMemo | None = None,
) -> MemoryTimeline:
    """The symbolic memory timeline of ``func``.

    Parameters
    ----------
    func
        A normalized Relax function, at any stage of the pipeline (see the module docstring).
    graph
        Its symbolic shape graph (built from ``func`` when omitted).
    mod
        The module ``func`` belongs to; lets calls of PrimFuncs be told from calls of Relax
        functions, and gives the kernels whose workspaces count. Without it, a ``GlobalVar``
        call that returns a tensor counts as allocating, and no workspace is counted.
    workspaces
        Count the workspace of each kernel call (needs ``mod``).
    target
        The target the kernels are built for, which decides their workspaces (see
        :func:`blade_relax.analysis.workspace.kernel_workspace`: by default the current target
        scope, else ``llvm``).
    memo
        Shares the graph and the bindings' effects with other timelines of variants of
        ``func`` (see :class:`TimelineMemo`); ``graph``, ``mod``, ``workspaces`` and
        ``target`` then come from the memo and must not be passed differently.

    Returns
    -------
    MemoryTimeline
    """
    if memo is not None:
        if (graph is not None and graph is not memo.graph) or (
            mod is not None and (memo.mod is None or not mod.same_as(memo.mod))
        ):
            raise ValueError("memory_timeline: pass the graph and module through the memo only")
        graph, mod = memo.graph, memo.mod
        effect_of = memo.effect_of
    else:
        graph = graph if graph is not None else ShapeGraph.from_function(func)

        def effect_of(binding: Any) -> ValueEffect:
            return binding_effect(binding, graph, mod, workspaces, target)

    info = liveness(func, uses_memo=None if memo is None else memo.uses)
    if memo is None:
        stage = _stage(info, mod)
    else:
        # Rewrites of one function stay at its stage.
        if memo.stage is None:
            memo.stage = _stage(info, mod)
        stage = memo.stage
    flow = storage_flow(info, effect_of, graph.bytes_of, explicit_kills=stage == "memory")
    allocations = flow.allocations
    return MemoryTimeline(
        graph=graph,
        stage=stage,
        allocations=allocations,
        persistent=_sum(graph.bytes_of(p) for p in info.params),
        output_bytes=_sum(allocations[a].nbytes for a in sorted(flow.outputs)),
        touched=flow.touched,
        step_vars=[binding.var for binding in info.bindings],
        workspaces=flow.workspaces,
        memo=memo,
    )


def _steps(timeline: MemoryTimeline) -> list[TimelineStep]:
    """The running sums of :attr:`MemoryTimeline.steps`."""
    memo = timeline.memo
    if memo is None:
        plus, minus, total = operator.add, operator.sub, _sum
    else:
        plus, minus, total = memo.plus, memo.minus, memo.total
    # The sizes made and freed at each step (a sum does not depend on the order of its terms).
    made: list[list[SymbolicExpr]] = [[] for _ in timeline.step_vars]
    dropped: list[list[SymbolicExpr]] = [[] for _ in timeline.step_vars]
    for allocation in timeline.allocations:
        made[allocation.start].append(allocation.nbytes)
        if allocation.end is not None:
            dropped[allocation.end].append(allocation.nbytes)
    steps: list[TimelineStep] = []
    live = SymbolicExpr.constant(0)
    for i, (var, workspace) in enumerate(zip(timeline.step_vars, timeline.workspaces)):
        allocated = total(made[i])
        freed = total(dropped[i])
        # Most bindings allocate and free nothing: skip sympy's arithmetic for them.
        if made[i]:
            live = plus(live, allocated)
        during = plus(live, workspace) if not _is_zero(workspace) else live
        if dropped[i]:
            live = minus(live, freed)
        steps.append(
            TimelineStep(
                index=i,
                var=var,
                allocated=allocated,
                freed=freed,
                live_during=during,
                live_after=live,
                workspace=workspace,
            )
        )
    return steps


def _sum(exprs) -> SymbolicExpr:
    # One sympy Add over all terms: pairwise sums would re-flatten the partial sum each time.
    terms = [e.expr for e in exprs if not _is_zero(e)]
    if not terms:
        return _ZERO
    return SymbolicExpr(terms[0]) if len(terms) == 1 else SymbolicExpr(sympy.Add(*terms))


_ZERO = SymbolicExpr.constant(0)

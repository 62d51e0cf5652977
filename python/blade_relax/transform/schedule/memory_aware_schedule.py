"""MemoryAwareSchedule: reorder the bindings of dataflow blocks to lower the peak of live bytes.

Where it runs
-------------
After ``FuseOps``/``FuseTIR`` (so it sees the kernels whose buffers the VM will allocate) and
before ``ToNonDataflow`` (dataflow blocks, whose bindings may be reordered freely as long as
dependencies hold, exist only until then). It also works on unfused graphs of high-level
operators, before ``LegalizeOps``. It must not run after ``StaticPlanBlockMemory``.

What it assumes
---------------
The module is normalized and well formed. Bindings of a dataflow block are pure, so any order
that respects the def-use edges computes the same values. The pass adds edges where purity
alone is not enough:

* a ``match_cast`` that defines a symbolic var comes before every binding that mentions it;
* a binding that writes into an argument (``call_tir_inplace``, ``call_inplace_packed``) keeps
  its position relative to every other binding that touches the same buffer.

A block with anything else (an impure call, ``If``, a local function, an unknown expression
kind) is left untouched, and so is a function whose shapes cannot be analysed.

Memory model
------------
Orders are scored by the bytes of storage the VM will hold, as the runtime accounting
(:func:`blade_relax.runtime.memory_stats`) measures them. Plain liveness first: a binding that
computes a tensor (an operator, ``call_tir``, a packed call) allocates its result (one buffer
per field of a tuple result); views (``reshape``, a ``call_tir`` of a reshape kernel that
``RewriteDataflowReshape`` turns into a view, tuples, ``TupleGetItem``, ``match_cast``) keep
their source alive. A buffer is freed after the last binding that reads a variable referring
to it, unless one of those variables is used after the block. Parameters belong to the caller
and are never counted; values of earlier blocks are live on entry and freed after their last
use in the block. At a binding, live bytes are ``live_before + allocated``, plus the
workspace its kernel holds while it runs (:mod:`blade_relax.analysis.workspace`; the measured
peak includes it, so an order whose peak step runs a kernel with scratch memory peaks that much
higher).

Facts of the lowering that decide the measured peak are modelled on top, per
``ScheduleOptions.planner`` (the memory planner that will run after the pass):

* ``KillAfterLastUse`` kills only variables that are read. After ``CallTIRRewrite`` the
  result of a multi-output kernel is a tuple variable that nothing reads (``TupleGetItem``
  folds to the field), so its fields live until the function returns; so does the source of a
  view or a tuple that is never read.
* ``"static"`` (the default): ``StaticPlanBlockMemory``'s storage reuse. A buffer's storage
  token returns to the pool after the last *call* that reads it, a new buffer takes a pooled
  token of the same dtype and provably equal size (for constant sizes, the closest within a
  factor 16, enlarged if needed), and a storage lives from its first buffer's allocation to
  its last buffer's last use.
* ``"none"``: plain liveness, each buffer in its own storage.
* ``"plan"``: plain liveness with the fields of multi-output kernels freed after their last
  use, which is what ``PlanMemory`` gives: it kills such tuples after their last item access,
  and its sharing is proven never to raise the peak of the unshared program. A kernel output
  that ``PlanMemory`` writes over an input of equal size dying at the call
  (:func:`blade_relax.analysis.inplace_reuse.inplace_verdict`) allocates nothing. Use it when
  ``PlanMemory`` replaces ``StaticPlanBlockMemory`` (``get_pipeline(plan=True)``).

On fused graphs these figures equal the memory-stage timeline
(:func:`blade_relax.analysis.memory_timeline`) of the lowered function, which equals the
measured bytes (tested).

How it decides
--------------
Byte counts are symbolic (:class:`blade_relax.symbolic.ShapeGraph`). Candidate orders come from
several strategies (``ScheduleOptions.strategies``):

``greedy-delta``
    List scheduling: among the ready bindings, run the one whose effect on live bytes
    (allocated minus freed) is provably smallest (``ShapeGraph.compare``); ties by allocated
    bytes, then by input position.
``greedy-peak``
    The same with the keys swapped: least allocated bytes (live bytes *during* the binding)
    first, then least net effect.
``depth-first``
    Post-order depth-first from the block's sinks, arguments in order (what
    ``relax.transform.TopologicalSort(order="depth-first", direction="from-outputs")`` does).
``refine``
    Local search from the input order: at the step where the peak is reached (each acceptance
    point in turn, largest peak first), move the producer of a live buffer, with the ancestors
    only it needs, to just before its first other reader, or the last reader of a live buffer,
    with the ancestors it still waits for, to just before the peak step; keep a move only if
    the peak gets no higher at any acceptance point and lower (or reached by fewer steps) at
    the point being worked on. At most ``refine_evaluations`` orders are scored. With the
    storage planner's model the search also runs once on plain liveness, and its moves are
    replayed one by one under the planner's model, keeping those that leave no point above the
    input (``refine-liveness``).
``balanced``
    Iterated local search (:mod:`._search`) on the pool of all orders above: with the
    moves of ``refine`` and joint delays (a producer together with the other producers that
    read an input its delay keeps alive: two normalizations of one residual stream are each
    no gain delayed alone, and a gain delayed together) but no monotonicity constraint, then
    random perturbations followed by the same descent, first for single acceptance points
    (spread over the range), then for all points at once, minimizing the worst ratio of the
    peak to the best peak met at each point while staying nowhere above the input. The best
    order met at each point joins the pool.
    At most ``min(search_evaluations, search_work // bindings)`` orders are scored per block.

When a comparison in a greedy step is UNKNOWN (it holds for some admissible shapes only), the
tie is broken by the values at ``ShapeGraph.representative_points()``: the smaller value at
the majority of the points, then the smaller value at the last point. With
``point_variants`` every greedy strategy that met an UNKNOWN runs again once per point,
deciding each UNKNOWN by that point's values.

The input order is always a candidate, and a candidate replaces it only if its symbolic peak
is **proven** no higher than the input's for every admissible value of the dims, or (with
``accept_sampled``) if no proof is found but it is no higher at every *acceptance point* (the
representative points, every power of two in the dims' ranges and the values half way between
them, see :mod:`._cost`) and all byte counts can be evaluated. It must also be
strictly lower at one of those points. Candidates are ranked by their worst ratio to the best
peak met at each acceptance point (by any order), then by the mean ratio; the best accepted
one is kept (a proven one on ties), so the result is never worse than the input order at any
of those points.

Range versions
--------------
An order can only be good for all shapes at once; when the order that suits short sequences
is not the one for long ones, each is a compromise. With ``max_versions > 1`` the pass looks
for ranges of the function's dim (only a function with one free dim, defined by its
parameters) on which one order of the pool is clearly better than the single order (by more
than ``version_gain`` in worst ratio), schedules a copy of the function for each range (the
search seeded with the pool, the acceptance points those of the range) and keeps the copies
that beat the single order on their range. The function then dispatches on the dim
(:mod:`._versions`: private copies, an ``If`` on ``R.prim_value(s <= k)`` in the
original function). Each copy is never worse than the input order at its range's points.
The ranges' searches are independent: on a function whose single search took long, they run
in forked processes, one per CPU (``ScheduleOptions.jobs``; only orders and reports come back),
with the same result as in one process.

When ``RecomputeCheapValues`` follows (``recompute_after``), the choice (one order or range
copies), the input order and the best ranked other orders of the pool are compared once more,
each recomputed and scored as the planner lowers it, and the ranges are chosen again from
those figures (``ScheduleOptions.recompute_after``).

Cost: each strategy is a list scheduler whose steps cost ``O(#distinct ready keys)`` cached
comparisons, or a local search whose steps score an order with numpy cumulative sums (and, for
``"static"``, a replay of the planner's token pool). Blocks of several thousand bindings
schedule in seconds (a few times the single-order cost with versions). The comparison after
recomputation runs ``RecomputeCheapValues`` once per candidate, at most
``recompute_work // bindings`` candidates from the pool besides the choice and the input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
from tvm import relax

from ...contract import SCHEDULE_VERSION_ATTR
from ...util.collection import pauses_collection
from ..dispatch import DimRange, range_dispatch, range_of
from ..fuse_into_sole_reader import FuseReaderOptions
from ..recompute_cheap_values import RecomputeOptions
from ..result import (
    PassResult,
    collect_results,
    publish,
)
from ._after_recompute import after_recompute, recompute_candidates
from ._blocks import graph_of, main_block, schedule_blocks
from ._memo import MEMO
from ._model import (
    PLANNERS,
)
from ._range_copies import range_copies
from ._reports import BlockReport, ScheduleReport, schedule_result
from ._versions import (
    range_graph,
    version_dim,
)

__all__ = [
    "BlockReport",
    "MemoryAwareSchedule",
    "ScheduleOptions",
    "ScheduleReport",
    "schedule_function",
    "schedule_module",
]


STRATEGIES = ("refine", "greedy-delta", "greedy-peak", "depth-first", "balanced")


@dataclass(frozen=True)
class ScheduleOptions:
    """Options of :class:`MemoryAwareSchedule`.

    Attributes
    ----------
    strategies
        Candidate generators, tried in this order (see the module docstring): any of
        ``"refine"``, ``"greedy-delta"``, ``"greedy-peak"``, ``"depth-first"``,
        ``"balanced"`` (which starts from the orders of the others). The input order is always
        a candidate.
    point_variants
        Re-run a greedy strategy that met an UNKNOWN comparison once per representative point,
        deciding each UNKNOWN at that point.
    accept_sampled
        Accept an order whose peak is not proven no higher than the input's when it is no
        higher at every acceptance point. With False, only proven orders are accepted.
    proof_budget
        Slow symbolic comparisons (``ShapeGraph.compare``) allowed per proof of one candidate
        against another; a proof that runs out counts as not found.
    planner
        The memory planner the schedule is scored for: ``"static"`` models the storage reuse
        of ``StaticPlanBlockMemory`` (the stock planner that follows the pass in the default
        pipeline), ``"none"`` plain liveness (each tensor freed after its last use),
        ``"plan"`` what ``PlanMemory`` gives (plain liveness, fields of multi-output kernels
        freed after their last use). See the module docstring.
    refine_evaluations
        Orders the ``refine`` strategy may score per block.
    refine_moves
        Moves ``refine`` and ``balanced`` try at each peak.
    search_evaluations
        Orders the ``balanced`` strategy may score per block (and per range version).
    search_work
        Caps ``balanced`` at ``search_work // bindings`` orders, so that its cost stays
        about constant as blocks grow.
    max_versions
        Most range versions of a function (1: one order for all shapes, no new functions).
    version_gain
        Least relative gain in worst-case ratio (see the module docstring) for a range split
        and for a range copy to be kept.
    tie
        Candidates whose worst and mean ratios are within this fraction of the best count as
        equally good; the one from the earliest strategy is kept (simple orders, e.g. the
        monotone ``refine``, leave other passes such as ``Rematerialize`` more to work with
        than an order tuned for the last few bytes).
    min_bindings
        Blocks with fewer bindings are left as they are.
    max_bindings
        Blocks with more bindings are left as they are (None: no limit).
    recompute_after
        ``RecomputeCheapValues`` follows the pass (as in :func:`blade_relax.get_pipeline`).
        Orders are scored before recomputation, which removes different values from different
        orders, so that an order scored best may peak higher than another once recomputed.
        Each function is therefore compared once more: the pass's choice (its order, or its
        range copies), the input order and the best ranked other orders of the pool are each
        recomputed and scored by the block model of ``planner`` (``model_inplace``:
        PlanMemory's in-place placements included; plain liveness where the model cannot
        read a block). Ranges of the function's dim are then chosen from these peaks as for
        range versions (up to ``max_versions``), each taking the candidate with the lowest
        worst ratio to the best peak met on it among those nowhere above the input order there
        (the pass's choice on ties): the function keeps one order or dispatches over range
        copies. On the fused graphs of the benchmark workloads these recomputed, planned
        figures equal the measured peaks of each candidate (the README quickstart's MLP at
        s = 1024: 5,898,756 bytes, against 6,295,556 when only the choice and the input order
        are compared).
    recompute_options
        The :class:`~blade_relax.transform.RecomputeOptions` of the ``RecomputeCheapValues``
        that follows (None: its defaults); :func:`blade_relax.get_pipeline` passes the options
        it runs that pass with, so that orders are compared on the program that will run.
    fuse_readers
        Compare them after ``FuseIntoSoleReader`` too, with ``fuse_reader_options``, when that
        pass follows ``RecomputeCheapValues`` (:func:`blade_relax.get_pipeline` sets both on
        CPU targets): what it fuses of the recomputed values differs from order to order.
    recompute_candidates
        Most orders of the pool compared after recomputation besides the pass's choice and
        the input order.
    recompute_work
        Caps those at ``recompute_work // bindings`` orders: each costs one run of
        ``RecomputeCheapValues`` on the function, so that large functions (a Llama training step
        has about 150 bindings per layer) compare only the choice and the input.
    model_inplace
        With ``planner="plan"``, count a kernel output that ``PlanMemory`` writes over a dying
        input of equal size as allocating nothing, as the lowered program does.
    model_workspaces
        Add the workspace of the kernel a step runs to its live bytes, as the measured peak
        does. Off by default: on the small MLP training step of ``tests/e2e/test_bad_input.py``
        the order it picks makes the rematerialized copy peak above the plain one (83,968
        against 75,776 bytes with nothing evicted), so a budget no eviction reaches ran higher
        than no budget.
    range_copies
        Also schedule the range copies an earlier run of the pass made (functions carrying
        ``contract.SCHEDULE_VERSION_ATTR``), each on its range's acceptance points; by default
        they are left as they are (to polish, say, the copies after passes that change them).
    jobs
        Most processes the pass uses (None: one per CPU this process may run on). On a
        function whose single search takes long, the searches of its range copies run in
        forked processes (see ``blade_relax.transform._parallel``); the result is the same
        with any number.
    """

    strategies: tuple[str, ...] = STRATEGIES
    point_variants: bool = True
    accept_sampled: bool = True
    proof_budget: int = 256
    planner: str = "static"
    refine_evaluations: int = 400
    refine_moves: int = 8
    search_evaluations: int = 3000
    search_work: int = 1_500_000
    max_versions: int = 3
    version_gain: float = 0.01
    tie: float = 0.001
    min_bindings: int = 3
    max_bindings: int | None = None
    recompute_after: bool = False
    recompute_options: RecomputeOptions | None = None
    fuse_readers: bool = False
    fuse_reader_options: FuseReaderOptions | None = None
    recompute_candidates: int = 8
    recompute_work: int = 2000
    model_inplace: bool = True
    model_workspaces: bool = False
    range_copies: bool = False
    jobs: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown schedule strategies {unknown}; choose from {STRATEGIES}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.proof_budget < 0:
            raise ValueError(f"proof_budget must be >= 0, got {self.proof_budget}")
        if self.refine_evaluations < 0 or self.refine_moves < 1:
            raise ValueError("refine_evaluations must be >= 0 and refine_moves >= 1")
        if self.search_evaluations < 0 or self.search_work < 0:
            raise ValueError("search_evaluations and search_work must be >= 0")
        if self.max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {self.max_versions}")
        if self.version_gain < 0:
            raise ValueError(f"version_gain must be >= 0, got {self.version_gain}")
        if self.tie < 0:
            raise ValueError(f"tie must be >= 0, got {self.tie}")
        if self.recompute_candidates < 0 or self.recompute_work < 0:
            raise ValueError("recompute_candidates and recompute_work must be >= 0")
        if self.recompute_options is not None and not isinstance(
            self.recompute_options, RecomputeOptions
        ):
            raise TypeError(
                "recompute_options must be RecomputeOptions or None, not "
                f"{type(self.recompute_options).__name__}"
            )
        if self.min_bindings < 0:
            raise ValueError(f"min_bindings must be >= 0, got {self.min_bindings}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"jobs must be >= 1 or None, got {self.jobs}")
        if self.fuse_reader_options is not None and not isinstance(
            self.fuse_reader_options, FuseReaderOptions
        ):
            raise TypeError(
                "fuse_reader_options must be FuseReaderOptions or None, not "
                f"{type(self.fuse_reader_options).__name__}"
            )


# ====================================================================== choosing


# ====================================================================== functions and modules


def schedule_function(
    func: relax.Function,
    mod: tvm.IRModule | None = None,
    options: ScheduleOptions | None = None,
    name: str = "",
) -> tuple[relax.Function, ScheduleReport]:
    """Reorder the dataflow blocks of one function (one order for all shapes, no versions).

    Parameters
    ----------
    func
        A normalized ``relax.Function``.
    mod
        The module ``func`` belongs to (lets ``call_tir`` of reshape kernels count as views).
    options
        :class:`ScheduleOptions` (defaults when None); ``max_versions`` is not used here
        (versions are new functions: see :func:`schedule_module`).
    name
        The function's name, for the report.

    Returns
    -------
    tuple
        The function (the same object when nothing changed) and a :class:`ScheduleReport`.
    """
    options = options or ScheduleOptions()
    report = ScheduleReport()
    graph = graph_of(func, name)
    if graph is None:
        return func, report
    scheduled = schedule_blocks(func, mod, options, name, graph)
    report.blocks.extend(scheduled.reports)
    return scheduled.func, report


def schedule_module(
    mod: tvm.IRModule, options: ScheduleOptions | None = None
) -> tuple[tvm.IRModule, ScheduleReport]:
    """Apply the pass to every Relax function of ``mod``.

    Each function is scheduled with one order for all shapes (:func:`schedule_function`);
    with ``options.max_versions > 1`` it may instead become a dispatcher over range copies
    (:mod:`._versions`). Returns the new module (``mod`` itself when nothing changed)
    and the merged report.
    """
    options = options or ScheduleOptions()
    report = ScheduleReport()
    updates: dict[tvm.ir.GlobalVar, relax.Function] = {}
    added: list[tuple[tvm.ir.GlobalVar, relax.Function]] = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        if func.attrs is not None and "Primitive" in func.attrs:
            continue  # fused sub-functions (FuseTIR turns them into kernels)
        copy_of = range_of(func)
        if copy_of is not None or (func.attrs is not None and SCHEDULE_VERSION_ATTR in func.attrs):
            if copy_of is not None and options.range_copies:
                scheduled = _schedule_range_copy(gv, func, mod, options, copy_of[1], report)
                if scheduled is not func:
                    updates[gv] = scheduled
            continue
        graph = graph_of(func, gv.name_hint)
        if graph is None:
            continue
        single = schedule_blocks(func, mod, options, gv.name_hint, graph)
        report.blocks.extend(single.reports)
        versions = None
        if options.max_versions > 1:
            versions = range_copies(gv, func, mod, options, graph, single, report)
        candidates: list[tuple[str, relax.Function]] = []
        if options.recompute_after and single.blocks:
            candidates = recompute_candidates(func, single, versions, options)
        if len(candidates) > 1:  # the input order alone needs no comparison
            block = single.blocks[main_block(single)][0]
            chosen = after_recompute(mod, gv, func, candidates, graph, options, block)
            if chosen is not None:
                names = ", ".join(name for _, name, _ in chosen)
                for entry in single.reports:
                    entry.strategy += f" ({names} after recomputation)"
                versions = [(rng, f) for rng, _, f in chosen] if len(chosen) > 1 else None
                if versions is None:
                    report.versions.pop(gv.name_hint, None)
                    if chosen[0][2] is not func:
                        updates[gv] = chosen[0][2]
                    continue
                report.versions[gv.name_hint] = [str(r) for r, _ in versions]
        if versions:
            var = version_dim(func, graph)[0]
            dispatcher, copies = range_dispatch(mod, gv, func, var, versions)
            updates[gv] = dispatcher
            added.extend(copies)
        elif single.func is not func:
            updates[gv] = single.func
    if not updates:
        return mod, report
    functions = {gv: updates.get(gv, func) for gv, func in mod.functions.items()}
    functions.update(dict(added))
    out = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
    return out, report


def _schedule_range_copy(
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    mod: tvm.IRModule,
    options: ScheduleOptions,
    rng: DimRange,
    report: ScheduleReport,
) -> relax.Function:
    """A range copy scheduled again on its range (one order, no copies of its own)."""
    if graph_of(func, gv.name_hint) is None:
        return func
    graph = range_graph(func, rng)
    single_options = dataclasses.replace(options, max_versions=1, recompute_after=False)
    scheduled = schedule_blocks(func, mod, single_options, gv.name_hint, graph, str(rng))
    report.blocks.extend(scheduled.reports)
    return scheduled.func


@tvm.transform.module_pass(opt_level=0, name="MemoryAwareSchedule")
class MemoryAwareSchedule:
    """Reorder the bindings of every dataflow block to lower the peak of live bytes.

    See the module docstring for where it runs, its memory model and how it decides.

    Parameters
    ----------
    options
        :class:`ScheduleOptions` (defaults when None).

    After the pass ran, ``pass_obj.report`` is the :class:`ScheduleReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (its
    ``detail`` is the same report). For every function it changed, the peaks before and after
    are those of :func:`blade_relax.analysis.memory_timeline` (at the stage the pass runs:
    before planning, so the plain liveness of the schedule's ``"none"`` model, kernel
    workspaces included; built when first read); a function turned into a dispatcher has no
    peak after (the dispatch allocates nothing), and each of its range copies reports its own.

    A run whose input equals one of the last few runs' in this process (the module, the options,
    the target and ``PassContext`` it reads) takes that run's result, a copy of its report and
    its warnings instead of searching again (:mod:`._memo`).
    """

    def __init__(self, options: ScheduleOptions | None = None) -> None:
        if options is not None and not isinstance(options, ScheduleOptions):
            raise TypeError(f"options must be a ScheduleOptions, got {type(options).__name__}")
        self.options = options or ScheduleOptions()
        self.report: ScheduleReport | None = None
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        def schedule() -> tuple[tvm.IRModule, ScheduleReport]:
            # The trial runs of RecomputeCheapValues (``recompute_after``) are not this run's.
            with collect_results():
                return schedule_module(mod, self.options)

        # An input met before in this process takes that run's result (see ._memo).
        new_mod, report = MEMO.run(mod, self.options, schedule)
        self.report = report
        publish(self, schedule_result(mod, new_mod, report))
        return new_mod


# ====================================================================== the result

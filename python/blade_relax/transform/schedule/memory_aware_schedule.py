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
    moves of ``refine`` but no monotonicity constraint, then random perturbations followed by
    the same descent, first for single acceptance points (spread over the range), then for all
    points at once, minimizing the worst ratio of the peak to the best peak met at each point
    while staying nowhere above the input. The best order met at each point joins the pool.
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

import bisect
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ...analysis import memory_timeline
from ...contract import SCHEDULE_VERSION_ATTR
from ...symbolic import ShapeGraph, SymbolicExpr
from .._collection import pauses_collection
from .._parallel import available_cpus, map_forked
from .._warn import warn_fallback
from ..dispatch import DimRange, range_dispatch, range_of
from ..fuse_into_sole_reader import FuseIntoSoleReader, FuseReaderOptions
from ..recompute_cheap_values import RecomputeCheapValues, RecomputeOptions
from ..result import (
    FunctionResult,
    PassResult,
    collect_results,
    counted,
    publish,
    snapshot,
    timeline_peak,
    with_functions,
)
from ._cost import OrderProfile, UnsupportedBytes, acceptance_points, front_le
from ._model import (
    PLANNERS,
    Block,
    BlockReader,
    UnsupportedBlock,
    profile,
    timeline,
    tir_var_names,
)
from ._search import (
    Decider,
    Pool,
    as_float,
    balanced_search,
    depth_first,
    greedy,
    refine,
    replay,
)
from ._versions import (
    _best,
    choose_ranges,
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


@dataclass
class BlockReport:
    """What the pass did to one dataflow block.

    Attributes
    ----------
    function, block
        The function's name and the block's index in its body.
    bindings
        Number of bindings.
    strategy
        The candidate whose order was kept (``"input"`` when unchanged; ``"best@3"`` is the
        best order met at acceptance point 3, ``"point3"`` the search tuned for it,
        ``"balanced-<start>"`` the balanced search from that candidate, ``"seed<i>"`` an order
        from the search over the whole range), why the block was skipped (``"skipped: ..."``),
        or, for a range copy that did not beat the single order, ``"single order kept"``.
    proven
        Whether the kept order's peak is proven no higher than the input's (True when
        unchanged).
    points
        The acceptance points (free dims only).
    peak_before, peak_after
        Peak live bytes of the block at each acceptance point, input order and kept order.
    candidates
        Per candidate strategy: ``"proven"`` (accepted, peak proven no higher), ``"sampled"``
        (accepted from the acceptance points), ``"rejected"``, ``"no gain"``, ``"duplicate"``
        (same order as an earlier candidate or the input) or ``"not needed"`` (ranked below
        the kept order).
    peak_expr_before, peak_expr_after
        The symbolic peaks (Max over the steps that can be the peak).
    seconds
        Time spent on the block.
    version
        For a block of a range copy, its range (``"2 <= s <= 31"``); empty otherwise.
    """

    function: str
    block: int
    bindings: int
    strategy: str
    proven: bool = True
    points: list[dict[str, int]] = field(default_factory=list)
    peak_before: list[int] = field(default_factory=list)
    peak_after: list[int] = field(default_factory=list)
    candidates: dict[str, str] = field(default_factory=dict)
    peak_expr_before: SymbolicExpr | None = None
    peak_expr_after: SymbolicExpr | None = None
    seconds: float = 0.0
    version: str = ""

    @property
    def changed(self) -> bool:
        return self.strategy not in ("input",) and not self.strategy.startswith("skipped")


@dataclass
class ScheduleReport:
    """Per-block reports of one run of the pass, and the range versions it emitted
    (function name: ranges, in dispatch order)."""

    blocks: list[BlockReport] = field(default_factory=list)
    versions: dict[str, list[str]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(b.changed for b in self.blocks)


# ====================================================================== choosing


def _search(
    block: Block,
    options: ScheduleOptions,
    report: BlockReport,
    seeds: Sequence[list[int]] = (),
) -> Pool:
    """Every candidate order of ``block`` (see the module docstring), scored in a pool;
    ``seeds`` are orders found earlier (for another range of the dims) to start from."""
    space = block.space
    identity = list(range(block.n))
    pool = Pool(block, timeline(block, identity).peaks)
    pool.add("input", identity)
    for i, order in enumerate(seeds):
        pool.add(f"seed{i}", order)
    # With seeds (the orders a search over a wider range scored), the list schedulers and the
    # monotone refinement have already contributed: only the balanced search runs again.
    strategies = options.strategies if not seeds else ()

    def add(name: str, order: list[int]) -> None:
        if not pool.add(name, order):
            report.candidates[name] = "duplicate"

    for strategy in strategies:
        if strategy == "depth-first":
            add(strategy, depth_first(block))
        elif strategy == "refine":
            add(strategy, refine(block, identity, options.refine_evaluations, options.refine_moves))
            if block.planner == "static":
                # Storage reuse makes the search landscape flat in places; the same search on
                # plain liveness finds other moves, which are then scored with the planner.
                moves: list[tuple[tuple[int, ...], int]] = []
                refine(
                    block,
                    identity,
                    options.refine_evaluations,
                    options.refine_moves,
                    "none",
                    moves,
                )
                add("refine-liveness", replay(block, identity, moves, pool.base_exact))
        elif strategy in ("greedy-delta", "greedy-peak"):
            decider = Decider(space, None)
            add(strategy, greedy(block, strategy, decider))
            if options.point_variants and decider.met_unknown:
                for p in range(len(space.decision_points)):
                    add(f"{strategy}@{p}", greedy(block, strategy, Decider(space, p)))
    if "balanced" in options.strategies:
        budget = min(options.search_evaluations, options.search_work // max(block.n, 1))
        balanced_search(pool, budget, options.refine_moves)
    return pool


def _choose(
    block: Block, pool: Pool, options: ScheduleOptions, report: BlockReport
) -> list[int] | None:
    """The best accepted order of the pool, None when the input order stays."""
    space = block.space
    identity = list(range(block.n))
    base = profile(block, identity)
    report.points = [dict(p) for p in space.acceptance_points]
    report.peak_before = [int(v) for v in base.peaks]
    report.peak_after = list(report.peak_before)
    report.peak_expr_before = base.peak_expr(space)
    report.peak_expr_after = report.peak_expr_before

    # Candidates best first: the lowest worst-case ratio of the peak to the best peak met at
    # each acceptance point, then the lowest mean ratio; within ``options.tie`` of the best
    # both, the earliest strategy (the simplest order) first. An order is taken only when it
    # is no worse than the input at every acceptance point and better at one (proven, or
    # sampled); among the tied orders a proven one is preferred.
    names = [name for name in pool.orders if name != "input"]
    rank = {name: i for i, name in enumerate(names)}
    worst = {name: float(pool.ratios(name).max()) for name in names}
    mean = {name: float(pool.ratios(name).mean()) for name in names}
    eligible = []
    for name in names:
        peaks = pool.exact[name]
        if space.exact and not bool((peaks <= pool.base_exact).all()):
            report.candidates[name] = "rejected"
        elif space.exact and not bool((peaks < pool.base_exact).any()):
            report.candidates[name] = "no gain"
        else:
            eligible.append(name)
    eligible.sort(key=lambda x: (worst[x], mean[x], rank[x]))
    tied: set[str] = set()
    if eligible:
        top = worst[eligible[0]] * (1.0 + options.tie)
        near = [x for x in eligible if worst[x] <= top]
        low = min(mean[x] for x in near) * (1.0 + options.tie)
        tied = {x for x in near if mean[x] <= low}
    ordered = sorted(tied, key=lambda x: rank[x]) + [x for x in eligible if x not in tied]

    chosen: tuple[str, OrderProfile, bool] | None = None
    for name in ordered:
        if chosen is not None and (name not in tied or chosen[2]):
            report.candidates[name] = "not needed"
            continue
        peaks = pool.exact[name]
        no_worse = bool((peaks <= pool.base_exact).all())
        better = bool((peaks < pool.base_exact).any())
        prof = profile(block, pool.orders[name])
        proven = front_le(space, prof.front, base.front, options.proof_budget)
        if proven and better:
            report.candidates[name] = "proven"
        elif options.accept_sampled and space.exact and no_worse and better:
            report.candidates[name] = "sampled"
        else:
            report.candidates[name] = "rejected"
            continue
        if chosen is None or (proven and not chosen[2]):
            chosen = (name, prof, proven)
    if chosen is None:
        return None
    name, prof, proven = chosen
    report.strategy = name
    report.proven = proven
    report.peak_after = [int(v) for v in prof.peaks]
    report.peak_expr_after = prof.peak_expr(space)
    return prof.order


# ====================================================================== functions and modules


def _used_vars(expr: relax.Expr) -> list[relax.Var]:
    return list(relax.analysis.free_vars(expr))


@dataclass
class _Scheduled:
    """One function scheduled for one range of its dims."""

    func: relax.Function  # with the kept orders (the input object when nothing changed)
    blocks: dict[int, tuple[Block, Pool, list[int]]]  # block index: model, pool, kept order
    reports: list[BlockReport]


def _graph_of(func: relax.Function, name: str) -> ShapeGraph | None:
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not any(
        isinstance(b, relax.DataflowBlock) for b in body.blocks
    ):
        return None
    try:
        return ShapeGraph.from_function(func)
    except Exception as err:  # user IR: reading its shapes and bounds may fail in any way
        warn_fallback(
            "MemoryAwareSchedule", "dataflow blocks", name or "function", err, stacklevel=3
        )
        return None


def _dataflow_blocks(
    func: relax.Function,
) -> Iterator[tuple[int, relax.DataflowBlock, set[relax.Var], set[relax.Var], set[str]]]:
    """Each dataflow block of ``func`` with what :class:`BlockReader` needs: its index, the
    variables used after it, the function's parameters and the dims defined before it."""
    body = func.body
    blocks = list(body.blocks)
    # Variables used after each block: by later blocks or by the result.
    used_after: list[set[relax.Var]] = [set() for _ in blocks]
    later: set[relax.Var] = set(_used_vars(body.body))
    for k in range(len(blocks) - 1, -1, -1):
        used_after[k] = set(later)
        for binding in blocks[k].bindings:
            later.update(_used_vars(binding.value))
    params = set(func.params)
    tir_defined: set[str] = set()
    for p in func.params:
        tir_defined |= tir_var_names([relax.analysis.definable_tir_vars_in_type(p.ty)])
    for k, blk in enumerate(blocks):
        if isinstance(blk, relax.DataflowBlock):
            yield k, blk, used_after[k], params, set(tir_defined)
        for binding in blk.bindings:
            if isinstance(binding, relax.MatchCast):
                tir_defined |= tir_var_names(
                    [relax.analysis.definable_tir_vars_in_type(binding.ty)]
                )


def _schedule_function(
    func: relax.Function,
    mod: tvm.IRModule | None,
    options: ScheduleOptions,
    name: str,
    graph: ShapeGraph,
    version: str = "",
    seeds: dict[int, list[list[int]]] | None = None,
) -> _Scheduled:
    dataflow = {k: rest for k, *rest in _dataflow_blocks(func)}

    result = _Scheduled(func, {}, [])
    for k, blk in enumerate(func.body.blocks):
        if k in dataflow:
            _, used_after, params, tir_defined = dataflow[k]
            entry = BlockReport(
                function=name, block=k, bindings=len(blk.bindings), strategy="input"
            )
            entry.version = version
            result.reports.append(entry)
            scheduled = _schedule_one(
                blk,
                graph,
                mod,
                params,
                used_after,
                tir_defined,
                options,
                entry,
                (seeds or {}).get(k, []),
            )
            if scheduled is not None:
                result.blocks[k] = scheduled
    result.func = _with_orders(func, {k: order for k, (_, _, order) in result.blocks.items()})
    return result


def _with_orders(func: relax.Function, orders: dict[int, list[int]]) -> relax.Function:
    """``func`` with the bindings of each block ``k`` in ``orders`` reordered by
    ``orders[k]`` (``func`` itself when every order is the identity)."""
    body = func.body
    blocks = list(body.blocks)
    changed = False
    for k, order in orders.items():
        if order != list(range(len(order))):
            bindings = list(blocks[k].bindings)
            blocks[k] = relax.DataflowBlock([bindings[i] for i in order], blocks[k].span)
            changed = True
    if not changed:
        return func
    new_body = relax.SeqExpr(blocks, body.body, body.span)
    new_func = relax.Function(
        func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span
    )
    return relax.BlockBuilder().normalize(new_func)


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
    graph = _graph_of(func, name)
    if graph is None:
        return func, report
    scheduled = _schedule_function(func, mod, options, name, graph)
    report.blocks.extend(scheduled.reports)
    return scheduled.func, report


def _schedule_one(
    blk: relax.DataflowBlock,
    graph: ShapeGraph,
    mod: tvm.IRModule | None,
    params: set[relax.Var],
    used_after: set[relax.Var],
    tir_defined: set[str],
    options: ScheduleOptions,
    entry: BlockReport,
    seeds: Sequence[list[int]] = (),
) -> tuple[Block, Pool, list[int]] | None:
    """Schedule one block: its model, the pool of scored orders and the kept order (the
    identity when the input order stays), or None when the block is skipped."""
    start = time.perf_counter()
    n = len(blk.bindings)
    try:
        if n < max(options.min_bindings, 2):
            entry.strategy = "skipped: too few bindings"
            return None
        if options.max_bindings is not None and n > options.max_bindings:
            entry.strategy = "skipped: too many bindings"
            return None
        try:
            block = BlockReader(
                blk,
                graph,
                mod,
                params,
                used_after,
                tir_defined,
                options.planner,
                inplace=options.model_inplace,
                workspaces=options.model_workspaces,
            ).build()
        except (UnsupportedBlock, UnsupportedBytes) as err:
            entry.strategy = f"skipped: {err}"
            return None
        pool = _search(block, options, entry, [o for o in seeds if len(o) == block.n])
        order = _choose(block, pool, options, entry)
        if order is None or order == list(range(n)):
            entry.strategy = "input"
            order = list(range(n))
        return block, pool, order
    finally:
        entry.seconds = time.perf_counter() - start


def _function_peaks(scheduled: _Scheduled, orders: dict[int, list[int]]) -> np.ndarray | None:
    """Peaks of the function at the acceptance points: the max over its scheduled blocks of
    each block's peak with ``orders`` (the kept order where none is given)."""
    out = None
    for k, (block, _, kept) in scheduled.blocks.items():
        order = orders.get(k, kept)
        peaks = as_float(timeline(block, order).peaks).astype(np.float64)
        out = peaks if out is None else np.maximum(out, peaks)
    return out


@dataclass
class _RangeOutcome:
    """What the search of one range copy found (see :func:`_range_outcome`); it pickles
    (no IR), so that a forked process can hand it back."""

    # The kept order per scheduled block (None: the copy's blocks differ from the function's).
    orders: dict[int, list[int]] | None = None
    # Whether the copy's own orders beat the single order on the range.
    use_own: bool = False
    reports: list[BlockReport] = field(default_factory=list)
    # Why the range's graph could not be built.
    error: ValueError | None = None


def _range_outcome(
    func: relax.Function,
    mod: tvm.IRModule,
    options: ScheduleOptions,
    name: str,
    rng: DimRange,
    single: _Scheduled,
    seeds: dict[int, list[list[int]]],
) -> _RangeOutcome:
    """Schedule ``func`` for the dims in ``rng`` (the single search's orders as seeds) and
    tell whether its own orders beat the single order there."""
    try:
        sub_graph = range_graph(func, rng)
    except ValueError as err:
        return _RangeOutcome(error=err)
    sub = _schedule_function(func, mod, options, name, sub_graph, str(rng), seeds)
    if set(sub.blocks) != set(single.blocks) or any(
        sub.blocks[k][0].n != single.blocks[k][0].n for k in sub.blocks
    ):
        return _RangeOutcome()
    # The single order and the range's own, scored at the range's points by their worst
    # ratio to the best peaks met there (the range's own search saw the single order).
    kept = {k: single.blocks[k][2] for k in sub.blocks}
    single_peaks = _function_peaks(sub, kept)
    own_peaks = _function_peaks(sub, {})
    reference = np.max([np.maximum(p.reference, 1.0) for _, p, _ in sub.blocks.values()], axis=0)
    use_own = (
        single_peaks is not None
        and own_peaks is not None
        and float((single_peaks / reference).max())
        > (1.0 + options.version_gain) * float((own_peaks / reference).max())
    )
    if not use_own:
        for entry in sub.reports:
            entry.strategy = "single order kept"
    orders = {k: order for k, (_, _, order) in sub.blocks.items()}
    return _RangeOutcome(orders=orders, use_own=use_own, reports=sub.reports)


# A function whose single search took this long has its range copies searched in parallel
# (below it, a fork costs more than it saves).
_PARALLEL_SECONDS = 0.25


def _jobs(options: ScheduleOptions) -> int:
    """Processes the pass may use (``ScheduleOptions.jobs``; None: every usable CPU)."""
    return available_cpus() if options.jobs is None else options.jobs


def _versions(
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    mod: tvm.IRModule,
    options: ScheduleOptions,
    graph: ShapeGraph,
    single: _Scheduled,
    report: ScheduleReport,
) -> list[tuple[DimRange, relax.Function]] | None:
    """Range copies of ``func`` when they lower the peak (see :mod:`._versions`)."""
    found = version_dim(func, graph)
    if found is None or not single.blocks:
        return None
    var, lower, upper = found
    # Ranges are chosen on the block that holds the function's peak at most points.
    block, pool, _ = single.blocks[_main_block(single)]
    values = [int(p[var.name]) for p in block.space.acceptance_points]

    def peaks_at(name: str, dim_values: list[int]) -> np.ndarray:
        rows = timeline(block, pool.orders[name]).during
        points = [{var.name: v} for v in dim_values]
        return np.asarray(block.space.at_points(rows, points), dtype=np.float64).max(axis=0)

    ranges = choose_ranges(
        pool,
        values,
        var.name,
        lower,
        upper,
        options.max_versions,
        options.version_gain,
        peaks_at,
    )
    if len(ranges) < 2:
        return None

    seeds = {k: list(p.orders.values()) for k, (_, p, _) in single.blocks.items()}

    def outcome(rng: DimRange) -> _RangeOutcome:
        return _range_outcome(func, mod, options, gv.name_hint, rng, single, seeds)

    # The ranges' searches are independent of one another: on a large function (where the
    # single search took long) they share the CPUs (see .._parallel).
    searched = sum(entry.seconds for entry in single.reports)
    jobs = _jobs(options) if searched >= _PARALLEL_SECONDS else 1
    chosen: list[tuple[DimRange, relax.Function]] = []
    reports: list[BlockReport] = []
    gained = False
    for rng, found in zip(ranges, map_forked(outcome, ranges, jobs)):
        if found.error is not None:  # the function's graph was read: only the range can fail
            note = "one order for all shapes"
            warn_fallback(
                "MemoryAwareSchedule", "range versions", gv.name_hint, found.error, note=note
            )
            return None
        if found.orders is None:
            return None
        reports.extend(found.reports)
        if found.use_own:
            gained = True
            chosen.append((rng, _with_orders(func, found.orders)))
        else:
            chosen.append((rng, single.func))
    if not gained:
        return None
    # Merge neighbours that run the same function.
    merged: list[tuple[DimRange, relax.Function]] = []
    for rng, f in chosen:
        if merged and merged[-1][1] is f:
            prev = merged[-1][0]
            merged[-1] = (DimRange(prev.dim, prev.lower, rng.upper), f)
        else:
            merged.append((rng, f))
    if len(merged) < 2:
        return None
    report.blocks.extend(reports)
    report.versions[gv.name_hint] = [str(r) for r, _ in merged]
    return merged


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
        graph = _graph_of(func, gv.name_hint)
        if graph is None:
            continue
        single = _schedule_function(func, mod, options, gv.name_hint, graph)
        report.blocks.extend(single.reports)
        versions = None
        if options.max_versions > 1:
            versions = _versions(gv, func, mod, options, graph, single, report)
        candidates: list[tuple[str, relax.Function]] = []
        if options.recompute_after and single.blocks:
            candidates = _recompute_candidates(func, single, versions, options)
        if len(candidates) > 1:  # the input order alone needs no comparison
            block = single.blocks[_main_block(single)][0]
            chosen = _after_recompute(mod, gv, func, candidates, graph, options, block)
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
    if _graph_of(func, gv.name_hint) is None:
        return func
    graph = range_graph(func, rng)
    single_options = dataclasses.replace(options, max_versions=1, recompute_after=False)
    scheduled = _schedule_function(func, mod, single_options, gv.name_hint, graph, str(rng))
    report.blocks.extend(scheduled.reports)
    return scheduled.func


def _recomputed(
    mod: tvm.IRModule,
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    recompute: RecomputeOptions | None = None,
    fuse: FuseReaderOptions | None = None,
) -> tuple[relax.Function, tvm.IRModule]:
    """``func`` in place of ``gv`` in a copy of ``mod``, after ``RecomputeCheapValues`` with
    ``recompute`` (the options the pipeline runs it with) and, when ``fuse`` is given,
    ``FuseIntoSoleReader`` with those options: the function and the module it runs in."""
    trial = RecomputeCheapValues(recompute)(with_functions(mod, {gv: func}))
    if fuse is not None:
        trial = FuseIntoSoleReader(fuse)(trial)
    return trial[gv], trial


def _main_block(single: _Scheduled) -> int:
    """The scheduled block that holds the function's peak at the most acceptance points."""
    peaks = {k: as_float(p.base) for k, (_, p, _) in single.blocks.items()}
    top = np.max(np.array(list(peaks.values())), axis=0)
    return max(peaks, key=lambda k: int((peaks[k] >= top).sum()))


def _recompute_candidates(
    func: relax.Function,
    single: _Scheduled,
    versions: list[tuple[DimRange, relax.Function]] | None,
    options: ScheduleOptions,
) -> list[tuple[str, relax.Function]]:
    """The functions compared once more after ``RecomputeCheapValues`` (see
    ``ScheduleOptions.recompute_after``), the pass's own choice first (so it wins ties): the
    range copies or the scheduled order, the input order, then the other orders of the main
    block's pool, best ranked first, up to ``recompute_candidates`` of them and
    ``recompute_work`` bindings in all."""
    out: list[tuple[str, relax.Function]] = []
    for rng, f in versions or []:
        if all(f is not g for _, g in out):
            out.append((f"copy for {rng}", f))
    if not versions and single.func is not func:
        out.append(("scheduled", single.func))
    out.append(("input", func))
    if not single.blocks:
        return out
    size = sum(len(b.bindings) for b in func.body.blocks)
    extra = min(options.recompute_candidates, options.recompute_work // max(size, 1))
    main = _main_block(single)
    _, pool, kept = single.blocks[main]
    seen = {tuple(kept), tuple(range(len(kept)))}
    kept_orders = {k: order for k, (_, _, order) in single.blocks.items()}
    for name in sorted(pool.orders, key=pool.rank_key):
        if extra <= 0:
            break
        order = pool.orders[name]
        if tuple(order) in seen:
            continue
        seen.add(tuple(order))
        out.append((name, _with_orders(func, {**kept_orders, main: order})))
        extra -= 1
    return out


def _after_recompute(
    mod: tvm.IRModule,
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    candidates: list[tuple[str, relax.Function]],
    graph: ShapeGraph,
    options: ScheduleOptions,
    block: Block,
) -> list[tuple[DimRange | None, str, relax.Function]] | None:
    """Choose among ``candidates`` (:func:`_recompute_candidates`) by their peaks once
    ``RecomputeCheapValues`` ran on them, under the block model of ``options.planner`` (with
    ``model_inplace``, PlanMemory's in-place placements included; plain liveness where the
    model cannot read a block): see ``ScheduleOptions.recompute_after``.

    The candidates' peaks at the acceptance points form a pool, from which ranges of the
    function's dim are chosen as for range versions (:func:`choose_ranges`, up to
    ``max_versions``); each range takes the candidate with the lowest worst ratio to the best
    peak met there among those nowhere above the input order there, the earliest on ties.
    Returns ``(range, name, function)`` per range (one entry with range None when one
    function is kept for all shapes), or None when a point cannot be evaluated.
    """
    found = version_dim(func, graph)
    points = acceptance_points(graph)
    if found is not None:
        points = sorted(points, key=lambda p: p[found[0].name])
    # A candidate may be the same function under two names (a range copy that kept the input
    # order is the input): each function is recomputed and read once.
    scored: list[tuple[relax.Function, Callable[[list[dict[str, int]]], list[int]]]] = []
    scorers = {}
    for name, f in candidates:
        scorer = next((known for g, known in scored if g.same_as(f)), None)
        if scorer is None:
            scorer = _recomputed_peaks(
                mod,
                gv,
                f,
                options.planner,
                options.model_inplace,
                options.recompute_options,
                _fuse(options),
            )
            scored.append((f, scorer))
        scorers[name] = scorer
    functions = dict(candidates)
    try:
        peaks = {name: np.asarray(scorer(points)) for name, scorer in scorers.items()}
    except (ValueError, KeyError):  # a size a point cannot evaluate: no second opinion
        return None
    # The pool's orders are only keys here (each candidate is a whole function), and ``block``
    # is never scored: every peak is given.
    pool = Pool(block, peaks["input"])
    for i, (name, _) in enumerate(candidates):
        pool.add(name, [i], peaks[name])
    if found is None or options.max_versions < 2:
        name = _best(pool, np.arange(len(points)))[2]
        return [(None, name, functions[name])]
    var, lower, upper = found

    def peaks_at(name: str, values: list[int]) -> np.ndarray:
        return np.asarray(scorers[name]([{var.name: v} for v in values]), dtype=np.float64)

    values = np.array([p[var.name] for p in points], dtype=np.int64)
    ranges = choose_ranges(
        pool,
        values.tolist(),
        var.name,
        lower,
        upper,
        options.max_versions,
        options.version_gain,
        peaks_at,
    )
    out: list[tuple[DimRange | None, str, relax.Function]] = []
    for rng in ranges:
        inside = values >= rng.lower
        if rng.upper is not None:
            inside &= values <= rng.upper
        name = _best(pool, np.nonzero(inside)[0])[2]
        if out and out[-1][1] == name:
            prev = out[-1][0]
            out[-1] = (DimRange(var.name, prev.lower, rng.upper), name, functions[name])
        else:
            out.append((rng, name, functions[name]))
    if len(out) == 1:
        return [(None, out[0][1], out[0][2])]
    return out


def _fuse(options: ScheduleOptions) -> FuseReaderOptions | None:
    """The options of the ``FuseIntoSoleReader`` that follows recomputation (None: none)."""
    if not options.fuse_readers:
        return None
    return options.fuse_reader_options or FuseReaderOptions()


def _recomputed_peaks(
    mod: tvm.IRModule,
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    planner: str,
    inplace: bool = False,
    recompute: RecomputeOptions | None = None,
    fuse: FuseReaderOptions | None = None,
) -> Callable[[list[dict[str, int]]], list[int]]:
    """Peaks of ``func`` once ``RecomputeCheapValues`` (and ``FuseIntoSoleReader``, see
    :func:`_recomputed`) ran on it, under the block model of ``planner`` (plain liveness where
    the model cannot read a block)."""
    recomputed, trial = _recomputed(mod, gv, func, recompute, fuse)
    scorer = _planned_peaks(recomputed, trial, planner, inplace)
    if scorer is not None:
        return scorer
    timeline_ = memory_timeline(recomputed, mod=trial)
    return lambda points: [timeline_.evaluate(p).peak for p in points]


def _planned_peaks(
    func: relax.Function, mod: tvm.IRModule, planner: str, inplace: bool = False
) -> Callable[[list[dict[str, int]]], list[int]] | None:
    """Peaks of ``func`` as its bindings stand, under the block model of ``planner``: for
    ``"plan"`` the in-place placements and kernel workspaces of the lowered function, which
    the relax-stage timeline does not see. The function's peak at each point is the largest of
    its dataflow blocks'. None when a block cannot be read or its sizes have no exact value."""
    graph = _graph_of(func, "")
    if graph is None:
        return None
    blocks = []
    try:
        for _, blk, used_after, params, tir_defined in _dataflow_blocks(func):
            block = BlockReader(
                blk,
                graph,
                mod,
                params,
                used_after,
                tir_defined,
                planner,
                inplace=inplace,
                workspaces=True,
            ).build()
            if not block.space.exact:
                return None
            blocks.append(block)
    except (UnsupportedBlock, UnsupportedBytes):
        return None
    if not blocks:
        return None
    rows = [timeline(b, list(range(b.n))).during for b in blocks]

    def peaks(points: list[dict[str, int]]) -> list[int]:
        values = [
            np.asarray(b.space.at_points(r, points)).reshape(-1, len(points)).max(axis=0)
            for b, r in zip(blocks, rows)
        ]
        return [int(v) for v in np.max(np.array(values, dtype=object), axis=0)]

    return peaks


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
    """

    def __init__(self, options: ScheduleOptions | None = None) -> None:
        if options is not None and not isinstance(options, ScheduleOptions):
            raise TypeError(f"options must be a ScheduleOptions, got {type(options).__name__}")
        self.options = options or ScheduleOptions()
        self.report: ScheduleReport | None = None
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # The trial runs of RecomputeCheapValues (``recompute_after``) are not this run's.
        with collect_results():
            new_mod, report = schedule_module(mod, self.options)
        self.report = report
        publish(self, _schedule_result(mod, new_mod, report))
        return new_mod


# ====================================================================== the result


def _schedule_result(mod: tvm.IRModule, out: tvm.IRModule, report: ScheduleReport) -> PassResult:
    """The :class:`PassResult` of one run: each Relax function of ``mod``, then the range
    copies the run added to ``out``."""
    out_functions = {gv.name_hint: f for gv, f in out.functions.items()}
    if out is not mod:  # the peaks are read later: from the modules as they are now
        mod, out = snapshot(mod), snapshot(out)
    taken = {gv.name_hint for gv in mod.get_global_vars()}
    results: list[FunctionResult] = []
    copies: list[FunctionResult] = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        name = gv.name_hint
        new = out_functions[name]
        blocks = [b for b in report.blocks if b.function == name]
        notes = tuple(
            f"block {b.block}: {b.strategy}"
            for b in blocks
            if not b.version
            and (b.strategy.startswith("skipped") or "after recomputation" in b.strategy)
        )
        if new.same_as(func):
            results.append(FunctionResult(name, False, notes=notes))
            continue
        before = timeline_peak(func, mod)
        if name not in report.versions:
            after = timeline_peak(new, out)
            changes = _order_changes(func, new, [b for b in blocks if not b.version])
            results.append(FunctionResult(name, True, changes, before, after, notes))
            continue
        ranges = report.versions[name]
        phrase = f"dispatches over {counted(len(ranges), 'range copy', 'range copies')}"
        notes += ("ranges: " + ", ".join(ranges),)
        results.append(FunctionResult(name, True, (phrase,), before, None, notes))
        for copy_name, copy in out_functions.items():
            info = range_of(copy)
            if copy_name in taken or info is None or info[0] != name:
                continue
            in_range = [b for b in blocks if b.version == str(info[1])]
            changes = (f"range copy for {info[1]}", *_order_changes(func, copy, in_range))
            after = timeline_peak(copy, out)
            copies.append(FunctionResult(copy_name, True, changes, before, after))
    return PassResult("MemoryAwareSchedule", (*results, *copies), detail=report)


def _order_changes(
    before: relax.Function, after: relax.Function, blocks: Sequence[BlockReport]
) -> tuple[str, ...]:
    """What a new order changed: the bindings moved and the blocks reordered (with how the
    order was accepted)."""
    out = []
    moved = _bindings_moved(before, after)
    if moved:
        out.append(f"{counted(moved, 'binding')} moved")
    changed = [b for b in blocks if b.changed and b.strategy != "single order kept"]
    if changed:
        proven = sum(1 for b in changed if b.proven)
        how = "proven" if proven == len(changed) else f"{proven} proven, rest sampled"
        out.append(f"{len(changed)} of {counted(len(blocks), 'block')} reordered ({how})")
    return tuple(out)


def _bindings_moved(before: relax.Function, after: relax.Function) -> int | None:
    """The fewest bindings that, moved, turn the blocks of ``before`` into those of ``after``
    (bindings told apart by name: ``after`` may be a copy with fresh variables); ``None``
    when the blocks do not correspond."""
    old_blocks, new_blocks = before.body.blocks, after.body.blocks
    if len(old_blocks) != len(new_blocks):
        return None
    moved = 0
    for old, new in zip(old_blocks, new_blocks):
        names = [b.var.name for b in old.bindings]
        index = {n: i for i, n in enumerate(names)}
        order = [index.get(b.var.name) for b in new.bindings]
        if len(index) != len(names) or len(order) != len(names) or None in order:
            return None
        # Those outside a longest increasing subsequence of the old positions move.
        tails: list[int] = []
        for position in order:
            at = bisect.bisect_left(tails, position)
            tails[at : at + 1] = [position]
        moved += len(order) - len(tails)
    return moved

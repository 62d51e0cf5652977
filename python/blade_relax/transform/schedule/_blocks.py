"""Scheduling the dataflow blocks of one function: candidate orders searched, scored and chosen
(see the docstring of :mod:`.memory_aware_schedule` for the strategies and the acceptance rule).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax

from ...symbolic import ShapeGraph
from .._warn import warn_fallback
from ._cost import OrderProfile, UnsupportedBytes, front_le
from ._effects import UnsupportedBlock
from ._model import (
    Block,
    BlockReader,
    profile,
    timeline,
    tir_var_names,
)
from ._reports import BlockReport
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

if TYPE_CHECKING:
    from .memory_aware_schedule import ScheduleOptions


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


def _used_vars(expr: relax.Expr) -> list[relax.Var]:
    return list(relax.analysis.free_vars(expr))


@dataclass
class Scheduled:
    """One function scheduled for one range of its dims."""

    func: relax.Function  # with the kept orders (the input object when nothing changed)
    blocks: dict[int, tuple[Block, Pool, list[int]]]  # block index: model, pool, kept order
    reports: list[BlockReport]


def graph_of(func: relax.Function, name: str) -> ShapeGraph | None:
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


def dataflow_blocks(
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


def schedule_blocks(
    func: relax.Function,
    mod: tvm.IRModule | None,
    options: ScheduleOptions,
    name: str,
    graph: ShapeGraph,
    version: str = "",
    seeds: dict[int, list[list[int]]] | None = None,
) -> Scheduled:
    dataflow = {k: rest for k, *rest in dataflow_blocks(func)}

    result = Scheduled(func, {}, [])
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
    result.func = with_orders(func, {k: order for k, (_, _, order) in result.blocks.items()})
    return result


def with_orders(func: relax.Function, orders: dict[int, list[int]]) -> relax.Function:
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


def function_peaks(scheduled: Scheduled, orders: dict[int, list[int]]) -> np.ndarray | None:
    """Peaks of the function at the acceptance points: the max over its scheduled blocks of
    each block's peak with ``orders`` (the kept order where none is given)."""
    out = None
    for k, (block, _, kept) in scheduled.blocks.items():
        order = orders.get(k, kept)
        peaks = as_float(timeline(block, order).peaks).astype(np.float64)
        out = peaks if out is None else np.maximum(out, peaks)
    return out


def main_block(single: Scheduled) -> int:
    """The scheduled block that holds the function's peak at the most acceptance points."""
    peaks = {k: as_float(p.base) for k, (_, p, _) in single.blocks.items()}
    top = np.max(np.array(list(peaks.values())), axis=0)
    return max(peaks, key=lambda k: int((peaks[k] >= top).sum()))

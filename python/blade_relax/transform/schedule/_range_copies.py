"""Range copies of a function: its blocks scheduled again for each range of one dim, kept where
their own orders beat the single order (see :mod:`._versions` for how ranges are chosen).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax

from ...symbolic import ShapeGraph
from .._parallel import available_cpus, map_forked
from .._warn import warn_fallback
from ..dispatch import DimRange
from ._blocks import Scheduled, function_peaks, main_block, schedule_blocks, with_orders
from ._model import (
    timeline,
)
from ._reports import BlockReport, ScheduleReport
from ._versions import (
    choose_ranges,
    range_graph,
    version_dim,
)

if TYPE_CHECKING:
    from .memory_aware_schedule import ScheduleOptions


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
    single: Scheduled,
    seeds: dict[int, list[list[int]]],
) -> _RangeOutcome:
    """Schedule ``func`` for the dims in ``rng`` (the single search's orders as seeds) and
    tell whether its own orders beat the single order there."""
    try:
        sub_graph = range_graph(func, rng)
    except ValueError as err:
        return _RangeOutcome(error=err)
    sub = schedule_blocks(func, mod, options, name, sub_graph, str(rng), seeds)
    if set(sub.blocks) != set(single.blocks) or any(
        sub.blocks[k][0].n != single.blocks[k][0].n for k in sub.blocks
    ):
        return _RangeOutcome()
    # The single order and the range's own, scored at the range's points by their worst
    # ratio to the best peaks met there (the range's own search saw the single order).
    kept = {k: single.blocks[k][2] for k in sub.blocks}
    single_peaks = function_peaks(sub, kept)
    own_peaks = function_peaks(sub, {})
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


def range_copies(
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    mod: tvm.IRModule,
    options: ScheduleOptions,
    graph: ShapeGraph,
    single: Scheduled,
    report: ScheduleReport,
) -> list[tuple[DimRange, relax.Function]] | None:
    """Range copies of ``func`` when they lower the peak (see :mod:`._versions`)."""
    found = version_dim(func, graph)
    if found is None or not single.blocks:
        return None
    var, lower, upper = found
    # Ranges are chosen on the block that holds the function's peak at most points.
    block, pool, _ = single.blocks[main_block(single)]
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
            chosen.append((rng, with_orders(func, found.orders)))
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

"""The schedule's choice compared once more after recomputation, as the pipeline runs it
(``ScheduleOptions.recompute_after``): each candidate function recomputed by
``RecomputeCheapValues`` with the pipeline's options (and ``FuseIntoSoleReader`` when it
follows), scored by the block model of the planner, and ranges chosen again from those figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax

from ...analysis import memory_timeline
from ...symbolic import ShapeGraph
from ..dispatch import DimRange
from ..fuse_into_sole_reader import FuseIntoSoleReader, FuseReaderOptions
from ..recompute_cheap_values import RecomputeCheapValues, RecomputeOptions
from ..result import differs, with_functions
from ._blocks import Scheduled, dataflow_blocks, graph_of, main_block, with_orders
from ._cost import UnsupportedBytes, acceptance_points
from ._effects import UnsupportedBlock
from ._model import (
    Block,
    BlockReader,
    timeline,
)
from ._search import (
    Pool,
)
from ._versions import (
    _best,
    choose_ranges,
    version_dim,
)

if TYPE_CHECKING:
    from .memory_aware_schedule import ScheduleOptions


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


def recompute_candidates(
    func: relax.Function,
    single: Scheduled,
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
    main = main_block(single)
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
        out.append((name, with_orders(func, {**kept_orders, main: order})))
        extra -= 1
    return out


def after_recompute(
    mod: tvm.IRModule,
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    candidates: list[tuple[str, relax.Function]],
    graph: ShapeGraph,
    options: ScheduleOptions,
    block: Block,
) -> list[tuple[DimRange | None, str, relax.Function]] | None:
    """Choose among ``candidates`` (:func:`recompute_candidates`) by their peaks once
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
    # order is the input; a range's own order is often one of the pool's, in another copy of
    # the function): each function is recomputed and read once.
    scored: list[tuple[relax.Function, Callable[[list[dict[str, int]]], list[int]]]] = []
    scorers = {}
    for name, f in candidates:
        scorer = next((known for g, known in scored if not differs(g, f)), None)
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
    graph = graph_of(func, "")
    if graph is None:
        return None
    blocks = []
    try:
        for _, blk, used_after, params, tir_defined in dataflow_blocks(func):
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

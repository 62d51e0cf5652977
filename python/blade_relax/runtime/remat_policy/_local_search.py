"""The local searches of the smallest peak, each from its own start.

:func:`_minimum` adds (or puts back) one slot at a time from no eviction;
:func:`_minimum_from_all` keeps one slot at a time from every eviction; :func:`_greedy_minimum`
is the budget greedy aimed at a target; :func:`_refine` chooses, per chained input, whether
it is kept (the mixed regime). :func:`~._search.minimum_peak` runs them and keeps the best.
"""

from __future__ import annotations

import numpy as np

from ._calls import _chain_inputs
from ._evaluation import Evaluation, _evaluate_many, _peak_event, evaluate
from ._floor import _lowest_live, _returns_above
from ._greedy import _gains, _greedy_toward
from ._neighbours import _evaluate_neighbours
from ._timeline import ConcreteTimeline, Regime, effective_slots


def _covering(tl: ConcreteTimeline, at: int) -> list[int]:
    """The effective slots whose window covers point ``at``, in index order."""
    return np.flatnonzero(tl.window_mask()[:, at] & tl._effective_mask).tolist()


# At most this many additions are tried exactly per step of the minimum search (the best by
# the estimate of :func:`_gains`).
_TRIALS = 8


def _minimum(tl: ConcreteTimeline, cache: bool, limit: int = -1) -> tuple[set[int], int]:
    """Local search for the smallest peak in one regime: add or put back one slot at a time,
    until the peak is within ``limit``."""
    candidates = effective_slots(tl)
    chosen: set[int] = set()
    ev = evaluate(tl, chosen, cache)
    for _ in range(4 * len(candidates) + 4):
        if ev.peak <= limit:
            break
        at, making = _peak_event(ev)
        trials: list[set[int]] = []
        gains = _gains(tl, ev, ev.peak - 1).tolist()
        covering = [x for x in _covering(tl, at) if x not in chosen]
        order = sorted(covering, key=lambda c: -gains[c])[:_TRIALS]
        trials.extend(chosen | {x} for x in order)
        # A regeneration makes the peak: keep one of the slots it recomputes instead.
        returns = [] if making is None else list(chosen & tl._plan_slots[making])
        trials.extend(chosen - {x} for x in returns)
        if cache is False:
            # (From this set's evaluation: see _TempNeighbours.)
            results = _evaluate_neighbours(tl, frozenset(chosen), ev, order, True)
            results += _evaluate_neighbours(tl, frozenset(chosen), ev, returns, False)
        else:
            results = _evaluate_many(tl, [(t, cache) for t in trials])
        best: tuple[int, float, set[int]] | None = None
        for trial, result in zip(trials, results):
            key = (result.peak, result.cost)
            if best is None or key < best[:2]:
                best = (result.peak, result.cost, trial)
        if best is None or best[0] >= ev.peak:
            break
        chosen = best[2]
        ev = evaluate(tl, chosen, cache)
    return chosen, ev.peak


def _minimum_from_all(tl: ConcreteTimeline, cache: bool) -> tuple[set[int], int]:
    """Greedy from the other end: evict everything, then keep, one at a time, the slot whose
    return lowers the peak most (ties: the cost most), while the peak does not rise.

    Keeping a slot cuts every chain through it (a checkpoint), which the additive search
    rarely reaches when long chains of regenerations make the peak.
    """
    chosen = set(effective_slots(tl))
    ev = evaluate(tl, chosen, cache)
    while chosen:
        # Rank every return once, then apply them in that order while each still helps: one
        # pass applies many returns for about the evaluations of one greedy step.
        # A return that surely peaks above the current peak is never applied: not evaluated.
        lowest = _lowest_live(tl, chosen)
        returns = [x for x in chosen if not _returns_above(tl, lowest, x, ev.peak)]
        results = _evaluate_many(tl, [(chosen - {x}, cache) for x in returns])
        ranked = sorted((result.peak, result.cost, x) for x, result in zip(returns, results))
        changed = False
        for peak, _, x in ranked:
            if peak > ev.peak:
                break
            result = evaluate(tl, chosen - {x}, cache)
            if result.peak < ev.peak or (result.peak == ev.peak and result.cost < ev.cost):
                chosen.discard(x)
                ev = result
                changed = True
        if not changed:
            break
    return chosen, ev.peak


def _greedy_minimum(tl: ConcreteTimeline, target: int, cache: bool) -> tuple[set[int], int]:
    """:func:`_greedy_toward` over every effective slot, as a search of the minimum."""
    chosen, ev = _greedy_toward(tl, effective_slots(tl), target, cache)
    return chosen, ev.peak


# Rounds of the mixed-regime refinement of the minimum search.
_REFINE_ROUNDS = 48


def _refine(
    tl: ConcreteTimeline, chosen: set[int], cache: Regime, limit: int = -1
) -> tuple[frozenset[int], frozenset[int]]:
    """Lower the peak of ``(chosen, cache)`` by choosing, per chained input, whether it is
    kept once materialized, while adding or dropping evictions.

    A chained input kept from an early site to its own holds its bytes over every point in
    between; recomputed as a temporary it costs a second recomputation but no memory there.
    Each round tries every such switch, every eviction of one of the slots whose window covers
    the peak (the most promising few), and dropping one of the slots a regeneration at the peak
    recomputes; the best move by (peak, cost) is taken while it lowers the peak.
    """
    evicted = frozenset(chosen)
    if isinstance(cache, bool):
        keep = frozenset(_chain_inputs(tl, evicted)) if cache else frozenset()
    else:
        keep = frozenset(cache)
    ev = evaluate(tl, evicted, keep)
    for _ in range(_REFINE_ROUNDS):
        if ev.peak <= limit:
            break
        at, making = _peak_event(ev)
        # Kept materializations whose bytes are back at the peak (materialized at an earlier
        # site, needed at a later one): as temporaries they would not be there.
        covering = frozenset(
            x for site, _, x in ev.events if x in keep and site < at <= tl.slots[x].site
        )
        trials: list[tuple[frozenset[int], frozenset[int]]] = []
        for x in _chain_inputs(tl, evicted):
            trials.append((evicted, keep ^ {x}))
        if covering:
            trials.append((evicted, keep - covering))
        gains = _gains(tl, ev, ev.peak - 1).tolist()
        order = sorted(
            (x for x in _covering(tl, at) if x not in evicted),
            key=lambda c: -gains[c],
        )
        for x in order[:_TRIALS]:
            trials.append((evicted | {x}, keep))
            trials.append((evicted | {x}, keep | {x}))
            trials.append((evicted | {x}, (keep - covering) | {x}))
            trials.append((evicted | {x}, frozenset({x})))
        if making is not None:
            for x in evicted & tl._plan_slots[making]:
                trials.append((evicted - {x}, keep - {x}))
        best: tuple[int, float, frozenset[int], frozenset[int], Evaluation] | None = None
        for (trial_evicted, trial_keep), result in zip(trials, _evaluate_many(tl, trials)):
            key = (result.peak, result.cost)
            if best is None or key < best[:2]:
                best = (result.peak, result.cost, trial_evicted, trial_keep, result)
        if best is None or best[0] >= ev.peak:
            break
        evicted, keep, ev = best[2], best[3], best[4]
    return evicted, keep

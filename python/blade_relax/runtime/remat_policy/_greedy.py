"""The greedy: evict, one at a time, the slot that removes the most bytes above a target per
unit of cost, then put back what the target does not need.

:func:`_gains` estimates each slot's bytes above the target (chains ignored);
:func:`_greedy_run` adds slots by that estimate, :func:`_prune` puts back the dearest ones the
limit does not need, and :func:`_greedy` is the budget decision of one regime.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._evaluation import Decision, Evaluation, _decision, evaluate
from ._floor import _lowest_live, _returns_above
from ._neighbours import _evaluate_neighbours
from ._timeline import ConcreteTimeline, Regime


def _gains(tl: ConcreteTimeline, ev: Evaluation, budget: int) -> np.ndarray:
    """For every slot, the bytes above ``budget`` its eviction would remove (chains ignored)."""
    nbytes = tl._nbytes
    high = ev.events_above(budget)
    if tl._sizes_nonnegative:
        # Only the points above the budget gain anything, at most the slot's bytes each; so
        # does each regeneration above the budget, when a slot is missing at its site. (The
        # slot's bytes where its window covers a point, else 0: one minimum for both.)
        above = np.flatnonzero(ev.live > budget)
        if high:
            columns = np.concatenate((above, [site for site, _, _ in high]))
            over = np.concatenate((ev.live[above], [value for _, value, _ in high]))
        else:
            columns, over = above, ev.live[above]
        over -= budget
        gain = np.minimum(tl.window_bytes()[:, columns], over).sum(axis=1)
    else:
        mask = tl.window_mask()
        over = np.maximum(ev.live - budget, 0)
        after = np.maximum(ev.live[None, :] - nbytes[:, None] - budget, 0)
        gain = ((over[None, :] - after) * mask).sum(axis=1)
        if high:
            values = np.array([value for _, value, _ in high], dtype=np.int64)
            excess = np.minimum(values[None, :] - budget, nbytes[:, None])
            gain = gain + np.where(mask[:, [site for site, _, _ in high]], excess, 0).sum(axis=1)
    own = ev.live[tl._site] - nbytes + tl._regen
    return gain - np.maximum(own - budget, 0)


def _prune(tl: ConcreteTimeline, chosen: set[int], cache: Regime, limit: int) -> set[int]:
    """Put back every slot (dearest first) whose eviction the limit does not need."""
    lowest = _lowest_live(tl, chosen)
    # (In the temp regime, each trial from the set's evaluation: see _TempNeighbours.)
    temp = cache is False
    ev = evaluate(tl, chosen, cache) if temp else None
    for x in sorted(chosen, key=lambda s: (-tl.slots[s].cost, s)):
        if _returns_above(tl, lowest, x, limit):
            continue
        trial = chosen - {x}
        if temp:
            (result,) = _evaluate_neighbours(tl, frozenset(chosen), ev, [x], False)
        else:
            result = evaluate(tl, trial, cache)
        if result.peak <= limit:
            chosen, ev = trial, result
            if lowest is not None and tl._effective_mask[x]:
                lowest[tl.slots[x].start : tl.slots[x].site + 1] += tl.slots[x].nbytes
    return chosen


def _greedy_toward(
    tl: ConcreteTimeline, candidates: Sequence[int], target: int, cache: bool
) -> tuple[set[int], Evaluation]:
    """:func:`_greedy_run`, remembered per search: a budget decision's greedy is also one of
    the minimum search's when the budget is one of its targets."""
    key = (tuple(candidates), target, cache)
    found = tl._greedy_runs.get(key)
    if found is None:
        chosen, ev = _greedy_run(tl, candidates, target, cache)
        found = tl._greedy_runs[key] = (frozenset(chosen), ev)
    return set(found[0]), found[1]


def _greedy_run(
    tl: ConcreteTimeline, candidates: Sequence[int], target: int, cache: bool
) -> tuple[set[int], Evaluation]:
    """Evict, one at a time, the candidate with the most bytes above ``target`` removed per
    unit of cost, until the peak is within ``target`` or no eviction removes any."""
    allowed = np.zeros(len(tl.slots), dtype=bool)
    allowed[list(candidates)] = True
    chosen: set[int] = set()
    ev = evaluate(tl, chosen, cache)
    while ev.peak > target:
        gains = np.where(allowed, _gains(tl, ev, target), 0)
        if gains.max() <= 0:
            break
        best = int(np.argmax(gains / tl._costs))
        if cache is False:
            (ev,) = _evaluate_neighbours(tl, frozenset(chosen), ev, [best], True)
        else:
            ev = evaluate(tl, chosen | {best}, cache)
        chosen.add(best)
        allowed[best] = False
    return chosen, ev


def _greedy(
    tl: ConcreteTimeline, candidates: Sequence[int], budget: int, cache: bool
) -> Decision | None:
    """The greedy eviction set that fits ``budget`` in one regime, or ``None``."""
    chosen, ev = _greedy_toward(tl, candidates, budget, cache)
    if ev.peak > budget:
        return None
    return _decision(tl, _prune(tl, chosen, cache, budget), cache, budget)

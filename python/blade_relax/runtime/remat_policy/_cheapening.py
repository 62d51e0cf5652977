"""Cheapening: lower the recompute cost of an eviction set that fits its budget, keeping it
within.

The searches that find a fitting set choose by bytes per unit of cost or by peak, one slot at
a time, and leave work the budget does not need. :func:`_cheapen` puts back dear evictions and
repairs with cheaper ones (:func:`_put_back`, :func:`_repair`), or swaps a large tensor in for
what it makes unnecessary (:func:`_swap_in`); :func:`_keep_more` keeps chained inputs once
materialized where the budget allows. Every move is evaluated exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ._calls import _chain_inputs
from ._evaluation import Evaluation, _cost, _evaluate_many, evaluate, predict_peak
from ._greedy import _gains, _prune
from ._neighbours import _evaluate_neighbours, _TempNeighbours
from ._timeline import ConcreteTimeline, Regime, effective_slots

# Most improvements :func:`_cheapen` makes to one decision (each lowers its cost), the moves
# of each kind a round tries, and the additions a step of its repair evaluates exactly (the
# best by the estimate of :func:`_gains`).
_CHEAPEN_ROUNDS = 8
_CHEAPEN_TRIES = 2
_SWAP_TRIES = 4
_REPAIR_TRIALS = 2
# After its first round, :func:`_cheapen` evaluates the saving of this many evictions per
# put-back it tries (the dearest of the previous round) besides the new ones; :func:`_swap_in`
# tries to put back as many of the old evictions.
_SAVING_CANDIDATES = 4


def _excess(ev: Evaluation, budget: int) -> int:
    """Bytes above ``budget``, summed over the points and the materializations.

    A repair step asks again for the set the previous step chose: remembered per budget.
    """
    found = ev.excess.get(budget)
    if found is None:
        over = ev.live - budget
        above = sum(value - budget for _, value, _ in ev.events_above(budget))
        found = ev.excess[budget] = int(over[over > 0].sum()) + above
    return found


def _repair(
    tl: ConcreteTimeline,
    chosen: set[int],
    allowed: np.ndarray,
    budget: int,
    cache: Regime,
    cost_limit: float,
) -> set[int] | None:
    """Add evictions from ``allowed`` to ``chosen`` until it fits ``budget``, or ``None``.

    Each step evaluates the few most promising additions (bytes above the budget removed per
    unit of cost, as estimated by :func:`_gains`) exactly: the cheapest that fits ends the
    repair, else the one that removes the most bytes above the budget per unit of cost is
    taken. The estimate ignores chains (an eviction whose regeneration recomputes another
    evicted slot may raise a peak elsewhere), the exact evaluation does not. The repair
    gives up when nothing removes bytes above the budget, or at ``cost_limit``.
    """
    allowed = allowed.copy()
    allowed[list(chosen)] = False
    costs = tl._costs
    ev = evaluate(tl, chosen, cache)
    while ev.peak > budget:
        if ev.cost >= cost_limit:
            return None
        gains = np.where(allowed, _gains(tl, ev, budget), 0)
        order = [int(x) for x in np.argsort(-gains / costs, kind="stable")[:_REPAIR_TRIALS]]
        order = [x for x in order if gains[x] > 0]
        if not order:
            return None
        excess = _excess(ev, budget)
        fits: tuple[float, int] | None = None
        best: tuple[float, int, Evaluation] | None = None
        if cache is False:
            results = _evaluate_neighbours(tl, frozenset(chosen), ev, order, True)
        else:
            results = _evaluate_many(tl, [(chosen | {x}, cache) for x in order])
        for x, result in zip(order, results):
            if result.peak <= budget:
                if fits is None or result.cost < fits[0]:
                    fits = (result.cost, x)
                continue
            score = (excess - _excess(result, budget)) / costs[x]
            if score > 0 and (best is None or score > best[0]):
                best = (score, x, result)
        if fits is not None:
            chosen = chosen | {fits[1]}
            break
        if best is None:
            return None
        chosen = chosen | {best[1]}
        allowed[best[1]] = False
        ev = best[2]
    return chosen


def _put_back(
    tl: ConcreteTimeline,
    chosen: set[int],
    x: int,
    effective: np.ndarray,
    cache: Regime,
    budget: int,
) -> set[int] | None:
    """``chosen`` with slot ``x`` put back and other evictions in its place, or ``None``."""
    allowed = effective.copy()
    allowed[x] = False
    cost_limit = evaluate(tl, chosen, cache).cost
    repaired = _repair(tl, chosen - {x}, allowed, budget, cache, cost_limit)
    return None if repaired is None else _prune(tl, repaired, cache, budget)


def _swap_in(
    tl: ConcreteTimeline,
    chosen: set[int],
    y: int,
    effective: np.ndarray,
    cache: Regime,
    budget: int,
) -> set[int] | None:
    """``chosen`` with slot ``y`` evicted in place of what it makes unnecessary, or ``None``.

    ``y``'s chained inputs are put back first: evicted with it, a regeneration of ``y``
    materializes them early (kept from its site to theirs, in the cache regime), which is
    what makes a large tensor look useless to evict one slot at a time. Evictions that the
    set then misses are repaired (:func:`_repair`), and the old evictions that are not
    needed any more are put back (the dearest few, dearest first) before ``y`` itself may be.
    """
    inputs = tl._plan_slots[y] - {y}
    trial = (chosen | {y}) - inputs
    allowed = effective.copy()
    allowed[list(inputs | {y})] = False
    cost_limit = evaluate(tl, chosen, cache).cost
    repaired = _repair(tl, trial, allowed, budget, cache, cost_limit)
    if repaired is None:
        return None
    # The dearest few only: trying every old eviction (hundreds in a deep model) dominated
    # the decision.
    dearest = sorted(repaired & chosen, key=lambda s: (-tl.slots[s].cost, s))
    for x in dearest[: _CHEAPEN_TRIES * _SAVING_CANDIDATES]:
        if predict_peak(tl, repaired - {x}, cache) <= budget:
            repaired = repaired - {x}
    return _prune(tl, repaired, cache, budget)


def _cheapen(
    tl: ConcreteTimeline, chosen: Iterable[int], cache: Regime, budget: int, swap: bool = True
) -> set[int]:
    """Lower the recompute cost of an eviction set that fits ``budget``, keeping it within.

    The searches that find a fitting set choose evictions by bytes removed per unit of cost,
    one at a time, or by peak: an early choice that a later one made unnecessary stays, and
    an expensive tensor may hold the place of a cheaper pair; a large tensor whose eviction
    would replace several small ones is never chosen when, evicted alongside its own chained
    inputs, its regeneration raises a peak. Each round tries two kinds of moves and takes the
    first that fits and costs less: put back one of the evictions whose return saves the most
    work and repair (:func:`_put_back`), then, when ``swap``, evict one of the slots that free
    the most bytes over their window in place of what it makes unnecessary (:func:`_swap_in`).
    Every move is evaluated exactly, and ties go to the lower index: the result is
    deterministic.
    """
    chosen = set(chosen)
    ev = evaluate(tl, chosen, cache)
    if ev.peak > budget:
        return chosen
    effective = np.zeros(len(tl.slots), dtype=bool)
    effective[effective_slots(tl)] = True
    # Slots that free the most bytes over their window first (ties: the lower index).
    volume = [
        (-(tl.slots[y].nbytes * (tl.slots[y].site - tl.slots[y].start + 1)), y)
        for y in effective_slots(tl)
    ]
    largest = [y for _, y in sorted(volume)]
    saving: dict[int, float] = {}
    for _ in range(_CHEAPEN_ROUNDS):
        # Dearest by the work putting it back saves: a chained input recomputed as a
        # temporary costs once per regeneration that reads it, not its own cost once.
        # Evaluated exactly for every eviction in the first round; after it, for the dearest
        # of the previous round and the new evictions only (a move changes a few evictions,
        # and re-evaluating hundreds every round dominated a deep model's decision).
        if saving:
            previous = sorted(saving, key=lambda s: (-saving[s], s))
            fresh = [x for x in previous[: _CHEAPEN_TRIES * _SAVING_CANDIDATES] if x in chosen]
            fresh += sorted(chosen - saving.keys())
        else:
            fresh = sorted(chosen)
        if cache is False:
            removed = _TempNeighbours(tl, ev).removed
            exact = {x: ev.cost - removed(x).cost for x in fresh}
        else:
            exact = {x: ev.cost - _cost(tl, chosen - {x}, cache) for x in fresh}
        saving = {x: exact.get(x, saving.get(x, 0.0)) for x in chosen}
        dearest = sorted(chosen, key=lambda s: (-saving[s], s))[:_CHEAPEN_TRIES]
        moves = [(_put_back, x) for x in dearest]
        # (A slot that alone costs what the set costs cannot take the place of anything.)
        swaps = [y for y in largest if y not in chosen][: _SWAP_TRIES if swap else 0]
        moves += [(_swap_in, y) for y in swaps if tl.slots[y].cost < ev.cost]
        found = None
        for move, x in moves:
            trial = move(tl, chosen, x, effective, cache, budget)
            if trial is None:
                continue
            result = evaluate(tl, trial, cache)
            if result.peak <= budget and result.cost < ev.cost:
                found = (trial, result)
                break
        if found is None:
            break
        chosen, ev = found
    return chosen


def _keep_more(
    tl: ConcreteTimeline, evicted: frozenset[int], keep: frozenset[int], budget: int
) -> frozenset[int]:
    """Keep more of the chained inputs of ``evicted`` while it fits ``budget`` and costs less.

    A chained input kept is recomputed once, not once per regeneration that reads it, and
    holds its bytes in between. Keeping each input not kept yet is evaluated once; those that
    fit and cost less are then kept one at a time, cheapest first (ties: the lower index),
    each while the set still fits and costs less. (Evaluating every input again after each
    one kept, and keeping the cheapest, made the same decisions on the 3,970 recorded ones of
    the bench's and random timelines, for about three times the evaluations.) The pure regimes
    are the two ends, and a search that reaches the budget in one of them may leave this work
    on the table.
    """
    inputs = sorted(_chain_inputs(tl, evicted) - keep)
    ev = evaluate(tl, evicted, keep)
    trials = [(evicted, keep | {x}) for x in inputs]
    ranked = sorted(
        (result.cost, x)
        for x, result in zip(inputs, _evaluate_many(tl, trials))
        if result.peak <= budget and result.cost < ev.cost
    )
    for _, x in ranked:
        result = evaluate(tl, evicted, keep | {x})
        if result.peak <= budget and result.cost < ev.cost:
            keep, ev = keep | {x}, result
    return keep

"""The decision: :func:`decide` (the cheapest set within a budget) and :func:`minimum_peak`
(the smallest peak the evictions reach), and the searches they run.

:func:`decide` tries every subset on few slots (:func:`_exact`), else the greedy in both
regimes, made cheaper (:mod:`._cheapening`); when no greedy set fits, :func:`minimum_peak`
runs its rounds of local searches (:mod:`._local_search`). The package docstring
(:mod:`blade_relax.runtime.remat_policy`) tells the whole story.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from ._calls import _chain_inputs
from ._cheapening import _cheapen, _keep_more
from ._evaluation import Decision, _decision, _peak_event, evaluate, predict_peak
from ._floor import _peak_is_fixed
from ._greedy import _greedy, _prune
from ._local_search import _greedy_minimum, _minimum, _minimum_from_all, _refine
from ._timeline import ConcreteTimeline, Regime, _forgets_runs, _kept, effective_slots

# Up to this many slots that can free memory, the decision tries every subset.
EXACT_LIMIT = 10


def _exact(tl: ConcreteTimeline, candidates: Sequence[int], budget: int) -> Decision:
    """Every subset in both regimes: the cheapest that fits, else the smallest peak.

    Each evicted slot is recomputed at least once, so a subset costs at least the sum of its
    slots' own costs (when none is negative): subsets are tried in the order of that bound,
    and once one fits, those whose bound exceeds its cost are not evaluated. Ties go to the
    smaller subset, then the first in ``itertools.combinations`` order, as if every subset
    had been tried.
    """
    subsets = [s for n in range(len(candidates) + 1) for s in itertools.combinations(candidates, n)]
    costs = [slot.cost for slot in tl.slots]
    bounded = all(c >= 0 for c in costs)
    lower = [sum(costs[k] for k in s) if bounded else 0.0 for s in subsets]
    best_fit: tuple | None = None
    best_peak: tuple | None = None
    for i in sorted(range(len(subsets)), key=lower.__getitem__):
        if best_fit is not None and bounded and lower[i] > best_fit[0]:
            break
        subset = subsets[i]
        for cache in (True, False):
            ev = evaluate(tl, subset, cache)
            if ev.peak <= budget:
                key = (ev.cost, ev.peak, not cache, len(subset), subset)
                if best_fit is None or key < best_fit:
                    best_fit = key
            else:
                key = (ev.peak, ev.cost, not cache, len(subset), subset)
                if best_peak is None or key < best_peak:
                    best_peak = key
    chosen = best_fit if best_fit is not None else best_peak
    assert chosen is not None
    return _decision(tl, chosen[4], not chosen[2], budget)


# How many of the minimum search's greedy results are refined as well as its local searches'
# (the best).
_REFINED_GREEDY = 2
# Targets (fractions of the unevicted peak) of the greedy starts of the minimum search.
_GREEDY_TARGETS = (0.9, 0.8, 0.7, 0.6, 0.5)

# One result of a search of the minimum: (peak, cost, not cache, evicted, cache, whether it
# comes from a local search).
_Result = tuple[int, float, bool, set[int], bool, bool]


def _enough(peak: int, floor: int, budget: int | None) -> bool:
    """Whether a search of the minimum may stop at ``peak``: no set peaks below the floor,
    and with a budget any set within it will do (it is made cheaper afterwards)."""
    return peak <= floor or (budget is not None and peak <= budget)


def _searched(
    tl: ConcreteTimeline, search: Callable, cache: bool, local: bool, budget: int | None
) -> _Result:
    """``search``'s result in ``cache``, without the evictions its peak (or the budget, if
    larger) does not need."""
    chosen, peak = search(tl, cache=cache)
    limit = peak if budget is None else max(peak, budget)
    chosen = _prune(tl, chosen, cache, limit)
    ev = evaluate(tl, chosen, cache)
    return (ev.peak, ev.cost, not cache, chosen, cache, local)


def _local_results(
    tl: ConcreteTimeline,
    budget: int | None,
    floor: int,
    regimes: tuple[bool, ...] = (True, False),
) -> list[_Result]:
    """The local searches of one round (:func:`_minimum` in each regime), the first that is
    enough ending them. They stop at the floor, where none goes lower. (Stopping them within
    a budget as well hands a set of more evictions to the cheapening: on gpt2-train it then
    ends 19 % dearer.)"""
    results: list[_Result] = []
    for cache in regimes:
        local = functools.partial(_minimum, limit=floor)
        results.append(_searched(tl, local, cache, True, budget))
        if _enough(results[-1][0], floor, budget):
            break
    return results


def _minimum_once(
    tl: ConcreteTimeline,
    budget: int | None,
    floor: int,
    results: list[_Result],
    dearest: bool = True,
) -> Decision:
    """The searches of one round of :func:`minimum_peak` (see there) after its local
    searches, whose ``results`` are given; ``dearest``: whether the search from every
    eviction runs (last). The searches stop at ``floor`` (no set goes below it; -1 when it
    is not built) or within the budget."""

    def enough(peak: int) -> bool:
        return _enough(peak, floor, budget)

    results = list(results)
    # (search, regime), the cheapest first: the searches stop at the first result that is
    # enough. The greedy that budget decisions use, aimed at fractions of the unevicted peak:
    # it may reach a lower peak than the local searches, and the minimum must not be above a
    # peak that a budget decision reaches.
    searches: list[tuple[Callable, bool]] = []
    for fraction in _GREEDY_TARGETS:
        search = functools.partial(_greedy_minimum, target=int(fraction * tl.base_peak))
        searches.append((search, False))
    # The dearest last: it evaluates the return of every evicted slot in each of its rounds.
    if dearest:
        searches.append((_minimum_from_all, True))
    if not any(enough(r[0]) for r in results):
        for search, cache in searches:
            results.append(_searched(tl, search, cache, search is _minimum_from_all, budget))
            if enough(results[-1][0]):
                break
    peak, cost, _, chosen, cache, _ = min(results, key=lambda r: r[:3])
    if enough(peak):
        return _decision(tl, chosen, cache, budget)
    # The searches end in different places: refine each local search's result and the
    # best few greedy ones, keep the best.
    greedy = sorted((r for r in results if not r[5]), key=lambda r: (*r[:3], sorted(r[3])))
    starts = [r for r in results if r[5]] + greedy[:_REFINED_GREEDY]
    refined = []
    for _, _, _, start, regime, _ in starts:
        evicted, keep = _refine(tl, start, regime, floor)
        ev = evaluate(tl, evicted, keep)
        refined.append((ev.peak, ev.cost, evicted, keep))
        if enough(ev.peak):
            break
    best_peak, _, evicted, keep = min(refined, key=lambda r: r[:2])
    if best_peak < peak:
        limit = best_peak if budget is None else max(best_peak, budget)
        evicted = frozenset(_prune(tl, set(evicted), keep, limit))
        # A kept slot that is no chained input any more keeps nothing: normalize.
        keep = keep & frozenset(_chain_inputs(tl, evicted))
        return _decision(tl, evicted, keep, budget)
    return _decision(tl, chosen, cache, budget)


# Rounds of the minimum search that keep the tensor whose regeneration made the last peak.
_KEEP_ROUNDS = 2


@_forgets_runs
def minimum_peak(tl: ConcreteTimeline, budget: int | None = None) -> Decision:
    """The smallest predicted peak the evictions can reach (local searches), at least cost.

    The searches of one round are described below. When the best result peaks at a
    regeneration, the local searches all went through evicting that tensor, which may be a
    trap: its regeneration (often several times its size, e.g. attention scores and
    probabilities) costs more than what keeping it costs, but every step away from it raises
    the peak first. Up to ``_KEEP_ROUNDS`` more rounds run with that tensor kept (and the ones
    kept before), and the best result of all rounds wins.

    One round: local searches, the best result wins. (1) In each regime, starting from no
    eviction, repeatedly take the best of: evicting one of the slots whose window covers the
    current peak (the most promising few, tried exactly), or, when a regeneration makes the
    peak, keeping one of the slots it recomputes; stop when none lowers the peak. (2) In the
    cache regime, starting from every eviction, keep one slot at a time (checkpoints) while
    the peak does not rise; in the first round only. (2b) The greedy of budget decisions aimed
    at 0.9 .. 0.5 of the unevicted peak, so that the minimum is never above a peak a budget
    decision reaches, in the temp regime only (with the cache regime's greedy starts as well,
    the minimum was the same on every timeline of the decision benches, and on 314 of 322
    random ones, lower on 2 and higher on 6). (3) From the results of (1), (2) and the best
    two of (2b), a mixed regime: per chained input, kept or a temporary (:func:`_refine`).
    Then put back every slot that the reached peak (or ``budget``, if larger) does not need.
    The searches run cheapest first, (2) last, and stop at the first result at the floor
    (``ConcreteTimeline.unevictable``: no set peaks lower) or within ``budget``; so do the
    refinements and the rounds, and the local searches and refinements stop at their first
    set at the floor.

    With a budget, a first pass runs the local searches (1) of every round and nothing else
    (:func:`_minimum_sweeps`: a budget the greedy misses is often met only by a round that
    keeps a tensor, and the local searches are the cheapest); only when no result of that
    pass fits the budget or reaches the floor does the whole search above run, reusing what
    the first pass evaluated. A budget that no result of the first pass meets therefore gets
    the whole search's result (the pass once also ran the other searches of each round
    without the dearest one, round by round, before the whole search: on the 3,970 recorded
    decisions of the bench's and random timelines, 3 differ without them, all on random
    ones and none in reachability, and an unreachable budget above what always stays live
    costs a fifth to a third less); a budget below what stays live at some point whatever is
    evicted, which no pass meets, gets it at once.

    Parameters
    ----------
    tl
        The concrete timeline.
    budget
        Recorded in the decision (its ``reachable`` compares against it). When a result
        fits it, the searches left, the refinement and the further rounds are skipped: that
        result is the answer, made cheaper by :func:`_cheapen` in every regime it fits in (a
        budget decision wants the least work within the budget, not the least peak), by
        putting back and repairing only: a swap starts its repair far above the budget, and
        on these sets it seldom pays (the same decisions on the bench's timelines; 0.7 % of
        random ones 2-15 % dearer; a third less time on llama-train at 0.7x).

    Returns
    -------
    Decision
    """
    if _peak_is_fixed(tl):
        return _decision(tl, (), True, budget)
    best = None
    if budget is not None and budget >= int(tl._fewest().max()):
        # The local searches alone first: only when nothing they find fits (or reaches the
        # floor, below which no search goes) does the whole search run.
        best = _minimum_rounds(tl, budget, dearest=False)
    if best is None or not (best.reachable or best.peak <= tl.unevictable()[0]):
        best = _minimum_rounds(tl, budget, dearest=True)
    if best.reachable and best.evicted and budget is not None:
        # A search for the least peak that ends within the budget: now lower its work, in
        # every regime the set fits in (the regime of least peak is seldom that of least
        # work: temporaries cost a recomputation per reader, kept inputs cost bytes).
        made = []
        for regime in _unique([best.cache, True, False]):
            if predict_peak(tl, best.evicted, regime) <= budget:
                evicted = frozenset(_cheapen(tl, best.evicted, regime, budget, swap=False))
                if not isinstance(regime, bool):
                    regime = regime & frozenset(_chain_inputs(tl, evicted))
                made.append(_decision(tl, evicted, regime, budget))
                if regime is not True:
                    # Keeping some of the chained inputs (between the pure regimes).
                    keep = _keep_more(tl, evicted, regime or frozenset(), budget)
                    made.append(_decision(tl, evicted, keep, budget))
        best = min(made, key=lambda d: d.cost)
    return best


def _minimum_rounds(tl: ConcreteTimeline, budget: int | None, dearest: bool) -> Decision:
    """The rounds of :func:`minimum_peak`: the best result of all, not made cheaper."""
    if not dearest:
        return _minimum_sweeps(tl, budget)
    floor = tl.unevictable()[0]
    keep: frozenset[int] = frozenset()
    timeline = tl
    best: Decision | None = None
    for place in range(_KEEP_ROUNDS + 1):
        own = timeline.unevictable()[0]
        found = _minimum_once(
            timeline, budget, own, _local_results(timeline, budget, own), place == 0
        )
        current = _decision(tl, found.evicted, found.cache, budget)
        if best is None or (current.peak, current.cost) < (best.peak, best.cost):
            best = current
        if _enough(best.peak, floor, budget):
            break
        _, making = _peak_event(evaluate(tl, current.evicted, current.cache))
        if making is None or making in keep:
            break
        keep = keep | {making}
        timeline = _kept(tl, keep)
    return best


def _minimum_sweeps(tl: ConcreteTimeline, budget: int | None) -> Decision:
    """The first pass of :func:`minimum_peak` (with a budget): the local searches of every
    round, and nothing else.

    A budget that the greedy misses is often one that only a round keeping a tensor meets
    (a regeneration that the local searches all go through makes the peak), and the local
    searches are the cheapest: each round after the first keeps, with the tensors kept
    before, the one whose regeneration makes the peak of the previous round's best local
    result. The first round runs the cache regime's local search alone (running the temp
    regime's after it changed none of the 370 recorded decisions of the bench's timelines
    and one of 3,600 random ones, 7 % cheaper, for one more local search wherever the first
    round misses the budget, as at 0.7x on the bench's llama-train and gpt2-train at
    s = 256); a round that keeps a tensor runs the temp regime's first, and the cache
    regime's when that is not enough. The rounds stop at the first result within the budget.
    They do not build the floor (about as dear as the local searches of a round): a pass that
    meets the budget is the same without it, since the floor is below the budget then and a
    search that reaches it stops there anyway, no move going lower; one that misses it is
    followed by the whole search.
    """
    floor = -1
    best: Decision | None = None
    keep: frozenset[int] = frozenset()
    timeline = tl
    for place in range(_KEEP_ROUNDS + 1):
        # A round that keeps a tensor runs the temp regime's local search first: it is the one
        # that meets a budget there on the bench's timelines.
        results = _local_results(timeline, budget, floor, (False, True) if place else (True,))
        _, _, _, chosen, cache, _ = min(results, key=lambda r: r[:3])
        current = _decision(tl, chosen, cache, budget)
        if best is None or (current.peak, current.cost) < (best.peak, best.cost):
            best = current
        if _enough(best.peak, floor, budget) or place == _KEEP_ROUNDS:
            break
        _, making = _peak_event(evaluate(tl, chosen, cache))
        if making is None or making in keep:
            break
        keep = keep | {making}
        timeline = _kept(tl, keep)
    assert best is not None
    return best


def _unique(regimes: list[Regime]) -> list[Regime]:
    """``regimes`` without repeats, in order (``True == 1``: compared with their type)."""
    out: list[Regime] = []
    for regime in regimes:
        if not any(type(r) is type(regime) and r == regime for r in out):
            out.append(regime)
    return out


@_forgets_runs
def decide(tl: ConcreteTimeline, budget: int | None, *, exact_limit: int = EXACT_LIMIT) -> Decision:
    """The evictions of least recompute cost that keep the predicted peak within ``budget``.

    Parameters
    ----------
    tl
        The concrete timeline.
    budget
        Bytes; ``None`` means no budget (nothing is evicted).
    exact_limit
        Up to this many slots that can free memory, every subset is tried.

    Returns
    -------
    Decision
        ``reachable`` is false when no eviction set fits; ``peak`` is then the smallest peak
        found.
    """
    if budget is None or tl.base_peak <= budget:
        return _decision(tl, (), True, budget)
    candidates = effective_slots(tl)
    if not candidates or _peak_is_fixed(tl):
        return _decision(tl, (), True, budget)
    if len(candidates) <= exact_limit:
        found = _exact(tl, candidates, budget)
        if found.reachable:
            return found
        # No subset fits in a pure regime: a mixed one may (see minimum_peak).
        lowest = minimum_peak(tl, budget)
        return lowest if (lowest.peak, lowest.cost) < (found.peak, found.cost) else found
    if budget < int(tl._fewest().max()):
        # No set fits a budget below what stays live at some point whatever is evicted: the
        # answer is the minimum search's (the greedy would evict all it can, for nothing).
        return minimum_peak(tl, budget)
    # The cache regime's greedy runs only when the temp regime's fits: a budget the temp
    # greedy misses goes to the minimum search (on the 3,970 recorded decisions of the
    # bench's and random timelines, 4 differ from running both, all on random timelines, 2
    # of them cheaper and none less reachable; a budget that both miss costs one greedy less).
    temp = _greedy(tl, candidates, budget, False)
    found = []
    if temp is not None:
        found = [d for d in (_greedy(tl, candidates, budget, True), temp) if d is not None]
    if found:
        best = min(found, key=lambda d: (d.cost, d.peak, not d.cache))
        return _decision(tl, _cheapen(tl, best.evicted, best.cache, budget), best.cache, budget)
    return minimum_peak(tl, budget)

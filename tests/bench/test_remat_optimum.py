"""The integer-program reference of the remat decision against exhaustive search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from blade_relax.bench import remat_optimum
from blade_relax.bench.remat_optimum import optimal_decision, optimal_minimum_peak
from blade_relax.runtime.remat_policy import (
    ConcreteTimeline,
    SlotTimeline,
    decide,
    evaluate,
    minimum_peak,
    predict_peak,
)


def _timeline(seed: int) -> ConcreteTimeline:
    """3 to 9 slots at distinct sites, with chains as the compiler builds them.

    Each slot reads some slots whose sites come later (a backward pass regenerates an
    activation from earlier activations, regenerated after it); its plan is the closure of
    those reads, latest site first (dependencies first), then the slot itself. Most slots
    start before their site; a few start after it (they free nothing).
    """
    rng = np.random.default_rng(seed)
    count = int(rng.integers(3, 10))
    npoints = int(rng.integers(count + 2, 3 * count + 6))
    sites = [int(s) for s in rng.choice(np.arange(1, npoints), size=count, replace=False)]
    reads = [
        tuple(d for d in range(count) if sites[d] > sites[k] and rng.random() < 0.35)
        for k in range(count)
    ]
    slots = []
    for k in range(count):
        closure: set[int] = set()
        todo = list(reads[k])
        while todo:
            d = todo.pop()
            if d not in closure:
                closure.add(d)
                todo.extend(reads[d])
        chain = sorted(closure, key=lambda d: -sites[d])
        plan = tuple((d, reads[d]) for d in chain) + ((k, reads[k]),)
        site = sites[k]
        if rng.random() < 0.85:
            start = int(rng.integers(0, site + 1))
        else:
            start = int(rng.integers(site + 1, npoints + 1))
        slots.append(
            SlotTimeline(
                name=f"t{k}",
                nbytes=int(rng.integers(1, 30)),
                cost=float(rng.integers(1, 10)),
                start=start,
                site=site,
                regen_peak=int(rng.integers(1, 40)),
                plan=plan,
            )
        )
    base = rng.integers(5, 60, npoints)
    for slot in slots:
        base[slot.start : slot.site + 1] += slot.nbytes
    return ConcreteTimeline(base=base, slots=tuple(slots))


def _every_answer(tl: ConcreteTimeline) -> list[tuple[int, float, frozenset[int], bool]]:
    """(peak, cost, evicted, cache) of every subset in both pure regimes."""
    out = []
    for size in range(len(tl.slots) + 1):
        for subset in itertools.combinations(range(len(tl.slots)), size):
            for cache in (True, False):
                ev = evaluate(tl, subset, cache)
                out.append((ev.peak, ev.cost, frozenset(subset), cache))
    return out


SEEDS = range(50)


def test_timelines_have_chains():
    assert sum(len(s.plan) > 2 for seed in SEEDS for s in _timeline(seed).slots) > 30


@pytest.mark.parametrize("seed", SEEDS)
def test_least_peak_matches_exhaustive_search(seed):
    tl = _timeline(seed)
    answers = _every_answer(tl)
    peak = min(a[0] for a in answers)
    cost = min(a[1] for a in answers if a[0] == peak)
    best = optimal_minimum_peak(tl)
    assert best.optimal
    assert (best.peak, best.cost) == (peak, cost)
    ev = evaluate(tl, best.evicted, best.cache)
    assert (ev.peak, ev.cost) == (best.peak, best.cost)


@pytest.mark.parametrize("seed", SEEDS)
def test_cheapest_fit_matches_exhaustive_search(seed):
    tl = _timeline(seed)
    answers = _every_answer(tl)
    lowest = min(a[0] for a in answers)
    # Budgets on the exact peak of some answers (boundaries), between them, and below all.
    peaks = sorted({a[0] for a in answers})
    budgets = {lowest - 1, lowest, (lowest + tl.base_peak) // 2, tl.base_peak, *peaks[::5]}
    for budget in sorted(budgets):
        fits = [a[1] for a in answers if a[0] <= budget]
        found = optimal_decision(tl, budget)
        if not fits:
            assert found is None, budget
            continue
        assert found is not None and found.optimal
        assert found.cost == min(fits), budget
        assert found.peak <= budget
        ev = evaluate(tl, found.evicted, found.cache)
        assert (ev.peak, ev.cost) == (found.peak, found.cost)


@pytest.mark.parametrize("seed", SEEDS)
def test_runtime_is_never_better_in_a_pure_regime(seed):
    """The runtime may beat the reference only with a mixed regime."""
    tl = _timeline(seed)
    lowest = optimal_minimum_peak(tl)
    found = minimum_peak(tl)
    if isinstance(found.cache, bool):
        assert found.peak >= lowest.peak
    for fraction in (0.6, 0.8, 0.95):
        budget = int(fraction * tl.base_peak)
        decision = decide(tl, budget)
        if not isinstance(decision.cache, bool):
            continue
        assert decision.peak >= lowest.peak
        if decision.reachable:
            best = optimal_decision(tl, budget)
            assert best is not None and decision.cost >= best.cost


def test_budget_below_every_peak_is_infeasible():
    tl = _timeline(3)
    lowest = optimal_minimum_peak(tl)
    assert optimal_decision(tl, lowest.peak - 1) is None
    assert optimal_decision(tl, lowest.peak).peak == lowest.peak


def test_a_slot_that_frees_nothing_may_still_help_in_the_cache_regime():
    """Evicting ``b`` (still held at its site) makes its regeneration materialize ``a`` at
    point 3, where little is live, instead of ``a``'s own site at point 4."""
    a = SlotTimeline("a", 10, 1.0, 1, 4, 30, ((0, ()),))
    b = SlotTimeline("b", 5, 1.0, 4, 3, 5, ((0, ()), (1, (0,))))
    tl = ConcreteTimeline(base=np.array([10, 50, 30, 10, 35, 10]), slots=(a, b))
    assert not b.effective
    best = optimal_minimum_peak(tl)
    assert (best.evicted, best.cache, best.peak) == (frozenset({0, 1}), True, 40)
    assert predict_peak(tl, {0}, True) == 55


def _mixed_case() -> ConcreteTimeline:
    """The runtime's test case where only a mixed regime reaches 30 (both pure ones: 35)."""

    def make(k, site, regen_peak, plan):
        return SlotTimeline(f"t{k}", 10, 1.0, 1, site, regen_peak, plan)

    slots = (
        make(0, 8, 10, ((0, ()),)),
        make(1, 10, 20, ((1, ()),)),
        make(2, 4, 10, ((0, ()), (1, ()), (2, (0, 1)))),
    )
    base = np.array([30, 30, 35, 55, 30, 35, 30, 30, 30, 30, 30, 30])
    return ConcreteTimeline(base=base, slots=slots)


def test_the_runtime_can_beat_the_reference_with_a_mixed_regime():
    tl = _mixed_case()
    assert optimal_minimum_peak(tl).peak == 35
    assert optimal_decision(tl, 32) is None
    assert minimum_peak(tl).peak == 30


def test_no_slots():
    tl = ConcreteTimeline(base=np.array([3, 7, 5]), slots=())
    assert optimal_minimum_peak(tl).peak == 7
    assert optimal_decision(tl, 6) is None
    assert optimal_decision(tl, 7).evicted == frozenset()


def test_plan_out_of_dependency_order_is_rejected():
    slots = (
        SlotTimeline("t0", 5, 1.0, 0, 3, 5, ((0, ()),)),
        SlotTimeline("t1", 5, 1.0, 0, 1, 5, ((0, (1,)), (1, ()))),
    )
    with pytest.raises(ValueError, match="dependencies first"):
        optimal_minimum_peak(ConcreteTimeline(base=np.array([20, 20, 20, 20]), slots=slots))


def test_a_formulation_bug_is_reported(monkeypatch):
    """The program's answer is checked against ``evaluate``, not trusted: here a program
    that counts every eviction's freed bytes twice."""
    tl = _timeline(3)
    window = remat_optimum._window

    def doubled(tl, k, site, points):
        return 2 * window(tl, k, site, points)

    monkeypatch.setattr(remat_optimum, "_window", doubled)
    with pytest.raises(RuntimeError, match="evaluate"):
        optimal_decision(tl, tl.base_peak - 1)


def _random_timeline(seed: int) -> ConcreteTimeline:
    """The synthetic timelines of tests/runtime/test_remat_policy.py (16 slots, 40 points)."""
    from tests.runtime.test_remat_policy import _random_timeline as build

    return build(seed, npoints=40, nslots=16)


@pytest.mark.parametrize(
    "seed, fraction, least",
    [(21, 0.8, 11.0), (26, 0.7, 16.0), (4, 0.7, 15.0), (12, 0.6, 22.0), (112, 0.65, 17.0)],
)
def test_the_runtime_decision_reaches_the_optimal_work(seed, fraction, least):
    """The least costs that tests/runtime/test_remat_policy.py expects are the optimum's; the
    budget greedy (and, for seed 112, the minimum search) alone spent 1.3-1.8x that."""
    tl = _random_timeline(seed)
    budget = int(fraction * tl.base_peak)
    best = optimal_decision(tl, budget)
    assert best is not None and best.optimal
    assert best.cost == pytest.approx(least)
    decision = decide(tl, budget)
    assert decision.peak <= budget and decision.cost <= best.cost + 1e-9

"""The remat decision on synthetic timelines, the metadata reader, and the runtime builtins."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import pickle
import pkgutil
import warnings
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

import blade_relax  # noqa: F401  (registers the builtins)
from blade_relax.contract import REMAT_FORMAT, RematFormatError, RematMetadata, metadata_key
from blade_relax.contract.dimexpr import compile_expressions
from blade_relax.runtime import (
    RematBudgetWarning,
    RematInexactWarning,
    RematProgram,
    last_remat_decision,
    memory_stats,
    remat_policy,
    reset_memory_stats,
    set_memory_budget,
)
from blade_relax.runtime.remat_policy import (
    ConcreteTimeline,
    Decision,
    SlotTimeline,
    _calls,
    _cheapening,
    _floor,
    _greedy,
    _local_search,
    _neighbours,
    _search,
    _timeline,
    decide,
    effective_slots,
    evaluate,
    minimum_peak,
    predict_peak,
)
from blade_relax.runtime.remat_policy._evaluation import _evaluate_many, _evaluate_once
from blade_relax.runtime.remat_policy._floor import _peak_is_fixed
from blade_relax.runtime.remat_policy._greedy import _gains

# Every module of the policy package: a search's helpers live in several, each reading the
# others' functions by name.
_POLICY_MODULES = [
    importlib.import_module(f"{remat_policy.__name__}.{info.name}")
    for info in pkgutil.iter_modules(remat_policy.__path__)
]


@contextlib.contextmanager
def _replaced(name: str, new):
    """``name`` replaced by ``new`` in every module of the policy that reads it: every call
    the policy makes of that function goes to ``new`` (yielded, as ``mock.patch`` does)."""
    with contextlib.ExitStack() as stack:
        for module in _POLICY_MODULES:
            if name in vars(module):
                stack.enter_context(mock.patch.object(module, name, new))
        yield new


def slot(k, nbytes, start, site, cost=1.0, regen_peak=None, deps=()):
    """A slot whose plan materializes ``deps`` (in order, no deps of their own) then itself."""
    plan = tuple((d, ()) for d in deps) + ((k, tuple(deps)),)
    return SlotTimeline(
        name=f"t{k}",
        nbytes=nbytes,
        cost=cost,
        start=start,
        site=site,
        regen_peak=nbytes if regen_peak is None else regen_peak,
        plan=plan,
    )


# --------------------------------------------------------------------------- model
def test_one_eviction_lowers_its_window():
    tl = ConcreteTimeline(base=np.array([10, 20, 30, 20, 10]), slots=(slot(0, 10, 1, 4),))
    assert tl.base_peak == 30
    assert predict_peak(tl, []) == 30
    # Bytes gone on points 1..4; the regeneration at point 4 peaks at 0 + 10.
    assert predict_peak(tl, [0]) == 20


def test_regeneration_peak_counts():
    # A regeneration that needs a temporary as large as its output peaks at twice its bytes.
    tl = ConcreteTimeline(
        base=np.array([10, 30, 10, 25]), slots=(slot(0, 10, 1, 3, regen_peak=20),)
    )
    assert predict_peak(tl, [0]) == max(10, 20, 0, 15 + 20)


def test_no_budget_and_budget_above_peak_evict_nothing():
    tl = ConcreteTimeline(base=np.array([10, 30, 10]), slots=(slot(0, 10, 1, 2),))
    for budget in (None, 30, 1000):
        decision = decide(tl, budget)
        assert decision.evicted == frozenset() and decision.reachable
        assert decision.peak == 30


def test_least_cost_eviction_wins():
    base = np.array([10, 40, 40, 10])
    slots = (slot(0, 10, 1, 3, cost=5.0), slot(1, 10, 1, 3, cost=2.0))
    tl = ConcreteTimeline(base=base, slots=slots)
    decision = decide(tl, 30)
    assert decision.evicted == frozenset({1}) and decision.reachable and decision.peak == 30
    both = decide(tl, 20)
    assert both.evicted == frozenset({0, 1}) and both.peak == 20 and both.cost == 7.0


def test_exact_and_greedy_agree_on_a_small_case():
    base = np.array([5, 40, 50, 45, 10, 8])
    slots = (
        slot(0, 10, 1, 5, cost=10.0),
        slot(1, 15, 2, 4, cost=4.0),
        slot(2, 5, 1, 3, cost=1.0),
    )
    tl = ConcreteTimeline(base=base, slots=slots)
    for budget in (45, 40, 35, 30):
        exact = decide(tl, budget)
        greedy = decide(tl, budget, exact_limit=0)
        assert exact.reachable == greedy.reachable
        if exact.reachable:
            assert exact.peak <= budget and greedy.peak <= budget
            assert exact.cost <= greedy.cost


def test_chain_cache_versus_temporaries():
    # Slot 1 is recomputed from slot 0; both evicted.
    base = np.array([10, 30, 40, 40, 30, 20])
    slots = (slot(0, 10, 1, 5, cost=3.0), slot(1, 10, 2, 3, cost=2.0, deps=(0,)))
    tl = ConcreteTimeline(base=base, slots=slots)
    # cache: slot 0 comes back at point 3 (slot 1's site) and stays: windows [1,3] and [2,3].
    live_cache = [10, 20, 20, 20, 30, 20]
    events_cache = [20 + 10, 20 + 10 + 10]  # slot 0 then slot 1 at point 3
    assert predict_peak(tl, [0, 1], cache=True) == max(live_cache + events_cache)
    # temp: slot 0 is a temporary at point 3 and again regenerated at its own site 5.
    live_temp = [10, 20, 20, 20, 20, 10]
    events_temp = [20 + 10, 20 + 10 + 10, 10 + 10]
    assert predict_peak(tl, [0, 1], cache=False) == max(live_temp + events_temp)
    temp = decide(tl, 30)
    assert temp.reachable and temp.peak <= 30


def test_unreachable_budget_reports_the_smallest_peak():
    base = np.array([10, 50, 10])
    tl = ConcreteTimeline(base=base, slots=(slot(0, 20, 1, 2),))
    decision = decide(tl, 5)
    assert not decision.reachable
    best = minimum_peak(tl)
    assert decision.peak == best.peak == predict_peak(tl, decision.evicted, decision.cache)
    assert best.peak == 30


def test_ineffective_slot_is_never_chosen():
    # Its storage is still held by the function at its site (start after site).
    tl = ConcreteTimeline(base=np.array([10, 50, 10]), slots=(slot(0, 20, 3, 2),))
    assert not tl.slots[0].effective
    assert decide(tl, 30).evicted == frozenset()


def test_bad_timeline_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        ConcreteTimeline(base=np.array([1, 2]), slots=(slot(0, 1, 0, 9),))
    with pytest.raises(ValueError, match="plan"):
        bad = SlotTimeline("x", 1, 1.0, 0, 1, 1, plan=((1, ()),))
        ConcreteTimeline(base=np.array([1, 2]), slots=(bad,))


@st.composite
def timelines(draw):
    npoints = draw(st.integers(3, 12))
    base = draw(st.lists(st.integers(0, 100), min_size=npoints, max_size=npoints))
    count = draw(st.integers(1, 6))
    slots = []
    for k in range(count):
        start = draw(st.integers(0, npoints - 1))
        site = draw(st.integers(start, npoints - 1))
        nbytes = draw(st.integers(1, 30))
        deps = tuple(d for d in range(k) if draw(st.booleans()) and slots[d].site > site)
        slots.append(slot(k, nbytes, start, site, cost=float(draw(st.integers(1, 9))), deps=deps))
    # Live bytes include every slot's bytes over its window (nothing evicted).
    arr = np.array(base, dtype=np.int64)
    for s in slots:
        arr[s.start : s.site + 1] += s.nbytes
    return ConcreteTimeline(base=arr, slots=tuple(slots))


@settings(max_examples=60, deadline=None)
@given(timelines(), st.floats(0.2, 1.1))
def test_decisions_keep_their_promise(tl, fraction):
    budget = int(fraction * tl.base_peak)
    for exact_limit in (10, 0):
        decision = decide(tl, budget, exact_limit=exact_limit)
        assert decision.peak == predict_peak(tl, decision.evicted, decision.cache)
        if decision.reachable:
            assert decision.peak <= budget
        else:
            assert decision.peak > budget
            assert decision.peak <= tl.base_peak
    # The exact search is never dearer than the greedy one, and never misses a feasible set.
    exact = decide(tl, budget)
    greedy = decide(tl, budget, exact_limit=0)
    if greedy.reachable:
        assert exact.reachable and exact.cost <= greedy.cost
    feasible = any(
        predict_peak(tl, subset, cache) <= budget
        for size in range(len(tl.slots) + 1)
        for subset in itertools.combinations(range(len(tl.slots)), size)
        for cache in (True, False)
    )
    assert exact.reachable == feasible


def test_unevictable_bytes_of_a_small_timeline():
    # Point 2 holds 30 B: slot 0 (10 B, window 1..3) can go, slot 1 (5 B, window 3..2) frees
    # nothing, so 20 B stay; point 4 holds 25 B and no window covers it.
    tl = ConcreteTimeline(
        base=np.array([10, 20, 30, 20, 25]),
        slots=(slot(0, 10, 1, 3), slot(1, 5, 3, 2)),
    )
    assert tl.unevictable() == (25, 4)
    assert minimum_peak(tl).peak == 25
    tl = ConcreteTimeline(base=np.array([10, 20, 30, 20, 10]), slots=(slot(0, 10, 1, 3),))
    assert tl.unevictable() == (20, 2)
    assert ConcreteTimeline(base=np.array([], dtype=np.int64), slots=()).unevictable() == (0, 0)


def test_unevictable_bytes_count_what_a_regeneration_brings_back():
    # The 50-B tensor could go on points 1..2, but recomputing it at its site (point 2) takes
    # 100 B on top of the 10 B left there: evicting it peaks at 110, keeping it at 60.
    tl = ConcreteTimeline(base=np.array([20, 60, 60]), slots=(slot(0, 50, 1, 2, regen_peak=100),))
    assert tl.unevictable() == (60, 1)
    assert minimum_peak(tl).peak == 60
    # A recomputation that reads another slot needs it at the site: it is not removable there.
    tl = ConcreteTimeline(
        base=np.array([10, 80, 80, 80, 40]),
        slots=(slot(0, 30, 1, 4), slot(1, 40, 1, 3, deps=(0,))),
    )
    floor, _ = tl.unevictable()
    assert floor == 50 and minimum_peak(tl).peak >= floor


@settings(max_examples=60, deadline=None)
@given(timelines(), st.floats(0.2, 1.1))
def test_no_decision_goes_below_the_unevictable_bytes(tl, fraction):
    floor, _ = tl.unevictable()
    assert minimum_peak(tl).peak >= floor
    assert decide(tl, int(fraction * tl.base_peak)).peak >= floor
    for size in range(len(tl.slots) + 1):
        for subset in itertools.combinations(range(len(tl.slots)), size):
            for cache in (True, False):
                assert predict_peak(tl, subset, cache) >= floor


# --------------------------------------------------------------------------- metadata
def _meta() -> dict:
    """Three storages of 4*s, 8*s and 4*s bytes; slot 0 is the second one."""
    return {
        "format": REMAT_FORMAT,
        "function": "f",
        "dims": ["s"],
        "exact": True,
        "points": 4,
        "exprs": ["(4 * s)", "(8 * s)", "(3 * s)"],
        "storages": [[0, 0, 4], [1, 1, 4], [0, 2, 3]],
        "slots": [
            {
                "name": "t",
                "regen": "f_remat0",
                "bytes": 1,
                "cost": 2,
                "regen_peak": 1,
                "start": 2,
                "site": 3,
                "plan": [[0, [["a", 0]]]],
            }
        ],
    }


def test_program_evaluates_the_timeline_once_per_shape():
    program = RematProgram(_meta())
    assert RematProgram.from_json(json.dumps(_meta())).metadata == program.metadata
    assert program.metadata == RematMetadata.from_dict(_meta())
    tl = program.timeline([10])
    assert tl.base.tolist() == [40, 120, 160, 120]
    assert tl.slots[0].nbytes == 80 and tl.slots[0].cost == 30.0
    assert program.timeline([10]) is tl
    assert program.decision([10], None) is program.decision([10], None)
    # Evicted: [40, 120, 80, 40] and the regeneration at point 3 peaks at 40 + 80.
    decision = program.decision([10], 130)
    assert decision.evicted == frozenset({0}) and decision.peak == 120 and decision.reachable
    assert not program.decision([10], 100).reachable


def test_program_rejects_other_formats_and_code():
    with pytest.raises(RematFormatError, match="format 'other/9'"):
        RematProgram({**_meta(), "format": "other/9"})
    with pytest.raises(RematFormatError, match="format 'other/9'"):
        RematProgram.from_json(json.dumps({**_meta(), "format": "other/9"}))
    for bad in ("__import__('os')", "s.real", "open(s)", "1.5 * s", "t + 1"):
        with pytest.raises(ValueError):
            compile_expressions(["s"], [bad])
    assert compile_expressions(["s"], ["max(s, 3) // 2", "tdiv(-7, 2)", "tmod(-7, 2)"])(5) == (
        2,
        -3,
        -1,
    )


# --------------------------------------------------------------------------- builtins
def _begin(meta: dict, dims: list[int]):
    text = json.dumps(meta)
    tensor = tvm.runtime.tensor(np.frombuffer(text.encode(), dtype=np.uint8).copy())
    begin = tvm.get_global_func("blade_relax.remat_begin")
    return begin(
        None, metadata_key(meta["function"], text), tensor, tvm.runtime.ShapeTuple(dims), None
    )


def test_no_budget_path_evaluates_nothing_and_keeps_tensors():
    meta = {**_meta(), "function": "f_nobudget"}
    set_memory_budget(None)
    frame = _begin(meta, [10])
    assert frame.program._timelines == {}  # the decision path did no work
    x = tvm.runtime.tensor(np.arange(4, dtype="float32"))
    tvm.get_global_func("blade_relax.evict")(None, frame, 0, x)
    back = tvm.get_global_func("blade_relax.regenerate")(frame, 0)
    assert back.same_as(x)


def test_budget_eviction_is_counted():
    meta = {**_meta(), "function": "f_evict"}
    reset_memory_stats()
    from blade_relax.runtime import current_live_bytes

    with set_memory_budget(130 + current_live_bytes()):
        frame = _begin(meta, [10])
    assert frame.evicted == frozenset({0})
    x = tvm.runtime.tensor(np.zeros(20, dtype="float32"))
    tvm.get_global_func("blade_relax.evict")(None, frame, 0, x)
    stats = memory_stats()
    assert stats["evictions"] == 1 and stats["evicted_bytes"] == 80
    decision = last_remat_decision()
    assert decision["reachable"] and decision["evicted"] == ["t"]
    live = decision["live_at_entry"]
    assert decision["predicted_peak"] - live == 120 and decision["no_remat_peak"] - live == 160


def test_unreachable_budget_warns_once_naming_budget_and_peak():
    meta = {**_meta(), "function": "f_warn"}
    with set_memory_budget(50):
        with pytest.warns(
            RematBudgetWarning, match=r"budget of 50 bytes.*smallest reachable peak is \d+ bytes"
        ):
            _begin(meta, [10])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _begin(meta, [10])  # the same shape and budget: no second warning
    decision = last_remat_decision()
    assert not decision["reachable"]
    assert decision["predicted_peak"] - decision["live_at_entry"] == 120
    # Nothing evictable is live where the minimum is reached: it is the floor.
    assert decision["unevictable_peak"] == decision["predicted_peak"]
    assert decision["reason"] == "budget" and decision["exact"]


def test_inexact_timeline_is_never_called_reachable_and_warns_once_per_program():
    """A timeline that misses allocations (a call it could not follow) promises no budget."""
    meta = {
        **_meta(),
        "function": "f_inexact",
        "exact": False,
        "notes": ["call of helper: control flow (If)"],
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dims, budget in (([10], 130), ([10], 10**9), ([12], 130), ([10], 50)):
            with set_memory_budget(budget):
                frame = _begin(meta, dims)
            decision = last_remat_decision()
            assert not decision["reachable"] and decision["reason"] == "inexact"
            assert not decision["exact"] and decision["budget"] == budget
    inexact = [w for w in caught if issubclass(w.category, RematInexactWarning)]
    assert len(inexact) == 1 and len(caught) == 1
    message = str(inexact[0].message)
    assert "best effort" in message and "control flow (If)" in message
    # The decision is still made on what the timeline knows: the budget of 130 evicts.
    from blade_relax.runtime import current_live_bytes

    with set_memory_budget(130 + current_live_bytes()):
        frame = _begin(meta, [10])
    assert frame.evicted == frozenset({0})


# --------------------------------------------------------------------------- mixed regime
def _mixed_case() -> ConcreteTimeline:
    """``y`` (slot 2, site 4) reads the chained inputs ``x`` (slot 0) and ``z`` (slot 1).

    Keeping ``x`` from point 4 to its own site (8) holds it over point 5; recomputing ``z``
    at its own site (10), where more is live, peaks above the budget: only keeping ``z`` and
    recomputing ``x`` as a temporary reaches 30.
    """

    def mk(k, site, regen_peak, plan):
        return SlotTimeline(
            name=f"t{k}",
            nbytes=10,
            cost=1.0,
            start=1,
            site=site,
            regen_peak=regen_peak,
            plan=plan,
        )

    slots = (
        mk(0, 8, 10, ((0, ()),)),
        mk(1, 10, 20, ((1, ()),)),
        mk(2, 4, 10, ((0, ()), (1, ()), (2, (0, 1)))),
    )
    return ConcreteTimeline(
        base=np.array([30, 30, 35, 55, 30, 35, 30, 30, 30, 30, 30, 30]), slots=slots
    )


def test_mixed_regime_reaches_below_both_pure_regimes():
    tl = _mixed_case()
    subsets = [s for n in range(4) for s in itertools.combinations(range(3), n)]
    pure = min(predict_peak(tl, s, c) for s in subsets for c in (True, False))
    assert pure == 35
    assert predict_peak(tl, {0, 1, 2}, frozenset({1})) == 30
    # The pure regimes are the two ends of the mixed one.
    for s in subsets:
        assert predict_peak(tl, s, frozenset(s)) == predict_peak(tl, s, True)
        assert predict_peak(tl, s, frozenset()) == predict_peak(tl, s, False)
    best = minimum_peak(tl)
    assert best.peak == 30 and best.cache == frozenset({1})
    assert best.evicted == frozenset({0, 1, 2})
    # A budget only the mixed regime meets is reachable, and keeps its promise.
    decision = decide(tl, 32)
    assert decision.reachable and decision.peak <= 32
    assert predict_peak(tl, decision.evicted, decision.cache) == decision.peak


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_minimum_peak_is_never_above_the_pure_searches(seed):
    rng = np.random.default_rng(seed)
    npoints = 14
    nslots = 5
    slots = []
    for k in range(nslots):
        start = int(rng.integers(1, 6))
        site = int(rng.integers(start + 1, npoints))
        deps = tuple(int(d) for d in range(k) if slots[d].site > site and rng.random() < 0.5)
        slots.append(
            SlotTimeline(
                name=f"t{k}",
                nbytes=int(rng.integers(1, 20)),
                cost=float(rng.integers(1, 10)),
                start=start,
                site=site,
                regen_peak=int(rng.integers(1, 30)),
                plan=tuple((d, ()) for d in deps) + ((k, deps),),
            )
        )
    tl = ConcreteTimeline(base=rng.integers(20, 80, npoints), slots=tuple(slots))
    best = minimum_peak(tl)
    assert best.peak == predict_peak(tl, best.evicted, best.cache)
    subsets = [s for n in range(nslots + 1) for s in itertools.combinations(range(nslots), n)]
    exact_pure = min(predict_peak(tl, s, c) for s in subsets for c in (True, False))
    assert best.peak <= max(exact_pure, tl.base_peak)


def _random_timeline(seed: int, npoints: int = 30, nslots: int = 12) -> ConcreteTimeline:
    """Slots over random windows with random chains; every slot's bytes are in the base."""
    rng = np.random.default_rng(seed)
    slots: list[SlotTimeline] = []
    for k in range(nslots):
        start = int(rng.integers(1, npoints // 2))
        site = int(rng.integers(start + 1, npoints))
        deps = tuple(int(d) for d in range(k) if slots[d].site > site and rng.random() < 0.3)
        slots.append(
            SlotTimeline(
                name=f"t{k}",
                nbytes=int(rng.integers(1, 40)),
                cost=float(rng.integers(1, 10)),
                start=start,
                site=site,
                regen_peak=int(rng.integers(1, 40)),
                plan=tuple((d, ()) for d in deps) + ((k, deps),),
            )
        )
    base = rng.integers(20, 80, npoints)
    for s in slots:
        base[s.start : s.site + 1] += s.nbytes
    return ConcreteTimeline(base=base, slots=tuple(slots))


@pytest.mark.parametrize("seed", [128, 129, 142, 149, 0, 1, 2, 3])
def test_minimum_is_never_above_a_greedy_budget_decision(seed):
    """Found on llama-train at s = 256: a budget of 0.7x the peak was met at a peak below the
    "smallest reachable peak" the minimum search reported for 0.6x (seeds 128-149 reproduce
    it on synthetic timelines). The search now also starts from the budget greedy aimed at
    0.9 .. 0.5 of the peak."""
    tl = _random_timeline(seed)
    lowest = minimum_peak(tl)
    assert lowest.peak == predict_peak(tl, lowest.evicted, lowest.cache)
    for fraction in (0.9, 0.8, 0.7, 0.6, 0.5):
        decision = decide(tl, int(fraction * tl.base_peak), exact_limit=0)
        assert lowest.peak <= decision.peak, fraction


# --------------------------------------------------------------------------- least work
def _plain_greedy_cost(tl: ConcreteTimeline, budget: int) -> float | None:
    """What the budget greedy alone (pruned, not made cheaper) costs, or ``None``."""
    found = [_greedy._greedy(tl, effective_slots(tl), budget, c) for c in (True, False)]
    return min((d.cost for d in found if d is not None), default=None)


# (seed, fraction of the peak, least cost that fits): 16 slots over 40 points, more than the
# exhaustive path takes; the least cost is that of every subset in both pure regimes
# (decide(..., exact_limit=16), six seconds each) and of the integer program
# (tests/bench/test_remat_optimum.py checks it).
_LEAST_WORK_GREEDY = [
    (21, 0.8, 11.0),
    (26, 0.7, 16.0),
    # These two need a slot swapped in for what it makes unnecessary (putting back and
    # repairing alone stops at 20 and 36).
    (4, 0.7, 15.0),
    (12, 0.6, 22.0),
]


@pytest.mark.parametrize("seed, fraction, least", _LEAST_WORK_GREEDY)
def test_a_greedy_decision_is_made_as_cheap_as_the_optimum(seed, fraction, least):
    """The greedy's choices by bytes per unit of cost keep evictions a later one made
    unnecessary, or an expensive slot where a cheaper pair fits (19 vs 11 for seed 21): the
    decision puts back, repairs and swaps until its work is the least that fits."""
    tl = _random_timeline(seed, npoints=40, nslots=16)
    budget = int(fraction * tl.base_peak)
    assert _plain_greedy_cost(tl, budget) > 1.3 * least
    decision = decide(tl, budget)
    assert decision.reachable and decision.peak <= budget
    assert decision.peak == predict_peak(tl, decision.evicted, decision.cache)
    assert decision.cost == least


def test_a_fallback_that_fits_keeps_the_cheapest_set():
    """No greedy fits, the minimum search does: the decision used to keep the set of least
    peak (cost 31, 1.8x the least); any set within the budget will do, the cheapest wins."""
    tl = _random_timeline(112, npoints=40, nslots=16)
    budget = int(0.65 * tl.base_peak)
    assert _plain_greedy_cost(tl, budget) is None
    decision = decide(tl, budget)
    assert decision.reachable and decision.peak <= budget
    assert decision.cost == 17.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), fraction=st.sampled_from([0.9, 0.8, 0.7, 0.6]))
def test_made_cheaper_never_costs_more_or_breaks_the_budget(seed, fraction):
    tl = _random_timeline(seed, npoints=30, nslots=14)
    budget = int(fraction * tl.base_peak)
    for cache in (True, False):
        start = _greedy._greedy(tl, effective_slots(tl), budget, cache)
        if start is None:
            continue
        cheaper = _cheapening._cheapen(tl, start.evicted, cache, budget)
        assert predict_peak(tl, cheaper, cache) <= budget
        assert evaluate(tl, cheaper, cache).cost <= start.cost
        for move in (_cheapening._put_back, _cheapening._swap_in):
            effective = np.zeros(len(tl.slots), dtype=bool)
            effective[effective_slots(tl)] = True
            for x in range(len(tl.slots)):
                if (x in start.evicted) != (move is _cheapening._put_back) or not effective[x]:
                    continue
                moved = move(tl, set(start.evicted), x, effective, cache, budget)
                assert moved is None or predict_peak(tl, moved, cache) <= budget


def test_putting_back_skips_only_what_surely_breaks_the_limit():
    """The bound behind the skipped evaluations of _prune and _minimum_from_all: putting a
    slot back never peaks below what is live on its window plus its bytes."""
    for seed in range(30):
        tl = _random_timeline(seed)
        chosen = set(effective_slots(tl))
        lowest = _floor._lowest_live(tl, chosen)
        for k in chosen:
            for cache in (True, False):
                peak = predict_peak(tl, chosen - {k}, cache)
                window = lowest[tl.slots[k].start : tl.slots[k].site + 1]
                assert peak >= int(window.max()) + tl.slots[k].nbytes
    negative = ConcreteTimeline(base=np.array([5, 5]), slots=(slot(0, -1, 0, 1),))
    assert _floor._lowest_live(negative, {0}) is None
    assert not _floor._returns_above(negative, None, 0, 0)


# --------------------------------------------------------------------------- fast paths
def _plain_evaluate(tl: ConcreteTimeline, evicted, cache=True):
    """The model of the module docstring, written out plainly: (peak, cost, live, events)."""
    slots = tl.slots
    chosen = frozenset(evicted)
    kept = (lambda _x: cache) if isinstance(cache, bool) else cache.__contains__
    live = [int(b) for b in tl.base]
    if not chosen:
        return max(live, default=0), 0.0, live, []
    materialized: dict[int, int] = {}
    runs = []
    cost = 0.0
    for k in sorted(chosen, key=lambda s: (slots[s].site, s)):
        if k in materialized:
            continue
        pending = frozenset(x for x, _ in slots[k].plan) & chosen
        pending = pending.difference(materialized)
        needed = {k}
        for x, refs in reversed(slots[k].plan):
            if x in needed:
                needed.update(t for t in refs if t in pending)
        sequence = tuple(x for x, _ in slots[k].plan if x in needed)
        for x in sequence:
            if x == k or kept(x):
                materialized[x] = slots[k].site
        cost += sum(slots[x].cost for x in sequence)
        runs.append((slots[k].site, sequence))
    for x, end in materialized.items():
        # Gone on [start, end]; both copies live on [end + 1, start) when start > end + 1.
        for i in range(len(live)):
            if slots[x].start <= i <= end:
                live[i] -= slots[x].nbytes
            elif end < i < slots[x].start:
                live[i] += slots[x].nbytes
    peak = max(live, default=0)
    events = []
    for site, sequence in runs:
        held = live[site]
        refs = dict(slots[sequence[-1]].plan)
        last_reader = {}
        for i, x in enumerate(sequence):
            for t in refs[x]:
                if t in sequence[:-1] and not kept(t):
                    last_reader[t] = i
        for i, x in enumerate(sequence):
            events.append((site, held + slots[x].regen_peak, x))
            peak = max(peak, held + slots[x].regen_peak)
            held += slots[x].nbytes
            held -= sum(slots[t].nbytes for t, reader in last_reader.items() if reader == i)
    return peak, cost, live, events


def _plain_gains(tl: ConcreteTimeline, ev, budget: int) -> list[int]:
    """Per slot: the bytes above ``budget`` that removing its bytes on its window would remove,
    at every point and every regeneration, less what its own regeneration adds above it."""
    gains = []
    for s in tl.slots:
        gain = 0
        for i, value in enumerate(ev.live.tolist()):
            if s.start <= i <= s.site:
                gain += max(value - budget, 0) - max(value - s.nbytes - budget, 0)
        for site, value, _ in ev.events:
            if value > budget and s.start <= site <= s.site:
                gain += min(value - budget, s.nbytes)
        own = int(ev.live[s.site]) - s.nbytes + s.regen_peak
        gains.append(gain - max(own - budget, 0))
    return gains


@st.composite
def chained_timelines(draw):
    """Plans whose entries read earlier entries (chains of chains), regenerations of any size,
    and sometimes a last point that holds the peak outside every window."""
    npoints = draw(st.integers(3, 14))
    count = draw(st.integers(1, 7))
    slots: list[SlotTimeline] = []
    for k in range(count):
        start = draw(st.integers(0, npoints))  # past the site: held past its copy
        site = draw(st.integers(0, npoints - 1))
        deps = [d for d in range(k) if slots[d].site > site and draw(st.booleans())]
        plan = []
        for j, d in enumerate(deps):
            plan.append((d, tuple(e for e in deps[:j] if draw(st.booleans()))))
        plan.append((k, tuple(d for d in deps if draw(st.booleans()))))
        slots.append(
            SlotTimeline(
                name=f"t{k}",
                nbytes=draw(st.integers(0, 30)),
                cost=float(draw(st.integers(0, 9))),
                start=start,
                site=site,
                regen_peak=draw(st.integers(0, 60)),
                plan=tuple(plan),
            )
        )
    base = np.array(draw(st.lists(st.integers(0, 100), min_size=npoints, max_size=npoints)))
    for s in slots:
        base[s.start : s.site + 1] += s.nbytes
    if draw(st.booleans()):
        # The results of a training step: the peak, at the end, outside every window.
        base = np.append(base, base.max() + draw(st.integers(0, 20)))
    return ConcreteTimeline(base=base, slots=tuple(slots))


@settings(max_examples=80, deadline=None)
@given(chained_timelines(), st.data())
def test_evaluation_agrees_with_the_plain_model(tl, data):
    """The evaluation reuses each regenerate call's materializations and peaks across sets and
    builds events on demand; the numbers are the plain model's, in every regime."""
    indices = st.sampled_from(range(len(tl.slots)))
    for _ in range(6):
        evicted = data.draw(st.frozensets(indices))
        cache = data.draw(st.one_of(st.booleans(), st.frozensets(indices)))
        ev = evaluate(tl, evicted, cache)
        peak, cost, live, events = _plain_evaluate(tl, evicted, cache)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)
        assert predict_peak(tl, evicted, cache) == peak
        budget = data.draw(st.integers(0, max(peak, 1)))
        assert _gains(tl, ev, budget).tolist() == _plain_gains(tl, ev, budget)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([10**3, 10**9, 2**60]))
def test_the_floors_matrix_product_is_exact(seed, high):
    """The floor's product of read counts and bytes runs in floating point where every sum
    is an integer it holds, and in integers beyond: the same numbers either way."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 3, (7, 5))
    values = rng.integers(-high, high, (5, 9))
    assert _floor._product(counts, values).tolist() == (counts @ values).tolist()


def test_a_plan_out_of_dependency_order_is_walked_backwards():
    # Entry 0 reads entry 1, listed after it: walked backwards from slot 2, the plan reaches 0
    # and then 1, but not 3 (read by 1, passed before 1 was reached).
    plan = ((0, (1,)), (1, (3,)), (3, ()), (2, (0,)))
    others = tuple(
        SlotTimeline(name=f"t{k}", nbytes=4, cost=1.0, start=1, site=k + 5, regen_peak=4)
        for k in range(4)
    )
    slots = tuple(
        replace(s, plan=plan, site=3) if k == 2 else replace(s, plan=((k, ()),))
        for k, s in enumerate(others)
    )
    tl = ConcreteTimeline(base=np.full(10, 50), slots=slots)
    ev = evaluate(tl, {0, 1, 2, 3}, True)
    assert [x for site, _, x in ev.events if site == 3] == [0, 1, 2]
    assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == _plain_evaluate(tl, {0, 1, 2, 3})


@settings(max_examples=150, deadline=None)
@given(chained_timelines(), st.data())
def test_plans_out_of_dependency_order_follow_the_plain_model(tl, data):
    """A regeneration follows what its plan's entries read from the slot over the pending
    slots alone when every entry comes after what it reads; a plan that lists an entry
    before one it reads is walked backwards in its own order, as the plain model does."""
    slots = []
    for k, slot in enumerate(tl.slots):
        others = [x for x, _ in slot.plan[:-1]]
        others = data.draw(st.permutations(others))
        entries = others + [k]
        plan = tuple(
            (x, tuple(t for t in entries if t != x and data.draw(st.booleans()))) for x in entries
        )
        slots.append(replace(slot, plan=plan))
    shuffled = ConcreteTimeline(base=tl.base, slots=tuple(slots))
    indices = st.sampled_from(range(len(slots)))
    every = frozenset(range(len(slots)))
    for evicted in (every, every, data.draw(st.frozensets(indices))):
        cache = data.draw(st.one_of(st.booleans(), st.frozensets(indices)))
        ev = evaluate(shuffled, evicted, cache)
        peak, cost, live, events = _plain_evaluate(shuffled, evicted, cache)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)


@settings(max_examples=60, deadline=None)
@given(chained_timelines(), st.data())
def test_a_batch_of_evaluations_agrees_with_the_plain_model(tl, data):
    """A search step evaluates its trials together (one array for all their live bytes), and
    a timeline with slots kept reuses the evaluations of sets that evict none of them: every
    number is still the plain model's, in every regime, repeats and empty sets included."""
    indices = st.sampled_from(range(len(tl.slots)))
    regimes = st.one_of(st.booleans(), st.frozensets(indices))
    items = data.draw(st.lists(st.tuples(st.frozensets(indices), regimes), max_size=8))
    items += items[:2]
    for (evicted, cache), ev in zip(items, _evaluate_many(tl, items)):
        peak, cost, live, events = _plain_evaluate(tl, evicted, cache)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)
    keep = data.draw(st.frozensets(indices, min_size=1))
    kept = _timeline._kept(tl, keep)
    for evicted, cache in items:
        ev = _evaluate_many(kept, [(evicted, cache)])[0]
        peak, cost, live, events = _plain_evaluate(kept, evicted, cache)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)
        assert predict_peak(kept, evicted, cache) == peak


@settings(max_examples=150, deadline=None)
@given(chained_timelines(), st.floats(0.2, 1.1))
def test_a_peak_no_eviction_lowers_ends_the_search_as_the_searches_would(tl, fraction):
    """Where a point holding the unevicted peak lies in no window, the decisions evict nothing
    at once: the same decisions as the searches' (run here with the check switched off)."""
    budget = int(fraction * tl.base_peak)
    fast = (decide(tl, budget), decide(tl, budget, exact_limit=0), minimum_peak(tl))
    fresh = ConcreteTimeline(base=tl.base, slots=tl.slots)
    with _replaced("_peak_is_fixed", lambda _tl: False):
        plain = (decide(fresh, budget), decide(fresh, budget, exact_limit=0), minimum_peak(fresh))
    assert fast == plain
    if _peak_is_fixed(tl):
        assert plain[2].peak == tl.base_peak and plain[2].evicted == frozenset()


def test_a_fixed_peak_needs_sizes_and_costs_that_are_not_negative():
    base = np.array([10, 20, 10, 30])  # the peak, at point 3, lies in no window
    tl = ConcreteTimeline(base=base, slots=(slot(0, 10, 1, 2),))
    assert _peak_is_fixed(tl)
    assert minimum_peak(tl).evicted == frozenset() and not decide(tl, 25).reachable
    assert not _peak_is_fixed(ConcreteTimeline(base=base, slots=(slot(0, 10, 1, 2, cost=-1.0),)))
    assert not _peak_is_fixed(ConcreteTimeline(base=base, slots=(slot(0, 10, 1, 3),)))


def test_a_pickled_timeline_carries_its_value_only():
    tl = _random_timeline(3)
    decision = decide(tl, int(0.6 * tl.base_peak))
    back = pickle.loads(pickle.dumps(tl))
    assert back._unevictable is None and back._window_mask is None and back._peak_fixed is None
    assert back.base.tolist() == tl.base.tolist() and back.slots == tl.slots
    assert decide(back, int(0.6 * tl.base_peak)) == decision


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), fraction=st.floats(0.3, 1.0))
def test_a_remembered_greedy_run_is_the_run(seed, fraction):
    """A search remembers its greedy runs (a budget decision's is one of the minimum search's
    when the budget is one of its targets): a run asked for again, or by the other search,
    is the plain greedy's, and the caller may change the set it gets."""
    tl = _random_timeline(seed, npoints=30, nslots=14)
    target = int(fraction * tl.base_peak)
    candidates = effective_slots(tl)
    for cache in (True, False):
        plain, plain_ev = _greedy._greedy_run(
            ConcreteTimeline(tl.base, tl.slots), candidates, target, cache
        )
        chosen, ev = _greedy._greedy_toward(tl, candidates, target, cache)
        assert (chosen, ev.peak) == (plain, plain_ev.peak)
        chosen.add(-1)
        again, second = _greedy._greedy_toward(tl, candidates, target, cache)
        assert (again, second.peak) == (plain, plain_ev.peak)
        assert _local_search._greedy_minimum(tl, target, cache) == (again, second.peak)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), fraction=st.sampled_from([0.8, 0.7, 0.6, 0.5, 0.4]))
def test_a_budget_the_first_pass_misses_gets_the_whole_search(seed, fraction):
    """With a budget, the minimum search first runs without its dearest search: a result of
    that pass that fits (or reaches the floor) is kept, else the decision is exactly the
    whole search's."""
    tl = _random_timeline(seed, npoints=30, nslots=14)
    budget = int(fraction * tl.base_peak)
    dearest = _local_search._minimum_from_all
    with _replaced("_minimum_from_all", mock.MagicMock(side_effect=dearest)) as runs:
        found = minimum_peak(tl, budget)
    assert found.peak == predict_peak(tl, found.evicted, found.cache)
    fresh = ConcreteTimeline(base=tl.base, slots=tl.slots)
    rounds = _search._minimum_rounds
    with _replaced("_minimum_rounds", lambda t, b, **_: rounds(t, b, dearest=True)):
        whole = minimum_peak(fresh, budget)
    floor = tl.unevictable()[0]
    if found.reachable:
        assert found.peak <= budget
    elif found.peak <= floor:
        assert whole.peak >= found.peak  # no set peaks below the floor
    else:
        assert runs.called
        assert found == whole


def test_gains_of_a_negative_size_follow_the_plain_formula():
    # Sizes are never negative in compiled timelines; the estimate still keeps its formula.
    tl = ConcreteTimeline(
        base=np.array([10, 40, 30, 50, 20]),
        slots=(slot(0, -5, 1, 3), slot(1, 10, 0, 4, deps=(0,)), slot(2, 20, 2, 3, cost=2.0)),
    )
    for evicted in ([], [0], [1, 2], [0, 1, 2]):
        ev = evaluate(tl, evicted, False)
        for budget in (0, 25, 45):
            assert _gains(tl, ev, budget).tolist() == _plain_gains(tl, ev, budget)


# --------------------------------------------------------------------------- search effort
def _every_subset(tl: ConcreteTimeline, candidates, budget):
    """Every subset in both regimes, each evaluated: the cheapest that fits, else the smallest
    peak (ties: the smaller subset, then combinations order, then the cache regime)."""
    fit, low = None, None
    for n in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, n):
            for cache in (True, False):
                ev = _plain_evaluate(tl, subset, cache)
                if ev[0] <= budget:
                    key = (ev[1], ev[0], not cache, n, subset)
                    fit = key if fit is None or key < fit else fit
                else:
                    key = (ev[0], ev[1], not cache, n, subset)
                    low = key if low is None or key < low else low
    best = fit if fit is not None else low
    return frozenset(best[4]), not best[2]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.6, 0.4])
def test_the_exact_search_skips_only_sets_that_cannot_win(seed, fraction):
    """Subsets are tried by the sum of their own costs, and once one fits, those whose sum
    exceeds its cost are skipped: the answer is that of every subset tried."""
    tl = _random_timeline(seed, npoints=20, nslots=6)
    budget = int(fraction * tl.base_peak)
    candidates = effective_slots(tl)
    evaluated = []
    real = _evaluate_once

    def counted(*args):
        evaluated.append(args[1:])
        return real(*args)

    with _replaced("_evaluate_once", counted):
        found = _search._exact(tl, candidates, budget)
    assert (found.evicted, found.cache) == _every_subset(tl, candidates, budget)
    if found.reachable and found.cost < sum(tl.slots[k].cost for k in candidates):
        assert len(evaluated) < 2 * (2 ** len(candidates) - 1)


@settings(max_examples=60, deadline=None)
@given(chained_timelines(), st.sampled_from([None, 0.9, 0.7, 0.5]))
def test_the_minimum_search_stops_at_the_floor_with_the_same_peak(tl, fraction):
    """No set peaks below the floor, so the searches stop at the first result there (or at
    the first within a budget): the peak is the one the whole search reaches."""
    budget = None if fraction is None else int(fraction * tl.base_peak)
    found = minimum_peak(tl, budget)
    fresh = ConcreteTimeline(base=tl.base, slots=tl.slots)
    with mock.patch.object(ConcreteTimeline, "unevictable", lambda _tl: (-1, 0)):
        whole = minimum_peak(fresh, budget)
    if budget is None or not whole.reachable:
        assert found.peak == whole.peak
    assert found.reachable == whole.reachable
    assert found.peak == predict_peak(tl, found.evicted, found.cache)
    assert found.peak >= tl.unevictable()[0]


def test_a_search_at_the_floor_skips_the_dearest_search():
    tl = ConcreteTimeline(
        base=np.array([10, 40, 40, 40, 10]), slots=(slot(0, 30, 1, 4, regen_peak=5),)
    )
    assert tl.unevictable()[0] == 10
    # Evicting the slot reaches the floor at once; every-eviction-first is not started.
    with _replaced("_minimum_from_all", mock.MagicMock(side_effect=AssertionError)) as dear:
        best = minimum_peak(tl)
    assert best.peak == 10 and best.evicted == frozenset({0})
    assert dear.call_count == 0


# --------------------------------------------------------------------------- search cost
def test_a_call_is_walked_again_only_when_what_it_materializes_changes():
    """Slot 2's plan names slots 0 and 1, its recomputation reads 1 only: evicting 0 as well
    leaves its regenerate call as it was (taken from the last walk, not built again), evicting
    1 no more changes it."""
    chained = SlotTimeline(
        name="t2", nbytes=5, cost=1.0, start=2, site=3, regen_peak=5,
        plan=((0, ()), (1, ()), (2, (1,))),
    )  # fmt: skip
    tl = ConcreteTimeline(
        base=np.full(10, 100), slots=(slot(0, 5, 1, 8), slot(1, 5, 1, 7), chained)
    )
    built = []
    real = _calls._run

    def counted(tl, k, pending, keep):
        built.append(k)
        return real(tl, k, pending, keep)

    with _replaced("_run", counted):
        first = evaluate(tl, {1, 2}, False)
        assert sorted(built) == [1, 2]
        built.clear()
        second = evaluate(tl, {0, 1, 2}, False)
        assert built == [0]  # slot 2's call (materializing 1, then 2) is the last one
        built.clear()
        third = evaluate(tl, {0, 2}, False)
        assert built == [2]  # 1 is not evicted any more: slot 2 materializes itself alone
    for evicted, ev in (({1, 2}, first), ({0, 1, 2}, second), ({0, 2}, third)):
        peak, cost, live, events = _plain_evaluate(tl, evicted, False)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)


@settings(max_examples=60, deadline=None)
@given(chained_timelines(), st.data())
def test_sets_that_differ_in_one_slot_follow_the_plain_model(tl, data):
    """A search's trial sets differ in one slot from the set before: walked one after another,
    each reusing the regenerate calls that still hold, in every regime, they give the plain
    model's numbers, and the events' arrays are the events."""
    indices = st.sampled_from(range(len(tl.slots)))
    evicted = set(data.draw(st.frozensets(indices)))
    for _ in range(12):
        evicted ^= {data.draw(indices)}
        cache = data.draw(st.one_of(st.booleans(), st.frozensets(indices)))
        ev = evaluate(tl, evicted, cache)
        peak, cost, live, events = _plain_evaluate(tl, evicted, cache)
        assert (ev.peak, ev.cost, ev.live.tolist(), ev.events) == (peak, cost, live, events)
        for limit in sorted({v for _, v, _ in events} | {ev.peak, -1}):
            assert ev.events_above(limit) == [e for e in events if e[1] > limit]


@pytest.mark.parametrize("seed", range(6))
def test_a_budget_below_what_always_stays_goes_to_the_minimum_search(seed):
    """Below the bytes live at some point whatever is evicted, no greedy can fit: the decision
    is the minimum search's, and no greedy runs (it would evict all it can, for nothing)."""
    tl = _random_timeline(seed)
    assert 1 < int(tl._fewest().max())
    with _replaced("_greedy", mock.MagicMock(side_effect=AssertionError)) as greedy:
        decision = decide(tl, 1)
    assert greedy.call_count == 0
    assert decision == minimum_peak(ConcreteTimeline(tl.base, tl.slots), 1)
    assert not decision.reachable


@pytest.mark.parametrize("seed", range(4))
def test_a_few_slots_are_still_tried_exactly_below_what_always_stays(seed):
    """With ten slots or fewer the exact search runs whatever the budget: in the pure regimes
    its least peak may be below the minimum search's."""
    tl = _random_timeline(seed, npoints=20, nslots=6)
    budget = int(tl._fewest().max()) - 1
    with _replaced("_exact", mock.MagicMock(side_effect=_search._exact)) as exact:
        decision = decide(tl, budget)
    assert exact.call_count == 1 and not decision.reachable
    lowest = minimum_peak(ConcreteTimeline(tl.base, tl.slots), budget)
    assert decision.peak <= lowest.peak


@pytest.mark.parametrize("seed", range(6))
def test_a_budget_below_what_always_stays_runs_the_whole_search_at_once(seed):
    """A first pass without the dearest search cannot fit a budget below what stays live at
    some point whatever is evicted: only the whole search runs."""
    tl = _random_timeline(seed)
    budget = int(tl._fewest().max()) - 1
    rounds = _search._minimum_rounds
    with _replaced("_minimum_rounds", mock.MagicMock(side_effect=rounds)) as passes:
        found = minimum_peak(tl, budget)
    assert [call.kwargs["dearest"] for call in passes.call_args_list] == [True]
    assert found.peak == predict_peak(tl, found.evicted, found.cache)


def test_a_budget_pass_runs_the_local_searches_of_every_round_first():
    """A budget the greedy misses is often met only by a round that keeps a tensor (the
    local searches all go through the regeneration that makes the peak): the first pass runs
    the local searches of every round, here two, and builds no floor (a pass that meets the
    budget is the same without it). None of them meets this budget: the whole search follows,
    floor first, and one of its greedy starts does."""
    tl = _random_timeline(45)
    calls = []
    real_local, real_greedy, real_floor = (
        _local_search._minimum,
        _local_search._greedy_minimum,
        ConcreteTimeline._floor,
    )

    def local(t, cache, limit=-1):
        calls.append(("local", bool(t._kept_set)))
        return real_local(t, cache, limit)

    def greedy(t, target, cache):
        calls.append(("greedy", bool(t._kept_set)))
        return real_greedy(t, target, cache)

    def floor(t):
        calls.append(("floor", bool(t._kept_set)))
        return real_floor(t)

    with (
        _replaced("_minimum", local),
        _replaced("_greedy_minimum", greedy),
        mock.patch.object(ConcreteTimeline, "_floor", floor),
    ):
        found = minimum_peak(tl, 134)
    assert found.reachable and found.peak <= 134
    first_greedy = calls.index(("greedy", False))
    assert ("local", True) in calls[: calls.index(("floor", False))]
    assert ("floor", False) in calls[:first_greedy]
    assert found.peak == predict_peak(tl, found.evicted, found.cache)


@pytest.mark.parametrize("seed", [0, 5, 10, 11])
def test_the_later_rounds_leave_out_the_dearest_search_and_greed_keeps_temporaries(seed):
    """The rounds that keep a tensor run without the dearest search (it evaluates the return
    of every evicted slot in each of its steps), and every round's greedy starts are in the
    temp regime: these seeds run more than one round."""
    tl = _random_timeline(seed)
    real_once, real_greedy = _search._minimum_once, _local_search._greedy_minimum
    with (
        _replaced("_minimum_once", mock.MagicMock(side_effect=real_once)) as rounds,
        _replaced(
            "_minimum_from_all", mock.MagicMock(side_effect=_local_search._minimum_from_all)
        ) as dear,
        _replaced("_greedy_minimum", mock.MagicMock(side_effect=real_greedy)) as greedy,
    ):
        best = minimum_peak(tl)
    assert rounds.call_count > 1 and dear.call_count == 1
    assert greedy.call_count > 0
    assert all(call.kwargs["cache"] is False for call in greedy.call_args_list)
    assert best.peak == predict_peak(tl, best.evicted, best.cache)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("cache", [True, False])
def test_a_local_search_stops_within_its_limit(seed, cache):
    """With a limit (the budget, or the floor) the local searches stop at their first set
    within it; without one they run until no move lowers the peak."""
    tl = _random_timeline(seed)
    whole, lowest = _local_search._minimum(tl, cache)
    assert lowest == predict_peak(tl, whole, cache)
    assert _local_search._minimum(tl, cache, limit=tl.base_peak) == (set(), tl.base_peak)
    limit = (lowest + tl.base_peak) // 2
    chosen, peak = _local_search._minimum(tl, cache, limit=limit)
    assert peak <= limit and len(chosen) <= len(whole)
    evicted, keep = _local_search._refine(tl, set(whole), cache, limit=lowest)
    assert evicted == frozenset(whole)


def test_the_fallbacks_set_is_made_cheaper_without_swaps():
    """Swapping a large tensor in (each try a repair from far above the budget) is left to
    the greedy's sets; the minimum search's set is made cheaper by putting back and
    repairing."""
    tl = _random_timeline(112, npoints=40, nslots=16)
    budget = int(0.65 * tl.base_peak)
    with _replaced("_swap_in", mock.MagicMock(side_effect=AssertionError)) as swaps:
        decision = decide(tl, budget)
    assert swaps.call_count == 0
    assert decision.reachable and decision.peak <= budget


def test_keeping_a_chained_input_makes_a_set_cheaper_where_the_budget_allows():
    """Slots 1 and 2 regenerate from slot 0: as a temporary, 0 is recomputed for each of them
    and at its own call (14); kept once materialized, once (6), but it holds its bytes up to
    its own call, over the point that then peaks at 25."""
    slots = (slot(0, 5, 1, 10, cost=4.0), slot(1, 5, 2, 5, deps=(0,)), slot(2, 5, 3, 7, deps=(0,)))
    base = np.full(12, 10)
    base[8] += 10
    for s in slots:
        base[s.start : s.site + 1] += s.nbytes
    tl = ConcreteTimeline(base=base, slots=slots)
    evicted = frozenset({0, 1, 2})
    assert (evaluate(tl, evicted, False).peak, evaluate(tl, evicted, False).cost) == (20, 14.0)
    kept = frozenset({0})
    assert (evaluate(tl, evicted, kept).peak, evaluate(tl, evicted, kept).cost) == (25, 6.0)
    assert _cheapening._keep_more(tl, evicted, frozenset(), 30) == frozenset({0})
    assert _cheapening._keep_more(tl, evicted, frozenset(), 24) == frozenset()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), fraction=st.sampled_from([0.8, 0.7, 0.6, 0.5]))
def test_keeping_more_never_costs_more_or_breaks_the_budget(seed, fraction):
    tl = _random_timeline(seed, npoints=30, nslots=14)
    budget = int(fraction * tl.base_peak)
    found = minimum_peak(tl, budget)
    if not found.reachable or found.cache is True:
        return
    keep = found.cache or frozenset()
    more = _cheapening._keep_more(tl, found.evicted, keep, budget)
    assert keep <= more
    ev = evaluate(tl, found.evicted, more)
    assert ev.peak <= budget and ev.cost <= found.cost


@pytest.mark.parametrize("seed", [3, 7, 12])
def test_the_first_pass_runs_the_cache_local_search_alone_in_its_first_round(seed):
    """The first pass's first round runs the cache regime's local search alone; a round that
    keeps a tensor runs the temp regime's first."""
    tl = _random_timeline(seed)
    calls = []
    real_local = _local_search._minimum

    def local(t, cache, limit=-1):
        calls.append((bool(t._kept_set), cache))
        return real_local(t, cache, limit)

    with _replaced("_minimum", local):
        found = _search._minimum_sweeps(tl, int(0.5 * tl.base_peak))
    assert [cache for kept, cache in calls if not kept] == [True]
    later = [cache for kept, cache in calls if kept]
    assert not later or later[0] is False
    assert found.peak == predict_peak(tl, found.evicted, found.cache)


def test_a_budget_the_temp_greedy_misses_runs_no_cache_greedy():
    """The cache regime's greedy runs only when the temp regime's fits the budget; one that
    misses goes to the minimum search."""
    seen = {True: 0, False: 0}
    real = _greedy._greedy

    def greedy(t, candidates, budget, cache):
        found = real(t, candidates, budget, cache)
        regimes.append((cache, found is not None))
        return found

    for seed in range(40):
        tl = _random_timeline(seed, npoints=40, nslots=16)
        for fraction in (0.8, 0.6):
            regimes = []
            with _replaced("_greedy", greedy):
                decision = decide(tl, int(fraction * tl.base_peak))
            if not regimes:
                continue
            assert regimes[0][0] is False
            temp_fits = regimes[0][1]
            assert [cache for cache, _ in regimes] == ([False, True] if temp_fits else [False])
            seen[temp_fits] += 1
            assert decision.peak == predict_peak(tl, decision.evicted, decision.cache)
    assert seen[True] and seen[False]


@settings(max_examples=120, deadline=None)
@given(chained_timelines(), st.data())
def test_neighbours_in_the_temp_regime_follow_the_plain_model(tl, data):
    """A temp-regime step evaluates each trial (one slot more, or one put back) from the set's
    own evaluation: its live bytes plus or minus the slot's window, and only the calls that
    read or materialize the slot walked again. Every number is the plain model's, for slots
    the set already has (or lacks), slots that free nothing, and repeats too."""
    indices = st.sampled_from(range(len(tl.slots)))
    chosen = data.draw(st.frozensets(indices))
    if data.draw(st.booleans()):
        evaluate(tl, chosen ^ {data.draw(indices)}, False)  # one trial already known
    for add in (True, False):
        slots = data.draw(st.lists(indices, max_size=6))
        ev = evaluate(tl, chosen, False)
        results = _neighbours._evaluate_neighbours(tl, chosen, ev, slots, add)
        for x, result in zip(slots, results, strict=True):
            trial = chosen | {x} if add else chosen - {x}
            peak, cost, live, events = _plain_evaluate(tl, trial, False)
            assert (result.peak, result.cost, result.live.tolist(), result.events) == (
                peak,
                cost,
                live,
                events,
            )
            if trial:  # (remembered: the empty set's evaluation is made afresh)
                assert evaluate(tl, trial, False) is result


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_timeline_derives_what_one_built_from_its_slots_does(seed):
    """A timeline with slots kept shares the arrays of the plans with the one it was made from
    and derives the rest again: the same arrays as a timeline built from its slots."""
    tl = _random_timeline(seed, 40, 16)
    keep = frozenset(effective_slots(tl)[::3])
    kept = _timeline._kept(tl, keep)
    built = ConcreteTimeline(base=kept.base, slots=kept.slots)
    evaluate(tl, effective_slots(tl)[:5], False)  # (fills the shared caches)
    caches = {"_plan_reads", "_runs", "_runs_by_sequence", "_last_runs", "_earlier_runs"}
    caches |= {"_evaluations", "_kept_set", "_kept_evaluations"}
    assert set(vars(kept)) == set(vars(built))
    for name, value in vars(built).items():
        if name not in caches:
            found = getattr(kept, name)
            if isinstance(value, np.ndarray):
                assert np.array_equal(found, value), name
            else:
                assert found == value, name
    assert kept._kept_set == keep
    for k in keep:
        assert not kept._effective_mask[k] and kept.slots[k].start == tl.slots[k].site + 1
    assert np.array_equal(kept.window_bytes(), built.window_bytes())
    assert kept.unevictable() == built.unevictable()


class _WalkedNeighbours:
    """:class:`_neighbours._TempNeighbours` by walking every set in full (what it saves)."""

    def __init__(self, tl: ConcreteTimeline, ev) -> None:
        self.tl, self.chosen = tl, frozenset(run.slot for run in ev.calls)

    def added(self, x: int):
        return _calls._walk(self.tl, self.chosen | {x}, 0)

    def removed(self, x: int):
        return _calls._walk(self.tl, self.chosen - {x}, 0)


def _walked_neighbours(tl, chosen, ev, slots, add):
    return [evaluate(tl, chosen | {x} if add else chosen - {x}, False) for x in slots]


@pytest.mark.parametrize("seed", range(10))
def test_decisions_are_the_same_with_every_set_walked_in_full(seed):
    """The searches evaluate temp-regime sets one slot away from an evaluated one from its
    evaluation: the decisions are those of evaluating every set in full."""
    npoints, nslots = (30, 12) if seed % 2 else (80, 30)
    tl = _random_timeline(seed, npoints, nslots)
    budgets = [int(f * tl.base_peak) for f in (0.9, 0.75, 0.6, 0.45)]

    def decisions() -> list[Decision]:
        fresh = [_random_timeline(seed, npoints, nslots) for _ in range(len(budgets) + 1)]
        found = [decide(t, b, exact_limit=0) for t, b in zip(fresh, budgets)]
        return found + [minimum_peak(fresh[-1])]

    fast = decisions()
    with (
        _replaced("_evaluate_neighbours", _walked_neighbours),
        _replaced("_TempNeighbours", _WalkedNeighbours),
    ):
        walked = decisions()
    assert fast == walked
    assert any(d.evicted for d in fast)

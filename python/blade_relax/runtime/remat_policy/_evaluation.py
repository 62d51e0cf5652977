"""Evaluating an eviction set: its live bytes per point, its predicted peak and its cost.

:func:`evaluate` is the model's prediction for one set in one regime (see
:mod:`blade_relax.runtime.remat_policy`); a search remembers what it evaluated, and
:func:`_evaluate_many` evaluates a search step's trial sets together. :class:`Decision` is what
the runtime does for one call: a set evaluated against a budget (:func:`_decision`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._calls import _keep_mask, _Run, _Walk, _walk
from ._timeline import ConcreteTimeline, Regime


@dataclass(frozen=True)
class Decision:
    """What the runtime does for one call.

    Attributes
    ----------
    evicted
        Slots to evict.
    cache
        The regime of chained inputs: kept once materialized (``True``), temporaries
        (``False``), or kept when in the given set (mixed).
    peak
        Predicted peak with those evictions.
    base_peak
        Predicted peak with no eviction.
    cost
        Recompute cost of the evictions.
    budget
        The budget the decision was made for (``None``: no budget).
    reachable
        Whether ``peak`` fits the budget (always true without a budget).
    reason
        Why the budget is not reachable: ``"budget"`` (below the smallest peak the evictions
        reach) or ``"inexact"`` (the timeline leaves out allocations, set by the caller of
        :func:`decide`); ``None`` when reachable.
    """

    evicted: frozenset[int]
    cache: Regime
    peak: int
    base_peak: int
    cost: float
    budget: int | None
    reachable: bool
    reason: str | None = None


@dataclass
class Evaluation:
    """What the model predicts for one eviction set in one regime (see :func:`evaluate`).

    The searches remember evaluations and share them: treat one as read-only.

    Attributes
    ----------
    peak
        The predicted peak bytes: the most live at a point or during a materialization.
    cost
        The recompute cost: the cost of every materialization, summed in program order.
    live
        Live bytes at every point of the timeline.
    calls
        Every ``regenerate`` call, in program order (the live bytes at its site are
        ``live[site]``).
    excess
        Bytes above a budget, by budget, as the cheapening's repair has asked for them.
    """

    peak: int
    cost: float
    live: np.ndarray
    calls: list[_Run] = field(default_factory=list)
    excess: dict[int, int] = field(default_factory=dict)

    @functools.cached_property
    def held(self) -> list[int]:
        """The live bytes at the site of every call, in program order."""
        if not self.calls:
            return []
        return self.live[[run.site for run in self.calls]].tolist()

    @functools.cached_property
    def events(self) -> list[tuple[int, int, int]]:
        """(site, value, slot materialized) of every materialization, in program order.

        Built on first use: most evaluations of a search are only compared by peak and cost.
        """
        return [
            (run.site, at + offset, x)
            for run, at in zip(self.calls, self.held)
            for offset, x in zip(run.offsets, run.sequence)
        ]

    def events_above(self, limit: int) -> list[tuple[int, int, int]]:
        """The :attr:`events` whose value is above ``limit``, in program order.

        What the estimates and the peak's event need: only a call whose top reaches above
        the limit is gone through (most are well below).
        """
        out = []
        for run, at in zip(self.calls, self.held):
            if at + run.top > limit:
                for offset, x in zip(run.offsets, run.sequence):
                    if at + offset > limit:
                        out.append((run.site, at + offset, x))
        return out


def _store(tl: ConcreteTimeline, chosen: frozenset[int]) -> dict:
    """Where the evaluations of ``chosen`` are remembered.

    A timeline with slots kept (:func:`_kept`) evaluates a set without them exactly as the
    timeline it was made from (only the kept slots' windows differ): such sets share the
    evaluations of that timeline.
    """
    if tl._kept_set.isdisjoint(chosen):
        return tl._evaluations
    return tl._kept_evaluations


def _remembered(tl: ConcreteTimeline, chosen: frozenset[int], cache: Regime) -> Evaluation | None:
    """The evaluation of ``chosen`` in ``cache`` if the search has made it (see :func:`_store`)."""
    return _store(tl, chosen).get((chosen, cache))


def evaluate(tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime = True) -> Evaluation:
    """Predict the live bytes, the peak and the cost when ``evicted`` are evicted.

    The model of :mod:`blade_relax.runtime.remat_policy`: each evicted slot's bytes are
    missing over its window, and each ``regenerate`` call materializes what its plan needs,
    peaking above the live bytes at its site. The evaluation is remembered on the timeline
    (the searches meet the same sets again) until :func:`decide` or :func:`minimum_peak`
    next returns.

    Parameters
    ----------
    tl
        The concrete timeline.
    evicted
        Slot indices.
    cache
        The regime of chained inputs: kept once materialized (``True``), temporaries
        (``False``), or kept when in the given set (mixed).

    Returns
    -------
    Evaluation
        The live bytes per point, the peak, the cost and the materializations
        (:attr:`Evaluation.events`).
    """
    chosen = frozenset(evicted)
    if not chosen:
        return Evaluation(peak=tl.base_peak, cost=0.0, live=tl.base)
    # The searches meet the same sets again (a greedy's prefixes, a pruning's trials, the
    # rounds of a local search): a search remembers what it evaluated (see _forgets_runs).
    key = (chosen, cache)
    store = _store(tl, chosen)
    found = store.get(key)
    if found is None:
        found = store[key] = _evaluate_once(tl, chosen, cache)
    return found


def _evaluate_once(tl: ConcreteTimeline, chosen: frozenset[int], cache: Regime) -> Evaluation:
    """:func:`evaluate` of a set that evicts something."""
    walk = _walk(tl, chosen, _keep_mask(cache))
    base = tl.base
    npoints = len(base)
    closed = np.array(walk.index, dtype=np.intp)
    nbytes = tl._nbytes[closed]
    delta = np.zeros(npoints + 1, dtype=np.int64)
    # (See _finish.)
    np.subtract.at(delta, tl._start[closed], nbytes)
    np.add.at(delta, np.array(walk.ends, dtype=np.int64) + 1, nbytes)
    live = base + np.cumsum(delta[:-1])
    peak = int(live.max()) if npoints else 0
    held = live[[run.site for run in walk.calls]].tolist()
    for at, run in zip(held, walk.calls):
        if at + run.top > peak:
            peak = at + run.top
    return Evaluation(peak=peak, cost=walk.cost, live=live, calls=walk.calls)


def _evaluate_many(
    tl: ConcreteTimeline, items: Sequence[tuple[Iterable[int], Regime]]
) -> list[Evaluation]:
    """:func:`evaluate` of every ``(evicted, cache)`` in ``items``, in order.

    A search step compares many trial sets: their live bytes are summed in one array
    operation (numpy's fixed cost per call is most of what a single evaluation costs).
    """
    out: list[Evaluation | None] = [None] * len(items)
    todo: dict[tuple[frozenset[int], Regime], list[int]] = {}
    for i, (evicted, cache) in enumerate(items):
        chosen = frozenset(evicted)
        if not chosen:
            out[i] = Evaluation(peak=tl.base_peak, cost=0.0, live=tl.base)
            continue
        found = _remembered(tl, chosen, cache)
        if found is not None:
            out[i] = found
        else:
            todo.setdefault((chosen, cache), []).append(i)
    if len(todo) == 1:
        # (One set: the single evaluation's arrays are smaller.)
        ((key, places),) = todo.items()
        ev = _store(tl, key[0])[key] = _evaluate_once(tl, *key)
        for i in places:
            out[i] = ev
    elif todo:
        walks = [_walk(tl, chosen, _keep_mask(cache)) for chosen, cache in todo]
        for (key, places), ev in zip(todo.items(), _finish(tl, walks)):
            _store(tl, key[0])[key] = ev
            for i in places:
                out[i] = ev
    return out  # type: ignore[return-value]


def _finish(tl: ConcreteTimeline, walks: Sequence[_Walk]) -> list[Evaluation]:
    """The live bytes and peaks of ``walks``, one row per walk."""
    base = tl.base
    npoints = len(base)
    rows = len(walks)
    width = npoints + 1
    index: list[int] = []
    ends: list[int] = []
    counts = []
    for walk in walks:
        index += walk.index
        ends += walk.ends
        counts.append(len(walk.index))
    closed = np.array(index, dtype=np.intp)
    row_start = np.repeat(np.arange(rows, dtype=np.int64) * width, counts)
    nbytes = tl._nbytes[closed]
    delta = np.zeros(rows * width, dtype=np.int64)
    # Each window [start, end] removes its bytes. When a storage is still held at its copy
    # (start > end), both are live in between: the same two updates with the roles of start
    # and end swapped.
    np.subtract.at(delta, tl._start[closed] + row_start, nbytes)
    np.add.at(delta, np.array(ends, dtype=np.int64) + 1 + row_start, nbytes)
    live = base + np.cumsum(delta.reshape(rows, width)[:, :npoints], axis=1)
    return _with_peaks(walks, live)


def _with_peaks(walks: Sequence[_Walk], live: np.ndarray) -> list[Evaluation]:
    """The evaluations of ``walks`` whose live bytes are the rows of ``live``: each peaks at
    the most bytes live at a point, or at a regenerate call (the live bytes at its site plus
    its own top)."""
    rows, npoints = live.shape
    if not npoints:
        return [
            Evaluation(peak=0, cost=walk.cost, live=row, calls=walk.calls)
            for walk, row in zip(walks, live)
        ]
    peaks = live.max(axis=1).tolist()
    # The live bytes at every call's site, all rows at once (a few numbers per row).
    held = live.ravel()[
        [row * npoints + run.site for row, walk in enumerate(walks) for run in walk.calls]
    ].tolist()
    out = []
    at = iter(held)
    for walk, peak, row in zip(walks, peaks, live):
        for run in walk.calls:
            value = next(at) + run.top
            if value > peak:
                peak = value
        out.append(Evaluation(peak=peak, cost=walk.cost, live=row, calls=walk.calls))
    return out


def _cost(tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime) -> float:
    """The recompute cost of evicting ``evicted``: :func:`evaluate`'s, from the regenerate
    calls alone (the walk) when the set has not been evaluated."""
    chosen = frozenset(evicted)
    if not chosen:
        return 0.0
    found = _remembered(tl, chosen, cache)
    if found is not None:
        return found.cost
    return _walk(tl, chosen, _keep_mask(cache)).cost


def predict_peak(tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime = True) -> int:
    """The predicted peak bytes when the slots in ``evicted`` are evicted.

    Parameters
    ----------
    tl
        The concrete timeline.
    evicted
        Slot indices.
    cache
        The regime of chained inputs (see :mod:`blade_relax.runtime.remat_policy`).

    Returns
    -------
    int
    """
    return evaluate(tl, evicted, cache).peak


def _decision(
    tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime, budget: int | None
) -> Decision:
    chosen = frozenset(evicted)
    ev = evaluate(tl, chosen, cache)
    reachable = budget is None or ev.peak <= budget
    return Decision(
        evicted=chosen,
        cache=cache,
        peak=ev.peak,
        base_peak=tl.base_peak,
        cost=ev.cost,
        budget=budget,
        reachable=reachable,
        reason=None if reachable else "budget",
    )


def _peak_event(ev: Evaluation) -> tuple[int, int | None]:
    """Where the predicted peak occurs: the point, and the slot being materialized if any
    (the first such materialization in program order)."""
    # (No event is above the peak: those above one byte less are at it.)
    hits = ev.events_above(ev.peak - 1)
    if hits:
        return hits[0][0], hits[0][2]
    return (int(np.argmax(ev.live)) if len(ev.live) else 0), None

"""An exact reference for the remat decision: the optimal eviction set, as an integer program.

The runtime (:mod:`blade_relax.runtime.remat_policy`) decides by exhaustive search on few
slots and by greedy and local searches on more. This module finds, for one concrete timeline,
the *optimal* eviction set under the same model (``evaluate``: the predicted peak and
recompute cost of an eviction set in a regime of chained inputs), with a mixed-integer program
in the manner of Checkmate (Jain et al., 2020) restricted to the evict / regenerate model,
solved by HiGHS through :func:`scipy.optimize.milp`. It is a yardstick for the runtime's
searches, not a runtime path.

Formulation (one program per pure regime)
-----------------------------------------
Slots are processed in the order of their ``regenerate`` sites (then index), as ``evaluate``
does.

* ``e[k]``: slot ``k`` is evicted (binary).
* ``m[j, x]``: slot ``x`` of ``j``'s plan is materialized at ``j``'s site. ``x`` is *pending*
  there when it is evicted and not available: its own site comes later and, in the cache
  regime, no earlier site materialized it (``pend = e[x] - sum of those m[j', x]``). A chained
  input is materialized iff it is pending and a later entry of the plan that reads it is
  materialized (``m <= pend``, ``m <= sum(readers)``, ``m >= pend + reader - 1``); ``j``
  itself iff evicted (temp regime) or evicted and not materialized earlier (cache regime). So
  for every ``e`` exactly one ``m`` is feasible, the one ``evaluate`` computes, and it is
  integral. (All of them are declared integral to the solver all the same: HiGHS 1.12's
  presolve returned suboptimal "optimal" answers with ``m`` continuous.)
* Live bytes at point ``i``: ``base[i]`` less, for every slot ``k``, its bytes when ``i`` lies in
  ``[start[k], end]``, where ``end`` is the site that first materializes ``k`` (in the cache
  regime exactly one site materializes an evicted slot, so this is linear in ``m``) or its own
  site (temp). When ``start > end + 1`` both copies are live in between, as in ``evaluate``.
* The materialization of ``x`` at ``j``'s site peaks at ``live[site] + regen_peak[x]`` plus
  the outputs of the earlier materializations of the call still held: all of them (cache), or
  those with a materialized reader at or after ``x`` (temp: a temporary is freed after its last
  reader; an AND, linearized exactly with a continuous variable).
* ``P >= live[i]`` (one point per run of points under the same windows: its largest base) and
  ``P >= live[site] + held + regen_peak[x] * m[j, x]`` for every possible materialization.
  No big-M is needed: when ``x`` is not materialized the right side is at most the value of
  the next materialization of the call (outputs held only grow in the cache regime; in the
  temp regime what is held before ``x`` is still held at the next materialization), or
  ``live[site]`` when the call runs nothing.
* Recompute cost: ``sum(cost[x] * m[j, x])``, divided by the largest slot cost.

In the temp regime, slots that free nothing (not ``effective``) are never evicted: evicting one
frees no byte at any point and only adds materializations (its own, and of chained inputs it
needs), so it never lowers a peak or a cost. Not so in the cache regime: there its
regeneration may materialize a chained input at its own (earlier) site, where fewer bytes are
live, in place of the input's own site.

:func:`optimal_minimum_peak` minimizes ``P``, then the cost with ``P`` at that minimum;
:func:`optimal_decision` minimizes the cost with ``P`` within the budget. Both solve the two
pure regimes and keep the better answer; the temp regime's answer bounds the cache regime's
search (a cutoff: the cache regime's programs are the harder ones where chains are deep). Every answer is re-evaluated with ``evaluate``: its
live bytes, materializations, peak and cost must equal the program's own values at the rounded
solution, and its peak must not exceed the solver's ``P`` (anything else is a formulation bug,
raised as :class:`RuntimeError`).

Limits
------
* The *mixed* regime (each chained input kept or a temporary, chosen per slot), which
  :func:`~blade_relax.runtime.remat_policy.minimum_peak` and ``decide`` may use, is left
  out: the runtime's answer can then beat this reference.
* Bytes are expressed in a unit: their greatest common divisor when the largest value is at
  most ``2**16`` of them (the answers are then exact), else ``1/2**16`` of the largest value
  (the solver's tolerances then make peaks optimal to within about a millionth of the peak;
  answers to a budget still fit it: a rounded answer that misses it by the tolerance is solved
  again with the budget tightened by the miss). Costs are optimal to within about ``1e-6`` of
  the largest slot cost.
* Plans must list dependencies first (no entry reads a later one) and name a slot once, as the
  compiler's do, and sizes must not be negative (:class:`ValueError` otherwise).
* The LP relaxation is weak where chains are deep (dozens of chained inputs per plan), mostly
  in the cache regime: a solve may then stop at its time limit (``optimal`` false). Compiled
  training steps, whose plans have a few entries, solve in a fraction of a second (a llama
  training step of 66 slots and 351 points: 0.15 s for the least peak); synthetic plans of up
  to 54 entries took about a minute.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from ..runtime.remat_policy import ConcreteTimeline, evaluate

__all__ = ["Optimum", "optimal_decision", "optimal_minimum_peak"]

# Most units of the largest byte value for which the unit is the exact common divisor: the
# solver's tolerances (about 1e-6 of a coefficient sum) stay well below one unit.
_EXACT_UNITS = 2**16
# Solves of a budget whose rounded answer keeps missing it by the tolerance.
_TIGHTENINGS = 3
# scipy.optimize.milp statuses.
_OPTIMAL = 0
_INFEASIBLE = 2


@dataclass(frozen=True)
class Optimum:
    """The optimal eviction set of one timeline in the pure regimes.

    Attributes
    ----------
    evicted
        Slots to evict.
    cache
        The regime of chained inputs: kept once materialized (``True``) or temporaries.
    peak
        Predicted peak bytes (``evaluate`` of the answer).
    cost
        Recompute cost of the answer.
    optimal
        Whether the solver proved every solve optimal (false when a time limit cut one short:
        the answer is then the best found).
    seconds
        Wall time, model building included.
    """

    evicted: frozenset[int]
    cache: bool
    peak: int
    cost: float
    optimal: bool
    seconds: float


@dataclass(frozen=True)
class _Plan:
    """What ``j``'s ``regenerate`` call can materialize: ``slots`` in plan order, ``j`` last;
    ``readers[p]``: the later positions whose entry reads ``slots[p]``."""

    slots: tuple[int, ...]
    readers: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Event:
    """One possible materialization: ``x`` (column ``column``) at ``j``'s site.

    ``held``: the earlier materializations of the call that may still be held then, as (slot,
    its column, the columns of its readers at or after ``x``); the readers are ``None`` in the
    cache regime, where every materialization is held to the end of the call.
    """

    j: int
    x: int
    column: int
    held: tuple[tuple[int, int, tuple[int, ...] | None], ...]


@dataclass(frozen=True)
class _Model:
    """The program of one regime (see the module docstring)."""

    cache: bool
    unit: float
    matrix: coo_array
    row_lower: np.ndarray
    row_upper: np.ndarray
    integrality: np.ndarray
    binary: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    peak: int
    # The cost of every column, divided by cost_scale (the largest slot cost).
    cost: np.ndarray
    cost_scale: float
    # (slot, site, column): the slot's bytes are missing from its start to that site when the
    # column is 1 (its first materialization in the cache regime, its eviction in temp).
    windows: tuple[tuple[int, int, int], ...]
    events: tuple[_Event, ...]


@dataclass(frozen=True)
class _Solution:
    """An answer of one regime, as ``evaluate`` sees it."""

    evicted: frozenset[int]
    peak: int
    cost: float
    optimal: bool


def _rank(tl: ConcreteTimeline) -> np.ndarray:
    """Each slot's place in the order ``evaluate`` processes them: by site, then index."""
    order = sorted(range(len(tl.slots)), key=lambda s: (tl.slots[s].site, s))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


def _plans(tl: ConcreteTimeline, rank: np.ndarray) -> list[_Plan]:
    """Per slot, the entries of its plan that its ``regenerate`` call may materialize.

    An entry can be needed only if a later entry that may be needed reads it (``_needed``
    walks the plan backwards), and only if its own site comes later (a slot regenerated
    earlier is available).
    """
    plans = []
    for j, slot in enumerate(tl.slots):
        names = [x for x, _ in slot.plan]
        if len(set(names)) != len(names):
            raise ValueError(f"slot {j} ({slot.name}): its plan names a slot twice: {names}")
        count = len(names)
        for p, (_, refs) in enumerate(slot.plan):
            ahead = [t for t in refs if t in names[p + 1 :]]
            if ahead:
                # _needed would materialize them without their own inputs.
                raise ValueError(
                    f"slot {j} ({slot.name}): plan entry {names[p]} reads {ahead}, listed after "
                    "it (a plan lists dependencies first)"
                )
        reads = [
            [q for q in range(p + 1, count) if names[p] in slot.plan[q][1]] for p in range(count)
        ]
        possible = [False] * count
        possible[-1] = True
        for p in range(count - 2, -1, -1):
            possible[p] = rank[names[p]] > rank[j] and any(possible[q] for q in reads[p])
        keep = [p for p in range(count) if possible[p]]
        where = {p: i for i, p in enumerate(keep)}
        plans.append(
            _Plan(
                slots=tuple(names[p] for p in keep),
                readers=tuple(tuple(where[q] for q in reads[p] if q in where) for p in keep),
            )
        )
    return plans


def _unit(tl: ConcreteTimeline) -> float:
    """The byte unit of the programs (see the module docstring)."""
    values = np.abs(np.concatenate([tl.base, tl.slot_bytes, tl.regen_peaks]).astype(np.int64))
    largest = (
        int(values.max(initial=0)) + int(tl.slot_bytes.sum()) + int(tl.regen_peaks.max(initial=0))
    )
    divisor = max(int(np.gcd.reduce(values)) if len(values) else 1, 1)
    if largest <= _EXACT_UNITS * divisor:
        return float(divisor)
    return largest / _EXACT_UNITS


class _Rows:
    """The columns and sparse rows ``lower <= sum(coef * column) <= upper`` of a program."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integral: list[int] = []
        self.binary: list[bool] = []
        self.col_lower: list[float] = []
        self.col_upper: list[float] = []

    def column(
        self, *, binary: bool, integral: bool = False, lower: float = 0.0, upper: float = 1.0
    ) -> int:
        """A new column: ``binary`` a 0/1 decision, ``integral`` declared so to the solver."""
        self.binary.append(binary)
        self.integral.append(int(integral))
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        return len(self.binary) - 1

    def add(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """One row; repeated columns add up."""
        row = len(self.lower)
        for col, val in terms:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)


def _points(tl: ConcreteTimeline, windows: list[tuple[int, int, int]]) -> np.ndarray:
    """Points enough for ``P >= live``: the largest base of each run of points under the same
    windows, and every site (materializations refer to the live bytes there)."""
    npoints = len(tl.base)
    cuts = {0}
    for k, site, _ in windows:
        cuts.update(c for c in (tl.slots[k].start, site + 1) if c < npoints)
    bounds = sorted(cuts) + [npoints]
    chosen = {lo + int(np.argmax(tl.base[lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:])}
    chosen.update(int(s) for s in tl.sites)
    return np.array(sorted(chosen), dtype=np.int64)


def _window(tl: ConcreteTimeline, k: int, site: int, points: np.ndarray) -> np.ndarray:
    """1 where slot ``k``'s bytes are missing when it comes back at ``site``, -1 where both of
    its copies are live (it starts after ``site + 1``), 0 elsewhere."""
    start = tl.slots[k].start
    missing = (points >= start) & (points <= site)
    doubled = (points > site) & (points < start)
    return missing.astype(np.int64) - doubled.astype(np.int64)


@dataclass(frozen=True)
class _Columns:
    """The decision columns of one regime's program (see the module docstring).

    ``evict[k]``: slot ``k`` is evicted. ``mat[j, x]``: slot ``x`` is materialized at ``j``'s
    site (``mat[j, j]`` is the eviction itself in the temp regime). ``chained[x]``: the sites
    that may materialize ``x`` as a chained input, in processing order.
    """

    cache: bool
    rank: np.ndarray
    evict: list[int]
    mat: dict[tuple[int, int], int]
    chained: dict[int, list[int]]

    def pending(self, j: int, x: int) -> list[tuple[int, float]]:
        """``x`` evicted and, in the cache regime, not materialized before ``j``'s site."""
        terms = [(self.evict[x], 1.0)]
        if self.cache:
            rank = self.rank
            terms += [(self.mat[s, x], -1.0) for s in self.chained[x] if rank[s] < rank[j]]
        return terms


def _minus(terms: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``terms`` negated."""
    return [(c, -v) for c, v in terms]


def _build(
    tl: ConcreteTimeline, plans: list[_Plan], rank: np.ndarray, unit: float, cache: bool
) -> _Model:
    """The program of one regime (see the module docstring), bytes in ``unit``."""
    nbytes = tl.slot_bytes / unit
    regen = tl.regen_peaks / unit
    rows = _Rows()
    columns = _decision_columns(rows, tl, plans, rank, cache)
    _chain_rows(rows, plans, columns)
    windows = [(k, slot.site, columns.mat[k, k]) for k, slot in enumerate(tl.slots)]
    if cache:
        windows += [
            (x, tl.slots[j].site, columns.mat[j, x])
            for j in range(len(tl.slots))
            for x in plans[j].slots[:-1]
        ]
    peak = rows.column(binary=False, lower=-np.inf, upper=np.inf)
    live = _live_rows(rows, tl, windows, peak, nbytes, unit)
    events = _event_rows(rows, tl, plans, columns, peak, live, nbytes, regen)
    cost, cost_scale = _objective(tl, columns, len(rows.binary))
    matrix = coo_array(
        (np.asarray(rows.vals), (np.asarray(rows.rows), np.asarray(rows.cols))),
        shape=(len(rows.lower), len(rows.binary)),
    )
    return _Model(
        cache=cache,
        unit=unit,
        matrix=matrix,
        row_lower=np.asarray(rows.lower),
        row_upper=np.asarray(rows.upper),
        integrality=np.asarray(rows.integral),
        binary=np.asarray(rows.binary),
        lower=np.asarray(rows.col_lower),
        upper=np.asarray(rows.col_upper),
        peak=peak,
        cost=cost,
        cost_scale=cost_scale,
        windows=tuple(windows),
        events=tuple(events),
    )


def _decision_columns(
    rows: _Rows, tl: ConcreteTimeline, plans: list[_Plan], rank: np.ndarray, cache: bool
) -> _Columns:
    """The columns ``e`` and ``m``, added to ``rows``: evictions first, then the
    materializations of each site in processing order."""
    slots = tl.slots
    n = len(slots)
    # In the temp regime a slot that frees nothing is never worth evicting (module docstring).
    evict = [
        rows.column(binary=True, integral=True, upper=1.0 if cache or s.effective else 0.0)
        for s in slots
    ]
    order = sorted(range(n), key=lambda s: rank[s])
    mat: dict[tuple[int, int], int] = {}
    chained: dict[int, list[int]] = {k: [] for k in range(n)}
    for j in order:
        mat[j, j] = rows.column(binary=True, integral=True) if cache else evict[j]
        for x in plans[j].slots[:-1]:
            mat[j, x] = rows.column(binary=True, integral=True)
            chained[x].append(j)
    return _Columns(cache=cache, rank=rank, evict=evict, mat=mat, chained=chained)


def _chain_rows(rows: _Rows, plans: list[_Plan], columns: _Columns) -> None:
    """The rows that make ``m`` the one materialization ``e`` implies: a slot at its own site
    iff pending (cache regime), a chained input iff pending and one of its readers is."""
    mat = columns.mat
    for j, plan in enumerate(plans):
        if columns.cache:
            rows.add([(mat[j, j], 1.0), *_minus(columns.pending(j, j))], 0.0, 0.0)
        for p, x in enumerate(plan.slots[:-1]):
            col = mat[j, x]
            readers = [mat[j, plan.slots[q]] for q in plan.readers[p]]
            pend = _minus(columns.pending(j, x))
            rows.add([(col, 1.0), *pend], -np.inf, 0.0)
            rows.add([(col, 1.0), *[(r, -1.0) for r in readers]], -np.inf, 0.0)
            for r in readers:
                rows.add([(col, 1.0), *pend, (r, -1.0)], -1.0, np.inf)


def _live_rows(
    rows: _Rows,
    tl: ConcreteTimeline,
    windows: list[tuple[int, int, int]],
    peak: int,
    nbytes: np.ndarray,
    unit: float,
) -> dict[int, int]:
    """A column of live bytes at each point that matters, and ``P`` above it; returns the
    columns by point."""
    points = _points(tl, windows)
    live: dict[int, int] = {}
    coefs = np.stack([_window(tl, k, site, points) * nbytes[k] for k, site, _ in windows], axis=1)
    for i, point in enumerate(points.tolist()):
        col = rows.column(binary=False, lower=-np.inf, upper=np.inf)
        live[point] = col
        terms = [(windows[w][2], float(coefs[i, w])) for w in np.flatnonzero(coefs[i])]
        rows.add([(col, 1.0), *terms], tl.base[point] / unit, tl.base[point] / unit)
        rows.add([(peak, 1.0), (col, -1.0)], 0.0, np.inf)
    return live


def _event_rows(
    rows: _Rows,
    tl: ConcreteTimeline,
    plans: list[_Plan],
    columns: _Columns,
    peak: int,
    live: dict[int, int],
    nbytes: np.ndarray,
    regen: np.ndarray,
) -> list[_Event]:
    """``P`` above every possible materialization: the live bytes at its site, the outputs
    of the call still held, and its own peak."""
    mat = columns.mat
    events: list[_Event] = []
    for j, plan in enumerate(plans):
        site = tl.slots[j].site
        for p, x in enumerate(plan.slots):
            held: list[tuple[int, int, tuple[int, ...] | None]] = []
            # Bytes of the outputs held at this materialization, as terms of the row of P.
            terms: list[tuple[int, float]] = []
            for a in range(p):
                y = plan.slots[a]
                if columns.cache:
                    held.append((y, mat[j, y], None))
                    terms.append((mat[j, y], -nbytes[y]))
                    continue
                later = tuple(mat[j, plan.slots[q]] for q in plan.readers[a] if q >= p)
                if not later:
                    continue  # freed after its last reader, before x
                held.append((y, mat[j, y], later))
                terms.append((_held_after(rows, mat[j, y], later), -nbytes[y]))
            events.append(_Event(j=j, x=x, column=mat[j, x], held=tuple(held)))
            rows.add([(peak, 1.0), (live[site], -1.0), *terms, (mat[j, x], -regen[x])], 0.0, np.inf)
    return events


def _held_after(rows: _Rows, made: int, later: tuple[int, ...]) -> int:
    """A column ``h = made AND any(later)`` (a temporary materialized and still to be read),
    linearized exactly."""
    h = rows.column(binary=False)
    rows.add([(h, 1.0), (made, -1.0)], -np.inf, 0.0)
    rows.add([(h, 1.0), *[(r, -1.0) for r in later]], -np.inf, 0.0)
    for r in later:
        rows.add([(h, 1.0), (made, -1.0), (r, -1.0)], -1.0, np.inf)
    return h


def _objective(tl: ConcreteTimeline, columns: _Columns, ncols: int) -> tuple[np.ndarray, float]:
    """The recompute cost of every column, divided by the largest slot cost (returned too)."""
    cost = np.zeros(ncols)
    top = max((abs(s.cost) for s in tl.slots), default=0.0)
    cost_scale = top if top > 0 else 1.0
    for (_, x), col in columns.mat.items():
        cost[col] += tl.slots[x].cost / cost_scale
    return cost, cost_scale


def _check(tl: ConcreteTimeline, model: _Model, values: np.ndarray, optimal: bool) -> _Solution:
    """The program's own values at a rounded solution, checked against ``evaluate``."""
    on = (np.rint(values) > 0) & model.binary
    slots = tl.slots
    evicted = frozenset(k for k in range(len(slots)) if on[k])
    points = np.arange(len(tl.base))
    live = tl.base.copy()
    for k, site, col in model.windows:
        if on[col]:
            live -= _window(tl, k, site, points) * tl.slot_bytes[k]
    events: list[tuple[int, int, int]] = []
    cost = 0.0
    for event in model.events:
        if not on[event.column]:
            continue
        site = slots[event.j].site
        value = int(live[site]) + slots[event.x].regen_peak
        for y, col, later in event.held:
            if on[col] and (later is None or any(on[r] for r in later)):
                value += slots[y].nbytes
        events.append((site, value, event.x))
        cost += slots[event.x].cost
    peak = max([int(live.max())] + [v for _, v, _ in events])
    ev = evaluate(tl, evicted, model.cache)
    what = f"the {'cache' if model.cache else 'temp'} program at {sorted(evicted)}"
    if not np.array_equal(ev.live, live):
        raise RuntimeError(
            f"{what}: live bytes {live.tolist()}, evaluate {np.asarray(ev.live).tolist()}"
        )
    if sorted(events) != sorted(ev.events):
        raise RuntimeError(f"{what}: materializations {sorted(events)}, evaluate {ev.events}")
    if peak != ev.peak or not math.isclose(cost, ev.cost, rel_tol=1e-9, abs_tol=1e-9):
        raise RuntimeError(f"{what}: peak {peak} and cost {cost}, evaluate {ev.peak} and {ev.cost}")
    solver_peak = float(values[model.peak]) * model.unit
    if peak > solver_peak + 1e-5 * max(abs(peak), 1) + model.unit:
        raise RuntimeError(
            f"{what}: peak {peak} above the solver's P ({solver_peak:.0f}): a missing constraint"
        )
    return _Solution(evicted=evicted, peak=ev.peak, cost=ev.cost, optimal=optimal)


def _solve(
    model: _Model,
    objective: np.ndarray,
    limit: float | None,
    time_limit: float,
    cost_limit: float | None = None,
):
    """One HiGHS solve; ``limit`` bounds the peak (bytes), ``cost_limit`` the cost."""
    upper = model.upper.copy()
    if limit is not None:
        upper[model.peak] = limit / model.unit
    constraints = [LinearConstraint(model.matrix.tocsr(), model.row_lower, model.row_upper)]
    if cost_limit is not None:
        # A cutoff: an answer of the other regime at this cost is known. Inclusive (ties go
        # by peak, then regime), with room for the sum's rounding.
        scaled = cost_limit / model.cost_scale
        constraints.append(
            LinearConstraint(model.cost[None, :], -np.inf, scaled + 1e-9 * max(1.0, abs(scaled)))
        )
    return milp(
        objective,
        integrality=model.integrality,
        bounds=Bounds(model.lower, upper),
        constraints=constraints,
        options={"time_limit": time_limit, "mip_rel_gap": 0.0},
    )


class _MissedBound(RuntimeError):
    """Rounded answers kept missing a peak bound by the solver's tolerance."""


def _cheapest(
    tl: ConcreteTimeline,
    model: _Model,
    limit: int,
    time_limit: float,
    cost_limit: float | None = None,
) -> _Solution | None:
    """The least-cost solution whose peak is within ``limit`` bytes (and cost within
    ``cost_limit``); ``None`` when there is none (proven)."""
    bound = float(limit)
    for _ in range(_TIGHTENINGS):
        result = _solve(model, model.cost, bound, time_limit, cost_limit)
        if result.x is None:
            if result.status == _INFEASIBLE:
                return None
            raise TimeoutError(
                f"no solution within {limit} bytes in {time_limit} s: {result.message}"
            )
        found = _check(tl, model, result.x, result.status == _OPTIMAL)
        if found.peak <= limit:
            return found
        # Rounding to integers crossed the bound by the solver's tolerance.
        bound -= found.peak - limit
    raise _MissedBound(
        f"the {'cache' if model.cache else 'temp'} program's answers keep missing {limit} bytes"
    )


def _lowest(
    tl: ConcreteTimeline, model: _Model, time_limit: float, limit: int | None = None
) -> _Solution | None:
    """The least peak, then the least cost at that peak; ``None`` when no peak is within
    ``limit`` (proven)."""
    objective = np.zeros(len(model.cost))
    objective[model.peak] = 1.0
    result = _solve(model, objective, limit, time_limit)
    if result.x is None:
        if result.status == _INFEASIBLE:
            return None
        if limit is not None:
            raise TimeoutError(f"no solution within {limit} bytes in {time_limit} s")
        # Cut short before any solution: evicting nothing is one.
        first = _Solution(frozenset(), tl.base_peak, 0.0, False)
    else:
        first = _check(tl, model, result.x, result.status == _OPTIMAL)
    try:
        second = _cheapest(tl, model, first.peak, time_limit)
    except (TimeoutError, _MissedBound):
        second = None
    if second is None or (second.peak, second.cost) > (first.peak, first.cost):
        return _Solution(first.evicted, first.peak, first.cost, False)
    return _Solution(second.evicted, second.peak, second.cost, first.optimal and second.optimal)


def _models(tl: ConcreteTimeline) -> tuple[_Model, _Model]:
    """The programs of the temp and cache regimes."""
    if (tl.slot_bytes < 0).any() or (tl.regen_peaks < 0).any():
        # The materializations' rows without big-M rely on held bytes never shrinking.
        raise ValueError("a slot has a negative size or regeneration peak")
    rank = _rank(tl)
    plans = _plans(tl, rank)
    unit = _unit(tl)
    return _build(tl, plans, rank, unit, False), _build(tl, plans, rank, unit, True)


def _answer(found: list[tuple[_Solution, bool]], optimal: bool, started: float) -> Optimum:
    best, cache = found[0]
    return Optimum(
        evicted=best.evicted,
        cache=cache,
        peak=best.peak,
        cost=best.cost,
        optimal=optimal and all(f.optimal for f, _ in found),
        seconds=time.perf_counter() - started,
    )


def optimal_minimum_peak(tl: ConcreteTimeline, *, time_limit: float = 60.0) -> Optimum:
    """The least predicted peak of any eviction set in a pure regime, at least cost.

    The temp regime is solved first (its programs are the easier ones where chains are
    deep); the cache regime then only searches for peaks within the temp regime's.

    Parameters
    ----------
    tl
        The concrete timeline.
    time_limit
        Seconds allowed to each solve (two per regime).

    Returns
    -------
    Optimum
        Ties in peak and cost go to the cache regime.

    Raises
    ------
    RuntimeError
        When an answer disagrees with ``evaluate`` (a formulation bug).
    """
    started = time.perf_counter()
    if not tl.slots or not len(tl.base):
        return Optimum(frozenset(), True, tl.base_peak, 0.0, True, 0.0)
    temp, cache = _models(tl)
    lowest = _lowest(tl, temp, time_limit)
    assert lowest is not None  # no limit: evicting nothing is a solution
    found = [(lowest, False)]
    optimal = True
    try:
        kept = _lowest(tl, cache, time_limit, limit=lowest.peak)
    except TimeoutError:
        kept, optimal = None, False
    if kept is not None:
        found.append((kept, True))
    found.sort(key=lambda f: (f[0].peak, f[0].cost, not f[1]))
    return _answer(found, optimal, started)


def optimal_decision(
    tl: ConcreteTimeline, budget: int, *, time_limit: float = 60.0
) -> Optimum | None:
    """The eviction set of least recompute cost whose predicted peak fits ``budget``, over both
    pure regimes.

    The temp regime is solved first; the cache regime then only searches for costs within the
    temp regime's.

    Parameters
    ----------
    tl
        The concrete timeline.
    budget
        Bytes.
    time_limit
        Seconds allowed to each solve (one per regime).

    Returns
    -------
    Optimum or None
        ``None`` when no eviction set fits in either pure regime (proven). Between the
        regimes, ties in cost go to the smaller peak, then to the cache regime (within a
        regime, any answer of least cost).

    Raises
    ------
    TimeoutError
        When no regime found a solution and one ran out of time before proving there is none.
    RuntimeError
        When an answer disagrees with ``evaluate`` (a formulation bug), or rounded answers
        keep missing the budget by the solver's tolerance.
    """
    started = time.perf_counter()
    if not tl.slots or not len(tl.base):
        if tl.base_peak > budget:
            return None
        return Optimum(frozenset(), True, tl.base_peak, 0.0, True, 0.0)
    found: list[tuple[_Solution, bool]] = []
    timed_out: TimeoutError | None = None
    for model in _models(tl):
        cost_limit = found[0][0].cost if found else None
        try:
            solution = _cheapest(tl, model, budget, time_limit, cost_limit)
        except TimeoutError as error:
            timed_out = error
            continue
        if solution is not None:
            found.append((solution, model.cache))
    if not found:
        if timed_out is not None:
            raise timed_out
        return None
    found.sort(key=lambda f: (f[0].cost, f[0].peak, not f[1]))
    return _answer(found, timed_out is None, started)

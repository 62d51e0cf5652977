"""The rematerialization decision on a concrete timeline: which tensors to evict for a budget.

Model
-----
A function compiled with ``Rematerialize`` has a timeline of *points* (every storage allocation
of the function, and every ``regenerate`` call). ``base[i]`` is the number of bytes live at
point ``i`` when nothing is evicted: at an allocation point, right after the allocation; at a
``regenerate`` point, right before the call.

Each evictable tensor (a *slot*) has:

* ``nbytes``: the bytes its storage frees;
* ``start``: the first point at which those bytes are gone when it is evicted (the VM has
  dropped its register right after the ``evict`` call);
* ``site``: the point of its own ``regenerate`` call;
* ``regen_peak``: the most bytes its regeneration allocates at once (its output included;
  for a slot offloaded to host memory, whose regeneration is a copy back, its own bytes:
  :func:`blade_relax.runtime.offload.eviction_timeline` builds that timeline);
* ``plan``: what its ``regenerate`` call materializes when it is evicted: a list of
  ``(slot, slot_inputs)`` in dependency order ending with the slot itself. An earlier entry is
  another evicted slot that the regeneration reads (a *chain*); it is materialized at this
  site, kept for its own ``regenerate`` call, and costs nothing more there.

A decision is an evicted set ``S`` and a *regime* for chained inputs:

``cache``
    A chained input is materialized at the first site that needs it and kept until its own
    ``regenerate`` call: each evicted slot is recomputed once, but its bytes come back early.
    A slot's bytes are missing on the points ``[start, end]``, where ``end`` is the first site
    that materializes it.
``temp``
    A chained input is recomputed as a temporary wherever it is needed and dropped after its
    last reader: more recomputation, less memory. A slot's bytes are missing on
    ``[start, site]``.
mixed
    A set of slots: a chained input in the set is kept (as in ``cache``), any other is a
    temporary (as in ``temp``).

At a site, each materialization ``x`` in order peaks at ``live[site] + (outputs of the
materializations still held) + regen_peak[x]``. The predicted peak is the largest of all those
values and of the live bytes at every point; the recompute cost is the sum of the costs of
every materialization.

Decision
--------
:func:`decide` returns, over both regimes, the evicted set of least recompute cost whose
predicted peak fits the budget: exact (every subset that can win) when few slots can free
memory, greedy otherwise (repeatedly the slot that removes the most bytes above the budget per
unit of cost, then a pruning pass that puts back every slot the budget does not need, dearest
first; in the temp regime, and in the cache regime too when the temp regime's fits). When no
greedy set fits, :func:`minimum_peak` searches for the smallest peak, also in a *mixed* regime
(each chained input kept or recomputed as a temporary, chosen per slot): a first pass of the
local searches alone, round by round, then the whole search when that pass neither fits the
budget nor reaches the floor (at once, and without the greedy, when the budget is below what
stays live at some point whatever is evicted). When one of its results fits the budget, the
first that does is the decision, else the decision runs at the smallest peak found and says
the budget is not reachable. A set that fits, from either path, is then made cheaper while it
still fits (:func:`_cheapen`: put back one of its dearest evictions, repair with cheaper ones
evaluated exactly, put back what is not needed; for the greedy's set, also swap a large
tensor in for what it makes unnecessary), since the greedy's choices one at a time and the
minimum search's choices by peak leave work that the budget does not need.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

__all__ = [
    "ConcreteTimeline",
    "Decision",
    "SlotTimeline",
    "decide",
    "minimum_peak",
    "predict_peak",
]

Regime = bool | frozenset
"""Which chained inputs are kept once materialized: all (``True``, the cache regime), none
(``False``, the temp regime), or the slots in a set (mixed)."""


# Up to this many slots that can free memory, the decision tries every subset.
EXACT_LIMIT = 10


@dataclass(frozen=True)
class SlotTimeline:
    """One evictable tensor, in concrete bytes (see the module docstring).

    Attributes
    ----------
    name
        The variable name, for reports.
    nbytes
        Bytes freed while it is evicted.
    cost
        Recompute cost of its own regeneration (its chained inputs are slots of their own).
    start
        First point where its bytes are gone when evicted.
    site
        Point of its ``regenerate`` call.
    regen_peak
        Most bytes its regeneration allocates at once, its output included.
    plan
        ``(slot, slot_inputs)`` materialized at its site when evicted, dependencies first, the
        slot itself last.
    """

    name: str
    nbytes: int
    cost: float
    start: int
    site: int
    regen_peak: int
    plan: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def effective(self) -> bool:
        """Whether evicting it frees anything at all."""
        return self.nbytes > 0 and self.start <= self.site


@dataclass(frozen=True)
class ConcreteTimeline:
    """A function's timeline at concrete dims.

    Attributes
    ----------
    base
        Live bytes at every point when nothing is evicted.
    slots
        The evictable tensors.
    """

    base: np.ndarray
    slots: tuple[SlotTimeline, ...]

    def __post_init__(self) -> None:
        base = np.asarray(self.base, dtype=np.int64)
        object.__setattr__(self, "base", base)
        npoints = len(base)
        for k, slot in enumerate(self.slots):
            if not (0 <= slot.start <= npoints and 0 <= slot.site < max(npoints, 1)):
                raise ValueError(
                    f"slot {k} ({slot.name}): start {slot.start} / site {slot.site} outside "
                    f"the {npoints} points of the timeline"
                )
            if not slot.plan or slot.plan[-1][0] != k:
                raise ValueError(f"slot {k} ({slot.name}): its plan must end with the slot itself")
        self._derive_plans()
        self._derive_windows()

    def _derive_plans(self) -> None:
        """The arrays of the searches that the plans, sizes, costs and sites give (not part
        of the value): a timeline with slots kept shares them (see :func:`_build_kept`)."""
        slots = self.slots
        object.__setattr__(self, "_nbytes", np.array([x.nbytes for x in slots], dtype=np.int64))
        object.__setattr__(self, "_regen", np.array([x.regen_peak for x in slots], dtype=np.int64))
        # Costs as the greedy searches divide by them (never zero).
        object.__setattr__(self, "_costs", np.array([max(x.cost, 1e-9) for x in slots]))
        object.__setattr__(self, "_site", np.array([x.site for x in slots], dtype=np.int64))
        object.__setattr__(self, "_plan_slots", [frozenset(x for x, _ in s.plan) for s in slots])
        object.__setattr__(self, "_refs", [dict(s.plan) for s in slots])
        # Sizes and costs as the regenerate calls sum them (see _build_run).
        object.__setattr__(
            self,
            "_sizes",
            ([x.nbytes for x in slots], [x.regen_peak for x in slots], [x.cost for x in slots]),
        )
        object.__setattr__(
            self, "_plan_masks", [sum(1 << x for x in plan) for plan in self._plan_slots]
        )
        # Each slot's place in the order its regenerate call runs (site, then index).
        order = sorted(range(len(slots)), key=lambda k: (slots[k].site, k))
        rank = [0] * len(slots)
        for place, k in enumerate(order):
            rank[k] = place
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_sizes_nonnegative", bool((self._nbytes >= 0).all()))

    def _derive_windows(self) -> None:
        """The arrays of the searches that the starts give, and their caches."""
        slots = self.slots
        object.__setattr__(self, "_start", np.array([x.start for x in slots], dtype=np.int64))
        # Each plan backwards with what each entry reads as a bit mask (built when first
        # walked: most timelines are decided without a search).
        object.__setattr__(self, "_plan_reads", [None] * len(slots))
        object.__setattr__(self, "_runs", {})
        object.__setattr__(self, "_runs_by_sequence", {})
        object.__setattr__(self, "_last_runs", [None] * len(slots))
        object.__setattr__(self, "_earlier_runs", [None] * len(slots))
        object.__setattr__(self, "_evaluations", {})
        # Results of the greedy runs (see _greedy_toward).
        object.__setattr__(self, "_greedy_runs", {})
        # Timelines with slots kept (see _kept).
        object.__setattr__(self, "_kept_timelines", {})
        # Slots kept by _kept, and the evaluations of the sets that evict one of them.
        object.__setattr__(self, "_kept_set", frozenset())
        object.__setattr__(self, "_kept_evaluations", self._evaluations)
        object.__setattr__(self, "_peak_fixed", None)
        object.__setattr__(self, "_window_mask", None)
        object.__setattr__(self, "_window_bytes", None)
        object.__setattr__(self, "_fewest_live", None)
        object.__setattr__(self, "_unevictable", None)
        object.__setattr__(
            self, "_effective_mask", np.array([x.effective for x in slots], dtype=bool)
        )

    def __getstate__(self) -> dict:
        # The value only: the searches' arrays and caches are rebuilt on loading.
        return {"base": self.base, "slots": self.slots}

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "base", state["base"])
        object.__setattr__(self, "slots", state["slots"])
        self.__post_init__()

    def window_mask(self) -> np.ndarray:
        """``mask[k, i]``: point ``i`` lies in slot ``k``'s window ``[start, site]``."""
        mask = self._window_mask
        if mask is None:
            points = np.arange(len(self.base))
            mask = (points[None, :] >= self._start[:, None]) & (
                points[None, :] <= self._site[:, None]
            )
            object.__setattr__(self, "_window_mask", mask)
        return mask

    def window_bytes(self) -> np.ndarray:
        """``bytes[k, i]``: slot ``k``'s bytes where its window covers point ``i``, else 0."""
        found = self._window_bytes
        if found is None:
            found = self.window_mask() * self._nbytes[:, None]
            object.__setattr__(self, "_window_bytes", found)
        return found

    @property
    def base_peak(self) -> int:
        """The peak with nothing evicted."""
        return int(self.base.max()) if len(self.base) else 0

    def unevictable(self) -> tuple[int, int]:
        """A floor under every peak an eviction set reaches, and the point that sets it.

        Two facts bound every decision from below, whatever it evicts:

        * At a point ``i``, at most the slots whose window covers ``i`` are missing, and a
          slot's bytes are back at its own ``regenerate`` call (kept, or recomputed into a
          tensor at least as large): what stays is ``base[i]`` minus the bytes of the slots
          with ``start <= i < site``.
        * Evicting slot ``k`` materializes it at its own site or at the site of a slot whose
          plan names it, and that regeneration peaks at no less than ``rise[k]``: the fewest
          bytes live there (``base`` minus every window covering the point, except those of
          the slots its recomputation reads, which are live or materialized before it) plus
          ``regen_peak[k]``, at the better of those sites. A decision that peaks at ``P``
          therefore evicts no slot with ``rise[k] > P``.

        The floor is the least ``P`` consistent with both: with the slots sorted by ``rise``,
        ``min over j of max(rise of the j-th, most bytes left at one point when only the
        first j may go)``. Chained regenerations (more bytes at a site) are left out, so it
        stays a bound; no decision peaks below it, and it says what holds the minimum up:
        tensors that are not evictable there (a kernel's inputs and outputs, a function's
        results, tensors with no recipe), or evictable ones whose regeneration would peak
        higher than keeping them.

        Returns
        -------
        tuple[int, int]
            The floor in bytes, and the point where it is reached (the site of the slot whose
            regeneration sets it, when that is what does).
        """
        found = self._unevictable
        if found is None:
            found = self._floor()
            object.__setattr__(self, "_unevictable", found)
        return found

    def _fewest(self) -> np.ndarray:
        """Live bytes per point with every evictable slot missing on its whole window: no
        eviction set goes below them (the first fact of :meth:`unevictable`)."""
        found = self._fewest_live
        if found is None:
            found = self.base - self.window_bytes()[self._effective_mask].sum(axis=0)
            object.__setattr__(self, "_fewest_live", found)
        return found

    def _floor(self) -> tuple[int, int]:
        npoints = len(self.base)
        if not npoints:
            return (0, 0)
        effective = [int(k) for k in np.flatnonzero(self._effective_mask)]
        covering = self.window_bytes()[effective]
        fewest = self._fewest()
        position = {k: i for i, k in enumerate(effective)}
        unique = np.bincount(self._site, minlength=npoints)
        # The fewest bytes live when slot k is materialized at a site: every window covering
        # the site is missing, except those of the slots the recomputation reads (live, or
        # materialized before it). One row per effective slot, one column per point.
        reads = np.zeros((len(effective), len(effective)), dtype=np.int64)
        for i, k in enumerate(effective):
            for r in self._refs[k][k]:
                if r in position:
                    reads[i, position[r]] += 1
        lowest = fewest + _product(reads, covering) + self._regen[effective, None]
        sites = self._site.tolist()

        # Options (rise, slot, end): evicting the slot and materializing it at a site ``end``
        # (its own, or that of a slot whose plan names it) removes its bytes on
        # ``[start, end)`` and peaks at no less than ``rise`` there.
        rows, ends, slots = [], [], []
        for k in effective:
            site = sites[k]
            rows.append(position[k])
            ends.append(site)
            slots.append(k)
            for x in self._plan_slots[k]:
                if x != k and x in position and site < sites[x]:
                    rows.append(position[x])
                    ends.append(site)
                    slots.append(x)
        options = sorted(zip(lowest[rows, ends].tolist(), slots, ends))
        left = self.base.copy()
        reach = {k: int(self._start[k]) for k in effective}
        best = (int(left.max()), int(np.argmax(left)))
        for n, (rise, k, end) in enumerate(options):
            if rise >= best[0]:
                break  # the options left rise at least as high: none lowers the bound
            if end > reach[k]:
                left[reach[k] : end] -= self._nbytes[k]
                reach[k] = end
            if end == self._site[k] and unique[end] == 1:
                # At its own site only a regeneration smaller than the tensor saves bytes.
                left[end] -= max(0, int(self._nbytes[k]) - int(self._regen[k]))
            elif end == self._site[k]:
                # Sharing a site, the model counts one regeneration there: none is credited.
                left[end] -= self._nbytes[k]
            if n + 1 < len(options) and options[n + 1][0] == rise:
                continue  # options of equal rise are allowed together
            most = int(left.max())
            bound = max(most, rise)
            if bound < best[0]:
                best = (bound, int(np.argmax(left)) if most >= rise else end)
        return best


# What ConcreteTimeline._derive_plans sets.
_PLAN_ARRAYS = (
    "_nbytes",
    "_regen",
    "_costs",
    "_site",
    "_plan_slots",
    "_refs",
    "_sizes",
    "_plan_masks",
    "_rank",
    "_sizes_nonnegative",
)


def _product(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``counts @ values`` of two integer matrices, in floating point when every partial sum
    is an integer it holds exactly (a matrix product of integers has no fast routine)."""
    if not counts.size or not values.size:
        return counts @ values
    bound = int(np.abs(counts).sum(axis=1).max()) * int(np.abs(values).max())
    if bound >= 2**53:
        return counts @ values
    product = counts.astype(np.float64) @ values.astype(np.float64)
    return product.astype(np.int64)


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
class _Evaluation:
    peak: int
    cost: float
    live: np.ndarray
    # Every regenerate call, in program order (the live bytes at its site are ``live[site]``).
    calls: list[_Run] = field(default_factory=list)
    # _excess by budget.
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


class _Run(NamedTuple):
    """One ``regenerate`` call, apart from the live bytes at its site (which the other
    evictions set): what :func:`_evaluate` needs of it, computed once per search."""

    # The slot whose call it is, and the call's point.
    slot: int
    site: int
    # The materializations, in order.
    sequence: tuple[int, ...]
    # Their recompute cost, summed in that order.
    cost: float
    # The slots whose windows close at the call: the slot, and its kept chained inputs; as a
    # bit mask, and the call's point once per slot (the ends of their windows).
    closes: tuple[int, ...]
    closes_mask: int
    ends: tuple[int, ...]
    # Each materialization's peak above the live bytes at the site.
    offsets: tuple[int, ...]
    top: int
    # What makes the call valid for other pending sets (see _walk): the chained inputs it
    # materializes, those of them it keeps, and the slots they read that it does not
    # materialize; as bit masks.
    inputs: int
    kept: int
    frontier: int


def _run(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """The ``regenerate`` call of ``k`` when the slots of the mask ``pending`` (of ``k``'s
    plan: evicted, and not materialized and kept before) are not available.

    ``keep`` is the mask of the slots kept once materialized (``-1``: all of them). What the
    call materializes is ``k`` and, dependencies first, the pending slots its recomputation
    reads, directly or through one another.
    """
    reads = tl._plan_reads[k]
    if reads is None:
        reads = tl._plan_reads[k] = _reads(tl.slots[k].plan)
    needed = 1 << k
    if reads.by_slot is not None:
        # What the recomputation reads, directly or through one another: followed from k
        # over the pending slots only (a few of a long plan).
        by_slot = reads.by_slot
        todo = by_slot[k] & pending
        while todo:
            low = todo & -todo
            needed |= low
            todo = (todo ^ low) | (by_slot[low.bit_length() - 1] & pending & ~needed)
    else:
        for x, refs in reads.backwards:
            if needed >> x & 1:
                needed |= refs & pending
    # Many pending sets lead to the same materializations (a search's sets differ in slots
    # the recomputation does not read): the call is the same when they and what it keeps are.
    key = (k, needed, needed & keep & ~(1 << k))
    found = tl._runs_by_sequence.get(key)
    if found is None:
        found = tl._runs_by_sequence[key] = _build_run(tl, k, reads, needed, keep, key[2])
    return found


def _build_run(
    tl: ConcreteTimeline, k: int, reads: _PlanReads, needed: int, keep: int, kept: int
) -> _Run:
    """:func:`_run` of the materializations ``needed`` (a bit mask), built."""
    frontier = 0
    members = 0  # the temporaries: chained inputs not kept
    if reads.by_slot is not None:
        # Each slot once in the plan: the materializations are the set bits, in plan order.
        by_slot = reads.by_slot
        sequence = []
        todo = needed
        while todo:
            low = todo & -todo
            todo ^= low
            x = low.bit_length() - 1
            sequence.append(x)
            frontier |= by_slot[x]
        if len(sequence) > 1:
            sequence.sort(key=reads.position.__getitem__)
        members = needed & ~keep & ~(1 << k)
    else:
        for x, refs in reads.backwards:
            if needed >> x & 1:
                frontier |= refs
        sequence = [x for x, _ in tl.slots[k].plan if needed >> x & 1]
        for x in sequence[:-1]:
            if not keep >> x & 1:
                members |= 1 << x
    nbytes, regen, costs = tl._sizes
    # A temporary lives until its last reader in the run: its bytes are dropped after it.
    dropped = [0] * len(sequence)
    if members:
        masks = reads.by_slot if reads.by_slot is not None else reads.last_masks
        last_reader: dict[int, int] = {}
        for i, x in enumerate(sequence):
            read = masks[x] & members
            while read:
                low = read & -read
                read ^= low
                last_reader[low.bit_length() - 1] = i
        for t, reader in last_reader.items():
            dropped[reader] += nbytes[t]
    offsets = []
    held = 0
    for x, drop in zip(sequence, dropped):
        offsets.append(held + regen[x])
        held += nbytes[x] - drop
    closes = tuple(x for x in sequence if x == k or keep >> x & 1)
    site = tl.slots[k].site
    return _Run(
        slot=k,
        site=site,
        sequence=tuple(sequence),
        cost=sum(costs[x] for x in sequence),
        closes=closes,
        closes_mask=sum(1 << x for x in closes),
        ends=(site,) * len(closes),
        offsets=tuple(offsets),
        top=max(offsets),
        inputs=needed & ~(1 << k),
        kept=kept,
        frontier=frontier & ~needed,
    )


class _PlanReads(NamedTuple):
    """What each entry of a plan reads, as bit masks (see :func:`_reads`)."""

    # By slot, when every entry is listed once, after what it reads (what reaches the slot is
    # then all :func:`_run` follows); else ``None``.
    by_slot: dict[int, int] | None
    # Each slot's place in the plan (with ``by_slot``).
    position: dict[int, int] | None
    # The entries backwards, walked in that order as the plan's order says (without
    # ``by_slot``), and what the last entry of each slot reads.
    backwards: list[tuple[int, int]] | None
    last_masks: dict[int, int] | None


def _reads(plan: tuple[tuple[int, tuple[int, ...]], ...]) -> _PlanReads:
    """What each entry of ``plan`` reads, as bit masks."""
    entries = [(x, _bit_mask(refs)) for x, refs in plan]
    masks = dict(entries)
    listed = _bit_mask(masks)
    seen = 0
    for x, _ in plan:
        if masks[x] & listed & ~seen:
            break  # an entry reads one listed after it
        seen |= 1 << x
    else:
        if len(masks) == len(plan):
            return _PlanReads(masks, {x: i for i, (x, _) in enumerate(plan)}, None, None)
    return _PlanReads(None, None, entries[::-1], masks)


def _bit_mask(slots: Iterable[int]) -> int:
    """The bit mask of ``slots``."""
    mask = 0
    for x in slots:
        mask |= 1 << x
    return mask


def _keep_mask(cache: Regime) -> int:
    """The bit mask of the slots a regime keeps once materialized (``-1``: every slot)."""
    if isinstance(cache, bool):
        return -1 if cache else 0
    mask = 0
    for k in cache:
        mask |= 1 << k
    return mask


class _Walk(NamedTuple):
    """The regenerate calls of one evicted set, in program order, and what they add up to."""

    cost: float
    calls: list[_Run]
    # Each closed window: its slot and its end (where the slot is materialized).
    index: list[int]
    ends: list[int]


def _holds(run: _Run | None, pending: int, keep: int) -> bool:
    """Whether ``run`` is its slot's regenerate call for ``pending`` and ``keep``: the pending
    set still has every input it materialized and none it reads beyond them, and it keeps
    the same of them (its recomputation then reaches the same slots)."""
    return (
        run is not None
        and not pending & run.frontier
        and pending & run.inputs == run.inputs
        and keep & run.inputs == run.kept
    )


def _other_call(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """Slot ``k``'s regenerate call when its last one does not hold: the one before it if that
    holds (a search's trial sets often differ in one slot that comes and goes), else the
    call remembered for the same pending set, else a new one. The two are remembered."""
    run = tl._earlier_runs[k]
    if not _holds(run, pending, keep):
        key = (k, pending, pending & keep)
        run = tl._runs.get(key)
        if run is None:
            run = tl._runs[key] = _run(tl, k, pending, keep)
    tl._earlier_runs[k] = tl._last_runs[k]
    tl._last_runs[k] = run
    return run


def _walk(tl: ConcreteTimeline, chosen: frozenset[int], keep: int) -> _Walk:
    """Which regenerate calls run when ``chosen`` are evicted, and what each materializes.

    The walk runs once per evaluation (but a temp-regime set one slot away from an evaluated
    one: see :class:`_TempNeighbours`), thousands of times per search: sets of slots are bit
    masks (Python integers) here, and each call is looked up by ``(slot, pending mask, kept
    part of it)``.
    """
    plan_masks = tl._plan_masks
    last = tl._last_runs
    chosen_mask = 0
    for k in chosen:
        chosen_mask |= 1 << k
    done = 0
    index: list[int] = []
    ends: list[int] = []
    calls: list[_Run] = []
    cost = 0.0
    for k in sorted(chosen, key=tl._rank.__getitem__):
        if done >> k & 1:
            continue
        # Kept materializations are in the stash; a plan never names a slot whose own
        # regenerate call came earlier. (A plan of the slot alone leaves it pending: it is
        # evicted and not materialized.)
        pending = plan_masks[k] & chosen_mask & ~done
        # The slot's last call, when it holds (:func:`_holds`, written out: the walk runs
        # this for every evicted slot of every evaluation); a search's trial sets mostly
        # differ elsewhere.
        run = last[k]
        if (
            run is None
            or pending & run.frontier
            or pending & run.inputs != run.inputs
            or keep & run.inputs != run.kept
        ):
            run = _other_call(tl, k, pending, keep)
        done |= run.closes_mask
        index += run.closes
        ends += run.ends
        cost += run.cost
        calls.append(run)
    return _Walk(cost, calls, index, ends)


def _store(tl: ConcreteTimeline, chosen: frozenset[int]) -> dict:
    """Where the evaluations of ``chosen`` are remembered.

    A timeline with slots kept (:func:`_kept`) evaluates a set without them exactly as the
    timeline it was made from (only the kept slots' windows differ): such sets share the
    evaluations of that timeline.
    """
    if tl._kept_set.isdisjoint(chosen):
        return tl._evaluations
    return tl._kept_evaluations


def _remembered(tl: ConcreteTimeline, chosen: frozenset[int], cache: Regime) -> _Evaluation | None:
    """The evaluation of ``chosen`` in ``cache`` if the search has made it (see :func:`_store`)."""
    return _store(tl, chosen).get((chosen, cache))


def _evaluate(tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime = True) -> _Evaluation:
    """Predict the live bytes, the peak and the cost when ``evicted`` are evicted."""
    chosen = frozenset(evicted)
    if not chosen:
        return _Evaluation(peak=tl.base_peak, cost=0.0, live=tl.base)
    # The searches meet the same sets again (a greedy's prefixes, a pruning's trials, the
    # rounds of a local search): a search remembers what it evaluated (see _forgets_runs).
    key = (chosen, cache)
    store = _store(tl, chosen)
    found = store.get(key)
    if found is None:
        found = store[key] = _evaluate_once(tl, chosen, cache)
    return found


def _evaluate_once(tl: ConcreteTimeline, chosen: frozenset[int], cache: Regime) -> _Evaluation:
    """:func:`_evaluate` of a set that evicts something."""
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
    return _Evaluation(peak=peak, cost=walk.cost, live=live, calls=walk.calls)


def _evaluate_many(
    tl: ConcreteTimeline, items: Sequence[tuple[Iterable[int], Regime]]
) -> list[_Evaluation]:
    """:func:`_evaluate` of every ``(evicted, cache)`` in ``items``, in order.

    A search step compares many trial sets: their live bytes are summed in one array
    operation (numpy's fixed cost per call is most of what a single evaluation costs).
    """
    out: list[_Evaluation | None] = [None] * len(items)
    todo: dict[tuple[frozenset[int], Regime], list[int]] = {}
    for i, (evicted, cache) in enumerate(items):
        chosen = frozenset(evicted)
        if not chosen:
            out[i] = _Evaluation(peak=tl.base_peak, cost=0.0, live=tl.base)
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


def _finish(tl: ConcreteTimeline, walks: Sequence[_Walk]) -> list[_Evaluation]:
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


def _with_peaks(walks: Sequence[_Walk], live: np.ndarray) -> list[_Evaluation]:
    """The evaluations of ``walks`` whose live bytes are the rows of ``live``: each peaks at
    the most bytes live at a point, or at a regenerate call (the live bytes at its site plus
    its own top)."""
    rows, npoints = live.shape
    if not npoints:
        return [
            _Evaluation(peak=0, cost=walk.cost, live=row, calls=walk.calls)
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
        out.append(_Evaluation(peak=peak, cost=walk.cost, live=row, calls=walk.calls))
    return out


class _TempNeighbours:
    """The walks of the sets one slot away from an evicted set in the temp regime, from the
    set's own evaluation, without walking.

    In that regime each evicted slot has its own regenerate call, and nothing it
    materializes is kept: adding a slot ``x`` adds its call and changes only the calls
    before it whose recomputation reads ``x`` (it is then pending there too); putting ``x``
    back drops its call and changes only the calls before it that materialize ``x``. The
    other calls are the set's. (The walk goes through every evicted slot.)
    """

    def __init__(self, tl: ConcreteTimeline, ev: _Evaluation) -> None:
        self.tl = tl
        self.calls = calls = ev.calls
        rank = tl._rank
        self.ranks = [rank[run.slot] for run in calls]
        # Before each call: the slots whose calls came earlier (done when the walk reaches
        # it), what the earlier calls read and do not materialize (their frontiers) and what
        # they materialize, and their cost summed in order as the walk sums it.
        self.done_before = done_before = [0]
        self.read_before = read_before = [0]
        self.made_before = made_before = [0]
        self.cost_before = cost_before = [0.0]
        for run in calls:
            done_before.append(done_before[-1] | 1 << run.slot)
            read_before.append(read_before[-1] | run.frontier)
            made_before.append(made_before[-1] | run.inputs)
            cost_before.append(cost_before[-1] + run.cost)
        self.chosen_mask = done_before[-1]

    def _neighbour(self, x: int, add: bool) -> _Walk:
        """The walk of the set with ``x`` added (``add``) or put back."""
        tl = self.tl
        plan_masks = tl._plan_masks
        done_before = self.done_before
        place = bisect.bisect_left(self.ranks, tl._rank[x])
        trial_mask = self.chosen_mask | 1 << x if add else self.chosen_mask & ~(1 << x)
        new_calls = self.calls[:place]
        first = place
        # The calls before x that read it (adding) or materialize it (putting back).
        if (self.read_before if add else self.made_before)[place] >> x & 1:
            for i in range(place):
                run = new_calls[i]
                if (run.frontier if add else run.inputs) >> x & 1:
                    pending = plan_masks[run.slot] & trial_mask & ~done_before[i]
                    new_calls[i] = _call(tl, run.slot, pending, 0)
                    first = min(first, i)
        if add:
            new_calls.append(_call(tl, x, plan_masks[x] & trial_mask & ~done_before[place], 0))
            new_calls += self.calls[place:]
        else:
            new_calls += self.calls[place + 1 :]
        cost = self.cost_before[first]
        for run in new_calls[first:]:
            cost += run.cost
        return _Walk(cost, new_calls, [], [])

    def added(self, x: int) -> _Walk:
        """The walk of the set with ``x`` (not in it) evicted too."""
        return self._neighbour(x, True)

    def removed(self, x: int) -> _Walk:
        """The walk of the set with ``x`` (in it) put back."""
        return self._neighbour(x, False)


def _evaluate_neighbours(
    tl: ConcreteTimeline,
    chosen: frozenset[int],
    ev: _Evaluation,
    slots: Sequence[int],
    add: bool,
) -> list[_Evaluation]:
    """:func:`_evaluate` in the temp regime of ``chosen`` with each slot of ``slots`` added
    (``add``) or put back, from ``ev``, the evaluation of ``chosen`` in that regime.

    The live bytes are ``ev``'s less (or plus) the slot's bytes on its window, the walk is
    :class:`_TempNeighbours`'s: the numbers are :func:`_evaluate`'s. A slot that is not
    effective (no bytes, or a storage held past its copy: not one window of its bytes) or
    that the set already has (or lacks) is evaluated as any set is.
    """
    out: list[_Evaluation | None] = [None] * len(slots)
    # Each slot to evaluate from ev: its trial set and where it goes in ``out``.
    todo: dict[int, tuple[frozenset[int], list[int]]] = {}
    effective = tl._effective_mask
    for i, x in enumerate(slots):
        trial = chosen | {x} if add else chosen - {x}
        found = _remembered(tl, trial, False)
        if found is not None:
            out[i] = found
        elif (x in chosen) == add or not effective[x]:
            out[i] = _evaluate(tl, trial, False)
        else:
            todo.setdefault(x, (trial, []))[1].append(i)
    if not todo:
        return out  # type: ignore[return-value]
    neighbours = _TempNeighbours(tl, ev)
    step = neighbours.added if add else neighbours.removed
    walks = [step(x) for x in todo]
    window = tl.window_bytes()[list(todo)]
    live = ev.live[None, :] - window if add else ev.live[None, :] + window
    for (trial, places), result in zip(todo.values(), _with_peaks(walks, live)):
        _store(tl, trial)[(trial, False)] = result
        for i in places:
            out[i] = result
    return out  # type: ignore[return-value]


def _call(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """Slot ``k``'s regenerate call for ``pending`` and ``keep``, as :func:`_walk` finds it."""
    run = tl._last_runs[k]
    if _holds(run, pending, keep):
        return run  # type: ignore[return-value]
    return _other_call(tl, k, pending, keep)


def _cost(tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime) -> float:
    """The recompute cost of evicting ``evicted``: :func:`_evaluate`'s, from the regenerate
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
        The regime of chained inputs (see the module docstring).

    Returns
    -------
    int
    """
    return _evaluate(tl, evicted, cache).peak


def _effective(tl: ConcreteTimeline) -> list[int]:
    return [k for k, slot in enumerate(tl.slots) if slot.effective]


def _peak_is_fixed(tl: ConcreteTimeline) -> bool:
    """Whether no eviction set lowers the peak, so that evicting nothing is every search's
    answer (at short lengths, a training step peaks at its end: gradients and results, which
    no window covers).

    With no negative size, an eviction removes a slot's bytes from points of its window
    ``[start, site]`` only; everything else it brings (regenerations, a storage held past its
    copy) adds bytes. A point that holds the unevicted peak and lies in no window keeps it
    whatever is evicted. With no negative cost either, evicting nothing (cache regime) is
    then the first set every search tries and one none improves on by (peak, cost).
    """
    fixed = tl._peak_fixed
    if fixed is None:
        fixed = False
        costs = [slot.cost for slot in tl.slots]
        if len(tl.base) and tl._sizes_nonnegative and all(c >= 0 for c in costs):
            covered = tl.window_mask()[tl._effective_mask].any(axis=0)
            fixed = bool(((tl.base == tl.base_peak) & ~covered).any())
        object.__setattr__(tl, "_peak_fixed", fixed)
    return fixed


def _decision(
    tl: ConcreteTimeline, evicted: Iterable[int], cache: Regime, budget: int | None
) -> Decision:
    chosen = frozenset(evicted)
    ev = _evaluate(tl, chosen, cache)
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
            ev = _evaluate(tl, subset, cache)
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


def _gains(tl: ConcreteTimeline, ev: _Evaluation, budget: int) -> np.ndarray:
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


def _lowest_live(tl: ConcreteTimeline, chosen: Iterable[int]) -> np.ndarray | None:
    """Live bytes per point that no regime of ``chosen`` goes below, or ``None``.

    An eviction removes its bytes from points of its window only, and everything else it
    brings (regenerations, a storage held past its copy) adds bytes, when no size is
    negative (``None`` otherwise). Putting back slot ``k`` of ``chosen`` therefore leaves a
    peak of at least ``max(lowest[start:site + 1]) + nbytes[k]``: the searches that put
    slots back skip, unevaluated, those that this bound already rules out.
    """
    if not tl._sizes_nonnegative:
        return None
    index = [k for k in chosen if tl._effective_mask[k]]
    if not index:
        return tl.base.copy()
    return tl.base - (tl.window_mask()[index] * tl._nbytes[index, None]).sum(axis=0)


def _returns_above(tl: ConcreteTimeline, lowest: np.ndarray | None, k: int, limit: int) -> bool:
    """Whether putting back slot ``k`` surely peaks above ``limit`` (see :func:`_lowest_live`)."""
    if lowest is None or not tl._effective_mask[k]:
        return False
    slot = tl.slots[k]
    return int(lowest[slot.start : slot.site + 1].max()) + slot.nbytes > limit


def _prune(tl: ConcreteTimeline, chosen: set[int], cache: Regime, limit: int) -> set[int]:
    """Put back every slot (dearest first) whose eviction the limit does not need."""
    lowest = _lowest_live(tl, chosen)
    # (In the temp regime, each trial from the set's evaluation: see _TempNeighbours.)
    temp = cache is False
    ev = _evaluate(tl, chosen, cache) if temp else None
    for x in sorted(chosen, key=lambda s: (-tl.slots[s].cost, s)):
        if _returns_above(tl, lowest, x, limit):
            continue
        trial = chosen - {x}
        if temp:
            (result,) = _evaluate_neighbours(tl, frozenset(chosen), ev, [x], False)
        else:
            result = _evaluate(tl, trial, cache)
        if result.peak <= limit:
            chosen, ev = trial, result
            if lowest is not None and tl._effective_mask[x]:
                lowest[tl.slots[x].start : tl.slots[x].site + 1] += tl.slots[x].nbytes
    return chosen


def _greedy_toward(
    tl: ConcreteTimeline, candidates: Sequence[int], target: int, cache: bool
) -> tuple[set[int], _Evaluation]:
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
) -> tuple[set[int], _Evaluation]:
    """Evict, one at a time, the candidate with the most bytes above ``target`` removed per
    unit of cost, until the peak is within ``target`` or no eviction removes any."""
    allowed = np.zeros(len(tl.slots), dtype=bool)
    allowed[list(candidates)] = True
    chosen: set[int] = set()
    ev = _evaluate(tl, chosen, cache)
    while ev.peak > target:
        gains = np.where(allowed, _gains(tl, ev, target), 0)
        if gains.max() <= 0:
            break
        best = int(np.argmax(gains / tl._costs))
        if cache is False:
            (ev,) = _evaluate_neighbours(tl, frozenset(chosen), ev, [best], True)
        else:
            ev = _evaluate(tl, chosen | {best}, cache)
        chosen.add(best)
        allowed[best] = False
    return chosen, ev


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


def _excess(ev: _Evaluation, budget: int) -> int:
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
    ev = _evaluate(tl, chosen, cache)
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
        best: tuple[float, int, _Evaluation] | None = None
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
    cost_limit = _evaluate(tl, chosen, cache).cost
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
    cost_limit = _evaluate(tl, chosen, cache).cost
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
    ev = _evaluate(tl, chosen, cache)
    if ev.peak > budget:
        return chosen
    effective = np.zeros(len(tl.slots), dtype=bool)
    effective[_effective(tl)] = True
    # Slots that free the most bytes over their window first (ties: the lower index).
    volume = [
        (-(tl.slots[y].nbytes * (tl.slots[y].site - tl.slots[y].start + 1)), y)
        for y in _effective(tl)
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
            result = _evaluate(tl, trial, cache)
            if result.peak <= budget and result.cost < ev.cost:
                found = (trial, result)
                break
        if found is None:
            break
        chosen, ev = found
    return chosen


def _greedy(
    tl: ConcreteTimeline, candidates: Sequence[int], budget: int, cache: bool
) -> Decision | None:
    """The greedy eviction set that fits ``budget`` in one regime, or ``None``."""
    chosen, ev = _greedy_toward(tl, candidates, budget, cache)
    if ev.peak > budget:
        return None
    return _decision(tl, _prune(tl, chosen, cache, budget), cache, budget)


def _peak_event(ev: _Evaluation) -> tuple[int, int | None]:
    """Where the predicted peak occurs: the point, and the slot being materialized if any
    (the first such materialization in program order)."""
    # (No event is above the peak: those above one byte less are at it.)
    hits = ev.events_above(ev.peak - 1)
    if hits:
        return hits[0][0], hits[0][2]
    return (int(np.argmax(ev.live)) if len(ev.live) else 0), None


def _covering(tl: ConcreteTimeline, at: int) -> list[int]:
    """The effective slots whose window covers point ``at``, in index order."""
    return np.flatnonzero(tl.window_mask()[:, at] & tl._effective_mask).tolist()


# At most this many additions are tried exactly per step of the minimum search (the best by
# the estimate of :func:`_gains`).
_TRIALS = 8


def _minimum(tl: ConcreteTimeline, cache: bool, limit: int = -1) -> tuple[set[int], int]:
    """Local search for the smallest peak in one regime: add or put back one slot at a time,
    until the peak is within ``limit``."""
    candidates = _effective(tl)
    chosen: set[int] = set()
    ev = _evaluate(tl, chosen, cache)
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
        ev = _evaluate(tl, chosen, cache)
    return chosen, ev.peak


def _minimum_from_all(tl: ConcreteTimeline, cache: bool) -> tuple[set[int], int]:
    """Greedy from the other end: evict everything, then keep, one at a time, the slot whose
    return lowers the peak most (ties: the cost most), while the peak does not rise.

    Keeping a slot cuts every chain through it (a checkpoint), which the additive search
    rarely reaches when long chains of regenerations make the peak.
    """
    chosen = set(_effective(tl))
    ev = _evaluate(tl, chosen, cache)
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
            result = _evaluate(tl, chosen - {x}, cache)
            if result.peak < ev.peak or (result.peak == ev.peak and result.cost < ev.cost):
                chosen.discard(x)
                ev = result
                changed = True
        if not changed:
            break
    return chosen, ev.peak


# How many of the minimum search's greedy results are refined as well as its local searches'
# (the best).
_REFINED_GREEDY = 2
# Targets (fractions of the unevicted peak) of the greedy starts of the minimum search.
_GREEDY_TARGETS = (0.9, 0.8, 0.7, 0.6, 0.5)


def _greedy_minimum(tl: ConcreteTimeline, target: int, cache: bool) -> tuple[set[int], int]:
    """:func:`_greedy_toward` over every effective slot, as a search of the minimum."""
    chosen, ev = _greedy_toward(tl, _effective(tl), target, cache)
    return chosen, ev.peak


# Rounds of the mixed-regime refinement of the minimum search.
_REFINE_ROUNDS = 48


def _chain_inputs(tl: ConcreteTimeline, chosen: frozenset[int]) -> set[int]:
    """Evicted slots that the regeneration of another evicted slot may materialize."""
    out: set[int] = set()
    for k in chosen:
        out.update(x for x in tl._plan_slots[k] if x != k and x in chosen)
    return out


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
    ev = _evaluate(tl, evicted, keep)
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
        best: tuple[int, float, frozenset[int], frozenset[int], _Evaluation] | None = None
        for (trial_evicted, trial_keep), result in zip(trials, _evaluate_many(tl, trials)):
            key = (result.peak, result.cost)
            if best is None or key < best[:2]:
                best = (result.peak, result.cost, trial_evicted, trial_keep, result)
        if best is None or best[0] >= ev.peak:
            break
        evicted, keep, ev = best[2], best[3], best[4]
    return evicted, keep


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
    ev = _evaluate(tl, chosen, cache)
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
        ev = _evaluate(tl, evicted, keep)
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


def _kept(tl: ConcreteTimeline, keep: frozenset[int]) -> ConcreteTimeline:
    """``tl`` with the slots in ``keep`` never evicted (their eviction frees nothing).

    A search remembers it (its floor, evaluations and greedy runs) for its later passes.
    """
    found = tl._kept_timelines.get(keep)
    if found is None:
        found = tl._kept_timelines[keep] = _build_kept(tl, keep)
    return found


def _build_kept(tl: ConcreteTimeline, keep: frozenset[int]) -> ConcreteTimeline:
    """:func:`_kept`, built."""
    slots = tuple(
        replace(slot, start=slot.site + 1) if k in keep else slot for k, slot in enumerate(tl.slots)
    )
    # Keeping a slot moves its start only: the arrays of the plans, sizes, costs and sites
    # are the original's (no search writes them), the others are derived again.
    kept = object.__new__(ConcreteTimeline)
    object.__setattr__(kept, "base", tl.base)
    object.__setattr__(kept, "slots", slots)
    for name in _PLAN_ARRAYS:
        object.__setattr__(kept, name, getattr(tl, name))
    kept._derive_windows()
    # What a regenerate call materializes and its peaks depend on the plans, sizes and costs
    # alone, which keeping a slot leaves as they are: the rounds share them. A set that
    # evicts no kept slot has the same windows in both timelines, hence the same evaluation.
    object.__setattr__(kept, "_plan_reads", tl._plan_reads)
    object.__setattr__(kept, "_runs", tl._runs)
    object.__setattr__(kept, "_runs_by_sequence", tl._runs_by_sequence)
    object.__setattr__(kept, "_last_runs", tl._last_runs)
    object.__setattr__(kept, "_earlier_runs", tl._earlier_runs)
    object.__setattr__(kept, "_evaluations", tl._evaluations)
    object.__setattr__(kept, "_kept_set", tl._kept_set | keep)
    object.__setattr__(kept, "_kept_evaluations", {})
    return kept


def _forgets_runs(search):
    """Drop the regenerate calls ``search`` remembered (:func:`_run`) once it returns: they
    are reused within a search, and a timeline stays cached per shape long after it."""

    @functools.wraps(search)
    def wrapper(tl: ConcreteTimeline, *args, **kwargs):
        try:
            return search(tl, *args, **kwargs)
        finally:
            tl._runs.clear()
            tl._runs_by_sequence.clear()
            tl._last_runs[:] = [None] * len(tl._last_runs)
            tl._earlier_runs[:] = [None] * len(tl._earlier_runs)
            tl._evaluations.clear()
            tl._greedy_runs.clear()
            tl._kept_timelines.clear()

    return wrapper


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
    ev = _evaluate(tl, evicted, keep)
    trials = [(evicted, keep | {x}) for x in inputs]
    ranked = sorted(
        (result.cost, x)
        for x, result in zip(inputs, _evaluate_many(tl, trials))
        if result.peak <= budget and result.cost < ev.cost
    )
    for _, x in ranked:
        result = _evaluate(tl, evicted, keep | {x})
        if result.peak <= budget and result.cost < ev.cost:
            keep, ev = keep | {x}, result
    return keep


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
        _, making = _peak_event(_evaluate(tl, current.evicted, current.cache))
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
        _, making = _peak_event(_evaluate(tl, chosen, cache))
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
    candidates = _effective(tl)
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

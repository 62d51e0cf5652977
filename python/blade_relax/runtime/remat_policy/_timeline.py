"""The concrete timeline a decision is made on: its slots, the arrays its searches read, and
the caches a search fills.

:class:`ConcreteTimeline` holds a function's live bytes per point and its evictable tensors
(:class:`SlotTimeline`) at concrete dims (see :mod:`blade_relax.runtime.remat_policy` for the
model). It also carries what the searches derive from it once (sizes, sites and plans as
arrays, window masks) and what a search remembers while it runs (regenerate calls,
evaluations, greedy runs, timelines with slots kept), cleared when the search returns
(:func:`_forgets_runs`); only its value is pickled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ._floor import unevictable_floor

Regime = bool | frozenset
"""Which chained inputs are kept once materialized: all (``True``, the cache regime), none
(``False``, the temp regime), or the slots in a set (mixed)."""


@dataclass(frozen=True)
class SlotTimeline:
    """One evictable tensor, in concrete bytes (see :mod:`blade_relax.runtime.remat_policy`).

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

    @property
    def slot_bytes(self) -> np.ndarray:
        """Per slot, the bytes its tensor takes (``slots[k].nbytes``, as an int64 array)."""
        return self._nbytes

    @property
    def regen_peaks(self) -> np.ndarray:
        """Per slot, the bytes its regeneration holds at its peak, as an int64 array."""
        return self._regen

    @property
    def sites(self) -> np.ndarray:
        """Per slot, the point of the binding that regenerates it, as an int64 array."""
        return self._site

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
        """:meth:`unevictable`, computed (:func:`~._floor.unevictable_floor`)."""
        return unevictable_floor(self)


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


def effective_slots(tl: ConcreteTimeline) -> list[int]:
    """The slots whose eviction frees anything at all (:attr:`SlotTimeline.effective`).

    Parameters
    ----------
    tl
        The concrete timeline.

    Returns
    -------
    list[int]
        Their indices, in order: the candidates of every search.
    """
    return [k for k, slot in enumerate(tl.slots) if slot.effective]


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
    """Drop the regenerate calls ``search`` remembered (:func:`~._calls._run`) once it returns: they
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

"""Lower bounds: what no eviction set goes below.

* :func:`unevictable_floor`: the floor under every peak an eviction set reaches
  (:meth:`ConcreteTimeline.unevictable <._timeline.ConcreteTimeline.unevictable>` says how it
  is built and caches it);
* :func:`_peak_is_fixed`: whether no eviction lowers the peak at all (every search's answer is
  then to evict nothing);
* :func:`_lowest_live` and :func:`_returns_above`: the live bytes no regime of a set goes
  below, with which the searches that put slots back skip those that surely peak too high.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ._timeline import ConcreteTimeline


def unevictable_floor(tl: ConcreteTimeline) -> tuple[int, int]:
    """:meth:`ConcreteTimeline.unevictable <._timeline.ConcreteTimeline.unevictable>`, built:
    the floor in bytes, and the point where it is reached."""
    npoints = len(tl.base)
    if not npoints:
        return (0, 0)
    effective = [int(k) for k in np.flatnonzero(tl._effective_mask)]
    covering = tl.window_bytes()[effective]
    fewest = tl._fewest()
    position = {k: i for i, k in enumerate(effective)}
    unique = np.bincount(tl._site, minlength=npoints)
    # The fewest bytes live when slot k is materialized at a site: every window covering
    # the site is missing, except those of the slots the recomputation reads (live, or
    # materialized before it). One row per effective slot, one column per point.
    reads = np.zeros((len(effective), len(effective)), dtype=np.int64)
    for i, k in enumerate(effective):
        for r in tl._refs[k][k]:
            if r in position:
                reads[i, position[r]] += 1
    lowest = fewest + _product(reads, covering) + tl._regen[effective, None]
    sites = tl._site.tolist()

    # Options (rise, slot, end): evicting the slot and materializing it at a site ``end``
    # (its own, or that of a slot whose plan names it) removes its bytes on
    # ``[start, end)`` and peaks at no less than ``rise`` there.
    rows, ends, slots = [], [], []
    for k in effective:
        site = sites[k]
        rows.append(position[k])
        ends.append(site)
        slots.append(k)
        for x in tl._plan_slots[k]:
            if x != k and x in position and site < sites[x]:
                rows.append(position[x])
                ends.append(site)
                slots.append(x)
    options = sorted(zip(lowest[rows, ends].tolist(), slots, ends))
    left = tl.base.copy()
    reach = {k: int(tl._start[k]) for k in effective}
    best = (int(left.max()), int(np.argmax(left)))
    for n, (rise, k, end) in enumerate(options):
        if rise >= best[0]:
            break  # the options left rise at least as high: none lowers the bound
        if end > reach[k]:
            left[reach[k] : end] -= tl._nbytes[k]
            reach[k] = end
        if end == tl._site[k] and unique[end] == 1:
            # At its own site only a regeneration smaller than the tensor saves bytes.
            left[end] -= max(0, int(tl._nbytes[k]) - int(tl._regen[k]))
        elif end == tl._site[k]:
            # Sharing a site, the model counts one regeneration there: none is credited.
            left[end] -= tl._nbytes[k]
        if n + 1 < len(options) and options[n + 1][0] == rise:
            continue  # options of equal rise are allowed together
        most = int(left.max())
        bound = max(most, rise)
        if bound < best[0]:
            best = (bound, int(np.argmax(left)) if most >= rise else end)
    return best


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

"""Range versions for :mod:`.memory_aware_schedule`: one scheduled copy per range of a dim.

When the order with the lowest peak for short sequences is not the one for long ones, no single
order is good at every length. The pass then emits one copy of the function per range of the
dim, each scheduled for its range only, and turns the function into a dispatcher::

    def main(x: R.Tensor((1, "s"))):        # original name, params and attributes
        if R.prim_value(s <= 64):
            r = main__s2_64(x)              # scheduled for s in [2, 64]
        else:
            r = main__s65_inf(x)            # scheduled for s >= 65
        return r

Why separate functions and not an ``If`` between two copies of the body inside ``main``: the
storage planners plan each function on its own, while ``StaticPlanBlockMemory`` shares storage
tokens across the branches of an ``If`` and can leave a branch using a storage that only the
other branch allocates (apache/tvm#20191). Each copy is private (no ``global_symbol``), keeps
the function's other attributes, gets ``tir_var_lower_bound`` raised to its range's lower end
(sound: the dispatcher guarantees it; it lets later passes prove more) but never
``tir_var_upper_bound`` (``StaticPlanBlockMemory`` would plan every buffer at that bound), and
carries :data:`~blade_relax.contract.SCHEDULE_VERSION_ATTR` (the function it was copied from and its
range; :func:`blade_relax.transform.dispatch.version_for` finds the copy that runs at given
dims). The dispatcher itself is built by :mod:`blade_relax.transform.dispatch`.

Only functions with exactly one free dim, defined by the parameters' shapes, are versioned.
This module chooses the ranges from the orders a search has already scored and builds the IR;
the pass (:mod:`.memory_aware_schedule`) schedules each copy and keeps the versions only when
they lower the peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from ...contract import LOWER_BOUND_ATTR, UPPER_BOUND_ATTR
from ...symbolic import ShapeGraph
from ..dispatch import DimRange, int_map
from ._cost import _free_roots
from ._search import Pool

__all__ = [
    "choose_ranges",
    "range_graph",
    "version_dim",
]


def version_dim(
    func: relax.Function, graph: ShapeGraph
) -> tuple[tvm.tirx.Var, int, int | None] | None:
    """The dim a function may be versioned on: its only free dim, defined by a parameter.

    Returns the TIR variable and the dim's range, or None.
    """
    roots = _free_roots(graph)
    if len(roots) != 1:
        return None
    (name,) = roots
    defined = {}
    for p in func.params:
        for v in relax.analysis.definable_tir_vars_in_type(p.ty):
            defined.setdefault(v.name, v)
    var = defined.get(name)
    if var is None or str(var.ty) != "int64":
        return None
    dim = graph.dims[name]
    lower = int(dim.lower) if dim.lower is not None else 1
    return var, lower, dim.upper


def _best(pool: Pool, points: np.ndarray) -> tuple[float, float, str]:
    """The order of the pool with the lowest worst-case ratio to the reference over
    ``points`` (then the lowest mean ratio) among those nowhere above the input there (the
    input itself qualifies): (worst ratio, mean ratio, name)."""
    best = (np.inf, np.inf, "input")
    for name in pool.orders:
        excess, worst, mean = pool.rank_key(name, points)
        if excess == 0 and (worst, mean) < best[:2]:
            best = (worst, mean, name)
    return best


def choose_ranges(
    pool: Pool,
    values: Sequence[int],
    dim: str,
    lower: int,
    upper: int | None,
    max_versions: int,
    min_gain: float,
    peaks_at: Callable[[str, list[int]], np.ndarray] | None = None,
) -> list[DimRange]:
    """Ranges of ``dim`` worth a copy each, estimated from the orders in ``pool``.

    ``values`` is the dim's value at each acceptance point of the pool. A range's score is the
    lowest worst-case ratio to the reference that one order of the pool reaches on the range's
    points (:func:`_best`). Ranges are split in two, at a point value, while a split lowers the
    worst score on one side by more than ``min_gain`` (the range's order scored on that side's
    points against the side's own best) and fewer than ``max_versions`` ranges exist; the split
    with the largest gain is taken first (then the lowest mean ratio).

    Between two acceptance points nothing is known; with ``peaks_at(name, dim_values)``
    (the peaks of a pool order at other values of the dim) each boundary is then moved to the
    last value, before the next acceptance point, where the left range's order is still no
    worse than the right range's. Returns one range (the whole one) when no split pays.
    """
    vals = np.asarray(values, dtype=np.int64)
    segments: list[tuple[int, int | None, np.ndarray]] = [(lower, upper, np.arange(vals.size))]
    while len(segments) < max_versions:
        best = None
        for i, (_, _, pts) in enumerate(segments):
            current = _best(pool, pts)[2]
            for t in np.unique(vals[pts])[:-1]:
                left, right = pts[vals[pts] <= t], pts[vals[pts] > t]
                (wl, ml, _), (wr, mr, _) = _best(pool, left), _best(pool, right)
                # What the split gives the lengths of either side: the current order's worst
                # ratio there over the side's own best (a gain on one side is not hidden by
                # the other side's worse points).
                gain = (
                    max(
                        pool.rank_key(current, left)[1] / wl,
                        pool.rank_key(current, right)[1] / wr,
                    )
                    - 1.0
                )
                key = (-round(gain, 9), (ml * left.size + mr * right.size) / pts.size)
                if gain > min_gain and (best is None or key < best[0]):
                    best = (key, i, int(t), left, right)
        if best is None:
            break
        _, i, t, left, right = best
        lo, hi, _ = segments[i]
        segments[i : i + 1] = [(lo, t, left), (t + 1, hi, right)]
    if peaks_at is not None:
        for i in range(len(segments) - 1):
            lo, t, left = segments[i]
            _, hi, right = segments[i + 1]
            nxt = int(vals[right].min())
            moved = _crossover(peaks_at, _best(pool, left)[2], _best(pool, right)[2], int(t), nxt)
            segments[i] = (lo, moved, left)
            segments[i + 1] = (moved + 1, hi, right)
    return [DimRange(dim, lo, hi) for lo, hi, _ in segments]


def _crossover(
    peaks_at: Callable[[str, list[int]], np.ndarray], left: str, right: str, t: int, nxt: int
) -> int:
    """The last value in ``[t, nxt)`` up to which ``left``'s peak stays no higher than
    ``right``'s (scanning up from ``t``; at most 33 values, spread geometrically)."""
    if nxt - t <= 1 or left == right:
        return t
    if nxt - t <= 33:
        grid = list(range(t + 1, nxt))
    else:
        grid = sorted({int(round(v)) for v in np.geomspace(t + 1, nxt - 1, 32)})
    pl, pr = peaks_at(left, grid), peaks_at(right, grid)
    moved = t
    for v, a, b in zip(grid, pl, pr):
        if a > b:
            break
        moved = v
    return moved


def range_graph(func: relax.Function, rng: DimRange) -> ShapeGraph:
    """The shape graph of ``func`` with ``rng.dim`` restricted to ``rng`` (for analysis only:
    the bounds are set on a copy that is never emitted)."""
    attrs = func.attrs
    lower = (
        {str(k): int(v) for k, v in attrs[LOWER_BOUND_ATTR].items()}
        if attrs is not None and LOWER_BOUND_ATTR in attrs
        else {}
    )
    upper = (
        {str(k): int(v) for k, v in attrs[UPPER_BOUND_ATTR].items()}
        if attrs is not None and UPPER_BOUND_ATTR in attrs
        else {}
    )
    lower[rng.dim] = max(lower.get(rng.dim, rng.lower), rng.lower)
    if rng.upper is not None:
        upper[rng.dim] = min(upper.get(rng.dim, rng.upper), rng.upper)
    probe = func.with_attr(LOWER_BOUND_ATTR, int_map(lower))
    if upper:
        probe = probe.with_attr(UPPER_BOUND_ATTR, int_map(upper))
    return ShapeGraph.from_function(probe)

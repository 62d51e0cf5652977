"""Peak-safety bookkeeping for ``PlanMemory`` (private helper).

Sharing a storage is never free when memory is counted the way the runtime counts it: the
storage stays allocated between its tensors (the *gap*) and, if it is larger than a later
tensor, by the difference (the *slack*). ``PlanMemory`` therefore accepts a sharing decision only
when it is proven not to raise the peak: after the decision, the live bytes at every allocation
point must stay ``<=`` the peak of the unshared program (each tensor in its own storage, in-place
pairs merged), for every admissible value of the dims.

:class:`LiveModel` keeps the live bytes at every allocation point ("moment") and answers two
questions about a decision, given as binding ranges with a symbolic byte delta each:

* ``screen``: does the decision keep every moment within the bound at a few sample points? (a
  fast filter used to rank candidates; never a proof);
* ``prove``: does it, for every admissible value? The admissible box of the dims is split into
  a *head* (from each dim's lower bound, as many values as ``max_grid_points`` allows), checked
  point by point with exact integer arithmetic, and one *tail* per dim whose range goes beyond
  the head (that dim above the head, the others over their whole range), where each affected
  moment is compared symbolically (``ShapeGraph.compare`` on a graph of the tail's ranges)
  with the moments that dominate the tail, under a budget of comparisons. A tail starts where
  sizes are large, so its asymptotically largest terms decide and one dominating moment
  usually suffices. When the head covers every admissible value the proof is exhaustive.
  Once the budget is spent, only decisions that add nothing are accepted.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import sympy

from ...symbolic import ShapeGraph, SymbolicExpr

__all__ = ["Interval", "LiveModel", "PointSet", "Region"]


@dataclass(frozen=True)
class Interval:
    """Bytes held over binding indices ``[start, end]`` (inclusive)."""

    start: int
    end: int
    size: SymbolicExpr


@dataclass(frozen=True)
class Region:
    """A decision's effect: ``delta`` bytes more at every moment in ``[lo, hi]``.

    The delta is kept as signed parts and summed symbolically only when a proof reads it: the
    planner screens many placements at sample points for each one it proves, and the
    screen adds the parts' values there.
    """

    lo: int
    hi: int
    parts: tuple[tuple[int, SymbolicExpr], ...]  # (sign, bytes): delta = sum(sign * bytes)

    @functools.cached_property
    def delta(self) -> SymbolicExpr:
        total = sympy.Add(*(sign * size.expr for sign, size in self.parts))
        return SymbolicExpr(total)


class Unevaluable(Exception):
    """An expression the vector evaluator does not support (or with an UNKNOWN symbol)."""


class PointSet:
    """Values of the free dims at a set of points, and exact vectorised evaluation there."""

    def __init__(self, symbols: Sequence[sympy.Symbol], columns: Sequence[np.ndarray]) -> None:
        self.symbols = list(symbols)
        self.values = {s: np.asarray(c, dtype=np.int64) for s, c in zip(symbols, columns)}
        self.size = int(len(columns[0])) if columns else 1
        self._cache: dict[sympy.Expr, np.ndarray] = {}

    @staticmethod
    def from_points(symbols: Sequence[sympy.Symbol], points: Sequence[dict]) -> PointSet:
        columns = [np.array([p[s.name] for p in points], dtype=np.int64) for s in symbols]
        return PointSet(symbols, columns)

    @staticmethod
    def grid(symbols: Sequence[sympy.Symbol], ranges: Sequence[tuple[int, int]]) -> PointSet:
        axes = [np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in ranges]
        if not axes:
            return PointSet([], [])
        mesh = np.meshgrid(*axes, indexing="ij")
        return PointSet(symbols, [m.reshape(-1) for m in mesh])

    def eval(self, expr: SymbolicExpr | sympy.Expr) -> np.ndarray:
        """Exact integer values of ``expr`` at every point (raises :class:`Unevaluable`)."""
        e = expr.expr if isinstance(expr, SymbolicExpr) else expr
        cached = self._cache.get(e)
        if cached is not None:
            return cached
        num, den = self._eval(e)
        if np.any(num % den != 0):
            raise Unevaluable(f"{e} is not an integer everywhere")
        out = num // den
        out.setflags(write=False)
        self._cache[e] = out
        return out

    def _full(self, value: int) -> np.ndarray:
        return np.full(self.size, value, dtype=np.int64)

    def _eval(self, e: sympy.Expr) -> tuple[np.ndarray, np.ndarray]:
        """(numerator, positive denominator) arrays."""
        one = self._full(1)
        if e.is_Integer:
            return self._full(int(e)), one
        if e.is_Rational:
            return self._full(int(e.p)), self._full(int(e.q))
        if e.is_Symbol:
            column = self.values.get(e)
            if column is None:
                raise Unevaluable(f"no value for {e}")
            return column, one
        if isinstance(e, sympy.Add):
            num, den = self._full(0), one
            for arg in e.args:
                n2, d2 = self._eval(arg)
                num, den = num * d2 + n2 * den, den * d2
                num, den = _reduce(num, den)
            return num, den
        if isinstance(e, sympy.Mul):
            num, den = one, one
            for arg in e.args:
                n2, d2 = self._eval(arg)
                num, den = _reduce(num * n2, den * d2)
            return num, den
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) >= 0:
            n, d = self._eval(e.base)
            k = int(e.exp)
            return n**k, d**k
        if isinstance(e, (sympy.Max, sympy.Min)):
            pick = np.greater if isinstance(e, sympy.Max) else np.less
            num, den = self._eval(e.args[0])
            for arg in e.args[1:]:
                n2, d2 = self._eval(arg)
                take = pick(n2 * den, num * d2)
                num, den = np.where(take, n2, num), np.where(take, d2, den)
            return num, den
        if isinstance(e, sympy.floor):
            n, d = self._eval(e.args[0])
            return n // d, one
        if isinstance(e, sympy.ceiling):
            n, d = self._eval(e.args[0])
            return -((-n) // d), one
        if isinstance(e, sympy.Mod):
            na, da = self._eval(e.args[0])
            nb, db = self._eval(e.args[1])
            if np.any(nb == 0):
                raise Unevaluable(f"{e}: modulo by zero")
            q = (na * db) // (da * nb)
            return _reduce(na * db - q * nb * da, da * db)
        raise Unevaluable(f"unsupported node {type(e).__name__} in {e}")


class _BlockMax:
    """Column-wise maxima of row ranges of a (moments x points) array, by blocks of rows.

    The planner screens every storage for every tensor it places, each against the live bytes
    over the storage's span, which grows with the function; block maxima make a range query
    cost the block size plus the number of blocks instead of the span. The caller updates the
    array in place and calls :meth:`refresh` for the rows it changed.
    """

    def __init__(self, live: np.ndarray, block: int = 32) -> None:
        self.live = live
        self.block = block
        n = live.shape[0]
        self.maxima = (
            np.stack([live[i : i + block].max(axis=0) for i in range(0, n, block)])
            if n
            else np.zeros((0,) + live.shape[1:], dtype=live.dtype)
        )

    def refresh(self, a: int, b: int) -> None:
        """Recompute the blocks of rows ``[a, b)``."""
        k = self.block
        for j in range(a // k, (b - 1) // k + 1):
            self.maxima[j] = self.live[j * k : (j + 1) * k].max(axis=0)

    def max(self, a: int, b: int) -> np.ndarray:
        """``live[a:b].max(axis=0)`` for ``a < b``."""
        k = self.block
        first, last = -(-a // k), b // k  # the blocks wholly inside [a, b)
        if first >= last:
            return self.live[a:b].max(axis=0)
        out = self.maxima[first:last].max(axis=0)
        if a < first * k:
            out = np.maximum(out, self.live[a : first * k].max(axis=0))
        if last * k < b:
            out = np.maximum(out, self.live[last * k : b].max(axis=0))
        return out


def _region_values(points: PointSet, region: Region) -> np.ndarray:
    """A region's delta at every point: the sum of its parts' (cached) values."""
    total = np.zeros(points.size, dtype=np.int64)
    for sign, size in region.parts:
        total += sign * points.eval(size)
    return total


def _reduce(num: np.ndarray, den: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = np.gcd(num, den)
    g[g == 0] = 1
    return num // g, den // g


class LiveModel:
    """Live bytes at every allocation point of a function, and the bound they must respect.

    Parameters
    ----------
    graph
        The function's shape graph (ranges, canonical forms, ``compare``).
    moments
        Binding indices where allocations happen (the points where the runtime peak is taken).
    base
        What is live in the unshared program: one interval per storage-to-be and per allocation
        the planner leaves alone.
    max_grid_points, max_grid_cells
        Limits of the exhaustive mode: number of admissible points, and points x moments.
    max_proofs
        Budget of symbolic comparisons when the grid is too large.
    """

    def __init__(
        self,
        graph: ShapeGraph,
        moments: Sequence[int],
        base: Sequence[Interval],
        max_grid_points: int = 4096,
        max_grid_cells: int = 1 << 23,
        max_proofs: int = 4000,
    ) -> None:
        self.graph = graph
        self.moments = np.array(sorted(set(moments)), dtype=np.int64)
        self._moment_list = [int(m) for m in self.moments]
        self.base = list(base)
        self.proofs_left = max_proofs
        symbols, ranges = _free_dims(graph, [iv.size for iv in self.base])
        self.screen_points = PointSet.from_points(symbols, _sample_points(graph, symbols))
        self._base_screen = self._accumulate(self.screen_points)
        self._live_screen = self._base_screen.copy()
        self._screen_blocks = _BlockMax(self._live_screen)
        self.bound_screen = self._base_screen.max(axis=0) if len(self.moments) else None
        # The admissible box is split into a head, checked point by point, and tails (one per
        # dim whose range goes beyond the head), checked symbolically on their own ranges,
        # where the asymptotically largest terms decide.
        self.grid: PointSet | None = None
        self.tails: list[_Tail] = []
        head = _head_box(ranges, max_grid_points, max_grid_cells // max(len(self.moments), 1))
        if head is None:
            self.tails.append(_Tail(graph, {}, self._argmax_moments(self.screen_points)))
        else:
            self.grid = PointSet.grid(symbols, head)
            for i, ((_lo, hi), (_, head_hi)) in enumerate(zip(ranges, head)):
                if hi is not None and hi <= head_hi:
                    continue
                tail_ranges = dict(zip((s_.name for s_ in symbols), ranges))
                tail_ranges[symbols[i].name] = (head_hi + 1, hi)
                self.tails.append(self._make_tail(symbols, tail_ranges))
        self.exhaustive = not self.tails
        if self.grid is not None:
            self._base_grid = self._accumulate(self.grid)
            self._live_grid = self._base_grid.copy()
            self.bound_grid = self._base_grid.max(axis=0) if len(self.moments) else None
        self._extra: list[list[sympy.Expr]] = [[] for _ in range(len(self.moments))]
        self._base_sym: dict[int, sympy.Expr] = {}

    # ------------------------------------------------------------------ queries
    def evaluable(self, expr: SymbolicExpr | Region) -> bool:
        """Whether ``expr`` (or every part of a region's delta) can be evaluated exactly."""
        exprs = [size for _, size in expr.parts] if isinstance(expr, Region) else [expr]
        try:
            for e in exprs:
                self.screen_points.eval(e)
                if self.grid is not None:
                    self.grid.eval(e)
        except (Unevaluable, OverflowError, ZeroDivisionError):
            return False
        return True

    def screen(self, regions: Sequence[Region]) -> tuple[bool, float]:
        """Whether the decision passes at the sample points, and its mean added bytes."""
        if not len(self.moments):
            return True, 0.0
        cost = 0.0
        for region, (a, b) in zip(regions, self._slices(regions)):
            if a >= b:
                continue
            delta = _region_values(self.screen_points, region)
            # The live bytes never exceed the bound (every applied decision passed this
            # screen), so a region that adds nothing anywhere cannot fail it.
            if np.any(delta > 0) and np.any(
                self._screen_blocks.max(a, b) + delta > self.bound_screen
            ):
                return False, float("inf")
            cost += float(delta.mean()) * (b - a)
        return True, cost

    def screen_mean(self, size: SymbolicExpr) -> float | None:
        """The mean of ``size`` over the sample points of :meth:`screen` (None if it cannot be
        evaluated there): what one byte of ``size`` held at one moment adds to a screen's cost.
        """
        try:
            return float(self.screen_points.eval(size).mean())
        except (Unevaluable, OverflowError, ZeroDivisionError):
            return None

    def moments_between(self, lo: int, hi: int) -> int:
        """The number of moments in the binding range ``[lo, hi]`` (as a region counts them)."""
        if lo > hi:
            return 0
        return bisect.bisect_right(self._moment_list, hi) - bisect.bisect_left(
            self._moment_list, lo
        )

    def prove(self, regions: Sequence[Region]) -> bool:
        """Whether the decision keeps every moment within the bound for all admissible dims."""
        if not len(self.moments):
            return True
        slices = self._slices(regions)
        if self.grid is not None:
            for region, (a, b) in zip(regions, slices):
                if a >= b:
                    continue
                delta = _region_values(self.grid, region)
                if np.any(self._live_grid[a:b].max(axis=0) + delta > self.bound_grid):
                    return False
        for tail in self.tails:
            for region, (a, b) in zip(regions, slices):
                if a >= b:
                    continue
                delta = tail.map(region.delta.expr)
                if tail.graph.compare(delta, 0).holds_le:
                    continue  # adds nothing there: the invariant already covers these moments
                for m in range(a, b):
                    if not self._prove_moment(tail, m, delta):
                        return False
        return True

    def apply(self, regions: Sequence[Region]) -> None:
        """Record an accepted decision."""
        for region, (a, b) in zip(regions, self._slices(regions)):
            if a >= b:
                continue
            self._live_screen[a:b] += _region_values(self.screen_points, region)
            self._screen_blocks.refresh(a, b)
            if self.grid is not None:
                self._live_grid[a:b] += _region_values(self.grid, region)
            for m in range(a, b):
                self._extra[m].append(region.delta.expr)

    # ------------------------------------------------------------------ internals
    def _accumulate(self, points: PointSet) -> np.ndarray:
        # Each interval adds its size to a run of moments: differences at the run's ends, then
        # one cumulative sum (adding to every moment of every run is quadratic in the program).
        change = np.zeros((len(self.moments) + 1, points.size), dtype=np.int64)
        for iv in self.base:
            a = int(np.searchsorted(self.moments, iv.start, side="left"))
            b = int(np.searchsorted(self.moments, iv.end, side="right"))
            if a < b:
                size = points.eval(iv.size)
                change[a] += size
                change[b] -= size
        return np.cumsum(change[:-1], axis=0)

    def _slices(self, regions: Sequence[Region]) -> list[tuple[int, int]]:
        out = []
        for r in regions:
            a = int(np.searchsorted(self.moments, r.lo, side="left"))
            b = int(np.searchsorted(self.moments, r.hi, side="right"))
            out.append((a, b))
        return out

    def _base_at(self, m: int) -> sympy.Expr:
        cached = self._base_sym.get(m)
        if cached is not None:
            return cached
        t = int(self.moments[m])
        terms = [iv.size.expr for iv in self.base if iv.start <= t <= iv.end]
        value = sympy.Add(*terms) if terms else sympy.Integer(0)
        self._base_sym[m] = value
        return value

    def _argmax_moments(self, points: PointSet) -> list[int]:
        live = self._accumulate(points)
        if not len(self.moments):
            return []
        return list(dict.fromkeys(int(i) for i in live.argmax(axis=0)))

    def _make_tail(
        self, symbols: Sequence[sympy.Symbol], ranges: dict[str, tuple[int | None, int | None]]
    ) -> _Tail:
        graph = ShapeGraph.from_ranges(ranges)
        mapping = {s: graph.dims[s.name].symbol for s in symbols if s.name in graph.dims}
        # Sample the tail geometrically from its start to find the moments that dominate there.
        values: dict[str, list[int]] = {}
        for name, (lo, hi) in ranges.items():
            lo = 1 if lo is None else lo
            cands = [lo, 2 * lo, 16 * lo, 256 * lo] if hi is None else [lo, (lo + hi) // 2, hi]
            values[name] = sorted({v for v in cands if hi is None or v <= hi})
        names = [s.name for s in symbols]
        points = [
            dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))
        ]
        return _Tail(graph, mapping, self._argmax_moments(PointSet.from_points(symbols, points)))

    def _prove_moment(self, tail: _Tail, m: int, delta: sympy.Expr) -> bool:
        live = tail.map(self._base_at(m) + sympy.Add(*self._extra[m])) + delta
        for j in tail.candidates:
            if self.proofs_left <= 0:
                return False
            self.proofs_left -= 1
            if tail.graph.compare(tail.map(self._base_at(j)), live).holds_ge:
                return True
        return False


@dataclass
class _Tail:
    """A part of the admissible dims checked symbolically, with the moments dominating it."""

    graph: ShapeGraph
    mapping: dict
    candidates: list[int]
    #: ``map``'s results: the same base sums are mapped for every decision proven, and
    #: ``xreplace`` re-evaluates every ``Max`` it rebuilds (sympy compares their arguments).
    _mapped: dict = field(default_factory=dict, repr=False)

    def map(self, expr: sympy.Expr) -> sympy.Expr:
        if not self.mapping:
            return expr
        out = self._mapped.get(expr)
        if out is None:
            out = self._mapped[expr] = expr.xreplace(self.mapping)
        return out


def _head_box(
    ranges: Sequence[tuple[int | None, int | None]], max_points: int, max_points_by_cells: int
) -> list[tuple[int, int]] | None:
    """The box checked point by point: as much of the ranges as the limits allow."""
    if any(lo is None for lo, _ in ranges):
        return None
    if not ranges:
        return []
    limit = max(1, min(max_points, max_points_by_cells))
    per_dim = max(1, int(round(limit ** (1.0 / len(ranges)))))
    while per_dim > 1 and per_dim ** len(ranges) > limit:
        per_dim -= 1
    box = []
    for lo, hi in ranges:
        head_hi = lo + per_dim - 1
        box.append((lo, head_hi if hi is None else min(hi, head_hi)))
    return box


def _free_dims(
    graph: ShapeGraph, sizes: Sequence[SymbolicExpr]
) -> tuple[list[sympy.Symbol], list[tuple[int | None, int | None]]]:
    """The free (root) dims that the sizes depend on, with their ranges."""
    roots: dict[sympy.Symbol, tuple[int | None, int | None]] = {}
    by_symbol = {d.symbol: d for d in graph.dims.values()}
    for size in sizes:
        for sym in size.expr.free_symbols:
            if sym in roots:
                continue
            dim = by_symbol.get(sym)
            if dim is None:
                roots[sym] = (None, None)
                continue
            lower = dim.lower if dim.lower > -(2**62) else None
            roots[sym] = (lower, dim.upper)
    symbols = sorted(roots, key=lambda s: s.name)
    return symbols, [roots[s] for s in symbols]


def _sample_points(graph: ShapeGraph, symbols: Sequence[sympy.Symbol]) -> list[dict[str, int]]:
    """The graph's representative points plus a few more per dim (screening only)."""
    points = [dict(p) for p in graph.representative_points()]
    by_symbol = {d.symbol: d for d in graph.dims.values()}
    extra: list[dict[str, int]] = []
    for sym in symbols:
        dim = by_symbol.get(sym)
        if dim is None:
            continue
        lo = max(dim.lower, 1)
        hi = dim.upper if dim.upper is not None else max(lo, 4096)
        for value in (lo + 1, (lo + hi) // 2, hi - 1):
            if lo <= value <= hi:
                extra.append({sym.name: value})
    out = list(points)
    for delta in extra:
        for base in points[:1]:
            p = dict(base)
            p.update(delta)
            out.append(p)
    names = [s.name for s in symbols]
    uniq: list[dict[str, int]] = []
    seen: set[tuple] = set()
    for p in out:
        if any(n not in p for n in names):
            continue
        key = tuple(p[n] for n in names)
        if key in seen:
            continue
        seen.add(key)
        uniq.append(p)
    return uniq or [{}]

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
* ``prove``: does it, for every admissible value? When every dim has a finite range and the
  grid of all admissible values is small, the check is exhaustive (exact integer arithmetic at
  every point of the grid, which is a proof). Otherwise each affected moment is compared
  symbolically (``ShapeGraph.compare``) with the moments that attain the bound, under a budget
  of comparisons; once the budget is spent, only decisions that add nothing are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy

from ..symbolic import ShapeGraph, SymbolicExpr

__all__ = ["Interval", "LiveModel", "PointSet", "Region"]


@dataclass(frozen=True)
class Interval:
    """Bytes held over binding indices ``[start, end]`` (inclusive)."""

    start: int
    end: int
    size: SymbolicExpr


@dataclass(frozen=True)
class Region:
    """A decision's effect: ``delta`` bytes more at every moment in ``[lo, hi]``."""

    lo: int
    hi: int
    delta: SymbolicExpr


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
        self.base = list(base)
        self.proofs_left = max_proofs
        symbols, ranges = _free_dims(graph, [iv.size for iv in self.base])
        self.screen_points = PointSet.from_points(symbols, _sample_points(graph, symbols))
        self.grid: PointSet | None = None
        count = 1
        for lo, hi in ranges:
            count = count * (hi - lo + 1) if lo is not None and hi is not None else -1
            if count < 0:
                break
        if 0 < count <= max_grid_points and count * max(len(self.moments), 1) <= max_grid_cells:
            self.grid = PointSet.grid(symbols, ranges)  # type: ignore[arg-type]
        self.exhaustive = self.grid is not None
        self._base_screen = self._accumulate(self.screen_points)
        self._live_screen = self._base_screen.copy()
        self.bound_screen = self._base_screen.max(axis=0) if len(self.moments) else None
        if self.grid is not None:
            self._base_grid = self._accumulate(self.grid)
            self._live_grid = self._base_grid.copy()
            self.bound_grid = self._base_grid.max(axis=0) if len(self.moments) else None
        self._extra: list[list[sympy.Expr]] = [[] for _ in range(len(self.moments))]
        self._base_sym: dict[int, sympy.Expr] = {}
        self._peak_moments: list[int] | None = None

    # ------------------------------------------------------------------ queries
    def evaluable(self, expr: SymbolicExpr) -> bool:
        """Whether ``expr`` can be evaluated exactly by this model."""
        try:
            self.screen_points.eval(expr)
            if self.grid is not None:
                self.grid.eval(expr)
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
            delta = self.screen_points.eval(region.delta)
            if np.any(self._live_screen[a:b].max(axis=0) + delta > self.bound_screen):
                return False, float("inf")
            cost += float(delta.mean()) * (b - a)
        return True, cost

    def prove(self, regions: Sequence[Region]) -> bool:
        """Whether the decision keeps every moment within the bound for all admissible dims."""
        if not len(self.moments):
            return True
        if self.grid is not None:
            for region, (a, b) in zip(regions, self._slices(regions)):
                if a >= b:
                    continue
                delta = self.grid.eval(region.delta)
                if np.any(self._live_grid[a:b].max(axis=0) + delta > self.bound_grid):
                    return False
            return True
        for region, (a, b) in zip(regions, self._slices(regions)):
            if a >= b:
                continue
            if self.graph.compare(region.delta, 0).holds_le:
                continue  # adds nothing anywhere: the invariant already covers these moments
            for m in range(a, b):
                if not self._prove_moment(m, region.delta.expr):
                    return False
        return True

    def apply(self, regions: Sequence[Region]) -> None:
        """Record an accepted decision."""
        for region, (a, b) in zip(regions, self._slices(regions)):
            if a >= b:
                continue
            self._live_screen[a:b] += self.screen_points.eval(region.delta)
            if self.grid is not None:
                self._live_grid[a:b] += self.grid.eval(region.delta)
            for m in range(a, b):
                self._extra[m].append(region.delta.expr)

    # ------------------------------------------------------------------ internals
    def _accumulate(self, points: PointSet) -> np.ndarray:
        live = np.zeros((len(self.moments), points.size), dtype=np.int64)
        for iv in self.base:
            a = int(np.searchsorted(self.moments, iv.start, side="left"))
            b = int(np.searchsorted(self.moments, iv.end, side="right"))
            if a < b:
                live[a:b] += points.eval(iv.size)
        return live

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

    def _peak_candidates(self) -> list[int]:
        if self._peak_moments is None:
            order = list(dict.fromkeys(int(i) for i in self._base_screen.argmax(axis=0)))
            self._peak_moments = order
        return self._peak_moments

    def _prove_moment(self, m: int, delta: sympy.Expr) -> bool:
        live = self._base_at(m) + sympy.Add(*self._extra[m]) + delta
        for j in self._peak_candidates():
            if self.proofs_left <= 0:
                return False
            self.proofs_left -= 1
            if self.graph.compare(SymbolicExpr(self._base_at(j)), SymbolicExpr(live)).holds_ge:
                return True
        return False


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
    out = []
    for base in points:
        out.append(base)
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

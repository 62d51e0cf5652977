"""Fast symbolic cost model for :mod:`.memory_aware_schedule`.

The scheduler scores many candidate orders of blocks with thousands of bindings, so it cannot
add and compare sympy expressions at every step. Instead, every byte count of one block is
written once as an integer vector over a *monomial basis* (``4096*s + 16*s**2`` becomes the
coefficients of ``[1, s, s**2]``). Live bytes are then sums of vectors (numpy cumulative sums),
values at sample points are one matrix product, and a comparison of two byte counts is:

1. EQ when the vectors are equal;
2. LE / GE when the difference has a non-negative (non-positive) coefficient on every monomial
   that is non-negative for all admissible dims, and no other non-zero coefficient. Monomials
   are products of atoms (dims, and non-polynomial sub-expressions such as ``floor(s / 2)``);
   an atom counts as non-negative when ``ShapeGraph.lower_bound`` proves it, or when it is an
   opaque UNKNOWN symbol: in a byte count such a symbol stands for a tensor's size or extent;
3. otherwise ``ShapeGraph.compare`` on the two expressions, cached per pair of vectors.

Only step 3 can be slow (milliseconds); it is reached for the few distinct pairs that the
coefficients cannot order.

Sample points
-------------
``decision_points``: ``ShapeGraph.representative_points()`` (every dim at the low end of its
range, at the geometric midpoint, at the high end, and with several dims each one at its high
end with the others at their low end; an unbounded dim's high end is
``UNBOUNDED_STAND_IN`` = 4096). ``acceptance_points``: those, plus one point per value ``v``
between the smallest low end and the largest high end that is a power of two ``2**k`` or half
way between two (``3 * 2**(k-1)``), with every free dim at ``v`` clamped into its own range.
A schedule that cannot be proven no worse than another must be no worse at every acceptance
point.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import sympy

from ...symbolic import UNBOUNDED_STAND_IN, Ordering, ShapeGraph, SymbolicExpr
from ...symbolic.dim import is_unknown_symbol
from ...symbolic.expr import evaluate_sympy

__all__ = ["ByteSpace", "OrderProfile", "UnsupportedBytes", "acceptance_points"]

# Values standing for opaque UNKNOWN atoms in heuristic decisions only: a schedule whose
# acceptance would need their real value must be proven instead.
_UNKNOWN_STAND_IN = 1

# Past this magnitude int64 arithmetic could overflow: fall back to Python integers.
_INT64_SAFE = 2**62

# Integers of smaller magnitude are exact in float64.
_FLOAT_EXACT = 2.0**53


class UnsupportedBytes(ValueError):
    """A byte count the cost model cannot represent (e.g. a non-integer coefficient)."""


def _is_proper_monomial_factor(base: sympy.Expr, exp: sympy.Expr) -> bool:
    return bool(exp.is_Integer) and int(exp) > 0 and not base.is_Number


class ByteSpace:
    """The byte counts of one block as integer vectors over a shared monomial basis.

    Parameters
    ----------
    graph
        The shape graph of the function the block belongs to.
    exprs
        Every byte count the block needs (one per buffer), canonical or not.

    Attributes
    ----------
    vectors
        ``len(exprs) x M`` coefficients, in the order of ``exprs``.
    decision_points, acceptance_points
        Dim bindings (free dims only) where values are taken (see the module docstring).
    exact
        False when some atom is an opaque UNKNOWN value, which has no value at any point:
        values at points are then heuristic only.
    """

    def __init__(self, graph: ShapeGraph, exprs: Sequence[SymbolicExpr]) -> None:
        self.graph = graph
        self._atoms: list[sympy.Expr] = []
        self._atom_index: dict[sympy.Expr, int] = {}
        self._monomials: list[tuple[tuple[int, int], ...]] = []
        self._monomial_index: dict[tuple[tuple[int, int], ...], int] = {}
        cache: dict = {}
        decomposed = []
        for e in exprs:
            key = e.expr
            if key not in cache:
                cache[key] = self._decompose(graph.canonical(e).expr)
            decomposed.append(cache[key])
        m = len(self._monomials)
        coeff_max = 1
        rows = np.zeros((len(exprs), m), dtype=object)
        for i, terms in enumerate(decomposed):
            for mono, coeff in terms.items():
                rows[i, mono] = coeff
                coeff_max = max(coeff_max, abs(coeff))
        self._nonneg = np.array([self._monomial_nonneg(k) for k in range(m)], dtype=bool)
        self.exact = not any(is_unknown_symbol(a) for a in self._atoms)
        self._roots = _free_roots(graph)
        self.decision_points = [_restrict(p, self._roots) for p in graph.representative_points()]
        self.acceptance_points = acceptance_points(graph)
        self._decision_values = self._monomial_values(self.decision_points)
        self._acceptance_values = self._monomial_values(self.acceptance_points)
        # Sums over every buffer of the block must stay exact: the largest such sum, of every
        # coefficient of every buffer, bounds every row sum and every value of one at a point
        # (per monomial, its coefficients' total times its largest value at a point).
        values = np.concatenate([self._acceptance_values, self._decision_values], axis=1)
        bound = sum(
            sum(abs(int(c)) for c in rows[:, k]) * max([1] + [abs(int(v)) for v in values[k]])
            for k in range(m)
        )
        self.dtype = np.int64 if bound < _INT64_SAFE and coeff_max < _INT64_SAFE else object
        # Sums of coefficients through float64 stay exact below 2**53.
        self.float_exact = self.dtype != object and coeff_max * max(1, len(exprs)) < 2**53
        self.vectors = rows.astype(self.dtype)
        self._decision_values = self._decision_values.astype(self.dtype)
        self._acceptance_values = self._acceptance_values.astype(self.dtype)
        # numpy multiplies int64 matrices without BLAS; the scorer takes values at the
        # acceptance points of every order it meets, so those products go through float64
        # whenever that is exact (see :meth:`_exact_in_float`).
        self._acceptance_float: np.ndarray | None = None
        self._acceptance_reach = 0.0
        if self.dtype != object:
            self._acceptance_float = self._acceptance_values.astype(np.float64)
            reach = np.abs(self._acceptance_float).sum(axis=0)
            self._acceptance_reach = float(reach.max()) if reach.size else 0.0
        self._compare_cache: dict[tuple[tuple, tuple], Ordering] = {}
        self._symbolic_cache: dict[tuple, SymbolicExpr] = {}
        self.symbolic_compares = 0

    # ------------------------------------------------------------------ basis
    @property
    def size(self) -> int:
        """Number of monomials in the basis."""
        return len(self._monomials)

    def zero(self) -> np.ndarray:
        """The zero vector."""
        return np.zeros(self.size, dtype=self.dtype)

    def constant_value(self, vec: np.ndarray) -> int | None:
        """The value of a vector that stands for a constant, None otherwise."""
        k = self._monomial_index.get(())
        nonzero = np.flatnonzero(vec)
        if nonzero.size == 0:
            return 0
        if k is None or nonzero.size != 1 or nonzero[0] != k:
            return None
        return int(vec[k])

    def constant(self, value: int) -> np.ndarray:
        """The vector of a constant that ``constant_value`` returned for some vector."""
        out = self.zero()
        if value:
            out[self._monomial_index[()]] = value
        return out

    def _atom(self, atom: sympy.Expr) -> int:
        index = self._atom_index.get(atom)
        if index is None:
            index = len(self._atoms)
            self._atoms.append(atom)
            self._atom_index[atom] = index
        return index

    def _monomial(self, key: tuple[tuple[int, int], ...]) -> int:
        index = self._monomial_index.get(key)
        if index is None:
            index = len(self._monomials)
            self._monomials.append(key)
            self._monomial_index[key] = index
        return index

    def _decompose(self, expr: sympy.Expr) -> dict[int, int]:
        terms: dict[int, int] = {}
        for term in sympy.Add.make_args(sympy.expand(expr)):
            coeff, rest = term.as_coeff_Mul()
            if not coeff.is_Integer:
                raise UnsupportedBytes(f"byte count {expr} has a non-integer coefficient")
            powers: dict[int, int] = {}
            if not (rest.is_Number and rest == 1):
                for factor in sympy.Mul.make_args(rest):
                    base, exp = factor.as_base_exp()
                    if not _is_proper_monomial_factor(base, exp):
                        base, exp = factor, sympy.Integer(1)
                    atom = self._atom(base)
                    powers[atom] = powers.get(atom, 0) + int(exp)
            mono = self._monomial(tuple(sorted(powers.items())))
            terms[mono] = terms.get(mono, 0) + int(coeff)
        return {k: v for k, v in terms.items() if v != 0}

    def _monomial_nonneg(self, k: int) -> bool:
        for atom_index, exp in self._monomials[k]:
            if exp % 2 == 0:
                continue
            atom = self._atoms[atom_index]
            if is_unknown_symbol(atom):
                continue
            lower = self.graph.lower_bound(SymbolicExpr(atom))
            if lower is None or lower < 0:
                return False
        return True

    def _monomial_values(self, points: Sequence[Mapping[str, int]]) -> np.ndarray:
        out = np.zeros((self.size, len(points)), dtype=object)
        for j, point in enumerate(points):
            atom_values = []
            for atom in self._atoms:
                if is_unknown_symbol(atom):
                    atom_values.append(_UNKNOWN_STAND_IN)
                    continue
                try:
                    atom_values.append(evaluate_sympy(atom, point))
                except (ValueError, ZeroDivisionError):
                    atom_values.append(_UNKNOWN_STAND_IN)
                    self.exact = False
            for k, mono in enumerate(self._monomials):
                value = 1
                for atom_index, exp in mono:
                    value *= atom_values[atom_index] ** exp
                out[k, j] = value
        return out

    # ------------------------------------------------------------------ queries
    def symbolic(self, vec: np.ndarray | tuple) -> SymbolicExpr:
        """The byte count a vector stands for."""
        key = tuple(int(c) for c in vec)
        cached = self._symbolic_cache.get(key)
        if cached is None:
            expr = sympy.Integer(0)
            for k, coeff in enumerate(key):
                if coeff:
                    mono = sympy.Integer(coeff)
                    for atom_index, exp in self._monomials[k]:
                        mono = mono * self._atoms[atom_index] ** exp
                    expr = expr + mono
            cached = SymbolicExpr(expr)
            self._symbolic_cache[key] = cached
        return cached

    def dominance(self, a: np.ndarray, b: np.ndarray) -> Ordering:
        """EQ / LE / GE from the coefficients alone, UNKNOWN when they do not decide."""
        diff = b - a
        if not diff.any():
            return Ordering.EQ
        nonneg = self._nonneg
        if (diff[~nonneg] != 0).any():
            return Ordering.UNKNOWN
        d = diff[nonneg]
        if (d >= 0).all():
            return Ordering.LE
        if (d <= 0).all():
            return Ordering.GE
        return Ordering.UNKNOWN

    def compare(self, a: np.ndarray | tuple, b: np.ndarray | tuple) -> Ordering:
        """The proven relation of two byte counts (see the module docstring)."""
        ka = a if isinstance(a, tuple) else tuple(a.tolist())
        kb = b if isinstance(b, tuple) else tuple(b.tolist())
        if ka == kb:
            return Ordering.EQ
        cached = self._compare_cache.get((ka, kb))
        if cached is not None:
            return cached
        va = np.array(ka, dtype=self.dtype)
        vb = np.array(kb, dtype=self.dtype)
        result = self.dominance(va, vb)
        if result is Ordering.UNKNOWN:
            self.symbolic_compares += 1
            result = self.graph.compare(self.symbolic(ka), self.symbolic(kb))
        self._compare_cache[(ka, kb)] = result
        self._compare_cache[(kb, ka)] = result.reverse()
        return result

    def at_decision_points(self, vecs: np.ndarray) -> np.ndarray:
        """Values of one vector (``M``) or of rows (``n x M``) at the decision points."""
        return vecs @ self._decision_values

    def _exact_in_float(self, vecs: np.ndarray) -> bool:
        """Whether every product and partial sum of ``vecs`` with the acceptance values is an
        integer below 2**53, so that a float64 (BLAS) product gives the exact int64 values in
        any order of the sums."""
        if self._acceptance_float is None or vecs.dtype != np.int64 or not vecs.size:
            return False
        largest = max(-int(vecs.min()), int(vecs.max()))
        return largest * self._acceptance_reach < _FLOAT_EXACT

    def at_acceptance_points(self, vecs: np.ndarray) -> np.ndarray:
        """Values of one vector (``M``) or of rows (``n x M``) at the acceptance points."""
        if self._exact_in_float(vecs):
            return (vecs.astype(np.float64) @ self._acceptance_float).astype(np.int64)
        return vecs @ self._acceptance_values

    def by_acceptance_point(self, rows: np.ndarray) -> np.ndarray:
        """Values of rows (``n x M``) at the acceptance points, one row per point (``P x n``,
        contiguous): :func:`at_acceptance_points` transposed, the layout in which the searches
        read one point's values over every step (a maximum along the steps of the ``n x P``
        layout strides through memory, and costs several times more)."""
        if self._exact_in_float(rows):
            product = self._acceptance_float.T @ rows.T.astype(np.float64)
            return product.astype(np.int64)
        return self._acceptance_values.T @ rows.T  # a new, C-contiguous array

    def at_points(self, vecs: np.ndarray, points: Sequence[Mapping[str, int]]) -> np.ndarray:
        """Values of one vector (``M``) or of rows (``n x M``) at other points (free dims).

        Heuristic use only (choosing where ranges meet): an atom that cannot be evaluated
        takes a stand-in value, and unlike at construction ``exact`` is left as it is.
        """
        exact = self.exact
        values = self._monomial_values(points)
        self.exact = exact
        return vecs.astype(object) @ values


@dataclass
class OrderProfile:
    """Live bytes of one order of a block.

    Attributes
    ----------
    order
        Binding indices (input positions) in execution order.
    peaks
        The peak of live bytes at each acceptance point.
    front
        Coefficient rows of ``live_during`` at the steps that can be the peak: every step whose
        live bytes are not dominated coefficient-wise by another step's.
    """

    order: list[int]
    peaks: np.ndarray
    front: np.ndarray

    def peak_expr(self, space: ByteSpace) -> SymbolicExpr:
        """The symbolic peak: the Max over the front."""
        return SymbolicExpr.max(*[space.symbolic(row) for row in self.front])


def pareto_front(space: ByteSpace, rows: np.ndarray) -> np.ndarray:
    """Rows not dominated coefficient-wise by another row (each kept once).

    Dominance needs every monomial non-negative; where that is not proven all distinct rows are
    kept (their Max is still exact, only larger).
    """
    if rows.shape[0] == 0:
        return rows
    unique = np.unique(rows, axis=0) if rows.dtype != object else _unique_object(rows)
    nonneg = space._nonneg
    if not nonneg.all():
        return unique
    # Largest first (at the largest acceptance point), so dominating rows are met early.
    order = np.argsort(-_as_float(space.at_acceptance_points(unique)).max(axis=1), kind="stable")
    kept: list[np.ndarray] = []
    kept_matrix = np.zeros((0, unique.shape[1]), dtype=unique.dtype)
    for i in order:
        row = unique[i]
        if kept and (kept_matrix >= row).all(axis=1).any():
            continue
        if kept:
            # Drop kept rows that this one dominates (possible after float ties).
            keep_mask = ~(kept_matrix <= row).all(axis=1)
            kept = [r for r, k in zip(kept, keep_mask) if k]
        kept.append(row)
        kept_matrix = np.array(kept, dtype=unique.dtype)
    return kept_matrix


def front_le(space: ByteSpace, front_a: np.ndarray, front_b: np.ndarray, budget: int) -> bool:
    """Whether ``Max(front_a) <= Max(front_b)`` is proven for every admissible point.

    Sufficient condition: every row of ``front_a`` is proven no larger than some row of
    ``front_b``. At most ``budget`` slow symbolic comparisons are spent.
    """
    if front_a.shape[0] == 0:
        return True
    if front_b.shape[0] == 0:
        return False
    values_b = space.at_acceptance_points(front_b)
    for row in front_a:
        diff_ok = False
        # Cheap: coefficient dominance against any row.
        nonneg = space._nonneg
        if nonneg.all():
            if (front_b >= row).all(axis=1).any():
                continue
        # Candidates that are at least as large at every point (necessary for a proof),
        # largest first.
        values_a = space.at_acceptance_points(row)
        possible = np.nonzero((values_b >= values_a).all(axis=1))[0]
        if possible.size == 0:
            return False
        possible = possible[np.argsort(-_as_float(values_b[possible]).max(axis=1), kind="stable")]
        for j in possible:
            if budget <= 0:
                return False
            before = space.symbolic_compares
            if space.compare(row, front_b[j]).holds_le:
                diff_ok = True
                break
            budget -= space.symbolic_compares - before
        if not diff_ok:
            return False
    return True


def _as_float(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float64) if values.dtype == object else values


def _unique_object(rows: np.ndarray) -> np.ndarray:
    seen: dict[tuple, None] = {}
    for row in rows:
        seen.setdefault(tuple(row.tolist()), None)
    return np.array(list(seen), dtype=object).reshape(len(seen), rows.shape[1])


def acceptance_points(graph: ShapeGraph) -> list[dict[str, int]]:
    """The acceptance points of ``graph``'s free dims (see the module docstring)."""
    roots = _free_roots(graph)
    decision = [_restrict(p, roots) for p in graph.representative_points()]
    return _dedup(decision + _dense_points(roots))


def _free_roots(graph: ShapeGraph) -> dict[str, tuple[int, int]]:
    """The dims that are their own class representative, with their (closed) sample range."""
    roots: dict[str, tuple[int, int]] = {}
    for name, dim in graph.dims.items():
        rep = graph.representative(name).expr
        if not (isinstance(rep, sympy.Symbol) and rep.name == name):
            continue
        lo = max(int(dim.lower), 0) if dim.lower is not None else 1
        hi = dim.upper if dim.upper is not None else max(lo, UNBOUNDED_STAND_IN)
        roots[name] = (lo, int(hi))
    return roots


def _restrict(point: Mapping[str, int], roots: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    return {name: int(point[name]) for name in roots if name in point}


def _dense_points(roots: Mapping[str, tuple[int, int]]) -> list[dict[str, int]]:
    if not roots:
        return []
    lo = min(r[0] for r in roots.values())
    hi = max(r[1] for r in roots.values())
    values = []
    k = 0
    while 2**k <= hi:
        # Powers of two and the values half way between them (3 * 2**(k-1)).
        values.extend([2**k, 3 * 2**k // 2] if k else [1])
        k += 1
    points = []
    for v in values:
        if max(lo, 1) <= v <= hi:
            points.append({name: min(max(v, rlo), rhi) for name, (rlo, rhi) in roots.items()})
    return points


def _dedup(points: Sequence[dict[str, int]]) -> list[dict[str, int]]:
    seen: set[tuple] = set()
    out = []
    for p in points:
        key = tuple(sorted(p.items()))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out

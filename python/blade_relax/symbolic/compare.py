"""Sound comparison of symbolic expressions over dims with integer value ranges.

``compare(a, b)`` answers a relation only when it holds for EVERY admissible integer value of
the dims (each dim in its ``[lower, upper]`` range); otherwise UNKNOWN. Nothing is ever decided
from a sample point.

The engine computes a sound lower bound of ``d = a - b`` (and of ``-d``, giving an upper bound):

* polynomials in the dims: each dim is shifted to ``x = lo + t`` (or ``x = hi - t`` when
  bounded, trying every corner for up to ``_MAX_CORNER_DIMS`` dims), ``0 <= t <= hi - lo``;
  the expanded polynomial in ``t`` is bounded below by its constant term plus, for each
  negative coefficient, the coefficient times the monomial's largest value on the box.
  A polynomial in one dim is minimised exactly over the integers of its range (the minimum of a
  univariate polynomial on integers lies at the range ends or next to a real root of its
  derivative, which are isolated with rational intervals).
* ``Max``/``Min``: at every point ``Max(x, y)`` is one of its arguments, so
  ``lb(d) >= min(lb(d[Max := x]), lb(d[Max := y]))``; where ``d`` is non-decreasing in the Max
  term (it is a factor of a term with a positive coefficient and non-negative co-factors),
  ``Max >= x`` gives the stronger ``lb(d) >= max(...)``. Mirrored for Min.
* ``floor(p / q)`` with a positive constant ``q`` and integer ``p``:
  ``(p - q + 1) / q <= floor(p / q) <= p / q``; ``0 <= Mod(x, c) <= c - 1`` (and ``<= x`` when
  ``x >= 0``); each bound is substituted where its direction is the sound one.
* ``Piecewise`` (from Select): the minimum over its branches.
* an expression that still contains an opaque UNKNOWN symbol after cancellation: no bound.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable
from fractions import Fraction

import sympy

from .dim import is_unknown_symbol

Bound = int | Fraction | float  # float only for +-inf
NEG_INF = float("-inf")
POS_INF = float("inf")
RangeOf = Callable[[sympy.Symbol], "tuple[int | None, int | None]"]

# Dims a polynomial may have for trying every lo/hi corner shift (2**n expansions).
_MAX_CORNER_DIMS = 3
# Sub-bounds computed (one per case of an eliminated Max/Min/floor/Mod/Piecewise) per bound
# before giving up with no bound: keeps a comparison of two large Max expressions cheap.
_MAX_STEPS = 256


class Ordering(enum.Enum):
    """A relation between two symbolic expressions, valid for every admissible value."""

    LT = "<"
    LE = "<="
    EQ = "=="
    GE = ">="
    GT = ">"
    UNKNOWN = "?"

    @property
    def holds_ge(self) -> bool:
        """Whether ``a >= b`` is proven (GT, GE or EQ)."""
        return self in (Ordering.GT, Ordering.GE, Ordering.EQ)

    @property
    def holds_le(self) -> bool:
        """Whether ``a <= b`` is proven (LT, LE or EQ)."""
        return self in (Ordering.LT, Ordering.LE, Ordering.EQ)

    def reverse(self) -> Ordering:
        """The relation of ``(b, a)`` given this relation of ``(a, b)``."""
        return _REVERSED[self]


_REVERSED = {
    Ordering.LT: Ordering.GT,
    Ordering.LE: Ordering.GE,
    Ordering.EQ: Ordering.EQ,
    Ordering.GE: Ordering.LE,
    Ordering.GT: Ordering.LT,
    Ordering.UNKNOWN: Ordering.UNKNOWN,
}


class BoundEngine:
    """Sound lower/upper bounds of expressions given the dims' ranges; results are cached.

    Parameters
    ----------
    range_of : callable
        Maps a dim symbol to its ``(lower, upper)`` range (None for unbounded).
    """

    def __init__(self, range_of: RangeOf) -> None:
        self._range_of = range_of
        self._lower_cache: dict[sympy.Expr, Bound] = {}
        self._terms_cache: dict[sympy.Expr, dict[tuple, Bound] | None] = {}

    # ------------------------------------------------------------------ public
    def order_of(self, a: sympy.Expr, b: sympy.Expr) -> Ordering:
        """The relation of ``a`` to ``b``, proven for every admissible point.

        Fast path: when both sides are plain polynomials (the usual byte sizes) their terms are
        read once, cached, and subtracted as dicts, with no sympy arithmetic per comparison.
        """
        ta, tb = self.terms(a), self.terms(b)
        if ta is None or tb is None:
            return self.order_of_difference(a - b)
        diff = dict(ta)
        for monom, c in tb.items():
            v = diff.get(monom, 0) - c
            if v:
                diff[monom] = v
            else:
                diff.pop(monom, None)
        return self._order_of_terms(diff)

    def order_of_difference(self, d: sympy.Expr) -> Ordering:
        """The sign relation of ``d`` against 0, proven for every admissible point."""
        if d.is_Number:
            if d > 0:
                return Ordering.GT
            if d < 0:
                return Ordering.LT
            return Ordering.EQ
        if any(is_unknown_symbol(s) for s in d.free_symbols):
            return Ordering.UNKNOWN
        terms = self.terms(d)
        if terms is not None:
            return self._order_of_terms(terms)
        return _classify(self.lower(d), lambda: -self.lower(-d))

    def terms(self, e: sympy.Expr) -> dict[tuple, Bound] | None:
        """``e`` as ``{((symbol, exponent), ...): coefficient}`` if a plain polynomial, else None."""
        cached = self._terms_cache.get(e, _MISSING)
        if cached is _MISSING:
            cached = _sparse_terms(e)
            self._terms_cache[e] = cached
        return cached

    def _order_of_terms(self, diff: dict[tuple, Bound]) -> Ordering:
        if not diff:
            return Ordering.EQ
        symbols = sorted({sym for monom in diff for sym, _ in monom}, key=lambda x: x.name)
        if any(is_unknown_symbol(x) for x in symbols):
            return Ordering.UNKNOWN
        index = {sym: i for i, sym in enumerate(symbols)}
        dense: dict[tuple[int, ...], Bound] = {}
        for monom, c in diff.items():
            key = [0] * len(symbols)
            for sym, k in monom:
                key[index[sym]] = k
            dense[tuple(key)] = c
        ranges = [self._range_of(x) for x in symbols]
        integral = all(isinstance(c, int) for c in dense.values())

        def bound(terms: dict[tuple[int, ...], Bound]) -> Bound:
            lb = _poly_terms_lower(terms, ranges)
            return math.ceil(lb) if integral and lb != NEG_INF else lb

        negated = {m: -c for m, c in dense.items()}
        return _classify(bound(dense), lambda: -bound(negated))

    def lower(self, e: sympy.Expr) -> Bound:
        """A sound lower bound of ``e`` over the admissible integer points (``-inf`` if none)."""
        cached = self._lower_cache.get(e)
        if cached is not None:
            return cached
        budget = [_MAX_STEPS]
        result = self._lower(e, budget)
        self._lower_cache[e] = result
        return result

    def upper(self, e: sympy.Expr) -> Bound:
        """A sound upper bound of ``e`` (``inf`` if none)."""
        return -self.lower(-e)

    # ------------------------------------------------------------------ internals
    def _lower(self, e: sympy.Expr, budget: list[int]) -> Bound:
        if e.is_Number:
            return _to_fraction(e)
        if any(is_unknown_symbol(s) for s in e.free_symbols):
            return NEG_INF
        atom = _first_atom(e)
        if atom is None:
            lb = self._poly_lower(e)
        else:
            cases = (
                len(atom.args) if isinstance(atom, (sympy.Max, sympy.Min, sympy.Piecewise)) else 1
            )
            budget[0] -= cases
            if budget[0] < 0:
                return NEG_INF
            lb = self._lower_atom(e, atom, budget)
        # An integer-valued expression is at least the next integer above any lower bound.
        if lb != NEG_INF and not isinstance(lb, int) and _integer_valued(e):
            lb = math.ceil(lb)
        return lb

    def _sub_lower(self, e: sympy.Expr, budget: list[int]) -> Bound:
        cached = self._lower_cache.get(e)
        if cached is not None:
            return cached
        return self._lower(e, budget)

    def _lower_atom(self, e: sympy.Expr, atom: sympy.Expr, budget: list[int]) -> Bound:
        if isinstance(atom, (sympy.Max, sympy.Min)):
            polarity = self._polarity(e, atom, budget)
            bounds = [self._sub_lower(e.xreplace({atom: a}), budget) for a in atom.args]
            # Max(x, y) >= x: where d grows with the Max, any one argument gives a lower bound.
            # Otherwise split cases: the Max equals one of its arguments at every point.
            monotone = polarity > 0 if isinstance(atom, sympy.Max) else polarity < 0
            return max(bounds) if monotone else min(bounds)
        if isinstance(atom, sympy.Piecewise):
            return min(self._sub_lower(e.xreplace({atom: v}), budget) for v, _ in atom.args)
        polarity = self._polarity(e, atom, budget)
        if polarity == 0:
            return NEG_INF
        if isinstance(atom, (sympy.floor, sympy.ceiling)):
            low, high = _rounding_bounds(atom)
            return self._sub_lower(e.xreplace({atom: low if polarity > 0 else high}), budget)
        if isinstance(atom, sympy.Mod):
            x, c = atom.args
            if polarity > 0:
                if self._sub_lower(c, budget) < 1:
                    return NEG_INF
                return self._sub_lower(e.xreplace({atom: sympy.Integer(0)}), budget)
            # Mod(x, c) <= c - 1 for c >= 1, and <= x when x >= 0.
            candidates = [NEG_INF]
            if self._sub_lower(c, budget) >= 1:
                candidates.append(self._sub_lower(e.xreplace({atom: c - 1}), budget))
            if self._sub_lower(x, budget) >= 0:
                candidates.append(self._sub_lower(e.xreplace({atom: x}), budget))
            return max(candidates)
        return NEG_INF

    def _polarity(self, e: sympy.Expr, atom: sympy.Expr, budget: list[int]) -> int:
        """+1 / -1 when ``e`` is non-decreasing / non-increasing in ``atom``, else 0."""
        sign = 0
        for term in sympy.Add.make_args(e):
            if not term.has(atom):
                continue
            coeff, factors = term.as_coeff_mul()
            if factors.count(atom) != 1:
                return 0
            for f in factors:
                if f is atom or f == atom:
                    continue
                if f.has(atom) or not self._nonnegative(f, budget):
                    return 0
            s = 1 if coeff > 0 else -1
            if sign and s != sign:
                return 0
            sign = s
        return sign

    def _nonnegative(self, f: sympy.Expr, budget: list[int]) -> bool:
        if f.is_Symbol:
            lo, _ = self._range_of(f)
            return lo is not None and lo >= 0
        if f.is_Pow and f.exp.is_Integer and f.exp > 0:
            if f.exp % 2 == 0:
                return True
            return self._nonnegative(f.base, budget)
        return self._sub_lower(f, budget) >= 0

    def _poly_lower(self, e: sympy.Expr) -> Bound:
        sparse = self.terms(e)
        if sparse is not None:
            gens = sorted({sym for monom in sparse for sym, _ in monom}, key=lambda x: x.name)
            index = {sym: i for i, sym in enumerate(gens)}
            terms: dict[tuple[int, ...], Bound] = {}
            for monom, c in sparse.items():
                key = [0] * len(gens)
                for sym, k in monom:
                    key[index[sym]] = k
                terms[tuple(key)] = c
        else:
            gens = sorted(e.free_symbols, key=lambda x: x.name)
            try:
                poly = sympy.Poly(e, *gens)
            except sympy.PolynomialError:
                return NEG_INF
            if any(m < 0 for monom in poly.monoms() for m in monom):
                return NEG_INF
            terms = {monom: _to_fraction(c) for monom, c in poly.terms()}
        ranges = [self._range_of(g) for g in gens]
        return _poly_terms_lower(terms, ranges)


_MISSING = object()


def _classify(lb: Bound, upper: Callable[[], Bound]) -> Ordering:
    """The relation of a difference to 0 from its lower bound and (lazily) its upper bound."""
    if lb > 0:
        return Ordering.GT
    ub = upper()
    if lb >= 0:
        return Ordering.EQ if ub <= 0 else Ordering.GE
    if ub < 0:
        return Ordering.LT
    if ub <= 0:
        return Ordering.LE
    return Ordering.UNKNOWN


def _sparse_terms(e: sympy.Expr) -> dict[tuple, Bound] | None:
    """Read a sum of monomials (number * symbol**k * ...) without expanding; None otherwise."""
    out: dict[tuple, Bound] = {}
    for term in sympy.Add.make_args(e):
        coeff, factors = term.as_coeff_mul()
        if not coeff.is_Rational:
            return None
        powers: dict[sympy.Symbol, int] = {}
        for f in factors:
            if f.is_Symbol:
                powers[f] = powers.get(f, 0) + 1
            elif f.is_Pow and f.base.is_Symbol and f.exp.is_Integer and f.exp > 0:
                powers[f.base] = powers.get(f.base, 0) + int(f.exp)
            else:
                return None
        monom = tuple(sorted(powers.items(), key=lambda kv: kv[0].name))
        value = out.get(monom, 0) + _to_fraction(coeff)
        if value:
            out[monom] = value
        else:
            out.pop(monom, None)
    return out


def _poly_terms_lower(terms: dict[tuple[int, ...], Bound], ranges: list) -> Bound:
    """Lower bound of the polynomial ``sum c * x^monom`` over the integer box ``ranges``."""
    if not terms:
        return 0
    if any(lo is None for lo, _ in ranges):
        return _naive_lower(terms, ranges)
    used = [i for i in range(len(ranges)) if any(m[i] for m in terms)]
    if len(used) <= 1:
        if not used:
            return sum(terms.values(), 0)
        i = used[0]
        coeffs = {m[i]: c for m, c in terms.items()}
        return _univariate_integer_min(coeffs, ranges[i])
    best = _shifted_lower(terms, ranges)
    if best > 0:
        return best
    # Factor out the common monomial g (dims >= 0): d = g * r. With lb(r) >= 0, d >= min(g) *
    # lb(r); otherwise d >= max(g) * lb(r). This proves b*s*(s - 64) <= 0 for s <= 64 where
    # the corner shifts alone see the unbounded b.
    common = tuple(min(m[i] for m in terms) for i in range(len(ranges)))
    if any(common):
        rest = {tuple(a - b for a, b in zip(m, common)): c for m, c in terms.items()}
        lb_rest = _poly_terms_lower(rest, ranges)
        g_lo, g_hi = _monomial_interval(common, ranges)
        if g_lo >= 0:
            if lb_rest >= 0:
                best = max(best, _mul(lb_rest, g_lo))
            elif g_hi != POS_INF and lb_rest != NEG_INF:
                best = max(best, lb_rest * g_hi)
    return best


def _to_fraction(n: sympy.Expr) -> Fraction | int:
    if n.is_Integer:
        return int(n)
    if n.is_Rational:
        return Fraction(int(n.p), int(n.q))
    raise TypeError(f"not a rational number: {n}")


def _integer_valued(e: sympy.Expr) -> bool:
    """Whether ``e`` takes integer values at integer points (structurally)."""
    if e.is_Integer or (e.is_Symbol and e.is_integer):
        return True
    if e.is_Add or e.is_Mul or isinstance(e, (sympy.Max, sympy.Min)):
        return all(_integer_valued(a) for a in e.args)
    if e.is_Pow:
        return bool(e.exp.is_Integer and e.exp >= 0 and _integer_valued(e.base))
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        return True
    if isinstance(e, sympy.Mod):
        return all(_integer_valued(a) for a in e.args)
    if isinstance(e, sympy.Piecewise):
        return all(_integer_valued(v) for v, _ in e.args)
    return False


_ATOM_TYPES = (sympy.Max, sympy.Min, sympy.floor, sympy.ceiling, sympy.Mod, sympy.Piecewise)


def _first_atom(e: sympy.Expr) -> sympy.Expr | None:
    # Outermost first (pre-order): eliminating an outer atom may expose inner ones as factors.
    for node in sympy.preorder_traversal(e):
        if isinstance(node, _ATOM_TYPES):
            return node
    return None


def _rounding_bounds(atom: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(lower, upper) sympy bounds of ``floor(arg)`` / ``ceiling(arg)``."""
    arg = atom.args[0]
    num, den = arg.as_numer_denom()
    integral = (
        den.is_Integer
        and den > 0
        and all(s.is_integer for s in num.free_symbols)
        and _has_integer_coefficients(num)
    )
    if isinstance(atom, sympy.floor):
        # floor(p/q) >= (p - q + 1)/q for integer p and positive integer q; else > arg - 1.
        low = (num - den + 1) / den if integral else arg - 1
        return low, arg
    high = (num + den - 1) / den if integral else arg + 1
    return arg, high


def _has_integer_coefficients(e: sympy.Expr) -> bool:
    try:
        return all(c.is_Integer for c in sympy.Poly(e).coeffs())
    except sympy.PolynomialError:
        return False


def _naive_lower(terms: dict[tuple[int, ...], Bound], ranges: list) -> Bound:
    """Interval lower bound of a polynomial, for dims some of which are unbounded below."""
    total: Bound = 0
    for monom, c in terms.items():
        lo, hi = _monomial_interval(monom, ranges)
        total += c * lo if c > 0 else (c * hi if hi != POS_INF else NEG_INF)
        if total == NEG_INF:
            return NEG_INF
    return total


def _monomial_interval(monom: tuple[int, ...], ranges: list) -> tuple[Bound, Bound]:
    lo_acc: Bound = 1
    hi_acc: Bound = 1
    for k, (lo, hi) in zip(monom, ranges):
        if k == 0:
            continue
        lo = NEG_INF if lo is None else lo
        hi = POS_INF if hi is None else hi
        cands = [_pow(lo, k), _pow(hi, k)]
        if lo < 0 < hi and k % 2 == 0:
            cands.append(0)
        plo, phi = min(cands), max(cands)
        prods = [_mul(a, b) for a in (lo_acc, hi_acc) for b in (plo, phi)]
        lo_acc, hi_acc = min(prods), max(prods)
    return lo_acc, hi_acc


def _pow(x: Bound, k: int) -> Bound:
    if x in (POS_INF, NEG_INF):
        return POS_INF if (x > 0 or k % 2 == 0) else NEG_INF
    return x**k


def _mul(a: Bound, b: Bound) -> Bound:
    if a == 0 or b == 0:
        return 0  # 0 * inf: the monomial's factor is exactly 0 there
    return a * b


def _shifted_lower(terms: dict[tuple[int, ...], Bound], ranges: list) -> Bound:
    """Best lower bound over corner shifts ``x = lo + t`` / ``x = hi - t`` (see module doc)."""
    n = len(ranges)
    bounded = [i for i, (_, hi) in enumerate(ranges) if hi is not None]
    corner_dims = bounded if len(bounded) <= _MAX_CORNER_DIMS else []
    choices: list[tuple[bool, ...]] = []
    for flips in itertools.product((False, True), repeat=len(corner_dims)):
        choice = [False] * n
        for i, f in zip(corner_dims, flips):
            choice[i] = f
        choices.append(tuple(choice))
    if len(bounded) > _MAX_CORNER_DIMS and len(bounded) == n:
        choices.append(tuple([True] * n))
    best: Bound = NEG_INF
    for from_upper in choices:
        lb = _shift_once(terms, ranges, from_upper)
        best = max(best, lb)
        if best > 0:
            break
    return best


def _shift_once(terms: dict, ranges: list, from_upper: tuple[bool, ...]) -> Bound:
    n = len(ranges)
    shifted: dict[tuple[int, ...], Bound] = {}
    for monom, c in terms.items():
        # Expand c * prod (base_i + sign_i * t_i)^k_i with the binomial theorem.
        partial: dict[tuple[int, ...], Bound] = {(0,) * n: c}
        for i, k in enumerate(monom):
            if k == 0:
                continue
            lo, hi = ranges[i]
            base, sign = (hi, -1) if from_upper[i] else (lo, 1)
            nxt: dict[tuple[int, ...], Bound] = {}
            for m, v in partial.items():
                for j in range(k + 1):
                    coef = math.comb(k, j) * base ** (k - j) * sign**j
                    if coef == 0:
                        continue
                    m2 = m[:i] + (m[i] + j,) + m[i + 1 :]
                    nxt[m2] = nxt.get(m2, 0) + v * coef
            partial = nxt
        for m, v in partial.items():
            shifted[m] = shifted.get(m, 0) + v
    total: Bound = shifted.pop((0,) * n, 0)
    for m, c in shifted.items():
        if c >= 0:
            continue
        # Largest value of the monomial in t over the box 0 <= t_i <= hi_i - lo_i.
        peak: Bound = 1
        for i, k in enumerate(m):
            if k == 0:
                continue
            lo, hi = ranges[i]
            if hi is None:
                return NEG_INF
            peak *= (hi - lo) ** k
        total += c * peak
    return total


def _univariate_integer_min(coeffs: dict[int, Bound], rng: tuple[int, int | None]) -> Bound:
    """Exact minimum of ``sum c * x^k`` (``coeffs`` maps k -> c) over the integers of a range.

    Memoized: the same differences of byte sizes recur across the timelines a pass builds.
    """
    key = (tuple(sorted(coeffs.items())), rng)
    cached = _UNIVARIATE_CACHE.get(key)
    if cached is None:
        cached = _univariate_integer_min_uncached(coeffs, rng)
        if len(_UNIVARIATE_CACHE) >= _UNIVARIATE_CACHE_SIZE:
            _UNIVARIATE_CACHE.clear()
        _UNIVARIATE_CACHE[key] = cached
    return cached


_UNIVARIATE_CACHE: dict[tuple, Bound] = {}
_UNIVARIATE_CACHE_SIZE = 1 << 16


def _univariate_integer_min_uncached(
    coeffs: dict[int, Bound], rng: tuple[int, int | None]
) -> Bound:
    lo, hi = rng
    degree = max(coeffs)

    def value(x: int) -> Bound:
        return sum((c * x**k for k, c in coeffs.items()), 0)

    if degree == 0:
        return coeffs[0]
    if hi is None and coeffs[degree] < 0:
        return NEG_INF
    candidates = {lo} if hi is None else {lo, hi}
    if degree >= 2:
        # Between consecutive real roots of p' the polynomial is monotone, so the integer minimum
        # is at a range end or at an integer next to a root. Every root is enclosed in a
        # rational interval; the integers from its floor to its ceiling are candidates.
        for a, b in _derivative_root_intervals(coeffs, degree):
            start, stop = math.floor(a), math.ceil(b)
            for r in range(max(start, lo), (stop if hi is None else min(stop, hi)) + 1):
                candidates.add(r)
    return min(value(x) for x in candidates)


def _derivative_root_intervals(
    coeffs: dict[int, Bound], degree: int
) -> list[tuple[Fraction, Fraction]]:
    """Rational intervals enclosing every real root of the derivative of ``sum c * x^k``.

    Degrees 2 and 3 (derivatives of degree 1 and 2, the byte sizes of matmuls and attention)
    are solved in closed form with exact integer square roots; sympy's real-root isolation,
    correct for any degree but ~1 ms a call, serves the rest.
    """
    if degree <= 3:
        # p'(x) = a x^2 + b x + c
        a = Fraction(3 * coeffs.get(3, 0))
        b = Fraction(2 * coeffs.get(2, 0))
        c = Fraction(coeffs.get(1, 0))
        if a == 0:
            if b == 0:
                return []
            root = -c / b
            return [(root, root)]
        disc = b * b - 4 * a * c
        if disc < 0:
            return []
        # sqrt(p/q) = sqrt(p*q)/q, bracketed by the integer square root of p*q.
        num, den = disc.numerator * disc.denominator, disc.denominator
        low = math.isqrt(num)
        high = low if low * low == num else low + 1
        sqrt_lo, sqrt_hi = Fraction(low, den), Fraction(high, den)
        out = []
        for sign in (1, -1):
            ends = [(-b + sign * r) / (2 * a) for r in (sqrt_lo, sqrt_hi)]
            out.append((min(ends), max(ends)))
        return out
    x = _X
    deriv = sympy.Poly(sum(sympy.Rational(c) * k * x ** (k - 1) for k, c in coeffs.items() if k), x)
    if deriv.is_zero:
        return []
    return [
        (_to_fraction(a), _to_fraction(b))
        for (a, b), _mult in deriv.intervals(eps=sympy.Rational(1, 4))
    ]


_X = sympy.Symbol("x")

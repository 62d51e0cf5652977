"""A shape graph at concrete values of its dims: evaluation, binding, sample points and grids.

:class:`ConcreteValues` holds the queries of :class:`~blade_relax.symbolic.ShapeGraph` that
take or give concrete values of the dims: :meth:`~ConcreteValues.evaluate` an expression at
given dims (checked against their ranges), :meth:`~ConcreteValues.bind_arguments` (the dims of
the parameters' concrete shapes), :meth:`~ConcreteValues.representative_points` and
:meth:`~ConcreteValues.sample` (screens, never proofs), and the grids of every admissible value
(:meth:`~ConcreteValues.admissible_grid`, :meth:`~ConcreteValues.split_unbounded`,
:meth:`~ConcreteValues.evaluate_grid`), where a check at every point is a proof.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sympy

from .dim import DEFAULT_LOWER, dim_symbol, format_range, is_unknown_symbol
from .expr import SymbolicExpr, _to_sympy, evaluate_sympy
from .relax_ir import shape_values, type_of

if TYPE_CHECKING:
    from .graph import ShapeGraph

#: Stand-in value of an unbounded dim in :meth:`ShapeGraph.representative_points`.
UNBOUNDED_STAND_IN = 4096


@functools.lru_cache(maxsize=1 << 14)
def _vectorized(e: sympy.Expr) -> Any:
    """``e`` as a numpy function of its free symbols, sorted by name.

    ``sympy.lambdify`` writes and compiles Python source on each call, which costs more than
    evaluating the result over a grid of thousands of points, and the passes evaluate the
    same sizes over a grid again and again (the trials of a rewrite share most of their sizes).
    The function depends on ``e`` alone, so it is made once per expression.
    """
    symbols = sorted(e.free_symbols, key=lambda sym: sym.name)
    return sympy.lambdify(symbols, e, modules="numpy")


class ConcreteValues:
    """The queries of a shape graph at concrete values of its dims: a base of
    :class:`~blade_relax.symbolic.ShapeGraph`, which builds what they read.

    Of the graph they read the dims (``_order``, ``_declared``, ``_parent``, ``_definition``),
    their classes' ranges and symbols (``_class_range``, ``_symbol_of``), the parameters
    (``_params``, ``_from_function``) and the methods ``_rebuild``, ``_canon``, ``_find``,
    ``_roots``, ``_members``, ``_range_of_symbol`` and ``with_lower_bounds``. Their caches
    (``_bind_cache``, ``_sample_cache``, ``_sample_points``) are the graph's, cleared whenever
    its classes change.
    """

    def evaluate(self, expr: SymbolicExpr | int | Any, bindings: Mapping[str, int]) -> int:
        """Evaluate ``expr`` at concrete dims, checked against the declared ranges.

        Raises
        ------
        ValueError
            If a needed dim is missing, a binding is outside its dim's range, two equal dims
            get different values, or the expression is UNKNOWN.
        """
        env = self._resolve_bindings(bindings)
        e = self._canon(_to_sympy(expr))
        try:
            return evaluate_sympy(e, env)
        except ValueError as err:
            missing = [
                s.name for s in e.free_symbols if not is_unknown_symbol(s) and s.name not in env
            ]
            if missing:
                details = ", ".join(
                    f"{n!r} (range {format_range(*self._range_of_symbol(self._symbol_for(n)))})"
                    for n in sorted(missing)
                )
                raise ValueError(
                    f"cannot evaluate {SymbolicExpr(e)}: no value for dim {details}"
                ) from None
            raise ValueError(f"cannot evaluate {SymbolicExpr(e)}: {err}") from None

    def _symbol_for(self, name: str) -> sympy.Symbol:
        return self._symbol_of.get(name) or dim_symbol(name)

    def _resolve_bindings(self, bindings: Mapping[str, int]) -> dict[str, int]:
        """Map given dim values to values of the free roots (checked); extra names pass through."""
        key = tuple(sorted((str(k), int(v)) for k, v in bindings.items()))
        cached = self._bind_cache.get(key)
        if cached is not None:
            return cached
        self._rebuild()
        env: dict[str, int] = {}
        given_defined: list[tuple[str, int]] = []
        for name, value in key:
            if name not in self._parent:
                env[name] = value
                continue
            lo, hi = self._declared[name]
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ValueError(
                    f"dim {name!r} = {value} is outside its range {format_range(lo, hi)}"
                )
            root = self._find(name)
            if root in self._definition:
                given_defined.append((name, value))
                continue
            clo, chi = self._class_range[root]
            if (clo is not None and value < clo) or (chi is not None and value > chi):
                raise ValueError(
                    f"dim {name!r} = {value} is outside the range {format_range(clo, chi)} of "
                    f"its class {sorted(self._members(root))}"
                )
            if root in env and env[root] != value:
                raise ValueError(
                    f"dims {sorted(self._members(root))} are equal but got different values "
                    f"({root!r} = {env[root]}, {name!r} = {value})"
                )
            env[root] = value
        for name, value in given_defined:
            expr = self._canon(self._symbol_of[name])
            try:
                expected = evaluate_sympy(expr, env)
            except (ValueError, ZeroDivisionError):
                continue
            if expected != value:
                raise ValueError(
                    f"dim {name!r} = {value} contradicts {name} = {SymbolicExpr(expr)} = {expected}"
                )
        self._bind_cache[key] = env
        return env

    def _all_values(self, env: Mapping[str, int]) -> dict[str, int]:
        """Values of every dim computable from root values ``env``."""
        out: dict[str, int] = {}
        for name in self._order:
            try:
                out[name] = evaluate_sympy(self._canon(self._symbol_of[name]), env)
            except (ValueError, ZeroDivisionError):
                continue
        return out

    def representative_points(self) -> list[dict[str, int]]:
        """Documented sample points of the dims' ranges (for reports and tests, never proofs).

        With ``lo``/``hi`` the class range of each free dim (``hi`` = max(lo,
        :data:`UNBOUNDED_STAND_IN`) when unbounded) and ``mid`` = round(sqrt(max(lo, 1) * hi))
        (the geometric midpoint, clamped into the range), the points are, in order, without
        duplicates: every dim at ``lo``; every dim at ``mid``; every dim at ``hi``; and, with
        several free dims, each dim at ``hi`` with the others at ``lo``. Every dim of the graph
        gets a value: equal dims the same one, dims defined by an expression its value.
        """
        self._rebuild()
        roots = self._roots()
        lo_hi: dict[str, tuple[int, int, int]] = {}
        for r in roots:
            lo, hi = self._class_range[r]
            lo = DEFAULT_LOWER if lo is None else lo
            hi = max(lo, UNBOUNDED_STAND_IN) if hi is None else hi
            mid = min(hi, max(lo, round(math.sqrt(max(lo, 1) * hi))))
            lo_hi[r] = (lo, mid, hi)
        choices = [
            {r: v[0] for r, v in lo_hi.items()},
            {r: v[1] for r, v in lo_hi.items()},
            {r: v[2] for r, v in lo_hi.items()},
        ]
        if len(roots) > 1:
            for r in roots:
                point = {q: v[0] for q, v in lo_hi.items()}
                point[r] = lo_hi[r][2]
                choices.append(point)
        points: list[dict[str, int]] = []
        seen: set[tuple] = set()
        for env in choices:
            key = tuple(sorted(env.items()))
            if key in seen:
                continue
            seen.add(key)
            points.append(self._all_values(env))
        return points

    def sample(self, expr: SymbolicExpr | int | Any) -> tuple[int, ...] | None:
        """The values of ``expr`` at :meth:`representative_points`, or None where one of them
        cannot be evaluated (an UNKNOWN part).

        A screen for proofs, never a proof: ``compare(a, b)`` can prove ``a >= b`` only if
        ``a``'s sample is at least ``b``'s at every point (the points are admissible), so a
        caller may skip a comparison the samples already refute.
        """
        e = self._canon(_to_sympy(expr))
        if e in self._sample_cache:
            return self._sample_cache[e]
        if self._sample_points is None:
            self._sample_points = self.representative_points()
        try:
            values = tuple(evaluate_sympy(e, point) for point in self._sample_points)
        except ValueError:
            values = None
        self._sample_cache[e] = values
        return values

    def admissible_grid(self, limit: int = 1 << 16) -> dict[str, Any] | None:
        """Every admissible value of the free dims: equal-length int64 arrays by dim name, one
        entry per point (the free dims' ranges crossed; dims defined by an expression of them
        are not listed, :meth:`evaluate_grid` computes them). ``None`` when a free dim is
        unbounded or there are more than ``limit`` points.

        Unlike :meth:`representative_points`, a check at every point of the grid is a proof:
        it covers every value the dims may take.
        """
        self._rebuild()
        if any(self._class_range[root][1] is None for root in self._roots()):
            return None
        return self._grid({}, limit)

    def _grid(self, upper: Mapping[str, int], limit: int) -> dict[str, Any] | None:
        """The free dims' ranges crossed, each root ending at ``upper[root]`` when given, else
        at its own (bounded) upper end; ``None`` past ``limit`` points."""
        import numpy as np

        axes = []
        for root in self._roots():
            lo, hi = self._class_range[root]
            lo = DEFAULT_LOWER if lo is None else lo
            axes.append(np.arange(lo, upper.get(root, hi) + 1, dtype=np.int64))
        if math.prod(len(a) for a in axes) > limit:
            return None
        mesh = np.meshgrid(*axes, indexing="ij") if axes else []
        return {root: m.ravel() for root, m in zip(self._roots(), mesh)}

    def split_unbounded(self, head: int = 1 << 12) -> tuple[dict[str, Any], ShapeGraph] | None:
        """For a graph whose one free dim is unbounded above (the others bounded): a grid of
        its first ``head`` values (crossed with the others' ranges, as :meth:`admissible_grid`)
        and a copy of the graph where that dim starts after them (:meth:`with_lower_bounds`).

        A check at every point of the grid and a proof on the copy cover every admissible
        value. ``None`` for any other graph, or a grid of more than ``1 << 16`` points.
        """
        self._rebuild()
        unbounded = [r for r in self._roots() if self._class_range[r][1] is None]
        if len(unbounded) != 1:
            return None
        (dim,) = unbounded
        lo = self._class_range[dim][0]
        last = (DEFAULT_LOWER if lo is None else lo) + head - 1
        grid = self._grid({dim: last}, 1 << 16)
        return None if grid is None else (grid, self.with_lower_bounds({dim: last + 1}))

    def evaluate_grid(self, expr: SymbolicExpr | int | Any, grid: Mapping[str, Any]) -> Any:
        """``expr`` at every point of ``grid`` (:meth:`admissible_grid`) as a float64 array
        (exact for integers below 2**53), or ``None`` when it reads an UNKNOWN part or a dim
        the grid does not give."""
        import numpy as np

        e = self._canon(_to_sympy(expr))
        points = len(next(iter(grid.values()))) if grid else 1
        symbols = sorted(e.free_symbols, key=lambda sym: sym.name)
        if any(is_unknown_symbol(sym) or sym.name not in grid for sym in symbols):
            return None
        if not symbols:
            return np.full(points, float(e))
        values = _vectorized(e)(*(grid[sym.name] for sym in symbols))
        return np.broadcast_to(np.asarray(values, dtype=np.float64), (points,))

    def bind_arguments(self, shapes: Sequence[Sequence[int] | None]) -> dict[str, int]:
        """Concrete dims from the concrete shapes of the function's parameters.

        Parameters
        ----------
        shapes : sequence
            One entry per parameter: the tensor's (or ``R.Shape`` value's) shape as ints, None to
            skip the parameter, or for a tuple parameter a sequence of such entries.

        Returns
        -------
        dict
            The value of every dim computable from the shapes (equal dims included).

        Raises
        ------
        ValueError
            On a rank or constant-dim mismatch, an out-of-range dim, or contradictory values;
            the message names the parameter, the dim and its range.
        """
        if not self._from_function:
            raise ValueError("bind_arguments needs a graph built with ShapeGraph.from_function")
        if len(shapes) != len(self._params):
            raise ValueError(
                f"expected {len(self._params)} parameter shapes "
                f"({[p.name for p in self._params]}), got {len(shapes)}"
            )
        pairs: list[tuple[str, Any, int]] = []
        for param, shape in zip(self._params, shapes):
            if shape is not None:
                _match_shape(param.name, type_of(param), shape, pairs)
        from tvm import tirx

        given: dict[str, int] = {}
        checks: list[tuple[str, Any, int]] = []
        for where, dim, value in pairs:
            if isinstance(dim, tirx.Var):
                name = dim.name
                if name in given and given[name] != value:
                    raise ValueError(
                        f"{where}: dim {name!r} = {value} but it is {given[name]} elsewhere"
                    )
                given[name] = value
            else:
                checks.append((where, dim, value))
        env = self._resolve_bindings(given)
        for where, dim, value in checks:
            expr = self._canon(SymbolicExpr.from_prim_expr(dim).expr)
            try:
                expected = evaluate_sympy(expr, env)
            except (ValueError, ZeroDivisionError):
                continue  # not determined by the parameters alone
            if expected != value:
                raise ValueError(
                    f"{where}: expected {SymbolicExpr(expr)} = {expected}, got {value}"
                )
        return self._all_values(env)


def _match_shape(where: str, ty: Any, shape: Any, pairs: list[tuple[str, Any, int]]) -> None:
    from tvm import relax

    if isinstance(ty, relax.TupleType):
        if len(shape) != len(ty.fields):
            raise ValueError(f"{where}: expected a tuple of {len(ty.fields)} shapes, got {shape}")
        for i, (f, s) in enumerate(zip(ty.fields, shape)):
            if s is not None:
                _match_shape(f"{where}[{i}]", f, s, pairs)
        return
    values = shape_values(ty)
    if values is None:
        ndim = getattr(ty, "ndim", -1)
        if ndim is not None and ndim >= 0 and len(shape) != ndim:
            raise ValueError(f"{where}: expected rank {ndim}, got shape {tuple(shape)}")
        return
    if len(values) != len(shape):
        raise ValueError(
            f"{where}: expected rank {len(values)} ({[str(v) for v in values]}), "
            f"got shape {tuple(shape)}"
        )
    for i, (dim, value) in enumerate(zip(values, shape)):
        pairs.append((f"{where} dim {i}", dim, int(value)))

"""The global symbolic shape graph of one Relax function.

``ShapeGraph.from_function(func)`` collects every symbolic dim of the parameters and of every
binding's type (``var.ty``), learns equalities across the whole function with a union-find, and
reads the value ranges of the dims from the function attributes. It reads the IR and never
changes it; it may run on a function at any stage (high-level ops, after lowering, after memory
planning), on well-formed functions whose bindings are normalized (every var has a ``ty``).

Equalities learned (each one sound: it holds whenever the function runs without error):

* ``match_cast``: the pattern type against the value's type, position by position (tensors,
  shapes, tuples). A new dim defined by a match_cast against an expression of earlier dims
  (``m`` in ``match_cast(x: (b * s, 64), (m, 64))``) is eliminated: ``m := b * s``.
* shared dims of operators: the reduction dim of ``matmul``; the non-axis dims of ``concat``;
  aligned dims of elementwise binary ops when both are proven ``>= 2`` (a dim of 1 could
  broadcast).
* any equality ``x == e`` where ``e`` is linear in a dim with a unit coefficient is solved for it.

Value ranges: ``tir_var_lower_bound`` / ``tir_var_upper_bound`` (dicts name -> int);
``tir_non_negative_var`` (names) lowers the default to 0; otherwise every dim is ``>= 1`` and
unbounded above. Dims proven equal share the intersection of their ranges. A dim eliminated in
favour of an expression keeps its declared range for ``evaluate`` checks only; ``compare`` does
not use it (ignoring a constraint only makes proofs harder, never wrong).

Canonical form: every dim is replaced by its class representative (the first dim of the class
met in the function: parameters first, then bindings in order), or by the expression it equals.
"""

from __future__ import annotations

import copy
import math
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import sympy

from .compare import BoundEngine, Ordering
from .concrete import ConcreteValues
from .dim import (
    DEFAULT_LOWER,
    SymbolicDim,
    dim_symbol,
    format_range,
    is_unknown_symbol,
    symbol_default_range,
    unknown_symbol,
)
from .expr import SymbolicExpr, _to_sympy
from .relax_ir import (
    bindings_in_order,
    element_bits,
    read_bound_attrs,
    shape_values,
    type_of,
)

_LATTICE = (sympy.Max, sympy.Min)
# Top-level Max/Min with at most this many arguments in all also go to the difference engine
# when the decomposition proves nothing (it knows, e.g., Max(s, t) * 2 >= s + t).
_SMALL_LATTICE = 8
# Argument comparisons allowed per decomposition of a top-level Max/Min.
_LATTICE_BUDGET = 20000
# (a >= b, a <= b) of a relation: 2 strict, 1 non-strict, 0 not proven.
_GE_LE = {
    Ordering.GT: (2, 0),
    Ordering.GE: (1, 0),
    Ordering.EQ: (1, 1),
    Ordering.LE: (0, 1),
    Ordering.LT: (0, 2),
    Ordering.UNKNOWN: (0, 0),
}

_ELEMENTWISE_BINARY = frozenset(
    f"relax.{name}"
    for name in (
        "add",
        "subtract",
        "multiply",
        "divide",
        "floor_divide",
        "power",
        "maximum",
        "minimum",
        "equal",
        "not_equal",
        "less",
        "less_equal",
        "greater",
        "greater_equal",
        "logical_and",
        "logical_or",
        "logical_xor",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "mod",
        "floor_mod",
    )
)


class ShapeGraph(ConcreteValues):
    """The symbolic dims of one function, their ranges and the equalities between them.

    Build it with :meth:`from_function` or :meth:`from_ranges`. Queries (``canonical``,
    ``compare``, ``bytes_of``) are cached; the graph is not meant to change after construction
    (``add_equality`` clears the caches). The queries at concrete values of the dims
    (``evaluate``, ``bind_arguments``, sample points and grids) are those of
    :class:`~blade_relax.symbolic.concrete.ConcreteValues`.
    """

    def __init__(self) -> None:
        self._order: list[str] = []  # dims in the order first met
        self._declared: dict[str, tuple[int | None, int | None]] = {}
        self._parent: dict[str, str] = {}
        self._definition: dict[str, sympy.Expr] = {}  # root -> expression over other roots
        self._unresolved: list[tuple[SymbolicExpr, SymbolicExpr]] = []
        self._params: list[Any] = []
        self._from_function = False
        self._dirty = True
        self._subst: dict[sympy.Symbol, sympy.Expr] = {}
        self._range_by_symbol: dict[sympy.Symbol, tuple[int | None, int | None]] = {}
        self._symbol_of: dict[str, sympy.Symbol] = {}
        self._canon_cache: dict[sympy.Expr, sympy.Expr] = {}
        self._compare_cache: dict[tuple[sympy.Expr, sympy.Expr], Ordering] = {}
        self._sample_cache: dict[sympy.Expr, tuple[int, ...] | None] = {}
        self._sample_points: list[dict[str, int]] | None = None
        self._engine = BoundEngine(self._range_of_symbol)
        self._dims_cache: dict[str, SymbolicDim] | None = None
        self._bind_cache: dict[tuple, dict[str, int]] = {}
        self._attr_lower: dict[str, int] = {}
        self._attr_upper: dict[str, int] = {}
        self._attr_nonneg: set[str] = set()
        self._binding_index = -1  # binding being collected (-1: parameters)
        self._first_seen: dict[str, int] = {}

    # ================================================================== construction
    @staticmethod
    def from_ranges(ranges: Mapping[str, tuple[int | None, int | None]]) -> ShapeGraph:
        """A synthetic graph: dims with the given ``(lower, upper)`` ranges, no equalities.

        ``None`` as lower means the default (1); ``None`` as upper means unbounded.
        """
        graph = ShapeGraph()
        for name, (lo, hi) in ranges.items():
            graph._add_dim(name, DEFAULT_LOWER if lo is None else int(lo), hi)
        return graph

    @staticmethod
    def from_function(func: Any) -> ShapeGraph:
        """Build the global symbolic shape graph of a ``relax.Function``."""
        from tvm import relax

        if not isinstance(func, relax.Function):
            raise TypeError(f"ShapeGraph.from_function expects a relax.Function, got {type(func)}")
        graph = ShapeGraph()
        graph._from_function = True
        lower, upper, nonneg = read_bound_attrs(func)
        graph._attr_lower, graph._attr_upper, graph._attr_nonneg = lower, upper, nonneg
        graph._params = list(func.params)
        for p in func.params:
            graph._collect_type(type_of(p))
        # Bindings: collect dims first (in order), then learn equalities, so every dim has a
        # declared range before it is unified.
        bindings = list(bindings_in_order(func.body, in_branch=False))
        for index, (b, _) in enumerate(bindings):
            graph._binding_index = index
            graph._collect_type(type_of(b.var))
            if isinstance(b, relax.MatchCast):
                graph._collect_type(b.ty)
        graph._binding_index = len(bindings)
        ret = type_of(func.body)
        if ret is not None:
            graph._collect_type(ret)
        try:
            free = list(relax.analysis.defined_symbolic_vars(func)) + list(
                relax.analysis.free_symbolic_vars(func)
            )
        except Exception:  # analysis helpers may reject unusual functions; types suffice
            free = []
        for v in free:
            graph._touch_var(v)
        for index, (b, in_branch) in enumerate(bindings):
            try:
                graph._learn_binding(b, index if in_branch else None)
            except Exception as err:  # learning is best effort: unsupported IR passes through
                warnings.warn(
                    f"blade_relax.symbolic: could not read binding {b.var.name}: {err}",
                    UserWarning,
                    stacklevel=2,
                )
        return graph

    def _add_dim(self, name: str, lower: int | None, upper: int | None) -> None:
        if name in self._declared:
            return
        if upper is not None and lower is not None and upper < lower:
            raise ValueError(f"dim {name!r}: empty range {format_range(lower, upper)}")
        self._order.append(name)
        self._first_seen[name] = self._binding_index
        self._declared[name] = (lower, upper)
        self._parent[name] = name
        self._dirty = True

    def _touch_var(self, var: Any) -> None:
        name = var.name
        if name in self._declared:
            return
        dtype = str(getattr(var, "ty", None) or getattr(var, "dtype", "int64"))
        if not dtype.startswith(("int", "uint")):
            # A scalar parameter of another type (``R.Prim("float32")``, which TVM lists among
            # the function's symbolic variables) is a value, not a dim: no shape depends on it.
            return
        lower = self._attr_lower.get(name)
        if lower is None:
            lower = 0 if name in self._attr_nonneg else DEFAULT_LOWER
        self._add_dim(name, lower, self._attr_upper.get(name))

    def _collect_type(self, ty: Any) -> None:
        for value in shape_values(ty, nested=True):
            self._collect_prim(value)

    def _collect_prim(self, value: Any) -> None:
        from tvm import tirx

        if isinstance(value, tirx.Var):
            self._touch_var(value)
            return
        if isinstance(value, tirx.IntImm) or isinstance(value, int):
            return
        try:
            vars_ = tirx.analysis.undefined_vars(value)
        except Exception:
            vars_ = []
        for v in vars_:
            self._touch_var(v)

    # ================================================================== learning
    def _learn_binding(self, b: Any, branch_index: int | None) -> None:
        """Learn from one binding; ``branch_index`` is set for bindings inside an If branch.

        A branch may not run, so inside one only the dims that this very binding introduces
        (first met at ``branch_index``) are defined; equalities between older dims are skipped.
        """
        from tvm import relax, tirx

        if isinstance(b, relax.MatchCast):
            if branch_index is None:
                self._learn_types(type_of(b.value), b.ty)
                self._learn_types(type_of(b.value), type_of(b.var))
                return
            va, vp = shape_values(type_of(b.value)), shape_values(b.ty)
            if va is not None and vp is not None and len(va) == len(vp):
                for x, y in zip(va, vp):
                    if isinstance(y, tirx.Var) and self._first_seen.get(y.name) == branch_index:
                        self._learn_prim_equal(x, y)
            return
        if branch_index is not None:
            return
        value = b.value
        if isinstance(value, relax.Call) and hasattr(value.op, "name"):
            self._learn_call(value)

    def _learn_types(self, actual: Any, pattern: Any) -> None:
        from tvm import relax

        if actual is None or pattern is None:
            return
        if isinstance(actual, relax.TupleType) and isinstance(pattern, relax.TupleType):
            for a, p in zip(actual.fields, pattern.fields):
                self._learn_types(a, p)
            return
        va = shape_values(actual)
        vp = shape_values(pattern)
        if va is None or vp is None or len(va) != len(vp):
            return
        for x, y in zip(va, vp):
            self._learn_prim_equal(x, y)

    def _learn_call(self, call: Any) -> None:
        from tvm import relax

        name = call.op.name
        if name == "relax.matmul" and len(call.args) >= 2:
            sa, sb = shape_values(type_of(call.args[0])), shape_values(type_of(call.args[1]))
            if sa and sb:
                # The reduction dim must match exactly (no broadcasting on it).
                k_b = sb[0] if len(sb) == 1 else sb[-2]
                self._learn_prim_equal(sa[-1], k_b)
                self._learn_broadcast(sa[:-2], sb[:-2])
        elif name in _ELEMENTWISE_BINARY and len(call.args) >= 2:
            sa, sb = shape_values(type_of(call.args[0])), shape_values(type_of(call.args[1]))
            if sa is not None and sb is not None:
                self._learn_broadcast(sa, sb)
        elif name == "relax.concat" and call.args and isinstance(call.args[0], relax.Tuple):
            axis = getattr(call.attrs, "axis", None)
            if axis is None:
                return
            shapes = [shape_values(type_of(f)) for f in call.args[0].fields]
            if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
                return
            ndim = len(shapes[0])
            axis = int(axis) % ndim if ndim else 0
            for other in shapes[1:]:
                for i in range(ndim):
                    if i != axis:
                        self._learn_prim_equal(shapes[0][i], other[i])

    def _learn_broadcast(self, sa: Sequence[Any], sb: Sequence[Any]) -> None:
        # Aligned from the right; two dims broadcast against each other are equal when neither
        # can be 1, i.e. both are proven >= 2.
        for x, y in zip(reversed(list(sa)), reversed(list(sb))):
            ex = self._canon(_to_sympy(SymbolicExpr.from_prim_expr(x)))
            ey = self._canon(_to_sympy(SymbolicExpr.from_prim_expr(y)))
            if ex == ey:
                continue
            if self._engine.lower(ex) >= 2 and self._engine.lower(ey) >= 2:
                self._learn_equal(ex, ey)

    def _learn_prim_equal(self, x: Any, y: Any) -> None:
        self._learn_equal(SymbolicExpr.from_prim_expr(x).expr, SymbolicExpr.from_prim_expr(y).expr)

    def add_equality(self, a: SymbolicExpr | int, b: SymbolicExpr | int) -> None:
        """Record that ``a == b`` for every admissible point (clears the query caches)."""
        self._learn_equal(_to_sympy(a), _to_sympy(b))

    def _learn_equal(self, a: sympy.Expr, b: sympy.Expr) -> None:
        ca, cb = self._canon(a), self._canon(b)
        if ca == cb:
            return
        if any(is_unknown_symbol(s) for s in (ca - cb).free_symbols):
            return  # an opaque value says nothing about the dims
        roots = {self._symbol_of[r]: r for r in self._roots()}
        if ca in roots and cb in roots:
            self._union(roots[ca], roots[cb])
            return
        # Divide out the content: 2*p - 2*s - 2 == 0 is solved as p == s + 1.
        diff = sympy.expand(ca - cb).as_content_primitive()[1]
        if diff.is_Number:
            self._unresolved.append((SymbolicExpr(ca), SymbolicExpr(cb)))
            warnings.warn(
                f"blade_relax.symbolic: contradictory shapes {ca} != {cb}",
                UserWarning,
                stacklevel=3,
            )
            return
        # Solve for the latest-met root dim that appears linearly with a unit coefficient.
        candidates = [s for s in diff.free_symbols if s in roots]
        candidates.sort(key=lambda s: self._order.index(roots[s]), reverse=True)
        for sym in candidates:
            poly = sympy.Poly(diff, sym)
            if poly.degree() != 1:
                continue
            coeff = poly.coeff_monomial(sym)
            if coeff not in (1, -1):
                continue
            rest = diff - coeff * sym
            if rest.has(sym):
                continue
            solution = -rest / coeff
            self._define(roots[sym], solution)
            return
        self._unresolved.append((SymbolicExpr(ca), SymbolicExpr(cb)))

    def _find(self, name: str) -> str:
        root = name
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[name] != root:  # path compression
            self._parent[name], name = root, self._parent[name]
        return root

    def _roots(self) -> list[str]:
        return [n for n in self._order if self._parent[n] == n and n not in self._definition]

    def _union(self, x: str, y: str) -> None:
        rx, ry = self._find(x), self._find(y)
        if rx == ry:
            return
        if self._order.index(ry) < self._order.index(rx):
            rx, ry = ry, rx
        self._parent[ry] = rx
        self._invalidate()

    def _define(self, root: str, expr: sympy.Expr) -> None:
        self._definition[root] = expr
        self._invalidate()

    def _invalidate(self) -> None:
        self._dirty = True
        self._canon_cache.clear()
        self._compare_cache.clear()
        self._sample_cache.clear()
        self._sample_points = None
        self._dims_cache = None
        self._bind_cache.clear()
        self._engine = BoundEngine(self._range_of_symbol)

    # ================================================================== canonical form
    def _rebuild(self) -> None:
        if not self._dirty:
            return
        # Ranges of a class: the intersection of its members' declared ranges.
        class_range: dict[str, tuple[int | None, int | None]] = {}
        for name in self._order:
            root = self._find(name)
            lo, hi = self._declared[name]
            if root in class_range:
                clo, chi = class_range[root]
                lo = clo if lo is None else (lo if clo is None else max(lo, clo))
                hi = chi if hi is None else (hi if chi is None else min(hi, chi))
            class_range[root] = (lo, hi)
        for root, (lo, hi) in class_range.items():
            if lo is not None and hi is not None and hi < lo:
                warnings.warn(
                    f"blade_relax.symbolic: dims {sorted(self._members(root))} are equal but "
                    f"their ranges do not intersect; keeping {root!r}'s own range",
                    UserWarning,
                    stacklevel=3,
                )
                class_range[root] = self._declared[root]
        self._class_range = class_range
        self._symbol_of = {
            name: dim_symbol(name, class_range[self._find(name)][0]) for name in self._order
        }
        self._range_by_symbol = {
            self._symbol_of[r]: class_range[r] for r in class_range if r not in self._definition
        }
        # Resolve every dim to an expression over free roots (definitions may chain).
        resolved: dict[str, sympy.Expr] = {}

        def resolve(name: str, stack: tuple[str, ...] = ()) -> sympy.Expr:
            root = self._find(name)
            if root in resolved:
                return resolved[root]
            if root not in self._definition or root in stack:
                value = self._symbol_of[root]
            else:
                definition = self._definition[root]
                sub = {}
                for s in definition.free_symbols:
                    if s.name in self._parent and not is_unknown_symbol(s):
                        sub[s] = resolve(s.name, stack + (root,))
                value = definition.xreplace(sub)
            resolved[root] = value
            return value

        subst: dict[sympy.Symbol, sympy.Expr] = {}
        for name in self._order:
            value = resolve(name)
            for lower in (1, 0, None):
                sym = dim_symbol(name, lower)
                if sym != value:
                    subst[sym] = value
        self._subst = subst
        self._dirty = False

    def _range_of_symbol(self, sym: sympy.Symbol) -> tuple[int | None, int | None]:
        self._rebuild()
        rng = self._range_by_symbol.get(sym)
        return rng if rng is not None else symbol_default_range(sym)

    def _canon(self, e: sympy.Expr) -> sympy.Expr:
        self._rebuild()
        cached = self._canon_cache.get(e)
        if cached is not None:
            return cached
        subst = self._subst
        if subst and any(s in subst for s in e.free_symbols):
            out = e.xreplace(subst)
        else:
            out = e
        self._canon_cache[e] = out
        return out

    def _members(self, root: str) -> list[str]:
        return [n for n in self._order if self._find(n) == root]

    # ================================================================== public queries
    @property
    def dims(self) -> Mapping[str, SymbolicDim]:
        """Every symbolic dim, by name, with its class range and equivalence class."""
        self._rebuild()
        if self._dims_cache is None:
            out: dict[str, SymbolicDim] = {}
            for name in self._order:
                root = self._find(name)
                lo, hi = self._class_range[root]
                out[name] = SymbolicDim(
                    name=name,
                    lower=lo if lo is not None else -(2**63),
                    upper=hi,
                    symbol=self._symbol_of[name],
                    eq_class=frozenset(self._members(root)),
                )
            self._dims_cache = out
        return self._dims_cache

    @property
    def unresolved_equalities(self) -> list[tuple[SymbolicExpr, SymbolicExpr]]:
        """Equalities met in the function that could not be solved for a dim (kept for info)."""
        return list(self._unresolved)

    def representative(self, name: str) -> SymbolicExpr:
        """The canonical expression the dim ``name`` stands for."""
        if name not in self._parent:
            raise KeyError(f"no dim {name!r} in this graph (dims: {sorted(self._parent)})")
        self._rebuild()
        return SymbolicExpr(self._canon(self._symbol_of[name]))

    def canonical(self, expr: SymbolicExpr | int | Any) -> SymbolicExpr:
        """``expr`` with every dim replaced by its class representative (or its definition)."""
        e = _to_sympy(expr)
        out = self._canon(e)
        if isinstance(expr, SymbolicExpr) and out is e:
            return expr
        return SymbolicExpr(out)

    def compare(self, a: SymbolicExpr | int | Any, b: SymbolicExpr | int | Any) -> Ordering:
        """The relation of ``a`` to ``b`` proven for every admissible value of the dims.

        Returns UNKNOWN whenever no relation is proven (see :mod:`.compare` for the method).
        """
        ca = self._canon(_to_sympy(a))
        cb = self._canon(_to_sympy(b))
        if ca == cb:
            return Ordering.EQ
        key = (ca, cb)
        cached = self._compare_cache.get(key)
        if cached is not None:
            return cached
        if ca.is_Integer and cb.is_Integer:
            result = Ordering.GT if ca > cb else Ordering.LT
        elif isinstance(ca, _LATTICE) or isinstance(cb, _LATTICE):
            result = self._compare_lattice(ca, cb)
        else:
            result = self._engine.order_of(ca, cb)
        self._compare_cache[key] = result
        self._compare_cache[(cb, ca)] = result.reverse()
        return result

    def _compare_lattice(self, a: sympy.Expr, b: sympy.Expr) -> Ordering:
        # A top-level Max/Min is decomposed into comparisons of its arguments (each cached),
        # which stays linear in the arguments where the difference engine would split cases.
        ge, le = self._ge(a, b), self._ge(b, a)
        decided = (ge and le) or ge == 2 or le == 2
        if not decided and (
            sum(len(x.args) for x in (a, b) if isinstance(x, _LATTICE)) <= _SMALL_LATTICE
        ):
            # Small ones also go through the difference engine; both answers are sound.
            eng_ge, eng_le = _GE_LE[self._engine.order_of(a, b)]
            ge, le = max(ge, eng_ge), max(le, eng_le)
        if ge and le:
            return Ordering.EQ
        if ge:
            return Ordering.GT if ge == 2 else Ordering.GE
        if le:
            return Ordering.LT if le == 2 else Ordering.LE
        return Ordering.UNKNOWN

    def _ge(self, a: sympy.Expr, b: sympy.Expr, budget: list[int] | None = None) -> int:
        """2 if ``a > b`` is proven, 1 if ``a >= b``, 0 if neither.

        ``budget`` caps the argument comparisons of one decomposition (two Max of thousands of
        terms would need millions): past it the answer is 0, never a guess.
        """
        if budget is None:
            budget = [_LATTICE_BUDGET]
        if isinstance(b, sympy.Max) or isinstance(a, sympy.Min):
            # a >= Max(B) iff a >= every b_i; Min(A) >= b iff every a_i >= b.
            pairs = (
                ((a, x) for x in b.args) if isinstance(b, sympy.Max) else ((x, b) for x in a.args)
            )
            worst = 2
            for x, y in pairs:
                worst = min(worst, self._ge(x, y, budget))
                if not worst:
                    return 0
            return worst
        if isinstance(a, sympy.Max) or isinstance(b, sympy.Min):
            # Max(A) >= b if some a_i >= b; a >= Min(B) if a >= some b_i.
            pairs = (
                ((x, b) for x in a.args) if isinstance(a, sympy.Max) else ((a, x) for x in b.args)
            )
            best = 0
            for x, y in pairs:
                best = max(best, self._ge(x, y, budget))
                if best == 2:
                    return 2
            return best
        budget[0] -= 1
        if budget[0] < 0:
            return 0
        rel = self.compare(SymbolicExpr(a), SymbolicExpr(b))
        return 2 if rel is Ordering.GT else (1 if rel.holds_ge else 0)

    def lower_bound(self, expr: SymbolicExpr | int) -> int | None:
        """A proven lower bound of ``expr`` (rounded up to an integer), None if unbounded."""
        lb = self._engine.lower(self._canon(_to_sympy(expr)))
        return None if lb == float("-inf") else math.ceil(lb)

    def upper_bound(self, expr: SymbolicExpr | int) -> int | None:
        """A proven upper bound of ``expr`` (rounded down to an integer), None if unbounded."""
        ub = self._engine.upper(self._canon(_to_sympy(expr)))
        return None if ub == float("inf") else math.floor(ub)

    def bytes_of(self, value: Any) -> SymbolicExpr:
        """Bytes of a Relax value from its type (a Var / Expr, a TensorType, a TupleType...).

        Tensors: product of the shape times the element bytes (:func:`element_bits` / 8); tuples:
        the sum of their fields; shapes, prim values, objects and functions: 0. A tensor of
        unknown shape, rank or dtype gives an UNKNOWN expression (one per value).
        """
        from tvm import ir, relax

        if isinstance(value, relax.Expr):
            ty = type_of(value)
            key = getattr(value, "name", None) or f"expr{value.__hash__()}"
            if ty is None:
                return SymbolicExpr(unknown_symbol(f"bytes_of_{key}"))
            return self._bytes_of_type(ty, f"bytes_of_{key}")
        if isinstance(value, ir.Type):
            return self._bytes_of_type(
                value, f"bytes_of_type_{zlib.crc32(str(value).encode()):08x}"
            )
        raise TypeError(f"bytes_of expects a relax.Expr or a type, got {type(value).__name__}")

    def _bytes_of_type(self, ty: Any, key: str) -> SymbolicExpr:
        from tvm import relax

        if isinstance(ty, relax.TupleType):
            total = sympy.Integer(0)
            for i, field in enumerate(ty.fields):
                total = total + self._bytes_of_type(field, f"{key}_{i}").expr
            return SymbolicExpr(total)
        if not isinstance(ty, relax.TensorType):
            return SymbolicExpr.constant(0)
        bits = element_bits(None if ty.dtype is None else str(ty.dtype))
        values = shape_values(ty)
        if bits is None or values is None:
            return SymbolicExpr(unknown_symbol(key))
        numel = sympy.Integer(1)
        for v in values:
            numel = numel * SymbolicExpr.from_prim_expr(v).expr
        # Sub-byte elements are packed, the total rounded up to whole bytes.
        size = numel * (bits // 8) if bits % 8 == 0 else sympy.ceiling(numel * bits / 8)
        return SymbolicExpr(self._canon(size))

    def with_lower_bounds(self, lower: Mapping[str, int]) -> ShapeGraph:
        """A copy of the graph whose dims named in ``lower`` are at least the given values
        (their other bounds and every equality kept): for proofs over part of a range."""
        out = copy.copy(self)
        out._order = list(self._order)
        out._declared = dict(self._declared)
        out._parent = dict(self._parent)
        out._definition = dict(self._definition)
        out._unresolved = list(self._unresolved)
        out._first_seen = dict(self._first_seen)
        out._attr_lower = dict(self._attr_lower)
        out._attr_upper = dict(self._attr_upper)
        out._attr_nonneg = set(self._attr_nonneg)
        # Fresh caches: _invalidate clears them in place, and these are the original's.
        out._canon_cache, out._compare_cache, out._sample_cache = {}, {}, {}
        out._bind_cache = {}
        for name, value in lower.items():
            if name not in out._declared:
                raise KeyError(f"no dim {name!r} in the graph")
            lo, hi = out._declared[name]
            if hi is not None and value > hi:
                raise ValueError(f"dim {name!r}: lower bound {value} above its upper bound {hi}")
            out._declared[name] = (value if lo is None else max(lo, value), hi)
        out._invalidate()
        return out

    def __repr__(self) -> str:
        parts = []
        for name, d in self.dims.items():
            rep = self.representative(name)
            eq = "" if str(rep) == name else f" = {rep}"
            parts.append(f"{name}{eq} in {d.range_str}")
        return f"ShapeGraph({', '.join(parts)})"


class TypeSizes:
    """:meth:`ShapeGraph.bytes_of` of Relax types, remembered per type.

    A function's values share a handful of types, and each size is a sympy product that the
    graph canonicalizes: passes that read sizes value by value (the schedule's block model,
    the memory timeline's effects) read each type's once. Free dims compare by identity, so
    structurally equal types have equal sizes. An unknown size is not remembered: each value
    keeps its own opaque size, named after it.
    """

    def __init__(self, graph: ShapeGraph) -> None:
        self.graph = graph
        # structural hash -> (type, bytes) of the types met with that hash.
        self._known: dict[int, list[tuple[Any, SymbolicExpr]]] = {}

    def bytes_of(self, ty: Any, value: Any = None) -> SymbolicExpr:
        """The bytes of type ``ty``; where they are unknown, ``graph.bytes_of(value)`` (the
        opaque size of that value), or the type's own opaque size without ``value``."""
        import tvm_ffi

        key = tvm_ffi.structural_hash(ty)
        for known, nbytes in self._known.get(key, ()):
            if tvm_ffi.structural_equal(known, ty):
                return nbytes
        nbytes = self.graph.bytes_of(ty)
        if nbytes.is_unknown:
            return self.graph.bytes_of(value) if value is not None else nbytes
        self._known.setdefault(key, []).append((ty, nbytes))
        return nbytes

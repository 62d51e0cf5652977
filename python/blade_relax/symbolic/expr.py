"""Symbolic expressions over dims: an immutable wrapper of a sympy expression.

``SymbolicExpr.from_prim_expr`` converts a tirx PrimExpr (Var, IntImm, Add, Sub, Mul, FloorDiv,
FloorMod, Min, Max, Cast, Select and the comparisons / logic a Select condition needs). Any other
node becomes an opaque UNKNOWN symbol, with one warning per conversion naming the node types;
conversion never raises on unsupported IR.

Mapping to sympy: FloorDiv -> ``floor(a / b)``, FloorMod -> ``Mod(a, b)`` (sympy's Mod has the
sign of the divisor, as floormod), Min/Max -> ``Min``/``Max``, Select -> ``Piecewise``.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any, Union

import sympy

from .dim import UNKNOWN_PREFIX, dim_symbol, is_unknown_symbol, unknown_symbol

ExprLike = Union["SymbolicExpr", int, sympy.Expr]


class SymbolicExpr:
    """An immutable integer expression over dim symbols (a sympy expression).

    Equality (``==``) and hashing are structural, on the sympy expression; use
    :meth:`ShapeGraph.compare` for a proven relation between two expressions.
    """

    __slots__ = ("_expr",)

    def __init__(self, expr: ExprLike) -> None:
        object.__setattr__(self, "_expr", _to_sympy(expr))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SymbolicExpr is immutable")

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def constant(value: int) -> SymbolicExpr:
        """The constant ``value``."""
        return SymbolicExpr(sympy.Integer(int(value)))

    @staticmethod
    def dim(name: str, lower: int | None = 1) -> SymbolicExpr:
        """The dim ``name`` alone (its symbol carries the assumptions of ``lower``)."""
        return SymbolicExpr(dim_symbol(name, lower))

    @staticmethod
    def unknown(key: str) -> SymbolicExpr:
        """An opaque UNKNOWN value identified by ``key`` (same key, same value)."""
        return SymbolicExpr(unknown_symbol(key))

    @staticmethod
    def max(*xs: ExprLike | Iterable[ExprLike]) -> SymbolicExpr:
        """The maximum of the arguments (or of one iterable argument).

        Duplicates and all constants but the largest are dropped; sympy's own Max evaluation
        (which compares all pairs under assumptions) is skipped, so a max of thousands of terms
        stays cheap.
        """
        return SymbolicExpr(_lattice(sympy.Max, xs))

    @staticmethod
    def min(*xs: ExprLike | Iterable[ExprLike]) -> SymbolicExpr:
        """The minimum of the arguments (or of one iterable argument); see :meth:`max`."""
        return SymbolicExpr(_lattice(sympy.Min, xs))

    @staticmethod
    def from_prim_expr(value: Any) -> SymbolicExpr:
        """Convert a tirx PrimExpr (or a Python int) to a SymbolicExpr.

        Unsupported nodes become opaque UNKNOWN symbols (one per distinct sub-expression) and
        one ``UserWarning`` names their node types.
        """
        return SymbolicExpr(prim_expr_to_sympy(value))

    # ------------------------------------------------------------------ properties
    @property
    def expr(self) -> sympy.Expr:
        """The wrapped sympy expression."""
        return self._expr

    @property
    def dim_names(self) -> frozenset[str]:
        """Names of the dims the expression depends on (UNKNOWN symbols excluded)."""
        return frozenset(
            s.name
            for s in self._expr.free_symbols
            if isinstance(s, sympy.Symbol) and not is_unknown_symbol(s)
        )

    @property
    def is_constant(self) -> bool:
        """Whether the expression is an integer constant."""
        return bool(self._expr.is_Integer)

    @property
    def is_unknown(self) -> bool:
        """Whether the expression contains an opaque UNKNOWN symbol."""
        return any(is_unknown_symbol(s) for s in self._expr.free_symbols)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, bindings: Mapping[str, int]) -> int:
        """Evaluate with concrete dims (no range checks; see ``ShapeGraph.evaluate``).

        Raises
        ------
        ValueError
            If a dim is missing from ``bindings``, the expression is UNKNOWN, or the value is
            not an integer.
        """
        return evaluate_sympy(self._expr, bindings)

    def __int__(self) -> int:
        if not self._expr.is_Integer:
            raise ValueError(f"SymbolicExpr {self} is not a constant")
        return int(self._expr)

    # ------------------------------------------------------------------ arithmetic
    def __add__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(self._expr + _to_sympy(other))

    def __radd__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(_to_sympy(other) + self._expr)

    def __sub__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(self._expr - _to_sympy(other))

    def __rsub__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(_to_sympy(other) - self._expr)

    def __mul__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(self._expr * _to_sympy(other))

    def __rmul__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(_to_sympy(other) * self._expr)

    def __neg__(self) -> SymbolicExpr:
        return SymbolicExpr(-self._expr)

    def __floordiv__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(sympy.floor(self._expr / _to_sympy(other)))

    def __mod__(self, other: ExprLike) -> SymbolicExpr:
        return SymbolicExpr(floor_mod(self._expr, _to_sympy(other)))

    # ------------------------------------------------------------------ identity
    def __eq__(self, other: object) -> bool:
        if isinstance(other, SymbolicExpr):
            return self._expr == other._expr
        if isinstance(other, int):
            return self._expr == sympy.Integer(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expr)

    def __repr__(self) -> str:
        return f"SymbolicExpr({self})"

    def __str__(self) -> str:
        return str(self._expr).replace(UNKNOWN_PREFIX, "?")

    def __reduce__(self):
        # Pickling: sympy rebuilds every node by calling its class on its arguments, which
        # evaluates it again: a Max of many terms compares them all pairwise (seconds for the
        # peak of a large block). The nodes are rebuilt unevaluated instead, as they were.
        return (_unpickle, (_postorder(self._expr),))


# Classes whose nodes are rebuilt from their arguments without evaluation when unpickled.
_UNEVALUATED = (sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min)


def _postorder(expr: sympy.Basic) -> list:
    """``expr`` as a postorder list: atoms as they are, every other node as ``(class,
    number of arguments)`` after its arguments."""
    out: list = []
    stack: list[tuple[sympy.Basic, bool]] = [(expr, False)]
    while stack:
        node, visited = stack.pop()
        if node.is_Atom:
            out.append(node)
        elif visited:
            out.append((node.func, len(node.args)))
        else:
            stack.append((node, True))
            stack.extend((arg, False) for arg in reversed(node.args))
    return out


def _unpickle(nodes: list) -> SymbolicExpr:
    """The :class:`SymbolicExpr` of a :func:`_postorder` list: nodes of the classes in
    ``_UNEVALUATED`` are built from their arguments as they were (already canonical), the
    others by their class."""
    values: list[sympy.Basic] = []
    for node in nodes:
        if isinstance(node, tuple):
            func, count = node
            args = values[len(values) - count :]
            del values[len(values) - count :]
            if issubclass(func, _UNEVALUATED):
                values.append(func(*args, evaluate=False))
            else:
                values.append(func(*args))
        else:
            values.append(node)
    return SymbolicExpr(values[0])


def _to_sympy(value: ExprLike) -> sympy.Expr:
    if isinstance(value, SymbolicExpr):
        return value._expr
    if isinstance(value, bool):
        return sympy.Integer(int(value))
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, sympy.Basic):
        return value
    # A tirx PrimExpr (or anything convertible): go through the converter.
    return prim_expr_to_sympy(value)


def _lattice(op: type, xs: tuple) -> sympy.Expr:
    if len(xs) == 1 and not isinstance(xs[0], (SymbolicExpr, int, sympy.Basic)):
        xs = tuple(xs[0])
    if not xs:
        raise ValueError(f"SymbolicExpr.{op.__name__.lower()} needs at least one argument")
    pick = max if op is sympy.Max else min
    args: set[sympy.Expr] = set()
    best_const: sympy.Integer | None = None
    for x in xs:
        e = _to_sympy(x)
        # Flatten nested lattices of the same kind: Max(Max(a, b), c) == Max(a, b, c).
        for a in e.args if isinstance(e, op) else (e,):
            if a.is_Integer:
                best_const = a if best_const is None else pick(best_const, a)
            else:
                args.add(a)
    if best_const is not None:
        args.add(best_const)
    if len(args) == 1:
        return next(iter(args))
    return op(*sorted(args, key=sympy.default_sort_key), evaluate=False)


# ---------------------------------------------------------------------- PrimExpr -> sympy


def prim_expr_to_sympy(value: Any) -> sympy.Expr:
    """Convert a tirx PrimExpr (or int) to sympy; see the module docstring for the mapping."""
    if isinstance(value, bool):
        return sympy.Integer(int(value))
    if isinstance(value, int):
        return sympy.Integer(value)
    unsupported: dict[str, None] = {}
    result = _convert(value, unsupported)
    if unsupported:
        warnings.warn(
            "blade_relax.symbolic: unsupported PrimExpr node type(s) "
            f"{', '.join(unsupported)} in {_short(value)}; treated as an opaque UNKNOWN value",
            UserWarning,
            stacklevel=3,
        )
    return result


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."


def floor_mod(p: sympy.Expr, q: sympy.Expr) -> sympy.Expr:
    """``Mod(p, q)`` (floormod: the sign of ``q``), safe from a sympy bug.

    sympy (1.14) evaluates ``Mod(a*Mod(b, r), q)`` with an integer ``q != r`` to
    ``Mod(a*Mod(b, r)**2, q)``: ``Mod.eval`` counts the inner remainder twice (for
    ``n*(n % -2) % 3`` at ``n = 1`` it gives 1 instead of 2). Remainders by another modulus
    inside ``p`` are first written ``b - r*floor(b/r)``, the same value, which ``Mod`` leaves
    alone; remainders by ``q`` itself are left to sympy, which folds them correctly.
    """
    if q.is_Integer and p.has(sympy.Mod):
        p = p.replace(
            lambda e: isinstance(e, sympy.Mod) and e.args[1] != q,
            lambda e: e.args[0] - e.args[1] * sympy.floor(e.args[0] / e.args[1]),
        )
    return sympy.Mod(p, q)


def _convert(node: Any, unsupported: dict[str, None]) -> sympy.Expr:
    from tvm import tirx  # local import: keeps `import blade_relax.symbolic` light

    if isinstance(node, bool):
        return sympy.Integer(int(node))
    if isinstance(node, int):
        return sympy.Integer(node)
    if isinstance(node, tirx.IntImm):
        return sympy.Integer(int(node.value))
    if isinstance(node, tirx.Var):
        if dtype_kind(node) in ("int", "uint", "bool"):
            return dim_symbol(node.name)
        return _opaque(node, unsupported, f"Var of type {node.ty}")
    if isinstance(node, tirx.Add):
        return _convert(node.a, unsupported) + _convert(node.b, unsupported)
    if isinstance(node, tirx.Sub):
        return _convert(node.a, unsupported) - _convert(node.b, unsupported)
    if isinstance(node, tirx.Mul):
        return _convert(node.a, unsupported) * _convert(node.b, unsupported)
    if isinstance(node, tirx.FloorDiv):
        b = _convert(node.b, unsupported)
        if b == 0:
            return _opaque(node, unsupported, "FloorDiv by zero")
        return sympy.floor(_convert(node.a, unsupported) / b)
    if isinstance(node, tirx.FloorMod):
        b = _convert(node.b, unsupported)
        if b == 0:
            return _opaque(node, unsupported, "FloorMod by zero")
        return floor_mod(_convert(node.a, unsupported), b)
    if isinstance(node, tirx.Min):
        return sympy.Min(_convert(node.a, unsupported), _convert(node.b, unsupported))
    if isinstance(node, tirx.Max):
        return sympy.Max(_convert(node.a, unsupported), _convert(node.b, unsupported))
    if isinstance(node, tirx.Cast):
        # Integer <-> integer casts of shape values keep the value (shapes never overflow
        # int32 in practice); a cast to or from floats is not a shape computation.
        if dtype_kind(node) in ("int", "uint") and dtype_kind(node.value) in (
            "int",
            "uint",
            "bool",
        ):
            return _convert(node.value, unsupported)
        if dtype_kind(node) == "bool":
            inner = _convert(node.value, unsupported)
            return sympy.Piecewise((sympy.Integer(0), sympy.Eq(inner, 0)), (sympy.Integer(1), True))
        return _opaque(node, unsupported, f"Cast to {node.ty}")
    if isinstance(node, tirx.Select):
        cond = _convert_cond(node.condition, unsupported)
        if cond is None:
            return _opaque(node, unsupported, "Select with an unsupported condition")
        t = _convert(node.true_value, unsupported)
        f = _convert(node.false_value, unsupported)
        return sympy.Piecewise((t, cond), (f, True))
    return _opaque(node, unsupported, type(node).__name__)


def _convert_cond(node: Any, unsupported: dict[str, None]) -> sympy.Basic | None:
    from tvm import tirx

    if isinstance(node, tirx.IntImm):
        return sympy.true if int(node.value) else sympy.false
    relations = {
        tirx.LT: sympy.Lt,
        tirx.LE: sympy.Le,
        tirx.GT: sympy.Gt,
        tirx.GE: sympy.Ge,
        tirx.EQ: sympy.Eq,
        tirx.NE: sympy.Ne,
    }
    for cls, rel in relations.items():
        if isinstance(node, cls):
            return rel(_convert(node.a, unsupported), _convert(node.b, unsupported))
    if isinstance(node, (tirx.And, tirx.Or)):
        a = _convert_cond(node.a, unsupported)
        b = _convert_cond(node.b, unsupported)
        if a is None or b is None:
            return None
        return sympy.And(a, b) if isinstance(node, tirx.And) else sympy.Or(a, b)
    if isinstance(node, tirx.Not):
        a = _convert_cond(node.a, unsupported)
        return None if a is None else sympy.Not(a)
    return None


def dtype_kind(node: Any) -> str:
    """``"int"``, ``"uint"``, ``"bool"`` or ``"other"``: the kind of a TIR expression's (or
    variable's) dtype. PrimExprs carry their dtype in ``ty`` (a ``PrimType``) in TVM 0.27."""
    ty = getattr(node, "ty", None)
    text = str(getattr(ty, "dtype", ty))
    if text.startswith("uint"):
        return "uint"
    if text.startswith("int"):
        return "int"
    if text.startswith("bool"):
        return "bool"
    return "other"


def is_integer(node: Any) -> bool:
    """Whether a TIR expression or variable has a signed or unsigned integer dtype (a buffer's
    handle, a float and a bool do not)."""
    return dtype_kind(node) in ("int", "uint")


def _opaque(node: Any, unsupported: dict[str, None], what: str) -> sympy.Expr:
    unsupported[what] = None
    # Same printed expression, same opaque symbol: identical unsupported expressions stay EQ.
    text = str(node)
    key = f"{type(node).__name__}_{zlib.crc32(text.encode()):08x}"
    return unknown_symbol(key)


# ---------------------------------------------------------------------- evaluation


def evaluate_sympy(expr: sympy.Expr, bindings: Mapping[str, int]) -> int:
    """Evaluate ``expr`` exactly with integer dims; raise ValueError when it cannot."""
    value = _eval(expr, bindings)
    if isinstance(value, Fraction):
        if value.denominator != 1:
            raise ValueError(f"{expr} evaluates to the non-integer {value} at {dict(bindings)}")
        return int(value)
    return int(value)


def _eval(e: sympy.Basic, env: Mapping[str, int]) -> int | Fraction | bool:
    # A small exact interpreter: much faster than sympy's subs for the few node kinds we build.
    if e.is_Integer:
        return int(e)
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e.is_Symbol:
        name = e.name
        if name.startswith(UNKNOWN_PREFIX):
            raise ValueError(f"cannot evaluate an UNKNOWN expression ({_short(e)})")
        try:
            return int(env[name])
        except KeyError:
            raise ValueError(f"no value for dim {name!r}") from None
    if e.is_Add:
        return sum((_eval(a, env) for a in e.args), 0)
    if e.is_Mul:
        out: int | Fraction = 1
        for a in e.args:
            out = out * _eval(a, env)
        return out
    if e.is_Pow:
        base = _eval(e.args[0], env)
        exp = _eval(e.args[1], env)
        if not isinstance(exp, int) and not (isinstance(exp, Fraction) and exp.denominator == 1):
            raise ValueError(f"cannot evaluate non-integer power {e}")
        exp = int(exp)
        return Fraction(base) ** exp if exp < 0 else base**exp
    if isinstance(e, sympy.floor):
        return math.floor(_eval(e.args[0], env))
    if isinstance(e, sympy.ceiling):
        return math.ceil(_eval(e.args[0], env))
    if isinstance(e, sympy.Mod):
        a, b = _eval(e.args[0], env), _eval(e.args[1], env)
        if b == 0:
            raise ValueError(f"modulo by zero in {e}")
        return a % b
    if isinstance(e, sympy.Max):
        return max(_eval(a, env) for a in e.args)
    if isinstance(e, sympy.Min):
        return min(_eval(a, env) for a in e.args)
    if isinstance(e, sympy.Piecewise):
        for value, cond in e.args:
            if _eval(cond, env):
                return _eval(value, env)
        raise ValueError(f"no branch of {e} applies")
    if e is sympy.true:
        return True
    if e is sympy.false:
        return False
    if isinstance(e, sympy.core.relational.Relational):
        a, b = _eval(e.lhs, env), _eval(e.rhs, env)
        ops = {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}
        return ops[e.rel_op]
    if isinstance(e, sympy.And):
        return all(_eval(a, env) for a in e.args)
    if isinstance(e, sympy.Or):
        return any(_eval(a, env) for a in e.args)
    if isinstance(e, sympy.Not):
        return not _eval(e.args[0], env)
    if isinstance(e, sympy.ITE):  # sympy folds nested Piecewise conditions into ITE
        return _eval(e.args[1], env) if _eval(e.args[0], env) else _eval(e.args[2], env)
    if isinstance(e, sympy.logic.boolalg.BooleanFunction):  # Xor, Implies, ...: rare, slow path
        args = [sympy.true if _eval(a, env) else sympy.false for a in e.args]
        return bool(e.func(*args))
    raise ValueError(f"cannot evaluate {type(e).__name__} in {e}")

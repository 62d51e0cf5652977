"""TIR ``PrimExpr`` to dim expression: the one converter of sizes the runtime evaluates.

The kernel workspace analysis (:mod:`.workspace`: a workspace over the kernel's argument
reads) and the remat timeline (``transform.remat._timeline``: storage sizes and recompute costs
over a function's dims) both write the sizes the runtime evaluates with
:func:`from_prim_expr`, in the language of :mod:`blade_relax.contract.dimexpr` (read its
docstring for the semantics). Each TIR node becomes the dim expression of the same value:

=========================  ===========================================================
TIR                        dim expression
=========================  ===========================================================
``IntImm``, ``Var``        the integer; the variable's text in ``names``, its value in
                           ``lets`` (inlined), or its name
``Add``, ``Sub``, ``Mul``  ``+``, ``-``, ``*``
``FloorDiv``, ``FloorMod`` ``//``, ``%`` (floor)
``Div``, ``Mod``           ``tdiv``, ``tmod`` (truncating toward zero); ``//``, ``%`` when
                           both operands are proven non-negative, where the two agree
``Min``, ``Max``           ``min``, ``max``
``RShift``, ``LShift``     by a constant ``n``: ``// 2**n``, ``* 2**n`` (TIR shifts a
                           signed integer arithmetically, which is floor division)
``Cast``                   between integer types: the value (no wrap-around); to ``bool``:
                           ``!= 0``
``LT`` ... ``NE``,         ``<`` ... ``!=``, ``and``, ``or``, ``not``, ``(t if c else f)``
``And``, ``Or``, ``Not``,
``Select``
=========================  ===========================================================

Anything else (floats, calls, loads) has no dim expression: :class:`UnsupportedNode`.

A value is proven non-negative from the structure of the expression: non-negative constants,
the variables the caller declares non-negative (the dims of a buffer's shape), and the
operations that keep the sign (``+``, ``*``, divisions and remainders of non-negative values,
``min`` of two, ``max`` with one, conditions).

:data:`SYMBOLIC_FUNCTIONS` evaluates a dim expression over
:class:`~blade_relax.symbolic.SymbolicExpr` values (symbolic bytes from the same text).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import sympy
from tvm import tirx

from ..symbolic import SymbolicExpr, dtype_kind

__all__ = ["SYMBOLIC_FUNCTIONS", "UndefinedVariable", "UnsupportedNode", "from_prim_expr"]


class UnsupportedNode(ValueError):
    """A TIR node without a dim expression (the message names it)."""

    def __init__(self, node: Any) -> None:
        super().__init__(f"cannot evaluate a {type(node).__name__} at run time: {node}")
        self.node = node


class UndefinedVariable(ValueError):
    """A variable the caller gives no text for, in strict mode."""

    def __init__(self, var: Any) -> None:
        super().__init__(f"variable {var.name} has no value here")
        self.var = var


# Deepest chain of let-bound variables inlined into one expression.
_MAX_LET_DEPTH = 64

_ARITHMETIC = {"Add": "+", "Sub": "-", "Mul": "*", "FloorDiv": "//", "FloorMod": "%"}
_TRUNCATING = {"Div": ("tdiv", "//"), "Mod": ("tmod", "%")}
_LOGIC = {
    "LT": "<",
    "LE": "<=",
    "GT": ">",
    "GE": ">=",
    "EQ": "==",
    "NE": "!=",
    "And": "and",
    "Or": "or",
}


def from_prim_expr(
    expr: Any,
    names: Mapping[Any, str] | None = None,
    *,
    strict: bool = False,
    nonnegative: Collection[Any] = (),
    lets: Mapping[Any, Any] | None = None,
    logic: bool = True,
) -> str:
    """The dim expression equal to a TIR ``PrimExpr`` (see the module docstring).

    Parameters
    ----------
    expr
        A ``PrimExpr`` of integer (or boolean) type, or a Python ``int``.
    names
        Text for variables (e.g. a kernel's reads ``v0``, ``v1``, or a callee's dims as
        expressions over its caller's); other variables are written by their name.
    strict
        A variable in neither ``names`` nor ``lets`` is an error (a callee's variable may share
        its name with an unrelated dim of the caller).
    nonnegative
        Variables known to be non-negative (dims of tensor shapes): a ``Div`` / ``Mod`` over
        them is written with the floor operators.
    lets
        Let-bound variables and their values, inlined.
    logic
        Whether comparisons, logic and ``Select`` are accepted (a caller that evaluates the
        text over symbolic values, on which Python's conditional cannot branch, says no).

    Raises
    ------
    UnsupportedNode
        For a node without a dim expression (or a logic node when ``logic`` is false).
    UndefinedVariable
        With ``strict``, for a variable in neither ``names`` nor ``lets``.
    ValueError
        For a chain of more than 64 let-bound variables.
    """
    converter = _Converter(names or {}, strict, frozenset(nonnegative), lets or {}, logic)
    return converter.convert(expr, 0)[0]


class _Converter:
    """One conversion: returns, per node, its text and whether it is proven non-negative."""

    def __init__(
        self,
        names: Mapping[Any, str],
        strict: bool,
        nonnegative: frozenset[Any],
        lets: Mapping[Any, Any],
        logic: bool,
    ) -> None:
        self.names = names
        self.strict = strict
        self.nonnegative = nonnegative
        self.lets = lets
        self.logic = logic

    def convert(self, expr: Any, depth: int) -> tuple[str, bool]:
        if isinstance(expr, int):
            return str(int(expr)), expr >= 0
        if isinstance(expr, tirx.IntImm):
            value = int(expr.value)
            return str(value), value >= 0
        if isinstance(expr, tirx.Var):
            return self.variable(expr, depth)
        kind = type(expr).__name__
        if kind in _ARITHMETIC:
            return self.arithmetic(expr, kind, depth)
        if kind in _TRUNCATING:
            return self.truncating(expr, kind, depth)
        if kind in ("Min", "Max"):
            (a, a_nn), (b, b_nn) = self.convert(expr.a, depth), self.convert(expr.b, depth)
            return f"{kind.lower()}({a}, {b})", (a_nn and b_nn) if kind == "Min" else a_nn or b_nn
        if kind in ("RShift", "LShift"):
            return self.shift(expr, kind, depth)
        if kind == "Cast":
            return self.cast(expr, depth)
        if self.logic:
            return self.logical(expr, kind, depth)
        raise UnsupportedNode(expr)

    def variable(self, var: Any, depth: int) -> tuple[str, bool]:
        if var in self.names:
            return self.names[var], var in self.nonnegative
        if var in self.lets:
            if depth >= _MAX_LET_DEPTH:
                raise ValueError("let chain too deep")
            return self.convert(self.lets[var], depth + 1)
        if self.strict:
            raise UndefinedVariable(var)
        return str(var.name), var in self.nonnegative

    def arithmetic(self, expr: Any, kind: str, depth: int) -> tuple[str, bool]:
        (a, a_nn), (b, b_nn) = self.convert(expr.a, depth), self.convert(expr.b, depth)
        if kind == "Sub":
            nonneg = False
        elif kind == "FloorMod":
            nonneg = b_nn  # the sign of the divisor
        else:
            nonneg = a_nn and b_nn
        return f"({a} {_ARITHMETIC[kind]} {b})", nonneg

    def truncating(self, expr: Any, kind: str, depth: int) -> tuple[str, bool]:
        (a, a_nn), (b, b_nn) = self.convert(expr.a, depth), self.convert(expr.b, depth)
        function, floor = _TRUNCATING[kind]
        if a_nn and b_nn:  # truncating and floor division agree
            return f"({a} {floor} {b})", True
        # The quotient is non-negative when both are; the remainder has the sign of ``a``.
        return f"{function}({a}, {b})", (a_nn and b_nn) if kind == "Div" else a_nn

    def shift(self, expr: Any, kind: str, depth: int) -> tuple[str, bool]:
        amount = getattr(expr, "b", None)
        if not isinstance(amount, tirx.IntImm) or int(amount.value) < 0:
            raise UnsupportedNode(expr)
        a, a_nn = self.convert(expr.a, depth)
        return f"({a} {'//' if kind == 'RShift' else '*'} {2 ** int(amount.value)})", a_nn

    def cast(self, expr: Any, depth: int) -> tuple[str, bool]:
        source, target = dtype_kind(expr.value), dtype_kind(expr)
        if source in ("int", "uint", "bool") and target in ("int", "uint"):
            return self.convert(expr.value, depth)
        if source in ("int", "uint", "bool") and target == "bool" and self.logic:
            return f"({self.convert(expr.value, depth)[0]} != 0)", True
        raise UnsupportedNode(expr)

    def logical(self, expr: Any, kind: str, depth: int) -> tuple[str, bool]:
        if kind in _LOGIC:
            a, b = self.convert(expr.a, depth)[0], self.convert(expr.b, depth)[0]
            return f"({a} {_LOGIC[kind]} {b})", True
        if kind == "Not":
            return f"(not {self.convert(expr.a, depth)[0]})", True
        if kind == "Select":
            cond = self.convert(expr.condition, depth)[0]
            (t, t_nn), (f, f_nn) = (
                self.convert(expr.true_value, depth),
                self.convert(expr.false_value, depth),
            )
            return f"({t} if {cond} else {f})", t_nn and f_nn
        raise UnsupportedNode(expr)


# --------------------------------------------------------------------------- symbolic values
def _symbolic_tdiv(a: Any, b: Any) -> SymbolicExpr:
    """:func:`blade_relax.contract.dimexpr.tdiv` of symbolic values: the quotient rounded
    toward zero, the floor of a non-negative one and the ceiling of a negative one."""
    p, q = SymbolicExpr(a).expr, SymbolicExpr(b).expr
    ratio = p / q
    return SymbolicExpr(
        sympy.Piecewise((sympy.floor(ratio), p * q >= 0), (sympy.ceiling(ratio), True))
    )


def _symbolic_tmod(a: Any, b: Any) -> SymbolicExpr:
    """:func:`blade_relax.contract.dimexpr.tmod` of symbolic values."""
    return SymbolicExpr(a) - SymbolicExpr(b) * _symbolic_tdiv(a, b)


#: The functions of a dim expression over :class:`~blade_relax.symbolic.SymbolicExpr` values
#: (for :func:`blade_relax.contract.dimexpr.compile_expressions`).
SYMBOLIC_FUNCTIONS: Mapping[str, Callable[..., SymbolicExpr]] = {
    "max": SymbolicExpr.max,
    "min": SymbolicExpr.min,
    "tdiv": _symbolic_tdiv,
    "tmod": _symbolic_tmod,
}

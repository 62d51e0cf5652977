"""TIR PrimExpr -> dim expression: every node means what TIR computes, checked against TIR's
own constant folding with negative and positive operands."""

from __future__ import annotations

import itertools

import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import tirx

from blade_relax.analysis.dimexpr import (
    SYMBOLIC_FUNCTIONS,
    UndefinedVariable,
    UnsupportedNode,
    from_prim_expr,
)
from blade_relax.contract.dimexpr import compile_expressions, validate
from blade_relax.symbolic import SymbolicExpr

X = tirx.Var("x", "int64")
Y = tirx.Var("y", "int64")


def _imm(value: int, dtype: str = "int64") -> tirx.IntImm:
    return tirx.IntImm(dtype, value)


def _tir_value(expr: tirx.PrimExpr, x: int, y: int) -> int:
    """What TIR computes: the expression with the variables bound, folded by its analyzer."""
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(X, _imm(x))
    analyzer.bind(Y, _imm(y))
    folded = analyzer.simplify(expr)
    assert isinstance(folded, tirx.IntImm), f"TIR did not fold {expr} to a constant: {folded}"
    return int(folded.value)


def _our_value(expr: tirx.PrimExpr, x: int, y: int, nonnegative=()) -> int:
    text = from_prim_expr(expr, nonnegative=nonnegative)
    validate(text, ["x", "y"])
    return int(compile_expressions(["x", "y"], [text])(x, y)[0])


# --------------------------------------------------------------------------- divisions
DIVISIONS = {
    "Div": tirx.Div,
    "Mod": tirx.Mod,
    "FloorDiv": tirx.FloorDiv,
    "FloorMod": tirx.FloorMod,
}


@pytest.mark.parametrize("kind", list(DIVISIONS))
def test_each_division_matches_tir_on_a_grid_of_signs(kind):
    expr = DIVISIONS[kind](X, Y)
    for x, y in itertools.product(range(-9, 10), [*range(-4, 0), *range(1, 5)]):
        assert _our_value(expr, x, y) == _tir_value(expr, x, y), (kind, x, y)


def test_truncating_division_is_written_as_such_unless_both_operands_are_non_negative():
    quotient = tirx.Div(X * _imm(4), tirx.Max(Y, _imm(1)))
    assert from_prim_expr(quotient) == "tdiv((x * 4), max(y, 1))"
    assert from_prim_expr(tirx.Mod(X, _imm(3))) == "tmod(x, 3)"
    # Over shape dims (never negative) truncating and floor division agree: the floor form.
    assert from_prim_expr(quotient, nonnegative=[X]) == "((x * 4) // max(y, 1))"
    assert from_prim_expr(tirx.Mod(X, _imm(3)), {X: "v0"}, nonnegative=[X]) == "(v0 % 3)"
    # A difference is not proven non-negative.
    assert from_prim_expr(tirx.Div(X - Y, _imm(2)), nonnegative=[X, Y]) == "tdiv((x - y), 2)"
    assert from_prim_expr(tirx.FloorDiv(X, _imm(2))) == "(x // 2)"


# --------------------------------------------------------------------------- random trees
def _nonzero(e: tirx.PrimExpr, negative: bool) -> tirx.PrimExpr:
    """A divisor never zero: ``±(e*e + 1)``."""
    positive = e * e + _imm(1)
    return _imm(0) - positive if negative else positive


def _trees(leaves: st.SearchStrategy) -> st.SearchStrategy:
    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        pairs = st.tuples(children, children)
        return st.one_of(
            st.builds(lambda p: tirx.Add(*p), pairs),
            st.builds(lambda p: tirx.Sub(*p), pairs),
            st.builds(lambda p: tirx.Mul(*p), pairs),
            st.builds(lambda p: tirx.Min(*p), pairs),
            st.builds(lambda p: tirx.Max(*p), pairs),
            st.builds(
                lambda p, kind, neg: DIVISIONS[kind](p[0], _nonzero(p[1], neg)),
                pairs,
                st.sampled_from(list(DIVISIONS)),
                st.booleans(),
            ),
            st.builds(
                lambda a, n, right: tirx.RShift(a, _imm(n)) if right else tirx.LShift(a, _imm(n)),
                children,
                st.integers(0, 3),
                st.booleans(),
            ),
            st.builds(
                lambda p, q, cmp: tirx.Select(cmp(*p), *q),
                pairs,
                pairs,
                st.sampled_from([tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE]),
            ),
            st.builds(lambda a: tirx.Cast("int64", tirx.Cast("int32", a)), children),
        )

    return st.recursive(leaves, extend, max_leaves=6)


_LEAVES = st.one_of(st.just(X), st.just(Y), st.integers(-5, 5).map(_imm))


@settings(max_examples=300, deadline=None)
@given(_trees(_LEAVES), st.integers(-7, 7), st.integers(-7, 7))
def test_random_expressions_match_tir(expr, x, y):
    assert _our_value(expr, x, y) == _tir_value(expr, x, y), expr


@settings(max_examples=200, deadline=None)
@given(_trees(_LEAVES), st.integers(0, 7), st.integers(0, 7))
def test_random_expressions_over_non_negative_dims_match_tir(expr, x, y):
    """With the dims declared non-negative, provably non-negative divisions take the floor
    operators: still TIR's value."""
    assert _our_value(expr, x, y, nonnegative=[X, Y]) == _tir_value(expr, x, y), expr


# --------------------------------------------------------------------------- what else
def test_logic_and_conditions():
    expr = tirx.Select(tirx.And(X < Y, tirx.Not(X == _imm(0))), X, Y)
    assert from_prim_expr(expr) == "(x if ((x < y) and (not (x == 0))) else y)"
    for x, y in itertools.product(range(-3, 4), repeat=2):
        assert _our_value(expr, x, y) == _tir_value(expr, x, y)
    with pytest.raises(UnsupportedNode):
        from_prim_expr(expr, logic=False)


def test_casts_between_integers_keep_the_value_and_others_are_refused():
    assert from_prim_expr(tirx.Cast("int32", X) * _imm(2)) == "(x * 2)"
    assert from_prim_expr(tirx.Cast("bool", X)) == "(x != 0)"
    with pytest.raises(UnsupportedNode, match="Cast"):
        from_prim_expr(tirx.Cast("int64", tirx.Cast("float32", X)))
    with pytest.raises(UnsupportedNode, match="FloatImm"):
        from_prim_expr(tirx.FloatImm("float32", 0.5))
    with pytest.raises(UnsupportedNode, match="RShift"):
        from_prim_expr(tirx.RShift(X, Y))  # only shifts by a constant


def test_variables_by_text_by_let_or_by_name():
    assert from_prim_expr(X + Y, {X: "v0"}) == "(v0 + y)"
    with pytest.raises(UndefinedVariable) as err:
        from_prim_expr(X + Y, {X: "v0"}, strict=True)
    assert err.value.var.same_as(Y)
    z = tirx.Var("z", "int64")
    assert from_prim_expr(z * _imm(2), {X: "v0"}, strict=True, lets={z: X + _imm(1)}) == (
        "((v0 + 1) * 2)"
    )
    assert from_prim_expr(7) == "7"


def test_symbolic_values_truncate_too():
    """The same text over SymbolicExpr (the symbolic timeline's workspace bytes)."""
    texts = ["tdiv(a, b)", "tmod(a, b)", "max(a, b)", "((a // b) + (a % b))"]
    symbolic = compile_expressions(["a", "b"], texts, SYMBOLIC_FUNCTIONS)
    a, b = SymbolicExpr.dim("a", lower=None), SymbolicExpr.dim("b", lower=None)
    values = symbolic(a, b)
    integer = compile_expressions(["a", "b"], texts)
    for x, y in itertools.product(range(-7, 8), [-3, -2, -1, 1, 2, 3]):
        got = tuple(v.evaluate({"a": x, "b": y}) for v in values)
        assert got == integer(x, y), (x, y)

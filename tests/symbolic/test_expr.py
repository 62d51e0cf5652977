"""SymbolicExpr: PrimExpr -> sympy conversion, arithmetic, evaluation."""

from __future__ import annotations

import pickle
import warnings

import pytest
import sympy
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import tirx

from blade_relax.symbolic import SymbolicExpr

N = tirx.Var("n", "int64")
M = tirx.Var("m", "int64")


def i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


def tvm_value(expr: tirx.PrimExpr, env: dict[str, int]) -> int:
    """Evaluate a PrimExpr with TVM's own arithmetic (the reference semantics)."""
    analyzer = tvm.sym.Analyzer()
    for var in (N, M):
        if var.name in env:
            analyzer.bind(var, i64(env[var.name]))
    out = analyzer.simplify(expr)
    assert isinstance(out, tirx.IntImm), f"TVM did not fold {expr} to a constant: {out}"
    return int(out.value)


# Random expressions are drawn as small recipes (nested tuples) and built afterwards: cheap to
# shrink and to print when a case fails.
_BINARY = ["add", "sub", "mul", "min", "max"]
recipes = st.recursive(
    st.one_of(st.sampled_from(["n", "m"]), st.integers(-9, 40)),
    lambda children: st.one_of(
        st.tuples(st.sampled_from(_BINARY), children, children),
        st.tuples(
            st.sampled_from(["floordiv", "floormod"]),
            children,
            st.integers(-7, 9).filter(lambda c: c != 0),
        ),
        st.tuples(st.just("select"), children, children, children),
        st.tuples(st.just("cast"), children),
    ),
    max_leaves=8,
)


def build(recipe) -> tirx.PrimExpr:
    if recipe == "n":
        return N
    if recipe == "m":
        return M
    if isinstance(recipe, int):
        return i64(recipe)
    op, *args = recipe
    if op == "cast":  # through int32 and back, so every node stays int64
        return tirx.Cast("int64", tirx.Cast("int32", build(args[0])))
    if op == "select":
        a, b, c = (build(x) for x in args)
        return tirx.Select(a < b, b, c)
    a, b = build(args[0]), build(args[1])
    return {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "min": lambda: tirx.min(a, b),
        "max": lambda: tirx.max(a, b),
        "floordiv": lambda: tirx.floordiv(a, b),
        "floormod": lambda: tirx.floormod(a, b),
    }[op]()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes, n=st.integers(1, 30), m=st.integers(1, 30))
def test_round_trip_matches_tvm_arithmetic(recipe, n, m):
    expr = build(recipe)
    sym = SymbolicExpr.from_prim_expr(expr)
    assert not sym.is_unknown
    assert sym.evaluate({"n": n, "m": m}) == tvm_value(expr, {"n": n, "m": m})


@pytest.mark.parametrize(
    "recipe",
    [
        ("floormod", ("mul", "n", ("floormod", "n", -2)), 3),  # the example hypothesis found
        ("floormod", ("mul", "m", ("floormod", "n", 4)), 3),
        ("floormod", ("add", ("floormod", "m", 3), ("mul", "m", ("floormod", "n", 4))), 3),
        ("floormod", ("mul", "m", ("floormod", "n", 3)), 3),  # same modulus: sympy folds it
    ],
)
def test_remainder_of_a_product_with_a_remainder_by_another_modulus(recipe):
    """sympy's ``Mod.eval`` counted an inner remainder by another modulus twice
    (``Mod(a*Mod(b, r), q)`` became ``Mod(a*Mod(b, r)**2, q)``)."""
    expr = build(recipe)
    sym = SymbolicExpr.from_prim_expr(expr)
    for n in range(1, 13):
        for m in (1, 2, 5, 7):
            env = {"n": n, "m": m}
            assert sym.evaluate(env) == tvm_value(expr, env), (recipe, env)


@pytest.mark.parametrize(
    ("build", "env"),
    [
        (lambda: N * 4096 * 4, {"n": 7}),
        (lambda: tirx.floordiv(N * 3 + 5, 4), {"n": 9}),
        (lambda: tirx.floordiv(N - 50, 8), {"n": 3}),  # negative numerator rounds down
        (lambda: tirx.floormod(N - 50, 8), {"n": 3}),  # floormod of a negative is >= 0
        (lambda: tirx.floormod(N, i64(-3)), {"n": 7}),  # sign of the divisor
        (lambda: tirx.max(N, M) - tirx.min(N, M), {"n": 4, "m": 11}),
        (lambda: tirx.Select(tirx.all(N < M, N > 2), N, M * 2), {"n": 3, "m": 5}),
        (lambda: tirx.Select(tirx.Not(N == M), N, i64(0)), {"n": 3, "m": 3}),
        (lambda: tirx.Cast("int32", N) * 2, {"n": 21}),
        (lambda: (N + M) * (N - M), {"n": 9, "m": 4}),
    ],
)
def test_hand_written_conversions(build, env):
    expr = build()
    assert SymbolicExpr.from_prim_expr(expr).evaluate(env) == tvm_value(expr, env)


def test_dims_are_positive_integer_symbols():
    e = SymbolicExpr.from_prim_expr(N * M)
    (n_sym,) = [s for s in e.expr.free_symbols if s.name == "n"]
    assert n_sym.is_integer and n_sym.is_positive
    assert e.dim_names == frozenset({"n", "m"})
    # Same name, same symbol: independently built expressions cancel.
    assert (SymbolicExpr.from_prim_expr(N * 4) - SymbolicExpr.dim("n") * 4).expr == 0


def test_int_and_intimm():
    assert SymbolicExpr.from_prim_expr(12).is_constant
    assert int(SymbolicExpr.from_prim_expr(i64(12))) == 12
    assert SymbolicExpr.from_prim_expr(True).evaluate({}) == 1


def test_unsupported_node_is_unknown_with_one_warning():
    # truncdiv (tirx.Div) and a call are not shape arithmetic we model.
    expr = tirx.truncdiv(N, 2) + tirx.call_extern("int64", "opaque_fn", N) + N
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = SymbolicExpr.from_prim_expr(expr)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "Div" in message and "Call" in message
    assert e.is_unknown
    assert e.dim_names == frozenset({"n"})
    with pytest.raises(ValueError, match="UNKNOWN"):
        e.evaluate({"n": 4})
    # The same unsupported expression maps to the same opaque symbol.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = SymbolicExpr.from_prim_expr(expr)
    assert (again - e).expr == 0


def test_float_cast_is_unknown_not_a_crash():
    with pytest.warns(UserWarning, match="Cast"):
        e = SymbolicExpr.from_prim_expr(tirx.Cast("float32", N))
    assert e.is_unknown


def test_arithmetic_and_immutability():
    s = SymbolicExpr.dim("s")
    e = (s * 4 + 2) * 3 - s
    assert e.evaluate({"s": 5}) == 61
    assert (2 - s).evaluate({"s": 5}) == -3
    assert (s // 4).evaluate({"s": 9}) == 2
    assert (s % 4).evaluate({"s": 9}) == 1
    assert (-s).evaluate({"s": 9}) == -9
    with pytest.raises(AttributeError):
        e._expr = sympy.Integer(0)  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(e)) == e
    assert hash(SymbolicExpr.dim("s") * 2) == hash(2 * SymbolicExpr.dim("s"))


def test_pickling_rebuilds_the_same_expression_without_evaluating_it(monkeypatch):
    """A peak is a Max of many terms: unpickling rebuilds it as it was instead of comparing
    its terms again (sympy's own pickling calls ``Max(*args)``, seconds for a large block)."""
    s, b = SymbolicExpr.dim("s"), SymbolicExpr.dim("b")
    terms = [s * b * (i + 1) + s * i + 1000 * i for i in range(12)]
    terms += [s * s * (i + 1) + s // (i + 2) for i in range(12)]
    exprs = [
        SymbolicExpr.max(*terms),
        SymbolicExpr.min(s, b * 2) + (s // 3) * (b % 4),
        (s * 4 + 2) * 3 - s,
        -s,
        SymbolicExpr(sympy.Rational(3, 2)) * s * s,
        SymbolicExpr(7),
        s,
    ]
    data = [pickle.dumps(e) for e in exprs]

    def no_evaluation(*args, **kwargs):
        raise AssertionError("Max / Min evaluated again while unpickling")

    monkeypatch.setattr(sympy.Max, "_find_localzeros", classmethod(no_evaluation))
    monkeypatch.setattr(sympy.Min, "_find_localzeros", classmethod(no_evaluation))
    for e, blob in zip(exprs, data):
        got = pickle.loads(blob)
        assert got == e and hash(got) == hash(e)
        assert sympy.srepr(got._expr) == sympy.srepr(e._expr)
        assert got.evaluate({"s": 38, "b": 5}) == e.evaluate({"s": 38, "b": 5})


def test_max_min_flatten_and_fold_constants():
    s, t = SymbolicExpr.dim("s"), SymbolicExpr.dim("t")
    m = SymbolicExpr.max(s, 3, SymbolicExpr.max(t, 7), s)
    assert isinstance(m.expr, sympy.Max)
    assert set(m.expr.args) == {s.expr, t.expr, sympy.Integer(7)}
    assert m.evaluate({"s": 2, "t": 1}) == 7
    assert SymbolicExpr.max([SymbolicExpr.constant(4), 9]).evaluate({}) == 9
    assert SymbolicExpr.min(s * 2, t, 100).evaluate({"s": 30, "t": 80}) == 60
    assert SymbolicExpr.max(s) == s
    with pytest.raises(ValueError):
        SymbolicExpr.max()


def test_max_of_many_terms_is_cheap():
    s = SymbolicExpr.dim("s")
    terms = [s * k + k for k in range(2000)]
    m = SymbolicExpr.max(terms)
    assert m.evaluate({"s": 2}) == 2 * 1999 + 1999


def test_evaluate_missing_dim():
    with pytest.raises(ValueError, match="'t'"):
        (SymbolicExpr.dim("s") * SymbolicExpr.dim("t")).evaluate({"s": 1})

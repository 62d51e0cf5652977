"""ShapeGraph.from_function: dims, ranges, equalities, bytes, evaluation, argument binding."""

from __future__ import annotations

import warnings

import pytest
import tvm
from tvm import relax, tirx
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.symbolic import (
    UNBOUNDED_STAND_IN,
    Ordering,
    ShapeGraph,
    SymbolicDim,
    SymbolicExpr,
    TypeSizes,
    element_bits,
    element_bytes,
)

E = SymbolicExpr


@R.function
def reshape_and_match_cast(
    x: R.Tensor(("b", "s", 64), "float32"), y: R.Tensor(("b", "t"), "float16")
):
    R.func_attr({"tir_var_upper_bound": {"s": 2048}, "tir_var_lower_bound": {"s": 2}})
    b = T.int64()
    s = T.int64()
    m = T.int64()
    with R.dataflow():
        z = R.reshape(x, R.shape([b * s, 64]))
        w = R.match_cast(y, R.Tensor((b, s), "float16"))
        u = R.match_cast(z, R.Tensor((m, 64), "float32"))
        v = R.add(u, u)
        pair = (z, w)
        R.output(v, pair)
    return (v, pair)


def binding_vars(func: relax.Function) -> dict[str, relax.Var]:
    out = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            out[binding.var.name] = binding.var
    return out


def test_dims_ranges_and_classes():
    graph = ShapeGraph.from_function(reshape_and_match_cast)
    assert set(graph.dims) == {"b", "s", "t", "m"}
    s_dim = graph.dims["s"]
    assert isinstance(s_dim, SymbolicDim)
    assert (s_dim.lower, s_dim.upper) == (2, 2048)
    # t is unified with s by the match_cast and shares the intersected range.
    assert graph.dims["t"].eq_class == frozenset({"s", "t"})
    assert (graph.dims["t"].lower, graph.dims["t"].upper) == (2, 2048)
    assert (graph.dims["b"].lower, graph.dims["b"].upper) == (1, None)
    assert graph.canonical(E.dim("t")) == E.dim("s")
    # m, introduced by a later match_cast, is eliminated in favour of b * s.
    assert graph.canonical(E.dim("m") * 3) == E.dim("b") * E.dim("s") * 3
    assert graph.representative("m") == E.dim("b") * E.dim("s")


@R.function
def scaled_by_a_float(x: R.Tensor(("n",), "float32"), weight: R.Prim("float32")):
    return x


def test_a_float_parameter_is_no_dim():
    # TVM lists the parameter among the function's symbolic variables; no shape depends on it.
    assert "weight" in [v.name for v in relax.analysis.defined_symbolic_vars(scaled_by_a_float)]
    assert list(ShapeGraph.from_function(scaled_by_a_float).dims) == ["n"]


def test_bytes_of_bindings_and_params():
    graph = ShapeGraph.from_function(reshape_and_match_cast)
    v = binding_vars(reshape_and_match_cast)
    b, s = E.dim("b"), E.dim("s")
    x, y = reshape_and_match_cast.params
    assert graph.bytes_of(x) == b * s * 64 * 4
    assert graph.bytes_of(y) == b * s * 2  # (b, t) float16 with t == s
    assert graph.bytes_of(v["z"]) == b * s * 256
    assert graph.bytes_of(v["u"]) == graph.bytes_of(v["z"])
    assert graph.bytes_of(v["pair"]) == b * s * 256 + b * s * 2
    assert graph.compare(graph.bytes_of(v["u"]), graph.bytes_of(v["w"])) == Ordering.GT
    assert graph.bytes_of(v["z"].ty) == graph.bytes_of(v["z"])  # a type works too


def test_evaluate_checks_ranges_and_missing_dims():
    graph = ShapeGraph.from_function(reshape_and_match_cast)
    nbytes = graph.bytes_of(reshape_and_match_cast.params[0])
    assert graph.evaluate(nbytes, {"b": 2, "s": 100}) == 2 * 100 * 256
    # Any member of a class can give its value.
    assert graph.evaluate(nbytes, {"b": 2, "t": 100}) == 2 * 100 * 256
    with pytest.raises(ValueError, match=r"'s' = 4000 is outside its range \[2, 2048\]"):
        graph.evaluate(nbytes, {"b": 2, "s": 4000})
    with pytest.raises(ValueError, match=r"'s' \(range \[2, 2048\]\)"):
        graph.evaluate(nbytes, {"b": 2})
    with pytest.raises(ValueError, match="different values"):
        graph.evaluate(nbytes, {"b": 2, "s": 100, "t": 99})
    with pytest.raises(ValueError, match="contradicts"):
        graph.evaluate(nbytes, {"b": 2, "s": 100, "m": 7})
    # t alone is range-checked against the class range, not only its declared [1, inf).
    with pytest.raises(ValueError, match="outside the range"):
        graph.evaluate(E.dim("t"), {"t": 1})


def test_representative_points():
    graph = ShapeGraph.from_function(reshape_and_match_cast)
    points = graph.representative_points()
    assert points[0] == {"b": 1, "s": 2, "t": 2, "m": 2}  # every dim at its lower bound
    assert points[2]["s"] == 2048 and points[2]["b"] == UNBOUNDED_STAND_IN
    for point in points:
        assert point["s"] == point["t"]
        assert point["m"] == point["b"] * point["s"]
        assert 2 <= point["s"] <= 2048 and point["b"] >= 1
        graph.evaluate(graph.bytes_of(reshape_and_match_cast.params[0]), point)
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)


def test_bind_arguments():
    graph = ShapeGraph.from_function(reshape_and_match_cast)
    assert graph.bind_arguments([(3, 10, 64), (3, 10)]) == {"b": 3, "s": 10, "t": 10, "m": 30}
    assert graph.bind_arguments([(3, 10, 64), None])["m"] == 30
    with pytest.raises(ValueError, match=r"'s' = 1 is outside its range \[2, 2048\]"):
        graph.bind_arguments([(3, 1, 64), None])
    with pytest.raises(ValueError, match="expected rank 3"):
        graph.bind_arguments([(3, 10), None])
    with pytest.raises(ValueError, match="expected 64 = 64, got 65"):
        graph.bind_arguments([(3, 10, 65), None])
    with pytest.raises(ValueError, match="different values"):
        graph.bind_arguments([(3, 10, 64), (3, 11)])
    with pytest.raises(ValueError, match="expected 2 parameter shapes"):
        graph.bind_arguments([(3, 10, 64)])
    with pytest.raises(ValueError, match="from_function"):
        ShapeGraph.from_ranges({"s": (1, 4)}).bind_arguments([(1,)])


def test_static_function_has_no_dims():
    @R.function
    def f(x: R.Tensor((4, 8), "float32"), mask: R.Tensor((4, 8), "bool")):
        with R.dataflow():
            y = R.add(x, x)
            z = R.reshape(y, R.shape([32]))
            R.output(z)
        return z

    graph = ShapeGraph.from_function(f)
    assert dict(graph.dims) == {}
    assert graph.bytes_of(f.params[0]) == 128
    assert graph.bytes_of(f.params[1]) == 32  # bool: one byte per element
    assert graph.bytes_of(f.params[0]).is_constant
    assert graph.compare(graph.bytes_of(f.params[0]), graph.bytes_of(f.params[1])) == Ordering.GT
    assert graph.representative_points() == [{}]
    assert graph.bind_arguments([(4, 8), (4, 8)]) == {}
    with pytest.raises(ValueError, match="expected 8 = 8, got 9"):
        graph.bind_arguments([(4, 9), None])


def test_bytes_of_other_types():
    graph = ShapeGraph.from_ranges({"n": (1, None)})
    n = tirx.Var("n", "int64")
    assert graph.bytes_of(relax.ShapeType([n, 4])) == 0
    assert graph.bytes_of(tvm.ir.PrimType("int64")) == 0
    assert graph.bytes_of(relax.ObjectType()) == 0
    assert graph.bytes_of(relax.TensorType([n, 3], "float32x4")) == E.dim("n") * 48
    assert graph.bytes_of(relax.TensorType([n, 3], "int4")).evaluate({"n": 3}) == 5  # 9 nibbles
    nested = relax.TupleType(
        [relax.TensorType([n], "float16"), relax.TupleType([relax.TensorType([2], "int8")])]
    )
    assert graph.bytes_of(nested) == E.dim("n") * 2 + 2
    assert graph.bytes_of(relax.TensorType(None, "float32", ndim=2)).is_unknown
    assert graph.bytes_of(relax.TensorType([n], None)).is_unknown
    assert graph.bytes_of(relax.TensorType(None, "float32", ndim=-1)).is_unknown
    assert element_bytes("bool") == 1 and element_bits("float16") == 16
    assert element_bytes("int4") is None and element_bits("int4") == 4
    assert element_bits(None) is None


def test_unknown_shape_vars_are_distinct_unknowns():
    @R.function
    def f(x: R.Tensor(ndim=2, dtype="float32"), y: R.Tensor(ndim=2, dtype="float32")):
        return x

    graph = ShapeGraph.from_function(f)
    bx, by = (graph.bytes_of(p) for p in f.params)
    assert bx.is_unknown and by.is_unknown
    assert graph.compare(bx, bx) == Ordering.EQ
    assert graph.compare(bx, by) == Ordering.UNKNOWN


def test_unsupported_prim_expr_in_a_type_warns_and_never_crashes():
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    y = relax.Var("y", relax.TensorType([tirx.truncdiv(n, 2), 4], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        out = bb.emit(relax.op.add(y, y))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = ShapeGraph.from_function(func)
        nbytes = graph.bytes_of(func.params[1])
    assert any("Div" in str(w.message) for w in caught)
    assert "n" in graph.dims
    assert nbytes.is_unknown
    assert graph.compare(nbytes, graph.bytes_of(func.params[0])) == Ordering.UNKNOWN
    assert graph.bytes_of(func.params[0]) == E.dim("n") * 16


def test_matmul_shares_the_reduction_dim():
    @R.function
    def f(x: R.Tensor(("s", "k"), "float32"), w: R.Tensor(("k2", "n"), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y

    graph = ShapeGraph.from_function(f)
    assert graph.dims["k2"].eq_class == frozenset({"k", "k2"})
    assert graph.compare(graph.bytes_of(f.params[0]), E.dim("s") * E.dim("k2") * 4) == Ordering.EQ


def test_elementwise_broadcast_unifies_only_dims_that_cannot_be_one():
    @R.function
    def f(
        x: R.Tensor(("s", "t"), "float32"),
        y: R.Tensor(("u", "v"), "float32"),
    ):
        R.func_attr({"tir_var_lower_bound": {"s": 2, "u": 2}})
        with R.dataflow():
            z = R.add(x, y)
            R.output(z)
        return z

    graph = ShapeGraph.from_function(f)
    assert graph.dims["u"].eq_class == frozenset({"s", "u"})  # both >= 2: must be equal
    assert graph.dims["v"].eq_class == frozenset({"v"})  # t or v may be 1 and broadcast


def test_concat_shares_non_axis_dims():
    @R.function
    def f(x: R.Tensor(("a", "h"), "float32"), y: R.Tensor(("c", "h2"), "float32")):
        with R.dataflow():
            z = R.concat((x, y), axis=0)
            R.output(z)
        return z

    graph = ShapeGraph.from_function(f)
    assert graph.dims["h2"].eq_class == frozenset({"h", "h2"})
    assert graph.dims["c"].eq_class == frozenset({"c"})


def test_match_cast_to_a_constant_fixes_the_dim():
    @R.function
    def f(x: R.Tensor((4, 8), "float32")):
        n = T.int64()
        with R.dataflow():
            y = R.match_cast(x, R.Tensor((n, 8), "float32"))
            R.output(y)
        return y

    graph = ShapeGraph.from_function(f)
    assert graph.canonical(E.dim("n") * 2) == 8
    y = binding_vars(f)["y"]
    assert graph.bytes_of(y) == 128


def test_match_cast_inside_a_branch_does_not_unify_older_dims():
    @R.function
    def f(x: R.Tensor(("s",), "float32"), y: R.Tensor(("t",), "float32"), c: R.Tensor((), "bool")):
        n = T.int64()
        s = T.int64()
        if c:
            y2 = R.match_cast(y, R.Tensor((s,), "float32"))  # only on this branch
            x2 = R.match_cast(x, R.Tensor((n,), "float32"))  # defines the new dim n
            out = R.add(y2, x)
        else:
            out = x
        return out

    graph = ShapeGraph.from_function(f)
    assert graph.dims["t"].eq_class == frozenset({"t"})
    assert graph.canonical(E.dim("n")) == E.dim("s")
    assert graph.compare(E.dim("s"), E.dim("t")) == Ordering.UNKNOWN


def test_non_negative_attribute_lowers_the_default():
    @R.function
    def f(x: R.Tensor(("n", 4), "float32"), y: R.Tensor(("m", 4), "float32")):
        R.func_attr({"tir_non_negative_var": ["n"]})
        return x

    graph = ShapeGraph.from_function(f)
    assert graph.dims["n"].lower == 0 and graph.dims["m"].lower == 1
    assert graph.compare(graph.bytes_of(f.params[0]), 0) == Ordering.GE
    assert graph.compare(graph.bytes_of(f.params[1]), 0) == Ordering.GT
    assert graph.evaluate(graph.bytes_of(f.params[0]), {"n": 0}) == 0


def test_shape_param_and_prim_param():
    @R.function
    def f(x: R.Tensor(("n",), "float32"), shape: R.Shape(["n", "k"]), p: R.Prim("int64")):
        return x

    graph = ShapeGraph.from_function(f)
    assert {"n", "k"} <= set(graph.dims)
    assert graph.bytes_of(f.params[1]) == 0 and graph.bytes_of(f.params[2]) == 0
    assert graph.bind_arguments([(5,), (5, 7), None]) == {"n": 5, "k": 7}


def test_from_ranges_and_repr():
    graph = ShapeGraph.from_ranges({"s": (1, 2048), "b": (1, None)})
    assert graph.dims["s"].upper == 2048 and graph.dims["b"].upper is None
    assert "s in [1, 2048]" in repr(graph)
    assert graph.representative_points()[:3] == [
        {"s": 1, "b": 1},
        {"s": 45, "b": 64},
        {"s": 2048, "b": UNBOUNDED_STAND_IN},
    ]
    with pytest.raises(ValueError, match="empty range"):
        ShapeGraph.from_ranges({"s": (5, 4)})
    with pytest.raises(TypeError):
        ShapeGraph.from_function("not a function")


def test_add_equality_and_linear_solution():
    graph = ShapeGraph.from_ranges({"s": (1, None), "p": (1, None)})
    s, p = E.dim("s"), E.dim("p")
    assert graph.compare(p, s + 1) == Ordering.UNKNOWN
    graph.add_equality(p * p, s * s + 3 * s)  # not solvable for a dim: kept aside
    assert len(graph.unresolved_equalities) == 1
    assert graph.compare(p, s) == Ordering.UNKNOWN
    graph.add_equality(p * 2, s * 2 + 2)  # the content is divided out: p == s + 1
    assert graph.compare(p, s) == Ordering.GT
    assert graph.canonical(p) == s + 1


def test_sample_is_the_value_at_every_representative_point():
    graph = ShapeGraph.from_ranges({"s": (2, 100)})
    s = SymbolicExpr.dim("s")
    points = graph.representative_points()
    assert graph.sample(s * s + 3) == tuple(p["s"] ** 2 + 3 for p in points)
    assert graph.sample(SymbolicExpr.unknown("k") + s) is None


def test_type_sizes_remember_known_sizes_per_type_only():
    n = tirx.Var("n", "int64")
    graph = ShapeGraph()
    sizes = TypeSizes(graph)
    first = sizes.bytes_of(relax.TensorType((n, 4), "float32"))
    again = sizes.bytes_of(relax.TensorType((n, 4), "float32"))  # a second, equal type
    assert again is first and first.expr == graph.bytes_of(relax.TensorType((n, 4), "float32")).expr
    assert sizes.bytes_of(relax.TensorType((n, 8), "float32")).expr == 2 * first.expr
    # Unknown sizes are the value's own opaque size, never shared between values.
    unknown = relax.TensorType(ndim=2, dtype="float32")
    a = relax.Var("a", unknown)
    b = relax.Var("b", unknown)
    size_a, size_b = sizes.bytes_of(unknown, a), sizes.bytes_of(unknown, b)
    assert size_a.is_unknown and size_b.is_unknown and size_a.expr != size_b.expr
    assert size_a.expr == graph.bytes_of(a).expr


@R.function
def bounded_length(x: R.Tensor(("s", 8), "float32")):
    R.func_attr({"tir_var_upper_bound": {"s": 40}, "tir_var_lower_bound": {"s": 3}})
    s = T.int64()
    with R.dataflow():
        y = R.reshape(x, R.shape([s * 8]))
        R.output(y)
    return y


def test_admissible_grid_holds_every_value_and_evaluates_exactly():
    import numpy as np

    graph = ShapeGraph.from_function(bounded_length)
    grid = graph.admissible_grid()
    assert list(grid) == ["s"] and grid["s"].tolist() == list(range(3, 41))
    s = grid["s"]
    size = graph.bytes_of(bounded_length.params[0]) * E.dim("s") + 7
    values = graph.evaluate_grid(size, grid)
    assert values.tolist() == [graph.evaluate(size, {"s": int(v)}) for v in s]
    assert graph.evaluate_grid(E.constant(5), grid).tolist() == [5.0] * len(s)
    assert graph.admissible_grid(limit=37) is None  # 38 points
    # An unbounded dim (b) leaves no grid.
    assert ShapeGraph.from_function(reshape_and_match_cast).admissible_grid() is None
    assert np.all(values > 0)


def test_an_expression_is_compiled_for_the_grid_once(monkeypatch):
    """The passes evaluate the same sizes over a grid again and again: each expression is
    turned into a numpy function once, and the values stay exact (an UNKNOWN part or a dim the
    grid lacks still gives None)."""
    import sympy

    from blade_relax.symbolic import concrete

    compiled = []
    lambdify = sympy.lambdify

    def counting(symbols, expr, **kwargs):
        compiled.append(expr)
        return lambdify(symbols, expr, **kwargs)

    monkeypatch.setattr(concrete.sympy, "lambdify", counting)
    concrete._vectorized.cache_clear()
    graph = ShapeGraph.from_function(bounded_length)
    grid = graph.admissible_grid()
    size = graph.bytes_of(bounded_length.params[0]) * E.dim("s") + 11
    first = graph.evaluate_grid(size, grid)
    again = graph.evaluate_grid(graph.bytes_of(bounded_length.params[0]) * E.dim("s") + 11, grid)
    other = graph.evaluate_grid(size + 1, grid)
    assert len(compiled) == 2  # size, then size + 1; the second size was the first's function
    assert (
        first.tolist() == again.tolist() == [graph.evaluate(size, {"s": int(v)}) for v in grid["s"]]
    )
    assert (other - first).tolist() == [1.0] * len(grid["s"])
    unknown = graph.bytes_of(relax.Var("opaque", relax.TensorType(ndim=1, dtype="float32")))
    assert graph.evaluate_grid(size + unknown, grid) is None
    assert graph.evaluate_grid(E.dim("b") * size, grid) is None
    assert len(compiled) == 2


def test_an_unbounded_dim_splits_into_checked_values_and_a_proven_tail():
    """Every value up to ``head`` is in the grid, and the copy starts right after them: a check
    over the grid and a proof on the copy cover every admissible value."""
    graph = ShapeGraph.from_ranges({"s": (2, None), "b": (1, 3)})
    grid, tail = graph.split_unbounded(head=100)
    assert sorted(set(grid["s"].tolist())) == list(range(2, 102))
    assert sorted(set(grid["b"].tolist())) == [1, 2, 3]
    assert len(grid["s"]) == 300
    s, b = E.dim("s"), E.dim("b")
    # 2 s^2 + 500 <= Max(1000, 4 s^2) for every s >= 2, but no one argument bounds it.
    trial, base = 2 * s * s + 500, E.max(E.constant(1000), 4 * s * s)
    assert graph.compare(trial, base) is Ordering.UNKNOWN
    assert tail.compare(trial, base) is Ordering.LT
    assert tail.dims["s"].lower == 102 and tail.dims["b"].upper == 3
    # The original is unchanged (its caches are its own).
    assert graph.dims["s"].lower == 2
    assert graph.compare(trial, base) is Ordering.UNKNOWN
    assert tail.compare(s, 101) is Ordering.GT and graph.compare(s, 101) is Ordering.UNKNOWN
    # Two unbounded dims, or none, have no such split.
    assert ShapeGraph.from_ranges({"s": (1, None), "n": (1, None)}).split_unbounded() is None
    assert ShapeGraph.from_ranges({"s": (1, 64)}).split_unbounded() is None
    with pytest.raises(KeyError, match="no dim 'q'"):
        graph.with_lower_bounds({"q": 3})
    with pytest.raises(ValueError, match="above its upper bound 3"):
        graph.with_lower_bounds({"b": 4})

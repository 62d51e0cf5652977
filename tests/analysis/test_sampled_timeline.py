# ruff: noqa: E501
"""SampledTimeline: a timeline's live bytes at the graph's sample points, equal to evaluating it
there, and the peak outside any window of steps read from running maxima; TimelineMemo's
effects equal the plain ones, kernel workspaces included."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import SampledTimeline, TimelineMemo, liveness, memory_timeline
from blade_relax.analysis.effects import binding_effect
from blade_relax.frontend.builtin import BUILTIN_MODELS
from blade_relax.pipeline import lower_to_memory_stage


# fmt: off
@I.ir_module
class Mixed:
    """Tensors of ``s`` rows and of 64 rows, so the peak is at different steps for small and
    large ``s``; ``scratch`` holds a workspace of ``(s, 8)`` floats while it runs."""

    @T.prim_func(private=True, s_tir=True)
    def scratch(x: T.handle, y: T.handle):
        s = T.int64()
        X = T.match_buffer(x, (s, 4), "float32")
        Y = T.match_buffer(y, (s, 4), "float32")
        tmp = T.alloc_buffer((s, 8), "float32")
        for i, j in T.grid(s, 8):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                tmp[vi, vj] = T.exp(X[vi, vj % 4])
        for i, j in T.grid(s, 4):
            with T.sblock("pair"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = tmp[vi, vj] + tmp[vi, vj + 4]

    @T.prim_func(private=True, s_tir=True)
    def double(x: T.handle, y: T.handle):
        s = T.int64()
        X = T.match_buffer(x, (s, 4), "float32")
        Y = T.match_buffer(y, (s, 4), "float32")
        for i, j in T.grid(s, 4):
            with T.sblock("double"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def wide(x: T.Buffer((64, 4), "float32"), y: T.Buffer((64, 4), "float32")):
        for i, j in T.grid(64, 4):
            with T.sblock("wide"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.float32(1)

    @R.function
    def main(x: R.Tensor(("s", 4), "float32"), w: R.Tensor((64, 4), "float32")):
        s = T.int64()
        cls = Mixed
        with R.dataflow():
            a = R.call_tir(cls.double, (x,), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.wide, (w,), out_ty=R.Tensor((64, 4), "float32"))
            c = R.call_tir(cls.wide, (b,), out_ty=R.Tensor((64, 4), "float32"))
            d = R.call_tir(cls.scratch, (a,), out_ty=R.Tensor((s, 4), "float32"))
            e = R.call_tir(cls.double, (d,), out_ty=R.Tensor((s, 4), "float32"))
            f = R.reshape(e, (s * 4,))
            g = R.call_tir(cls.wide, (c,), out_ty=R.Tensor((64, 4), "float32"))
            R.output(f, g, a)
        return (f, g, a)


@I.ir_module
class Unknown:
    @R.function
    def main(x: R.Tensor(ndim=2, dtype="float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y
# fmt: on


def _timelines():
    yield memory_timeline(Mixed["main"], mod=Mixed)
    for name in sorted(BUILTIN_MODELS):
        lowered = lower_to_memory_stage(BUILTIN_MODELS[name]())
        yield memory_timeline(lowered["main"], mod=lowered)


def test_sampled_values_equal_the_evaluated_timeline():
    for timeline in _timelines():
        sampled = SampledTimeline.of(timeline)
        assert sampled is not None
        assert sampled.points == tuple(timeline.graph.representative_points())
        for k, point in enumerate(sampled.points):
            at = timeline.evaluate(point)
            assert [v[k] for v in sampled.live_during] == at.live_during
            assert sampled.peak[k] == at.peak
            assert sampled.peak[k] == timeline.graph.evaluate(timeline.peak, point)


def test_mixed_sizes_peak_at_different_steps():
    """The fixture is what the window tests need: the peak step depends on the point."""
    sampled = SampledTimeline.of(memory_timeline(Mixed["main"], mod=Mixed))
    at_peak = {
        max(range(len(sampled.live_during)), key=lambda i: sampled.live_during[i][k])
        for k in range(len(sampled.points))
    }
    assert len(at_peak) > 1
    # At ``d``: ``a``, ``c`` (``b`` died), ``d`` and the workspace of ``scratch`` (32 bytes a
    # row), which counts while it runs.
    for k, point in enumerate(sampled.points):
        s = point["s"]
        assert sampled.live_during[3][k] == 16 * s + 1024 + 16 * s + 32 * s


_MIXED = SampledTimeline.of(memory_timeline(Mixed["main"], mod=Mixed))


@given(st.integers(-2, 9), st.integers(-2, 9))
def test_peak_outside_a_window_is_the_largest_value_left(first, last):
    sampled = _MIXED
    n = len(sampled.live_during)
    outside = [v for i, v in enumerate(sampled.live_during) if i < first or i > last]
    if last < first:
        outside = list(sampled.live_during)
    expected = tuple(max((v[k] for v in outside), default=0) for k in range(len(sampled.points)))
    assert sampled.peak_outside(first, last) == expected
    assert all(o <= p for o, p in zip(sampled.peak_outside(first, last), sampled.peak))
    assert sampled.peak_outside(0, n - 1) == (0,) * len(sampled.points)


def test_points_outside_a_dims_range_are_left_out():
    """A dim defined by another (``t = 2 s``, learned from the ``match_cast``) whose own range
    is narrower: at the points where it falls outside, no expression evaluates (they are no
    admissible values), so the samples leave them out."""

    @I.ir_module
    class Narrow:
        @R.function
        def main(x: R.Tensor(("s", 4), "float32"), y: R.Tensor(("t", 4), "float32")):
            R.func_attr({"tir_var_upper_bound": {"t": 64}})
            s = T.int64()
            t = T.int64()
            with R.dataflow():
                z = R.add(x, x)
                w = R.concat([x, x], axis=0)
                u = R.match_cast(w, R.Tensor((t, 4), "float32"))
                v = R.add(y, y)
                R.output(z, u, v)
            return (z, u, v)

    timeline = memory_timeline(Narrow["main"])
    sampled = SampledTimeline.of(timeline)
    points = timeline.graph.representative_points()
    assert 0 < len(sampled.points) < len(points)
    for point in points:
        try:
            value = timeline.graph.evaluate(timeline.peak, point)
        except ValueError:
            assert point not in sampled.points
        else:
            assert sampled.peak[sampled.points.index(point)] == value


def test_unknown_sizes_give_no_samples():
    assert SampledTimeline.of(memory_timeline(Unknown["main"])) is None


@pytest.mark.parametrize("module", [Mixed], ids=["mixed"])
def test_memo_effects_equal_the_plain_ones(module):
    """The memo asks for a kernel's workspace only where the kernel has one: the effects are
    the same as :func:`binding_effect`'s with workspaces, binding by binding."""
    func = module["main"]
    memo = TimelineMemo.for_function(func, mod=module)
    for binding in liveness(func).bindings:
        plain = binding_effect(binding, memo.graph, module, True)
        assert memo.effect_of(binding) == plain
    assert {gv.name_hint: held for gv, held in memo.kernels.items()} == {
        "scratch": True,
        "double": False,
        "wide": False,
    }
    shared = memory_timeline(func, memo=memo)
    plain = memory_timeline(func, mod=module)
    assert [s.live_during for s in shared.steps] == [s.live_during for s in plain.steps]


def test_memo_effects_of_lowered_calls():
    """After lowering, kernels are called directly (a ``GlobalVar`` callee)."""
    for name in sorted(BUILTIN_MODELS):
        lowered = lower_to_memory_stage(BUILTIN_MODELS[name]())
        func = lowered["main"]
        memo = TimelineMemo.for_function(func, mod=lowered)
        for binding in liveness(func).bindings:
            assert memo.effect_of(binding) == binding_effect(binding, memo.graph, lowered, True)


def test_relax_stage_unchanged_by_the_memo():
    func = Mixed["main"]
    rebuilt = relax.Function(func.params, func.body, func.ret_ty, func.is_pure, func.attrs)
    memo = TimelineMemo.for_function(func, mod=Mixed)
    a = SampledTimeline.of(memory_timeline(rebuilt, memo=memo))
    b = SampledTimeline.of(memory_timeline(func, mod=Mixed))
    assert a == b


def test_peaks_over_a_grid_equal_the_evaluated_timeline():
    """At every point of a bounded dim's grid the array holds the evaluated peak."""
    from blade_relax.analysis import peaks_over_grid
    from blade_relax.frontend.imported import set_dim_bounds

    mod = set_dim_bounds(Mixed, upper={"s": 48}, lower={"s": 1})
    timeline = memory_timeline(mod["main"], mod=mod)
    grid = timeline.graph.admissible_grid()
    assert grid is not None and len(grid["s"]) == 48
    peaks = peaks_over_grid(timeline, grid)
    expected = [timeline.evaluate({"s": int(n)}).peak for n in grid["s"]]
    assert peaks.tolist() == expected

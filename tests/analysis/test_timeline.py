"""The symbolic memory timeline: structure at three IR stages, and exact agreement with the VM."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax
from blade_relax.analysis import liveness, memory_timeline, workspace_table
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline
from blade_relax.runtime import measure_memory
from blade_relax.symbolic import Ordering


@I.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor(("s", 64), "float32"), w: R.Tensor((64, 64), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.matmul(x, w)
            b = R.nn.relu(a)
            c = R.add(b, x)
            d = R.reshape(c, (s * 64,))
            e = R.multiply(d, d)
            R.output(e)
        return e


def test_liveness_positions():
    info = liveness(Chain["main"])
    names = [b.var.name for b in info.bindings]
    assert names == ["a", "b", "c", "d", "e"]
    x, w = info.params
    assert info.uses[x] == [0, 2]
    assert info.last_use(info.bindings[2].var) == 3
    # The returned value is used "at the end".
    assert info.last_use(info.bindings[4].var) == info.end == 5


def test_relax_stage_live_bytes():
    timeline = memory_timeline(Chain["main"])
    assert timeline.stage == "relax"
    at = timeline.evaluate({"s": 10})
    t = 10 * 64 * 4
    # a; b (a dies); c (b dies); d is a view of c; e (c and d die).
    assert at.live_during == [t, 2 * t, 2 * t, t, 2 * t]
    assert at.live_after == [t, t, t, t, t]
    assert at.peak == 2 * t
    assert at.persistent == t + 64 * 64 * 4
    # Largest working set: the add reads b and x... x is a parameter, so b + c.
    assert at.lower_bound == at.persistent + 2 * t
    assert timeline.graph.compare(timeline.peak, timeline.lower_bound) is Ordering.LT


def test_symbolic_peak_is_exact_expression():
    timeline = memory_timeline(Chain["main"])
    for s in (1, 7, 300):
        assert timeline.graph.evaluate(timeline.peak, {"s": s}) == 2 * s * 256


def test_memory_stage_detected_and_matches_relax_stage_here():
    lowered = lower_to_memory_stage(Chain)
    timeline = memory_timeline(lowered["main"], mod=lowered)
    assert timeline.stage == "memory"
    # The stock planner puts a and c in one storage, b in another; e gets its own once b's is
    # gone, while the view d keeps c's storage alive: never more than two s*256-byte storages.
    assert timeline.evaluate({"s": 5}).peak == 2 * 5 * 256


def _measured_peak(mod: tvm.IRModule, args: list[np.ndarray], workspaces=None) -> int:
    exe = tvm.compile(mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    tensors = [tvm.runtime.tensor(a) for a in args]
    with measure_memory(vm, workspaces=workspaces) as measured:
        out = vm["main"](*tensors)
    del out
    return measured.peak_bytes


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_prediction_equals_measured_peak(name):
    """At the final IR stage the timeline predicts the VM's allocations to the byte, kernel
    workspaces included (the measurement counts them from the same kernels)."""
    mod = BUILTIN_MODELS[name]()
    lowered = lower_to_memory_stage(mod)
    timeline = memory_timeline(lowered["main"], mod=lowered)
    workspaces = workspace_table(lowered)
    assert timeline.stage == "memory"
    rng = np.random.default_rng(len(name))
    dim_names = sorted(timeline.graph.dims)
    assert dim_names, "built-in models have a dynamic dim"
    for trial in range(5):
        dims = {d: int(rng.integers(1, 200)) for d in dim_names}
        args = random_arguments(mod["main"], dims, seed=trial)
        predicted = timeline.evaluate(dims).peak
        assert _measured_peak(mod, args, workspaces) == predicted, (name, dims)


def test_no_symbolic_dims_is_constant():
    @I.ir_module
    class Static:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.exp(x)
                z = R.add(y, y)
                R.output(z)
            return z

    timeline = memory_timeline(Static["main"])
    assert timeline.peak.is_constant
    assert timeline.evaluate({}).peak == 2 * 4 * 8 * 4


def test_tuple_keeps_members_alive():
    @I.ir_module
    class Tup:
        @R.function
        def main(x: R.Tensor(("n",), "float32")):
            with R.dataflow():
                a = R.exp(x)
                b = R.exp(x)
                t = (a, b)
                c = R.exp(x)
                u = t[0]
                d = R.add(u, c)
                R.output(d)
            return d

    at = memory_timeline(Tup["main"]).evaluate({"n": 100})
    # a and b stay alive through the tuple until u = t[0]; then only a (via u) with c.
    assert at.live_during == [400, 800, 800, 1200, 1200, 1200]
    assert at.peak == 1200


def test_kill_semantics_keep_storage_alive_through_tensor():
    @I.ir_module
    class Planned:
        @R.function(pure=False)
        def main(shape: R.Shape(["n"])):
            n = T.int64()
            storage = R.memory.alloc_storage(R.shape([n * 4]), 0, "global", "uint8")
            t = R.memory.alloc_tensor(storage, 0, R.shape([n]), "float32")
            _k1 = R.memory.kill_storage(storage)
            other = R.builtin.alloc_tensor(R.shape([n]), "float32", 0)
            _k2 = R.memory.kill_tensor(t)
            out = R.builtin.alloc_tensor(R.shape([2 * n]), "float32", 0)
            return out

    timeline = memory_timeline(Planned["main"])
    assert timeline.stage == "memory"
    at = timeline.evaluate({"n": 10})
    # storage (40 B) lives until t is killed; `other` is never killed so it lives to the end.
    assert at.live_during == [40, 40, 40, 80, 80, 120]
    assert at.live_after == [40, 40, 40, 80, 40, 120]
    assert at.peak == 120


def test_blade_relax_import_counts_stock_vm():
    """After ``import blade_relax``, a VM running a module compiled by stock TVM alone
    (``tvm.compile``'s default pipeline) is measured: both of its storages, exactly."""
    from blade_relax.runtime import memory_stats, reset_memory_stats

    @I.ir_module
    class Stock:
        @R.function
        def main(x: R.Tensor(("s", 64), "float32")):
            with R.dataflow():
                a = R.exp(x)  # planned by StaticPlanBlockMemory: s * 256 bytes
                b = R.add(a, a)  # the output, its own storage: s * 256 bytes
                R.output(b)
            return b

    assert blade_relax.runtime.accounting_installed()
    vm = relax.VirtualMachine(tvm.compile(Stock, "llvm"), tvm.cpu())
    x = tvm.runtime.tensor(np.ones((10, 64), "float32"))
    reset_memory_stats()
    before = memory_stats()
    out = vm["main"](x)
    stats = memory_stats()
    np.testing.assert_allclose(out.numpy(), 2 * np.e * np.ones((10, 64)), rtol=1e-6)
    assert stats["allocations"] == 2
    assert stats["allocated_bytes"] == 2 * 10 * 64 * 4
    assert stats["peak_bytes"] - before["live_bytes"] == 2 * 10 * 64 * 4
    # The intermediate's storage is freed when the call ends; the output's is held by `out`.
    assert stats["live_bytes"] - before["live_bytes"] == 10 * 64 * 4


def test_remat_builtins_keep_the_evicted_tensor_until_regenerate():
    # Without an eviction decision the remat runtime keeps an "evicted" tensor in its frame
    # until `regenerate` hands it back, so the tensor stays live across the gap although its
    # register is killed right after `evict`.
    @I.ir_module
    class Remat:
        @R.function(pure=False)
        def main(shape: R.Shape(["n"])):
            n = T.int64()
            frame = R.call_packed("blade_relax.remat_begin", ty_args=R.Object)
            storage = R.memory.alloc_storage(R.shape([n * 4]), 0, "global", "uint8")
            t = R.memory.alloc_tensor(storage, 0, R.shape([n]), "float32")
            _k1 = R.memory.kill_storage(storage)
            _e = R.call_packed("blade_relax.evict", frame, R.prim_value(0), t, ty_args=R.Object)
            _k2 = R.memory.kill_tensor(t)
            gap = R.builtin.alloc_tensor(R.shape([2 * n]), "float32", 0)
            back = R.call_packed(
                "blade_relax.regenerate",
                frame,
                R.prim_value(0),
                ty_args=R.Tensor((n,), "float32"),
            )
            _k3 = R.vm.kill_object(frame)
            _k4 = R.memory.kill_tensor(back)
            return gap

    at = memory_timeline(Remat["main"]).evaluate({"n": 10})
    # frame, storage, t, kill, evict, kill t (still kept), gap, regenerate (no new bytes),
    # kill frame, kill back (freed here).
    assert at.live_during == [0, 40, 40, 40, 40, 40, 120, 120, 120, 120]
    assert at.live_after == [0, 40, 40, 40, 40, 40, 120, 120, 120, 80]


def test_remat_regenerate_without_kept_tensor_allocates():
    @I.ir_module
    class Regenerate:
        @R.function(pure=False)
        def main(shape: R.Shape(["n"])):
            n = T.int64()
            frame = R.call_packed("blade_relax.remat_begin", ty_args=R.Object)
            back = R.call_packed(
                "blade_relax.regenerate",
                frame,
                R.prim_value(1),
                ty_args=R.Tensor((n,), "float32"),
            )
            return back

    at = memory_timeline(Regenerate["main"]).evaluate({"n": 10})
    assert at.live_during == [0, 40]


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_memo_gives_the_same_timeline(name):
    """A TimelineMemo shares the graph, the bindings' effects and the running sums between
    timelines; every figure equals the timeline built without it, also for a rewrite of the
    function (blocks rebuilt, bindings kept)."""
    from blade_relax.analysis import TimelineMemo

    lowered = lower_to_memory_stage(BUILTIN_MODELS[name]())
    func = lowered["main"]
    memo = TimelineMemo.for_function(func, mod=lowered)
    rebuilt = relax.Function(func.params, func.body, func.ret_ty, func.is_pure, func.attrs)
    plain = memory_timeline(func, mod=lowered)
    for variant in (func, rebuilt, func):
        shared = memory_timeline(variant, memo=memo)
        assert [s.live_during for s in shared.steps] == [s.live_during for s in plain.steps]
        assert [s.live_after for s in shared.steps] == [s.live_after for s in plain.steps]
        assert shared.working_sets == plain.working_sets
        assert shared.lower_bound == plain.lower_bound
        assert plain.graph.compare(shared.peak, plain.peak) is Ordering.EQ
    with pytest.raises(ValueError, match="through the memo"):
        memory_timeline(func, mod=BUILTIN_MODELS[name](), memo=memo)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_evaluation_needs_no_symbolic_sums_and_equals_them(name):
    """``evaluate`` and ``SampledTimeline`` read the allocations only: the steps' symbolic
    running sums are not built for them. Built afterwards, every step's ``live_during`` and
    ``live_after`` and every working set evaluate to the figures ``evaluate`` gave."""
    from blade_relax.analysis import SampledTimeline

    lowered = lower_to_memory_stage(BUILTIN_MODELS[name]())
    timeline = memory_timeline(lowered["main"], mod=lowered)
    graph = timeline.graph
    points = graph.representative_points()[:3]
    evaluated = [timeline.evaluate(point) for point in points]
    sampled = SampledTimeline.of(timeline)
    assert timeline._steps is None
    assert sampled is not None and len(sampled.live_during) == len(timeline.steps)
    for point, at in zip(points, evaluated):
        assert [graph.evaluate(s.live_during, point) for s in timeline.steps] == at.live_during
        assert [graph.evaluate(s.live_after, point) for s in timeline.steps] == at.live_after
        working = max(graph.evaluate(w, point) for w in timeline.working_sets)
        outputs = graph.evaluate(timeline.output_bytes, point)
        assert at.lower_bound == at.persistent + max(working, outputs)
        assert at.names == [s.name for s in timeline.steps]


def test_symbolic_max_keeps_exactly_the_undominated_candidates():
    """The sample screen only skips comparisons that cannot succeed: the Max keeps s*s and
    4096 - s*... (each the largest somewhere) and drops what one of them covers."""
    from blade_relax.analysis.timeline import _symbolic_max
    from blade_relax.symbolic import ShapeGraph, SymbolicExpr

    graph = ShapeGraph.from_ranges({"s": (1, 64)})
    s = SymbolicExpr.dim("s")
    cands = [
        s * s,
        s * 2,
        SymbolicExpr.constant(4096) - s * 60,
        s * s - 1,
        SymbolicExpr.constant(7),
    ]
    peak = _symbolic_max(graph, cands)
    kept = set(peak.expr.args) if peak.expr.func.__name__ == "Max" else {peak.expr}
    assert kept == {(s * s).expr, (SymbolicExpr.constant(4096) - s * 60).expr}
    for v in (1, 30, 64):
        expected = max(graph.evaluate(c, {"s": v}) for c in cands)
        assert graph.evaluate(peak, {"s": v}) == expected


def test_memo_bytes_of_equals_the_graph():
    """TimelineMemo.bytes_of remembers sizes per type; each equals ``graph.bytes_of``, and a
    value of unknown size keeps its own opaque size."""
    from blade_relax.analysis import TimelineMemo

    @I.ir_module
    class Sizes:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), u: R.Tensor(ndim=2, dtype="float32")):
            with R.dataflow():
                a = R.add(x, x)
                b = R.add(a, x)
                c = R.add(u, u)
                d = R.add(c, u)
                e = R.concat((a, b), axis=0)
                R.output(b, d, e)
            return (b, d, e)

    func = Sizes["main"]
    memo = TimelineMemo.for_function(func, mod=Sizes)
    variables = [b.var for blk in func.body.blocks for b in blk.bindings]
    for var in variables + variables:
        assert memo.bytes_of(var).expr == memo.graph.bytes_of(var).expr
    by_name = {v.name: memo.bytes_of(v) for v in variables}
    assert by_name["c"].is_unknown and by_name["d"].is_unknown
    assert by_name["c"].expr != by_name["d"].expr
    plain = memory_timeline(func, mod=Sizes)
    shared = memory_timeline(func, memo=memo)
    assert [s.live_during for s in shared.steps] == [s.live_during for s in plain.steps]

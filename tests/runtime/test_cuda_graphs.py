"""CUDA graphs per length bucket: the buckets, the padding, the static copies, the shared pool.

Everything but the last test runs on the CPU: CUDA executables are built for ``sm_90`` without
a GPU (their pool read from the IR TVM produced), and the bucketed runner runs the same copies
on the llvm target, where nothing is captured.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.analysis.cuda_graph_pool import PoolPlan, merged_pool
from blade_relax.bench.bucketing import bucket_length
from blade_relax.contract import CUDA_GRAPH_RUN, LENGTH_BUCKET_ATTR, bucket_function_name
from blade_relax.gpuprog.buckets import compile_buckets
from blade_relax.runtime.cuda_graphs import (
    BucketedRunner,
    LengthBuckets,
    Padding,
    PaddingNotExactError,
)
from blade_relax.transform import SpecializeBuckets

CUDA = {"kind": "cuda", "arch": "sm_90"}
HIDDEN, WIDE = 16, 32


def _per_token_mlp(upper: int = 64) -> tvm.IRModule:
    """``main(x: (s, 16), w1, w2, w3) = relu(relu(x @ w1) @ w3) @ w2``: every output row
    depends on its own input row only, so padding the length is exact. The middle layer is
    what a graph captures (the first reads the input, the last writes the output: neither has
    a fixed address)."""
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((s, HIDDEN), "float32"))
    w1 = relax.Var("w1", relax.TensorType((HIDDEN, WIDE), "float32"))
    w2 = relax.Var("w2", relax.TensorType((WIDE, HIDDEN), "float32"))
    w3 = relax.Var("w3", relax.TensorType((WIDE, WIDE), "float32"))
    with bb.function("main", [x, w1, w2, w3]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w1)))
            h = bb.emit(relax.op.nn.relu(relax.op.matmul(h, w3)))
            out = bb.emit_output(relax.op.matmul(h, w2))
        bb.emit_func_output(out)
    mod = bb.get()
    func = mod["main"].with_attr("num_input", 1)
    func = func.with_attr("tir_var_upper_bound", {"s": upper})
    func = func.with_attr("tir_var_lower_bound", {"s": 1})
    mod["main"] = func
    return mod


def _weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((HIDDEN, WIDE)) / HIDDEN**0.5).astype("float32"),
        (rng.standard_normal((WIDE, HIDDEN)) / WIDE**0.5).astype("float32"),
        (rng.standard_normal((WIDE, WIDE)) / WIDE**0.5).astype("float32"),
    ]


def _mlp(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> np.ndarray:
    return np.maximum(np.maximum(x @ w1, 0) @ w3, 0) @ w2


# ------------------------------------------------------------------------------- buckets
def test_bucket_boundaries_by_spec_and_bound():
    assert LengthBuckets.of("pow2", 64).boundaries == (1, 2, 4, 8, 16, 32, 64)
    assert LengthBuckets.of("pow2", 100, lower=2).boundaries == (2, 4, 8, 16, 32, 64, 100)
    assert LengthBuckets.of(16, 50).boundaries == (16, 32, 48, 50)
    assert LengthBuckets.of([64, 16, 32, 16], 64).boundaries == (16, 32, 64)
    for bad in ([128], [0, 8]):
        with pytest.raises(ValueError, match="outside"):
            LengthBuckets.of(bad, 64)
    with pytest.raises(ValueError, match="strictly increasing"):
        LengthBuckets((8, 8))
    with pytest.raises(ValueError, match="at least one"):
        LengthBuckets(())
    with pytest.raises(ValueError, match="'pow2', a positive step"):
        LengthBuckets.of(0, 64)


def test_the_bucket_of_a_length_and_the_lengths_refused():
    buckets = LengthBuckets.of([16, 32, 64], 64)
    assert [buckets.bucket_for(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    with pytest.raises(ValueError, match="at least 1"):
        buckets.bucket_for(0)
    with pytest.raises(ValueError, match="above the largest bucket 64"):
        buckets.bucket_for(65)


@pytest.mark.parametrize("spec", ["pow2", 16, 7])
def test_buckets_agree_with_the_benchmarks_bucketing(spec):
    # The bench's tvm-bucketed configurations and the CUDA-graph buckets pad alike.
    upper = 300
    buckets = LengthBuckets.of(spec, upper)
    assert all(buckets.bucket_for(n) == bucket_length(n, spec, upper) for n in range(1, upper + 1))


# ------------------------------------------------------------------------------- padding
def test_padding_pads_at_the_end_and_cuts_back():
    padding = Padding(input_axes=(1, None), output_axes=(1, None), fill=(7,), causal=True)
    ids, static = np.array([[1, 2, 3]]), np.ones(4)
    padded = padding.pad([ids, static], 5)
    np.testing.assert_array_equal(padded[0], [[1, 2, 3, 7, 7]])
    assert padded[1] is not None and padded[1].shape == (4,)
    assert padding.length_of([ids, static]) == 3
    out = padding.cut([np.arange(10).reshape(1, 5, 2), np.zeros(2)], 3)
    assert out[0].shape == (1, 3, 2) and out[1].shape == (2,)
    with pytest.raises(ValueError, match="longer"):
        padding.pad([ids, static], 2)
    with pytest.raises(ValueError, match="disagree"):
        Padding((0, 0), (0,), causal=True).length_of([np.ones(3), np.ones(4)])


def test_padding_nobody_asserted_exact_is_refused():
    with pytest.raises(PaddingNotExactError, match="causal=True"):
        Padding(input_axes=(0,), output_axes=(0,)).check()
    with pytest.raises(PaddingNotExactError):
        BucketedRunner(None, tvm.cpu(), LengthBuckets((8,)), Padding((0,), (0,)))


# ----------------------------------------------------------------------------- the pass
def test_specialize_buckets_makes_static_copies():
    specializer = SpecializeBuckets("s", [32, 8])
    mod = specializer(_per_token_mlp())
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    assert names == [bucket_function_name("main", "s", n) for n in (32, 8)]
    copy = mod["main_s8"]
    assert [int(v) for v in copy.params[0].ty.shape.values] == [8, HIDDEN]
    assert dict(copy.attrs[LENGTH_BUCKET_ATTR])["s"] == 8
    assert "tir_var_upper_bound" not in copy.attrs and copy.attrs["global_symbol"] == "main_s8"
    assert not relax.analysis.free_symbolic_vars(copy)
    assert specializer.last_result.functions[0].changes == ("main_s8", "main_s32")
    kept = SpecializeBuckets("s", [8], keep_original=True)(_per_token_mlp())
    assert {gv.name_hint for gv in kept.get_global_vars()} == {"main", "main_s8"}


def test_specialize_buckets_refuses_lengths_outside_the_declared_range():
    with pytest.raises(ValueError, match=r"s=128 is outside the range main declares"):
        SpecializeBuckets("s", [16, 128])(_per_token_mlp(upper=64))
    with pytest.raises(ValueError, match="no symbolic dim 'n'"):
        SpecializeBuckets("n", [16])(_per_token_mlp())
    with pytest.raises(ValueError, match="no function 'forward'"):
        SpecializeBuckets("s", [16], function="forward")(_per_token_mlp())


# -------------------------------------------------------------------------------- the pool
def test_the_merge_gives_each_rank_its_largest_storage():
    assert merged_pool({"a": [3, 1], "b": [2, 2, 2]}) == [3, 2, 2]
    plan = PoolPlan({"a": (3, 1), "b": (2, 2, 2)}, (3, 2, 2))
    assert plan.largest_function == "b" and plan.largest_bytes == 6
    assert plan.pool_bytes == 7 and plan.excess_bytes == 1 and plan.unshared_bytes == 10


def test_the_pool_is_the_largest_buckets_and_adding_buckets_adds_nothing():
    mod = _per_token_mlp()
    one = compile_buckets(mod, CUDA, [64])
    many = compile_buckets(mod, CUDA, [4, 8, 16, 32, 64])
    assert one.graphs and many.graphs
    assert CUDA_GRAPH_RUN in many.executable.as_text()
    assert many.pool.largest_function == "main_s64"
    # What TVM allocates (its cuda_graph_alloc) is what the plan says, and is the largest
    # bucket's planned static storage: the smaller buckets share it.
    assert sorted(many.allocated_pool, reverse=True) == list(many.pool.pool)
    assert many.pool.pool_bytes == many.pool.largest_bytes == one.pool.pool_bytes > 0
    assert many.pool.excess_bytes == 0
    assert many.pool.unshared_bytes > many.pool.pool_bytes
    # Two storages of (64, 32) floats: the hidden activations, live together in the middle
    # layer (the output has a storage of its own, outside the pool).
    assert one.pool.functions == {"main_s64": (64 * WIDE * 4, 64 * WIDE * 4)}


# ------------------------------------------------------------------------ running on the CPU
def test_padded_runs_give_the_unpadded_outputs_on_the_cpu():
    mod = _per_token_mlp()
    build = compile_buckets(mod, "llvm", [8, 16, 64])
    assert not build.graphs and build.input_axes == [0] and build.output_axes == [0]
    padding = Padding(tuple(build.input_axes), tuple(build.output_axes), causal=True)
    weights = _weights()
    runner = BucketedRunner(
        build.executable, tvm.cpu(), LengthBuckets(build.lengths), padding, weights
    )
    assert not runner.graphs
    assert set(runner.capture([np.zeros((1, HIDDEN), "float32")])) == {8, 16, 64}
    rng = np.random.default_rng(1)
    for length in (1, 8, 9, 40, 64):
        x = rng.standard_normal((length, HIDDEN)).astype("float32")
        (out,) = runner(x)
        assert out.shape == (length, HIDDEN)
        np.testing.assert_allclose(out, _mlp(x, *weights), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="above the largest bucket"):
        runner(np.zeros((65, HIDDEN), "float32"))
    with pytest.raises(ValueError, match="no copy main_s32"):
        BucketedRunner(build.executable, tvm.cpu(), LengthBuckets((8, 32)), padding, weights)


@pytest.fixture(scope="module")
def tiny_gpt2():
    pytest.importorskip("transformers")
    from blade_relax.bench.workloads import ModelSizes, build_workload

    sizes = ModelSizes(
        layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
    )
    return build_workload("gpt2-infer", sizes).graph


def test_a_causal_lm_padded_to_its_bucket_matches_the_dynamic_function(tiny_gpt2):
    from blade_relax.pipeline import get_pipeline

    graph = tiny_gpt2
    buckets = LengthBuckets.of([16, 32, 64], graph.dims["s"].upper, graph.dims["s"].lower)
    build = compile_buckets(graph.mod, "llvm", buckets.boundaries)
    padding = Padding(tuple(build.input_axes), tuple(build.output_axes), causal=True)
    runner = BucketedRunner(build.executable, tvm.cpu(), buckets, padding, graph.params)
    dynamic = tvm.compile(graph.mod, "llvm", relax_pipeline=get_pipeline("llvm", remat=False))
    vm = relax.VirtualMachine(dynamic, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    for length in (5, 16, 17, 40):
        inputs = graph.random_inputs({"s": length}, seed=length)
        (logits,) = runner(*inputs)
        want = vm["main"](tvm.runtime.tensor(inputs[0]), *params)[0].numpy()
        assert logits.shape == want.shape == (1, length, graph.int_input_high)
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits, graph.reference(inputs)[0], rtol=1e-4, atol=1e-4)


def test_a_causal_lm_builds_for_cuda_with_one_pool(tiny_gpt2):
    graph = tiny_gpt2
    build = compile_buckets(graph.mod, CUDA, [16, 32, 64])
    text = build.executable.as_text()
    assert build.graphs and text.count(CUDA_GRAPH_RUN) >= 3  # a captured region per bucket
    assert build.input_axes == [1] and build.output_axes == [1]
    plan = build.pool
    assert sorted(build.allocated_pool, reverse=True) == list(plan.pool)
    assert plan.largest_function == "main_s64"
    assert plan.pool_bytes == plan.largest_bytes and plan.excess_bytes == 0
    assert set(plan.functions) == {"main_s16", "main_s32", "main_s64"}
    # Each bucket alone would need its own storages: the sharing saves all but the largest.
    smaller = sum(sum(plan.functions[n]) for n in ("main_s16", "main_s32"))
    assert plan.unshared_bytes - plan.pool_bytes == smaller > 0


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_graphs_replay_each_bucket_in_one_pool_on_cuda():
    from blade_relax.runtime import memory_stats, reset_memory_stats
    from blade_relax.runtime.devices import configure_cuda_compiler

    configure_cuda_compiler()
    dev = tvm.cuda(0)
    major, minor = dev.compute_version.split(".")
    target = {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    build = compile_buckets(_per_token_mlp(), target, [8, 16, 64])
    padding = Padding(tuple(build.input_axes), tuple(build.output_axes), causal=True)
    weights = _weights()
    reset_memory_stats()
    runner = BucketedRunner(build.executable, dev, LengthBuckets(build.lengths), padding, weights)
    assert runner.graphs
    runner.capture([np.zeros((1, HIDDEN), "float32")])
    pool = memory_stats()["live_bytes"]
    assert pool >= build.pool.pool_bytes  # allocated once, by the first capture
    rng = np.random.default_rng(2)
    for length in (3, 8, 16, 40, 64, 40):
        x = rng.standard_normal((length, HIDDEN)).astype("float32")
        (out,) = runner(x)
        np.testing.assert_allclose(out, _mlp(x, *weights), rtol=1e-4, atol=1e-4)
    stats = memory_stats()
    # Replays allocate no pool again: only each call's output storage on top of it.
    assert stats["peak_bytes"] <= pool + 64 * HIDDEN * 4 + (1 << 10)

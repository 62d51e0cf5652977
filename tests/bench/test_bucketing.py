"""Bucketing: bucket lengths, padding, and a padded step that computes the unpadded one."""

from __future__ import annotations

import numpy as np
import pytest

from blade_relax.bench.bucketing import (
    IGNORE_INDEX,
    bucket_length,
    check_paddable,
    pad_to_bucket,
    parse_bucket,
)
from blade_relax.bench.configs import get_config


def test_bucket_lengths_round_up_and_stop_at_the_bound():
    assert [bucket_length(n, 64, 2048) for n in (1, 64, 65, 2000, 2048)] == [
        64,
        64,
        128,
        2048,
        2048,
    ]
    assert [bucket_length(n, 256, 300) for n in (2, 256, 257)] == [256, 256, 300]
    assert [bucket_length(n, "pow2", 2048) for n in (2, 3, 64, 65, 1500)] == [
        2,
        4,
        64,
        128,
        2048,
    ]
    assert bucket_length(200, "pow2", 200) == 200  # capped: the last bucket is shorter
    with pytest.raises(ValueError, match="outside"):
        bucket_length(65, 64, 64)
    with pytest.raises(ValueError, match="positive number of tokens"):
        bucket_length(3, 0, 64)


def test_the_family_parses_its_argument():
    config = get_config("tvm-bucketed@64")
    assert config.bucket == 64 and not config.static and not config.keep_bounds
    assert get_config("tvm-bucketed@pow2").bucket == "pow2"
    assert parse_bucket("256") == 256
    for bad in ("0", "-3", "big", "1.5"):
        with pytest.raises(ValueError, match="tvm-bucketed@"):
            get_config(f"tvm-bucketed@{bad}")


def test_padding_masks_the_labels():
    ids = np.array([[5, 6, 7]], dtype="int64")
    labels = np.array([[6, 7, 8]], dtype="int64")
    padded_ids, padded_labels = pad_to_bucket(["input_ids", "labels"], [ids, labels], 5)
    np.testing.assert_array_equal(padded_ids, [[5, 6, 7, 0, 0]])
    np.testing.assert_array_equal(padded_labels, [[6, 7, 8, IGNORE_INDEX, IGNORE_INDEX]])
    with pytest.raises(ValueError, match="above the bucket"):
        pad_to_bucket(["input_ids", "labels"], [ids, labels], 2)
    with pytest.raises(ValueError, match="causal LM training step"):
        check_paddable(["x", "onehot"])


@pytest.fixture(scope="module")
def small_llama():
    pytest.importorskip("transformers")
    from blade_relax.bench.workloads import ModelSizes, build_workload

    sizes = ModelSizes(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)
    return build_workload("llama-train", sizes)


@pytest.mark.parametrize("length", [5, 17, 40])
def test_a_padded_step_has_the_loss_and_gradients_of_the_unpadded_one(small_llama, length):
    # The torch step itself, padded to the next multiple of 16: the masked labels leave the
    # mean over the same positions, and causal attention keeps the earlier positions as they
    # were, so loss and every gradient are those of the unpadded step.
    graph = small_llama.graph
    inputs = small_llama.inputs(length)
    padded = pad_to_bucket(graph.input_names, inputs, bucket_length(length, 16, 256))
    assert padded[0].shape[1] > length
    unpadded_out = graph.reference(inputs)
    padded_out = graph.reference(padded)
    assert len(unpadded_out) == len(padded_out) == 1 + len(graph.params)
    for name, a, b in zip(graph.output_names, unpadded_out, padded_out):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=name)
    # Not by accident: the loss of the padded step with its pad labels left in differs.
    unmasked = [padded[0], np.where(padded[1] == IGNORE_INDEX, 1, padded[1])]
    assert abs(float(graph.reference(unmasked)[0]) - float(unpadded_out[0])) > 1e-4


def test_the_bucketed_config_runs_the_padded_graph_and_matches_torch(small_llama):
    from blade_relax.bench import run_benchmark

    result = run_benchmark(small_llama, ["tvm-bucketed@16"], [5, 12, 17], repeat=1)
    rows = {(m.config, m.seq_len): m for m in result.measurements}
    for n in (5, 12, 17):
        bucketed = rows[("tvm-bucketed@16", n)]
        assert bucketed.error is None and bucketed.correct, bucketed  # against unpadded torch
        assert bucketed.padded_to == (16 if n <= 16 else 32)
        # The caller holds the padded inputs: 2 int64 arrays of the bucket's length.
        assert bucketed.caller_bytes == small_llama.graph.param_bytes + 2 * 8 * bucketed.padded_to
    # 5 and 12 share the bucket of 16 (one compilation, the same peak); 17 needs another.
    assert [rows[("tvm-bucketed@16", n)].compilations for n in (5, 12, 17)] == [1, 1, 2]
    assert rows[("tvm-bucketed@16", 12)].compile_time_s == 0.0
    assert rows[("tvm-bucketed@16", 5)].peak_bytes == rows[("tvm-bucketed@16", 12)].peak_bytes
    assert rows[("tvm-bucketed@16", 17)].peak_bytes > rows[("tvm-bucketed@16", 12)].peak_bytes
    summary = {c.name: c for c in result.configs}
    assert summary["tvm-bucketed@16"].compilations == 2
    assert summary["tvm-bucketed@16"].settings["bucket"] == 16

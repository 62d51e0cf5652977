"""PyTorch with scaled-dot-product attention as a baseline (``torch-eager-sdpa``).

The registered Hugging Face workloads build their models with eager attention (what the
compiled step imports); transformers' default is SDPA, which keeps no attention matrix for the
backward pass. On a one-layer Llama: the SDPA step computes the eager step's loss and
gradients with a lower peak once the attention matrix counts; the shared module comes back
with its own attention; a workload without a Hugging Face model is refused clearly; the
predicted peak (meta tensors) is the measured one, with and without padding.
"""

from __future__ import annotations

import numpy as np
import pytest

from blade_relax.bench import ModelSizes, build_workload, run_benchmark
from blade_relax.bench.configs import get_config
from blade_relax.bench.predict import predict_benchmark
from blade_relax.bench.runner import _TorchRunner

from ._torch_steps import measure_torch_step

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SIZES = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
)
LENGTHS = [12, 57]


@pytest.fixture(scope="module")
def workload():
    return build_workload("llama-train", SIZES)


def test_the_configs_are_registered():
    eager, compiled = get_config("torch-eager-sdpa"), get_config("torch-compile-sdpa")
    assert eager.attention == compiled.attention == "sdpa"
    assert not eager.compile and compiled.compile
    assert get_config("torch-eager").attention is None


def test_same_loss_and_gradients_as_eager_attention_and_a_lower_peak(workload):
    model = workload.graph.torch_module.model
    assert model.config._attn_implementation == "eager"
    eager_row, eager = measure_torch_step(workload, "torch-eager", LENGTHS[-1])
    sdpa_row, sdpa = measure_torch_step(workload, "torch-eager-sdpa", LENGTHS[-1])
    assert model.config._attn_implementation == "eager"  # restored after the step
    assert len(sdpa) == len(eager) == 1 + len(workload.graph.param_names)
    for got, want in zip(sdpa, eager):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # No (heads, s, s) matrix kept for the backward pass.
    assert 0 < sdpa_row.step_peak_bytes < eager_row.step_peak_bytes


def test_predicted_peaks_are_the_measured_ones(workload):
    configs = ["torch-eager-sdpa"]
    predicted = predict_benchmark(workload, configs, LENGTHS)
    measured = run_benchmark(workload, configs, LENGTHS, repeat=1)
    assert measured.all_correct
    assert measured.configs[0].settings["attention"] == "sdpa"
    guess = {m.seq_len: m for m in predicted.measurements}
    for real in measured.measurements:
        row = guess[real.seq_len]
        assert row.error is None and row.source == "predicted", row
        assert row.step_peak_bytes == real.step_peak_bytes, real.seq_len


def test_padded_batches_are_predicted_as_measured():
    """A batch with padding gets transformers' boolean mask (turned additive for SDPA); one
    without gets none: the prediction answers transformers' test of the mask from the batch."""
    sizes = ModelSizes(
        layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=48
    )
    workload = build_workload("llama-sft", sizes)
    lengths = [20, 48]
    predicted = predict_benchmark(workload, ["torch-eager-sdpa"], lengths)
    measured = run_benchmark(workload, ["torch-eager-sdpa"], lengths, repeat=1)
    masks = [
        workload.inputs(n)[workload.graph.input_names.index("attention_mask")] for n in lengths
    ]
    assert any(not mask.all() for mask in masks)  # padding at some length
    for row, real in zip(predicted.measurements, measured.measurements):
        assert real.error is None and real.correct, real
        assert row.step_peak_bytes == real.step_peak_bytes, real.seq_len


def test_relax_native_workload_is_refused_clearly():
    tiny = ModelSizes(layers=1, hidden=16, intermediate=32, vocab=8, max_seq_len=48)
    workload = build_workload("mlp-train", tiny)
    with pytest.raises(ValueError, match="torch-eager-sdpa: attention='sdpa' needs a Hugging"):
        _TorchRunner(get_config("torch-eager-sdpa"), workload.graph)

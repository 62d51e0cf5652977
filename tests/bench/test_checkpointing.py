"""Hugging Face gradient checkpointing as a PyTorch baseline (``torch-eager-ckpt``).

On a two-layer Llama: the checkpointed step computes the loss and gradients of the plain one,
with a lower step peak where the activations outweigh the gradients; the shared module comes
back as it was; a workload without a Hugging Face model is refused with a clear message;
``torch_fit(..., checkpointing=True)`` trains as the plain loop does.
"""

from __future__ import annotations

import numpy as np
import pytest

from blade_relax.bench import ModelSizes, build_workload, run_benchmark
from blade_relax.bench.configs import get_config
from blade_relax.bench.runner import _TorchRunner

from ._torch_steps import measure_torch_step

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SIZES = ModelSizes(
    layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, max_seq_len=64
)
LENGTH = 48


@pytest.fixture(scope="module")
def workload():
    return build_workload("llama-train", SIZES)


def _checkpointing(module) -> bool:
    return any(getattr(sub, "gradient_checkpointing", False) for sub in module.modules())


@pytest.fixture(scope="module")
def steps(workload):
    return {
        name: measure_torch_step(workload, name, LENGTH)
        for name in ("torch-eager", "torch-eager-ckpt")
    }


def test_same_loss_and_gradients_as_eager(workload, steps):
    (_, plain), (_, ckpt) = steps["torch-eager"], steps["torch-eager-ckpt"]
    assert len(ckpt) == len(plain) == 1 + len(workload.graph.param_names)
    for got, want in zip(ckpt, plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_step_peak_is_below_eager(steps):
    plain, ckpt = steps["torch-eager"][0], steps["torch-eager-ckpt"][0]
    assert 0 < ckpt.step_peak_bytes < plain.step_peak_bytes


def test_the_benchmark_runs_it_against_the_reference(workload):
    result = run_benchmark(workload, ["torch-eager-ckpt"], [16, LENGTH], repeat=1)
    assert result.all_correct
    assert [m.max_rel_error for m in result.measurements] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert result.configs[0].settings["checkpointing"] is True


@pytest.mark.parametrize("training", [False, True])
def test_module_is_restored(workload, training):
    module = workload.graph.torch_module
    before = module.training
    module.train(training)
    try:
        measure_torch_step(workload, "torch-eager-ckpt", 16)
        assert not _checkpointing(module)
        assert all(sub.training == training for sub in module.modules())
        assert not getattr(module.model, "_require_grads_hooks", None)
    finally:
        module.train(before)


def test_restored_when_the_step_fails(workload):
    from blade_relax.training.hf_checkpointing import gradient_checkpointing

    module = workload.graph.torch_module
    flags = [sub.training for sub in module.modules()]
    module.model.model.eval()  # mixed flags: each comes back as it was
    mixed = [sub.training for sub in module.modules()]
    try:
        with pytest.raises(RuntimeError, match="inside"), gradient_checkpointing(module) as model:
            assert model is module.model and _checkpointing(module) and module.model.training
            raise RuntimeError("inside")
        assert not _checkpointing(module)
        assert [sub.training for sub in module.modules()] == mixed
    finally:
        for sub, flag in zip(module.modules(), flags):
            sub.training = flag


def test_relax_native_workload_is_refused_clearly():
    tiny = ModelSizes(layers=1, hidden=16, intermediate=32, vocab=8, max_seq_len=48)
    workload = build_workload("mlp-train", tiny)
    with pytest.raises(ValueError, match="torch-eager-ckpt: gradient checkpointing needs a Hugg"):
        _TorchRunner(get_config("torch-eager-ckpt"), workload.graph)
    result = run_benchmark(workload, ["torch-eager", "torch-eager-ckpt"], [8], repeat=1)
    rows = {m.config: m for m in result.measurements}
    assert rows["torch-eager"].error is None and rows["torch-eager"].correct
    assert rows["torch-eager-ckpt"].error.startswith("ValueError: torch-eager-ckpt: gradient")
    assert "Hugging Face" in rows["torch-eager-ckpt"].error


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_non_reentrant_checkpointing_needs_no_input_hooks_with_a_frozen_embedding():
    """A PEFT model: the embedding frozen, the adapter's gradients unchanged without the
    input-embedding hooks (which ``gradient_checkpointing`` removes)."""
    peft = pytest.importorskip("peft")
    from blade_relax.bench.workloads import llama_model
    from blade_relax.frontend.hf import step_wrappers
    from blade_relax.training.hf_checkpointing import gradient_checkpointing

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(llama_model(SIZES), config)
    assert not model.get_input_embeddings().weight.requires_grad
    step = step_wrappers()[1](model)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, SIZES.vocab, (1, LENGTH)))

    def gradients():
        model.zero_grad(set_to_none=True)
        (loss,) = step(ids, ids)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]

    plain = gradients()
    with gradient_checkpointing(step) as inner:
        assert inner is model and not getattr(model, "_require_grads_hooks", None)
        ckpt = gradients()
    assert not _checkpointing(step)
    assert len(plain) == len(ckpt) > 1
    for got, want in zip(ckpt, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_torch_fit_with_checkpointing_trains_as_without(workload):
    from blade_relax.training import SGD, torch_fit
    from blade_relax.training.data import synthetic_batches

    batches = synthetic_batches(SIZES.vocab, [LENGTH, 32])
    plain = torch_fit(workload.graph, SGD(lr=0.1), batches, 2)
    ckpt = torch_fit(workload.graph, SGD(lr=0.1), batches, 2, checkpointing=True)
    assert (plain.label, ckpt.label) == ("torch-eager", "torch-eager-ckpt")
    assert len(ckpt.records) == 2
    np.testing.assert_allclose(
        [r.loss for r in ckpt.records], [r.loss for r in plain.records], rtol=1e-5
    )
    assert ckpt.records[0].step_peak_bytes < plain.records[0].step_peak_bytes
    for got, want in zip(ckpt.parameters, plain.parameters):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert not _checkpointing(workload.graph.torch_module)


def test_torch_fit_refuses_a_relax_native_graph():
    from blade_relax.training import SGD, torch_fit

    tiny = ModelSizes(layers=1, hidden=16, intermediate=32, vocab=8, max_seq_len=48)
    graph = build_workload("mlp-train", tiny).graph
    with pytest.raises(ValueError, match="needs a Hugging Face model"):
        torch_fit(graph, SGD(lr=0.1), [graph.random_inputs({"s": 8})], 1, checkpointing=True)

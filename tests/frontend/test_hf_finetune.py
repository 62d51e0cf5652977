"""Fine-tuning as users run it: padded batches with ``attention_mask``, prompt-masked labels,
LoRA adapters (PEFT) on a frozen base.

Each graph is compiled once with symbolic ``b`` and ``s`` and checked against torch (loss and
every gradient) on batches padded on the left and on the right, with random prompt lengths, at
several shapes, by the stock pipeline and by blade_relax's default one.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.bench.sft import pad_batch
from blade_relax.bench.workloads import ModelSizes, llama_model
from blade_relax.frontend import flatten_outputs, import_training_step
from blade_relax.pipeline import stock_pipeline

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

MAX_LEN = 48
MAX_BATCH = 4
# Loss and gradients agree with torch to about 1e-6 (float32, other summation orders).
TOLERANCE = 1e-4
TINY = ModelSizes(
    layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96, max_seq_len=MAX_LEN
)
# (batch, pairs' lengths, padding side): shapes that differ in b and s, both sides.
CASES = [
    ([(3, 9), (5, 2), (1, 4)], "left"),
    ([(2, 20), (11, 6)], "right"),
    ([(7, 30), (4, 4), (2, 12), (9, 1)], "left"),
]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batches(seed: int = 0) -> list[dict[str, np.ndarray]]:
    return [
        pad_batch(pairs, TINY.vocab, padding_side=side, seed=seed + i)
        for i, (pairs, side) in enumerate(CASES)
    ]


def _relative(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _check_against_torch(graph, pipeline) -> None:
    exe = tvm.compile(graph.with_upper_bounds(False).mod, "llvm", relax_pipeline=pipeline)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    for batch in _batches():
        inputs = [batch[name] for name in graph.input_names]
        graph.bind_dims(inputs)
        out = flatten_outputs(vm["main"](*[tvm.runtime.tensor(a) for a in inputs], *params))
        reference = graph.reference(inputs)
        assert len(out) == len(reference) == 1 + graph.num_trainable
        for name, got, want in zip(graph.output_names, out, reference):
            assert got.numpy().shape == want.shape, name
            assert _relative(got.numpy(), want) <= TOLERANCE, name


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    # PEFT starts lora_B at zero (the adapter adds nothing); draw it so gradients flow to A too.
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return lora


@pytest.fixture(scope="module")
def masked():
    return import_training_step(
        llama_model(TINY),
        max_seq_len=MAX_LEN,
        max_batch_size=MAX_BATCH,
        attention_mask=True,
    )


@pytest.fixture(scope="module")
def lora():
    return import_training_step(
        _lora(llama_model(TINY)),
        max_seq_len=MAX_LEN,
        max_batch_size=MAX_BATCH,
        attention_mask=True,
    )


def test_masked_step_takes_ids_mask_and_labels_with_symbolic_batch(masked):
    assert masked.input_names == ["input_ids", "attention_mask", "labels"]
    assert masked.input_shapes == [("b", "s")] * 3
    assert set(masked.dims) == {"b", "s"}
    assert masked.num_frozen == 0
    assert [str(p.name) for p in masked.main.params[:3]] == masked.input_names


def test_masked_step_matches_torch_stock(masked):
    _check_against_torch(masked, stock_pipeline("llvm"))


def test_masked_step_matches_torch_blade_relax(masked, well_formed_checks):
    _check_against_torch(masked, blade_relax.get_pipeline("llvm"))


def test_padding_changes_nothing_but_the_padding(masked):
    """A sequence alone and the same sequence padded (left or right) in a batch: same loss."""
    exe = tvm.compile(masked.with_upper_bounds(False).mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in masked.params]

    def loss(batch):
        args = [tvm.runtime.tensor(batch[n]) for n in masked.input_names]
        return float(flatten_outputs(vm["main"](*args, *params))[0].numpy())

    alone = pad_batch([(5, 9)], TINY.vocab, seed=3)
    for side in ("left", "right"):
        padded = pad_batch([(5, 9)], TINY.vocab, padding_side=side, seed=3, length=30)
        assert loss(padded) == pytest.approx(loss(alone), rel=1e-5)


def test_left_padding_without_the_mask_would_differ(masked):
    """The mask matters: the same left-padded batch with a mask of ones gives another loss."""
    batch = pad_batch([(6, 10), (2, 3)], TINY.vocab, padding_side="left", seed=5)
    ones = {**batch, "attention_mask": np.ones_like(batch["attention_mask"])}
    order = masked.input_names
    with_mask = masked.reference([batch[n] for n in order])[0]
    without = masked.reference([ones[n] for n in order])[0]
    assert abs(float(with_mask) - float(without)) > 1e-4


def test_lora_freezes_the_base_and_trains_the_adapters(lora):
    assert lora.num_frozen > 0
    assert all("lora_" in name for name in lora.trainable_names)
    assert not any("lora_" in name for name in lora.frozen_names)
    assert lora.output_names == ["loss"] + [f"grad:{n}" for n in lora.trainable_names]
    assert len(lora.torch_params) == lora.num_trainable
    func_params = lora.main.params[len(lora.input_names) :]
    for param, array in zip(func_params, lora.params):
        assert tuple(int(v) for v in param.ty.shape.values) == array.shape


def test_lora_step_matches_torch(lora, well_formed_checks):
    _check_against_torch(lora, blade_relax.get_pipeline("llvm"))


def test_training_step_gives_frozen_parameters_no_state_and_no_update(lora):
    from blade_relax.training import AdamW, build_training_step

    step = build_training_step(lora, AdamW())
    main = step.mod["main"]
    n_in, n_train = len(lora.input_names), lora.num_trainable
    assert len(step.state_names) == 2 * n_train
    assert len(main.params) == n_in + len(lora.param_names) + 2 * n_train + 1
    assert len(main.ret_ty.fields) == 1 + n_train + 2 * n_train

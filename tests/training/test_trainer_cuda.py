"""Training on a CUDA GPU: the step with its in-graph optimizer builds for CUDA on any machine
(every kernel bound to GPU threads, the optimizer's in-place updates included), and on a GPU
one rank on NCCL trains as PyTorch does and peaks as predicted."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import tvm

import blade_relax
from blade_relax.bench.workloads import ModelSizes, llama_model
from blade_relax.frontend.hf import import_training_step
from blade_relax.pipeline import lower_to_memory_stage
from blade_relax.runtime.devices import configure_cuda_compiler
from blade_relax.training import AdamW, ZeroSharding, build_training_step, torch_fit

# A head size of 32 and as many key/value heads as heads: what dlight schedules and torch
# 2.11's export accepts (see tests/e2e/test_cuda_gpu.py).
SIZES = ModelSizes(
    layers=1, hidden=64, heads=2, kv_heads=2, intermediate=128, vocab=64, max_seq_len=32
)
LENGTHS = (9, 16, 5)


def _target() -> tvm.target.Target:
    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "") if dev.exist else "sm_90"
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _adamw() -> AdamW:
    return AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


def _batches() -> list[dict[str, np.ndarray]]:
    """Two rows a batch, labels -100 on part of one row (padding as a collator writes it)."""
    rng = np.random.default_rng(0)
    out = []
    for s in LENGTHS:
        ids = rng.integers(0, SIZES.vocab, size=(2, s)).astype("int64")
        labels = ids.copy()
        labels[1, s // 2 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture(scope="module")
def graph():
    pytest.importorskip("transformers")
    model = llama_model(SIZES, seed=0, attn_implementation=None)
    return import_training_step(model, max_seq_len=SIZES.max_seq_len, max_batch_size=2)


def _bound(func: tvm.tirx.PrimFunc) -> bool:
    return "T.thread_binding" in func.script() or "launch_thread" in func.script()


@pytest.mark.parametrize("sharding", [None, ZeroSharding(2)], ids=["one-process", "two-ranks"])
def test_the_step_with_its_optimizer_builds_for_cuda(graph, sharding):
    try:
        configure_cuda_compiler()
    except RuntimeError as err:
        pytest.skip(str(err))
    step = build_training_step(graph, _adamw(), sharding)
    target = _target()
    lowered = lower_to_memory_stage(step.mod, target)
    kernels = {
        gv.name_hint: f
        for gv, f in lowered.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and "update" in gv.name_hint
    }
    assert kernels, "the optimizer's update kernels are missing"
    assert all(_bound(f) for f in kernels.values()), sorted(kernels)
    tvm.compile(step.mod, target, relax_pipeline=blade_relax.get_pipeline(target))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_on_nccl(graph):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch with CUDA and NCCL")
    from blade_relax.training.data_parallel import DataParallelTrainer

    configure_cuda_compiler()
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        trainer = DataParallelTrainer(graph, _adamw(), target=_target())
        history = trainer.fit(_batches(), progress=False)
        predicted = [trainer.predicted_peak({"b": 2, "s": s}) for s in LENGTHS]
        state = trainer.full_state()
        params = trainer.parameters()
    finally:
        dist.destroy_process_group()
    return history, predicted, params, state


@pytest.mark.gpu
def test_one_rank_on_nccl_trains_as_torch(graph, one_rank_on_nccl):
    history, _predicted, params, state = one_rank_on_nccl
    reference = torch_fit(graph, _adamw(), _batches())
    for step, (got, want) in enumerate(zip(history.losses, reference.losses), start=1):
        assert got == pytest.approx(want, rel=1e-4), f"step {step}"
    for name, got, want in zip(graph.param_names, params, reference.parameters):
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), name
    assert len(state) == 2 * graph.num_trainable
    assert all(np.isfinite(s).all() for s in state)


@pytest.mark.gpu
def test_one_rank_on_nccl_peaks_as_predicted(one_rank_on_nccl):
    history, predicted, _params, _state = one_rank_on_nccl
    assert history.peaks == predicted

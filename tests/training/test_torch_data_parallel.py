"""PyTorch DDP and FSDP2 on 2 gloo processes: the loss of a single process on the whole batch,
and this rank's bytes."""

import functools

import numpy as np
import pytest

pytest.importorskip("torch.distributed.fsdp")

from blade_relax.bench.distributed import run_ranks  # noqa: E402
from blade_relax.bench.workloads import ModelSizes, llama_model  # noqa: E402
from blade_relax.frontend.hf import import_training_step  # noqa: E402
from blade_relax.training import AdamW, torch_fit  # noqa: E402

SIZES = ModelSizes(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)
LENGTHS = (9, 16, 5)


@functools.cache
def _graph():
    return import_training_step(llama_model(SIZES, seed=0), max_seq_len=32, max_batch_size=4)


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for s in LENGTHS:
        ids = rng.integers(0, SIZES.vocab, size=(4, s)).astype("int64")
        labels = ids.copy()
        labels[0, :4] = -100  # unequal shares of the loss between the ranks
        labels[3, 2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _optimizer():
    return AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


def _rank(rank, world):
    from blade_relax.training.torch_data_parallel import torch_data_parallel_fit

    graph = _graph()
    return {
        mode: torch_data_parallel_fit(graph, _optimizer(), _batches(), mode=mode)
        for mode in ("ddp", "fsdp2")
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_rank, 2, timeout_s=300)


def test_losses_equal_one_process_on_the_whole_batch(runs):
    reference = torch_fit(_graph(), _optimizer(), _batches())
    for mode in ("ddp", "fsdp2"):
        for rank in (0, 1):
            history = runs[rank][mode]
            assert history.label == f"torch-{mode}"
            np.testing.assert_allclose(history.losses, reference.losses, rtol=1e-5)
            for got, want in zip(history.parameters, reference.parameters):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_bytes_held_per_rank(runs):
    graph = _graph()
    params = sum(np.asarray(p).nbytes for p in graph.params)
    ddp, fsdp2 = runs[0]["ddp"], runs[0]["fsdp2"]
    # DDP: parameters, their gradients' buckets, the whole AdamW state (two moments + step).
    assert ddp.persistent_bytes >= 4 * params
    # FSDP2: about half of parameters and state on each of the 2 ranks (shards padded).
    assert 3 * params / 2 <= fsdp2.persistent_bytes < 3 * params / 2 + 4096
    for history in (ddp, fsdp2):
        assert all(r.step_peak_bytes > 0 for r in history.records)
        assert all(r.peak_bytes > history.persistent_bytes for r in history.records[1:])

"""The TorchDispatchMode live-bytes counter, eager and under torch.compile."""

from __future__ import annotations

import pytest

from blade_relax.training.torch_memory import LiveBytesCounter, visible_inductor_allocations

torch = pytest.importorskip("torch")


def test_counts_allocations_frees_and_skips_views():
    x = torch.ones(1000)  # allocated before: the caller's, not counted
    with LiveBytesCounter() as counter:
        a = x + 1  # 4000 bytes
        b = a * 2  # 4000 more
        view = b.view(10, 100)  # no new storage
        a.add_(1)  # in place: nothing new
        del a
        c = b + 1  # 4000 again, after a died
    assert counter.peak_bytes == 8000
    assert counter.live_bytes == 8000  # b (held by `view`) and c
    assert counter.allocations == 3
    del view, b, c
    assert counter.live_bytes == 0


def test_gradients_of_a_backward_are_counted():
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(8, 64)
    with LiveBytesCounter() as counter:
        loss = (x @ w).square().sum()
        loss.backward()
    assert w.grad is not None
    assert counter.live_bytes >= w.grad.numel() * 4
    assert counter.peak_bytes >= counter.live_bytes + 8 * 32 * 4


def test_compiled_code_runs_compiled_and_is_counted():
    torch._dynamo.reset()

    def fn(x):
        return (x.sin() * 2).cos() + x

    compiled = torch.compile(fn, dynamic=True)
    x = torch.randn(4096)
    with visible_inductor_allocations():
        compiled(x)  # compile outside the measurement
        with LiveBytesCounter() as counter:
            out = compiled(x)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1
    # The fused kernel writes one buffer: the output; eager would allocate three.
    assert counter.peak_bytes == out.numel() * 4
    with LiveBytesCounter() as eager:
        fn(x)
    assert eager.peak_bytes > counter.peak_bytes


def test_meta_tensors_are_counted_only_when_asked():
    x = torch.empty(1000, device="meta")
    with LiveBytesCounter() as plain:
        y = x * 2
    with LiveBytesCounter(meta=True) as meta:
        z = x * 2
        view = z.view(10, 100)
        z.add_(1)
    assert plain.peak_bytes == 0
    assert meta.peak_bytes == 4000 and meta.allocations == 1  # the view and in-place add: none
    del y, view


def test_a_training_step_on_meta_tensors_counts_what_the_cpu_step_allocates():
    # PyTorch eager's peak at 1.1B parameters is predicted this way: same ops, same storages.
    pytest.importorskip("transformers")
    from blade_relax.bench import ModelSizes, build_workload, run_benchmark
    from blade_relax.bench.predict import predict_torch_peak

    sizes = ModelSizes(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=100)
    workload = build_workload("llama-train", sizes)
    lengths = [7, 50]
    measured = run_benchmark(workload, ["torch-eager"], lengths, repeat=1)
    for row in measured.measurements:
        assert row.correct and row.step_peak_bytes > 0
        shapes = [(1, row.seq_len), (1, row.seq_len)]
        assert predict_torch_peak(workload.graph, shapes) == row.step_peak_bytes, row.seq_len


def test_code_compiled_without_kernels_never_runs_after():
    """Inside ``inductor_kernels_skipped`` the compiled step computes nothing; once it is left,
    the same function compiles again, with its kernels, and computes."""
    import torch

    from blade_relax.training.torch_memory import inductor_kernels_skipped

    def f(x, w):
        return torch.tanh(x @ w) + 1.0

    x = torch.ones(4, 8)
    w = torch.full((8, 3), 0.5)
    compiled = torch.compile(f, dynamic=True)
    with torch._inductor.config.patch(fx_graph_cache=False), inductor_kernels_skipped():
        skipped = compiled(x, w)
    # Its output was allocated, never written (the reference is computed only after it).
    assert skipped.shape == (4, 3) and not torch.allclose(skipped, f(x, w))
    torch.testing.assert_close(compiled(x, w), f(x, w))
    with torch._inductor.config.patch(fx_graph_cache=False), inductor_kernels_skipped():
        compiled(x, w)  # compiles without kernels again: nothing reused from the real run
    torch.testing.assert_close(compiled(x, w), f(x, w))

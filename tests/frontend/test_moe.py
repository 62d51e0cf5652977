"""The mixture-of-experts converters: transformers' grouped GEMM and its backward, ``histc``,
``scatter_add`` and an integer ``//`` by a Python number, each against torch on graphs exported with a symbolic
number of rows; then whole Mixtral training steps whose router sends every token to the same
two experts (so two receive every token and two receive none)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm.relax.frontend.torch import from_exported_program

from blade_relax.frontend.converters import custom_convert_map

from .test_converters import compile_and_run

torch = pytest.importorskip("torch")
moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_*

EXPERTS, K, N = 4, 6, 5


def _import(module, example, dynamic):
    ep = torch.export.export(module, example, dynamic_shapes=dynamic)
    return from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )


class GroupedForwardBackward(torch.nn.Module):
    """The grouped GEMM and its backward on a weight stored ``[E, K, N]``, or ``[E, N, K]`` and
    transposed first, as transformers' expert parameters are."""

    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed

    def forward(self, x, w, offsets, grad):
        w = w.permute(0, 2, 1) if self.transposed else w
        out = torch.ops.transformers.grouped_mm_fallback(x, w, offsets)
        grad_input, grad_weight = torch.ops.transformers.grouped_mm_fallback_backward(
            x, w, offsets, grad
        )
        return out, grad_input, grad_weight


#: Offsets (running sums of rows per expert) for 9 rows: every expert some rows; the first
#: expert none and the second all; two experts none and rows past the last offset (no expert).
OFFSETS = {
    "spread": [2, 3, 7, 9],
    "one_receives_all": [0, 9, 9, 9],
    "rows_left_over": [3, 3, 3, 7],
}


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_gemm_and_backward_match_transformers(transposed):
    rows = torch.export.Dim("rows", min=2, max=64)
    shape = (EXPERTS, N, K) if transposed else (EXPERTS, K, N)
    gen = torch.Generator().manual_seed(0)
    example = (
        torch.randn(9, K, generator=gen),
        torch.randn(*shape, generator=gen),
        torch.tensor(OFFSETS["spread"], dtype=torch.int32),
        torch.randn(9, N, generator=gen),
    )
    module = GroupedForwardBackward(transposed)
    mod = _import(module, example, ({0: rows}, None, None, {0: rows}))
    for name, offsets in OFFSETS.items():
        for count in (9, 13):  # the graph serves any number of rows
            x, w, grad = (torch.randn(count, K), torch.randn(*shape), torch.randn(count, N))
            offs = torch.tensor(offsets, dtype=torch.int32)
            want = [t.numpy() for t in module(x, w, offs, grad)]
            got = compile_and_run(mod, x.numpy(), w.numpy(), offs.numpy(), grad.numpy())
            for g, v in zip(got, want):
                assert g.shape == v.shape
                np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5, err_msg=name)
            # An expert with no row has a zero weight gradient; rows past the last offset are
            # zero in the output.
            assert np.all(got[0][offsets[-1] :] == 0)
            empty = [e for e in range(EXPERTS) if offsets[e] == (offsets[e - 1] if e else 0)]
            for e in empty:
                assert np.all(got[2][e] == 0)


def test_histc_counts_like_torch():
    class Histogram(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=4, min=0, max=3)

    count = torch.export.Dim("count", min=2, max=64)
    example = (torch.tensor([0.0, 1.0, 3.0]),)
    mod = _import(Histogram(), example, ({0: count},))
    for values in (
        [0.0, 1.0, 1.0, 3.0, 3.0, 2.0],  # integer expert ids: one bin per expert, max included
        [-1.0, 0.5, 2.99, 3.0, 3.01, 7.0],  # outside [min, max] not counted
        [2.0, 2.0],  # every value in one bin, three bins empty
    ):
        x = torch.tensor(values)
        (got,) = compile_and_run(mod, x.numpy())
        np.testing.assert_array_equal(got, Histogram()(x).numpy())


def test_histc_over_the_data_range_is_refused():
    class Histogram(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=4)

    with pytest.raises(ValueError, match="bins from the data's own range are not supported"):
        _import(Histogram(), (torch.tensor([0.0, 1.0, 3.0]),), None)


def test_integer_floor_division_by_a_python_number_keeps_the_tensor_dtype():
    class PairToToken(torch.nn.Module):
        def forward(self, perm):
            return torch.div(perm, 2, rounding_mode="floor")

    count = torch.export.Dim("count", min=2, max=64)
    mod = _import(PairToToken(), (torch.arange(6),), ({0: count},))
    perm = torch.tensor([5, 0, 3, 2, 7, 1, 6, 4])
    (got,) = compile_and_run(mod, perm.numpy())
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, perm.numpy() // 2)


def test_scatter_add_accumulates_repeated_indices():
    class GroupScores(torch.nn.Module):
        def forward(self, base, index, src):
            return base.scatter_add(1, index, src)

    count = torch.export.Dim("count", min=2, max=64)
    example = (torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    mod = _import(GroupScores(), example, ({0: count}, {0: count}, {0: count}))
    base = torch.randn(5, 4)
    index = torch.tensor([[0, 0], [3, 1], [2, 2], [1, 0], [3, 3]])
    src = torch.randn(5, 2)
    (got,) = compile_and_run(mod, base.numpy(), index.numpy(), src.numpy())
    np.testing.assert_allclose(got, GroupScores()(base, index, src).numpy(), rtol=1e-6)


def test_unsorted_topk_is_a_valid_top_k():
    class GroupChoice(torch.nn.Module):
        def forward(self, scores):
            return torch.topk(scores, 2, dim=-1, sorted=False)

    count = torch.export.Dim("count", min=2, max=64)
    mod = _import(GroupChoice(), (torch.randn(3, 5),), ({0: count},))
    scores = torch.randn(7, 5)
    values, indices = compile_and_run(mod, scores.numpy())
    want, _ = torch.topk(scores, 2, dim=-1)
    np.testing.assert_array_equal(np.sort(values, axis=-1), np.sort(want.numpy(), axis=-1))
    np.testing.assert_array_equal(np.take_along_axis(scores.numpy(), indices, -1), values)


def test_inference_of_a_mixture_of_experts_model_matches_torch():
    import tvm
    from tvm import relax

    from blade_relax import get_pipeline
    from blade_relax.bench.runner import relative_error
    from blade_relax.frontend import flatten_outputs, import_inference

    graph = import_inference(_mixtral_routed_to_two_experts(), max_seq_len=32)
    exe = tvm.compile(graph.mod, "llvm", relax_pipeline=get_pipeline())
    vm = relax.VirtualMachine(exe, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    for n in (2, 19):
        ids = np.random.default_rng(n).integers(0, 96, (1, n))
        got = flatten_outputs(vm["main"](tvm.runtime.tensor(ids), *params))
        (want,) = graph.reference([ids])
        assert relative_error(got[0].numpy(), want) < 1e-5


def _mixtral_routed_to_two_experts():
    """A tiny Mixtral of one decoder layer whose router sends every token to experts 0 and 1:
    embeddings of unit scale whose first component is at least 3, a router that reads only
    that component, with expert scores 2, 1, -1, -2 (so experts 2 and 3 receive no token). One
    layer: a second runs the same converters and passes (the test took 51.5 s with two, 32.8 s
    with one)."""
    transformers = pytest.importorskip("transformers")
    from blade_relax.bench.zoo import tiny_config

    torch.manual_seed(0)
    config = tiny_config(
        "mixtral", num_local_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=1
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight
        embedding.copy_(torch.randn(embedding.shape))
        embedding[:, 0] = 3.0 + embedding[:, 0].abs()
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:, 0] = torch.tensor([2.0, 1.0, -1.0, -2.0])
    return model


def _tokens_per_expert(model, length):
    counts = []

    def record(_module, _inputs, outputs):
        counts.append(torch.bincount(outputs[2].reshape(-1), minlength=EXPERTS).tolist())

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, model.config.vocab_size, (1, length)))
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def test_training_step_where_experts_receive_all_tokens_or_none():
    from blade_relax.bench.zoo import check_model

    model = _mixtral_routed_to_two_experts()
    lengths = (3, 17)
    for n in lengths:
        assert _tokens_per_expert(model, n) == [[n, n, 0, 0]] * model.config.num_hidden_layers
    summary, result = check_model("mixtral", model, lengths)
    assert summary.status == "supported", [
        (r.config, r.seq_len, r.max_rel_error) for r in result.measurements
    ]
    assert summary.at_or_below_eager, (summary.peaks, summary.eager_peaks)


def test_a_mixture_of_experts_model_trains_as_torch_with_its_optimizer():
    """The training step keeps the graph's own kernels (the grouped GEMM): three AdamW steps
    equal torch's loop, at the peaks the timeline predicts."""
    transformers = pytest.importorskip("transformers")
    from blade_relax.bench.zoo import tiny_config
    from blade_relax.frontend.hf import import_training_step
    from blade_relax.training import AdamW, Trainer, torch_fit

    torch.manual_seed(0)
    config = tiny_config("mixtral", num_hidden_layers=1)  # a second layer adds only time
    model = transformers.AutoModelForCausalLM.from_config(config)
    graph = import_training_step(model, max_seq_len=32)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, config.vocab_size, size=(1, n)).astype("int64") for n in (7, 19)]
    trainer = Trainer(graph, AdamW(lr=1e-2))
    history = trainer.fit(batches, progress=False)
    reference = torch_fit(graph, AdamW(lr=1e-2), batches)
    np.testing.assert_allclose(history.losses, reference.losses, rtol=1e-5)
    assert history.losses[0] != history.losses[1]
    assert history.peaks == [trainer.predicted_peak({"s": b.shape[1]}) for b in batches]

"""Hugging Face models to Relax: training steps and inference graphs match torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax  # noqa: F401  (installs the runtime accounting)
from blade_relax.bench.workloads import ModelSizes, gpt2_model, llama_model
from blade_relax.frontend import (
    DimOutOfRangeError,
    DimRange,
    TiedParameterError,
    flatten_outputs,
    import_inference,
    import_training_step,
)
from blade_relax.frontend.imported import SIZE_OPTIONS
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_LEN = 64
TOLERANCE = 1e-4


TINY = ModelSizes(
    layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96, max_seq_len=MAX_LEN
)


def tiny_llama():
    return llama_model(TINY, attn_implementation=None)


def tiny_gpt2(tied: bool):
    return gpt2_model(
        dataclasses.replace(TINY, intermediate=128), tied=tied, attn_implementation=None
    )


def run(graph, lengths, keep_bounds=False):
    """Compile once (stock pipeline) and return [(outputs, reference)] per length."""
    variant = graph.with_upper_bounds(keep_bounds)
    exe = tvm.compile(variant.mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    results = []
    for length in lengths:
        inputs = graph.random_inputs({"s": length}, seed=length)
        graph.bind_dims(inputs)
        out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs], *params)
        results.append(([t.numpy() for t in flatten_outputs(out)], graph.reference(inputs)))
    return results


def assert_matches(results, count):
    for outputs, reference in results:
        assert len(outputs) == len(reference) == count
        for out, ref in zip(outputs, reference):
            assert out.shape == ref.shape
            err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= TOLERANCE


@pytest.fixture(scope="module")
def llama_step():
    return import_training_step(tiny_llama(), max_seq_len=MAX_LEN)


def test_llama_training_step_matches_torch(llama_step):
    graph = llama_step
    model_params = dict(tiny_llama().named_parameters())
    assert graph.param_names == list(model_params)
    assert graph.output_names == ["loss"] + [f"grad:{n}" for n in graph.param_names]
    assert [p.shape for p in graph.params] == [tuple(p.shape) for p in model_params.values()]
    results = run(graph, [7, 40])
    assert_matches(results, 1 + len(graph.param_names))
    # The two lengths give different losses: the graph really follows the length.
    assert results[0][0][0] != results[1][0][0]


def test_llama_step_has_a_named_symbolic_length(llama_step):
    main = llama_step.main
    ids, labels = main.params[:2]
    seq = ids.ty.shape.values[1]
    assert isinstance(seq, tvm.tirx.Var) and seq.name == "s"
    assert labels.ty.shape.values[1].same_as(seq)
    assert llama_step.upper_bounds == {"s": MAX_LEN}
    assert llama_step.dims["s"].lower == 2 and llama_step.dims["s"].upper == MAX_LEN
    dropped = llama_step.with_upper_bounds(False)
    assert dropped.upper_bounds == {}
    assert "tir_var_upper_bound" not in dropped.main.attrs
    assert dropped.with_upper_bounds(True).upper_bounds == {"s": MAX_LEN}


def test_llama_step_planned_at_the_bound_matches_torch(llama_step):
    assert_matches(run(llama_step, [5], keep_bounds=True), 1 + len(llama_step.param_names))


def test_length_beyond_the_bound_is_refused_before_running(llama_step):
    inputs = llama_step.random_inputs({"s": 8})
    too_long = [np.zeros((1, MAX_LEN + 1), dtype="int64")] * 2
    assert llama_step.bind_dims(inputs) == {"s": 8}
    with pytest.raises(DimOutOfRangeError, match=f"s <= {MAX_LEN}") as info:
        llama_step.bind_dims(too_long)
    assert str(MAX_LEN + 1) in str(info.value)
    with pytest.raises(DimOutOfRangeError, match="s >= 2"):
        llama_step.bind_dims([np.zeros((1, 1), dtype="int64")] * 2)
    with pytest.raises(ValueError, match="dim 's' is 5"):
        llama_step.bind_dims([np.zeros((1, 5), "int64"), np.zeros((1, 6), "int64")])


def test_gpt2_tied_training_step_sums_the_tied_gradient():
    model = tiny_gpt2(tied=True)
    graph = import_training_step(model, max_seq_len=MAX_LEN)
    unique = dict(model.named_parameters())  # the tied lm_head.weight appears once
    assert graph.param_names == list(unique)
    assert graph.metadata["tied"] == [["transformer.wte.weight", "lm_head.weight"]]
    # The model is left tied after the import.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_matches(run(graph, [9, 33]), 1 + len(graph.param_names))


def test_tied_parameters_error_says_what_to_change():
    with pytest.raises(TiedParameterError, match="tie_word_embeddings=False"):
        import_training_step(tiny_gpt2(tied=True), max_seq_len=MAX_LEN, tied_parameters="error")


def test_import_rejects_a_maximum_beyond_the_position_table():
    with pytest.raises(ValueError, match="position limit 64 .*: pass max_seq_len=64 or less"):
        import_training_step(tiny_gpt2(tied=False), max_seq_len=2 * MAX_LEN)


@pytest.fixture(scope="module")
def llama_model_only():
    return tiny_llama()


@pytest.mark.parametrize("importer", [import_training_step, import_inference])
def test_missing_max_seq_len_says_what_to_pass(llama_model_only, importer):
    name = importer.__name__
    with pytest.raises(TypeError) as info:
        importer(llama_model_only)
    assert str(info.value) == (
        f"{name} needs max_seq_len=, the longest sequence (in tokens) the step will take (from 2 "
        f"to {MAX_LEN}, the model's position limit); e.g. {name}(model, max_seq_len={MAX_LEN})"
    )


@pytest.mark.parametrize("importer", [import_training_step, import_inference])
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"max_seq_len": "32"}, TypeError, "max_seq_len must be an int.*not '32'"),
        ({"max_seq_len": 32.0}, TypeError, "max_seq_len must be an int.*e.g. max_seq_len=64"),
        ({"max_seq_len": True}, TypeError, "max_seq_len must be an int"),
        ({"max_seq_len": 1}, ValueError, "below min_seq_len 2: pass max_seq_len=2 or more"),
        ({"max_seq_len": 8, "min_seq_len": 1}, ValueError, "pass min_seq_len=2 .*or more"),
        ({"max_seq_len": 8, "batch_size": 0}, ValueError, "batch_size must be an int >= 1"),
        ({"max_seq_len": 8, "max_batch_size": 0}, ValueError, "max_batch_size must be None"),
        (
            {"max_seq_len": 8, "batch_size": 3, "max_batch_size": 2},
            ValueError,
            "batch_size 3 is above max_batch_size 2: pass max_batch_size=3 or more",
        ),
    ],
)
def test_wrong_sizes_say_what_to_pass(llama_model_only, importer, options, error, match):
    with pytest.raises(error, match=match):
        importer(llama_model_only, **options)


def test_shape_errors_name_the_import_option(llama_step):
    def ids(*shape):
        return np.zeros(shape, "int64")

    message = (
        "input 'input_ids' axis 0 (batch) is 2, but the step was imported for batch 1: pass "
        "max_batch_size=2 (or more) to import_training_step"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        llama_step.bind_dims([ids(2, 8)] * 2)
    with pytest.raises(ValueError, match=re.escape("rank 2 (batch, sequence length); a single")):
        llama_step.bind_dims([ids(8)] * 2)
    with pytest.raises(ValueError, match=re.escape("'labels' axis 1 (sequence length) is 6")):
        llama_step.bind_dims([ids(1, 5), ids(1, 6)])
    # Beyond the model's positions (the step's maximum here): no import runs it.
    with pytest.raises(DimOutOfRangeError, match=f"position limit is {MAX_LEN} .*truncate"):
        llama_step.bind_dims([ids(1, MAX_LEN + 1)] * 2)
    with pytest.raises(DimOutOfRangeError, match="s >= 2; pad the sequence to 2 tokens"):
        llama_step.bind_dims([ids(1, 1)] * 2)
    # A step imported for lengths 8 to 32 names both ends.
    narrow = dataclasses.replace(llama_step, dims={"s": DimRange("s", 8, 32)})
    message = (
        "sequence length s = 40 exceeds the exported upper bound s <= 32 (the torch.export Dim "
        f"max); pass max_seq_len=40 (or more, at most {MAX_LEN}, the model's position limit) "
        "to import_training_step"
    )
    with pytest.raises(DimOutOfRangeError, match=re.escape(message)):
        narrow.bind_dims([ids(1, 40)] * 2)
    with pytest.raises(DimOutOfRangeError, match=re.escape("pass min_seq_len=5 (or less) to")):
        narrow.bind_dims([ids(1, 5)] * 2)
    # Without the import's options (a graph built by hand): the plain messages.
    bare = dataclasses.replace(narrow, metadata={})
    with pytest.raises(ValueError, match=re.escape("axis 0 is 2, expected 1")):
        bare.bind_dims([ids(2, 8)] * 2)
    with pytest.raises(DimOutOfRangeError, match="import again with a larger maximum"):
        bare.bind_dims([ids(1, 40)] * 2)


def test_entry_points_are_at_the_top_level():
    import blade_relax.frontend
    import blade_relax.training

    for name in ("import_training_step", "import_inference"):
        assert getattr(blade_relax, name) is getattr(blade_relax.frontend, name)
        assert name in blade_relax.__all__ and name in dir(blade_relax)
    for name in ("Trainer", "fit", "AdamW", "SGD"):
        assert getattr(blade_relax, name) is getattr(blade_relax.training, name)
        assert name in blade_relax.__all__
    from blade_relax import Trainer, import_training_step  # noqa: F401

    with pytest.raises(AttributeError, match="no attribute 'import_everything'"):
        blade_relax.import_everything  # noqa: B018


_NO_TORCH = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r} (blocked)")

sys.meta_path.insert(0, Block())
import blade_relax
from blade_relax import Trainer, fit, import_inference, import_training_step
assert "torch" not in sys.modules and "transformers" not in sys.modules

class Config:
    max_position_embeddings = 64

class Model:
    config = Config()

try:
    import_training_step(Model(), max_seq_len=16)
except ImportError as err:
    print(err)
"""


def test_top_level_import_needs_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'blade-relax[hf]'" in proc.stdout


@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_gpt2(tied=True)], ids=["llama", "gpt2"])
def test_inference_graph_matches_logits(make):
    graph = import_inference(make(), max_seq_len=MAX_LEN)
    assert graph.output_names == ["logits"]
    assert graph.metadata[SIZE_OPTIONS]["call"] == "import_inference"
    with pytest.raises(ValueError, match="pass max_batch_size=3 .* to import_inference"):
        graph.bind_dims([np.zeros((3, 8), "int64")])
    results = run(graph, [6, 29])
    assert_matches(results, 1)
    assert results[1][0][0].shape == (1, 29, 96)


def test_a_batch_of_at_most_two_is_one_symbol():
    # The example batch is then the Dim's maximum, and torch.export gives the labels' batch a
    # symbol of its own: the import makes it the one ``b``, so the loss's broadcasts lower.
    graph = import_training_step(tiny_llama(), max_seq_len=MAX_LEN, max_batch_size=2)
    batch = [p.ty.shape.values[0] for p in graph.main.params[:2]]
    assert batch[0].same_as(batch[1]) and batch[0].name == "b"
    lower_to_memory_stage(graph.mod, "llvm")


def test_symbolic_batch_and_length():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
    )
    graph = import_training_step(
        transformers.LlamaForCausalLM(config), max_seq_len=MAX_LEN, max_batch_size=4
    )
    assert graph.input_shapes == [("b", "s"), ("b", "s")]
    assert graph.upper_bounds == {"b": 4, "s": MAX_LEN}
    names = [v.name for v in graph.main.params[0].ty.shape.values]
    assert names == ["b", "s"]
    with pytest.raises(DimOutOfRangeError, match=r"b <= 4 .*pass max_batch_size=5 \(or more\)"):
        graph.bind_dims([np.zeros((5, 8), "int64")] * 2)
    variant = graph.with_upper_bounds(False)
    exe = tvm.compile(variant.mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    inputs = graph.random_inputs({"b": 3, "s": 20})
    out = vm["main"](*map(tvm.runtime.tensor, inputs), *map(tvm.runtime.tensor, graph.params))
    got = [t.numpy() for t in flatten_outputs(out)]
    assert_matches([(got, graph.reference(inputs))], 1 + len(graph.param_names))

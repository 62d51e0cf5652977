"""Carried graphs: the module travels without weights and runs with another model's weights.

The GPU machine builds the model again (another torch, another draw of the weights) and
attaches it to the carried module: the module must read back as itself, nothing may be exported
again, and the outputs must match the torch reference of the attached model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.bench.runner import relative_error
from blade_relax.frontend import flatten_outputs

pytest.importorskip("transformers")

from blade_relax.bench.workloads import ModelSizes, build_workload, gpt2_model, llama_model  # noqa: E402
from blade_relax.frontend.carry import FORMAT, attach_model, load_graph, save_graph  # noqa: E402
from blade_relax.frontend.imported import SIZE_OPTIONS  # noqa: E402

SIZES = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)


@pytest.fixture(scope="module")
def llama_train():
    return build_workload("llama-train", SIZES)


def _run(graph, inputs) -> list[np.ndarray]:
    exe = tvm.compile(graph.with_upper_bounds(False).mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in [*inputs, *graph.params]]
    return [o.numpy() for o in flatten_outputs(vm["main"](*args))]


def test_training_graph_travels_and_runs_with_the_new_models_weights(
    llama_train, tmp_path, monkeypatch
):
    path = save_graph(llama_train.graph, tmp_path / "llama.npz", info={"seed": 3})
    carried = load_graph(path)
    tvm.ir.assert_structural_equal(carried.mod, llama_train.graph.mod)
    assert carried.info == {"seed": 3}
    assert carried.param_names == llama_train.graph.param_names
    assert carried.dims["s"].upper == SIZES.max_seq_len
    # What shape errors name travels too.
    assert carried.metadata[SIZE_OPTIONS] == llama_train.graph.metadata[SIZE_OPTIONS]

    import torch

    def no_export(*_args, **_kwargs):
        raise AssertionError("attaching a model must not export it")

    monkeypatch.setattr(torch.export, "export", no_export)
    # Other weights than the imported model's: what the GPU machine's torch draws.
    graph = attach_model(carried, llama_model(SIZES, seed=7))
    assert not all(np.array_equal(a, b) for a, b in zip(graph.params, llama_train.graph.params))
    inputs = llama_train.inputs(11)
    outputs, reference = _run(graph, inputs), graph.reference(inputs)
    assert len(outputs) == len(reference) == len(graph.output_names)
    for name, out, ref in zip(graph.output_names, outputs, reference):
        assert relative_error(out, ref) <= 1e-4, name
    # The reference is the attached model's: it differs from the imported model's.
    assert not np.allclose(reference[0], llama_train.graph.reference(inputs)[0])


def test_inference_graph_travels(tmp_path):
    sizes = dataclasses.replace(SIZES, heads=2, kv_heads=2)
    built = build_workload("gpt2-infer", sizes)
    graph = attach_model(load_graph(save_graph(built.graph, tmp_path / "g.npz")), gpt2_model(sizes))
    inputs = built.inputs(9)
    (logits,) = _run(graph, inputs)
    assert relative_error(logits, graph.reference(inputs)[0]) <= 1e-4


def test_attaching_another_model_is_refused(llama_train, tmp_path):
    carried = load_graph(save_graph(llama_train.graph, tmp_path / "llama.npz"))
    wider = dataclasses.replace(SIZES, intermediate=2 * SIZES.intermediate)
    with pytest.raises(ValueError, match="mlp.*in the model"):
        attach_model(carried, llama_model(wider))
    with pytest.raises(ValueError, match="has no parameter"):
        attach_model(carried, gpt2_model(SIZES))


def test_other_formats_are_refused(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, record=np.array('{"format": "something/0"}'), script=np.array(""))
    with pytest.raises(ValueError, match=FORMAT):
        load_graph(path)

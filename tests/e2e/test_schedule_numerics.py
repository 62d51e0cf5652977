"""MemoryAwareSchedule end to end: identical outputs and no higher measured peak, on the VM."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.frontend import flatten_outputs
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.runtime import memory_stats, reset_memory_stats

LENGTHS = (3, 17, 64)


def _vm(mod: tvm.IRModule, schedule: bool) -> relax.VirtualMachine:
    pipe = blade_relax.get_pipeline("llvm", schedule=schedule, remat=False, plan=False)
    return relax.VirtualMachine(tvm.compile(mod, "llvm", relax_pipeline=pipe), tvm.cpu())


def _run(vm: relax.VirtualMachine, arrays: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    args = [tvm.runtime.tensor(a) for a in arrays]
    reset_memory_stats()
    before = memory_stats()["live_bytes"]
    out = vm["main"](*args)
    peak = memory_stats()["peak_bytes"] - before
    return [o.numpy() for o in flatten_outputs(out)], peak


def _check(mod: tvm.IRModule, arguments) -> list[tuple[int, int]]:
    stock, scheduled = _vm(mod, False), _vm(mod, True)
    peaks = []
    for length in LENGTHS:
        arrays = arguments(length)
        expected, stock_peak = _run(stock, arrays)
        got, peak = _run(scheduled, arrays)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            # Reordering independent bindings changes no arithmetic: bit-identical results.
            assert np.array_equal(a, b), f"length {length}: outputs differ"
        assert peak <= stock_peak, f"length {length}: peak {peak} > stock {stock_peak}"
        peaks.append((peak, stock_peak))
    return peaks


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_models(name):
    mod = BUILTIN_MODELS[name]()
    func = mod["main"]
    dims = sorted({v.name for p in func.params for v in relax.analysis.tir_vars_in_type(p.ty)})
    _check(mod, lambda n: random_arguments(func, dict.fromkeys(dims, n), seed=n))


def _tiny_llama_training_step():
    import torch
    import transformers

    from blade_relax.frontend import import_training_step

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return import_training_step(
        transformers.LlamaForCausalLM(config), max_seq_len=64, keep_upper_bound=False
    )


def test_llama_training_step_is_scheduled_identically():
    graph = _tiny_llama_training_step()

    def arguments(n: int) -> list[np.ndarray]:
        rng = np.random.default_rng(n)
        ids = rng.integers(0, graph.int_input_high, size=(1, n)).astype("int64")
        return [ids, ids.copy(), *graph.params]

    _check(graph.mod, arguments)

"""MemoryAwareSchedule end to end: identical outputs and no higher measured peak, on the VM."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.frontend import flatten_outputs, specialize
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.runtime import memory_stats, reset_memory_stats
from blade_relax.testing.differential import Variant

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


def _builtin(name: str) -> tuple[tvm.IRModule, list[str], Callable[[int], list[np.ndarray]]]:
    """A built-in model, its dims, and its arguments with every dim set to one length."""
    mod = BUILTIN_MODELS[name]()
    func = mod["main"]
    dims = sorted({v.name for p in func.params for v in relax.analysis.tir_vars_in_type(p.ty)})
    return mod, dims, lambda n: random_arguments(func, dict.fromkeys(dims, n), seed=n)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_models(name):
    mod, _, arguments = _builtin(name)
    _check(mod, arguments)


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


def _llama_arguments(graph) -> Callable[[int], list[np.ndarray]]:
    def arguments(n: int) -> list[np.ndarray]:
        rng = np.random.default_rng(n)
        ids = rng.integers(0, graph.int_input_high, size=(1, n)).astype("int64")
        return [ids, ids.copy(), *graph.params]

    return arguments


def test_llama_training_step_is_scheduled_identically():
    graph = _tiny_llama_training_step()
    _check(graph.mod, _llama_arguments(graph))


# ---------------------------------------------------------------------------------------------
# Symbolic scheduling against exact shapes: the same passes on the graph specialized to each
# length. PlanMemory plans symbolic and constant sizes alike, so the comparison measures the
# schedule; StaticPlanBlockMemory reuses storage across different sizes only when they are
# constants, which would credit the exact-shape graph with the planner's advantage.


def _planned_vm(mod: tvm.IRModule) -> relax.VirtualMachine:
    # The schedule and the planner alone (the default pipeline's graph passes switched off).
    pipe = blade_relax.get_pipeline(
        "llvm", **Variant("schedule-plan", schedule=True, plan=True).flags
    )
    return relax.VirtualMachine(tvm.compile(mod, "llvm", relax_pipeline=pipe), tvm.cpu())


def _check_against_exact(mod: tvm.IRModule, dims: list[str], arguments) -> None:
    dynamic = _planned_vm(mod)
    for length in LENGTHS:
        arrays = arguments(length)
        got, peak = _run(dynamic, arrays)
        exact, exact_peak = _run(_planned_vm(specialize(mod, dict.fromkeys(dims, length))), arrays)
        for a, b in zip(got, exact):
            # Kernels compiled for constant shapes may order their arithmetic differently.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert peak <= 1.01 * exact_peak, (
            f"length {length}: symbolic schedule peaks at {peak} B, exact shapes at {exact_peak} B"
        )


# concat-split is left out: with constant shapes FuseOps fuses its concat, tanh, split and add
# into one kernel (the symbolic split's output shape blocks that fusion), a different program.
@pytest.mark.parametrize("name", sorted(set(BUILTIN_MODELS) - {"concat-split"}))
def test_symbolic_schedule_loses_nothing_to_exact_shapes(name):
    _check_against_exact(*_builtin(name))


def test_llama_symbolic_schedule_loses_nothing_to_exact_shapes():
    graph = _tiny_llama_training_step()
    _check_against_exact(graph.mod, ["s"], _llama_arguments(graph))


# ---------------------------------------------------------------------------------------------
# Range versions: the dispatcher runs the copy for the length, with the same results.


def _flip_q_first() -> tvm.IRModule:
    """Q first (an s x s temporary) suits s >= 1024; P first (s x 1024) suits shorter s."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function
        def main(
            x: R.Tensor(("s", 64), "float32"),
            wp: R.Tensor((64, 1024), "float32"),
            wr: R.Tensor((1024, 64), "float32"),
        ):
            with R.dataflow():
                xt = R.permute_dims(x)
                qa = R.matmul(x, xt)
                rq = R.matmul(qa, x)
                pa = R.matmul(x, wp)
                rp = R.matmul(pa, wr)
                out = R.add(rp, rq)
                R.output(out)
            return out

    return Module


@pytest.mark.parametrize("memory_passes", [False, True])
def test_versions_dispatch_by_length(memory_passes):
    mod = _flip_q_first()
    stock = _vm(mod, False)
    pipe = blade_relax.get_pipeline("llvm", schedule=True, remat=memory_passes, plan=memory_passes)
    scheduled = relax.VirtualMachine(tvm.compile(mod, "llvm", relax_pipeline=pipe), tvm.cpu())
    rng = np.random.default_rng(0)
    wp = rng.standard_normal((64, 1024)).astype("float32")
    wr = rng.standard_normal((1024, 64)).astype("float32")
    for n in (5, 300, 1023, 1024, 1100):
        x = rng.standard_normal((n, 64)).astype("float32")
        expected, stock_peak = _run(stock, [x, wp, wr])
        got, peak = _run(scheduled, [x, wp, wr])
        assert np.array_equal(got[0], expected[0]), f"length {n}: outputs differ"
        assert peak <= stock_peak, f"length {n}: peak {peak} > stock {stock_peak}"
        if n == 300:
            # The copy for short lengths runs P first: its s x 1024 temporary is freed
            # before the s x s one exists.
            assert peak < stock_peak

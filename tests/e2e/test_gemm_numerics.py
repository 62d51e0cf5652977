"""DispatchGemm end to end: the default pipeline with ATen's GEMMs computes what it computes
with TVM's kernels, training gradients included, at several lengths of the symbolic dim.

ATen sums in another order than TVM's loop nests: results agree to rounding, not bit for bit.
Each program is checked to have dispatched GEMMs, so that a pass that silently dispatched
nothing could not pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.bench.runner import relative_error
from blade_relax.bench.workloads import ModelSizes, build_workload
from blade_relax.frontend import flatten_outputs
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.pipeline import get_pipeline
from blade_relax.transform import collect_results

# A Llama training step small enough for the CPU of CI: one layer, grouped-query attention.
TINY = ModelSizes(
    layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, max_seq_len=64
)


def _compile(mod: tvm.IRModule, dispatch: bool) -> tuple[relax.VirtualMachine, int]:
    """The VM of ``mod`` built by the default pipeline, and the number of GEMMs dispatched."""
    with collect_results() as results:
        exe = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=dispatch))
    dispatched = sum(r.detail.total for r in results if r.pass_name == "DispatchGemm")
    return relax.VirtualMachine(exe, tvm.cpu()), dispatched


def _run(vm: relax.VirtualMachine, args: list[np.ndarray]) -> list[np.ndarray]:
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in flatten_outputs(out)]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], tolerance: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        assert relative_error(g, w) <= tolerance, (i, relative_error(g, w))


@pytest.mark.parametrize("model", ["attention", "mlp-train"])
def test_builtin_models_match_tvm_kernels(model):
    mod = BUILTIN_MODELS[model]()
    dims = sorted(
        {v.name for p in mod["main"].params for v in relax.analysis.tir_vars_in_type(p.ty)}
    )
    dispatched_vm, dispatched = _compile(mod, True)
    reference_vm, none = _compile(mod, False)
    assert dispatched > 0 and none == 0
    for length in (1, 7, 40):
        args = random_arguments(mod["main"], dict.fromkeys(dims, length), seed=length)
        _assert_close(_run(dispatched_vm, args), _run(reference_vm, args), 1e-5)


def test_llama_training_step_loss_and_gradients_match_tvm_kernels():
    workload = build_workload("llama-train", TINY)
    mod = workload.graph.with_upper_bounds(False).mod
    dispatched_vm, dispatched = _compile(mod, True)
    reference_vm, _ = _compile(mod, False)
    # Forward and backward of every projection: NN, NT and TN products.
    assert dispatched >= 3 * 7
    params = workload.graph.params
    for length in (2, 19, 64):
        args = [*workload.inputs(length), *params]
        got, want = _run(dispatched_vm, args), _run(reference_vm, args)
        assert len(want) == 1 + len(params)  # the loss, then one gradient per parameter
        _assert_close(got, want, 1e-4)


def test_gpt2_training_step_with_split_epilogues_matches_tvm_kernels():
    """GPT-2's projections have a bias: their GEMMs are fused with the add (and the backward's
    with other tails), and split into ATen's GEMM and the tail in place."""
    workload = build_workload("gpt2-train", TINY)
    mod = workload.graph.with_upper_bounds(False).mod
    with collect_results() as results:
        exe = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=True))
    (report,) = [r.detail for r in results if r.pass_name == "DispatchGemm"]
    assert sum(report.epilogues.values()) >= 4
    dispatched_vm = relax.VirtualMachine(exe, tvm.cpu())
    reference_vm, _ = _compile(mod, False)
    params = workload.graph.params
    for length in (2, 19, 64):
        args = [*workload.inputs(length), *params]
        got, want = _run(dispatched_vm, args), _run(reference_vm, args)
        assert len(want) == 1 + len(params)
        _assert_close(got, want, 1e-4)

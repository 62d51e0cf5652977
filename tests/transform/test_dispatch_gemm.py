# ruff: noqa: E501, F841
"""DispatchGemm: matmuls become ATen GEMM calls; what it does not accept passes unchanged."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.contract import GEMM_FUNCS, GEMM_LAYOUT_ATTR
from blade_relax.pipeline import get_pipeline, lower_to_memory_stage
from blade_relax.runtime import gemm as runtime_gemm
from blade_relax.transform import DispatchGemm, GemmOptions, SimplifyTransposes
from blade_relax.transform import dispatch_gemm as dispatch_module


# fmt: off
@I.ir_module
class Linear:
    """A linear layer's forward and backward as torch's joint export writes them (the double
    transposes already cancelled)."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((16, 8), "float32"), dy: R.Tensor(("s", 16), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, wt)
            dx = R.matmul(dy, w)
            dyt = R.permute_dims(dy, axes=[1, 0])
            dw = R.matmul(dyt, x)
            R.output(y, dx, dw)
        return (y, dx, dw)


@I.ir_module
class LinearExpected:
    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((16, 8), "float32"), dy: R.Tensor(("s", 16), "float32")) -> R.Tuple(R.Tensor(("s", 16), dtype="float32"), R.Tensor(("s", 8), dtype="float32"), R.Tensor((16, 8), dtype="float32")):
        s = T.int64()
        with R.dataflow():
            y = R.call_dps_packed("blade_relax.gemm_NT", (x, w), out_ty=R.Tensor((s, 16), dtype="float32"))
            dx = R.call_dps_packed("blade_relax.gemm_NN", (dy, w), out_ty=R.Tensor((s, 8), dtype="float32"))
            dw = R.call_dps_packed("blade_relax.gemm_TN", (dy, x), out_ty=R.Tensor((16, 8), dtype="float32"))
            R.output(y, dx, dw)
        return (y, dx, dw)


@I.ir_module
class Batched:
    """Attention scores and context: batch axes equal on both sides, a weight with a batched
    input."""

    @R.function
    def main(q: R.Tensor((2, "s", 4), "float32"), k: R.Tensor((2, "s", 4), "float32"), w: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 2, 1])
            scores = R.matmul(q, kt)
            context = R.matmul(scores, k)
            projected = R.matmul(context, w)
            R.output(scores, projected)
        return (scores, projected)


@I.ir_module
class BatchedExpected:
    @R.function
    def main(q: R.Tensor((2, "s", 4), "float32"), k: R.Tensor((2, "s", 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tuple(R.Tensor((2, "s", "s"), dtype="float32"), R.Tensor((2, "s", 4), dtype="float32")):
        s = T.int64()
        with R.dataflow():
            scores = R.call_dps_packed("blade_relax.gemm_NT", (q, k), out_ty=R.Tensor((2, s, s), dtype="float32"))
            context = R.call_dps_packed("blade_relax.gemm_NN", (scores, k), out_ty=R.Tensor((2, s, 4), dtype="float32"))
            projected = R.call_dps_packed("blade_relax.gemm_NN", (context, w), out_ty=R.Tensor((2, s, 4), dtype="float32"))
            R.output(scores, projected)
        return (scores, projected)


@I.ir_module
class NotGemms:
    """Nothing the pass accepts: a broadcast batch axis, a mixed-precision product, a vector
    operand, a transposed batched input against a weight, and no matmul at all."""

    @R.function
    def main(a: R.Tensor((2, "s", 4), "float32"), b: R.Tensor((1, 4, "s"), "float32"), h: R.Tensor(("s", 4), "float16"), v: R.Tensor((4,), "float32"), c: R.Tensor(("s", 3), "float32")):
        with R.dataflow():
            broadcast = R.matmul(a, b)
            mixed = R.matmul(h, R.permute_dims(h), out_dtype="float32")
            vector = R.matmul(a, v)
            at = R.permute_dims(a, axes=[0, 2, 1])
            folded = R.matmul(at, c)
            e = R.exp(a)
            R.output(broadcast, mixed, vector, folded, e)
        return (broadcast, mixed, vector, folded, e)
# fmt: on


def test_linear_forward_and_backward_dispatch_by_layout():
    pass_obj = DispatchGemm()
    after = pass_obj(Linear)
    tvm.ir.assert_structural_equal(after, LinearExpected)
    assert pass_obj.report.dispatched == {"NT": 1, "NN": 1, "TN": 1}
    assert pass_obj.report.kept == 0
    assert pass_obj.last_result.changed


def test_batched_and_weight_gemms_dispatch():
    after = DispatchGemm()(Batched)
    tvm.ir.assert_structural_equal(after, BatchedExpected)


def test_tagged_kernels_of_simplify_transposes_dispatch_and_disappear():
    simplified = SimplifyTransposes()(Linear)
    tagged = [
        str(f.attrs[GEMM_LAYOUT_ATTR])
        for f in simplified.functions.values()
        if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert sorted(tagged) == ["NT", "TN"]
    after = DispatchGemm()(simplified)
    tvm.ir.assert_structural_equal(after, LinearExpected)
    assert not any(isinstance(f, tvm.tirx.PrimFunc) for f in after.functions.values())


def test_what_is_not_a_gemm_it_accepts_passes_unchanged():
    pass_obj = DispatchGemm()
    after = pass_obj(NotGemms)
    tvm.ir.assert_structural_equal(after, NotGemms)
    assert pass_obj.report.total == 0
    # The broadcast, the mixed-precision product and the transposed input against a weight
    # are GEMMs left to TVM; the vector product is no GEMM at all.
    assert pass_obj.report.kept == 3
    assert not pass_obj.last_result.changed


@pytest.mark.parametrize(
    ("options", "dispatched"),
    [
        # The transpose is materialized and the product of it dispatched as it is stored.
        (GemmOptions(transposed=False), {"NN": 3}),
        (GemmOptions(batched=False), {"NN": 1}),
        (GemmOptions(dtypes=("float64",)), {}),
    ],
)
def test_options_narrow_what_is_dispatched(options, dispatched):
    pass_obj = DispatchGemm(options)
    after = pass_obj(Batched)
    assert pass_obj.report.dispatched == dispatched
    # The score matmul either reads the stored transpose or stays with TVM: it is kept.
    assert "R.permute_dims(k" in after.script()
    assert pass_obj.report.total + pass_obj.report.kept == 3


def test_options_are_type_checked():
    with pytest.raises(TypeError, match="GemmOptions"):
        DispatchGemm({"batched": False})  # type: ignore[arg-type]


def test_dispatch_computes_what_tvm_computes():
    def run(mod, flag, s):
        exe = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=flag))
        vm = relax.VirtualMachine(exe, tvm.cpu())
        rng = np.random.default_rng(s)
        args = [
            rng.standard_normal(
                [s if isinstance(d, tvm.tirx.Var) else int(d) for d in p.ty.shape.values]
            ).astype("float32")
            for p in mod["main"].params
        ]
        return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in args])]

    for s in (1, 5, 33):
        for mod in (Linear, Batched):
            for got, want in zip(run(mod, True, s), run(mod, False, s)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def without_torch(monkeypatch):
    """The process as it is without PyTorch: the GEMM functions unregistered, the notice not
    yet given."""
    monkeypatch.setattr(runtime_gemm, "torch_found", lambda: False)
    monkeypatch.setattr(dispatch_module, "_TOLD", False)
    assert not runtime_gemm.register_gemm_functions()
    yield
    monkeypatch.undo()
    assert runtime_gemm.register_gemm_functions()


def test_without_torch_the_pipeline_keeps_tvm_kernels_and_says_so_once(without_torch, caplog):
    assert tvm.get_global_func(GEMM_FUNCS["NN"], allow_missing=True) is None
    with caplog.at_level(logging.WARNING, logger="blade_relax"):
        lowered = lower_to_memory_stage(Linear, "llvm", stop_before="legalize", dispatch_gemm=True)
        exe = tvm.compile(Batched, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=True))
    assert "call_dps_packed" not in lowered.script()
    told = [r.getMessage() for r in caplog.records if "not dispatched" in r.getMessage()]
    assert told == [dispatch_module.NOT_DISPATCHED]
    vm = relax.VirtualMachine(exe, tvm.cpu())
    q = np.ones((2, 3, 4), "float32")
    w = np.eye(4, dtype="float32")
    scores, projected = vm["main"](*(tvm.runtime.tensor(a) for a in (q, q, w)))
    np.testing.assert_allclose(scores.numpy(), np.full((2, 3, 3), 4.0))
    np.testing.assert_allclose(projected.numpy(), np.full((2, 3, 4), 12.0))

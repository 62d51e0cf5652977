"""Tests of RewriteSoftmaxBackward: the score gradient as one GEMM-with-epilogue kernel."""

# ruff: noqa: E501  (TVMScript signatures are long)
# fmt: off
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.pipeline import PipelineFlags
from blade_relax.transform import RewriteSoftmaxBackward, SoftmaxBackwardOptions

from ._steps import run_step, tiny_training_graph


@I.ir_module
class SoftmaxBackward:
    """``O = P @ V`` and the backward of the softmax as autograd exports it, scaled."""

    @R.function
    def main(scores: R.Tensor((1, 2, "s", "s"), "float32"), v: R.Tensor((2, "s", 8), "float32"), do: R.Tensor((2, "s", 8), "float32")):
        s = T.int64()
        with R.dataflow():
            p = R.nn.softmax(scores, axis=-1)
            p_heads = R.reshape(p, R.shape([2, s, s]))
            o = R.matmul(p_heads, v, out_dtype="float32")
            vt = R.permute_dims(v, axes=[0, 2, 1])
            dp_heads = R.matmul(do, vt, out_dtype="float32")
            dp = R.reshape(dp_heads, R.shape([1, 2, s, s]))
            t = R.multiply(dp, p)
            d = R.sum(t, axis=[-1], keepdims=True)
            pd = R.multiply(p, d)
            ds = R.subtract(t, pd)
            ds_scaled = R.multiply(ds, R.const(0.5, "float32"))
            ds_heads = R.reshape(ds_scaled, R.shape([2, s, s]))
            R.output(o, ds_heads)
        return (o, ds_heads)


@I.ir_module
class SoftmaxBackwardExpected:
    @T.prim_func(private=True, s_tir=True)
    def softmax_grad_NT_matmul(var_do: T.handle, var_v: T.handle, var_p_heads: T.handle, var_lv1: T.handle, var_softmax_grad: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        do = T.match_buffer(var_do, (T.int64(2), s, T.int64(8)))
        v = T.match_buffer(var_v, (T.int64(2), s, T.int64(8)))
        p_heads = T.match_buffer(var_p_heads, (T.int64(2), s, s))
        lv1 = T.match_buffer(var_lv1, (T.int64(2), s, T.int64(1)))
        softmax_grad = T.match_buffer(var_softmax_grad, (T.int64(2), s, s))
        NT_matmul = T.sblock_alloc_buffer((T.int64(2), s, s))
        for i0, i1, i2, k in T.grid(T.int64(2), s, s, T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(do[v_i0, v_i1, v_k], v[v_i0, v_i2, v_k])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = NT_matmul[v_i0, v_i1, v_i2] + do[v_i0, v_i1, v_k] * v[v_i0, v_i2, v_k]
        for i0, i1, i2 in T.grid(T.int64(2), s, s):
            with T.sblock("softmax_grad"):
                v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(p_heads[v_i0, v_i1, v_i2], NT_matmul[v_i0, v_i1, v_i2], lv1[v_i0, v_i1, T.int64(0)])
                T.writes(softmax_grad[v_i0, v_i1, v_i2])
                softmax_grad[v_i0, v_i1, v_i2] = p_heads[v_i0, v_i1, v_i2] * (NT_matmul[v_i0, v_i1, v_i2] - lv1[v_i0, v_i1, T.int64(0)]) * T.float32(0.5)

    @R.function
    def main(scores: R.Tensor((1, 2, "s", "s"), "float32"), v: R.Tensor((2, "s", 8), "float32"), do: R.Tensor((2, "s", 8), "float32")):
        s = T.int64()
        cls = SoftmaxBackwardExpected
        with R.dataflow():
            p = R.nn.softmax(scores, axis=-1)
            p_heads = R.reshape(p, R.shape([2, s, s]))
            o = R.matmul(p_heads, v, out_dtype="float32")
            lv = R.multiply(do, o)
            lv1 = R.sum(lv, axis=[-1], keepdims=True)
            lv2 = R.call_tir(cls.softmax_grad_NT_matmul, (do, v, p_heads, lv1), out_ty=R.Tensor((2, s, s), "float32"))
            ds_scaled = R.reshape(lv2, R.shape([1, 2, s, s]))
            ds_heads = R.reshape(ds_scaled, R.shape([2, s, s]))
            R.output(o, ds_heads)
        return (o, ds_heads)


@I.ir_module
class Refusals:
    """Softmax backwards left as they are: ``t`` read by another binding; the backward GEMM
    reading another tensor than ``V``; a softmax over another axis than the last; a ``V``
    broadcast over the heads by the GEMM."""

    @R.function
    def main(scores: R.Tensor((2, "s", "s"), "float32"), v: R.Tensor((2, "s", 8), "float32"), w: R.Tensor((2, "s", 8), "float32"), do: R.Tensor((2, "s", 8), "float32"), shared: R.Tensor((1, "s", 8), "float32")):
        with R.dataflow():
            p = R.nn.softmax(scores, axis=-1)
            o = R.matmul(p, v, out_dtype="float32")
            dp = R.matmul(do, R.permute_dims(v, axes=[0, 2, 1]), out_dtype="float32")
            t = R.multiply(dp, p)
            ds = R.subtract(t, R.multiply(p, R.sum(t, axis=[-1], keepdims=True)))
            kept = R.add(ds, t)
            other_dp = R.matmul(do, R.permute_dims(w, axes=[0, 2, 1]), out_dtype="float32")
            t2 = R.multiply(other_dp, p)
            ds2 = R.subtract(t2, R.multiply(p, R.sum(t2, axis=[-1], keepdims=True)))
            q = R.nn.softmax(scores, axis=1)
            oq = R.matmul(q, v, out_dtype="float32")
            dq = R.matmul(do, R.permute_dims(v, axes=[0, 2, 1]), out_dtype="float32")
            t3 = R.multiply(dq, q)
            ds3 = R.subtract(t3, R.multiply(q, R.sum(t3, axis=[-1], keepdims=True)))
            r = R.nn.softmax(scores, axis=-1)
            o4 = R.matmul(r, shared, out_dtype="float32")
            dr = R.matmul(do, R.permute_dims(shared, axes=[0, 2, 1]), out_dtype="float32")
            t4 = R.multiply(dr, r)
            ds4 = R.subtract(t4, R.multiply(r, R.sum(t4, axis=[-1], keepdims=True)))
            R.output(o, kept, ds2, oq, ds3, o4, ds4)
        return (o, kept, ds2, oq, ds3, o4, ds4)
# fmt: on


def test_the_score_gradient_is_one_kernel_over_p(well_formed_checks):
    rewrite = RewriteSoftmaxBackward()
    tvm.ir.assert_structural_equal(rewrite(SoftmaxBackward), SoftmaxBackwardExpected)
    assert (rewrite.report.rewritten, rewrite.report.scales_folded) == (1, 1)
    assert rewrite.last_result["main"].changes == (
        "1 softmax backward computed as one GEMM with an epilogue",
    )


def test_what_is_not_proven_passes_through(well_formed_checks):
    rewrite = RewriteSoftmaxBackward()
    normalized = relax.transform.Normalize()(Refusals)
    tvm.ir.assert_structural_equal(rewrite(normalized), normalized)
    assert rewrite.report.rewritten == 0


def test_options():
    off = RewriteSoftmaxBackward(SoftmaxBackwardOptions(enabled=False))
    tvm.ir.assert_structural_equal(off(SoftmaxBackward), SoftmaxBackward)
    unscaled = RewriteSoftmaxBackward(SoftmaxBackwardOptions(fold_scale=False))
    out = unscaled(SoftmaxBackward)
    assert (unscaled.report.rewritten, unscaled.report.scales_folded) == (1, 0)
    assert "R.multiply(ds, R.const(0.5" in out.script()
    with pytest.raises(TypeError, match="expects SoftmaxBackwardOptions"):
        RewriteSoftmaxBackward(object())


def _run(mod: tvm.IRModule, s: int) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    rng = np.random.default_rng(s)
    shapes = [(1, 2, s, s), (2, s, 8), (2, s, 8)]
    args = [tvm.runtime.tensor(rng.standard_normal(x).astype("float32")) for x in shapes]
    return [out.numpy() for out in vm["main"](*args)]


@pytest.mark.parametrize("s", [1, 5, 33])
def test_the_gradient_agrees_to_rounding(s):
    expected, got = _run(SoftmaxBackward, s), _run(RewriteSoftmaxBackward()(SoftmaxBackward), s)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


def _softmax_grad_kernels(func: relax.Function) -> int:
    """Calls of the pass's kernel in a function at the memory stage (direct calls)."""
    return sum(
        isinstance(b.value, relax.Call)
        and isinstance(b.value.op, tvm.ir.GlobalVar)
        and b.value.op.name_hint.startswith("softmax_grad_NT_matmul")
        for block in func.body.blocks
        for b in block.bindings
    )


@pytest.mark.parametrize("workload", ["gpt2-train", "llama-train"])
def test_training_steps_agree_and_one_attention_matrix_is_live(workload):
    """Two-layer training steps, the length unbounded as the benchmark compiles them: every
    layer's score gradient is the new kernel, the loss and every gradient agree with the
    default pipeline's to rounding, and at a length where the attention matrices dominate the
    step peaks lower (one matrix live in the softmax's backward instead of two)."""
    graph, sizes = tiny_training_graph(workload)
    kernels, peaks, outs = [], [], []
    for rewrite in (False, True):
        flags = {
            **PipelineFlags.defaults(),
            "schedule": False,
            "remat": False,
            "softmax_backward": rewrite,
        }
        stage, out = run_step(graph, sizes, flags)
        outs.append(out)
        kernels.append(_softmax_grad_kernels(stage["main"]))
        timeline = memory_timeline(stage["main"], mod=stage)
        peaks.append(timeline.evaluate({"s": 1024}).peak)
    assert kernels == [0, 2]
    assert peaks[1] < peaks[0], peaks
    for ours, theirs in zip(outs[1], outs[0]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)

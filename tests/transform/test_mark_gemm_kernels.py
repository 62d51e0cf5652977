# ruff: noqa: E501
"""MarkGemmKernels: a GEMM kernel records what it computes, so that DispatchGemm still knows
it once dlight has scheduled it for a GPU; other kernels are left as they are."""

from __future__ import annotations

import re

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import tirx as T

import blade_relax
from blade_relax.contract import GEMM_FUNCS, GEMM_KERNEL_ATTR
from blade_relax.pipeline import pipeline_phases
from blade_relax.transform import MarkGemmKernels
from blade_relax.transform.dispatch_gemm import GemmKernel, gemm_layout


# fmt: off
@I.ir_module
class Before:
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(16), T.int64(8)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j, k in T.grid(T.int64(4), T.int64(16), T.int64(8)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    out[vi, vj] = T.float32(0.0)
                out[vi, vj] = out[vi, vj] + x[vi, vk] * w[vj, vk]

    @T.prim_func(private=True, s_tir=True)
    def add(y: T.Buffer((T.int64(4), T.int64(16)), "float32"), z: T.Buffer((T.int64(4), T.int64(16)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(T.int64(4), T.int64(16)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = y[vi, vj] + z[vi, vj]


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(16), T.int64(8)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"blade_relax.gemm_kernel": "NT:2,2,2:float32:0,1,2", "tirx.noalias": True})
        for i, j, k in T.grid(T.int64(4), T.int64(16), T.int64(8)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    out[vi, vj] = T.float32(0.0)
                out[vi, vj] = out[vi, vj] + x[vi, vk] * w[vj, vk]

    @T.prim_func(private=True, s_tir=True)
    def add(y: T.Buffer((T.int64(4), T.int64(16)), "float32"), z: T.Buffer((T.int64(4), T.int64(16)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(T.int64(4), T.int64(16)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = y[vi, vj] + z[vi, vj]
# fmt: on


def test_a_gemm_kernel_is_marked_and_others_are_not():
    marker = MarkGemmKernels()
    after = marker(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert marker.marked == ("NT_matmul",)
    # Marking again changes nothing.
    assert marker(after).same_as(after)


def test_the_mark_encodes_what_the_recognizer_found():
    kernel = gemm_layout(Before["NT_matmul"])
    assert kernel == GemmKernel("NT", (2, 2, 2), "float32", (0, 1, 2))
    assert GemmKernel.decode(kernel.encode()) == kernel
    # A kernel whose blocks no longer read as a GEMM (a GPU schedule) is known by its mark.
    scheduled = Before["add"].with_attr(GEMM_KERNEL_ATTR, kernel.encode())
    assert gemm_layout(scheduled) == kernel


def _cuda() -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def test_on_cuda_the_mark_comes_right_before_dlight():
    names = [p.info.name for p in pipeline_phases(_cuda())["legalize"]]  # dispatch_gemm is on
    assert names[names.index("MarkGemmKernels") + 1] == "ApplyDefaultSchedule"
    off = pipeline_phases(_cuda(), dispatch_gemm=False)["legalize"]
    assert "MarkGemmKernels" not in [p.info.name for p in off]
    assert "MarkGemmKernels" not in [
        p.info.name for p in pipeline_phases("llvm", dispatch_gemm=True)["legalize"]
    ]
    finalize = [p.info.name for p in pipeline_phases(_cuda(), dispatch_gemm=True)["finalize"]]
    assert "DispatchGemm" in finalize


def test_a_cuda_build_runs_the_three_gemms_of_a_linear_layer_on_aten():
    """Forward (NT), input gradient (NN) and weight gradient (TN) of three layers, built for
    sm_90 (no GPU needed): every GEMM kernel dlight scheduled becomes an ATen call."""
    pytest.importorskip("torch")
    from blade_relax.analysis.workspace import compile_keeping_module
    from blade_relax.gpuprog.gemm import gemm_module, llama_gemms

    sizes = dict(hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)
    mod = gemm_module(llama_gemms(sizes))
    target = _cuda()
    compiled = compile_keeping_module(
        mod, target, blade_relax.get_pipeline(target, dispatch_gemm=True)
    )
    text = compiled.module.script()
    called = set(re.findall(r'"(blade_relax\.gemm_\w+)"', text))
    assert called == {GEMM_FUNCS["NT"], GEMM_FUNCS["NN"], GEMM_FUNCS["TN"]}
    kernels = [
        gv.name_hint
        for gv, f in compiled.module.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint
    ]
    assert kernels == []
    # With the flag off the GEMMs stay dlight's kernels.
    stock = compile_keeping_module(
        mod, target, blade_relax.get_pipeline(target, dispatch_gemm=False)
    )
    assert "blade_relax.gemm_" not in stock.module.script()
    assert isinstance(compiled.executable, relax.VMExecutable)

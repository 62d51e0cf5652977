# ruff: noqa: E501
"""BindElementwiseKernels: a marked in-place kernel gets its GPU threads (one flat index,
split into blocks and threads, the tail masked); other kernels are left as they are."""

from __future__ import annotations

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from blade_relax.contract import ELEMENTWISE_KERNEL_ATTR
from blade_relax.pipeline import pipeline_phases
from blade_relax.training.optimizers import AdamW, update_kernel
from blade_relax.transform import BindElementwiseKernels, BindElementwiseOptions

CUDA = {"kind": "cuda", "arch": "sm_90"}


# fmt: off
@I.ir_module
class Before:
    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.handle, g: T.handle):
        T.func_attr({"blade_relax.elementwise_inplace": True, "tir.noalias": True})
        m, n = T.int64(), T.int64()
        P = T.match_buffer(p, (m, n))
        G = T.match_buffer(g, (m, n))
        for i0, i1 in T.grid(m, n):
            with T.sblock("update"):
                v0, v1 = T.axis.remap("SS", [i0, i1])
                P[v0, v1] = P[v0, v1] - T.float32(0.5) * G[v0, v1]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((T.int64(8),), "float32"), y: T.Buffer((T.int64(8),), "float32")):
        T.func_attr({"tir.noalias": True})
        for i in range(T.int64(8)):
            with T.sblock("scale"):
                vi = T.axis.remap("S", [i])
                y[vi] = x[vi] * T.float32(2)


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.handle, g: T.handle):
        T.func_attr({"blade_relax.elementwise_inplace": True, "tir.is_scheduled": True, "tir.noalias": True})
        m, n = T.int64(), T.int64()
        P = T.match_buffer(p, (m, n))
        G = T.match_buffer(g, (m, n))
        for block_x in T.thread_binding((m * n + T.int64(127)) // T.int64(128), thread="blockIdx.x"):
            for thread_x in T.thread_binding(T.int64(128), thread="threadIdx.x"):
                with T.sblock("update"):
                    v0 = T.axis.spatial(m, (block_x * T.int64(128) + thread_x) // n)
                    v1 = T.axis.spatial(n, (block_x * T.int64(128) + thread_x) % n)
                    T.where(block_x * T.int64(128) + thread_x < m * n)
                    T.reads(P[v0, v1], G[v0, v1])
                    T.writes(P[v0, v1])
                    P[v0, v1] = P[v0, v1] - T.float32(0.5) * G[v0, v1]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((T.int64(8),), "float32"), y: T.Buffer((T.int64(8),), "float32")):
        T.func_attr({"tir.noalias": True})
        for i in range(T.int64(8)):
            with T.sblock("scale"):
                vi = T.axis.remap("S", [i])
                y[vi] = x[vi] * T.float32(2)
# fmt: on


def test_a_marked_kernel_is_bound_and_others_are_not(well_formed_checks):
    bind = BindElementwiseKernels(BindElementwiseOptions(threads_per_block=128))
    after = bind(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert bind.bound == ("sgd",)


def test_a_bound_kernel_is_left_as_it_is():
    bind = BindElementwiseKernels(BindElementwiseOptions(threads_per_block=128))
    once = bind(Before)
    assert bind(once).same_as(once)
    assert bind.bound == ()


@pytest.mark.parametrize("ndim", [0, 1, 3])
@pytest.mark.parametrize("sharded", [False, True])
def test_every_update_kernel_of_the_optimizers_is_bound(ndim, sharded):
    kernel = update_kernel(AdamW()._rule(), ndim, "float32", sharded=sharded)
    assert kernel.attrs[ELEMENTWISE_KERNEL_ATTR]
    bind = BindElementwiseKernels()
    after = bind(tvm.IRModule({"adamw_update": kernel}))
    assert bind.bound == ("adamw_update",)
    text = after["adamw_update"].script()
    assert 'thread="blockIdx.x"' in text and 'thread="threadIdx.x"' in text
    assert text.count("T.thread_binding") == 2 and " in T.grid(" not in text
    # Every other loop is gone: what CUDA codegen needs of a kernel with no serial loop left.
    assert "for i" not in text


def test_bad_options_are_refused():
    for threads in (0, 2048):
        with pytest.raises(ValueError, match="threads_per_block"):
            BindElementwiseOptions(threads_per_block=threads)


def test_it_runs_before_dlight_on_gpu_targets_only():
    cuda = [p.info.name for p in pipeline_phases(CUDA, dispatch_gemm=False)["legalize"]]
    assert cuda.index("BindElementwiseKernels") == cuda.index("ApplyDefaultSchedule") - 1
    stock = [p.info.name for p in pipeline_phases(CUDA, **_all_off())["legalize"]]
    assert "BindElementwiseKernels" in stock  # the stock pipeline cannot build the kernels either
    gemm = [p.info.name for p in pipeline_phases(CUDA)["legalize"]]  # dispatch_gemm is on
    assert gemm.index("MarkGemmKernels") == gemm.index("ApplyDefaultSchedule") - 1
    assert gemm.index("BindElementwiseKernels") < gemm.index("MarkGemmKernels")
    phases = pipeline_phases("llvm")
    assert all("BindElementwiseKernels" != p.info.name for ps in phases.values() for p in ps)


def _all_off() -> dict[str, bool]:
    from blade_relax.pipeline import PipelineFlags

    return dict.fromkeys(PipelineFlags.switches(), False)

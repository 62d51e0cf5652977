# ruff: noqa: E501, F841
"""InlineKernelIntermediates: fused CPU kernels compute elementwise chains without scratch."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.frontend.builtin import attention_block
from blade_relax.pipeline import lower_to_memory_stage, pipeline_phases
from blade_relax.transform import InlineKernelIntermediates, InlineOptions
from blade_relax.transform.inline_kernel_intermediates import inline_intermediates


# fmt: off
@I.ir_module
class Softmax:
    """What FuseTIR makes of ``softmax(x) + 1``: the ``exp`` and the quotient are scratch."""

    @T.prim_func(private=True, s_tir=True)
    def fused_softmax_add(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(8)))
        out = T.match_buffer(var_out, (s, T.int64(8)))
        maxelem = T.sblock_alloc_buffer((s,))
        e = T.sblock_alloc_buffer((s, T.int64(8)))
        expsum = T.sblock_alloc_buffer((s,))
        norm = T.sblock_alloc_buffer((s, T.int64(8)))
        for i0, k in T.grid(s, T.int64(8)):
            with T.sblock("maxelem"):
                v_i0, v_k = T.axis.remap("SR", [i0, k])
                T.reads(x[v_i0, v_k])
                T.writes(maxelem[v_i0])
                with T.init():
                    maxelem[v_i0] = T.float32(-3.0e38)
                maxelem[v_i0] = T.max(maxelem[v_i0], x[v_i0, v_k])
        for i0, i1 in T.grid(s, T.int64(8)):
            with T.sblock("exp"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(x[v_i0, v_i1], maxelem[v_i0])
                T.writes(e[v_i0, v_i1])
                e[v_i0, v_i1] = T.exp(x[v_i0, v_i1] - maxelem[v_i0])
        for i0, k in T.grid(s, T.int64(8)):
            with T.sblock("expsum"):
                v_i0, v_k = T.axis.remap("SR", [i0, k])
                T.reads(e[v_i0, v_k])
                T.writes(expsum[v_i0])
                with T.init():
                    expsum[v_i0] = T.float32(0.0)
                expsum[v_i0] = expsum[v_i0] + e[v_i0, v_k]
        for i0, i1 in T.grid(s, T.int64(8)):
            with T.sblock("norm"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(e[v_i0, v_i1], expsum[v_i0])
                T.writes(norm[v_i0, v_i1])
                norm[v_i0, v_i1] = e[v_i0, v_i1] / expsum[v_i0]
        for i0, i1 in T.grid(s, T.int64(8)):
            with T.sblock("add"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(norm[v_i0, v_i1])
                T.writes(out[v_i0, v_i1])
                out[v_i0, v_i1] = norm[v_i0, v_i1] + T.float32(1.0)

    @R.function
    def main(x: R.Tensor(("s", 8), "float32")) -> R.Tensor(("s", 8), "float32"):
        s = T.int64()
        cls = Softmax
        with R.dataflow():
            y = R.call_tir(cls.fused_softmax_add, (x,), out_ty=R.Tensor((s, 8), "float32"))
            R.output(y)
        return y


@I.ir_module
class SoftmaxExpected:
    @T.prim_func(private=True, s_tir=True)
    def fused_softmax_add(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(8)))
        out = T.match_buffer(var_out, (s, T.int64(8)))
        maxelem = T.sblock_alloc_buffer((s,))
        expsum = T.sblock_alloc_buffer((s,))
        for i0, k in T.grid(s, T.int64(8)):
            with T.sblock("maxelem"):
                v_i0, v_k = T.axis.remap("SR", [i0, k])
                T.reads(x[v_i0, v_k])
                T.writes(maxelem[v_i0])
                with T.init():
                    maxelem[v_i0] = T.float32(-3.0e38)
                maxelem[v_i0] = T.max(maxelem[v_i0], x[v_i0, v_k])
        for i0, k in T.grid(s, T.int64(8)):
            with T.sblock("expsum"):
                v_i0, v_k = T.axis.remap("SR", [i0, k])
                T.reads(x[v_i0, v_k], maxelem[v_i0])
                T.writes(expsum[v_i0])
                with T.init():
                    expsum[v_i0] = T.float32(0.0)
                expsum[v_i0] = expsum[v_i0] + T.exp(x[v_i0, v_k] - maxelem[v_i0])
        for i0, i1 in T.grid(s, T.int64(8)):
            with T.sblock("add"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(x[v_i0, v_i1], maxelem[v_i0], expsum[v_i0])
                T.writes(out[v_i0, v_i1])
                out[v_i0, v_i1] = T.exp(x[v_i0, v_i1] - maxelem[v_i0]) / expsum[v_i0] + T.float32(1.0)

    @R.function
    def main(x: R.Tensor(("s", 8), "float32")) -> R.Tensor(("s", 8), "float32"):
        s = T.int64()
        cls = SoftmaxExpected
        with R.dataflow():
            y = R.call_tir(cls.fused_softmax_add, (x,), out_ty=R.Tensor((s, 8), "float32"))
            R.output(y)
        return y


@T.prim_func(private=True, s_tir=True)
def reused_elements(var_x: T.handle, var_w: T.handle, var_out: T.handle):
    """A scaled operand read by a matmul (each element read once per output column) and a
    row vector broadcast to a matrix: inlining either would repeat its work."""
    T.func_attr({"tirx.noalias": True})
    s = T.int64()
    x = T.match_buffer(var_x, (s, T.int64(8)))
    w = T.match_buffer(var_w, (T.int64(8), T.int64(4)))
    out = T.match_buffer(var_out, (s, T.int64(4)))
    scaled = T.sblock_alloc_buffer((s, T.int64(8)))
    for i0, i1 in T.grid(s, T.int64(8)):
        with T.sblock("scale"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(x[v_i0, v_i1])
            T.writes(scaled[v_i0, v_i1])
            scaled[v_i0, v_i1] = x[v_i0, v_i1] * T.float32(2.0)
    for i0, i1, k in T.grid(s, T.int64(4), T.int64(8)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(scaled[v_i0, v_k], w[v_k, v_i1])
            T.writes(out[v_i0, v_i1])
            with T.init():
                out[v_i0, v_i1] = T.float32(0.0)
            out[v_i0, v_i1] = out[v_i0, v_i1] + scaled[v_i0, v_k] * w[v_k, v_i1]


@T.prim_func(private=True, s_tir=True)
def transpose_split(var_x: T.handle, var_q: T.handle, var_k: T.handle, var_v: T.handle):
    """What FuseTIR makes of a fused ``qkv`` projection moved to ``(heads, s, 3 * d)`` and split
    in three: each part reads a third of the moved copy."""
    T.func_attr({"tirx.noalias": True})
    s = T.int64()
    x = T.match_buffer(var_x, (s, T.int64(2), T.int64(6)))
    q = T.match_buffer(var_q, (T.int64(2), s, T.int64(2)))
    k = T.match_buffer(var_k, (T.int64(2), s, T.int64(2)))
    v = T.match_buffer(var_v, (T.int64(2), s, T.int64(2)))
    moved = T.sblock_alloc_buffer((T.int64(2), s, T.int64(6)))
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(6)):
        with T.sblock("T_transpose"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(x[v1, v0, v2])
            T.writes(moved[v0, v1, v2])
            moved[v0, v1, v2] = x[v1, v0, v2]
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(moved[v0, v1, v2])
            T.writes(q[v0, v1, v2])
            q[v0, v1, v2] = moved[v0, v1, v2]
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split_1"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(moved[v0, v1, v2 + T.int64(2)])
            T.writes(k[v0, v1, v2])
            k[v0, v1, v2] = moved[v0, v1, v2 + T.int64(2)]
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split_2"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(moved[v0, v1, v2 + T.int64(4)])
            T.writes(v[v0, v1, v2])
            v[v0, v1, v2] = moved[v0, v1, v2 + T.int64(4)]


@T.prim_func(private=True, s_tir=True)
def transpose_split_expected(var_x: T.handle, var_q: T.handle, var_k: T.handle, var_v: T.handle):
    T.func_attr({"tirx.noalias": True})
    s = T.int64()
    x = T.match_buffer(var_x, (s, T.int64(2), T.int64(6)))
    q = T.match_buffer(var_q, (T.int64(2), s, T.int64(2)))
    k = T.match_buffer(var_k, (T.int64(2), s, T.int64(2)))
    v = T.match_buffer(var_v, (T.int64(2), s, T.int64(2)))
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(x[v1, v0, v2])
            T.writes(q[v0, v1, v2])
            q[v0, v1, v2] = x[v1, v0, v2]
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split_1"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(x[v1, v0, v2 + T.int64(2)])
            T.writes(k[v0, v1, v2])
            k[v0, v1, v2] = x[v1, v0, v2 + T.int64(2)]
    for i0, i1, i2 in T.grid(T.int64(2), s, T.int64(2)):
        with T.sblock("T_split_2"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(x[v1, v0, v2 + T.int64(4)])
            T.writes(v[v0, v1, v2])
            v[v0, v1, v2] = x[v1, v0, v2 + T.int64(4)]
# fmt: on


def test_softmax_chain_is_inlined():
    pass_ = InlineKernelIntermediates(InlineOptions(epilogues=False, rows=False))
    tvm.ir.assert_structural_equal(pass_(Softmax), SoftmaxExpected)
    assert (pass_.report.inlined, pass_.report.kernels) == (2, 1)


def _lowered_scratch(func: tvm.tirx.PrimFunc) -> list[str]:
    """The scratch allocations TVM's own lowering makes for ``func``, as printed."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    s_tir = tvm.s_tir.transform
    mod = tvm.transform.Sequential(
        [
            s_tir.LowerInitBlock(),
            s_tir.PlanAndUpdateBufferAllocationLocation(),
            s_tir.ConvertBlocksToOpaque(),
            s_tir.CompactBufferAllocation(),
        ]
    )(mod)
    return [line.strip() for line in mod["main"].script().splitlines() if "alloc_buffer(" in line]


def test_reduction_readers_run_per_slice():
    """With epilogues on, the softmax's sum and quotient run per row of its maximum: TVM's
    lowering then keeps one element of each row reduction instead of s of them."""
    before = _lowered_scratch(Softmax["fused_softmax_add"])
    after = _lowered_scratch(InlineKernelIntermediates()(Softmax)["fused_softmax_add"])
    assert any("(s," in line for line in before), before
    assert after and all("((T.int64(1),)" in line for line in after), after
    pass_ = InlineKernelIntermediates()
    pass_(Softmax)
    assert (pass_.report.inlined, pass_.report.nested) == (2, 2)


def test_reused_elements_are_not_recomputed():
    func, report = inline_intermediates(reused_elements, InlineOptions(epilogues=False, rows=False))
    assert report.inlined == 0 and func.same_as(reused_elements)


def test_parts_of_a_split_read_the_moved_copy_once_in_all():
    """Three readers, each of a third: inlined (each element still computed once), where three
    readers of the whole would not be (three times the work, more than ``max_consumers``)."""
    func, report = inline_intermediates(transpose_split)
    assert report.inlined == 1
    tvm.ir.assert_structural_equal(func, transpose_split_expected)
    x = np.random.default_rng(3).standard_normal((5, 2, 6)).astype("float32")
    outs = []
    for kernel in (transpose_split, func):
        lib = tvm.compile(kernel.with_attr("global_symbol", "main"), "llvm")
        parts = [tvm.runtime.tensor(np.zeros((2, 5, 2), "float32")) for _ in range(3)]
        lib["main"](tvm.runtime.tensor(x), *parts)
        outs.append(np.concatenate([p.numpy() for p in parts], axis=-1))
    np.testing.assert_array_equal(outs[0], x.transpose(1, 0, 2))
    np.testing.assert_array_equal(outs[1], outs[0])
    # Readers that overlap: each reads two thirds, four thirds of the work in all (within 2x).
    wide = inline_intermediates(_widened(transpose_split, 4), InlineOptions(rows=False))[1]
    assert wide.inlined == 1
    # Three readers of the whole: three times the work, more than max_consumers = 2.
    whole = inline_intermediates(_widened(transpose_split, 6), InlineOptions(rows=False))[1]
    assert whole.inlined == 0


def _widened(func: tvm.tirx.PrimFunc, width: int) -> tvm.tirx.PrimFunc:
    """``transpose_split`` with parts ``width`` wide instead of 2 (they overlap), each reading
    the moved copy from offset 0."""
    script = func.script().replace("T.int64(2), s, T.int64(2)", f"T.int64(2), s, T.int64({width})")
    for offset in (2, 4):
        script = script.replace(f"v2 + T.int64({offset})", "v2")
    return tvm.script.from_source(script)


def test_producers_run_per_row_of_their_reader():
    """The rows stage computes the scaled operand one row at a time under the matmul's row
    loop (still once per element): TVM's lowering then keeps one row of scratch."""
    func, report = inline_intermediates(reused_elements)
    assert (report.inlined, report.rows) == (0, 1)
    before, after = _lowered_scratch(reused_elements), _lowered_scratch(func)
    assert any("(s, T.int64(8))" in line for line in before), before
    assert after and all("(s, T.int64(8))" not in line for line in after), after
    x = np.random.default_rng(0).standard_normal((5, 8)).astype("float32")
    w = np.random.default_rng(1).standard_normal((8, 4)).astype("float32")
    outs = []
    for kernel in (reused_elements, func):
        lib = tvm.compile(kernel.with_attr("global_symbol", "main"), "llvm")
        out = tvm.runtime.tensor(np.zeros((5, 4), "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[1], outs[0])


def test_last_result_says_what_changed_per_kernel():
    pass_ = InlineKernelIntermediates(InlineOptions(epilogues=False, rows=False))
    pass_(Softmax)
    kernel = pass_.last_result["fused_softmax_add"]
    assert kernel.changed and kernel.changes == ("2 intermediates inlined",)
    assert [f.function for f in pass_.last_result.changed_functions] == ["fused_softmax_add"]
    pass_(tvm.IRModule({"reused_elements": reused_elements}))
    assert not pass_.last_result.changed
    assert not pass_.last_result["reused_elements"].changed


def test_consumer_limit_and_disabled():
    one = InlineKernelIntermediates(InlineOptions(max_consumers=1, epilogues=False))
    result = one(Softmax)
    # The quotient has one consumer; exp has two and stays.
    assert one.report.inlined == 1
    assert InlineKernelIntermediates(InlineOptions(enabled=False))(Softmax).same_as(Softmax)
    with pytest.raises(ValueError, match="max_consumers"):
        InlineOptions(max_consumers=0)
    with pytest.raises(TypeError, match="InlineOptions"):
        InlineKernelIntermediates(2)


@pytest.mark.parametrize("s", [1, 9, 64])
def test_results_equal_the_untransformed_kernels(s):
    x = np.random.default_rng(s).standard_normal((s, 8)).astype("float32")
    outs = []
    for mod in (Softmax, InlineKernelIntermediates()(Softmax)):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[1], outs[0])


def test_cpu_pipeline_inlines_and_gpu_pipeline_does_not():
    """On llvm the fused kernels keep fewer scratch buffers; the CUDA pipeline leaves kernels
    to dlight."""
    attention = attention_block()

    def scratch_buffers(target, **flags):
        lowered = lower_to_memory_stage(attention, target, **flags)
        sizes = []
        for func in lowered.functions.values():
            if isinstance(func, tvm.tirx.PrimFunc):
                sch = tvm.s_tir.Schedule(func)
                try:
                    root = sch.get(sch.get_sblock("root"))
                except Exception:  # noqa: BLE001 - GPU-scheduled kernels have no plain root
                    continue
                sizes += [len(b.shape) for b in root.alloc_buffers]
        return sizes

    stock = scratch_buffers("llvm")
    inlined = scratch_buffers("llvm", inline_kernels=True)
    assert sum(stock) > sum(inlined)

    def names(target):
        phases = pipeline_phases(target, inline_kernels=True)
        return [p.info.name for passes in phases.values() for p in passes]

    assert "InlineKernelIntermediates" in names("llvm")
    assert "InlineKernelIntermediates" not in names({"kind": "cuda", "arch": "sm_90"})

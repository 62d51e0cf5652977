"""VectorizeSoftmax: structure (Before / Expected), what it leaves alone, and results bit for bit
against TVM's softmax kernel at several shapes."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis.inplace_reuse import inplace_verdict
from blade_relax.analysis.workspace import kernel_workspace
from blade_relax.contract import SOFTMAX_KERNEL_ATTR
from blade_relax.pipeline import get_pipeline, pipeline_phases
from blade_relax.transform import SoftmaxOptions, VectorizeSoftmax
from blade_relax.transform.vectorize_softmax import (
    is_softmax_kernel,
    log_softmax_axis,
    softmax_axis,
)

from ._kernels import LLVM, fuse, kernels


# fmt: off
@I.ir_module
class Rows:
    @R.function
    def main(x: R.Tensor((3, 20), "float32")):
        with R.dataflow():
            y = R.nn.softmax(x, axis=-1)
            R.output(y)
        return y


@T.prim_func(private=True, s_tir=True)
def rows_expected(x: T.Buffer((T.int64(3), T.int64(20)), "float32"), T_softmax_norm: T.Buffer((T.int64(3), T.int64(20)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    with T.sblock("root"):
        T.reads()
        T.writes()
        for v in range(T.int64(3)):
            buffer = T.alloc_buffer((16,))
            buffer_1 = T.alloc_buffer((2,))
            for v_1 in range(16):
                buffer[v_1] = T.float32(-340282346638528859811704183484516925440.0)
            for v_1, v_2 in T.grid(T.int64(1), 16):
                buffer[v_2] = T.max(buffer[v_2], x[v, v_1 * T.int64(16) + T.Cast("int64", v_2)])
            buffer_1[0] = T.float32(-340282346638528859811704183484516925440.0)
            for v_1 in range(16):
                buffer_1[0] = T.max(buffer_1[0], buffer[v_1])
            for v_1 in range(T.int64(4)):
                buffer_1[0] = T.max(buffer_1[0], x[v, T.int64(16) + v_1])
            for v_1 in range(T.int64(20)):
                T_softmax_norm[v, v_1] = T.exp(x[v, v_1] - buffer_1[0])
            buffer_1[1] = T.float32(0.0)
            for v_1 in range(T.int64(20)):
                buffer_1[1] = buffer_1[1] + T_softmax_norm[v, v_1]
            for v_1 in range(T.int64(20)):
                T_softmax_norm[v, v_1] = T_softmax_norm[v, v_1] / buffer_1[1]


@I.ir_module
class LogRows:
    @R.function
    def main(x: R.Tensor((3, 20), "float32")):
        with R.dataflow():
            y = R.nn.log_softmax(x, axis=-1)
            R.output(y)
        return y


@T.prim_func(private=True, s_tir=True)
def log_rows_expected(x: T.Buffer((T.int64(3), T.int64(20)), "float32"), compute: T.Buffer((T.int64(3), T.int64(20)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    with T.sblock("root"):
        T.reads()
        T.writes()
        for v in range(T.int64(3)):
            buffer = T.alloc_buffer((16,))
            buffer_1 = T.alloc_buffer((2,))
            for v_1 in range(16):
                buffer[v_1] = T.float32(-340282346638528859811704183484516925440.0)
            for v_1, v_2 in T.grid(T.int64(1), 16):
                buffer[v_2] = T.max(buffer[v_2], x[v, v_1 * T.int64(16) + T.Cast("int64", v_2)])
            buffer_1[0] = T.float32(-340282346638528859811704183484516925440.0)
            for v_1 in range(16):
                buffer_1[0] = T.max(buffer_1[0], buffer[v_1])
            for v_1 in range(T.int64(4)):
                buffer_1[0] = T.max(buffer_1[0], x[v, T.int64(16) + v_1])
            for v_1 in range(T.int64(20)):
                compute[v, v_1] = T.exp(x[v, v_1] - buffer_1[0])
            buffer_1[1] = T.float32(0.0)
            for v_1 in range(T.int64(20)):
                buffer_1[1] = buffer_1[1] + compute[v, v_1]
            buffer_1[1] = T.log(buffer_1[1])
            for v_1 in range(T.int64(20)):
                compute[v, v_1] = x[v, v_1] - buffer_1[0] - buffer_1[1]


@I.ir_module
class LogClasses:
    @R.function
    def main(x: R.Tensor(("s", "c"), "float32")):
        with R.dataflow():
            y = R.nn.log_softmax(x, axis=-1)
            R.output(y)
        return y


@I.ir_module
class Heads:
    @R.function
    def main(x: R.Tensor((1, 2, "s", "s"), "float32")):
        with R.dataflow():
            y = R.nn.softmax(x, axis=-1)
            R.output(y)
        return y


@I.ir_module
class Fused:
    """The softmax with its elementwise reader fused into one kernel: not TVM's softmax alone."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32")):
        with R.dataflow():
            y = R.multiply(R.nn.softmax(x, axis=-1), R.const(2.0, "float32"))
            R.output(y)
        return y


@I.ir_module
class FirstAxis:
    @R.function
    def main(x: R.Tensor((8, "s"), "float32")):
        with R.dataflow():
            y = R.nn.softmax(x, axis=0)
            R.output(y)
        return y
# fmt: on


def test_a_softmax_kernel_becomes_vector_loops():
    fused = fuse(Rows)
    (name, kernel) = next(iter(kernels(fused).items()))
    assert softmax_axis(kernel) == 1
    pass_ = VectorizeSoftmax()
    with LLVM:
        out = pass_(fused)
    expected = rows_expected.with_attrs(kernel.attrs).with_attr(SOFTMAX_KERNEL_ATTR, 1)
    tvm.ir.assert_structural_equal(kernels(out)[name], expected)
    # The rewritten kernel no longer reads as topi's softmax; the attribute says what it is.
    assert softmax_axis(kernels(out)[name]) is None and is_softmax_kernel(kernels(out)[name])
    assert pass_.kernels == 1 and pass_.last_result[name].changed
    # The Relax function is untouched.
    assert out["main"].same_as(fused["main"])


def test_a_log_softmax_kernel_becomes_vector_loops():
    fused = fuse(LogRows)
    (name, kernel) = next(iter(kernels(fused).items()))
    assert log_softmax_axis(kernel) == 1 and softmax_axis(kernel) is None
    pass_ = VectorizeSoftmax()
    with LLVM:
        out = pass_(fused)
    tvm.ir.assert_structural_equal(kernels(out)[name], log_rows_expected.with_attrs(kernel.attrs))
    assert pass_.kernels == 1 and pass_.last_result[name].changes == (
        "log-softmax over vectorizable loops",
    )


@pytest.mark.parametrize(("s", "c"), [(1, 1), (3, 15), (4, 16), (5, 17), (7, 512)])
def test_log_softmax_results_are_the_stock_kernels_bit_for_bit(s, c):
    rng = np.random.default_rng(c)
    x = (rng.standard_normal((s, c)) * 5).astype("float32")
    if c > 1:
        x[0, 0] = -np.inf  # a masked class
    fused = fuse(LogClasses)
    with LLVM:
        vectorized = VectorizeSoftmax()(fused)
    np.testing.assert_array_equal(_run(vectorized, [x]), _run(fused, [x]))


@pytest.mark.parametrize("module", [Fused, FirstAxis])
def test_other_kernels_are_left_alone(module):
    fused = fuse(module)
    pass_ = VectorizeSoftmax()
    with LLVM:
        out = pass_(fused)
    assert out.same_as(fused)
    assert pass_.kernels == 0 and not pass_.last_result.changed


@pytest.mark.parametrize("module", [Rows, LogRows, Heads])
def test_the_kernels_hold_no_workspace(module):
    """The lanes and the two scalars are constant-size buffers of global scope, which TVM
    keeps on the stack (of "local" scope, each row would take them from the workspace pool)."""
    fused = fuse(module)
    with LLVM:
        out = VectorizeSoftmax()(fused)
    for name, kernel in kernels(out).items():
        assert kernel_workspace(kernel, name, LLVM).allocations == ()


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        SoftmaxOptions(lanes=12)
    with pytest.raises(TypeError, match="SoftmaxOptions"):
        VectorizeSoftmax({"lanes": 16})


def _run(mod, args):
    exe = tvm.compile(mod, LLVM)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


@pytest.mark.parametrize("s", [1, 15, 16, 17, 40])
def test_results_are_the_stock_kernels_bit_for_bit(s):
    rng = np.random.default_rng(s)
    x = (rng.standard_normal((1, 2, s, s)) * 4).astype("float32")
    if s > 1:
        x[0, 0, 0, 0] = -np.inf  # a masked score (not a whole row: that would be 0 / 0)
    fused = fuse(Heads)
    with LLVM:
        vectorized = VectorizeSoftmax()(fused)
    want, got = _run(fused, [x]), _run(vectorized, [x])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_the_default_cpu_pipeline_runs_it_after_inline_kernel_intermediates():
    fused = [p.info.name for p in pipeline_phases("llvm")["fused"]]
    assert fused.index("VectorizeSoftmax") == fused.index("InlineKernelIntermediates") + 1
    cuda = pipeline_phases({"kind": "cuda", "arch": "sm_90"})
    assert "VectorizeSoftmax" not in [p.info.name for ph in cuda.values() for p in ph]
    x = np.random.default_rng(0).standard_normal((1, 2, 9, 9)).astype("float32")
    outs = []
    for on in (False, True):
        exe = tvm.compile(Heads, LLVM, relax_pipeline=get_pipeline(LLVM, vectorize_softmax=on))
        outs.append(relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("s", [1, 16, 40])
def test_the_softmax_kernel_may_write_over_its_input(s):
    """Each row is read whole (its maximum) before any of it is written, and each element at
    its own write after that: ``PlanMemory`` may place the probabilities in the scores'
    storage. Run in place, the kernel computes what it computes out of place, bit for bit.
    The log-softmax kernel reads its input again after writing: refused."""
    with LLVM:
        vectorized = VectorizeSoftmax()(fuse(Heads))
        logs = VectorizeSoftmax()(fuse(LogClasses))
    (name, kernel) = next(iter(kernels(vectorized).items()))
    assert inplace_verdict(kernel, [0], 1).ok
    assert not inplace_verdict(next(iter(kernels(logs).values())), [0], 1).ok
    compiled = tvm.compile(
        tvm.IRModule({"softmax": kernel.with_attr("global_symbol", "softmax")}), LLVM
    )
    rng = np.random.default_rng(s)
    x = (rng.standard_normal((1, 2, s, s)) * 4).astype("float32")
    apart = tvm.runtime.tensor(np.zeros_like(x))
    compiled["softmax"](tvm.runtime.tensor(x), apart)
    inplace = tvm.runtime.tensor(x)
    compiled["softmax"](inplace, inplace)
    np.testing.assert_array_equal(inplace.numpy(), apart.numpy())

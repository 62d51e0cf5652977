"""VectorizeColumnReductions: structure (Before / Expected), what it leaves alone, and results
bit for bit against TVM's reduction kernels at several shapes, a training step's gradients
included."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.pipeline import get_pipeline, pipeline_phases
from blade_relax.transform import ColumnReductionOptions, VectorizeColumnReductions
from blade_relax.transform.vectorize_column_reductions import column_reduction_order

from ._kernels import LLVM, fuse, kernels


# fmt: off
@I.ir_module
class ColumnSum:
    @R.function
    def main(x: R.Tensor(("s", 8), "float32")):
        with R.dataflow():
            y = R.sum(x, axis=[0])
            R.output(y)
        return y


@T.prim_func(private=True, s_tir=True)
def column_sum_expected(var_x: T.handle, x_red: T.Buffer((T.int64(8),), "float32")):
    T.func_attr({"op_pattern": 3, "tirx.noalias": True})
    s = T.int64()
    x = T.match_buffer(var_x, (s, T.int64(8)))
    for ax0_init in range(T.int64(8)):
        with T.sblock("x_red_init"):
            v_ax0 = T.axis.spatial(T.int64(8), ax0_init)
            T.reads()
            T.writes(x_red[v_ax0])
            x_red[v_ax0] = T.float32(0.0)
    for k0, ax0 in T.grid(s, T.int64(8)):
        with T.sblock("x_red_update"):
            v_ax0, v_k0 = T.axis.remap("SR", [ax0, k0])
            T.reads(x_red[v_ax0], x[v_k0, v_ax0])
            T.writes(x_red[v_ax0])
            x_red[v_ax0] = x_red[v_ax0] + x[v_k0, v_ax0]


@I.ir_module
class Reductions:
    """Reductions over outer and middle axes (rewritten), over the last axis and over a
    one-element row (left alone)."""

    @R.function
    def main(x: R.Tensor(("s", 64), "float32"), y: R.Tensor((2, "s", 16), "float32")):
        with R.dataflow():
            over_rows = R.sum(x, axis=[0])
            over_two = R.sum(y, axis=[0, 1])
            over_middle = R.max(y, axis=[1])
            along_rows = R.sum(x, axis=[1])
            scaled = R.sum(R.multiply(y, R.const(0.5, "float32")), axis=[1])
            R.output(over_rows, over_two, over_middle, along_rows, scaled)
        return (over_rows, over_two, over_middle, along_rows, scaled)


@I.ir_module
class Narrow:
    @R.function
    def main(x: R.Tensor(("s", 1), "float32")):
        with R.dataflow():
            y = R.sum(x, axis=[0])
            R.output(y)
        return y
# fmt: on


def test_a_column_sum_runs_along_rows():
    fused = fuse(ColumnSum)
    (name, kernel) = next(iter(kernels(fused).items()))
    assert column_reduction_order(kernel) == [1, 0]
    pass_ = VectorizeColumnReductions()
    with LLVM:
        out = pass_(fused)
    tvm.ir.assert_structural_equal(kernels(out)[name], column_sum_expected)
    assert pass_.kernels == 1 and pass_.last_result[name].changed
    assert out["main"].same_as(fused["main"])  # the Relax function is untouched


def test_which_kernels_it_rewrites():
    fused = fuse(Reductions)
    orders = {name: column_reduction_order(k) for name, k in kernels(fused).items()}
    # over_rows (s, 64) -> (64,); over_two (2, s, 16) -> (16,); over_middle and the fused
    # scale (2, s, 16) -> (2, 16): the output's last axis goes inside. along_rows is a row
    # reduction already contiguous.
    assert sorted(orders.values(), key=str) == sorted(
        [[1, 0], [1, 2, 0], [0, 2, 1], [0, 2, 1], None], key=str
    )
    pass_ = VectorizeColumnReductions()
    with LLVM:
        pass_(fused)
    assert pass_.kernels == 4


def test_a_one_element_row_is_left_alone():
    fused = fuse(Narrow)
    pass_ = VectorizeColumnReductions()
    with LLVM:
        out = pass_(fused)
    assert out.same_as(fused) and pass_.kernels == 0
    kernel = next(iter(kernels(fused).values()))
    assert column_reduction_order(kernel, min_inner_extent=1) == [1, 0]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ColumnReductionOptions(min_inner_extent=0)
    with pytest.raises(TypeError, match="ColumnReductionOptions"):
        VectorizeColumnReductions({"min_inner_extent": 2})


def _outputs(mod: tvm.IRModule, args: list[np.ndarray], fn: str = "main") -> list[np.ndarray]:
    exe = tvm.compile(mod, LLVM)
    out = relax.VirtualMachine(exe, tvm.cpu())[fn](*(tvm.runtime.tensor(a) for a in args))
    return [o.numpy() for o in out] if type(out).__name__ == "Array" else [out.numpy()]


@pytest.mark.parametrize("s", [1, 3, 17, 300])
def test_results_are_the_stock_kernels_bit_for_bit(s):
    rng = np.random.default_rng(s)
    x = (rng.standard_normal((s, 64)) * 3).astype("float32")
    y = (rng.standard_normal((2, s, 16)) * 3).astype("float32")
    fused = fuse(Reductions)
    with LLVM:
        rewritten = VectorizeColumnReductions()(fused)
    for got, want in zip(_outputs(rewritten, [x, y]), _outputs(fused, [x, y])):
        np.testing.assert_array_equal(got, want)


def _training_step() -> tvm.IRModule:
    """A linear layer with a bias and a squared loss, differentiated by Relax: the bias's
    gradient is a ``collapse_sum`` over the rows."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 24], "float32"))
    w = relax.Var("w", relax.TensorType([24, 40], "float32"))
    b = relax.Var("b", relax.TensorType([40], "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            h = bb.emit(relax.op.tanh(relax.op.add(relax.op.matmul(x, w), b)))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(h, h)))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=[w, b])(bb.get())
    return relax.transform.DeadCodeElimination(["main_adjoint"])(mod)


@pytest.mark.parametrize("n", [2, 33, 128])
def test_training_gradients_are_unchanged(n):
    """The default pipeline with and without the pass: loss and gradients bit for bit."""
    rng = np.random.default_rng(n)
    args = [
        rng.standard_normal((n, 24)).astype("float32"),
        (rng.standard_normal((24, 40)) * 0.2).astype("float32"),
        rng.standard_normal(40).astype("float32"),
    ]
    mod = _training_step()
    results = []
    for on in (False, True):
        exe = tvm.compile(mod, LLVM, relax_pipeline=get_pipeline(LLVM, vectorize_reductions=on))
        vm = relax.VirtualMachine(exe, tvm.cpu())
        loss, grads = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in args))
        results.append([loss.numpy()] + [g.numpy() for g in grads])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


def test_the_default_cpu_pipeline_runs_it_after_vectorize_softmax():
    fused = [p.info.name for p in pipeline_phases("llvm")["fused"]]
    assert fused.index("VectorizeColumnReductions") == fused.index("VectorizeScoreGrad") + 1
    assert fused.index("VectorizeScoreGrad") == fused.index("VectorizeSoftmax") + 1
    cuda = pipeline_phases({"kind": "cuda", "arch": "sm_90"})
    assert "VectorizeColumnReductions" not in [p.info.name for ph in cuda.values() for p in ph]

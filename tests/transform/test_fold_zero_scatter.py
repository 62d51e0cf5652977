# ruff: noqa: E501, F841
"""FoldZeroScatter: one-hots as predicates, accumulations into zeros as one reduction kernel."""

from __future__ import annotations

import functools
from typing import TypeVar

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.transform import FoldZeroScatter, ZeroScatterOptions


# fmt: off
@I.ir_module
class OneHot:
    """The one-hot of a cross-entropy backward."""

    @R.function
    def main(labels: R.Tensor(("s", 1), "int64"), g: R.Tensor(("s", 1), "float32")):
        s = T.int64()
        with R.dataflow():
            z = R.full(R.shape([s, 10]), R.const(0.0, "float32"), dtype="float32")
            oh = R.scatter_elements(z, labels, g, axis=1, reduction="update")
            y = R.multiply(oh, R.const(2.0, "float32"))
            R.output(y)
        return y


@I.ir_module
class OneHotExpected:
    @R.function
    def main(labels: R.Tensor(("s", 1), "int64"), g: R.Tensor(("s", 1), "float32")) -> R.Tensor(("s", 10), dtype="float32"):
        s = T.int64()
        with R.dataflow():
            lv: R.Tensor((10,), dtype="int64") = R.arange(0, 10, 1, dtype="int64")
            lv1: R.Tensor((1, 10), dtype="int64") = R.reshape(lv, R.shape([1, 10]))
            lv2: R.Tensor((s, 1), dtype="bool") = R.less(labels, R.const(0, "int64"))
            lv3: R.Tensor((s, 1), dtype="int64") = R.add(labels, R.const(10, "int64"))
            lv4: R.Tensor((s, 1), dtype="int64") = R.where(lv2, lv3, labels)
            lv5: R.Tensor((s, 10), dtype="bool") = R.equal(lv1, lv4)
            oh: R.Tensor((s, 10), dtype="float32") = R.where(lv5, g, R.const(0.0, "float32"))
            y: R.Tensor((s, 10), dtype="float32") = R.multiply(oh, R.const(2.0, "float32"))
            R.output(y)
        return y


@I.ir_module
class EmbeddingGrad:
    """An embedding's gradient: the importer's form of ``index_put_(..., accumulate=True)``."""

    @R.function
    def main(ids: R.Tensor(("s",), "int64"), dy: R.Tensor(("s", 4), "float32")):
        s = T.int64()
        with R.dataflow():
            z = R.zeros(R.shape([10, 4]), dtype="float32")
            e = R.expand_dims(ids, axis=[-1])
            eb = R.broadcast_to(e, R.shape([s, 4]))
            dw = R.scatter_elements(z, eb, dy, axis=0, reduction="add")
            R.output(dw)
        return dw


@I.ir_module
class VectorGatherGrad:
    """The gradient of a gather from a vector (a mixture-of-experts layer's routing weights,
    read in expert order): a one-dimensional accumulation."""

    @R.function
    def main(ids: R.Tensor(("s",), "int64"), dy: R.Tensor(("s",), "float32")):
        s = T.int64()
        with R.dataflow():
            z = R.zeros(R.shape([10]), dtype="float32")
            dw = R.scatter_elements(z, ids, dy, axis=0, reduction="add")
            R.output(dw)
        return dw


@I.ir_module
class EmbeddingGradOfABatch:
    """The same over a padded batch: the rows are ``b * s``, a size no buffer binds alone."""

    @R.function
    def main(ids: R.Tensor(("b", "s"), "int64"), dy: R.Tensor(("b", "s", 4), "float32")):
        b = T.int64()
        s = T.int64()
        with R.dataflow():
            z = R.zeros(R.shape([10, 4]), dtype="float32")
            flat = R.reshape(ids, R.shape([b * s]))
            rows = R.reshape(dy, R.shape([b * s, 4]))
            e = R.expand_dims(flat, axis=[-1])
            eb = R.broadcast_to(e, R.shape([b * s, 4]))
            dw = R.scatter_elements(z, eb, rows, axis=0, reduction="add")
            R.output(dw)
        return dw


@I.ir_module
class EmbeddingGradExpected:
    @T.prim_func(private=True, s_tir=True)
    def scatter_add_zero(var_ids: T.handle, var_dy: T.handle, scatter_add_zero: T.Buffer((T.int64(10), T.int64(4)), "float32")):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        ids = T.match_buffer(var_ids, (s,), "int64")
        dy = T.match_buffer(var_dy, (s, T.int64(4)))
        for i0, i1, i in T.grid(T.int64(10), T.int64(4), s):
            with T.sblock("scatter_add_zero"):
                v_i0, v_i1, v_i = T.axis.remap("SSR", [i0, i1, i])
                T.reads(ids[v_i], dy[v_i, v_i1])
                T.writes(scatter_add_zero[v_i0, v_i1])
                with T.init():
                    scatter_add_zero[v_i0, v_i1] = T.float32(0.0)
                scatter_add_zero[v_i0, v_i1] = scatter_add_zero[v_i0, v_i1] + T.Select(T.Select(ids[v_i] < T.int64(0), ids[v_i] + T.int64(10), ids[v_i]) == v_i0, dy[v_i, v_i1], T.float32(0.0))

    @R.function
    def main(ids: R.Tensor(("s",), "int64"), dy: R.Tensor(("s", 4), "float32")) -> R.Tensor((10, 4), dtype="float32"):
        cls = EmbeddingGradExpected
        with R.dataflow():
            dw = R.call_tir(cls.scatter_add_zero, (ids, dy), out_ty=R.Tensor((10, 4), dtype="float32"))
            R.output(dw)
        return dw


# The length, shared by the kernel's buffers (TVMScript's spelling of a dim bound by them).
s = TypeVar("s")


@I.ir_module
class EmbeddingGradSerialExpected:
    """With ``serial_accumulate``: zero the gradient, then add each row of ``dy`` to the row its
    id names (ids outside the vocabulary skipped)."""

    @T.prim_func(private=True)
    def scatter_add_zero(index: T.Buffer((s,), "int64"), updates: T.Buffer((s, T.int64(4)), "float32"), out: T.Buffer((T.int64(10), T.int64(4)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for v, v_1 in T.grid(T.int64(10), T.int64(4)):
            out[v, v_1] = T.float32(0.0)
        for v, v_1 in T.grid(s, T.int64(4)):
            if T.Select(index[v] < T.int64(0), index[v] + T.int64(10), index[v]) >= T.int64(0) and T.Select(index[v] < T.int64(0), index[v] + T.int64(10), index[v]) < T.int64(10):
                out[T.Select(index[v] < T.int64(0), index[v] + T.int64(10), index[v]), v_1] = out[T.Select(index[v] < T.int64(0), index[v] + T.int64(10), index[v]), v_1] + updates[v, v_1]

    @R.function
    def main(ids: R.Tensor(("s",), "int64"), dy: R.Tensor(("s", 4), "float32")) -> R.Tensor((10, 4), dtype="float32"):
        cls = EmbeddingGradSerialExpected
        with R.dataflow():
            dw = R.call_tir(cls.scatter_add_zero, (ids, dy), out_ty=R.Tensor((10, 4), dtype="float32"))
            R.output(dw)
        return dw


@I.ir_module
class Untouched:
    """Not a scatter into zeros, a reduction other than add, two indices per line with
    ``update`` (the winner is the loop order), data not zero; and one accumulation whose
    index is a row broadcast down the scatter axis (rewritten, reading the row)."""

    @R.function
    def main(d: R.Tensor(("s", 10), "float32"), i1: R.Tensor(("s", 1), "int64"), u1: R.Tensor(("s", 1), "float32"), i2: R.Tensor(("s", 2), "int64"), u2: R.Tensor(("s", 2), "float32"), row: R.Tensor((4,), "int64"), u4: R.Tensor((4, 4), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.scatter_elements(d, i1, u1, axis=1, reduction="update")
            z = R.zeros(R.shape([s, 10]), dtype="float32")
            b = R.scatter_elements(z, i1, u1, axis=1, reduction="mul")
            c = R.scatter_elements(z, i2, u2, axis=1, reduction="update")
            ones = R.full(R.shape([s, 10]), R.const(1.0, "float32"), dtype="float32")
            e = R.scatter_elements(ones, i1, u1, axis=1, reduction="update")
            z4 = R.zeros(R.shape([4, 4]), dtype="float32")
            rb = R.broadcast_to(row, R.shape([4, 4]))
            f = R.scatter_elements(z4, rb, u4, axis=0, reduction="add")
            R.output(a, b, c, e, f)
        return (a, b, c, e, f)
# fmt: on


def test_one_hot_becomes_a_predicate():
    tvm.ir.assert_structural_equal(FoldZeroScatter()(OneHot), OneHotExpected)


def test_embedding_gradient_becomes_one_kernel_reading_the_ids():
    tvm.ir.assert_structural_equal(FoldZeroScatter()(EmbeddingGrad), EmbeddingGradExpected)


def test_embedding_gradient_as_a_serial_loop_over_the_updates():
    result = FoldZeroScatter(ZeroScatterOptions(serial_accumulate=True))(EmbeddingGrad)
    tvm.ir.assert_structural_equal(result, EmbeddingGradSerialExpected)


def test_other_scatters_pass_through_unchanged():
    pass_ = FoldZeroScatter()
    result = pass_(Untouched)
    assert (pass_.report.one_hot, pass_.report.accumulate) == (0, 1)
    kernel = next(f for f in result.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert [p.name for p in kernel.params][:2] == ["row", "u4"]


# fmt: off
@I.ir_module
class EmbeddingGradClipped:
    """The joint export's form: the ids are clipped and reshaped before the broadcast."""

    @R.function
    def main(input_ids: R.Tensor((1, "s"), "int64"), dy: R.Tensor(("s", 4), "float32")):
        s = T.int64()
        with R.dataflow():
            z = R.full(R.shape([10, 4]), R.const(0.0, "float32"), dtype="float32")
            c = R.clip(input_ids, -10, 9)
            ids = R.reshape(c, R.shape([s]))
            e = R.expand_dims(ids, axis=[-1])
            eb = R.broadcast_to(e, R.shape([s, 4]))
            dw = R.scatter_elements(z, eb, dy, axis=0, reduction="add")
            R.output(dw)
        return dw
# fmt: on


def test_index_is_read_through_clip_and_unit_axes():
    result = FoldZeroScatter()(EmbeddingGradClipped)
    main = result["main"]
    bindings = main.body.blocks[0].bindings
    assert len(bindings) == 1, [b.var.name for b in bindings]
    kernel = next(f for f in result.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert [p.name for p in kernel.params][:2] == ["input_ids", "dy"]


def test_last_result_says_what_changed_per_function():
    pass_ = FoldZeroScatter()
    pass_(EmbeddingGrad)
    assert pass_.last_result["main"].changed
    assert pass_.last_result["main"].changes == (
        "1 accumulating scatter folded (reduction kernel)",
    )
    pass_(OneHot)
    assert pass_.last_result["main"].changes == ("1 one-hot scatter folded (predicate)",)
    assert "main: 1 one-hot scatter folded" in pass_.last_result.summary()
    no_one_hot = FoldZeroScatter(ZeroScatterOptions(one_hot=False))
    no_one_hot(OneHot)
    assert not no_one_hot.last_result.changed and not no_one_hot.last_result["main"].changed


def test_options_switch_rewrites_off():
    assert FoldZeroScatter(ZeroScatterOptions(one_hot=False)).__call__(OneHot).same_as(OneHot)
    assert FoldZeroScatter(ZeroScatterOptions(accumulate=False))(EmbeddingGrad).same_as(
        EmbeddingGrad
    )
    with pytest.raises(TypeError, match="ZeroScatterOptions"):
        FoldZeroScatter(True)


@functools.cache
def _executable(mod: tvm.IRModule, serial: bool | None = None):
    """``mod`` compiled as it is (``serial`` None) or after ``FoldZeroScatter`` with
    ``serial_accumulate=serial``: once for every length the test runs."""
    if serial is not None:
        mod = FoldZeroScatter(ZeroScatterOptions(serial_accumulate=serial))(mod)
    return tvm.compile(mod, "llvm")


def _run(mod: tvm.IRModule, args: list[np.ndarray], serial: bool | None = None) -> list[np.ndarray]:
    vm = relax.VirtualMachine(_executable(mod, serial), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    out = out if isinstance(out, tvm.ir.Array | list | tuple) else [out]
    return [o.numpy() for o in out]


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("s", [1, 5, 40])
def test_results_equal_the_untransformed_program(s, serial):
    """Negative and repeated indices included; sums are bit-identical."""
    rng = np.random.default_rng(s)
    cases = [
        (OneHot, [rng.integers(-10, 10, (s, 1)), rng.standard_normal((s, 1)).astype("float32")]),
        (
            EmbeddingGrad,
            [rng.integers(-10, 10, (s,)), rng.standard_normal((s, 4)).astype("float32")],
        ),
        (
            Untouched,
            [
                rng.standard_normal((s, 10)).astype("float32"),
                rng.integers(-10, 10, (s, 1)),
                rng.standard_normal((s, 1)).astype("float32"),
                rng.integers(0, 10, (s, 2)),
                rng.standard_normal((s, 2)).astype("float32"),
                rng.integers(-4, 4, (4,)),
                rng.standard_normal((4, 4)).astype("float32"),
            ],
        ),
    ]
    cases.append(
        (VectorGatherGrad, [rng.integers(-10, 10, (s,)), rng.standard_normal(s).astype("float32")])
    )
    cases.append(
        (
            EmbeddingGradOfABatch,
            [rng.integers(-10, 10, (3, s)), rng.standard_normal((3, s, 4)).astype("float32")],
        )
    )
    for module, args in cases:
        for want, got in zip(_run(module, args), _run(module, args, serial)):
            np.testing.assert_array_equal(got, want)

# ruff: noqa: E501, F841
"""SimplifyTransposes: transposes cancel and compose; matmuls read transposed operands in place."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax
from blade_relax.transform import SimplifyTransposes, TransposeOptions


# fmt: off
@I.ir_module
class Linear:
    """A linear layer's forward and backward as torch's joint export writes them."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((16, 8), "float32"), dy: R.Tensor(("s", 16), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, wt)
            wtt = R.permute_dims(wt, axes=[1, 0])
            dx = R.matmul(dy, wtt)
            dyt = R.permute_dims(dy, axes=[1, 0])
            dw = R.matmul(dyt, x)
            dwt = R.permute_dims(dw, axes=[1, 0])
            dwtt = R.permute_dims(dwt, axes=[1, 0])
            R.output(y, dx, dwtt)
        return (y, dx, dwtt)


@I.ir_module
class LinearExpected:
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(var_x: T.handle, w: T.Buffer((T.int64(16), T.int64(8)), "float32"), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(8)))
        NT_matmul = T.match_buffer(var_out, (s, T.int64(16)))
        for i0, i1, k in T.grid(s, T.int64(16), T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(x[v_i0, v_k], w[v_i1, v_k])
                T.writes(NT_matmul[v_i0, v_i1])
                with T.init():
                    NT_matmul[v_i0, v_i1] = T.float32(0.0)
                NT_matmul[v_i0, v_i1] = NT_matmul[v_i0, v_i1] + x[v_i0, v_k] * w[v_i1, v_k]

    @T.prim_func(private=True, s_tir=True)
    def TN_matmul(var_dy: T.handle, var_x: T.handle, TN_matmul: T.Buffer((T.int64(16), T.int64(8)), "float32")):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        dy = T.match_buffer(var_dy, (s, T.int64(16)))
        x = T.match_buffer(var_x, (s, T.int64(8)))
        for i0, i1, k in T.grid(T.int64(16), T.int64(8), s):
            with T.sblock("TN_matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(dy[v_k, v_i0], x[v_k, v_i1])
                T.writes(TN_matmul[v_i0, v_i1])
                with T.init():
                    TN_matmul[v_i0, v_i1] = T.float32(0.0)
                TN_matmul[v_i0, v_i1] = TN_matmul[v_i0, v_i1] + dy[v_k, v_i0] * x[v_k, v_i1]

    @R.function
    def main(x: R.Tensor(("s", 8), dtype="float32"), w: R.Tensor((16, 8), dtype="float32"), dy: R.Tensor(("s", 16), dtype="float32")) -> R.Tuple(R.Tensor(("s", 16), dtype="float32"), R.Tensor(("s", 8), dtype="float32"), R.Tensor((16, 8), dtype="float32")):
        s = T.int64()
        cls = LinearExpected
        with R.dataflow():
            y = R.call_tir(cls.NT_matmul, (x, w), out_ty=R.Tensor((s, 16), dtype="float32"))
            dx: R.Tensor((s, 8), dtype="float32") = R.matmul(dy, w, out_dtype=None)
            dwtt = R.call_tir(cls.TN_matmul, (dy, x), out_ty=R.Tensor((16, 8), dtype="float32"))
            R.output(y, dx, dwtt)
        return (y, dx, dwtt)


@I.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor(("a", 3, 4), "float32")):
        with R.dataflow():
            y = R.permute_dims(x, axes=[1, 2, 0])
            z = R.permute_dims(y, axes=[1, 2, 0])
            u = R.add(z, R.const(1.0, "float32"))
            R.output(u)
        return u


@I.ir_module
class ChainExpected:
    @R.function
    def main(x: R.Tensor(("a", 3, 4), "float32")) -> R.Tensor((4, "a", 3), dtype="float32"):
        a = T.int64()
        with R.dataflow():
            z: R.Tensor((4, a, 3), dtype="float32") = R.permute_dims(x, axes=[2, 0, 1])
            u: R.Tensor((4, a, 3), dtype="float32") = R.add(z, R.const(1.0, "float32"))
            R.output(u)
        return u


@I.ir_module
class Shared:
    """``wt`` has a second consumer: it stays, and the matmul no longer reads it."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, wt)
            z = R.add(wt, w)
            R.output(y, z)
        return (y, z)


@I.ir_module
class SharedExpected:
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(var_x: T.handle, w: T.Buffer((T.int64(8), T.int64(8)), "float32"), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(8)))
        NT_matmul = T.match_buffer(var_out, (s, T.int64(8)))
        for i0, i1, k in T.grid(s, T.int64(8), T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                T.reads(x[v_i0, v_k], w[v_i1, v_k])
                T.writes(NT_matmul[v_i0, v_i1])
                with T.init():
                    NT_matmul[v_i0, v_i1] = T.float32(0.0)
                NT_matmul[v_i0, v_i1] = NT_matmul[v_i0, v_i1] + x[v_i0, v_k] * w[v_i1, v_k]

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tuple(R.Tensor(("s", 8), dtype="float32"), R.Tensor((8, 8), dtype="float32")):
        s = T.int64()
        cls = SharedExpected
        with R.dataflow():
            wt: R.Tensor((8, 8), dtype="float32") = R.permute_dims(w, axes=[1, 0])
            y = R.call_tir(cls.NT_matmul, (x, w), out_ty=R.Tensor((s, 8), dtype="float32"))
            z: R.Tensor((8, 8), dtype="float32") = R.add(wt, w)
            R.output(y, z)
        return (y, z)


@I.ir_module
class Untouched:
    """Nothing to do: a plain matmul, a vector matmul, a transpose that is not of the last two
    axes, and a permute of a tensor of unknown rank."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((8, 4), "float32"), v: R.Tensor((8,), "float32"), b: R.Tensor((3, 3, 8, 8), "float32"), u: R.Tensor(dtype="float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.matmul(x, v)
            bt = R.permute_dims(b, axes=[1, 0, 3, 2])
            c = R.matmul(b, bt)
            ut = R.permute_dims(u)
            R.output(y, z, c, ut)
        return (y, z, c, ut)
# fmt: on


def test_linear_forward_and_backward():
    result = SimplifyTransposes()(Linear)
    tvm.ir.assert_structural_equal(result, LinearExpected)


def test_chain_composes_to_one_transpose():
    tvm.ir.assert_structural_equal(SimplifyTransposes()(Chain), ChainExpected)


def test_transpose_with_another_consumer_stays():
    tvm.ir.assert_structural_equal(SimplifyTransposes()(Shared), SharedExpected)


def test_untouched_module_is_returned_unchanged():
    pass_ = SimplifyTransposes()
    assert pass_(Untouched).same_as(Untouched)
    assert (pass_.report.composed, pass_.report.fused) == (0, 0)


def test_report_counts_each_rewrite():
    pass_ = SimplifyTransposes()
    pass_(Linear)
    assert (pass_.report.composed, pass_.report.cancelled, pass_.report.fused) == (2, 2, 2)


def test_last_result_says_what_changed_per_function():
    pass_ = SimplifyTransposes()
    assert pass_.last_result is None
    pass_(Linear)
    result = pass_.last_result
    assert result.pass_name == "SimplifyTransposes" and result.changed
    assert result["main"].changes == (
        "2 transpose pairs cancelled",
        "2 matmuls fused with a transpose",
    )
    assert result["main"].peak_before is None and result["main"].peak_after is None
    assert result.detail is pass_.report
    pass_(Untouched)
    assert not pass_.last_result.changed and not pass_.last_result["main"].changed
    assert pass_.last_result.summary() == "SimplifyTransposes: no change"


def test_options_switch_stages_off():
    only_compose = SimplifyTransposes(TransposeOptions(fuse_matmul=False))
    result = only_compose(Linear)
    assert only_compose.report.fused == 0 and only_compose.report.cancelled == 2
    assert not any(isinstance(f, tvm.tirx.PrimFunc) for f in result.functions.values())
    nothing = SimplifyTransposes(TransposeOptions(compose=False, fuse_matmul=False))
    assert nothing(Linear).same_as(Linear)


def test_rejects_foreign_options():
    with pytest.raises(TypeError, match="TransposeOptions"):
        SimplifyTransposes({"compose": True})


# fmt: off
@I.ir_module
class Batched:
    """Batched matmuls with broadcast batch axes and transposes on either side."""

    @R.function
    def main(a: R.Tensor((2, 3, "s", 4), "float32"), b: R.Tensor((3, 5, 4), "float32"), c: R.Tensor((1, "s", 5), "float32"), d: R.Tensor((2, 3, 4, "s"), "float32")):
        with R.dataflow():
            bt = R.permute_dims(b, axes=[0, 2, 1])
            nt = R.matmul(a, bt)
            ct = R.permute_dims(c, axes=[0, 2, 1])
            tn = R.matmul(ct, c, out_dtype="float32")
            dt = R.permute_dims(d, axes=[0, 1, 3, 2])
            at = R.permute_dims(a, axes=[0, 1, 3, 2])
            tt = R.matmul(dt, at)
            R.output(nt, tn, tt)
        return (nt, tn, tt)
# fmt: on


# fmt: off
@I.ir_module
class RowTransposes:
    """Transposes of a product's rows: a relative-position projection's ``(s * 4, 2) @ (2, 8)``
    moved to ``(1, 4, s, 8)``, and one without a reshape."""

    @R.function
    def main(x: R.Tensor((1, "s", 4, 2), "float32"), w: R.Tensor((2, 8), "float32"), v: R.Tensor(("s", 4, 2), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.reshape(x, R.shape([s * 4, 2]))
            m = R.matmul(a, w)
            r = R.reshape(m, R.shape([1, s, 4, 8]))
            t = R.permute_dims(r, axes=[0, 2, 1, 3])
            mv = R.matmul(v, w, out_dtype="float32")
            tv = R.permute_dims(mv, axes=[1, 0, 2])
            R.output(t, tv)
        return (t, tv)


@I.ir_module
class RowTransposesExpected:
    @R.function
    def main(x: R.Tensor((1, "s", 4, 2), "float32"), w: R.Tensor((2, 8), "float32"), v: R.Tensor(("s", 4, 2), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.reshape(x, R.shape([s * 4, 2]))
            a_rows = R.reshape(a, R.shape([1, s, 4, 2]))
            a_moved = R.permute_dims(a_rows, axes=[0, 2, 1, 3])
            t = R.matmul(a_moved, w)
            v_moved = R.permute_dims(v, axes=[1, 0, 2])
            tv = R.matmul(v_moved, w, out_dtype="float32")
            R.output(t, tv)
        return (t, tv)


@I.ir_module
class RowTransposesKept:
    """Transposes stage 3 leaves: onto a wider operand, of a product read elsewhere too, of a
    product's columns, after a reshape of its last axis, after a product with a batched
    weight."""

    @R.function
    def main(x: R.Tensor(("s", 4, 8), "float32"), w: R.Tensor((8, 2), "float32"), u: R.Tensor(("s", 4, 2), "float32"), w8: R.Tensor((2, 8), "float32"), wb: R.Tensor((4, 2, 8), "float32")):
        s = T.int64()
        with R.dataflow():
            narrow = R.matmul(x, w)
            wider = R.permute_dims(narrow, axes=[1, 0, 2])
            shared = R.matmul(u, w8)
            shared_t = R.permute_dims(shared, axes=[1, 0, 2])
            product = R.matmul(u, w8)
            columns = R.permute_dims(product, axes=[0, 2, 1])
            product2 = R.matmul(u, w8)
            split = R.reshape(product2, R.shape([s, 4, 2, 4]))
            split_t = R.permute_dims(split, axes=[1, 0, 2, 3])
            u_t = R.permute_dims(u, axes=[1, 0, 2])
            per_head = R.matmul(u_t, wb)
            batched = R.permute_dims(per_head, axes=[1, 0, 2])
            R.output(wider, shared, shared_t, columns, split_t, batched)
        return (wider, shared, shared_t, columns, split_t, batched)
# fmt: on


def test_row_transposes_move_onto_the_narrower_operand():
    pass_ = SimplifyTransposes()
    tvm.ir.assert_structural_equal(pass_(RowTransposes), RowTransposesExpected)
    assert pass_.report.moved == 2
    assert pass_.last_result["main"].changes == (
        "2 transposes moved onto a matmul's narrower operand",
    )


def test_row_transposes_that_would_not_narrow_stay():
    pass_ = SimplifyTransposes(TransposeOptions(compose=False, fuse_matmul=False))
    assert pass_(RowTransposesKept).same_as(RowTransposesKept)
    assert pass_.report.moved == 0


def test_options_switch_the_move_off():
    pass_ = SimplifyTransposes(TransposeOptions(move_to_narrow_operand=False))
    assert pass_(RowTransposes).same_as(RowTransposes)


def _run(mod: tvm.IRModule, args: list[np.ndarray]) -> list[np.ndarray]:
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in out]


@pytest.mark.parametrize("s", [1, 6, 33])
@pytest.mark.parametrize("module", [Linear, Batched], ids=["linear", "batched"])
def test_results_equal_the_untransformed_program(module, s):
    pass_ = SimplifyTransposes()
    transformed = pass_(module)
    assert pass_.report.fused >= 2
    rng = np.random.default_rng(s)
    params = module["main"].params
    shapes = [
        [s if not isinstance(d, tvm.tirx.IntImm) else int(d) for d in p.ty.shape.values]
        for p in params
    ]
    args = [rng.standard_normal(shape).astype("float32") for shape in shapes]
    for want, got in zip(_run(module, args), _run(transformed, args)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("s", [1, 6, 33])
def test_moved_transposes_give_the_untransformed_results(s):
    rng = np.random.default_rng(s)
    args = [
        rng.standard_normal(shape).astype("float32") for shape in ((1, s, 4, 2), (2, 8), (s, 4, 2))
    ]
    want = _run(RowTransposes, args)
    got = _run(SimplifyTransposes()(RowTransposes), args)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_default_pipeline_allocates_no_transposed_weight():
    """Through the whole pipeline: no kernel of the compiled linear step is a transpose."""
    lowered = blade_relax.pipeline.lower_to_memory_stage(Linear, "llvm", simplify=True)
    names = [
        gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert not any("transpose" in n for n in names), names
    stock = blade_relax.pipeline.lower_to_memory_stage(Linear, "llvm")
    stock_names = [
        gv.name_hint for gv, f in stock.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert any("transpose" in n for n in stock_names), stock_names

# ruff: noqa: E501, F841
"""FuseIntoSoleReader: an elementwise kernel read by one elementwise kernel is computed inside
it when its inputs are live there anyway, never raising the live bytes, bit for bit the same
results."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.transform import FuseIntoSoleReader, FuseReaderOptions


# fmt: off
@I.ir_module
class SoleReader:
    """``a = 2x`` is read only by ``c = a + b``, two bindings later; ``x`` is a parameter and
    ``b`` an output."""

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2.0)

    @T.prim_func(private=True, s_tir=True)
    def exp(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.exp(x[vi, vj])

    @T.prim_func(private=True, s_tir=True)
    def add(var_a: T.handle, var_b: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        b = T.match_buffer(var_b, (s, T.int64(4)))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]

    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tuple(R.Tensor(("s", 4), "float32"), R.Tensor(("s", 4), "float32")):
        s = T.int64()
        cls = SoleReader
        with R.dataflow():
            a = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.exp, (x,), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (a, b), out_ty=R.Tensor((s, 4), "float32"))
            R.output(b, c)
        return (c, b)


@I.ir_module
class Fused:
    @T.prim_func(private=True, s_tir=True)
    def exp(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.exp(x[vi, vj])

    @T.prim_func(private=True, s_tir=True)
    def fused_scale_add(p_x: T.handle, p_b: T.handle, p_output0: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(p_x, (s, T.int64(4)))
        b = T.match_buffer(p_b, (s, T.int64(4)))
        c_intermediate = T.match_buffer(p_output0, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(x[vi, vj], b[vi, vj])
                T.writes(c_intermediate[vi, vj])
                c_intermediate[vi, vj] = x[vi, vj] * T.float32(2.0) + b[vi, vj]

    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tuple(R.Tensor(("s", 4), "float32"), R.Tensor(("s", 4), "float32")):
        s = T.int64()
        cls = Fused
        with R.dataflow():
            b = R.call_tir(cls.exp, (x,), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.fused_scale_add, (x, b), out_ty=R.Tensor((s, 4), "float32"))
            R.output(b, c)
        return (c, b)


# fmt: on


# fmt: off
@I.ir_module
class Narrowing:
    """Kernels that read a row ``(s, 4)`` and give one value per row ``(s,)``."""

    @T.prim_func(private=True, s_tir=True)
    def first(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s,))
        for i in range(s):
            with T.sblock("first"):
                vi = T.axis.spatial(s, i)
                y[vi] = x[vi, T.int64(0)]

    @T.prim_func(private=True, s_tir=True)
    def shift(var_x: T.handle, n: T.int64, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("shift"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.Cast("float32", n)

    @T.prim_func(private=True, s_tir=True)
    def add1(var_a: T.handle, var_b: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s,))
        b = T.match_buffer(var_b, (s,))
        c = T.match_buffer(var_c, (s,))
        for i in range(s):
            with T.sblock("add1"):
                vi = T.axis.spatial(s, i)
                c[vi] = a[vi] + b[vi]
# fmt: on


def _variant(body, modules: tuple[tvm.IRModule, ...] | None = None) -> tvm.IRModule:
    """The kernels of ``modules`` (``SoleReader`` and ``Narrowing``) with a ``main`` whose
    block ``body(bb, x, gv)`` builds (``gv``: kernel name -> GlobalVar; ``x`` typed as the
    first module's); ``body`` returns the block's output."""
    modules = modules or (SoleReader, Narrowing)
    kernels = {
        gv: func
        for mod in modules
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc)
    }
    x = relax.Var("x", modules[0]["main"].params[0].ty)
    bb = relax.BlockBuilder(tvm.IRModule(kernels))
    gv = {g.name_hint: g for g in kernels}
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x, gv))
        bb.emit_func_output(out)
    return bb.get()


def _call(bb, gv, name, *args, ty=None):
    return bb.emit(relax.call_tir(gv[name], list(args), ty or args[0].ty))


def _kernels_called(mod: tvm.IRModule) -> list[str]:
    calls = [b.value for b in mod["main"].body.blocks[0].bindings]
    return [c.args[0].name_hint for c in calls if isinstance(c, relax.Call)]


def test_a_value_with_one_reader_is_computed_inside_it():
    after = FuseIntoSoleReader()(SoleReader)
    tvm.ir.assert_structural_equal(after, Fused)


def test_report_says_what_was_fused():
    fuse = FuseIntoSoleReader()
    fuse(SoleReader)
    assert (fuse.report.fused, fuse.report.kernels, fuse.report.refused) == (1, 1, 0)
    changed = fuse.last_result.changed_functions
    assert [f.function for f in changed] == ["main"]
    assert "1 kernel computed inside their one reader" in changed[0].changes


def test_a_value_read_twice_is_left_alone():
    def body(bb, x, gv):
        a = _call(bb, gv, "scale", x)
        return relax.Tuple([_call(bb, gv, "add", a, x), _call(bb, gv, "exp", a)])

    before = _variant(body)
    tvm.ir.assert_structural_equal(FuseIntoSoleReader()(before), before)


def test_a_kernel_with_a_scalar_argument_is_left_alone():
    """A dim passed as a value (``shift(x, s)``: mixture-of-experts kernels get their row
    counts so) would not reach the fused kernel through FuseTIR's group function."""

    def body(bb, x, gv):
        a = bb.emit(relax.call_tir(gv["shift"], [x, relax.prim_value(x.ty.shape[0])], x.ty))
        return relax.Tuple([_call(bb, gv, "add", a, x), x])

    before = _variant(body)
    tvm.ir.assert_structural_equal(FuseIntoSoleReader()(before), before)


def test_a_reader_that_is_a_reduction_is_left_alone():
    """Only injective readers: a reduction's loop nest is not where an elementwise value may
    be computed once per element."""

    @I.ir_module
    class Reduction:
        @T.prim_func(private=True, s_tir=True)
        def scale(var_x: T.handle, var_y: T.handle):
            T.func_attr({"op_pattern": 0, "tirx.noalias": True})
            s = T.int64()
            x = T.match_buffer(var_x, (s, T.int64(4)))
            y = T.match_buffer(var_y, (s, T.int64(4)))
            for i, j in T.grid(s, T.int64(4)):
                with T.sblock("scale"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] * T.float32(2.0)

        @T.prim_func(private=True, s_tir=True)
        def row_sum(var_x: T.handle, var_y: T.handle):
            T.func_attr({"op_pattern": 3, "tirx.noalias": True})
            s = T.int64()
            x = T.match_buffer(var_x, (s, T.int64(4)))
            y = T.match_buffer(var_y, (s,))
            for i, k in T.grid(s, T.int64(4)):
                with T.sblock("sum"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    with T.init():
                        y[vi] = T.float32(0.0)
                    y[vi] = y[vi] + x[vi, vk]

        @R.function
        def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s",), "float32"):
            s = T.int64()
            cls = Reduction
            with R.dataflow():
                a = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
                b = R.call_tir(cls.row_sum, (a,), out_ty=R.Tensor((s,), "float32"))
                R.output(b)
            return b

    tvm.ir.assert_structural_equal(FuseIntoSoleReader()(Reduction), Reduction)


def test_an_input_kept_alive_longer_must_be_no_larger_than_the_value():
    """``a`` computed from ``e`` at ``e``'s last read: fused into its reader, ``a`` keeps ``e``
    alive until there. Accepted when ``e`` is no larger than ``a`` (the bytes live in between
    do not rise); refused when ``a`` is one value per row of ``e``."""

    def equal_sizes(bb, x, gv):
        e = _call(bb, gv, "exp", x)
        g = _call(bb, gv, "exp", e)  # e is read twice: it stays a buffer
        a = _call(bb, gv, "scale", e)
        b = _call(bb, gv, "exp", x)
        return relax.Tuple([_call(bb, gv, "add", a, b), g])

    def narrowing(bb, x, gv):
        e = _call(bb, gv, "exp", x)
        g = _call(bb, gv, "exp", e)
        row = relax.TensorType([x.ty.shape[0]], "float32")
        a = _call(bb, gv, "first", e, ty=row)
        b = _call(bb, gv, "first", x, ty=row)
        return relax.Tuple([_call(bb, gv, "add1", a, b), g])

    after = FuseIntoSoleReader()(_variant(equal_sizes))
    assert _kernels_called(after) == ["exp", "exp", "fused_scale_exp_add"]
    after = FuseIntoSoleReader()(_variant(narrowing))
    assert _kernels_called(after) == ["exp", "exp", "first", "fused_first_add1"]


def test_options():
    with pytest.raises(ValueError, match="max_pattern"):
        FuseReaderOptions(max_pattern=3)
    with pytest.raises(ValueError, match="max_rounds"):
        FuseReaderOptions(max_rounds=0)
    with pytest.raises(TypeError, match="FuseReaderOptions"):
        FuseIntoSoleReader(1)
    off = FuseIntoSoleReader(FuseReaderOptions(enabled=False))
    tvm.ir.assert_structural_equal(off(SoleReader), SoleReader)
    assert off.last_result.notes == ("disabled by its options",)


@pytest.mark.parametrize("s", [1, 7, 64])
def test_live_bytes_never_rise_and_results_are_bit_identical(s):
    after = FuseIntoSoleReader()(SoleReader)
    dims = {"s": s}
    before_t = memory_timeline(SoleReader["main"], mod=SoleReader).evaluate(dims)
    after_t = memory_timeline(after["main"], mod=after).evaluate(dims)
    assert after_t.peak == before_t.peak - 16 * s  # ``a`` is gone: (s, 4) float32
    x = np.random.default_rng(s).standard_normal((s, 4)).astype("float32")
    outs = []
    for mod in (SoleReader, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        outs.append([t.numpy() for t in vm["main"](tvm.runtime.tensor(x))])
    for ours, theirs in zip(outs[1], outs[0]):
        np.testing.assert_array_equal(ours, theirs)


# fmt: off
@I.ir_module
class WrittenBetween:
    """``a = 2x`` is read only by ``c``, but ``x`` is halved in place in between: computed inside
    ``c``, ``a`` would read the halved ``x``."""

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2.0)

    @T.prim_func(private=True, s_tir=True)
    def halve(var_x: T.handle):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("halve"):
                vi, vj = T.axis.remap("SS", [i, j])
                x[vi, vj] = x[vi, vj] * T.float32(0.5)

    @T.prim_func(private=True, s_tir=True)
    def add(var_a: T.handle, var_b: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        b = T.match_buffer(var_b, (s, T.int64(4)))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]

    @R.function
    def main(x: R.Tensor(("s", 4), "float32"), y: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = WrittenBetween
        with R.dataflow():
            a = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            x2 = R.call_tir_inplace(cls.halve, (x,), inplace_indices=[0], out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (a, y), out_ty=R.Tensor((s, 4), "float32"))
            R.output(c)
        return c
# fmt: on


def test_no_producer_moves_past_an_in_place_write_of_its_input():
    fuse = FuseIntoSoleReader()
    assert fuse(WrittenBetween).same_as(WrittenBetween)


# fmt: off
@I.ir_module
class Shifted:
    """``a``, the labels shifted left with ``-1`` padded in (a causal LM loss's shift: an
    ``if_then_else``), read by one kernel: ``keep`` reads it twice per element (a ``where``
    on it), ``double`` once."""

    @T.prim_func(private=True, s_tir=True)
    def shift(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s,))
        y = T.match_buffer(var_y, (s,))
        for i in range(s):
            with T.sblock("shift"):
                vi = T.axis.spatial(s, i)
                y[vi] = T.if_then_else(vi + T.int64(1) < s, x[vi + T.int64(1)], T.float32(-1.0))

    @T.prim_func(private=True, s_tir=True)
    def keep(var_a: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s,))
        c = T.match_buffer(var_c, (s,))
        for i in range(s):
            with T.sblock("keep"):
                vi = T.axis.spatial(s, i)
                c[vi] = T.Select(a[vi] != T.float32(-1.0), a[vi], T.float32(0.0))

    @T.prim_func(private=True, s_tir=True)
    def double(var_a: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s,))
        c = T.match_buffer(var_c, (s,))
        for i in range(s):
            with T.sblock("double"):
                vi = T.axis.spatial(s, i)
                c[vi] = a[vi] * T.float32(2.0)

    @R.function
    def main(x: R.Tensor(("s",), "float32")) -> R.Tensor(("s",), "float32"):
        s = T.int64()
        cls = Shifted
        with R.dataflow():
            a = R.call_tir(cls.shift, (x,), out_ty=R.Tensor((s,), "float32"))
            c = R.call_tir(cls.keep, (a,), out_ty=R.Tensor((s,), "float32"))
            R.output(c)
        return c
# fmt: on


def test_a_conditional_its_reader_reads_twice_is_not_copied_into_it():
    """Fused, ``keep`` would evaluate the shift's ``if_then_else`` twice per element, which
    TVM's simplifier would enter under each enclosing condition (34-38 s to lower the loss
    gradient of a step specialized to one length): the pair is left as it is."""
    fuse = FuseIntoSoleReader()
    assert fuse(Shifted).same_as(Shifted)
    assert (fuse.report.fused, fuse.report.refused) == (0, 1)


@pytest.mark.parametrize("s", [1, 2, 9])
def test_a_conditional_read_once_is_computed_inside_its_reader(s):
    before = _variant(
        lambda bb, x, gv: _call(bb, gv, "double", _call(bb, gv, "shift", x)), (Shifted,)
    )
    after = FuseIntoSoleReader()(before)
    assert _kernels_called(after) == ["fused_shift_double"]
    x = np.random.default_rng(s).standard_normal(s).astype("float32")
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[1], outs[0])
    assert outs[0][-1] == -2.0

# ruff: noqa: E501, F841
"""RecomputeCheapValues: an elementwise result read late is recomputed there from inputs that are
live anyway, never raising the live bytes at any point."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.transform import RecomputeCheapValues, RecomputeOptions


# fmt: off
@I.ir_module
class LateRead:
    """``h = 2x`` is read at once and again four bindings later; ``x`` is a parameter."""

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
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = LateRead
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            a = R.call_tir(cls.add, (h, x), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            d = R.call_tir(cls.add, (c, h), out_ty=R.Tensor((s, 4), "float32"))
            R.output(d)
        return d


@I.ir_module
class LateReadExpected:
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
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = LateReadExpected
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            a = R.call_tir(cls.add, (h, x), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            h_recompute = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            d = R.call_tir(cls.add, (c, h_recompute), out_ty=R.Tensor((s, 4), "float32"))
            R.output(d)
        return d


@I.ir_module
class InputDiesEarly:
    """``h = 2t`` of a local ``t`` that nothing reads late (recomputing ``h`` alone would keep
    ``t`` alive), and ``g``, returned (read after the block)."""

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
        cls = InputDiesEarly
        with R.dataflow():
            t = R.call_tir(cls.add, (x, x), out_ty=R.Tensor((s, 4), "float32"))
            h = R.call_tir(cls.scale, (t,), out_ty=R.Tensor((s, 4), "float32"))
            g = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            a = R.call_tir(cls.add, (h, g), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            b2 = R.call_tir(cls.add, (b, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b2, b2), out_ty=R.Tensor((s, 4), "float32"))
            d = R.call_tir(cls.add, (c, h), out_ty=R.Tensor((s, 4), "float32"))
            e = R.call_tir(cls.add, (d, g), out_ty=R.Tensor((s, 4), "float32"))
            R.output(e, g)
        return (e, g)
# fmt: on


# fmt: off
@I.ir_module
class ViewReadLate:
    """``h = 2x`` is read at once, and its view ``hv`` (a reshape the VM runs as a view of
    ``h``'s memory) four bindings later."""

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

    @T.prim_func(private=True, s_tir=True)
    def flatten(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s * T.int64(4),))
        for i in range(s * T.int64(4)):
            with T.sblock("flatten"):
                vi = T.axis.spatial(s * T.int64(4), i)
                y[vi] = x[vi // T.int64(4), vi % T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def add_flat(var_a: T.handle, var_f: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        f = T.match_buffer(var_f, (s * T.int64(4),))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add_flat"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + f[vi * T.int64(4) + vj]
    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = ViewReadLate
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            hv = R.call_tir(cls.flatten, (h,), out_ty=R.Tensor((s * 4,), "float32"))
            a = R.call_tir(cls.add, (h, x), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            d = R.call_tir(cls.add_flat, (c, hv), out_ty=R.Tensor((s, 4), "float32"))
            R.output(d)
        return d


@I.ir_module
class ViewReadLateExpected:
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

    @T.prim_func(private=True, s_tir=True)
    def flatten(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s * T.int64(4),))
        for i in range(s * T.int64(4)):
            with T.sblock("flatten"):
                vi = T.axis.spatial(s * T.int64(4), i)
                y[vi] = x[vi // T.int64(4), vi % T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def add_flat(var_a: T.handle, var_f: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        f = T.match_buffer(var_f, (s * T.int64(4),))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add_flat"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + f[vi * T.int64(4) + vj]
    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = ViewReadLateExpected
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            a = R.call_tir(cls.add, (h, x), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            h_recompute = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            hv_recompute = R.call_tir(cls.flatten, (h_recompute,), out_ty=R.Tensor((s * 4,), "float32"))
            d = R.call_tir(cls.add_flat, (c, hv_recompute), out_ty=R.Tensor((s, 4), "float32"))
            R.output(d)
        return d


@I.ir_module
class ViewReadEarlyAndLate:
    """``h`` is read early through its view ``hv``, and late both directly and through
    ``hv``: a copy of ``h`` alone would leave ``hv`` holding ``h``'s memory until ``e``."""

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

    @T.prim_func(private=True, s_tir=True)
    def flatten(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s * T.int64(4),))
        for i in range(s * T.int64(4)):
            with T.sblock("flatten"):
                vi = T.axis.spatial(s * T.int64(4), i)
                y[vi] = x[vi // T.int64(4), vi % T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def add_flat(var_a: T.handle, var_f: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        f = T.match_buffer(var_f, (s * T.int64(4),))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add_flat"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + f[vi * T.int64(4) + vj]
    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = ViewReadEarlyAndLate
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            hv = R.call_tir(cls.flatten, (h,), out_ty=R.Tensor((s * 4,), "float32"))
            a = R.call_tir(cls.add_flat, (x, hv), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            d = R.call_tir(cls.add, (c, h), out_ty=R.Tensor((s, 4), "float32"))
            e = R.call_tir(cls.add_flat, (d, hv), out_ty=R.Tensor((s, 4), "float32"))
            R.output(e)
        return e


@I.ir_module
class ViewReadEarlyAndLateExpected:
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

    @T.prim_func(private=True, s_tir=True)
    def flatten(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        s = T.int64()
        x = T.match_buffer(var_x, (s, T.int64(4)))
        y = T.match_buffer(var_y, (s * T.int64(4),))
        for i in range(s * T.int64(4)):
            with T.sblock("flatten"):
                vi = T.axis.spatial(s * T.int64(4), i)
                y[vi] = x[vi // T.int64(4), vi % T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def add_flat(var_a: T.handle, var_f: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        f = T.match_buffer(var_f, (s * T.int64(4),))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("add_flat"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + f[vi * T.int64(4) + vj]
    @R.function
    def main(x: R.Tensor(("s", 4), "float32")) -> R.Tensor(("s", 4), "float32"):
        s = T.int64()
        cls = ViewReadEarlyAndLateExpected
        with R.dataflow():
            h = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            hv = R.call_tir(cls.flatten, (h,), out_ty=R.Tensor((s * 4,), "float32"))
            a = R.call_tir(cls.add_flat, (x, hv), out_ty=R.Tensor((s, 4), "float32"))
            b = R.call_tir(cls.add, (a, a), out_ty=R.Tensor((s, 4), "float32"))
            c = R.call_tir(cls.add, (b, b), out_ty=R.Tensor((s, 4), "float32"))
            h_recompute = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((s, 4), "float32"))
            hv_recompute = R.call_tir(cls.flatten, (h_recompute,), out_ty=R.Tensor((s * 4,), "float32"))
            d = R.call_tir(cls.add, (c, h_recompute), out_ty=R.Tensor((s, 4), "float32"))
            e = R.call_tir(cls.add_flat, (d, hv_recompute), out_ty=R.Tensor((s, 4), "float32"))
            R.output(e)
        return e
# fmt: on


@pytest.mark.parametrize(
    ("before", "expected"),
    [(ViewReadLate, ViewReadLateExpected), (ViewReadEarlyAndLate, ViewReadEarlyAndLateExpected)],
    ids=["late-through-view", "early-and-late-through-view"],
)
def test_reads_through_a_view_are_reads_of_the_value(before, expected):
    """A reshape is a view of its input's memory: its reads keep the value alive. The value is
    recomputed with its views for the late reads, so the early value and views die together;
    a copy for the direct reads alone would hold two copies while the view is read."""
    pass_ = RecomputeCheapValues()
    after = pass_(before)
    tvm.ir.assert_structural_equal(after, expected)
    assert pass_.report.recomputed == 1
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[1], outs[0])
    for s in (1, 16, 300):
        old = memory_timeline(before["main"], mod=before).evaluate({"s": s})
        new = memory_timeline(after["main"], mod=after).evaluate({"s": s})
        assert new.peak <= old.peak, s
        # In the gap, h's bytes (4 floats a row) are no longer held (nor hv's, which the
        # timeline of a dataflow block counts as a tensor of its own before it is a view).
        old_live = dict(zip(old.names, old.live_during))
        new_live = dict(zip(new.names, new.live_during))
        assert all(new_live[n] <= old_live[n] - 16 * s for n in "bc"), s


def test_a_view_read_after_the_block_keeps_the_value():
    """A view the function returns holds the value's memory to the end: nothing to gain."""
    view_returned = ViewReadLate.script().replace(
        "R.output(d)\n        return d", "R.output(d, hv)\n        return (d, hv)"
    )
    view_returned = view_returned.replace(
        '-> R.Tensor((s, 4), dtype="float32"):',
        '-> R.Tuple(R.Tensor((s, 4), dtype="float32"), R.Tensor((s * 4,), dtype="float32")):',
    )
    mod = tvm.script.from_source(view_returned)
    assert "return (d, hv)" in mod.script()
    pass_ = RecomputeCheapValues()
    assert pass_(mod).same_as(mod)
    assert pass_.report.recomputed == 0


def test_late_read_is_recomputed():
    pass_ = RecomputeCheapValues()
    tvm.ir.assert_structural_equal(pass_(LateRead), LateReadExpected)
    assert pass_.report.recomputed == 1


def test_value_whose_input_dies_early_needs_a_chain():
    """Without chains or longer-lived inputs nothing qualifies (``g`` escapes; ``h``'s input
    ``t`` dies early); with them ``t`` and ``h`` are recomputed from ``x``, as the timeline
    proves the peak no higher, and it is lower (five tensors are live at ``b2`` while ``h``
    waits for ``d``)."""
    single = RecomputeCheapValues(RecomputeOptions(max_chain=1, extend_inputs=False))
    assert single(InputDiesEarly).same_as(InputDiesEarly)
    assert single.report.recomputed == 0
    chained = RecomputeCheapValues()
    result = chained(InputDiesEarly)
    assert chained.report.recomputed == 1
    names = [b.var.name for b in result["main"].body.blocks[0].bindings]
    assert names.index("t_recompute") + 1 == names.index("h_recompute") == names.index("d") - 1
    for s in (1, 16, 300):
        before = memory_timeline(InputDiesEarly["main"], mod=InputDiesEarly).evaluate({"s": s})
        after = memory_timeline(result["main"], mod=result).evaluate({"s": s})
        assert after.peak < before.peak


def test_last_result_says_what_changed_per_function():
    pass_ = RecomputeCheapValues()
    pass_(LateRead)
    assert pass_.last_result["main"].changed
    assert pass_.last_result["main"].changes == ("1 value recomputed before late readers",)
    short_gap = RecomputeCheapValues(RecomputeOptions(min_gap=3))
    short_gap(LateRead)
    assert not short_gap.last_result.changed and not short_gap.last_result["main"].changed


def test_options():
    assert RecomputeCheapValues(RecomputeOptions(enabled=False))(LateRead).same_as(LateRead)
    # The gap (three bindings between the early and the late read) must exceed min_gap.
    assert RecomputeCheapValues(RecomputeOptions(min_gap=3))(LateRead).same_as(LateRead)
    with pytest.raises(ValueError, match="max_pattern"):
        RecomputeOptions(max_pattern=3)
    with pytest.raises(ValueError, match="min_gap"):
        RecomputeOptions(min_gap=0)
    with pytest.raises(ValueError, match="max_chain"):
        RecomputeOptions(max_chain=0)
    with pytest.raises(TypeError, match="RecomputeOptions"):
        RecomputeCheapValues(1)


@pytest.mark.parametrize("s", [1, 8, 100])
def test_live_bytes_never_rise_and_results_are_equal(s):
    """The timeline of the rewritten function is at or below the original's at every binding
    the two share, strictly below in the gap (``b``, ``c``); outputs are identical."""
    after = RecomputeCheapValues()(LateRead)
    dims = {"s": s}
    before_t = memory_timeline(LateRead["main"], mod=LateRead).evaluate(dims)
    after_t = memory_timeline(after["main"], mod=after).evaluate(dims)
    assert after_t.peak <= before_t.peak
    shared = dict(zip(before_t.names, before_t.live_during))
    for name, live in zip(after_t.names, after_t.live_during):
        if name in shared:
            assert live <= shared[name], name
    gap = {n: v for n, v in zip(after_t.names, after_t.live_during) if n in ("b", "c")}
    assert all(gap[n] == shared[n] - 8 * s * 2 for n in gap), (gap, shared)
    x = np.random.default_rng(s).standard_normal((s, 4)).astype("float32")
    outs = []
    for mod in (LateRead, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[1], outs[0])


def test_a_second_run_on_an_equal_function_replays_the_decision(monkeypatch):
    """MemoryAwareSchedule runs the pass on the order it picks and the pipeline runs it again
    on the same function: the second run replays the plans (no timeline trials), with the same
    result; other options, or another function, decide afresh."""
    from blade_relax.transform import recompute_cheap_values as rcv

    calls = []

    class Counting(rcv._DecisionMemo):
        def store(self, *args):  # called for every decision made afresh
            calls.append(1)
            super().store(*args)

    monkeypatch.setattr(rcv, "_DECISIONS", Counting())
    first = RecomputeCheapValues()(InputDiesEarly)
    assert len(calls) == 1
    copy = tvm.IRModule(dict(InputDiesEarly.functions))
    again = RecomputeCheapValues()(copy)
    assert len(calls) == 1
    tvm.ir.assert_structural_equal(again, first)
    RecomputeCheapValues(RecomputeOptions(max_chain=1, extend_inputs=False))(InputDiesEarly)
    assert len(calls) == 2
    RecomputeCheapValues()(LateRead)
    assert len(calls) == 3


def test_the_pipeline_replays_the_decision_on_the_order_the_schedule_chose(monkeypatch):
    """MemoryAwareSchedule recomputes each of its candidates (ten on this small MLP step) before
    the pipeline's own run of the pass, which then replays the decision made on the order
    chosen instead of deciding afresh: the memo outlives the comparison."""
    from blade_relax.bench import ModelSizes, build_workload
    from blade_relax.pipeline import get_pipeline
    from blade_relax.transform import recompute_cheap_values as rcv
    from blade_relax.transform.schedule import memory_aware_schedule

    found = []

    class Counting(rcv._DecisionMemo):
        def lookup(self, *args):
            plans = super().lookup(*args)
            found.append(plans is not None)
            return plans

    monkeypatch.setattr(rcv, "_DECISIONS", Counting())
    compared = []
    original = memory_aware_schedule.after_recompute

    def spy(*args):
        chosen = original(*args)
        compared.append((len(args[3]), chosen))
        return chosen

    monkeypatch.setattr(memory_aware_schedule, "after_recompute", spy)
    sizes = ModelSizes(layers=1, hidden=16, intermediate=32, vocab=8, max_seq_len=48)
    with tvm.transform.PassContext(opt_level=3):
        get_pipeline("llvm")(build_workload("mlp-train", sizes).graph.mod)
    ((candidates, chosen),) = compared
    assert candidates > 8
    assert len(chosen) == 1 and chosen[0][0] is None, "expected one order for all shapes"
    assert found[-1] and not any(found[:-1]), found


# fmt: off
@I.ir_module
class Kernels:
    """Elementwise kernels over ``(s, 4)`` and ``(64, 4)`` tensors (bytes that grow with ``s``
    and bytes that do not, so the peak is at different bindings for small and large ``s``),
    and ``mix``, which is not cheap (a reduction's pattern)."""

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

    @T.prim_func(private=True, s_tir=True)
    def mix(var_a: T.handle, var_b: T.handle, var_c: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        s = T.int64()
        a = T.match_buffer(var_a, (s, T.int64(4)))
        b = T.match_buffer(var_b, (s, T.int64(4)))
        c = T.match_buffer(var_c, (s, T.int64(4)))
        for i, j in T.grid(s, T.int64(4)):
            with T.sblock("mix"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] * b[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def wide_scale(x: T.Buffer((64, 4), "float32"), y: T.Buffer((64, 4), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i, j in T.grid(64, 4):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2.0)

    @T.prim_func(private=True, s_tir=True)
    def wide_add(a: T.Buffer((64, 4), "float32"), b: T.Buffer((64, 4), "float32"), c: T.Buffer((64, 4), "float32")):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        for i, j in T.grid(64, 4):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]
# fmt: on


def _random_block(seed: int) -> tvm.IRModule:
    """A dataflow block of ``Kernels`` calls with random reads: mostly recent values, some far
    back (the late reads the pass looks for); a few values are returned."""
    rng = np.random.default_rng(seed)
    s = tvm.tirx.Var("s", "int64")
    types = {"s": relax.TensorType([s, 4], "float32"), "64": relax.TensorType([64, 4], "float32")}
    x = relax.Var("x", types["s"])
    w = relax.Var("w", types["64"])
    kernels = {"s": ("scale", "add", "mix"), "64": ("wide_scale", "wide_add")}
    bb = relax.BlockBuilder(Kernels)
    with bb.function("main", [x, w]):
        with bb.dataflow():
            values = {"s": [x], "64": [w]}
            for i in range(int(rng.integers(8, 26))):
                family = "s" if rng.random() < 0.6 else "64"
                name = kernels[family][int(rng.integers(len(kernels[family])))]
                pool = values[family]
                args = []
                for _ in range(1 if name.endswith("scale") else 2):
                    recent = rng.random() < 0.7
                    low = max(0, len(pool) - 3) if recent else 0
                    args.append(pool[int(rng.integers(low, len(pool)))])
                gv = bb.get().get_global_var(name)
                var = bb.emit(relax.call_tir(gv, args, types[family]), name_hint=f"v{i}")
                pool.append(var)
            outputs = [values["s"][-1], values["64"][-1]]
            outputs += [v for v in values["s"][1:-1] if rng.random() < 0.1]
            out = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(out)
    return bb.get()


def test_the_screen_decides_as_the_timelines_do(monkeypatch):
    """Trials the sample screen rejects (no timeline of their own) are rejected by the full
    timelines too, and the numbers-first decision on a trial's timeline equals the proof-first
    one: on random blocks, the pass with the screen gives the module it gives without."""
    from blade_relax.transform import recompute_cheap_values as rcv

    keeps_peak = rcv._Screen.keeps_peak
    lowers = rcv._lowers
    pairs: list[tuple[bool, bool]] = []
    pending: list[bool] = []
    narrowed = 0  # rejections only the narrower window of an extended input gives

    def record_screen(self, plan, facts):
        nonlocal narrowed
        rejected = keeps_peak(self, plan, facts)
        if plan.extends is not None:
            narrowed += rejected and not keeps_peak(self, replace(plan, extends=None), facts)
        pending.append(rejected)
        return False  # every trial gets its timeline, as without the screen

    def record_lowers(trial, base, trial_screen, base_screen):
        decided = lowers(trial, base, trial_screen, base_screen)
        assert decided == lowers(trial, base, None, None)
        pairs.append((pending.pop(), decided))
        return decided

    def run(mod, mode):
        monkeypatch.setattr(rcv, "_DECISIONS", rcv._DecisionMemo())
        with monkeypatch.context() as patch:
            if mode == "plain":
                patch.setattr(rcv._Screen, "of", classmethod(lambda cls, timeline: None))
            elif mode == "recorded":
                patch.setattr(rcv._Screen, "keeps_peak", record_screen)
                patch.setattr(rcv, "_lowers", record_lowers)
            return RecomputeCheapValues()(mod)

    changed = 0
    for seed in range(40):
        mod = _random_block(seed)
        plain = run(mod, "plain")
        tvm.ir.assert_structural_equal(run(mod, "screened"), plain)
        tvm.ir.assert_structural_equal(run(mod, "recorded"), plain)
        changed += not plain.same_as(mod)
    assert not pending
    # A rejection by the screen is one by the timelines; trials of both kinds occur, and
    # trials the timelines accept. Some plans that keep an input alive are rejected only by
    # their narrower window.
    assert all(not decided for rejected, decided in pairs if rejected)
    assert any(rejected for rejected, _ in pairs)
    assert narrowed
    assert any(not rejected for rejected, _ in pairs)
    assert any(decided for _, decided in pairs)
    assert changed


def test_on_bounded_dims_the_grid_decides_as_the_proof_does(monkeypatch):
    """Where every value of the dims can be listed, a trial past the screen is decided by its
    peaks at each value, without the symbolic peaks: on random blocks whose dim is bounded,
    each such verdict is the proof-first one (a symbolic proof of no higher, else the peaks
    over the grid), and the pass builds the module it builds deciding proof-first."""
    from blade_relax.analysis import lowers_peak
    from blade_relax.transform import recompute_cheap_values as rcv

    lowers = rcv._lowers
    pairs: list[tuple[bool, bool]] = []  # (the pass's verdict, the proof-first one)
    proven = 0

    def proof_first(trial, base, trial_screen, base_screen):
        nonlocal proven
        if trial_screen is None or base_screen is None:
            return lowers(trial, base, trial_screen, base_screen)
        trial_peak, base_peak = trial_screen.sampled.peak, base_screen.sampled.peak
        if any(t > b for t, b in zip(trial_peak, base_peak)) or trial_peak == base_peak:
            return False
        assert base.graph.admissible_grid() is not None
        if base.graph.compare(trial.peak, base.peak) in rcv._NO_HIGHER:
            proven += 1
            decided = True
        else:
            decided = lowers_peak(trial, base) is True
        pairs.append((lowers(trial, base, trial_screen, base_screen), decided))
        return decided

    def run(mod, decide):
        monkeypatch.setattr(rcv, "_DECISIONS", rcv._DecisionMemo())
        with monkeypatch.context() as patch:
            patch.setattr(rcv, "_lowers", decide)
            return RecomputeCheapValues()(mod)

    changed = 0
    for seed in range(40):
        mod = _random_block(seed)
        mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {"s": 64})
        expected = run(mod, proof_first)
        tvm.ir.assert_structural_equal(run(mod, lowers), expected)
        changed += not expected.same_as(mod)
    assert all(ours == theirs for ours, theirs in pairs)
    # Trials past the screen occur, some of them proven symbolically; the blocks change.
    assert pairs and proven and changed


def _softmax_calls(func: relax.Function) -> int:
    return sum(
        1
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call)
        and isinstance(b.value.op, tvm.ir.Op)
        and b.value.op.name == "relax.call_tir"
        and "softmax" in b.value.args[0].name_hint
        and "log" not in b.value.args[0].name_hint
    )


@functools.cache
def _starcoder2_step() -> tuple[Any, Any]:
    """The tiny Starcoder2 of the zoo (seed 0) and its training step, imported once per
    process: the tests only read them."""
    import torch
    import transformers

    from blade_relax.bench.zoo import tiny_config
    from blade_relax.frontend import import_training_step

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("starcoder2"))
    return model, import_training_step(model, max_seq_len=64)


def test_attention_probabilities_are_recomputed_in_the_backward():
    """A two-layer causal LM's training step: each layer's probabilities are recomputed from
    its queries and keys before the backward reads them, which lowers the peak where they
    dominate and raises it nowhere; the step computes the same bits."""
    pytest.importorskip("transformers")
    import dataclasses

    from blade_relax import get_pipeline
    from blade_relax.frontend import flatten_outputs
    from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage

    pytest.importorskip("torch")
    model, graph = _starcoder2_step()
    flags = {f.name: getattr(PipelineFlags(), f.name) for f in dataclasses.fields(PipelineFlags)}
    fused = lower_to_memory_stage(
        graph.mod, stop_before="dataflow_lower", **{**flags, "recompute": False}
    )
    without = RecomputeCheapValues(RecomputeOptions(attention=False))(fused)
    pass_ = RecomputeCheapValues()
    with_attention = pass_(fused)
    layers = model.config.num_hidden_layers
    assert _softmax_calls(with_attention["main"]) == _softmax_calls(without["main"]) + layers
    peaks = [
        memory_timeline(m["main"], mod=m).evaluate({"s": s}).peak
        for m in (without, with_attention)
        for s in (2, 40, 64)
    ]
    assert peaks[3:] <= peaks[:3] and peaks[4] < peaks[1], peaks

    off = RecomputeOptions(attention=False)
    exes = [
        tvm.compile(graph.mod, "llvm", relax_pipeline=get_pipeline(recompute_options=o))
        for o in (off, None)
    ]
    vms = [relax.VirtualMachine(exe, tvm.cpu()) for exe in exes]
    params = [tvm.runtime.tensor(p) for p in graph.params]
    for s in (3, 40):
        ids = np.random.default_rng(s).integers(0, model.config.vocab_size, (1, s))
        inputs = [tvm.runtime.tensor(ids), tvm.runtime.tensor(ids)]
        plain, recomputed = (
            [t.numpy() for t in flatten_outputs(vm["main"](*inputs, *params))] for vm in vms
        )
        for a, b in zip(plain, recomputed):
            np.testing.assert_array_equal(b, a)


def test_attention_recomputation_is_proven_without_an_upper_bound(monkeypatch):
    """Without ``tir_var_upper_bound`` no grid holds every length: the recomputation is proven
    by checking the first lengths one by one and the rest symbolically, past the lengths where
    the step that holds the peak moves (``analysis.lowers_peak``); the symbolic comparison
    alone proves none. In the input order, recomputing both layers' probabilities lowers the
    peak at s = 40 and raises it nowhere (before ``FoldBroadcastMatmul`` removed the copy of
    ``P`` that ``P @ V`` read, the second layer's was refused: it then lowered the peak
    nowhere)."""
    pytest.importorskip("transformers")
    import dataclasses

    from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage

    pytest.importorskip("torch")
    model, graph = _starcoder2_step()
    graph = graph.with_upper_bounds(False)
    flags = {f.name: getattr(PipelineFlags(), f.name) for f in dataclasses.fields(PipelineFlags)}
    flags.update(recompute=False, schedule=False)
    fused = lower_to_memory_stage(graph.mod, stop_before="dataflow_lower", **flags)
    assert fused["main"].attrs is None or "tir_var_upper_bound" not in fused["main"].attrs
    without = RecomputeCheapValues(RecomputeOptions(attention=False))(fused)
    with_attention = RecomputeCheapValues()(fused)
    layers = model.config.num_hidden_layers
    assert _softmax_calls(with_attention["main"]) == _softmax_calls(without["main"]) + layers
    lengths = (2, 17, 40, 64, 1000, 5000)
    peaks = [
        [memory_timeline(m["main"], mod=m).evaluate({"s": s}).peak for s in lengths]
        for m in (without, with_attention)
    ]
    assert all(a <= b for a, b in zip(peaks[1], peaks[0])) and peaks[1][2] < peaks[0][2], peaks
    from blade_relax.symbolic import ShapeGraph
    from blade_relax.transform import recompute_cheap_values as rcv

    monkeypatch.setattr(rcv, "_DECISIONS", rcv._DecisionMemo())
    monkeypatch.setattr(ShapeGraph, "split_unbounded", lambda self, head=0: None)
    unproven = RecomputeCheapValues()(fused)
    assert _softmax_calls(unproven["main"]) == _softmax_calls(without["main"])

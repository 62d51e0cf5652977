"""In-place writes: which parameters a kernel stores to, and which bindings of a sequence
write into memory that existed before them (``analysis.effects.in_place_writes``)."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis.effects import (
    InPlaceWrites,
    in_place_writes,
    kernel_written_params,
    written_operands,
)
from blade_relax.training import SGD, AdamW


# fmt: off
@I.ir_module
class Update:
    """``w`` is read, updated in place through a reshape view, and read again after that."""

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        n = T.int64()
        w = T.match_buffer(var_w, (n, 4))
        g = T.match_buffer(var_g, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("sgd"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - T.float32(0.5) * g[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def sgd_flat(var_w: T.handle, var_g: T.handle):
        m = T.int64()
        w = T.match_buffer(var_w, (m,))
        g = T.match_buffer(var_g, (m,))
        for i in range(m):
            with T.sblock("sgd"):
                vi = T.axis.remap("S", [i])
                w[vi] = w[vi] - g[vi]

    @R.function
    def main(
        x: R.Tensor(("n", 4), "float32"), w: R.Tensor(("n", 4), "float32")
    ) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("n * 4",), "float32")):
        n = T.int64()
        cls = Update
        with R.dataflow():
            y = R.call_tir(cls.scale, (w,), out_ty=R.Tensor((n, 4), "float32"))
            w2 = R.call_tir_inplace(cls.sgd, (w, y), inplace_indices=[0], out_ty=R.Tensor((n, 4), "float32"))
            z = R.call_tir(cls.scale, (w2,), out_ty=R.Tensor((n, 4), "float32"))
            flat = R.reshape(w2, R.shape([n * 4]))
            gflat = R.reshape(x, R.shape([n * 4]))
            w3 = R.call_tir_inplace(cls.sgd_flat, (flat, gflat), inplace_indices=[0], out_ty=R.Tensor((n * 4,), "float32"))
            pair = (w3, x)
            first = pair[0]
            out = (z, first)
            R.output(out)
        return out


@I.ir_module
class NoUpdate:
    """Only destination-passing kernels: nothing is written in place."""

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)

    @R.function
    def main(w: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
        n = T.int64()
        cls = NoUpdate
        with R.dataflow():
            y = R.call_tir(cls.scale, (w,), out_ty=R.Tensor((n, 4), "float32"))
            v = R.reshape(y, R.shape([4, n]))
            z = R.reshape(v, R.shape([n, 4]))
            u = R.call_tir(cls.scale, (z,), out_ty=R.Tensor((n, 4), "float32"))
            R.output(u)
        return u


@I.ir_module
class Lowered:
    """After ``CallTIRRewrite``: ``scale`` writes its fresh output ``a``; ``sgd`` writes the
    parameter ``w``; the second ``scale`` writes ``a`` again, which is no longer fresh."""

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        n = T.int64()
        w = T.match_buffer(var_w, (n, 4))
        g = T.match_buffer(var_g, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("sgd"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - T.float32(0.5) * g[vi, vj]

    @R.function
    def main(
        x: R.Tensor(("n", 4), "float32"), w: R.Tensor(("n", 4), "float32")
    ) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("n", 4), "float32")):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = Lowered
        a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.scale(x, a)
        cls.sgd(w, a)
        w2 = w
        cls.scale(x, a)
        return (a, w2)
# fmt: on


def _bindings(mod: tvm.IRModule) -> list[relax.Binding]:
    return [b for block in mod["main"].body.blocks for b in block.bindings]


def _index(bindings: list[relax.Binding], name: str) -> int:
    (i,) = [k for k, b in enumerate(bindings) if b.var.name == name]
    return i


# --------------------------------------------------------------------------- kernels
def test_destination_passing_kernel_writes_only_its_output():
    assert kernel_written_params(Update["scale"]) == frozenset({1})


def test_in_place_kernel_writes_the_input_it_updates():
    assert kernel_written_params(Update["sgd"]) == frozenset({0})
    assert kernel_written_params(Update["sgd_flat"]) == frozenset({0})


def test_stores_into_an_intermediate_buffer_are_not_parameters():
    @T.prim_func(private=True, s_tir=True)
    def two_stage(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        t = T.alloc_buffer((n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("t"):
                vi, vj = T.axis.remap("SS", [i, j])
                t[vi, vj] = x[vi, vj] * T.float32(2)
        for i, j in T.grid(n, 4):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = t[vi, vj] + T.float32(1)

    assert kernel_written_params(two_stage) == frozenset({1})


@pytest.mark.parametrize(
    "optimizer, written",
    [(SGD(0.1), {0}), (SGD(0.1, momentum=0.9), {0, 2}), (AdamW(1e-3), {0, 2, 3})],
)
def test_optimizer_kernels_write_the_parameter_and_its_state(optimizer, written):
    """``(p, g, *states, scalars)``: the parameter and the states, never the gradient."""
    kernel = optimizer.kernel(relax.TensorType((8, 4), "float32"))
    assert kernel_written_params(kernel) == frozenset(written)


# --------------------------------------------------------------------------- dataflow
def test_call_tir_inplace_on_a_parameter_and_on_a_view_of_it():
    func = Update["main"]
    x, w = func.params
    bindings = _bindings(Update)
    at = {name: _index(bindings, name) for name in ("y", "w2", "z", "flat", "w3", "first")}
    writes = in_place_writes(bindings, Update)
    assert isinstance(writes, InPlaceWrites)
    # Both updates write the parameter: the first directly, the second through a view of it.
    assert writes.writes == {at["w2"]: frozenset({w}), at["w3"]: frozenset({w})}
    assert writes.written_roots == frozenset({w})
    by_name = {b.var.name: b.var for b in bindings}
    for name in ("w2", "flat", "w3"):
        assert writes.roots_of(by_name[name]) == frozenset({w}), name
    # A tuple item's roots are those of its tuple (every field, conservatively).
    assert w in writes.roots_of(by_name["first"])
    # Fresh results and parameters are their own roots.
    assert writes.roots_of(by_name["y"]) == frozenset({by_name["y"]})
    assert writes.roots_of(w) == frozenset({w})
    assert writes.roots_of(by_name["gflat"]) == frozenset({x})


def test_written_between_is_strict_on_both_sides():
    func = Update["main"]
    x, w = func.params
    bindings = _bindings(Update)
    y, w2, z = (_index(bindings, n) for n in ("y", "w2", "z"))
    writes = in_place_writes(bindings, Update)
    w2_var = bindings[w2].var
    # A read of w at y and another at z: the update at w2 lies between them.
    assert writes.written_between(w, y, z)
    assert writes.written_between(w2_var, y, z)  # the alias refers to the same memory
    assert not writes.written_between(w, y, w2)  # up to, not including, the update
    assert not writes.written_between(w, w2, z)  # from just after the first update
    assert not writes.written_between(x, -1, len(bindings))  # x is only read
    y_var = bindings[y].var
    assert not writes.written_between(y_var, -1, len(bindings))  # the gradient is only read
    # The view `flat` refers to w: the second update is a write of w too.
    flat, w3 = _index(bindings, "flat"), _index(bindings, "w3")
    assert writes.written_between(w, flat, w3 + 1)
    assert not writes.written_between(w, z, flat)


def test_written_operands_of_each_kind_of_call():
    bindings = _bindings(Update)
    _, w = Update["main"].params
    by_name = {b.var.name: b for b in bindings}
    (target,) = written_operands(by_name["w2"].value, Update)
    assert target.same_as(w)
    (view,) = written_operands(by_name["w3"].value, Update)
    assert view.same_as(by_name["flat"].var)
    # call_tir allocates its result: it writes nothing that existed before.
    assert written_operands(by_name["y"].value, Update) == ()
    assert written_operands(by_name["pair"].value, Update) == ()


def test_call_inplace_packed_writes_its_in_place_arguments():
    @I.ir_module
    class Packed:
        @R.function
        def main(w: R.Tensor((4,), "float32"), g: R.Tensor((4,), "float32")):
            w2 = R.call_inplace_packed(
                "test.update", w, g, inplace_indices=[0], ty_args=R.Tensor((4,), "float32")
            )
            return w2

    w, g = Packed["main"].params
    bindings = _bindings(Packed)
    (target,) = written_operands(bindings[0].value, Packed)
    assert target.same_as(w)
    writes = in_place_writes(bindings, Packed)
    assert writes.writes == {0: frozenset({w})}
    assert writes.roots_of(bindings[0].var) == frozenset({w})


def test_block_without_in_place_writes():
    bindings = _bindings(NoUpdate)
    writes = in_place_writes(bindings, NoUpdate)
    assert writes.writes == {}
    assert writes.written_roots == frozenset()
    (w,) = NoUpdate["main"].params
    assert not writes.written_between(w, -1, len(bindings))
    # Views of views resolve to the tensor that owns the memory.
    y = bindings[_index(bindings, "y")].var
    assert writes.roots_of(bindings[_index(bindings, "z")].var) == frozenset({y})


# --------------------------------------------------------------------------- lowered
def test_lowered_kernel_writing_its_fresh_output_is_not_a_write():
    """In the lowered function, ``scale(x, a)`` fills a fresh allocation (not reported),
    ``sgd(w, a)`` writes the parameter, and the second ``scale(x, a)`` overwrites ``a``."""
    x, w = Lowered["main"].params
    bindings = _bindings(Lowered)
    a = bindings[0].var
    writes = in_place_writes(bindings, Lowered)
    assert writes.writes == {2: frozenset({w}), 4: frozenset({a})}
    assert writes.roots_of(bindings[3].var) == frozenset({w})  # w2 = w
    # written_operands reports every argument the PrimFunc stores to, fresh or not.
    (out,) = written_operands(bindings[1].value, Lowered)
    assert out.same_as(a)
    (param,) = written_operands(bindings[2].value, Lowered)
    assert param.same_as(w)


def test_call_tir_rewrite_output_matches_the_dataflow_form():
    """``CallTIRRewrite`` of ``Update``: its call_tir outputs are fresh allocations (no write),
    its call_tir_inplace calls are direct kernel calls writing ``w`` (one through a view)."""
    lowered = relax.transform.CallTIRRewrite()(Update)
    _, w = lowered["main"].params
    bindings = _bindings(lowered)
    writes = in_place_writes(bindings, lowered)
    written = sorted(writes.writes)
    assert [bindings[i].value.op.name_hint for i in written] == ["sgd", "sgd_flat"]
    assert all(roots == frozenset({w}) for roots in writes.writes.values())
    calls = [
        i
        for i, b in enumerate(bindings)
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)
    ]
    assert [bindings[i].value.op.name_hint for i in calls] == ["scale", "sgd", "scale", "sgd_flat"]

"""Rematerialize: Before/Expected structure, unchanged cases, metadata and the alias hazard."""

from __future__ import annotations

import json

import pytest
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as phases
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax  # noqa: F401  (registers the runtime builtins)
from blade_relax.transform import Rematerialize, RematOptions
from blade_relax.transform._remat_timeline import (
    BEGIN,
    EVICT,
    META_ATTR,
    REGENERATE,
    RematHazardError,
    RematTimeline,
    simulate,
)

OPTIONS = RematOptions(min_bytes=0, min_fraction=0.0)


# --------------------------------------------------------------------------- fixtures
def _chain_module() -> tvm.IRModule:
    """``a`` is computed first and read again at the end, over two other kernels."""

    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            c = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(b, c)
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add(c, a, d)
            return d

    return Before


def _normalized(mod: tvm.IRModule) -> tvm.IRModule:
    """Drop the metadata (checked apart) so that the structure can be compared."""
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.attrs is not None and META_ATTR in func.attrs:
            func = func.without_attr(META_ATTR)
            blocks = []
            for block in func.body.blocks:
                bindings = []
                for b in block.bindings:
                    value = b.value
                    if (
                        isinstance(value, relax.Call)
                        and len(value.args) == 2
                        and isinstance(value.args[0], relax.ExternFunc)
                        and value.args[0].global_symbol == BEGIN
                    ):
                        args = list(value.args[1].fields)
                        args[0] = tvm.ir.StringImm("meta")
                        args[1] = relax.prim_value(0)
                        value = relax.Call(
                            value.op, [value.args[0], relax.Tuple(args)], value.attrs, value.ty_args
                        )
                        b = relax.VarBinding(b.var, value)
                    bindings.append(b)
                blocks.append(relax.BindingBlock(bindings))
            func = relax.Function(
                func.params,
                relax.SeqExpr(blocks, func.body.body),
                func.ret_ty,
                func.is_pure,
                func.attrs,
            )
            func = relax.BlockBuilder().normalize(func)
        out[gv] = func
    return tvm.IRModule(out)


def _meta(mod: tvm.IRModule, name: str = "main") -> dict:
    return json.loads(str(mod[name].attrs[META_ATTR]))


# --------------------------------------------------------------------------- structure
def test_pass_name_and_options():
    assert Rematerialize().info.name == "Rematerialize"
    with pytest.raises(TypeError):
        Rematerialize({"max_candidates": 3})
    with pytest.raises(ValueError):
        RematOptions(hot_fraction=2.0)


def test_evict_and_regenerate_inserted():
    after = Rematerialize(OPTIONS)(_chain_module())

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"blade_relax.no_plan": ["a"], "relax.force_pure": True})
            cls = Expected
            frame = R.call_builtin_with_ctx(
                "blade_relax.remat_begin",
                (R.str("meta"), R.prim_value(0), R.shape([n]), cls.blade_relax_remat_release),
                ty_args=R.Object,
            )
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            _ = R.call_builtin_with_ctx(
                "blade_relax.evict", (frame, R.prim_value(0), a), ty_args=R.Object
            )
            c = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(b, c)
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            a_remat = R.call_packed(
                "blade_relax.regenerate",
                frame,
                R.prim_value(0),
                cls.main_remat0,
                x,
                ty_args=R.Tensor((n, 4), "float32"),
            )
            cls.add(c, a_remat, d)
            return d

        @R.function(private=True)
        def main_remat0(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"blade_relax.remat_regen": "main/0", "relax.force_pure": True})
            cls = Expected
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            return a

        @R.function(private=True)
        def blade_relax_remat_release() -> R.Tuple:
            R.func_attr({"blade_relax.remat_release": True})
            return R.tuple()

    tvm.ir.assert_structural_equal(_normalized(after), Expected)


def test_metadata_symbolic_bytes_cost_and_timeline():
    after = Rematerialize(OPTIONS)(_chain_module())
    meta = _meta(after)
    assert meta["format"] == "blade_relax.remat/1" and meta["dims"] == ["n"]
    assert meta["exact"] is False  # the estimate, before planning
    (slot,) = meta["slots"]
    assert slot["name"] == "a" and slot["regen"] == "main_remat0"
    env = {"n": 10}
    assert eval(meta["exprs"][slot["bytes"]], {}, env) == 10 * 4 * 4
    assert eval(meta["exprs"][slot["cost"]], {}, env) == 10 * 4  # one store per element
    assert slot["plan"] == [[0, [["a", 0]]]]
    assert slot["start"] <= slot["site"] < meta["points"]
    # Every storage of the lowered function (a, b, c, d) is on the timeline.
    assert len(meta["storages"]) == 4


def _lower_to_memory(mod: tvm.IRModule) -> tvm.IRModule:
    target = tvm.target.Target("llvm")
    passes = [Rematerialize(OPTIONS)]
    for p in phases.finalize_passes(target):
        if p.info.name == "VMShapeLower":
            break
        passes.append(p)
        if p.info.name == "KillAfterLastUse":
            passes.append(RematTimeline())
    with target:
        return tvm.transform.Sequential(passes)(mod)


def test_evictable_tensor_owns_its_storage_after_stock_planning():
    """After StaticPlanBlockMemory, the evicted tensor's storage is its own."""
    lowered = _lower_to_memory(_chain_module())
    func = lowered["main"]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    producer = {b.var: b.value for b in bindings}
    evicted = [
        b.value.args[1].fields[2]
        for b in bindings
        if isinstance(b.value, relax.Call)
        and isinstance(b.value.args[0], relax.ExternFunc)
        and b.value.args[0].global_symbol == EVICT
    ]
    assert len(evicted) == 1
    storage = producer[evicted[0]].args[0]
    carved = [
        b.var
        for b in bindings
        if isinstance(b.value, relax.Call)
        and isinstance(b.value.op, tvm.ir.Op)
        and b.value.op.name in ("relax.memory.alloc_tensor", "relax.vm.alloc_tensor")
        and b.value.args[0].same_as(storage)
    ]
    assert carved == [evicted[0]]
    meta = _meta(lowered)
    assert meta["exact"] is True
    # RematTimeline found the window: the storage is gone between the evict and the regenerate.
    assert meta["slots"][0]["start"] <= meta["slots"][0]["site"]


def test_hazard_detected_when_a_plan_reuses_an_evictable_storage():
    @I.ir_module
    class Bad:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            frame = R.call_builtin_with_ctx(
                "blade_relax.remat_begin",
                (R.str("k"), R.prim_value(0), R.shape([1])),
                ty_args=R.Object,
            )
            s = R.memory.alloc_storage(
                R.shape([16]), R.prim_value(0), R.str("global"), R.dtype("uint8")
            )
            a = R.memory.alloc_tensor(s, R.prim_value(0), R.shape([4]), R.dtype("float32"))
            _ = R.call_builtin_with_ctx(
                "blade_relax.evict", (frame, R.prim_value(0), a), ty_args=R.Object
            )
            b = R.memory.alloc_tensor(s, R.prim_value(0), R.shape([4]), R.dtype("float32"))
            a2 = R.call_packed(
                "blade_relax.regenerate", frame, R.prim_value(0), ty_args=R.Tensor((4,), "float32")
            )
            return (a2, b)

    with pytest.raises(RematHazardError):
        simulate(Bad["main"], Bad, "memory")


def test_view_read_after_the_gap_is_rebuilt_from_the_regenerated_tensor():
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            v = R.reshape(a, R.shape([n * 4]))
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            c = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(b, c)
            w = R.reshape(v, R.shape([n, 4]))
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add(c, w, d)
            return d

    after = Rematerialize(OPTIONS)(Before)
    func = after["main"]
    text = func.script()
    # The view read after the gap reads the regenerated tensor; the old view is gone.
    assert "R.reshape(a_remat" in text
    bindings = [b for block in func.body.blocks for b in block.bindings]
    names = [b.var.name for b in bindings]
    assert "v" not in names and "v_remat" in names


# --------------------------------------------------------------------------- unchanged
def test_unchanged_without_a_gap():
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            return b

    tvm.ir.assert_structural_equal(Rematerialize(OPTIONS)(Before), Before)


def test_unchanged_with_dataflow_blocks():
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            with R.dataflow():
                a = R.add(x, x)
                b = R.multiply(a, a)
                c = R.add(b, b)
                d = R.add(c, a)
                R.output(d)
            return d

    tvm.ir.assert_structural_equal(Rematerialize(OPTIONS)(Before), Before)


def test_unchanged_with_control_flow():
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), flag: R.Tensor((), "bool")) -> R.Tensor(
            ("n", 4), "float32"
        ):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a)
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            if flag:
                c = b
            else:
                c = x
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add(c, a, d)
            return d

    tvm.ir.assert_structural_equal(Rematerialize(OPTIONS)(Before), Before)


def test_unchanged_when_the_tensor_comes_from_a_packed_call():
    """An opaque producer (maybe random, maybe in-place) is never replayed."""

    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 4))
            y = T.match_buffer(var_y, (n, 4))
            z = T.match_buffer(var_z, (n, 4))
            for i, j in T.grid(n, 4):
                with T.sblock("z"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    z[vi, vj] = x[vi, vj] + y[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.call_packed("test.random_like", x, ty_args=R.Tensor((n, 4), "float32"))
            b = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a, b)
            c = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(b, c)
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add(c, a, d)
            return d

    tvm.ir.assert_structural_equal(Rematerialize(OPTIONS)(Before), Before)


def test_unchanged_with_no_candidate_allowed():
    before = _chain_module()
    options = RematOptions(min_bytes=0, min_fraction=0.0, max_candidates=0)
    tvm.ir.assert_structural_equal(Rematerialize(options)(before), before)


def test_idempotent():
    once = Rematerialize(OPTIONS)(_chain_module())
    tvm.ir.assert_structural_equal(Rematerialize(OPTIONS)(once), once)


def test_metadata_constant_matches_attribute():
    after = Rematerialize(OPTIONS)(_chain_module())
    func = after["main"]
    begin = func.body.blocks[0].bindings[0].value
    const = begin.args[1].fields[1]
    text = const.value.numpy().tobytes().decode()
    assert json.loads(text) == _meta(after)
    assert str(begin.args[1].fields[0].value).startswith("main:")
    assert isinstance(begin.args[0], relax.ExternFunc)
    regen = [
        b.value
        for b in func.body.blocks[0].bindings
        if isinstance(b.value, relax.Call)
        and isinstance(b.value.op, relax.ExternFunc)
        and b.value.op.global_symbol == REGENERATE
    ]
    assert len(regen) == 1

"""Rematerialize: Before/Expected structure, unchanged cases, metadata and the alias hazard."""

from __future__ import annotations

import dataclasses
import json

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax  # noqa: F401  (registers the runtime builtins)
from blade_relax.analysis import memory_timeline
from blade_relax.contract import (
    EVICT,
    REGENERATE,
    REMAT_BEGIN,
    REMAT_COPY_ATTR,
    REMAT_META_ATTR,
    RematMetadata,
)
from blade_relax.contract.dimexpr import compile_expressions
from blade_relax.transform import PassFallbackWarning, Rematerialize, RematOptions, version_for
from blade_relax.transform.remat import RematHazardError
from blade_relax.transform.remat._timeline import simulate

# The structure tests read the rewritten function in place (the budget dispatch has its own).
OPTIONS = RematOptions(min_bytes=0, min_fraction=0.0, plain_without_budget=False)


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
        if (
            isinstance(func, relax.Function)
            and func.attrs is not None
            and REMAT_META_ATTR in func.attrs
        ):
            func = func.without_attr(REMAT_META_ATTR)
            blocks = []
            for block in func.body.blocks:
                bindings = []
                for b in block.bindings:
                    value = b.value
                    if (
                        isinstance(value, relax.Call)
                        and len(value.args) == 2
                        and isinstance(value.args[0], relax.ExternFunc)
                        and value.args[0].global_symbol == REMAT_BEGIN
                    ):
                        args = list(value.args[1].fields)[:4]
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
    return json.loads(str(mod[name].attrs[REMAT_META_ATTR]))


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
            # Regenerated before the reader's output is allocated: not on top of it.
            a_inputs = (x,)
            a_remat = R.call_packed(
                "blade_relax.regenerate",
                frame,
                R.prim_value(0),
                a_inputs,
                ty_args=R.Tensor((n, 4), "float32"),
            )
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
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
    # remat_begin also receives the regeneration functions, in slot order (left out of the
    # structural comparison: their types hold each function's own dims, free in main).
    begin = after["main"].body.blocks[0].bindings[0].value
    assert [f.name_hint for f in begin.args[1].fields[4:]] == ["main_remat0"]


def test_metadata_symbolic_bytes_cost_and_timeline():
    after = Rematerialize(OPTIONS)(_chain_module())
    meta = _meta(after)
    assert meta["format"] == "blade_relax.remat/2" and meta["dims"] == ["n"]
    assert meta["exact"] is False  # the estimate, before planning
    (slot,) = meta["slots"]
    assert slot["name"] == "a" and slot["regen"] == "main_remat0"
    nbytes, cost = compile_expressions(
        meta["dims"], [meta["exprs"][slot["bytes"]], meta["exprs"][slot["cost"]]]
    )(10)
    assert nbytes == 10 * 4 * 4
    assert cost == 10 * 4  # one store per element
    assert slot["plan"] == [[0, [["a", 0]]]]
    assert slot["start"] <= slot["site"] < meta["points"]
    # Every storage of the lowered function (a, b, c, d) is on the timeline.
    assert len(meta["storages"]) == 4


def _lower_to_memory(mod: tvm.IRModule) -> tvm.IRModule:
    """Rematerialize, then the stock finalize passes (RematTimeline after KillAfterLastUse) up
    to the memory stage."""
    from blade_relax.pipeline import lower_to_memory_stage

    return lower_to_memory_stage(
        mod, "llvm", start_at="finalize", remat=True, remat_options=OPTIONS
    )


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


def test_metadata_is_written_by_rematerialize_and_updated_by_remat_timeline():
    """Both writes are the contract's dataclass as JSON: the estimate after Rematerialize, the
    exact timeline once RematTimeline read the planned IR, with the same slots."""
    estimate = RematMetadata.from_json(
        str(Rematerialize(OPTIONS)(_chain_module())["main"].attrs[REMAT_META_ATTR])
    )
    text = str(_lower_to_memory(_chain_module())["main"].attrs[REMAT_META_ATTR])
    exact = RematMetadata.from_json(text)
    assert exact.to_json() == text
    assert (estimate.exact, exact.exact) == (False, True)
    assert [(s.name, s.regen, s.plan) for s in exact.slots] == [
        (s.name, s.regen, s.plan) for s in estimate.slots
    ]
    assert exact.exprs[exact.slots[0].cost] == estimate.exprs[estimate.slots[0].cost]


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
    options = RematOptions(
        min_bytes=0, min_fraction=0.0, max_candidates=0, plain_without_budget=False
    )
    tvm.ir.assert_structural_equal(Rematerialize(options)(before), before)


def test_only_the_named_functions_are_transformed():
    before = _chain_module()
    other = dataclasses.replace(OPTIONS, functions=("other",))
    tvm.ir.assert_structural_equal(Rematerialize(other)(before), before)
    named = Rematerialize(dataclasses.replace(OPTIONS, functions=("main",)))(before)
    assert _meta(named)["slots"][0]["name"] == "a"


def test_gap_shorter_than_min_gap_is_not_a_candidate():
    # One kernel (`c = add_one(b)`) runs between the eviction of `a` and its regeneration.
    before = _chain_module()
    assert len(_meta(Rematerialize(dataclasses.replace(OPTIONS, min_gap=1))(before))["slots"]) == 1
    after = Rematerialize(dataclasses.replace(OPTIONS, min_gap=2))(before)
    tvm.ir.assert_structural_equal(after, before)


def test_recipe_longer_than_max_recipe_ops_is_not_a_candidate():
    # `a0` is dead when `a` is read again: regenerating `a` replays both kernels.
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
            a0 = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(x, a0)
            a = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(a0, a)
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

    two = Rematerialize(dataclasses.replace(OPTIONS, max_recipe_ops=2))(Before)
    assert [s["name"] for s in _meta(two)["slots"]] == ["a"]
    assert _calls_in(two["main_remat0"]) == ["add_one", "add_one"]
    one = Rematerialize(dataclasses.replace(OPTIONS, max_recipe_ops=1))(Before)
    tvm.ir.assert_structural_equal(one, Before)


def test_unreadable_shapes_warn_and_leave_the_function_unchanged():
    # An empty range (lower bound above the upper bound): the timeline cannot be built.
    before = _chain_module()
    before["main"] = (
        before["main"]
        .with_attr("tir_var_lower_bound", {"n": 8})
        .with_attr("tir_var_upper_bound", {"n": 4})
    )
    with pytest.warns(
        PassFallbackWarning,
        match=r"^Rematerialize: function left unchanged for main: ValueError: dim 'n': empty",
    ):
        after = Rematerialize(OPTIONS)(before)
    tvm.ir.assert_structural_equal(after, before)


def test_last_result_reports_evictable_tensors_and_the_timeline_peaks():
    before = _chain_module()
    pass_ = Rematerialize(RematOptions(min_bytes=0, min_fraction=0.0))
    assert pass_.last_result is None
    after = pass_(before)
    main = pass_.last_result["main"]
    assert main.changed
    assert main.changes == (
        "1 tensor evictable (a)",
        "dispatches on a memory budget to the rewritten or the plain copy",
    )
    for n in (1, 10, 1000):
        dims = {"n": n}
        rewritten = after[version_for(after, "main", dims, budget=True)]
        assert main.evaluate(dims) == (
            memory_timeline(before["main"], mod=before).evaluate(dims).peak,
            memory_timeline(rewritten, mod=after).evaluate(dims).peak,
        )
    nothing = Rematerialize(RematOptions(min_bytes=0, min_fraction=0.0, max_candidates=0))
    nothing(before)
    assert not nothing.last_result.changed
    assert nothing.last_result["main"].notes == ("no tensor worth evicting",)


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


# --------------------------------------------------------------------------- calls
def _call_module(branch: bool = False) -> tvm.IRModule:
    """``main`` keeps ``a`` over a call of ``helper``, which allocates two tensors of its own.

    With ``branch``, the helper picks its result with an ``If``.
    """

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

        @R.function(private=True)
        def helper(p: R.Tensor(("h", 4), "float32")) -> R.Tensor(("h", 4), "float32"):
            h = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            t = R.builtin.alloc_tensor(
                R.shape([h, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(p, t)
            u = R.builtin.alloc_tensor(
                R.shape([h, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(t, u)
            return u

        @R.function(private=True)
        def branching(p: R.Tensor(("h", 4), "float32"), flag: R.Tensor((), "bool")) -> R.Tensor(
            ("h", 4), "float32"
        ):
            h = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            t = R.builtin.alloc_tensor(
                R.shape([h, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add_one(p, t)
            if flag:
                u = t
            else:
                u = p
            return u

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
            g = cls.helper(b)
            d = R.builtin.alloc_tensor(
                R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global")
            )
            cls.add(g, a, d)
            return d

    if not branch:
        return Before
    main = Before["main"]
    bindings = list(main.body.blocks[0].bindings)
    call = bindings[4]
    bindings[4] = relax.VarBinding(
        call.var,
        relax.Call(Before.get_global_var("branching"), [call.value.args[0], main.params[1]]),
    )
    new_main = relax.Function(
        main.params,
        relax.SeqExpr([relax.BindingBlock(bindings)], main.body.body),
        main.ret_ty,
        main.is_pure,
        main.attrs,
    )
    mod = Before.clone() if hasattr(Before, "clone") else Before
    mod["main"] = relax.BlockBuilder().normalize(new_main)
    return mod


def _calls_in(func: relax.Function) -> list[str]:
    """The callees of ``func`` in order: Relax/PrimFunc names and builtin symbols."""
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            value = b.value
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, relax.GlobalVar):
                out.append(value.op.name_hint)
            elif isinstance(value.op, relax.ExternFunc):
                out.append(value.op.global_symbol)
            elif value.args and isinstance(value.args[0], relax.ExternFunc):
                name = value.args[0].global_symbol
                if name == "vm.builtin.invoke_closure":
                    name += f"({value.args[1].fields[0].name_hint})"
                out.append(name)
    return out


def test_called_function_is_not_rematerialized_and_release_follows_the_call():
    before = _call_module()
    after = Rematerialize(OPTIONS)(before)
    tvm.ir.assert_structural_equal(after["helper"], before["helper"])
    calls = _calls_in(after["main"])
    # The VM keeps a callee's result in its return register until the next function returns:
    # the release right after the call makes that moment fixed.
    at = calls.index("helper")
    assert calls[at + 1] == "vm.builtin.invoke_closure(blade_relax_remat_release)"
    assert calls.count(EVICT) == calls.count(REGENERATE) == 1


def test_simulation_follows_a_call_in_the_callers_dims():
    after = Rematerialize(OPTIONS)(_call_module())
    sim = simulate(after["main"], after, "lowered")
    assert sim.exact and not sim.notes
    by_name = {s.name: s for s in sim.storages}
    assert set(by_name) == {"a", "b", "t", "u", "d"}
    for name in ("t", "u"):  # the helper's sizes, over main's dim n
        assert compile_expressions(["n"], [by_name[name].size])(10) == (10 * 4 * 4,)
    # t dies when the helper returns; u, its result, lives on in g until main's last read.
    assert by_name["t"].end == by_name["u"].first + 1
    assert by_name["u"].end > by_name["d"].first
    meta_points = sim.points
    assert meta_points == 5 + 1  # five allocations and one regenerate


def test_simulation_of_a_call_it_cannot_follow_is_inexact():
    after = Rematerialize(OPTIONS)(_call_module(branch=True))
    sim = simulate(after["main"], after, "lowered")
    assert not sim.exact
    assert any("If" in note for note in sim.notes)
    # The storage allocated before the If is still on the timeline.
    assert "t" in {s.name for s in sim.storages}


def test_functions_called_from_a_dispatcher_with_control_flow_are_rematerialized():
    """A caller the pass cannot transform (an ``If`` choosing a version) leaves its callees
    eligible: each version decides for itself."""
    chain = _chain_module()
    bb = relax.BlockBuilder(chain)
    version = relax.utils.copy_with_new_vars(chain["main"].without_attr("global_symbol"))
    gv = bb.add_func(version, "main_version")
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    with bb.function("dispatch", [x, flag]):
        then_ = relax.SeqExpr([], relax.Call(gv, [x]))
        else_ = relax.SeqExpr([], x)
        out = bb.emit(relax.If(flag, then_, else_))
        bb.emit_func_output(out)
    mod = bb.get()
    after = Rematerialize(OPTIONS)(mod)
    assert REMAT_META_ATTR in after["main_version"].attrs
    assert after["dispatch"].attrs is None or REMAT_META_ATTR not in after["dispatch"].attrs


# --------------------------------------------------------------------------- budget dispatch
DISPATCH = RematOptions(min_bytes=0, min_fraction=0.0)  # plain_without_budget by default


def _with_attrs(func: relax.Function, attrs) -> relax.Function:
    return relax.Function(func.params, func.body, func.ret_ty, func.is_pure, attrs, func.span)


def test_budget_dispatch_calls_the_rewritten_copy_only_under_a_budget():
    before = _chain_module()
    after = Rematerialize(DISPATCH)(before)
    in_place = Rematerialize(OPTIONS)(before)

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def main__remat(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            return x

        @R.function(private=True)
        def main__plain(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            return x

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            active = R.call_packed("blade_relax.remat_active", ty_args=R.Prim("bool"))
            if active:
                r = cls.main__remat(x)
            else:
                r = cls.main__plain(x)
            return r

    tvm.ir.assert_structural_equal(after["main"], Expected["main"], map_free_vars=True)
    # The copies: the rewritten function and the original, private, each marked.
    remat, plain = after["main__remat"], after["main__plain"]
    assert "global_symbol" not in remat.attrs and "global_symbol" not in plain.attrs
    assert str(remat.attrs[REMAT_COPY_ATTR]["of"]) == "main" and int(
        remat.attrs[REMAT_COPY_ATTR]["budget"]
    )
    assert not int(plain.attrs[REMAT_COPY_ATTR]["budget"])
    tvm.ir.assert_structural_equal(
        _with_attrs(remat, in_place["main"].attrs), in_place["main"], map_free_vars=True
    )
    tvm.ir.assert_structural_equal(_with_attrs(plain, before["main"].attrs), before["main"])
    # Regeneration functions and the release function are those of the in-place rewrite.
    others = {g.name_hint for g in after.get_global_vars()} - {"main__remat", "main__plain"}
    assert others == {g.name_hint for g in in_place.get_global_vars()}


def test_budget_dispatch_is_idempotent():
    once = Rematerialize(DISPATCH)(_chain_module())
    tvm.ir.assert_structural_equal(Rematerialize(DISPATCH)(once), once)


def test_version_for_follows_range_and_budget_dispatchers():
    """A range dispatcher over copies that Rematerialize then turns into budget dispatchers:
    ``version_for`` names the copy that runs at given dims, with and without a budget."""
    from blade_relax.transform.dispatch import DimRange, range_dispatch, version_for

    chain = _chain_module()
    gv = chain.get_global_var("main")
    n = chain["main"].params[0].ty.shape.values[0]
    versions = [(DimRange("n", 1, 64), chain["main"]), (DimRange("n", 65, None), chain["main"])]
    dispatcher, copies = range_dispatch(chain, gv, chain["main"], n, versions)
    functions = {g: f for g, f in chain.functions.items() if g != gv}
    versioned = tvm.IRModule({**functions, gv: dispatcher, **dict(copies)})
    after = Rematerialize(DISPATCH)(versioned)
    relax.analysis.well_formed(after)
    assert version_for(after, "main", {"n": 8}) == "main__n1_64__plain"
    assert version_for(after, "main", {"n": 8}, budget=True) == "main__n1_64__remat"
    assert version_for(after, "main", {"n": 100}, budget=True) == "main__n65_inf__remat"
    assert version_for(after, "other", {"n": 8}) == "other"


def test_own_storage_for_large_tensors():
    """With ``own_storage_fraction``, large tensors that are not evictable get an explicit
    storage of their own, which the planners leave alone; small ones stay planned."""
    options = RematOptions(
        min_bytes=0, min_fraction=0.0, own_storage_fraction=0.0, plain_without_budget=False
    )
    after = Rematerialize(options)(_chain_module())
    bindings = {b.var.name: b.value for b in after["main"].body.blocks[0].bindings}
    n = after["main"].params[0].ty.shape.values[0]
    analyzer = tvm.sym.Analyzer()
    for name in ("b", "c"):  # not evictable
        value = bindings[name]
        assert value.op.name == "relax.memory.alloc_tensor"
        storage = bindings[value.args[0].name]
        assert storage.op.name == "relax.memory.alloc_storage"
        (size,) = storage.args[0].values
        assert analyzer.can_prove_equal(size, n * 16)  # n x 4 float32
    # The evictable tensor keeps its plain allocation (unplanned through the evict call).
    assert bindings["a"].op.name == "relax.builtin.alloc_tensor"
    # The default leaves everything to the planner.
    default = Rematerialize(OPTIONS)(_chain_module())
    ops = {
        b.value.op.name
        for b in default["main"].body.blocks[0].bindings
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
    }
    assert "relax.memory.alloc_storage" not in ops
    with pytest.raises(ValueError):
        RematOptions(own_storage_fraction=1.5)


# --------------------------------------------------------------------------- selection depth
@I.ir_module
class _LayerKernels:
    @T.prim_func(private=True, s_tir=True)
    def add_one(var_x: T.handle, var_y: T.handle):
        n, m = T.int64(), T.int64()
        x = T.match_buffer(var_x, (n, m))
        y = T.match_buffer(var_y, (n, m))
        for i, j in T.grid(n, m):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def add_row_sum(var_x: T.handle, var_y: T.handle, var_z: T.handle):
        n, m, k = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(var_x, (n, m))
        y = T.match_buffer(var_y, (n, k))
        z = T.match_buffer(var_z, (n, m))
        for i, j, r in T.grid(n, m, k):
            with T.sblock("z"):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    z[vi, vj] = x[vi, vj]
                z[vi, vj] = z[vi, vj] + y[vi, vr]


def _layers_module(widths: list[int]) -> tvm.IRModule:
    """A forward of one elementwise kernel per layer (``h{i}``, of width ``widths[i]``, from
    the previous layer of its width) and a backward that reads the layers in reverse: the shape
    of a deep training step, every ``h{i}`` but the last live across the turn."""
    bb = relax.BlockBuilder(_LayerKernels)
    add_one = bb.get().get_global_var("add_one")
    add_row_sum = bb.get().get_global_var("add_row_sum")
    n = tvm.tirx.Var("n", "int64")
    inputs = {w: relax.Var(f"x{w}", R.Tensor((n, w), "float32")) for w in sorted(set(widths))}

    def alloc(width: int, name: str) -> relax.Var:
        shape = relax.ShapeExpr([n, width])
        return bb.emit(relax.op.builtin.alloc_tensor(shape, "float32", 0), name)

    with bb.function("main", list(inputs.values()), {"relax.force_pure": True}):
        layers, latest = [], dict(inputs)
        for i, width in enumerate(widths):
            h = alloc(width, f"h{i}")
            bb.emit(relax.Call(add_one, [latest[width], h]))
            layers.append(h)
            latest[width] = h
        grad = inputs[widths[0]]
        for i in reversed(range(len(widths))):
            out = alloc(widths[0], f"g{i}")
            bb.emit(relax.Call(add_row_sum, [grad, layers[i], out]))
            grad = out
        bb.emit_func_output(grad)
    return bb.get()


def test_many_small_tensors_that_make_the_peak_together_are_candidates():
    # Each layer holds about a tenth of the peak: below min_fraction alone, most of the peak
    # together. Only the smallest that together stay below 0.2 of it are left out (one layer;
    # among equals the shortest gap, h6's).
    before = _layers_module([4] * 8)
    options = dataclasses.replace(OPTIONS, min_fraction=0.2)
    after = Rematerialize(options)(before)
    assert [s["name"] for s in _meta(after)["slots"]] == ["h0", "h1", "h2", "h3", "h4", "h5"]
    # When all of them together are below the fraction, none is worth evicting.
    nothing = Rematerialize(dataclasses.replace(OPTIONS, min_fraction=0.95))(before)
    tvm.ir.assert_structural_equal(nothing, before)


def test_the_candidates_kept_are_those_that_free_the_most_bytes():
    # h3 and h5 are four times wider than the others, with shorter gaps than h0..h2: past
    # max_candidates the memory a candidate can free decides, not its recompute cost per byte
    # (the same for every elementwise layer).
    before = _layers_module([4, 4, 4, 16, 4, 16, 4, 4])
    for limit, kept in ((2, ["h3", "h5"]), (3, ["h0", "h3", "h5"])):
        after = Rematerialize(dataclasses.replace(OPTIONS, max_candidates=limit))(before)
        assert [s["name"] for s in _meta(after)["slots"]] == kept
    every = Rematerialize(OPTIONS)(before)
    assert [s["name"] for s in _meta(every)["slots"]] == [f"h{i}" for i in range(7)]


def test_a_kernel_calls_cost_is_read_once_for_every_recipe_sharing_it(monkeypatch):
    """Neighbouring candidates' recipes replay many of the same kernel calls: each call's loop
    nest is read once, and each candidate's cost is the sum over its own recipe's kernels."""
    from types import SimpleNamespace

    from blade_relax.transform.remat import rematerialize

    read = []

    def kernel_cost(op, mod, dims):
        read.append(op.var)
        return f"{op.var} * s"

    monkeypatch.setattr(rematerialize, "_kernel_cost", kernel_cost)
    a, b, c = (SimpleNamespace(var=name, kind="kernel") for name in "abc")
    view = SimpleNamespace(var="v", kind="view")
    first = SimpleNamespace(root="x", recipe=SimpleNamespace(ops=[a, view, b]))
    second = SimpleNamespace(root="y", recipe=SimpleNamespace(ops=[a, b, c]))
    cost_of = rematerialize._CostTexts(None, {"s"})
    assert cost_of(first) == "(a * s) + (b * s)"
    assert cost_of(second) == "(a * s) + (b * s) + (c * s)"
    assert cost_of(first) == "(a * s) + (b * s)"
    assert read == ["a", "b", "c"]

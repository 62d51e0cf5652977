"""The op table: every memory model classifies bindings through ``analysis.effects``."""

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import Kind, binding_effect, classify, liveness
from blade_relax.contract import EVICT, REGENERATE
from blade_relax.symbolic import ShapeGraph


@I.ir_module
class Relax:
    @T.prim_func(private=True, s_tir=True)
    def exp(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        for i, j in T.grid(n, 4):
            with T.sblock("e"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = T.exp(X[vi, vj])

    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        cls = Relax
        with R.dataflow():
            a = R.call_tir(cls.exp, (x,), R.Tensor((n, 4), "float32"))
            b = R.reshape(a, R.shape([n * 4]))
            c = R.add(b, b)
            t = (a, c)
            d = t[1]
            e = R.shape_of(d)
            R.output(d, e)
        return d


@I.ir_module
class Lowered:
    @T.prim_func(private=True, s_tir=True)
    def exp(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        for i, j in T.grid(n, 4):
            with T.sblock("e"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = T.exp(X[vi, vj])

    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        cls = Lowered
        storage = R.memory.alloc_storage(R.shape([n * 16]), 0, "global", "uint8")
        a = R.memory.alloc_tensor(storage, 0, R.shape([n, 4]), "float32")
        _ = cls.exp(x, a)
        b = R.call_packed(
            "vm.builtin.reshape", a, R.shape([n * 4]), ty_args=(R.Tensor((n * 4,), "float32"),)
        )
        _1 = R.memory.kill_tensor(a)
        return b


def _kinds(mod):
    func = mod["main"]
    return {b.var.name: classify(b, mod).kind for blk in func.body.blocks for b in blk.bindings}


def test_classify_relax_stage():
    kinds = _kinds(Relax)
    assert kinds == {
        "a": Kind.CALL_TIR,
        "b": Kind.VIEW,
        "c": Kind.OPERATOR,
        "t": Kind.TUPLE,
        "d": Kind.ITEM,
        "e": Kind.SHAPE_ONLY,
    }


def test_classify_memory_stage():
    kinds = _kinds(Lowered)
    assert kinds["storage"] is Kind.STORAGE_ALLOC
    assert kinds["a"] is Kind.TENSOR_IN_STORAGE
    assert kinds["_"] is Kind.KERNEL
    assert kinds["b"] is Kind.VIEW  # a packed view: the same answer as the operator's
    assert kinds["_1"] is Kind.KILL
    view = classify(Lowered["main"].body.blocks[0].bindings[3], Lowered)
    assert view.source.same_as(Lowered["main"].body.blocks[0].bindings[1].var)


def test_kernel_needs_the_module():
    """Without the module a GlobalVar call cannot be told from a Relax call."""
    call = Lowered["main"].body.blocks[0].bindings[2]
    assert classify(call, Lowered).kind is Kind.KERNEL
    assert classify(call).kind is Kind.RELAX_CALL


def test_remat_builtins_are_classified_from_the_contract_names():
    frame = relax.Var("frame", relax.ObjectType())
    x = relax.Var("x", relax.TensorType([4], "float32"))
    evict = relax.Call(
        tvm.ir.Op.get("relax.call_builtin_with_ctx"),
        [relax.ExternFunc(EVICT), relax.Tuple([frame, relax.prim_value(0), x])],
        ty_args=[relax.TupleType([])],
    )
    inst = classify(evict)
    assert inst.kind is Kind.EVICT
    assert len(inst.args) == 3 and inst.args[2].same_as(x)  # the context tuple is unpacked
    regenerate = relax.Call(relax.ExternFunc(REGENERATE), [frame, relax.prim_value(0)])
    assert classify(regenerate).kind is Kind.REGENERATE


def test_binding_effect_of_a_view_aliases_its_source():
    func = Relax["main"]
    graph = ShapeGraph.from_function(func)
    info = liveness(func)
    effects = {b.var.name: binding_effect(b, graph, Relax) for b in info.bindings}
    assert effects["b"].allocates is None
    assert [v.name for v in effects["b"].aliases] == ["a"]
    assert graph.evaluate(effects["a"].allocates, {"n": 3}) == 3 * 4 * 4
    assert graph.evaluate(effects["c"].allocates, {"n": 3}) == 3 * 4 * 4
    assert effects["e"].allocates is None  # a shape is not a tensor


def test_classify_remembers_op_calls_per_node():
    """A call's class is remembered per node: asking again gives the same answer as a fresh
    classification, and a call of a GlobalVar (whose class depends on the module) is not
    remembered."""
    from blade_relax.analysis import effects

    bindings = [b for blk in Relax["main"].body.blocks for b in blk.bindings]
    calls = [b.value for b in bindings if isinstance(b.value, relax.Call)]
    first = [classify(c, Relax) for c in calls]
    effects._CLASSIFIED.clear()
    fresh = [effects._classify_op_call(c, c.op) for c in calls]
    again = [classify(c, Relax) for c in calls]
    assert first == fresh == again
    # Each node's entry is found through a new Python object for the same node.
    bindings = [b for blk in Relax["main"].body.blocks for b in blk.bindings]
    assert [classify(b.value, Relax) for b in bindings if isinstance(b.value, relax.Call)] == fresh
    kernel_call = Lowered["main"].body.blocks[0].bindings[2].value
    assert classify(kernel_call, Lowered).kind is Kind.KERNEL
    assert classify(kernel_call).kind is Kind.RELAX_CALL
    assert classify(kernel_call, Lowered).kind is Kind.KERNEL

"""The storage flow: what each variable keeps alive, and when the last holder lets go."""

from __future__ import annotations

import pytest
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import binding_effect, death_points, liveness, storage_flow
from blade_relax.analysis.effects import ValueEffect
from blade_relax.analysis.liveness import block_liveness
from blade_relax.analysis.storage_flow import TupleFields
from blade_relax.symbolic import ShapeGraph


@I.ir_module
class Fields:
    @R.function
    def main(x: R.Tensor(("s", 8), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.exp(x)
            b = R.negative(x)
            t = (a, b)
            c = t[0]
            d = R.reshape(c, (s * 8,))
            e = R.add(d, d)
            R.output(e)
        return e


@I.ir_module
class UnusedParam:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor((4,), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.add(a, a)
            R.output(b)
        return b


def _flow(mod, explicit_kills=False):
    func = mod["main"]
    graph = ShapeGraph.from_function(func)
    info = liveness(func)

    def effect_of(binding):
        return binding_effect(binding, graph, mod, False, None)

    return info, storage_flow(info, effect_of, graph.bytes_of, explicit_kills=explicit_kills)


def test_a_field_read_keeps_only_its_field_and_a_view_keeps_its_source():
    info, flow = _flow(Fields)
    names = [b.var.name for b in info.bindings]
    var = {b.var.name: b.var for b in info.bindings}
    allocations = {a.var.name: a for a in flow.allocations}
    # Views, tuples and field reads allocate nothing.
    assert sorted(allocations) == ["a", "b", "e"]
    assert flow.refs[var["t"]] == {allocations["a"].id, allocations["b"].id}
    assert flow.refs[var["c"]] == {allocations["a"].id}
    assert flow.refs[var["d"]] == {allocations["a"].id}
    # ``b`` is held by the tuple only, which dies after its one read (c = t[0]); ``a`` lives
    # on through c and its view d until e reads d.
    assert allocations["b"].end == names.index("c")
    assert allocations["a"].end == names.index("e")
    assert allocations["e"].end is None
    assert flow.outputs == {allocations["e"].id}


def test_touched_holds_the_result_and_what_the_inputs_keep_alive():
    info, flow = _flow(Fields)
    ids = {a.var.name: a.id for a in flow.allocations}
    names = [b.var.name for b in info.bindings]
    touched, workspace = flow.touched[names.index("e")]
    assert touched == tuple(sorted((ids["a"], ids["e"])))
    assert workspace.is_constant and int(workspace) == 0


def test_death_points_drop_parameters_only_when_asked():
    info = liveness(UnusedParam["main"])
    x, y = info.params
    a = info.bindings[0].var
    plain = death_points(info)
    with_params = death_points(info, params=True)
    # a dies after b (its last use); b is returned and never dies.
    assert plain == {1: [a]}
    # x dies after its one read (binding 0); y, never read, is never dropped.
    assert with_params == {0: [x], 1: [a]}
    assert all(y not in dead for dead in with_params.values())


@I.ir_module
class Rebound:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.negative(x)
            t = (a, b)
            u = t
            c = u[0]
            n = ((a, b), b)
            m = n[0]
            d = m[1]
            e = R.add(c, d)
            R.output(e)
        return e


def _refs(mod, **options):
    func = mod["main"]
    graph = ShapeGraph.from_function(func)
    info = liveness(func)

    def effect_of(binding):
        return binding_effect(binding, graph, mod, False, None)

    flow = storage_flow(info, effect_of, graph.bytes_of, explicit_kills=False, **options)
    names = {a.id: a.var.name for a in flow.allocations}
    refs = {var.name: sorted(names[k] for k in ids) for var, ids in flow.refs.items()}
    return flow, refs


def test_a_tuples_fields_are_followed_as_far_as_the_reader_asks():
    _, refs = _refs(Rebound)
    # By default only a Tuple binding's fields are known: a read through a re-binding keeps
    # the whole tuple, a field of a nested literal keeps nothing the op table sees.
    assert refs["c"] == ["a", "b"]
    assert refs["m"] == []
    _, refs = _refs(Rebound, fields=TupleFields(through_aliases=True, nested_literals=True))
    assert refs["c"] == ["a"]
    assert refs["m"] == ["a", "b"]


@I.ir_module
class Nested:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.negative(x)
            t = (a, b)
            n = (t, b)
            m = n[0]
            d = m[1]
            R.output(d)
        return d


def test_an_item_that_is_a_tuple_knows_its_fields_when_asked():
    _, refs = _refs(Nested)
    assert refs["d"] == ["a", "b"]
    _, refs = _refs(Nested, fields=TupleFields(through_items=True))
    assert refs["d"] == ["b"]


def test_parameters_as_buffers_live_on_entry():
    flow, refs = _refs(Nested, params_live=True)
    (x,) = Nested["main"].params
    (buffer,) = [a for a in flow.allocations if a.var.same_as(x)]
    assert buffer.start == -1 and buffer.end is None
    assert refs["x"] == ["x"]
    _, refs = _refs(Nested)
    assert refs["x"] == []


def test_without_lifetimes_the_refs_are_the_same_and_no_end_is_known():
    full, refs = _refs(Rebound)
    bare, bare_refs = _refs(Rebound, lifetimes=False)
    assert bare_refs == refs
    assert [a.end for a in full.allocations] != [None] * len(full.allocations)
    assert [a.end for a in bare.allocations] == [None] * len(bare.allocations)
    assert bare.touched == []
    func = Rebound["main"]
    (x,) = func.params
    info = liveness(func, positions=False)
    assert info.uses == {} and info.definition == {}

    def keeps(binding):
        return ValueEffect(keeps=(x, 0, x))

    with pytest.raises(ValueError, match="lifetimes"):
        storage_flow(info, keeps, lambda var: None, explicit_kills=False, lifetimes=False)


@I.ir_module
class TwoBlocks:
    @R.function
    def main(x: R.Tensor(("s", 8), "float32")):
        s = T.int64()
        with R.dataflow():
            a = R.exp(x)
            b = R.negative(x)
            R.output(a, b)
        c = R.add(b, a)
        t = (c, a)
        d = R.exp(c)
        return (t, d)


def test_a_block_meets_the_values_of_earlier_blocks_as_buffers_live_on_entry():
    func = TwoBlocks["main"]
    graph = ShapeGraph.from_function(func)
    block = func.body.blocks[1]
    info = block_liveness(block)
    (x,) = func.params

    def effect_of(binding):
        return binding_effect(binding, graph, TwoBlocks, False, None)

    def outside(var):
        return None if var.same_as(x) else graph.bytes_of(var)

    flow = storage_flow(
        info, effect_of, graph.bytes_of, explicit_kills=False, lifetimes=False, outside=outside
    )
    # c's result is allocated before the values it reads from the first block are met, in the
    # order it reads them; d reads c only.
    assert [(a.var.name, a.start) for a in flow.allocations] == [
        ("c", 0),
        ("b", -1),
        ("a", -1),
        ("d", 2),
    ]
    order = {var.name: ids for var, ids in flow.refs_in_order.items()}
    assert order["t"] == (0, 2)
    assert {var.name: ids for var, ids in flow.refs.items()}["t"] == frozenset({0, 2})
    # Without ``outside``, what the block does not bind keeps nothing.
    bare = storage_flow(info, effect_of, graph.bytes_of, explicit_kills=False, lifetimes=False)
    assert [a.var.name for a in bare.allocations] == ["c", "d"]


@I.ir_module
class TupleResult:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor((4,), "float32")):
        with R.dataflow():
            r = R.call_dps_packed(
                "two_outputs",
                (x,),
                out_ty=[R.Tensor((4,), "float32"), R.Tensor((4,), "float32")],
            )
            a = r[1]
            w = R.call_dps_packed(
                "write_first",
                (y, x),
                out_ty=[R.Tensor((4,), "float32"), R.Tensor((4,), "float32")],
            )
            b = w[0]
            c = w[1]
            R.output(a, b, c)
        return (a, b, c)


def test_a_calls_fields_are_its_per_field_allocations_and_aliases():
    func = TupleResult["main"]
    graph = ShapeGraph.from_function(func)
    info = liveness(func, positions=False)
    x, y = func.params
    sixteen = graph.bytes_of(x)

    def effect_of(binding):
        if binding.var.name == "r":
            return ValueEffect(field_allocates=(sixteen, None))
        if binding.var.name == "w":
            # The first field is written into y; the second is fresh.
            return ValueEffect(
                aliases=(y,), field_allocates=(sixteen, sixteen), field_aliases=((y,), None)
            )
        return binding_effect(binding, graph, TupleResult, False, None)

    flow = storage_flow(
        info, effect_of, graph.bytes_of, explicit_kills=False, params_live=True, lifetimes=False
    )
    by_id = {a.id: (a.var.name, a.field) for a in flow.allocations}
    order = {var.name: [by_id[k] for k in ids] for var, ids in flow.refs_in_order.items()}
    # r's second field allocates nothing, so a field read of it keeps nothing.
    assert order["r"] == [("r", 0)]
    assert order["a"] == []
    # w keeps y first (what it aliases), then its fresh allocations; its fields are y and
    # the second fresh allocation.
    assert order["w"] == [("y", None), ("w", 0), ("w", 1)]
    assert order["b"] == [("y", None)]
    assert order["c"] == [("w", 1)]

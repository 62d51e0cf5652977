"""The index of free storages (``EndIndex``) and the search of ``PlanMemory`` built on it.

The search screens only the free storages that may rank among the placements proven; the
plan must be the one of screening every free storage, which a reference search (the planner's
rules, without the index) checks on a lowered Llama training step.
"""

from __future__ import annotations

import dataclasses

import pytest
import tvm
from hypothesis import given
from hypothesis import strategies as st

from blade_relax.bench.workloads import ModelSizes, build_workload
from blade_relax.pipeline import PipelineFlags, as_target, finalize_phases, lower_to_memory_stage
from blade_relax.transform.plan import _share, plan_memory
from blade_relax.transform.plan._index import EndIndex
from blade_relax.transform.plan._peak import LiveModel

# ---------------------------------------------------------------------- EndIndex


def test_ended_before_reads_one_class_latest_first():
    index: EndIndex[str] = EndIndex()
    for cls, end, order, item in [
        ("a", 5, 0, "a5"),
        ("b", 3, 1, "b3"),
        ("a", 2, 2, "a2"),
        ("a", 9, 3, "a9"),
        ("a", 5, 4, "a5'"),
    ]:
        index.insert(cls, end, order, item)
    assert index.classes() == ["a", "b"]
    assert len(index) == 5
    # Equal ends: the later order first (the reverse of insertion by (end, order)).
    assert list(index.ended_before("a", 9)) == [(5, "a5'"), (5, "a5"), (2, "a2")]
    assert list(index.ended_before("a", 5)) == [(2, "a2")]
    assert list(index.ended_before("a", 2)) == []
    assert list(index.ended_before("b", 100)) == [(3, "b3")]
    assert list(index.ended_before("missing", 100)) == []


def test_remove_finds_the_item_by_class_end_and_order():
    index: EndIndex[str] = EndIndex()
    index.insert("a", 5, 0, "x")
    index.insert("a", 5, 1, "y")
    assert index.remove("a", 5, 0) == "x"
    assert list(index.ended_before("a", 6)) == [(5, "y")]
    with pytest.raises(KeyError):
        index.remove("a", 5, 0)
    with pytest.raises(KeyError):
        index.remove("a", 4, 1)
    with pytest.raises(KeyError):
        index.remove("b", 5, 1)
    index.remove("a", 5, 1)
    assert index.classes() == [] and len(index) == 0


# An operation: insert (cls, end) as a new item, or move / remove the i-th item inserted.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 2), st.integers(0, 20)),
        st.tuples(st.just("move"), st.integers(0, 40), st.integers(0, 2), st.integers(0, 20)),
        st.tuples(st.just("remove"), st.integers(0, 40)),
    ),
    max_size=40,
)


@given(ops=_ops, start=st.integers(0, 22))
def test_index_answers_like_a_scan_of_every_item(ops, start):
    index: EndIndex[int] = EndIndex()
    items: dict[int, tuple[int, int]] = {}  # order -> (cls, end): what a scan reads
    next_order = 0
    for op in ops:
        if op[0] == "insert":
            _, cls, end = op
            index.insert(cls, end, next_order, next_order)
            items[next_order] = (cls, end)
            next_order += 1
            continue
        if op[1] not in items:
            continue
        order = op[1]
        cls, end = items.pop(order)
        assert index.remove(cls, end, order) == order
        if op[0] == "move":  # a storage that took a tensor: new end, maybe a new size class
            _, _, cls, end = op
            index.insert(cls, end, order, order)
            items[order] = (cls, end)
    assert len(index) == len(items)
    assert set(index.classes()) == {cls for cls, _ in items.values()}
    for cls in range(3):
        expected = sorted(
            ((end, order) for order, (c, end) in items.items() if c == cls and end < start),
            reverse=True,
        )
        assert list(index.ended_before(cls, start)) == expected


# ---------------------------------------------------------------------- the search


def _choose_screening_every_free_storage(
    group, storages, free, storage_of, group_of, ge_inplace, graph, model, options
):
    """The reference: every free storage screened, the best four screened proven in turn
    (without peak proofs: the best by size class, then recency)."""
    head = group.head
    ranked = []
    for in_id in ge_inplace.get(head.id, []):
        storage = storage_of.get(id(group_of[in_id]))
        if storage is None or head.first_use is None or storage.last != head.first_use:
            continue
        if graph.compare(storage.size, group.size).holds_ge:
            ranked.append(((0, 0.0), storage, storage.size, storage.size_prim, in_id))
    if options.share:
        for storage in storages:
            if storage.last >= group.start or not _share.compatible(storage.head, head):
                continue
            terms = _share._share_terms(storage, group, graph, options)
            if terms is not None:
                rank, new_size, new_prim = terms
                ranked.append(((rank, -storage.last), storage, new_size, new_prim, None))
    if not options.peak_safe:
        if not ranked:
            return None
        ranked.sort(key=lambda r: r[0])
        _key, storage, new_size, new_prim, inplace_from = ranked[0]
        regions = _share._merge_delta(storage, group, new_size)
        return storage, new_size, new_prim, regions, inplace_from
    screened = []
    for key, storage, new_size, new_prim, inplace_from in ranked:
        regions = _share._merge_delta(storage, group, new_size)
        if not all(model.evaluable(r) for r in regions):
            continue
        ok, cost = model.screen(regions)
        if ok:
            screened.append(((cost, *key), (storage, new_size, new_prim, regions, inplace_from)))
    screened.sort(key=lambda r: r[0])  # stable: equal keys keep the enumeration order
    for _key, placement in screened[: _share._PROVEN]:
        if model.prove(placement[3]):
            return placement
    return None


_SIZES = ModelSizes(
    layers=3, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
)


@pytest.fixture(scope="module")
def before_plan_memory() -> tuple[tvm.IRModule, tvm.transform.Pass]:
    """A Llama training step lowered up to PlanMemory, and the PlanMemory pass of the pipeline."""
    graph = build_workload("llama-train", _SIZES).graph
    flags = {k: True for k in PipelineFlags.switches()}
    target = as_target("llvm")
    mod = lower_to_memory_stage(graph.mod, target, stop_before="finalize", **flags)
    finalize, _ = finalize_phases(target, PipelineFlags.stock(**flags))
    names = [p.info.name for p in finalize]
    at = names.index("PlanMemory")
    with target:
        mod = tvm.transform.Sequential(finalize[:at])(mod)
    return mod, finalize[at]


def _plan_counting_screens(mod: tvm.IRModule, options) -> tuple[tvm.IRModule, dict, int]:
    count = [0]
    screen = LiveModel.screen

    def counted(self, regions):
        count[0] += 1
        return screen(self, regions)

    pass_obj = plan_memory.PlanMemory(options)
    LiveModel.screen = counted
    try:
        out = pass_obj(mod)
    finally:
        LiveModel.screen = screen
    return out, pass_obj.plans, count[0]


@pytest.mark.parametrize(
    "changes", [{}, {"grow": False}, {"peak_safe": False}], ids=["default", "no-grow", "greedy"]
)
def test_search_plans_like_screening_every_free_storage(before_plan_memory, monkeypatch, changes):
    mod, pipeline_pass = before_plan_memory
    options = dataclasses.replace(pipeline_pass.options, **changes)
    out, plans, screens = _plan_counting_screens(mod, options)
    monkeypatch.setattr(_share, "_choose", _choose_screening_every_free_storage)
    ref_out, ref_plans, ref_screens = _plan_counting_screens(mod, options)
    assert plans == ref_plans
    tvm.ir.assert_structural_equal(out, ref_out)
    assert any(len(s.tensors) > 1 for p in plans.values() for s in p.storages)
    if options.peak_safe:
        assert screens < ref_screens / 2  # the index leaves most free storages unscreened

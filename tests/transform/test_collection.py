"""Every pass runs with the cyclic garbage collector paused (``util/collection.py``)."""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
import tvm
from tvm.ir.instrument import pass_instrument

from blade_relax.bench.workloads import SMALL, build_workload
from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage
from blade_relax.util.collection import collection_paused, pauses_collection


@pytest.fixture
def collector_enabled():
    """The test starts with the collector enabled and leaves it as it found it."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_pause_restores_the_collector_even_on_error(collector_enabled):
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():  # re-entrant: the inner pause leaves the outer one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collection_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_pause_keeps_a_disabled_collector_disabled(collector_enabled):
    @pauses_collection
    def run(x: int) -> tuple[int, bool]:
        return x + 1, gc.isenabled()

    assert run(1) == (2, False) and gc.isenabled()
    gc.disable()
    assert run(2) == (3, False)
    assert not gc.isenabled()


def test_no_collection_runs_inside_our_passes(collector_enabled):
    """With a collection due every few allocations, collections run inside the stock passes
    and never inside ours (nested runs included: MemoryAwareSchedule runs
    RecomputeCheapValues itself)."""
    ours = {*PipelineFlags.passes().values(), "RematTimeline"}
    running: list[str] = []
    seen: set[str] = set()
    collected_in: set[str] = set()

    @pass_instrument
    class Track:
        def run_before_pass(self, _mod, info):
            running.append(info.name)
            seen.add(info.name)

        def run_after_pass(self, _mod, info):
            running.pop()

    def note(phase: str, _info: dict) -> None:
        # A collection inside a pass of ours has its ``transform_module`` on the stack (the
        # instrument's hooks and TVM's pass wrapper run outside the pause).
        if phase != "start" or not running:
            return
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "transform_module" and "blade_relax" in code.co_filename:
                collected_in.add(running[-1])
                return
            frame = frame.f_back
        collected_in.add(f"outside:{running[-1]}")

    workload = build_workload("llama-train", dataclasses.replace(SMALL, layers=1))
    flags = dict.fromkeys(PipelineFlags.switches(), True)
    threshold = gc.get_threshold()
    gc.callbacks.append(note)
    gc.set_threshold(20, 2, 2)
    try:
        with tvm.transform.PassContext(instruments=[Track()]):
            lower_to_memory_stage(workload.graph.mod, "llvm", **flags)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(note)
    assert gc.isenabled()
    # The pipeline ran every pass of ours that this target has, and collections did run.
    assert ours - {"FuseAttention"} <= seen
    assert collected_in, "no collection ran at all: the test would not see one"
    assert not collected_in & ours

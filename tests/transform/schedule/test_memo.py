"""MemoryAwareSchedule remembers its runs: an input met again takes the remembered result,
report and warnings; anything the pass reads that differs schedules again."""

from __future__ import annotations

import warnings

import pytest
import tvm

from blade_relax.transform import CompileClock, MemoryAwareSchedule, PassFallbackWarning
from blade_relax.transform.schedule import (
    ScheduleOptions,
    forget_schedules,
    memory_aware_schedule,
    remembered_seconds,
)

from .test_memory_aware_schedule import SMALL, _flip_q_first

# A block whose linear branch (``pa``, ``rp``) is better run first for ``s <= 512``, in the
# other order.
_quadratic_first = _flip_q_first


def _order(mod: tvm.IRModule) -> list[str]:
    return [b.var.name for b in mod["main"].body.blocks[0].bindings]


@pytest.fixture
def searches(monkeypatch):
    """The inputs the pass really scheduled (not taken from its memo), in order."""
    seen: list[tvm.IRModule] = []
    schedule_module = memory_aware_schedule.schedule_module

    def counted(mod, options=None):
        seen.append(mod)
        return schedule_module(mod, options)

    monkeypatch.setattr(memory_aware_schedule, "schedule_module", counted)
    forget_schedules()
    return seen


def test_an_equal_input_takes_the_remembered_schedule(searches):
    first_pass, second_pass = MemoryAwareSchedule(), MemoryAwareSchedule()
    first = first_pass(_quadratic_first(SMALL))
    saved = remembered_seconds()
    again = _quadratic_first(SMALL)  # another object, structurally the same
    second = second_pass(again)
    assert len(searches) == 1
    assert _order(first) == ["pa", "rp", "xt", "qa", "rq", "out"]
    tvm.ir.assert_structural_equal(second, first)
    assert remembered_seconds() > saved
    # The report and the pass's result are the first run's, the report a copy of it.
    assert second_pass.report is not first_pass.report
    assert second_pass.report.blocks[0].strategy == first_pass.report.blocks[0].strategy
    assert second_pass.last_result["main"].changes == first_pass.last_result["main"].changes


def test_other_options_or_another_target_schedule_again(searches):
    MemoryAwareSchedule()(_quadratic_first(SMALL))
    MemoryAwareSchedule()(_quadratic_first(SMALL))
    assert len(searches) == 1
    MemoryAwareSchedule(ScheduleOptions(tie=0.01))(_quadratic_first(SMALL))
    with tvm.target.Target({"kind": "llvm", "opt-level": 1}):
        MemoryAwareSchedule()(_quadratic_first(SMALL))
    with tvm.transform.PassContext(opt_level=2, config={"tirx.disable_vectorize": True}):
        MemoryAwareSchedule()(_quadratic_first(SMALL))
    MemoryAwareSchedule()(_quadratic_first({"tir_var_upper_bound": {"s": 256}}))
    assert len(searches) == 5


def test_an_unchanged_input_comes_back_as_the_callers_object(searches):
    best = MemoryAwareSchedule()(_quadratic_first(SMALL))
    again = tvm.IRModule(dict(best.functions))  # a new module of the same functions
    assert MemoryAwareSchedule()(best).same_as(best)
    assert MemoryAwareSchedule()(again).same_as(again)
    assert len(searches) == 2  # ``best`` and ``again`` are equal: the second is remembered


def test_a_remembered_run_warns_as_the_run_did(searches):
    empty_range = {"tir_var_lower_bound": {"s": 8}, "tir_var_upper_bound": {"s": 4}}
    message = r"^MemoryAwareSchedule: dataflow blocks left unchanged for main: ValueError: dim"
    for _ in range(2):
        with pytest.warns(PassFallbackWarning, match=message):
            MemoryAwareSchedule()(_quadratic_first(empty_range))
    assert len(searches) == 1
    # A warning turned into an error stops the run, and nothing is remembered of it.
    forget_schedules()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassFallbackWarning)
        with pytest.raises(Exception, match="empty range"):
            MemoryAwareSchedule()(_quadratic_first(empty_range))
    with pytest.warns(PassFallbackWarning, match=message):
        MemoryAwareSchedule()(_quadratic_first(empty_range))
    assert len(searches) == 3


def test_the_compile_clock_counts_the_search_a_remembered_run_skipped(searches):
    MemoryAwareSchedule()(_quadratic_first(SMALL))
    clock = CompileClock()
    saved = remembered_seconds()
    MemoryAwareSchedule()(_quadratic_first(SMALL))
    skipped = remembered_seconds() - saved
    assert skipped > 0 and clock.seconds() >= skipped

"""PassResult / FunctionResult: byte figures (lazy ones too), summaries, and collecting."""

from __future__ import annotations

import dataclasses

import pytest

from blade_relax.symbolic import SymbolicExpr
from blade_relax.transform import FunctionResult, PassResult, SimplifyTransposes, collect_results
from blade_relax.transform.result import publish

S = SymbolicExpr.dim("s")


def test_figures_evaluate_at_concrete_dims_and_read_in_the_summary():
    result = FunctionResult("main", True, ("2 bindings moved",), S * 8 + 64, S * 4 + 64)
    assert result.evaluate({"s": 10}) == (144, 104)
    assert result.summary({"s": 10}) == (
        "main: 2 bindings moved; peak 144 B -> 104 B (-40 B, -27.8%) at s=10"
    )
    assert result.summary() == "main: 2 bindings moved; peak 8*s + 64 -> 4*s + 64"
    with pytest.raises(ValueError):
        result.evaluate({})
    unchanged = FunctionResult("f", False, notes=("nothing to plan",))
    assert unchanged.evaluate({}) == (None, None)
    assert unchanged.summary() == "f: unchanged; nothing to plan"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.changed = False


def test_a_lazy_figure_is_computed_once_on_first_read():
    calls = []

    def source():
        calls.append(1)
        return S * 2

    def broken():
        raise RuntimeError("cannot read this IR")

    result = FunctionResult("main", True, ("x",), source, broken)
    assert calls == []
    assert result.peak_before == S * 2 and result.peak_before == S * 2
    assert calls == [1]
    assert result.peak_after is None
    assert result.prediction_notes == ("no byte prediction (RuntimeError: cannot read this IR)",)
    assert result == FunctionResult("main", True, ("x",), S * 2, None)
    assert "no byte prediction" in result.summary()


def test_summary_lists_changed_functions_first_and_counts_the_rest():
    result = PassResult(
        "P",
        (
            FunctionResult("a", False, notes=("skipped",)),
            FunctionResult("b", True, ("1 thing done",)),
            FunctionResult("c", False),
            FunctionResult("d", True, ("2 things done",)),
        ),
    )
    assert result.changed and [f.function for f in result.changed_functions] == ["b", "d"]
    assert result.summary().splitlines() == [
        "P: changed 2 of 4 functions",
        "  b: 1 thing done",
        "  d: 2 things done",
        "  a: unchanged; skipped",
        "  1 other function unchanged",
    ]
    assert result.summary(max_functions=1).splitlines()[1:3] == [
        "  b: 1 thing done",
        "  (2 more functions)",
    ]
    assert PassResult("Q", notes=("disabled by its options",)).summary() == (
        "Q: no change (disabled by its options)"
    )
    assert result["d"].changes == ("2 things done",)
    with pytest.raises(KeyError):
        result["e"]
    data = PassResult("P", (FunctionResult("m", True, (), S, S + 1),)).to_dict({"s": 3})
    assert data["functions"][0]["peak_before"] == "s"
    assert (
        data["functions"][0]["peak_before_bytes"],
        data["functions"][0]["peak_after_bytes"],
    ) == (
        3,
        4,
    )


def test_collectors_nest_and_take_the_results_of_their_own_block():
    class Pass:
        last_result = None

    outer_pass, inner_pass = Pass(), Pass()
    with collect_results() as outer:
        publish(outer_pass, PassResult("Outer1"))
        with collect_results() as inner:
            publish(inner_pass, PassResult("Inner"))
        publish(outer_pass, PassResult("Outer2"))
    assert [r.pass_name for r in outer] == ["Outer1", "Outer2"]
    assert [r.pass_name for r in inner] == ["Inner"]
    assert inner_pass.last_result.pass_name == "Inner"
    assert outer_pass.last_result.pass_name == "Outer2"
    publish(outer_pass, PassResult("Alone"))  # no collector: only the pass object holds it


def test_a_pass_run_inside_a_collector_reports_there():
    from .test_simplify_transposes import Linear

    pass_ = SimplifyTransposes()
    with collect_results() as results:
        pass_(Linear)
    assert results == [pass_.last_result]

"""MemoryReport renders the timeline: JSON, Chrome trace schema, text table and plot."""

from __future__ import annotations

import json

import pytest

from blade_relax.analysis import MemoryReport, memory_timeline
from blade_relax.analysis.report import LowerBound
from blade_relax.frontend.builtin import BUILTIN_MODELS, attention_block, mlp, mlp_training_step
from blade_relax.pipeline import get_pipeline, lower_to_memory_stage
from blade_relax.transform import version_for


def _report(label: str = "stock") -> MemoryReport:
    lowered = lower_to_memory_stage(mlp_training_step())
    return MemoryReport.from_function(
        lowered["main"], {"b": 64}, label=label, mod=lowered, measured={"peak_bytes": 1}
    )


def test_summary_matches_timeline():
    report = _report()
    lowered = lower_to_memory_stage(mlp_training_step())
    expected = memory_timeline(lowered["main"], mod=lowered).evaluate({"b": 64})
    summary = report.summary()
    assert summary["peak_bytes"] == expected.peak
    # Read from this function alone (no bound of the function before the passes was given).
    assert summary["lower_bound_bytes"] == expected.persistent + expected.output_bytes
    assert summary["measured_peak_bytes"] == 1
    assert max(r["live_bytes"] for r in report.rows()) == expected.peak


def test_json_round_trips():
    report = _report()
    data = json.loads(report.to_json())
    assert data["summary"]["dims"] == {"b": 64}
    assert len(data["rows"]) == len(report.timeline.steps)


def test_chrome_trace_follows_trace_event_schema():
    trace = json.loads(json.dumps(_report().to_chrome_trace()))
    events = trace["traceEvents"]
    assert events, "no events"
    for event in events:
        assert event["ph"] in {"X", "C", "M"}
        assert isinstance(event["name"], str) and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], int) and event["dur"] == 1 and "tid" in event
        if event["ph"] == "C":
            assert set(event["args"]) == {"live"} and event["args"]["live"] >= 0
    counters = [e["args"]["live"] for e in events if e["ph"] == "C"]
    assert max(counters) == _report().peak


def test_text_table_names_the_peak_binding():
    report = _report()
    text = report.to_text(max_rows=5)
    assert report.summary()["peak_binding"] in text
    assert f"{report.peak:,}" in text


def test_plot_writes_png(tmp_path):
    before = MemoryReport.from_function(mlp_training_step()["main"], {"b": 64}, label="before")
    path = before.plot(str(tmp_path / "mem.png"), _report("after"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _blade_flags() -> dict[str, bool]:
    """The passes get_pipeline runs by default (as blade-relax report lowers with them)."""
    import inspect

    return {
        name: param.default
        for name, param in inspect.signature(get_pipeline).parameters.items()
        if isinstance(param.default, bool) and name != "check_dims"
    }


def _versions(mod, dims):
    """The reports of the function as given, after the stock passes and after ours, all
    sharing the bound read from the function before the passes."""
    bound = LowerBound.of_function(mod["main"], dims, mod=mod, source="main before the passes")
    reports = [MemoryReport.from_function(mod["main"], dims, label="input", mod=mod, bound=bound)]
    for label, flags in (("stock", {}), ("blade_relax", _blade_flags())):
        lowered = lower_to_memory_stage(mod, **flags)
        name = version_for(lowered, "main", dims)
        reports.append(
            MemoryReport.from_function(lowered[name], dims, label=label, mod=lowered, bound=bound)
        )
    return bound, reports


@pytest.mark.parametrize(
    ("model", "dims"),
    [("attention", {"s": 256}), ("mlp", {"s": 128}), ("mlp-train", {"b": 16})],
)
def test_every_version_reports_one_lower_bound_below_its_peak(model, dims):
    mod = BUILTIN_MODELS[model]()
    bound, reports = _versions(mod, dims)
    assert {r.lower_bound for r in reports} == {bound.nbytes}
    assert {r.summary()["lower_bound_bytes"] for r in reports} == {bound.nbytes}
    assert {r.summary()["lower_bound_symbolic"] for r in reports} == {bound.symbolic}
    bound_lines = {
        line for r in reports for line in r.to_text().splitlines() if "lower bound:" in line
    }
    assert len(bound_lines) == 1 and "main before the passes" in bound_lines.pop()
    for report in reports:
        # A lower bound: no version goes below it.
        assert bound.nbytes <= report.peak + report.evaluated.persistent, report.label


def test_lower_bound_is_what_every_version_holds():
    """Parameters and inputs plus the outputs, read from the function before the passes."""
    mod = attention_block()
    bound = LowerBound.of_function(mod["main"], {"s": 64}, mod=mod)
    timeline = memory_timeline(mod["main"], mod=mod, workspaces=False).evaluate({"s": 64})
    assert bound.persistent == timeline.persistent and bound.outputs == timeline.output_bytes
    assert bound.nbytes == timeline.persistent + timeline.output_bytes
    # The working set of the function's largest operator is no bound for a fused version:
    # blade_relax's attention never holds the scores that operator writes.
    _, (given, stock, ours) = _versions(mod, {"s": 64})
    assert timeline.lower_bound > ours.peak + ours.evaluated.persistent
    assert ours.lower_bound == given.lower_bound == stock.lower_bound


def test_lower_bound_ignores_dims_lowering_adds():
    mod = mlp()
    bound = LowerBound.of_function(mod["main"], {"s": 8, "added_by_lowering": 3}, mod=mod)
    assert bound.nbytes == LowerBound.of_function(mod["main"], {"s": 8}, mod=mod).nbytes

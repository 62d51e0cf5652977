"""MemoryReport renders the timeline: JSON, Chrome trace schema, text table and plot."""

from __future__ import annotations

import json

from blade_relax.analysis import MemoryReport, memory_timeline
from blade_relax.frontend.builtin import mlp_training_step
from blade_relax.pipeline import lower_to_memory_stage


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
    assert summary["lower_bound_bytes"] == expected.lower_bound
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

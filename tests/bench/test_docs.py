"""The benchmark pages: generated from the committed results, read back from JSON exactly."""

from __future__ import annotations

import json

import pytest

from blade_relax.bench import docs
from blade_relax.bench.report import (
    RecordedResult,
    RecordedWorkload,
    markdown_table,
    peak_grid,
    read_json,
    write_json,
)
from blade_relax.bench.runner import ConfigSummary, Measurement


def test_committed_pages_are_what_the_command_generates():
    """docs/benchmarks.md and the README's headline block regenerate byte for byte."""
    stale = [
        path.name
        for path, text in docs.expected_files().items()
        if not path.exists() or path.read_text() != text
    ]
    assert not stale, f"run python -m blade_relax.bench.docs: {stale} out of date"
    assert docs.main(["--check"]) == 0


def test_every_section_has_its_results_and_provenance():
    for section in docs.SECTIONS:
        result = read_json(docs.RESULTS / section.results)
        assert result.provenance["command"].startswith("python -m blade_relax.bench")
        assert result.provenance["commit"] and result.provenance["date"]
        assert section.ours in {c.name for c in result.configs if c.requested}


def test_check_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("# hand-edited\n")
    readme = tmp_path / "README.md"
    readme.write_text(docs.README.read_text())
    monkeypatch.setattr(docs, "PAGE", page)
    monkeypatch.setattr(docs, "README", readme)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "HEADLINE_PLOT", tmp_path / "img" / "peak.png")
    monkeypatch.setattr(docs, "FINETUNE_PLOT", tmp_path / "img" / "lora.png")
    assert docs.main(["--check"]) == 1
    assert "benchmarks.md" in capsys.readouterr().err
    assert page.read_text() == "# hand-edited\n"  # --check writes nothing
    assert docs.main([]) == 0
    assert docs.main(["--check"]) == 0
    assert (tmp_path / "img" / "peak.png").stat().st_size > 0
    assert (tmp_path / "img" / "lora.png").stat().st_size > 0


def _recorded(rows: list[Measurement], names: list[str]) -> RecordedResult:
    return RecordedResult(
        workload=RecordedWorkload("w", "training", {}, {"s": [2, 64]}, 0),
        target="llvm",
        lengths=sorted({m.seq_len for m in rows}),
        trace={},
        repeat=1,
        tolerance=1e-4,
        configs=[ConfigSummary(n, "tvm", "", True) for n in names],
        measurements=rows,
        environment={},
        provenance={},
    )


def test_ratio_grid_counts_lengths_at_or_below():
    rows = [
        Measurement("ours", 8, peak_bytes=90),
        Measurement("torch-eager", 8, peak_bytes=100),
        Measurement("ours", 16, peak_bytes=120),
        Measurement("torch-eager", 16, peak_bytes=100),
    ]
    grid = docs.ratio_grid(_recorded(rows, ["ours", "torch-eager"]), "ours", ["torch-eager"])
    assert "| 8 | 0.900 |" in grid and "| 16 | 1.200 |" in grid
    assert "`ours`: at or below `torch-eager` at 1 of 2 lengths." in grid
    assert docs.ratio_grid(_recorded(rows, ["ours"]), "ours", ["torch-eager"]) is None


def test_time_grid_takes_ratios_within_the_run():
    rows = [
        Measurement("ours", 8, step_time_s=0.02),
        Measurement("torch-eager", 8, step_time_s=0.01),
        Measurement("ours", 16, step_time_s=0.03),
        Measurement("torch-eager", 16, step_time_s=0.06),
    ]
    grid = docs.time_grid(_recorded(rows, ["ours", "torch-eager"]), "ours")
    assert "| 8 | 2.00 |" in grid and "| 16 | 0.50 |" in grid
    assert "Median over the lengths: 1.25 against torch-eager." in grid


@pytest.fixture(scope="module")
def tiny_run():
    from blade_relax.bench import ModelSizes, build_workload, run_benchmark

    workload = build_workload("mlp-train", ModelSizes(layers=2, hidden=16, intermediate=32))
    return run_benchmark(workload, ["tvm-dynamic", "blade-relax"], [8, 24], repeat=1)


def test_json_reads_back_into_the_same_tables(tiny_run, tmp_path):
    path = write_json(tiny_run, tmp_path / "run.json", command="python -m blade_relax.bench x")
    recorded = read_json(path)
    assert markdown_table(recorded) == markdown_table(tiny_run)
    assert peak_grid(recorded) == peak_grid(tiny_run)
    assert recorded.all_correct == tiny_run.all_correct
    prov = json.loads(path.read_text())["provenance"]
    assert prov["command"] == "python -m blade_relax.bench x"
    assert set(prov) == {"command", "commit", "dirty", "date"}


def test_read_json_refuses_another_schema(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": "blade_relax.report/1"}))
    with pytest.raises(ValueError, match="expected 'blade_relax.bench/1'"):
        read_json(path)


def test_every_overhead_run_has_its_provenance_and_rows():
    for section in docs.SECTIONS:
        if not section.overhead:
            continue
        run = docs.read_overhead(docs.RESULTS / section.overhead)
        assert run.provenance["command"].startswith("python -m blade_relax.bench.overhead")
        assert run.provenance["commit"] and run.provenance["date"]
        result = read_json(docs.RESULTS / section.results)
        assert run.workload == result.workload.name
        for n in run.lengths:
            assert run.row(section.budgeted, n).base == section.ours
            assert run.row(section.checkpointing[0], n).base == section.checkpointing[1]


def test_checkpointing_grid_counts_peaks_and_overheads():
    from blade_relax.bench.overhead import OverheadRow, RecordedOverhead

    rows = [
        Measurement("ours@0.7", 8, peak_bytes=90),
        Measurement("torch-eager-ckpt", 8, peak_bytes=100),
        Measurement("ours@0.7", 16, peak_bytes=120),
        Measurement("torch-eager-ckpt", 16, peak_bytes=100),
    ]
    result = _recorded(rows, ["ours@0.7", "torch-eager-ckpt"])
    run = RecordedOverhead(
        workload="w",
        blocks=3,
        steps=2,
        provenance={"command": "python -m blade_relax.bench.overhead", "commit": "abc1234"},
        rows=(
            OverheadRow("ours@0.7", 8, median_ratio=1.2, base="ours"),
            OverheadRow("torch-eager-ckpt", 8, median_ratio=1.5, base="torch-eager"),
            OverheadRow("ours@0.7", 16, median_ratio=1.6, base="ours"),
            OverheadRow("torch-eager-ckpt", 16, median_ratio=1.5, base="torch-eager"),
        ),
    )
    section = docs.Section("w.json", "t", "i", ours="ours", budgeted="ours@0.7")
    grid = docs.checkpointing_grid(section, result, run)
    assert "| 8 | 90 B | 100 B | 1.20 | 1.50 |" in grid
    assert "| 16 | 120 B | 100 B | 1.60 | 1.50 |" in grid
    standing = docs.checkpointing_standing(section, result, run)
    assert "at 1 of 2 lengths; step-time" in standing and standing.endswith("at 1 of 2 lengths")
    # A row divided by another base does not count as the overhead against checkpointing.
    other = RecordedOverhead("w", 3, 2, {}, (OverheadRow("ours@0.7", 8, 1.0, base="x"),))
    assert "| 8 | 90 B | 100 B | - | - |" in docs.checkpointing_grid(section, result, other)

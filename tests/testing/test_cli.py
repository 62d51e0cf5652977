"""The fuzzing command line: totals, JSON report, crash isolation."""

from __future__ import annotations

import json

from blade_relax.testing.fuzz import main


def test_in_process_run_writes_totals(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    status = main(["--count", "2", "--start", "4", "--shapes", "1", "--quiet", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["programs"] == 2 and data["shapes"] == 2
    assert data["seeds"] == [4, 6]
    assert data["runs"] >= 2 and data["checks"]["outputs"] == data["runs"]
    assert status == (1 if data["mismatches"] else 0)
    assert "programs: 2" in capsys.readouterr().out


def test_crashing_worker_is_reported_and_replaced(tmp_path, monkeypatch):
    out = tmp_path / "fuzz.json"
    monkeypatch.setenv("BLADE_RELAX_FUZZ_CRASH_SEED", "1")
    status = main(["--isolate", "--count", "3", "--shapes", "1", "--quiet", "--json", str(out)])
    data = json.loads(out.read_text())
    # Seed 1 crashed its worker; seeds 0 and 2 ran anyway.
    assert data["programs"] == 3
    crashed = [f for f in data["failures"] if f["seed"] == 1]
    assert crashed and crashed[0]["mismatches"][0].startswith("crash")
    assert status == 1

"""The decision-time benchmark: its rows on a hand-written program, and the command at a tiny
size (an MLP of two layers, no sweep, one repeat)."""

from __future__ import annotations

import json

import pytest

from blade_relax.bench.decision_time import CLOCKS, main, table, time_timeline
from blade_relax.contract import REMAT_FORMAT
from blade_relax.runtime.remat import RematProgram


def _program() -> RematProgram:
    """Storages of 4*s, 8*s and 4*s bytes; slot 0 is the second one (its window is 2..3)."""
    return RematProgram(
        {
            "format": REMAT_FORMAT,
            "function": "f",
            "dims": ["s"],
            "exact": True,
            "points": 4,
            "exprs": ["(4 * s)", "(8 * s)", "(3 * s)"],
            "storages": [[0, 0, 4], [1, 1, 4], [0, 2, 3]],
            "slots": [
                {
                    "name": "t",
                    "regen": "f_remat0",
                    "bytes": 1,
                    "cost": 2,
                    "regen_peak": 1,
                    "start": 2,
                    "site": 3,
                    "plan": [[0, [["a", 0]]]],
                }
            ],
        }
    )


def test_rows_of_a_program():
    row = time_timeline(_program(), [10], [0.9, 0.5], repeat=2, workload="w", length=10)
    assert (row.slots, row.candidates, row.points, row.base_peak) == (1, 1, 4, 160)
    assert [b.fraction for b in row.budgets] == [0.9, 0.5]
    reach, miss = row.budgets
    # 0.9: evicting the slot brings the peak to 120 (the test of the runtime's own program).
    assert reach.budget == 144 and reach.reachable and reach.peak == 120 and reach.evicted == 1
    assert not miss.reachable and miss.peak == row.minimum_peak == 120
    for b in row.budgets:
        assert len(b.uncached_samples) == 2 and b.uncached_ms > 0 and b.cached_us > 0
    assert row.minimum_ms > 0 and len(row.minimum_samples) == 2
    text = table([row], [0.9, 0.5])
    assert "| w | 0 | 10 | 1 | 4 |" in text
    assert "*" in text.splitlines()[-1]  # 0.5 is unreachable


def test_rows_by_the_cpu_clock():
    """The CPU time of the deciding thread: the same decisions, positive times."""
    wall = time_timeline(_program(), [10], [0.9, 0.5], repeat=2)
    cpu = time_timeline(_program(), [10], [0.9, 0.5], repeat=2, clock=CLOCKS["cpu"])
    assert [(b.peak, b.reachable, b.evicted) for b in cpu.budgets] == [
        (b.peak, b.reachable, b.evicted) for b in wall.budgets
    ]
    assert all(t >= 0 for b in cpu.budgets for t in b.uncached_samples)
    assert cpu.minimum_peak == wall.minimum_peak and all(b.cached_us > 0 for b in cpu.budgets)


def test_command_on_a_tiny_mlp(tmp_path, capsys):
    out = tmp_path / "decisions.json"
    argv = [
        "--workloads",
        "mlp-train",
        "--layers",
        "",
        "--lengths",
        "8,32",
        "--repeat",
        "1",
        "--hidden",
        "16",
        "--intermediate",
        "64",
        "--vocab",
        "8",
        "--max-seq-len",
        "64",
        "--quiet",
        "--clock",
        "cpu",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "## Remat decision time" in printed and "Growth" not in printed
    assert "CPU time of the deciding thread" in printed
    assert "| mlp-train | 2 | 8 |" in printed and "| mlp-train | 2 | 32 |" in printed
    payload = json.loads(out.read_text())
    assert [r["length"] for r in payload["rows"]] == [8, 32] and payload["sweep"] == []
    assert payload["clock"] == "cpu"
    for row in payload["rows"]:
        assert [b["fraction"] for b in row["budgets"]] == [0.9, 0.8, 0.7]
        assert row["minimum_peak"] >= row["floor"]
        for b in row["budgets"]:
            assert b["peak"] >= row["floor"] and b["reachable"] == (b["peak"] <= b["budget"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--workloads", "no-such-workload"],
        ["--lengths", "a,b"],
        ["--fractions", "0.9,-1"],
        ["--repeat", "0"],
        ["--layers", "0"],
        ["--clock", "sundial"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err

"""The rematerialization quality bench: floor, minimum, budgets held, the exact optimum."""

from __future__ import annotations

import json

import pytest

from blade_relax.bench import remat_quality


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workloads", "gpt2-infer"], "unknown workload"),
        (["--lengths", "16,x"], "--lengths"),
        (["--lengths", "1"], "at least 2"),
        (["--time-limit", "0"], "--time-limit"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert remat_quality.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_mlp_train_report(tmp_path, capsys):
    out = tmp_path / "quality.json"
    argv = ["--workloads", "mlp-train", "--lengths", "256", "--json", str(out)]
    assert remat_quality.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| mlp-train | 256 |" in printed and "runtime peak / optimum" in printed
    (row,) = json.loads(out.read_text())
    assert row["floor"] <= row["minimum"] <= row["unbudgeted"]
    assert row["minimum"] < row["unbudgeted"]  # at s = 256 evictions lower the peak
    assert row["minimum_bitwise_equal"]
    assert row["budgets"], "the budgets between 1.05 x floor and the peak were measured"
    for budget in row["budgets"]:
        assert budget["bitwise_equal"]
        assert budget["held"] == (budget["peak"] <= budget["budget"])
        if budget["reachable"]:
            assert budget["held"]
    assert [o["fraction"] for o in row["optimum"]] == [0.9, 0.8, 0.7]
    for o in row["optimum"]:
        assert o["optimal"]
        if o["optimum_feasible"]:
            assert o["optimum_peak"] <= o["budget"]
        else:  # nothing fits: the runtime cannot call the budget reachable either
            assert not o["runtime_reachable"]


def test_each_workload_reads_its_own_program(monkeypatch):
    # Every workload's function may be called `main`: another executable's `main`, registered
    # earlier in the process (here a one-slot program), must not stand in for this one's.
    from blade_relax.contract import REMAT_FORMAT
    from blade_relax.runtime import remat

    other = remat.RematProgram(
        {
            "format": REMAT_FORMAT,
            "function": "main",
            "dims": ["s"],
            "exact": True,
            "points": 2,
            "exprs": ["(4 * s)"],
            "storages": [[0, 0, 2]],
            "slots": [],
        }
    )
    monkeypatch.setitem(remat._programs, "main:another-executable", other)
    (report,) = remat_quality.measure_workload("tanh-mlp-train", [512], say=lambda _m: None)
    # The foreign program has no slot; how many the tanh MLP's has depends on the passes
    # (8 before the graph passes changed, 4 since): any is its own.
    assert report.slots > 0
    assert report.floor <= report.minimum <= report.unbudgeted

"""The interleaved overhead ruler: rows, ratios against the base, refusals."""

from __future__ import annotations

import pytest

from blade_relax.bench import ModelSizes, build_workload
from blade_relax.bench.overhead import active_query_us, main, measure_overhead

TINY = ModelSizes(layers=2, hidden=16, intermediate=64, vocab=8, max_seq_len=64, min_seq_len=2)


@pytest.fixture(scope="module")
def workload():
    return build_workload("mlp-train", TINY)


def test_rows_per_config_and_length(workload):
    rows = measure_overhead(
        workload, "blade-relax-schedule", ["blade-relax"], [8, 32], blocks=3, steps=1
    )
    assert [(r.config, r.length) for r in rows] == [
        ("blade-relax-schedule", 8),
        ("blade-relax", 8),
        ("blade-relax-schedule", 32),
        ("blade-relax", 32),
    ]
    for row in rows:
        assert len(row.block_ratios) == 3 and all(r > 0 for r in row.block_ratios)
        assert row.median_step_s > 0
    base_rows = [r for r in rows if r.config == "blade-relax-schedule"]
    assert all(r.block_ratios == [1.0, 1.0, 1.0] and r.median_ratio == 1.0 for r in base_rows)
    # The base has no remat runtime, so no decision to time.
    assert all(r.decision_us is None for r in base_rows)


def test_active_query_is_timed():
    assert 0 < active_query_us(calls=1000) < 1e4


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "blade-relax@0.5"],  # budgeted: not a no-budget overhead
        ["--configs", "no-such-config"],
        ["--lengths", "a,b"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(["--workload", "mlp-train", "--blocks", "1", "--steps", "1", *argv]) == 2
    assert capsys.readouterr().err.strip()

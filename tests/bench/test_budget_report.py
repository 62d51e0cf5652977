"""The budget sweep summary: ratios to the unbudgeted runs, budgets held, the plot."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blade_relax.bench.report import budget_points, budget_table, write_budget_plot
from blade_relax.bench.runner import BenchResult, ConfigSummary, Measurement


def _tvm(name, budget=None):
    settings = {"static": False, "keep_bounds": False, "budget": budget, "budget_of": None}
    if budget is not None:
        settings["budget_of"] = "ours"
    return ConfigSummary(name, "tvm", "", True, settings=settings)


def _torch(name, fraction=None):
    settings = {"compile": True, "activation_memory_budget": fraction}
    return ConfigSummary(name, "torch", "", True, settings=settings)


def _row(config, n, peak, time, step_peak=None, budget=None):
    return Measurement(
        config,
        n,
        peak_bytes=peak,
        step_peak_bytes=step_peak,
        step_time_s=time,
        budget_bytes=budget,
    )


def _result(configs, rows):
    return BenchResult(
        workload=SimpleNamespace(name="toy"),
        target="llvm",
        lengths=[8, 16, 32],
        trace={},
        repeat=1,
        tolerance=1e-4,
        configs=configs,
        measurements=rows,
    )


@pytest.fixture
def sweep():
    configs = [_tvm("ours"), _tvm("ours@0.5", 0.5), _torch("tc"), _torch("tc@0.2", 0.2)]
    rows = [
        _row("ours", 8, 1000, 1.0, 900),
        _row("ours", 16, 2000, 2.0, 1900),
        _row("ours", 32, 4000, 4.0, 3900),
        # Held at 8 and 16, over at 32 (step peak 2000 > budget 1950).
        _row("ours@0.5", 8, 600, 1.1, 500, budget=450 * 2),
        _row("ours@0.5", 16, 1000, 2.4, 900, budget=950),
        _row("ours@0.5", 32, 2100, 4.8, 2000, budget=1950),
        _row("tc", 8, 800, 0.5),
        _row("tc", 16, 1600, 1.0),
        _row("tc", 32, 3200, 2.0),
        _row("tc@0.2", 8, 700, 0.6),
        _row("tc@0.2", 16, 1400, 1.3),
        _row("tc@0.2", 32, 3000, 2.2),
    ]
    return _result(configs, rows)


def test_ratios_are_medians_over_lengths(sweep):
    points = {p.config: p for p in budget_points(sweep)}
    assert set(points) == {"ours", "ours@0.5", "tc", "tc@0.2"}
    assert points["ours"].peak_ratio == 1.0 and points["ours"].time_ratio == 1.0
    # peak ratios 0.6, 0.5, 0.525 -> 0.525; time ratios 1.1, 1.2, 1.2 -> 1.2
    assert points["ours@0.5"].peak_ratio == pytest.approx(0.525)
    assert points["ours@0.5"].time_ratio == pytest.approx(1.2)
    assert points["ours@0.5"].budget_met == (2, 3)
    assert points["ours@0.5"].setting == 0.5
    # torch peaks against our reference, its times against its own unbudgeted compile
    assert points["tc"].peak_ratio == pytest.approx(0.8)
    assert points["tc@0.2"].time_ratio == pytest.approx(1.2)
    assert points["tc@0.2"].family == "activation_memory_budget"
    assert points["tc"].budget_met is None


def test_checkpointing_configs_stay_out_of_the_torch_curve(sweep):
    # Listed first, the checkpointed compile must not become the torch curve's time base.
    ckpt = ConfigSummary(
        "tc-ckpt",
        "torch",
        "",
        True,
        settings={"compile": True, "activation_memory_budget": None, "checkpointing": True},
    )
    sweep.configs.insert(0, ckpt)
    sweep.measurements += [_row("tc-ckpt", n, 100 * n, 10.0) for n in (8, 16, 32)]
    points = {p.config: p for p in budget_points(sweep)}
    assert set(points) == {"ours", "ours@0.5", "tc", "tc@0.2"}
    assert points["tc"].time_ratio == pytest.approx(1.0)
    assert points["tc@0.2"].time_ratio == pytest.approx(1.2)


def test_table_and_plot(sweep, tmp_path):
    table = budget_table(sweep)
    assert "| ours@0.5 | 0.5 | 0.53 | 1.20 | 2/3 |" in table
    assert "| tc | - | 0.80 | 1.00 | - |" in table
    path = write_budget_plot(sweep, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_budgeted_config_gives_nothing(tmp_path):
    result = _result([_tvm("ours")], [_row("ours", 8, 1000, 1.0, 900)])
    assert budget_points(result) == []
    assert budget_table(result) == ""
    with pytest.raises(ValueError, match="no budgeted configuration"):
        write_budget_plot(result, tmp_path / "x.png")

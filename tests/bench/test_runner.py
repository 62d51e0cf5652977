"""The ruler end to end on the small Relax-native workload: JSON schema, table, plot, budgets."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from blade_relax.bench import ModelSizes, build_workload, main, run_benchmark
from blade_relax.bench import configs as registry
from blade_relax.bench.configs import TvmConfig, register_budget_family, register_config
from blade_relax.bench.configs import stock_pipeline_factory as stock
from blade_relax.bench.report import SCHEMA, markdown_table
from blade_relax.bench.runner import within_float64_rounding
from blade_relax.frontend import DimOutOfRangeError

pytest.importorskip("torch")

TINY = ["--workload", "mlp-train", "--hidden", "16", "--intermediate", "32", "--vocab", "8",
        "--layers", "1", "--max-seq-len", "48", "--repeat", "1", "--quiet"]  # fmt: skip
TINY_SIZES = ModelSizes(layers=1, hidden=16, intermediate=32, vocab=8, max_seq_len=48)

RESULT_KEYS = {
    "config", "seq_len", "peak_bytes", "step_peak_bytes", "caller_bytes", "lower_bound_bytes",
    "step_time_s", "step_times_s", "compile_time_s", "compilations", "loss", "max_rel_error",
    "correct", "budget_bytes", "evictions", "regenerations", "unevictable_bytes",
    "workspace_bytes", "allocations", "driver_peak_bytes", "driver_agrees", "padded_to",
    "source", "error", "offloads", "peak_host_bytes", "float64_checked",
}  # fmt: skip
MEASURED_KEYS = {
    "config", "seq_len", "peak_bytes", "step_peak_bytes", "caller_bytes", "lower_bound_bytes",
    "step_time_s", "step_times_s", "compile_time_s", "compilations", "loss", "max_rel_error",
    "correct", "source",
}  # fmt: skip


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [*TINY, "--configs", "tvm-dynamic,tvm-bounded,tvm-static,torch-eager",
            "--lengths", "8,40", "--out", str(out / "r.json"), "--plot", str(out / "p.png")]  # fmt: skip
    code = main(argv)
    return code, json.loads((out / "r.json").read_text()), out


def test_cli_run_succeeds_and_writes_plot(run_json):
    code, doc, out = run_json
    assert code == 0
    assert doc["all_correct"] is True
    assert (out / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_schema(run_json):
    _, doc, _ = run_json
    assert doc["schema"] == SCHEMA
    assert set(doc) >= {
        "schema", "workload", "target", "environment", "trace", "repeat", "tolerance",
        "all_correct", "configs", "results",
    }  # fmt: skip
    assert doc["workload"]["name"] == "mlp-train"
    assert doc["workload"]["dims"] == {"s": [2, 48]}
    assert doc["workload"]["outputs"][0] == "loss"
    assert doc["target"] == "host"  # the default: llvm for this machine's CPU
    assert doc["environment"]["llvm_cpu"]
    assert doc["trace"]["measured_lengths"] == [8, 40]
    assert [c["name"] for c in doc["configs"]] == [
        "tvm-dynamic", "tvm-bounded", "tvm-static", "torch-eager",
    ]  # fmt: skip
    for config in doc["configs"]:
        assert set(config) == {
            "name", "kind", "description", "requested", "compile_time_s", "compilations",
            "settings",
        }  # fmt: skip
    assert len(doc["results"]) == 8
    for row in doc["results"]:
        # Null fields are left out; these never are in a measured row.
        assert set(row) <= RESULT_KEYS, set(row) - RESULT_KEYS
        assert set(row) >= MEASURED_KEYS, MEASURED_KEYS - set(row)
        assert row.get("error") is None, row
        assert row["correct"] is True, row
        assert row["max_rel_error"] <= 1e-4, row
        assert row["peak_bytes"] == row["step_peak_bytes"] + row["caller_bytes"], row
        assert row["step_peak_bytes"] > 0, row
        assert row["lower_bound_bytes"] is not None, row
        assert row["lower_bound_bytes"] > row["caller_bytes"], row
        if row["config"].startswith("tvm"):
            # The kernel workspace included in the step's peak (TVM rows only).
            assert 0 <= row["workspace_bytes"] <= row["step_peak_bytes"], row
        else:
            assert row.get("workspace_bytes") is None, row
        assert len(row["step_times_s"]) == 1, row
        assert row["source"] == "measured" and row.get("padded_to") is None, row


def test_measured_facts(run_json):
    _, doc, _ = run_json
    rows = {(r["config"], r["seq_len"]): r for r in doc["results"]}
    # Compiled once vs once per length.
    assert rows[("tvm-dynamic", 40)]["compilations"] == 1
    assert rows[("tvm-static", 40)]["compilations"] == 2
    assert rows[("tvm-dynamic", 40)]["compile_time_s"] == 0.0
    # Same loss everywhere; more bytes at the longer length for the size-following configs.
    for config in ("tvm-dynamic", "tvm-static", "torch-eager"):
        assert rows[(config, 40)]["peak_bytes"] > rows[(config, 8)]["peak_bytes"]
        assert rows[(config, 8)]["loss"] == pytest.approx(rows[("torch-eager", 8)]["loss"], 1e-5)
    # Planning at the bound costs bytes at short lengths.
    assert rows[("tvm-bounded", 8)]["peak_bytes"] > rows[("tvm-dynamic", 8)]["peak_bytes"]
    assert rows[("tvm-dynamic", 8)]["caller_bytes"] == rows[("torch-eager", 8)]["caller_bytes"]


def test_lengths_beyond_the_bound_are_refused(capsys):
    assert main([*TINY, "--lengths", "8,49"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert "s <= 48" in line


def test_list_configs(capsys):
    assert main(["--list-configs"]) == 0
    listed = capsys.readouterr().out
    for name in ("tvm-dynamic", "tvm-bounded", "tvm-static", "torch-eager", "torch-compile@B"):
        assert name in listed
    # One column of descriptions, however long the names.
    lines = listed.splitlines()
    columns = {len(line) - len(line.split(maxsplit=1)[1]) for line in lines}
    assert len(columns) == 1, listed
    assert "blade-relax-schedule-plan-static " in listed


@pytest.fixture
def budget_family():
    saved = dict(registry._CONFIGS), dict(registry._FAMILIES)
    register_config(TvmConfig("stock-again", pipeline=stock))
    register_budget_family("stock-again")
    yield
    registry._CONFIGS.clear()
    registry._CONFIGS.update(saved[0])
    registry._FAMILIES.clear()
    registry._FAMILIES.update(saved[1])


def test_budget_is_a_fraction_of_the_reference_peak(budget_family):
    workload = build_workload("mlp-train", TINY_SIZES)
    result = run_benchmark(workload, ["stock-again@0.5"], [12], repeat=1)
    assert [(c.name, c.requested) for c in result.configs] == [
        ("stock-again", False),
        ("stock-again@0.5", True),
    ]
    reference, budgeted = result.measurements
    assert budgeted.budget_bytes == int(0.5 * reference.step_peak_bytes)
    assert budgeted.error is None and budgeted.correct
    assert "stock-again@0.5" in markdown_table(result)
    assert "| stock-again |" not in markdown_table(result)  # not requested, not shown
    with pytest.raises(DimOutOfRangeError, match="s <= 48"):
        run_benchmark(workload, ["tvm-dynamic"], [49])


def test_unevictable_bytes_bound_the_budgeted_peak(budget_family):
    workload = build_workload("mlp-train", TINY_SIZES)
    # The rematerialized config first: the stock one after it must not inherit its decision.
    result = run_benchmark(
        workload, ["blade-relax-schedule-remat@0.01", "stock-again@0.5"], [12, 40], repeat=1
    )
    rows = {(m.config, m.seq_len): m for m in result.measurements}
    for n in (12, 40):
        budgeted = rows[("blade-relax-schedule-remat@0.01", n)]
        assert budgeted.error is None and budgeted.correct
        # Unreachable budget: the runtime ran at its smallest peak, never below the floor.
        assert rows[("blade-relax-schedule-remat", n)].unevictable_bytes is None
        assert budgeted.caller_bytes < budgeted.unevictable_bytes <= budgeted.peak_bytes
        assert rows[("stock-again@0.5", n)].unevictable_bytes is None


def test_float64_rounding_passes_noise_and_refuses_an_error():
    exact = np.zeros(16)
    noise = np.random.default_rng(0).normal(scale=1e-11, size=(2, 16))
    # A gradient zero in exact arithmetic: torch's and ours are both noise of one size.
    assert within_float64_rounding(noise[0], noise[1], exact)
    assert not within_float64_rounding(noise[0] + 1e-6, noise[1], exact)
    # Where torch's float32 result is close to exact, being as far as the tolerance is not.
    exact = np.linspace(1.0, 2.0, 16)
    assert not within_float64_rounding(exact * (1 + 1e-3), exact * (1 + 1e-7), exact)
    assert within_float64_rounding(exact * (1 + 1e-7), exact * (1 - 1e-7), exact)


def _with_noisy_reference(workload, index, noisy_exact):
    """``workload`` whose torch reference misses output ``index`` by 1e-3 (as float32 rounding
    misses a gradient zero in exact arithmetic), with a float64 reference that is the true
    outputs (``noisy_exact=False``) or misses it as well (``True``); counts float64 calls."""
    reference, calls = workload.graph.reference, []

    def noisy(inputs):
        outputs = [np.array(a) for a in reference(inputs)]
        outputs[index] = outputs[index] * np.float32(1 + 1e-3)
        return outputs

    def exact(inputs):
        calls.append(len(inputs))
        return [np.float64(a) for a in (noisy if noisy_exact else reference)(inputs)]

    graph = dataclasses.replace(workload.graph, reference=noisy, float64_reference=exact)
    return dataclasses.replace(workload, graph=graph), calls


@pytest.mark.parametrize("noisy_exact", [False, True])
def test_an_output_above_the_tolerance_is_checked_against_float64(noisy_exact):
    workload = build_workload("mlp-train", TINY_SIZES)
    plain = run_benchmark(workload, ["tvm-dynamic"], [12], repeat=1).measurements[0]
    assert plain.correct and plain.float64_checked is None
    index = 2
    noisy, calls = _with_noisy_reference(workload, index, noisy_exact)
    (row,) = run_benchmark(noisy, ["tvm-dynamic"], [12], repeat=1).measurements
    assert calls == [len(workload.inputs(12))]  # asked once, and only because one failed
    name = workload.graph.output_names[index]
    if noisy_exact:  # torch's float32 result is close to exact, ours is not: wrong
        assert not row.correct and row.float64_checked is None
        assert row.max_rel_error > 1e-4
    else:
        assert row.correct and row.float64_checked == [name]
        assert row.max_rel_error == pytest.approx(plain.max_rel_error)


def test_no_float64_step_is_run_where_every_output_is_within_tolerance():
    workload = build_workload("mlp-train", TINY_SIZES)
    calls = []
    graph = dataclasses.replace(
        workload.graph, float64_reference=lambda inputs: calls.append(1) or []
    )
    result = run_benchmark(dataclasses.replace(workload, graph=graph), ["tvm-dynamic"], [12])
    assert result.all_correct and not calls

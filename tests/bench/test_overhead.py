"""The interleaved overhead ruler: rows, ratios against each row's base, peaks, refusals."""

from __future__ import annotations

import types

import pytest

from blade_relax.bench import ModelSizes, build_workload
from blade_relax.bench import overhead as overhead_module
from blade_relax.bench.overhead import active_query_us, main, measure_overhead, parse_pairs

# MemoryAwareSchedule + Rematerialize, no PlanMemory: what the remat runtime costs over the schedule.
REMAT = "blade-relax-schedule-remat"
REMAT_BUDGET = f"{REMAT}@0.5"
TINY = ModelSizes(layers=2, hidden=16, intermediate=64, vocab=8, max_seq_len=64, min_seq_len=2)


@pytest.fixture(scope="module")
def workload():
    return build_workload("mlp-train", TINY)


def test_rows_per_config_and_length(workload):
    rows = measure_overhead(workload, "blade-relax-schedule", [REMAT], [8, 32], blocks=3, steps=1)
    assert [(r.config, r.length) for r in rows] == [
        ("blade-relax-schedule", 8),
        (REMAT, 8),
        ("blade-relax-schedule", 32),
        (REMAT, 32),
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
        ["--configs", "blade-relax-static"],  # recompiled per length: no single executable
        ["--configs", "no-such-config"],
        ["--lengths", "a,b"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(["--workload", "mlp-train", "--blocks", "1", "--steps", "1", *argv]) == 2
    assert capsys.readouterr().err.strip()


def test_ratios_divide_blocks_of_the_same_round(workload, monkeypatch):
    """A scripted clock gives every (config, round) block its own time: each ratio must be the
    block over its base's block of the same round, the order rotating from round to round."""
    names = ["blade-relax-schedule", REMAT, REMAT_BUDGET]
    pairs = {REMAT_BUDGET: REMAT}
    blocks = 3

    def elapsed(name: str, round_index: int) -> float:
        return (names.index(name) + 2) * (round_index + 1) + 0.5 * round_index

    script = []
    for round_index in range(blocks):
        shift = round_index % len(names)
        script += [elapsed(n, round_index) for n in names[shift:] + names[:shift]]
    clock = {"now": 0.0, "calls": 0}

    def perf_counter() -> float:
        # Two readings per block: its start, then its end `elapsed` later.
        if clock["calls"] % 2:
            clock["now"] += script[clock["calls"] // 2]
        clock["calls"] += 1
        return clock["now"]

    monkeypatch.setattr(overhead_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    rows = measure_overhead(
        workload, names[0], names[1:], [16], pairs=pairs, blocks=blocks, steps=1
    )
    assert clock["calls"] == 2 * len(script)
    for row in rows:
        base = pairs.get(row.config, names[0])
        assert row.base == base
        assert row.block_times_s == [elapsed(row.config, r) for r in range(blocks)]
        want = [elapsed(row.config, r) / elapsed(base, r) for r in range(blocks)]
        assert row.block_ratios == pytest.approx(want, rel=1e-12)
        assert row.median_ratio == pytest.approx(sorted(want)[1], rel=1e-12)


LLAMA = ModelSizes(
    layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)
# Two layers: with one, Hugging Face checkpointing has no layer boundary to save activations at,
# and its recomputation raises the step peak instead of lowering it.
MEMORY_VS_TIME = {
    "blade-relax@0.5": "blade-relax",
    "torch-eager-ckpt": "torch-eager",
    "torch-eager": "torch-eager",
}


@pytest.fixture(scope="module")
def cost_rows():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    llama = build_workload("llama-train", LLAMA)
    return measure_overhead(
        llama,
        "blade-relax",
        ["blade-relax@0.5", "torch-eager", "torch-eager-ckpt"],
        [16, 32],
        pairs=MEMORY_VS_TIME,
        blocks=2,
        steps=1,
    )


def _row(rows, config, length):
    (row,) = [r for r in rows if r.config == config and r.length == length]
    return row


def test_memory_vs_time_rows(cost_rows):
    configs = ["blade-relax", "blade-relax@0.5", "torch-eager", "torch-eager-ckpt"]
    assert [(r.config, r.length) for r in cost_rows] == [(c, n) for n in (16, 32) for c in configs]
    for row in cost_rows:
        assert row.base == MEMORY_VS_TIME.get(row.config, "blade-relax")
        assert len(row.block_ratios) == len(row.block_times_s) == 2
        assert row.step_peak_bytes and row.step_peak_bytes > 0
        base = _row(cost_rows, row.base, row.length)
        assert row.block_ratios == [t / b for t, b in zip(row.block_times_s, base.block_times_s)]
        assert row.median_ratio > 0
    for config in ("blade-relax", "torch-eager"):  # their own base: exactly 1
        for n in (16, 32):
            own = _row(cost_rows, config, n)
            assert own.block_ratios == [1.0, 1.0] and own.median_ratio == 1.0
    # Only the TVM rows have a remat runtime to time; only the budgeted row has a budget.
    assert all((r.decision_us is None) == r.config.startswith("torch") for r in cost_rows)
    assert all((r.budget_bytes is not None) == r.config.endswith("@0.5") for r in cost_rows)


def test_budget_is_half_the_unbudgeted_peak_and_lowers_it(cost_rows):
    for n in (16, 32):
        free = _row(cost_rows, "blade-relax", n)
        budgeted = _row(cost_rows, "blade-relax@0.5", n)
        assert budgeted.budget_bytes == max(1, int(0.5 * free.step_peak_bytes))
        assert budgeted.step_peak_bytes <= free.step_peak_bytes
    assert (
        _row(cost_rows, "blade-relax@0.5", 32).step_peak_bytes
        < _row(cost_rows, "blade-relax", 32).step_peak_bytes
    )


def test_checkpointing_lowers_the_torch_peak(cost_rows):
    ckpt = _row(cost_rows, "torch-eager-ckpt", 32)
    eager = _row(cost_rows, "torch-eager", 32)
    assert 0 < ckpt.step_peak_bytes < eager.step_peak_bytes


def test_table_shows_ratio_and_peak_side_by_side(cost_rows):
    table = overhead_module._table(cost_rows, 0.5)
    line = next(
        x for x in table.splitlines() if x.startswith("| torch-eager-ckpt | torch-eager | 32")
    )
    cells = [c.strip() for c in line.strip("|").split("|")]
    ckpt, eager = _row(cost_rows, "torch-eager-ckpt", 32), _row(cost_rows, "torch-eager", 32)
    assert cells[3] == f"{ckpt.median_ratio:.3f}"
    assert cells[6] == f"{ckpt.step_peak_bytes / eager.step_peak_bytes:.3f}"


@pytest.mark.slow
def test_lora_sft_batches():
    pytest.importorskip("peft")
    sft = build_workload("llama-lora-sft", LLAMA)
    assert len(sft.graph.input_names) == 3
    rows = measure_overhead(
        sft,
        "blade-relax",
        ["blade-relax@0.5", "torch-eager", "torch-eager-ckpt"],
        [32],
        pairs=MEMORY_VS_TIME,
        blocks=1,
        steps=1,
    )
    peaks = {r.config: r.step_peak_bytes for r in rows}
    assert set(peaks) == {
        "blade-relax",
        "blade-relax@0.5",
        "torch-eager",
        "torch-eager-ckpt",
    }
    assert all(r.median_ratio > 0 for r in rows)
    assert peaks["blade-relax@0.5"] <= peaks["blade-relax"]
    assert peaks["torch-eager-ckpt"] < peaks["torch-eager"]


def test_parse_pairs():
    assert parse_pairs("a@0.5:a, b:c") == {"a@0.5": "a", "b": "c"}
    assert parse_pairs("") == {}
    for bad in ("a", "a:", ":b", "a:b:c", "a:b,a:c"):
        with pytest.raises(ValueError, match="--pairs"):
            parse_pairs(bad)


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ({"torch-eager": REMAT}, "'torch-eager' is not among the configurations timed"),
        ({"no-such-config": REMAT}, "'no-such-config' is not among"),
        (
            {REMAT_BUDGET: "torch-eager"},
            "the base 'torch-eager' of 'blade-relax-schedule-remat@0.5'",
        ),
    ],
)
def test_bad_pairs_are_refused(workload, pairs, message):
    with pytest.raises(ValueError, match=message):
        measure_overhead(workload, "blade-relax-schedule", [REMAT, REMAT_BUDGET], [8], pairs=pairs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "torch-eager-ckpt", "--pairs", "torch-eager-ckpt:torch-eager"],
        ["--configs", REMAT, "--pairs", f"torch-eager:{REMAT}"],
        ["--configs", REMAT, "--pairs", REMAT],
    ],
)
def test_bad_pairs_exit_2(argv, capsys):
    argv = ["--workload", "llama-lora-sft", "--blocks", "1", "--steps", "1", *argv]
    assert main(argv) == 2
    assert "pairs" in capsys.readouterr().err


def test_old_names_are_timed_under_their_new_names(monkeypatch, capsys):
    from blade_relax.bench import configs

    monkeypatch.setattr(configs, "_WARNED", set())
    plan = overhead_module._plan(
        "blade-relax-full",
        ["blade-relax-full@0.5", "torch-eager"],
        {"blade-relax-full@0.5": "blade-relax-full"},
    )
    assert plan.timed == ["blade-relax", "blade-relax@0.5", "torch-eager"]
    assert [c.name for c in plan.configs] == plan.timed
    assert plan.bases == {
        "blade-relax": "blade-relax",
        "blade-relax@0.5": "blade-relax",
        "torch-eager": "blade-relax",
    }
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("the old name will be removed" in line for line in lines)


def test_the_default_times_rematerialize_against_the_schedule():
    import argparse

    seen = {}

    def parse(self, argv=None):
        seen.update(vars(original(self, argv)))
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse)
        with pytest.raises(SystemExit):
            main([])
    assert (seen["base"], seen["configs"]) == ("blade-relax-schedule", REMAT)

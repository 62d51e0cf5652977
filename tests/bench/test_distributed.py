"""The data-parallel bench at tiny sizes on 2 gloo processes."""

import pytest

pytest.importorskip("torch.distributed.fsdp")

from blade_relax.bench.distributed import RUNS, compare_data_parallel, format_table  # noqa: E402
from blade_relax.bench.workloads import ModelSizes  # noqa: E402

TINY = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)


def test_three_runs_per_length_agree():
    result = compare_data_parallel(TINY, [7, 20], rows=2, world=2)
    assert [row["length"] for row in result["rows"]] == [7, 20]
    assert result["runs"] == list(RUNS)
    for row in result["rows"]:
        for label in RUNS:
            assert row[f"{label}_peak"] > 0
            assert row[f"{label}_time_s"] > 0
        assert row["predicted_equals_measured"]
        # Per rank, the sharded step holds no more than DDP or FSDP2 (same sharding).
        assert row["blade_relax_peak"] <= min(row["torch-ddp_peak"], row["torch-fsdp2_peak"])
    assert result["max_loss_rel_diff"] < 1e-5
    assert "| 20 |" in format_table(result)


def _prediction(peaks: dict[str, list[int | None]]) -> dict:
    run = {label: {"persistent_bytes": 2**30, "peaks": p} for label, p in peaks.items()}
    return {
        "provenance": {
            "command": "python -m blade_relax.bench.distributed --predict",
            "commit": "abc1234",
            "date": "2026-11-29",
        },
        "world_size": 8,
        "rows_per_rank": 1,
        "lengths": [512, 2048],
        "llama-1.1b": run,
        "llama-7b-extrapolated": run,
    }


def test_predictions_print_both_placements_and_the_readme_the_lower():
    from blade_relax.bench import docs
    from blade_relax.bench.distributed import _extrapolated, format_prediction

    gib = 2**30
    result = _prediction(
        {
            "sharded": [3 * gib, 4 * gib],
            "one": [6 * gib, 8 * gib],
            "sharded-early": [2 * gib, None],
            "one-early": [5 * gib, 9 * gib],
        }
    )
    text = format_prediction(result)
    assert "| llama-1.1b | end | 512 | 3.00 | 6.00 | 0.500 |" in text
    assert "| llama-1.1b | early | 2048 | n/a | 9.00 | n/a |" in text
    line = docs.distributed_block(result).splitlines()[1]
    # Per length the lower placement; a refused extrapolation (None) is left out.
    assert "Llama 1.1B 2.00 / 4.00 GiB per rank (one process: 5.00 / 8.00)" in line
    assert "`python -m blade_relax.bench.distributed --predict` at commit `abc1234`" in line
    # The layers' line: exact for the bytes held, refused where the own peak falls.
    one, two = (
        {"x": {"persistent_bytes": held, "peaks": [held + own]}} for held, own in ((10, 5), (20, 3))
    )
    assert _extrapolated({1: one, 2: two}, 4) == {"x": {"persistent_bytes": 40, "peaks": [None]}}

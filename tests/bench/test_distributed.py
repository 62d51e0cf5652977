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

"""The compile-time bench: both pipelines lowered in child processes, one row per layer count."""

import dataclasses

import pytest

from blade_relax.bench import compile_time
from blade_relax.bench.workloads import SMALL

_SIZES = dataclasses.replace(SMALL, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64)


@pytest.fixture(scope="module")
def rows():
    # Three runs of each pipeline: the median tests read them, the others one row of medians.
    return compile_time.measure("llama-train", _SIZES, [1], repeat=3)


def test_rows_time_both_pipelines(rows):
    (row,) = rows
    assert row.layers == 1 and row.workload == "llama-train"
    for run in (row.stock, row.default):
        assert run.seconds > 0
        assert run.peak_rss >= run.start_rss > 0
    # The default pipeline adds passes, and the schedule/remat copies add bindings.
    assert row.default.bindings >= row.stock.bindings > 0
    assert row.ratio == row.default.seconds / row.stock.seconds


def test_table_has_a_row_per_layer_count(rows):
    text = compile_time.table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| 1 | ")
    assert lines[2].split("|")[6].strip() == "1.00"  # growth against itself


def test_cli_rejects_bad_layers(capsys):
    assert compile_time.main(["--layers", "0"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert compile_time.main(["--size", "huge"]) == 2


def test_repeated_runs_report_the_median_run(rows):
    (row,) = rows
    assert len(row.stock_runs) == len(row.default_runs) == 3
    assert row.stock.seconds == sorted(row.stock_runs)[1]
    assert row.default.seconds == sorted(row.default_runs)[1]
    assert row.ratio == row.default.seconds / row.stock.seconds
    with pytest.raises(ValueError, match="repeat"):
        compile_time.measure("llama-train", _SIZES, [1], repeat=0)
    assert compile_time.main(["--repeat", "0"]) == 2


def _hold_pages(send) -> None:
    import numpy as np

    block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB of pages of its own
    send.send(int(block.sum()))
    send.recv()


def test_memory_is_read_per_process_with_a_child_s_private_pages():
    import multiprocessing
    import os

    assert compile_time._resident_bytes(os.getpid()) > 0
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_hold_pages, args=(there,))
    child.start()
    try:
        assert here.recv() == 64 * 2**20
        assert child.pid in compile_time._children(os.getpid())
        # Pages written after the fork are the child's alone; those it shares are not counted.
        private = compile_time._private_bytes(child.pid)
        assert 64 * 2**20 <= private < compile_time._resident_bytes(child.pid)
    finally:
        here.send("done")
        child.join()
    assert compile_time._resident_bytes(child.pid) == 0
    assert compile_time._private_bytes(child.pid) == 0
    assert compile_time._children(child.pid) == []

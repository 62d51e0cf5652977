"""The predicted mode: every predicted peak is the peak the ruler measures, byte for byte."""

from __future__ import annotations

import dataclasses
import json

import pytest

from blade_relax.bench import main, run_benchmark
from blade_relax.bench.predict import NOT_PREDICTED, predict_benchmark

pytest.importorskip("transformers")

# Each kind of module a config compiles: bounded (dynamic), one bucket (specialized), the
# default pipeline with its range copies, the remat runtime's budget, PyTorch eager, and
# torch.compile (predicted with its kernels skipped).
CONFIGS = [
    "tvm-bounded",
    "tvm-bucketed@64",
    "blade-relax",
    "blade-relax@0.97",
    "torch-eager",
    "torch-compile",
]
LENGTHS = [12, 40]
# The command line on the Relax-native MLP: no export to wait for.
TINY_MLP = ["--workload", "mlp-train", "--hidden", "16", "--intermediate", "32", "--vocab", "8",
            "--layers", "1", "--max-seq-len", "48", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama():
    from blade_relax.bench.workloads import ModelSizes, build_workload

    sizes = ModelSizes(
        layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
    )
    return build_workload("llama-train", sizes)


@pytest.fixture(scope="module")
def both(tiny_llama):
    predicted = predict_benchmark(tiny_llama, CONFIGS, LENGTHS)
    measured = run_benchmark(tiny_llama, CONFIGS, LENGTHS, repeat=1)
    return predicted, measured


def test_every_predicted_peak_is_the_measured_one(both):
    predicted, measured = both
    guess = {(m.config, m.seq_len): m for m in predicted.measurements}
    assert len(guess) == len(measured.measurements) == len(CONFIGS) * len(LENGTHS)
    for real in measured.measurements:
        assert real.error is None and real.correct, real
        row = guess[(real.config, real.seq_len)]
        assert row.error is None and row.source == "predicted" and real.source == "measured"
        at = (real.config, real.seq_len)
        assert row.step_peak_bytes == real.step_peak_bytes, at
        assert row.peak_bytes == real.peak_bytes, at
        assert row.caller_bytes == real.caller_bytes, at
        assert row.lower_bound_bytes == real.lower_bound_bytes, at
        assert row.budget_bytes == real.budget_bytes, at
        assert row.unevictable_bytes == real.unevictable_bytes, at
        assert row.padded_to == real.padded_to, at
        assert row.compilations == real.compilations, at
        assert row.loss is None and row.correct is None


def test_the_budget_is_predicted_where_the_runtime_evicts(both):
    predicted, measured = both
    rows = {(m.config, m.seq_len): m for m in measured.measurements}
    guess = {(m.config, m.seq_len): m for m in predicted.measurements}
    # At s=40 the runtime evicts to meet the budget: the prediction follows it there.
    real = rows[("blade-relax@0.97", 40)]
    assert real.evictions > 0
    assert real.step_peak_bytes <= real.budget_bytes < rows[("blade-relax", 40)].step_peak_bytes
    assert guess[("blade-relax@0.97", 40)].step_peak_bytes == real.step_peak_bytes


def test_lowerings_are_counted_per_configuration(both):
    predicted, _ = both
    summary = {c.name: c for c in predicted.configs}
    assert summary["tvm-bounded"].compilations == 1
    assert summary["tvm-bucketed@64"].compilations == 1  # 12 and 40 share the bucket
    # The budgeted config reads the lowering of its reference, but needs it as its own.
    assert summary["blade-relax@0.97"].compilations == 1
    assert summary["blade-relax"].compile_time_s > 0
    assert summary["torch-eager"].compilations == 0
    assert summary["torch-compile"].compilations == 1  # dynamic: one graph for both lengths
    assert summary["torch-compile"].compile_time_s > 0


def test_the_command_line_predicts_every_config(tmp_path, capsys):
    out = tmp_path / "p.json"
    plot = tmp_path / "p.png"
    code = main(
        [*TINY_MLP, "--predict", "--lengths", "12,40", "--out", str(out), "--plot", str(plot),
         "--configs", "tvm-dynamic,tvm-static,torch-eager,torch-compile"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    assert plot.read_bytes()[:4] == b"\x89PNG"
    rows = {(r["config"], r["seq_len"]): r for r in doc["results"]}
    assert all(r["source"] == "predicted" for r in rows.values())
    for config in ("tvm-dynamic", "tvm-static", "torch-eager", "torch-compile"):
        assert rows[(config, 40)]["peak_bytes"] > rows[(config, 12)]["peak_bytes"], config
    assert "| tvm-static | " in text and "| 2 | " in text  # two lowerings, one per length
    compiled = [line for line in text.splitlines() if line.startswith("| torch-compile | ")]
    assert compiled and compiled[0].endswith("| predicted |"), compiled


def _result(peaks: dict[str, list[int]], trace: list[int]):
    from blade_relax.bench.runner import BenchResult, ConfigSummary, Measurement

    lengths = sorted(set(trace))
    return BenchResult(
        workload=None,
        target="llvm",
        lengths=lengths,
        trace={"lengths": trace},
        repeat=0,
        tolerance=0.0,
        configs=[ConfigSummary(name, "tvm", "", True) for name in peaks],
        measurements=[
            Measurement(name, n, peak_bytes=p, source="predicted")
            for name, values in peaks.items()
            for n, p in zip(lengths, values)
        ],
    )


def test_the_acceptance_check_counts_trace_entries_and_every_bucket():
    from blade_relax.bench.report import acceptance, acceptance_lines, over_trace

    # s = 10 appears 3 times in the trace: ours is above static there (3 of 5 entries).
    result = _result(
        {
            "blade-relax": [5, 9, 7],
            "tvm-static": [4, 9, 8],
            "tvm-bucketed@64": [6, 8, 9],
        },
        trace=[10, 10, 10, 20, 30],
    )
    check = acceptance(result)
    assert check.at_or_below_static == (2, 5) and check.static_share == 0.4
    assert check.above_buckets == {"tvm-bucketed@64": [20]}
    lines = acceptance_lines(result)
    assert lines[0].endswith("(40 %; target >= 95 %: NOT met)")
    assert lines[1] == "- blade-relax > tvm-bucketed@64 at s = 20"
    ours = over_trace(result)[0]
    assert ours.max_peak == 9 and ours.mean_peak == (5 * 3 + 9 + 7) / 5
    assert acceptance(_result({"tvm-static": [1]}, [10])) is None


def test_the_1b_preset_is_the_llama_2_architecture_at_1_1b_parameters():
    from blade_relax.bench.cli import _sizes, build_parser
    from blade_relax.bench.workloads import LLAMA_1B, llama_model

    sizes = _sizes(build_parser().parse_args(["--size", "1b", "--layers", "2"]))
    assert sizes == dataclasses.replace(LLAMA_1B, layers=2)
    assert (LLAMA_1B.hidden, LLAMA_1B.heads, LLAMA_1B.kv_heads) == (2048, 32, 4)
    # Counted on the meta device: the parameters of the whole model, nothing allocated.
    import torch

    with torch.device("meta"):
        model = llama_model(LLAMA_1B, weights="empty")
    count = sum(p.numel() for p in model.parameters())
    assert count == 1_100_048_384


def test_bfloat16_predictions_are_the_measured_peaks(tiny_llama):
    """The Llama in bfloat16: every product stays bfloat16 through the import, and the peaks
    predicted for TVM and for PyTorch eager are the ones measured, byte for byte."""
    from blade_relax.bench.workloads import ModelSizes, build_workload

    sizes = ModelSizes(
        layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64,
        dtype="bfloat16",
    )  # fmt: skip
    workload = build_workload("llama-train", sizes)
    assert {str(p.dtype) for p in workload.graph.params} == {"bfloat16"}
    configs = ["tvm-dynamic", "blade-relax", "blade-relax@0.97", "torch-eager"]
    predicted = predict_benchmark(workload, configs, [40])
    # bfloat16 keeps 8 bits of mantissa: TVM's kernels round differently from torch's. The
    # budgeted config runs blade-relax's executable (builds shared): one compile fewer.
    measured = run_benchmark(workload, configs, [40], repeat=1, tolerance=0.1, builds={})
    guess = {m.config: m for m in predicted.measurements}
    for real in measured.measurements:
        assert real.error is None and real.correct, real
        assert guess[real.config].step_peak_bytes == real.step_peak_bytes, real.config
    # The same Llama in float32.
    assert dataclasses.replace(sizes, dtype="float32") == tiny_llama.sizes
    single = predict_benchmark(tiny_llama, ["tvm-dynamic"], [40]).measurements[0]
    assert guess["tvm-dynamic"].step_peak_bytes < single.step_peak_bytes


def test_bfloat16_is_offered_for_the_hugging_face_workloads_only():
    from blade_relax.bench.cli import _sizes, build_parser
    from blade_relax.bench.workloads import ModelSizes, build_workload

    assert _sizes(build_parser().parse_args(["--dtype", "bfloat16"])).dtype == "bfloat16"
    with pytest.raises(ValueError, match="float32 only"):
        build_workload("mlp-train", ModelSizes(dtype="bfloat16"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_workload("llama-train", ModelSizes(dtype="float16"))


def test_torch_is_not_predicted_without_a_torch_module(tiny_llama):
    graph = dataclasses.replace(tiny_llama.graph, torch_module=None)
    workload = dataclasses.replace(tiny_llama, graph=graph)
    result = predict_benchmark(workload, ["torch-eager", "torch-compile"], [12])
    assert len(result.measurements) == 2
    for row in result.measurements:
        assert row.step_peak_bytes is None and row.error.startswith(NOT_PREDICTED), row


@pytest.mark.parametrize("name", ["llama-sft", "llama-lora-sft"])
def test_fine_tuning_predictions_are_the_measured_peaks(name):
    """Padded batches (symbolic b), a PEFT model rebuilt on the meta device with its adapters,
    Hugging Face checkpointing on the meta twin: predicted == measured, byte for byte."""
    from blade_relax.bench.workloads import ModelSizes, build_workload

    pytest.importorskip("peft")
    sizes = ModelSizes(
        layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=48
    )
    workload = build_workload(name, sizes)
    configs = ["blade-relax", "torch-eager", "torch-eager-ckpt"]
    predicted = predict_benchmark(workload, configs, [20, 48])
    measured = run_benchmark(workload, configs, [20, 48], repeat=1)
    guess = {(m.config, m.seq_len): m for m in predicted.measurements}
    for real in measured.measurements:
        assert real.error is None and real.correct, real
        row = guess[(real.config, real.seq_len)]
        assert row.error is None, row
        assert row.step_peak_bytes == real.step_peak_bytes, (real.config, real.seq_len)
        # The lower bound is evaluated at the batch's b too (b is symbolic here).
        assert real.lower_bound_bytes is not None
        assert row.lower_bound_bytes == real.lower_bound_bytes
    peaks = {(m.config, m.seq_len): m.step_peak_bytes for m in measured.measurements}
    assert peaks[("torch-eager-ckpt", 48)] < peaks[("torch-eager", 48)]

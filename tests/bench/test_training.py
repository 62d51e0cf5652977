"""The training-loop benchmark (``compare_training``) and ``blade-relax train`` at a tiny size.

One comparison runs for the module (a one-layer Llama, four steps): its checks against
PyTorch, the per-length table, the plot and the command line that prints them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from blade_relax import cli
from blade_relax.bench import training as training_bench
from blade_relax.bench.workloads import ModelSizes
from blade_relax.training import SGD, AdamW
from blade_relax.training.data import MarkovTokens, synthetic_batches
from blade_relax.training.trainer import TRAINER_UPDATES

TINY = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)


@pytest.fixture(scope="module")
def comparison():
    return training_bench.compare_training(
        "llama", size=TINY, steps=4, optimizer=AdamW(lr=1e-3), progress=False
    )


def test_losses_and_parameters_match_torch(comparison):
    assert comparison.max_loss_error < 1e-4
    assert comparison.max_param_error < 1e-4
    assert comparison.ours.compilations == 1
    assert [r.length for r in comparison.ours.records] == comparison.lengths
    assert comparison.lengths[-1] == TINY.max_seq_len  # the trace ends at the maximum


def test_table_takes_the_highest_peak_per_length(comparison):
    rows = comparison.by_length()
    assert [r["length"] for r in rows] == sorted(set(comparison.lengths))
    for row in rows:
        ours = [r.peak_bytes for r in comparison.ours.records if r.length == row["length"]]
        assert row["blade_relax"] == max(ours)
        assert row["ratio_torch-eager"] == row["blade_relax"] / row["torch-eager"]
    lines = training_bench.summary_lines(comparison)
    assert len(lines) == 1 + len(rows)
    assert "torch-eager" in lines[0]


def test_compiled_step_is_below_torch_at_every_length(comparison):
    for row in comparison.by_length():
        assert row["blade_relax"] < row["torch-eager"], row


def test_json_and_plot(comparison, tmp_path):
    data = json.loads(json.dumps(comparison.as_dict()))
    assert data["runs"][0]["label"] == "blade_relax"
    assert len(data["runs"][1]["steps"]) == 4
    pytest.importorskip("matplotlib")
    path = tmp_path / "train.png"
    training_bench.plot_training(comparison, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        training_bench.compare_training("bert", size=TINY, steps=1)


def test_command_prints_the_table_and_checks_the_losses(comparison, monkeypatch, capsys, tmp_path):
    calls = {}

    def fake(model, **kwargs):
        calls.update(kwargs, model=model)
        return comparison

    monkeypatch.setattr(training_bench, "compare_training", fake)
    out_json = tmp_path / "t.json"
    code = cli.main(
        ["train", "--steps", "4", "--no-plot", "--json", str(out_json), "--optimizer", "sgd"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert calls["model"] == "llama" and calls["steps"] == 4
    assert isinstance(calls["optimizer"], SGD)
    assert calls["updates"] == "end" == comparison.settings["updates"]
    for row in comparison.by_length():
        assert f"{row['blade_relax']:,}" in out
    assert json.loads(out_json.read_text())["max_loss_error"] == comparison.max_loss_error

    bad = training_bench.TrainingComparison(**{**comparison.__dict__, "max_loss_error": 1e-3})
    monkeypatch.setattr(training_bench, "compare_training", lambda model, **kw: bad)
    assert cli.main(["train", "--steps", "4", "--no-plot"]) == 1
    assert "check failed" in capsys.readouterr().err


def test_command_passes_each_placement_of_the_updates(comparison, monkeypatch, capsys):
    calls = {}

    def fake(model, **kwargs):
        calls.update(kwargs)
        return comparison

    monkeypatch.setattr(training_bench, "compare_training", fake)
    for updates in TRAINER_UPDATES:
        assert cli.main(["train", "--steps", "4", "--no-plot", "--updates", updates]) == 0
        assert calls["updates"] == updates
    capsys.readouterr()
    assert cli.main(["train", "--updates", "later"]) != 0
    assert "invalid choice: 'later'" in capsys.readouterr().err


def test_synthetic_tokens_follow_the_chain():
    chain = MarkovTokens(vocab=16, successors=2, noise=0.0, seed=3)
    table = chain.table()
    (batch,) = synthetic_batches(16, [40], seed=3)[:1]
    assert batch.shape == (1, 40) and batch.dtype == np.int64
    rng = np.random.default_rng(0)
    sample = chain.sample(50, 3, rng)
    for row in sample:
        for a, b in zip(row[:-1], row[1:]):
            assert b in table[a]
    with pytest.raises(ValueError):
        MarkovTokens(vocab=1)


# ------------------------------------------------------------------------------ fine-tuning
@pytest.fixture(scope="module")
def lora_comparison():
    """Three LoRA fine-tuning steps on padded (prompt, response) batches, left-padded, with
    PyTorch's eager loop and its gradient-checkpointed one beside blade_relax's."""
    return training_bench.compare_training(
        "llama",
        size=TINY,
        steps=3,
        optimizer=AdamW(lr=1e-2),
        lora=True,
        padding_side="left",
        torch_checkpointing=True,
        progress=False,
    )


def test_lora_fine_tuning_matches_torch(lora_comparison):
    result = lora_comparison
    assert result.settings["workload"] == "llama-lora-sft"
    assert result.max_loss_error < 1e-4
    assert result.max_param_error < 1e-4
    assert [run.label for run in result.torch_runs] == ["torch-eager", "torch-eager-ckpt"]
    eager, ckpt = result.torch_runs
    assert ckpt.losses == pytest.approx(eager.losses, rel=1e-5)
    assert 0 < result.settings["trainable_bytes"] < result.param_bytes
    assert result.lengths[-1] == TINY.max_seq_len
    assert "padded on the left" in result.settings["data"]


def test_lora_fine_tuning_holds_the_frozen_model_once(lora_comparison):
    """Persistent bytes: every parameter once, AdamW's two moments of the adapters only."""
    result = lora_comparison
    trainable = result.settings["trainable_bytes"]
    scalars = result.ours.persistent_bytes - result.param_bytes - 2 * trainable
    assert 0 < scalars <= 64


def test_command_passes_the_fine_tuning_flags(lora_comparison, monkeypatch, capsys):
    calls = {}

    def fake(model, **kwargs):
        calls.update(kwargs, model=model)
        return lora_comparison

    monkeypatch.setattr(training_bench, "compare_training", fake)
    argv = ["train", "--lora", "--batch", "2", "--dtype", "bf16", "--padding", "left"]
    assert cli.main([*argv, "--torch-ckpt", "--steps", "3", "--no-plot"]) == 0
    assert calls["lora"] and calls["sft"] and calls["torch_checkpointing"]
    assert calls["padding_side"] == "left"
    assert calls["size"].batch == 2
    assert (calls["size"].dtype, calls["size"].autocast) == ("float32", "bfloat16")
    out = capsys.readouterr().out
    assert "trained, the rest frozen" in out
    assert "torch-eager-ckpt" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sft", "--model", "gpt2"], "fine-tune --model llama, not gpt2"),
        (["--lora", "--batch", "0"], "--batch must be positive"),
    ],
)
def test_command_refuses_bad_fine_tuning_flags(argv, message, capsys):
    assert cli.main(["train", *argv, "--no-plot"]) == 2
    assert message in capsys.readouterr().err

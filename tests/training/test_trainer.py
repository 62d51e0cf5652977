"""The training loop (``Trainer``, ``fit``) against PyTorch's, and how it treats bad input.

A tiny Llama (``llama-train``, torch export) trains with AdamW over batches of varying length,
compiled once by the full blade_relax pipeline: every loss and the final parameters equal those
of ``torch_fit`` (the same loop with ``torch.optim``); the peaks it reports are consistent and
deterministic; a memory budget (relative or in bytes) changes neither losses nor parameters;
a bad batch raises before any kernel runs and leaves parameters and state untouched; ``fit``
refuses empty input and bad arguments; the progress bar shows the loss. A Relax-native MLP
checks ``fit`` itself with SGD, a learning-rate schedule and mapping batches.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import tvm

from blade_relax import get_pipeline
from blade_relax.bench.workloads import ModelSizes, build_workload
from blade_relax.frontend import DimOutOfRangeError
from blade_relax.runtime import RematBudgetWarning
from blade_relax.training import (
    SGD,
    AdamW,
    Trainer,
    as_batch,
    check_batch,
    fit,
    torch_fit,
)

SIZES = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)
# Steps 2 and 5 share a length (12); 32 is the exported maximum.
LENGTHS = (5, 12, 32, 7, 12)


def _adamw() -> AdamW:
    return AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


def _ids(lengths, seed: int = 0, dtype: str = "int64") -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SIZES.vocab, size=(SIZES.batch, n)).astype(dtype) for n in lengths]


def _rel_norm(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.fixture(scope="module")
def graph():
    return build_workload("llama-train", SIZES).graph


@pytest.fixture(scope="module")
def run(graph):
    """Five AdamW steps, blade_relax's loop and torch's, from the same start and batches."""
    trainer = Trainer(graph, _adamw())
    history = trainer.fit(_ids(LENGTHS), progress=False)
    reference = torch_fit(graph, _adamw(), _ids(LENGTHS))
    return SimpleNamespace(
        trainer=trainer,
        history=history,
        parameters=trainer.parameters(),
        state=trainer.state(),
        reference=reference,
    )


def _twin(graph, run, optimizer=None) -> Trainer:
    """A fresh trainer (graph's parameters, zero state) reusing the module's compiled step
    (compiling the Llama again would double this file's time)."""
    trainer = Trainer(graph, optimizer or _adamw())
    trainer.executable = run.trainer.executable
    return trainer


# ---------------------------------------------------------------------------------- numerics


def test_losses_and_parameters_match_torch(run, graph):
    history, reference = run.history, run.reference
    assert history.lengths == list(LENGTHS) == reference.lengths
    assert [r.step for r in history.records] == list(range(1, len(LENGTHS) + 1))
    assert history.compilations == 1 and run.trainer.compilations == 1
    for step, (got, want) in enumerate(zip(history.losses, reference.losses), start=1):
        assert got == pytest.approx(want, rel=1e-4), f"step {step}"
    # The model trained: its loss on a repeated length moved.
    assert history.losses[1] != history.losses[4]
    assert len(run.parameters) == len(reference.parameters) == len(graph.param_names)
    for name, got, want, start in zip(
        graph.param_names, run.parameters, reference.parameters, graph.params
    ):
        assert got.shape == want.shape, name
        assert _rel_norm(got, want) <= 1e-4, name
        assert not np.array_equal(got, start), name


def test_state_has_one_moment_pair_per_parameter(run, graph):
    names = run.trainer.step_ir.state_names
    assert len(run.state) == len(names) == 2 * len(graph.param_names)
    assert names[:2] == [f"exp_avg:{graph.param_names[0]}", f"exp_avg_sq:{graph.param_names[0]}"]
    second_moments = run.state[1::2]
    assert all((v >= 0).all() and v.any() for v in second_moments)


# ---------------------------------------------------------------------------------- peaks


def test_peaks_are_persistent_plus_step_peak(run):
    trainer, history = run.trainer, run.history
    expected_persistent = (
        sum(p.nbytes for p in trainer.parameters())
        + sum(s.nbytes for s in trainer.state())
        + 4 * trainer.optimizer.num_scalars
    )
    assert history.persistent_bytes == trainer.persistent_bytes == expected_persistent
    for record in history.records:
        assert record.step_peak_bytes > 0
        assert record.peak_bytes == history.persistent_bytes + record.step_peak_bytes
        assert record.evictions == 0 and record.regenerations == 0  # no budget
    by_length = {}
    for record in history.records:
        by_length.setdefault(record.length, []).append(record.peak_bytes)
    assert len(set(by_length[12])) == 1, by_length  # the same length, the same peak
    assert by_length[32][0] > by_length[5][0]  # a longer sequence needs more


def test_peaks_are_deterministic_across_calls(run):
    trainer = run.trainer
    first = trainer.step(_ids((9,), seed=5)[0])
    second = trainer.step(_ids((9,), seed=6)[0])
    assert first.step + 1 == second.step
    assert first.peak_bytes == second.peak_bytes
    assert first.step_peak_bytes == second.step_peak_bytes


def test_a_step_does_not_collect_and_peaks_as_without_garbage(graph, run, monkeypatch):
    """A step reads only its own bytes, which garbage of earlier calls cannot change: it runs
    no full collection (0.5 s with a Hugging Face model imported), even while a VM result only
    a reference cycle holds is live, and peaks as it does without that garbage."""
    import gc

    from tvm import relax

    trainer = _twin(graph, run)
    batch = _ids((9,), seed=5)[0]
    clean = trainer.step(batch)
    vm = relax.VirtualMachine(trainer.executable, trainer.device)
    arrays = [tvm.runtime.tensor(a, trainer.device) for a in as_batch(graph, batch)]
    scalars = tvm.runtime.tensor(trainer.optimizer.scalars(1), trainer.device)
    cycle: list = [vm["main"](*arrays, *trainer.params, *trainer.states, scalars), vm]
    cycle.append(cycle)
    del vm, cycle
    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or collect(*args))
    gc.disable()
    try:
        with_garbage = trainer.step(batch)
    finally:
        gc.enable()
    assert collections == []
    assert with_garbage.step_peak_bytes == clean.step_peak_bytes
    assert with_garbage.peak_bytes == clean.peak_bytes


# ---------------------------------------------------------------------------------- bad input


def _bad_batches():
    good = _ids((6,))[0]
    too_high = good.copy()
    too_high[0, 3] = SIZES.vocab
    negative = good.copy()
    negative[0, 1] = -5
    # The graph is import_training_step's, at the model's position limit, batch 1.
    limit = SIZES.max_seq_len
    return [
        ("too-long", _ids((limit + 1,))[0], DimOutOfRangeError, f"position limit is {limit}"),
        ("too-short", _ids((1,))[0], DimOutOfRangeError, "lower bound s >= 2; pad the sequence"),
        ("float", good.astype("float32"), TypeError, "float32, but it holds integers"),
        ("float-labels", [good, good.astype("float64")], TypeError, "'labels' has dtype float64"),
        ("torch-float", torch.from_numpy(good).float(), TypeError, "float32"),
        ("bool-ids", good > 3, TypeError, "bool"),
        ("id-outside-vocab", too_high, ValueError, f"outside \\[0, {SIZES.vocab}\\)"),
        ("int32-outside-vocab", too_high.astype("int32"), ValueError, f"vocab_size {SIZES.vocab}"),
        ("uint64-beyond-int64", np.full((1, 6), 2**63, "uint64"), ValueError, "cannot hold"),
        ("negative-id", negative, ValueError, "-5"),
        ("three-arrays", [good, good, good], ValueError, "2 arrays"),
        ("one-array", [good], ValueError, "2 arrays"),
        ("unknown-name", {"input_ids": good, "mask": good}, ValueError, "mask"),
        ("lengths-disagree", [good, _ids((7,))[0]], ValueError, "'s'"),
        (
            "batch-of-two",
            np.concatenate([good, good]),
            ValueError,
            "input 'input_ids' axis 0 \\(batch\\) is 2, but the step was imported for batch 1: "
            "pass max_batch_size=2 \\(or more\\) to import_training_step",
        ),
        ("one-sequence", good[0], ValueError, "expected rank 2 \\(batch, sequence length\\)"),
        ("not-a-batch", 3.5, TypeError, "float"),
    ]


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [pytest.param(b, e, m, id=name) for name, b, e, m in _bad_batches()],
)
def test_bad_batch_changes_nothing(run, batch, error, match):
    trainer = run.trainer
    params, state, done = trainer.parameters(), trainer.state(), trainer.steps_done
    with pytest.raises(error, match=match):
        trainer.step(batch)
    assert trainer.steps_done == done
    for before, after in zip(params + state, trainer.parameters() + trainer.state()):
        np.testing.assert_array_equal(before, after)


def test_out_of_range_length_is_a_value_error():
    assert issubclass(DimOutOfRangeError, ValueError)


def test_bad_batch_in_fit_stops_after_the_good_ones(run):
    trainer = run.trainer
    done = trainer.steps_done
    bad = _ids((SIZES.max_seq_len + 1,))[0]
    with pytest.raises(DimOutOfRangeError):
        trainer.fit([_ids((4,))[0], bad, _ids((4,))[0]], progress=False)
    assert trainer.steps_done == done + 1
    params = trainer.parameters()
    with pytest.raises(ValueError, match="outside"):
        trainer.fit([np.full((1, 4), SIZES.vocab, "int64")], progress=False)
    for before, after in zip(params, trainer.parameters()):
        np.testing.assert_array_equal(before, after)


def test_ignored_labels_are_accepted(run):
    ids = _ids((6,), seed=7)[0]
    labels = ids.copy()
    labels[0, :2] = -100
    record = run.trainer.step({"input_ids": ids, "labels": labels})
    assert np.isfinite(record.loss)


def test_int32_batches_train_as_int64_batches_do(graph, run):
    """Token ids and labels of any integer dtype (numpy or torch) are cast losslessly: the same
    steps, bit for bit, as with int64."""
    wide, narrow = _twin(graph, run), _twin(graph, run)
    batches = _ids((6, 11), seed=21)
    labels = [b.copy() for b in batches]
    labels[1][0, :3] = -100
    want = [wide.step({"input_ids": b, "labels": y}) for b, y in zip(batches, labels)]
    given = [
        batches[0].astype("int32"),  # the ids, also the labels
        {"input_ids": torch.from_numpy(batches[1]).int(), "labels": labels[1].astype("int16")},
    ]
    got = [narrow.step(b) for b in given]
    assert [r.loss for r in got] == [r.loss for r in want]
    for before, after in zip(
        wide.parameters() + wide.state(), narrow.parameters() + narrow.state()
    ):
        np.testing.assert_array_equal(before, after)
    assert not np.array_equal(narrow.parameters()[0], graph.params[0])  # it trained
    ignored = batches[0].copy()
    ignored[0, :2] = -100
    arrays = as_batch(graph, [batches[0].astype("uint8"), torch.from_numpy(ignored).int()])
    assert [a.dtype for a in arrays] == [np.dtype("int64")] * 2
    np.testing.assert_array_equal(arrays[0], batches[0])
    np.testing.assert_array_equal(arrays[1], ignored)


def test_as_batch_forms(graph):
    ids = _ids((6,))[0]
    for batch in (ids, {"input_ids": ids}, [ids, ids], torch.from_numpy(ids)):
        arrays = as_batch(graph, batch)
        assert len(arrays) == 2
        assert all(np.array_equal(a, ids) for a in arrays)
    assert check_batch(graph, as_batch(graph, ids)) == {"s": 6}


# ---------------------------------------------------------------------------------- fit arguments


def test_fit_refuses_empty_input_and_bad_steps(run):
    trainer = run.trainer
    done, params = trainer.steps_done, trainer.parameters()
    with pytest.raises(ValueError, match="empty"):
        trainer.fit(iter([]), progress=False)
    with pytest.raises(ValueError, match="empty"):
        trainer.fit([], progress=False)
    for steps in (0, -1):
        with pytest.raises(ValueError, match="steps"):
            trainer.fit(_ids((4,)), steps=steps, progress=False)
    with pytest.raises(ValueError, match="budget"):
        trainer.fit(_ids((4,)), budget=-1, progress=False)
    assert trainer.steps_done == done
    for before, after in zip(params, trainer.parameters()):
        np.testing.assert_array_equal(before, after)


def test_fit_stops_after_steps(run):
    trainer = run.trainer
    done = trainer.steps_done
    history = trainer.fit(_ids((4, 5, 6, 7)), steps=2, progress=False)
    assert history.lengths == [4, 5]
    assert [r.step for r in history.records] == [done + 1, done + 2]
    assert history.compilations == 1


# ---------------------------------------------------------------------------------- budgets


def _budgeted_run(graph, run, budget_of):
    """The same three steps without and with a budget, from the same start."""
    plain, budgeted = _twin(graph, run), _twin(graph, run)
    records = []
    with warnings.catch_warnings():
        # A budget below what eviction can reach runs at the smallest reachable peak.
        warnings.simplefilter("ignore", RematBudgetWarning)
        for batch in _ids((32, 8, 32), seed=11):
            reference = plain.step(batch)
            records.append((reference, budgeted.step(batch, budget=budget_of(reference))))
    return plain, budgeted, records


@pytest.mark.parametrize(
    "budget_of",
    [
        pytest.param(lambda reference: 0.5, id="fraction"),
        pytest.param(lambda reference: int(0.6 * reference.step_peak_bytes), id="bytes"),
    ],
)
def test_budget_changes_no_loss_and_no_parameter(graph, run, budget_of):
    plain, budgeted, records = _budgeted_run(graph, run, budget_of)
    for reference, record in records:
        assert record.loss == reference.loss  # bitwise: eviction recomputes the same values
        assert record.length == reference.length and record.step == reference.step
        assert record.peak_bytes == budgeted.persistent_bytes + record.step_peak_bytes
    # Otherwise the equalities above would say nothing about rematerialization.
    assert sum(record.evictions for _, record in records) > 0
    for before, after in zip(
        plain.parameters() + plain.state(), budgeted.parameters() + budgeted.state()
    ):
        np.testing.assert_array_equal(before, after)


def test_fit_with_a_budget_matches_fit_without(graph, run):
    plain, budgeted = _twin(graph, run), _twin(graph, run)
    batches = _ids((32, 16), seed=12)
    want = plain.fit(batches, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematBudgetWarning)
        got = budgeted.fit(batches, budget=0.5, progress=False)
    assert got.losses == want.losses
    assert sum(r.evictions for r in got.records) > 0  # the budget made it evict
    assert not any(r.evictions for r in want.records)


@pytest.mark.parametrize(
    ("budget", "error"),
    [
        (-1, ValueError),
        (0, ValueError),
        (0.0, ValueError),
        (1.5, ValueError),
        (-0.5, ValueError),
        (True, TypeError),
        ("1", TypeError),
    ],
)
def test_bad_budget_raises_before_running(run, budget, error):
    trainer = run.trainer
    done, params = trainer.steps_done, trainer.parameters()
    with pytest.raises(error, match="budget"):
        trainer.step(_ids((4,))[0], budget=budget)
    assert trainer.steps_done == done
    for before, after in zip(params, trainer.parameters()):
        np.testing.assert_array_equal(before, after)


# ---------------------------------------------------------------------------------- progress


def test_progress_bar_shows_the_loss(run, capsys):
    pytest.importorskip("tqdm")
    history = run.trainer.fit(_ids((4, 6), seed=13), progress=True)
    err = capsys.readouterr().err
    assert "train" in err and "loss" in err
    assert f"{history.records[-1].loss:.4f}" in err
    run.trainer.fit(_ids((4,), seed=14), progress=False)
    assert "loss" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------- fit, MLP


MLP_SIZES = ModelSizes(layers=1, hidden=8, intermediate=16, vocab=6, max_seq_len=16)


def test_fit_function_with_sgd_and_a_schedule_matches_torch():
    graph = build_workload("mlp-train", MLP_SIZES).graph

    def make():
        return SGD(lr=0.05, momentum=0.9, lr_schedule=lambda step: 0.05 / step)

    batches = [graph.random_inputs({"s": n}, seed=n) for n in (3, 9, 16, 3)]
    mappings = [dict(zip(graph.input_names, b)) for b in batches]
    history = fit(graph, mappings, optimizer=make(), progress=False)
    reference = torch_fit(graph, make(), batches)
    assert history.compilations == 1 and history.label == "blade_relax"
    assert history.lengths == [3, 9, 16, 3] == reference.lengths
    np.testing.assert_allclose(history.losses, reference.losses, rtol=1e-5)
    # fit returns no parameters: a Trainer on the same batches gives them.
    trainer = Trainer(graph, make())
    trainer.fit(batches, progress=False)
    for got, want in zip(trainer.parameters(), reference.parameters):
        assert _rel_norm(got, want) <= 1e-5


def test_auto_updates_run_the_placement_predicted_lower_at_each_length(graph, run, monkeypatch):
    """``updates="auto"``: both placements compiled, each batch run by the one whose predicted
    peak is lower at its length (here the end up to 7 tokens, early beyond); the same losses
    and parameters as updates at the end, and each step's peak the lower prediction. The
    predictions read the memory stage each compilation kept: no step is lowered again."""
    from blade_relax.training import step_peak

    def lowered_again(*_args, **_kwargs):
        raise AssertionError("a compiled step was lowered again to predict its peak")

    trainer = Trainer(graph, _adamw(), updates="auto")
    trainer.compile()
    monkeypatch.setattr(step_peak, "lower_step", lowered_again)
    assert set(trainer.steps_ir) == {"end", "early"}
    history = trainer.fit(_ids(LENGTHS), progress=False)
    assert history.compilations == 2
    # Each version's timeline was built once, for the first length it ran.
    from blade_relax import analysis

    monkeypatch.setattr(analysis, "memory_timeline", lowered_again)
    chosen = []
    for record in history.records:
        peaks = trainer.predicted_peaks({"s": record.length})
        lower = min(peaks.values())
        assert record.updates == ("end" if peaks["end"] == lower else "early")
        assert record.peak_bytes == lower == trainer.predicted_peak({"s": record.length})
        chosen.append(record.updates)
    assert set(chosen) == {"end", "early"}, chosen
    np.testing.assert_allclose(history.losses, run.history.losses, rtol=1e-5)
    for got, want in zip(trainer.parameters(), run.parameters):
        assert _rel_norm(got, want) <= 1e-5
    assert {r.updates for r in run.history.records} == {"end"}


def test_auto_updates_need_a_graph_and_the_default_pipeline(graph, run):
    with pytest.raises(ValueError, match="not a TrainingStep"):
        Trainer(run.trainer.step_ir, updates="auto")
    with pytest.raises(ValueError, match="pipeline of your own"):
        Trainer(graph, _adamw(), updates="auto", pipeline=get_pipeline("llvm"))
    with pytest.raises(ValueError, match="updates must be one of"):
        Trainer(graph, _adamw(), updates="later")


def test_torch_fit_needs_a_torch_graph():
    graph = build_workload("mlp-train", MLP_SIZES).graph
    bare = dataclasses.replace(graph, torch_module=None, torch_params=None)
    with pytest.raises(ValueError, match="torch"):
        torch_fit(bare, _adamw(), [graph.random_inputs({"s": 4})])


def test_early_updates_train_alike_and_peak_as_predicted(graph, run):
    """``updates="early"``: each gradient is applied where it is complete; the same losses and
    parameters as updates at the end, and the peak the timeline predicts."""
    trainer = Trainer(graph, _adamw(), updates="early")
    assert trainer.step_ir.updates == "early"
    history = trainer.fit(_ids(LENGTHS), progress=False)
    np.testing.assert_allclose(history.losses, run.history.losses, rtol=1e-5)
    for got, want in zip(trainer.parameters(), run.parameters):
        assert _rel_norm(got, want) <= 1e-5
    predicted = [trainer.predicted_peak({"s": n}) for n in LENGTHS]
    assert history.peaks == predicted
    with pytest.raises(ValueError, match="places its updates"):
        Trainer(run.trainer.step_ir, updates="early")

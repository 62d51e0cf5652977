"""The Trainer takes what ``transformers`` data collators yield, and refuses bad batches.

A tiny Llama imported with ``attention_mask`` (symbolic ``b`` and ``s``) trains on batches made
by ``DataCollatorForSeq2Seq`` and ``DataCollatorWithPadding`` from a tokenizer built here (a
word-level ``tokenizers`` model: nothing is downloaded), as torch tensors and as numpy arrays,
padded on either side; its losses and parameters equal PyTorch's loop on the same batches. A
bad batch raises one clear error before any kernel runs and leaves parameters and state as they
were. A step imported without ``attention_mask`` takes a padded batch only where the mask
changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from blade_relax.bench.workloads import ModelSizes, build_workload, llama_model
from blade_relax.frontend import DimOutOfRangeError, import_training_step
from blade_relax.training import AdamW, Trainer, as_batch, torch_fit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SIZES = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)
MAX_BATCH = 4


def _tokenizer(padding_side: str):
    vocab = {f"t{i}": i for i in range(SIZES.vocab)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t1"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="t0", unk_token="t1"
    )
    fast.padding_side = padding_side
    return fast


def _features(lengths, prompts, seed):
    """Tokenized (prompt, response) examples: labels -100 on the prompt."""
    rng = np.random.default_rng(seed)
    features = []
    for n, p in zip(lengths, prompts):
        ids = rng.integers(2, SIZES.vocab, size=n).tolist()
        features.append(
            {"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] * p + ids[p:]}
        )
    return features


def _seq2seq_batches(padding_side: str, return_tensors: str):
    collate = transformers.DataCollatorForSeq2Seq(
        _tokenizer(padding_side),
        padding=True,
        label_pad_token_id=-100,
        return_tensors=return_tensors,
    )
    return [
        collate(_features([9, 4, 13], [3, 1, 5], seed=1)),
        collate(_features([20, 7], [2, 6], seed=2)),
        collate(_features([5, 5, 11, 3], [1, 2, 4, 1], seed=3)),
    ]


def _adamw() -> AdamW:
    return AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


@pytest.fixture(scope="module")
def graph():
    return import_training_step(
        llama_model(SIZES),
        max_seq_len=SIZES.max_seq_len,
        max_batch_size=MAX_BATCH,
        attention_mask=True,
    )


@pytest.fixture(scope="module")
def compiled(graph):
    trainer = Trainer(graph, _adamw())
    trainer.compile()
    return trainer.executable


def _trainer(graph, compiled) -> Trainer:
    trainer = Trainer(graph, _adamw())
    trainer.executable = compiled
    return trainer


def _relative(got, want) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize(("side", "tensors"), [("left", "pt"), ("right", "np")])
def test_collator_batches_train_as_torch_does(graph, compiled, side, tensors):
    batches = _seq2seq_batches(side, tensors)
    trainer = _trainer(graph, compiled)
    history = trainer.fit(batches, progress=False)
    reference = torch_fit(graph, _adamw(), batches)
    assert history.losses == pytest.approx(reference.losses, rel=1e-5)
    assert history.lengths == [13, 20, 11]
    # AdamW normalises each coordinate's step: where a gradient is rounding noise (the
    # embedding rows of tokens seen once), float32 noise moves the parameter by up to lr.
    for got, want in zip(trainer.parameters(), reference.parameters):
        assert _relative(got, want) < 1e-3


def test_first_loss_is_the_models_own_on_the_padded_batch(graph, compiled):
    batch = _seq2seq_batches("left", "pt")[0]
    record = _trainer(graph, compiled).step(batch)
    inputs = [batch[name].numpy() for name in graph.input_names]
    assert record.loss == pytest.approx(float(graph.reference(inputs)[0]), rel=1e-5)


def test_a_batch_without_labels_takes_the_ids_where_the_mask_is_one(graph):
    collate = transformers.DataCollatorWithPadding(_tokenizer("left"), return_tensors="np")
    batch = collate([{"input_ids": [3, 4, 5, 6]}, {"input_ids": [7, 8]}])
    ids, mask, labels = as_batch(graph, batch)
    np.testing.assert_array_equal(labels, np.where(mask == 1, ids, -100))
    assert labels[1, :2].tolist() == [-100, -100]


def _bad_batches():
    good = _seq2seq_batches("right", "np")[0]
    mask_two = {**good, "attention_mask": good["attention_mask"] * 2}
    unlabelled = {**good, "labels": np.full_like(good["labels"], -100)}
    short_mask = {**good, "attention_mask": good["attention_mask"][:, :-1]}
    five = {k: np.concatenate([v, v[:2]]) for k, v in good.items()}
    extra = {**good, "token_type_ids": np.zeros_like(good["input_ids"])}
    label_out = {**good, "labels": np.where(good["labels"] >= 0, SIZES.vocab, -100)}
    return [
        ("mask-of-two", mask_two, ValueError, "attention_mask' holds 2"),
        ("no-counted-label", unlabelled, ValueError, "counts no token"),
        ("mask-shorter", short_mask, ValueError, "axis 1"),
        (
            "batch-of-five",
            five,
            DimOutOfRangeError,
            "batch size b = 5 exceeds the exported upper bound b <= 4 .*; pass "
            "max_batch_size=5 \\(or more\\) to import_training_step",
        ),
        (
            "float-mask",
            {**good, "attention_mask": good["attention_mask"] * 1.0},
            TypeError,
            "float",
        ),
        ("unknown-key", extra, ValueError, "token_type_ids"),
        ("label-outside-vocab", label_out, ValueError, "outside"),
    ]


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [pytest.param(b, e, m, id=name) for name, b, e, m in _bad_batches()],
)
def test_bad_batch_changes_nothing(graph, compiled, batch, error, match):
    trainer = _trainer(graph, compiled)
    params, state = trainer.parameters(), trainer.state()
    with pytest.raises(error, match=match):
        trainer.step(batch)
    assert trainer.steps_done == 0
    for before, after in zip(params + state, trainer.parameters() + trainer.state()):
        np.testing.assert_array_equal(before, after)


@pytest.fixture(scope="module")
def unmasked():
    return build_workload("llama-train", SIZES).graph


def test_unmasked_step_refuses_a_mask_that_matters(unmasked):
    (left,) = _seq2seq_batches("left", "np")[:1]
    one = {k: v[:1] for k, v in left.items()}  # batch of one: the step's static batch
    one["attention_mask"] = one["attention_mask"].copy()
    one["attention_mask"][0, 0] = 0
    with pytest.raises(ValueError, match="would attend to the padding"):
        as_batch(unmasked, one)


def test_unmasked_step_takes_a_mask_that_changes_nothing(unmasked):
    right = _seq2seq_batches("right", "np")[1]
    row = {k: v[1:2] for k, v in right.items()}  # right-padded, labels -100 on the padding
    assert (row["attention_mask"] == 0).any()
    ids, labels = as_batch(unmasked, row)
    np.testing.assert_array_equal(ids, row["input_ids"])
    np.testing.assert_array_equal(labels, row["labels"])
    ones = {"input_ids": row["input_ids"], "attention_mask": np.ones_like(row["input_ids"])}
    assert len(as_batch(unmasked, ones)) == 2


def test_int32_collator_batches_train_as_int64_ones_do(graph, compiled):
    """int32 ids, mask and labels (torch or numpy) are cast losslessly: the same steps, bit for
    bit, as int64."""
    batches = _seq2seq_batches("left", "np")[:2]
    narrow = [
        {k: torch.from_numpy(v).int() for k, v in batches[0].items()},
        {k: v.astype("int32") for k, v in batches[1].items()},
    ]
    wide, cast = _trainer(graph, compiled), _trainer(graph, compiled)
    want = [wide.step(b).loss for b in batches]
    assert [cast.step(b).loss for b in narrow] == want
    for before, after in zip(wide.parameters() + wide.state(), cast.parameters() + cast.state()):
        np.testing.assert_array_equal(before, after)
    assert not np.array_equal(cast.parameters()[0], graph.params[0])  # it trained


def test_trainer_imports_a_hugging_face_model_with_its_mask():
    trainer = Trainer(llama_model(SIZES), max_seq_len=16, max_batch_size=2)
    assert trainer.graph.input_names == ["input_ids", "attention_mask", "labels"]
    assert trainer.graph.dims["b"].upper == 2
    assert trainer.graph.dims["s"].upper == 16
    # Errors name the Trainer's own options (checked before anything compiles).
    ids = np.ones((3, 8), "int32")
    with pytest.raises(DimOutOfRangeError, match="pass max_batch_size=3 .* to Trainer"):
        trainer.step(ids)
    with pytest.raises(
        DimOutOfRangeError,
        match=f"pass max_seq_len=20 \\(or more, at most {SIZES.max_seq_len}, the model's "
        "position limit\\) to Trainer",
    ):
        trainer.step(np.ones((1, 20), "int32"))
    assert trainer.executable is None and trainer.steps_done == 0

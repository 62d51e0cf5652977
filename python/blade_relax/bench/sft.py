"""Supervised fine-tuning batches: (prompt, response) pairs padded as data collators pad them.

Instruction-tuning data (CodeAlpaca-20K, Alpaca, Dolly) is a prompt (instruction and input)
followed by a response; the loss counts the response only. With a Llama tokenizer, CodeAlpaca's
prompts have a median of about 20-30 tokens and its responses about 50-70, both with a long
tail. :func:`sft_trace` imitates that at any scale with two seeded log-normals: prompts of
median ``max_len / 16``, responses of median ``max_len / 8``, ``sigma = 0.8`` each; a pair
longer than ``max_len`` is cut in its response (at least one response token stays). Pairs are
grouped ``batch`` to a step, and the last step always holds one pair of exactly ``max_len``
tokens, so every run reaches the bound (as :func:`.trace.length_trace` does).

:func:`pad_batch` turns a step's pairs into what ``transformers.DataCollatorForSeq2Seq`` yields
for a causal LM: ``input_ids`` padded to the longest pair (with ``pad_id``, on the left or the
right), ``attention_mask`` 1 on tokens and 0 on padding, ``labels`` equal to the ids on the
response and ``-100`` on the prompt and the padding. The token ids are seeded per step: the same
arguments give the same batches on every machine, for every configuration of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..training.trainer import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "SftTrace", "pad_batch", "pairs_at", "sft_trace"]

PROMPT_MEDIAN_FRACTION = 1 / 16
RESPONSE_MEDIAN_FRACTION = 1 / 8
SIGMA = 0.8
PADDING_SIDES = ("right", "left")


@dataclass(frozen=True)
class SftTrace:
    """A seeded fine-tuning trace: ``batch`` (prompt, response) pairs a step.

    Attributes
    ----------
    steps
        Per step, its pairs ``(prompt_len, response_len)``.
    seed, batch, min_len, max_len
        The arguments that produced it.
    distribution
        A one-line description, for the JSON output.
    """

    steps: tuple[tuple[tuple[int, int], ...], ...]
    seed: int
    batch: int
    min_len: int
    max_len: int
    distribution: str

    @property
    def lengths(self) -> list[int]:
        """Per step, the padded length: the longest pair of the step."""
        return [max(p + r for p, r in pairs) for pairs in self.steps]

    @property
    def unique(self) -> list[int]:
        """Distinct padded lengths, ascending."""
        return sorted(set(self.lengths))

    def pairs_at(self, length: int) -> tuple[tuple[int, int], ...]:
        """The pairs of the first step padded to ``length``."""
        for pairs, padded in zip(self.steps, self.lengths):
            if padded == length:
                return pairs
        raise ValueError(f"no step of the trace pads to {length}; its lengths are {self.unique}")


def sft_trace(steps: int, batch: int, min_len: int, max_len: int, seed: int = 0) -> SftTrace:
    """``steps`` steps of ``batch`` (prompt, response) pairs within ``[min_len, max_len]``.

    Parameters
    ----------
    steps
        Number of steps (>= 1).
    batch
        Pairs a step (>= 1).
    min_len, max_len
        Shortest and longest pair (prompt plus response, tokens); ``min_len >= 2``.
    seed
        Seed of the generator.
    """
    if steps < 1 or batch < 1:
        raise ValueError(f"a trace needs steps >= 1 and batch >= 1, got {steps}, {batch}")
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    prompt_median = max(1.0, max_len * PROMPT_MEDIAN_FRACTION)
    response_median = max(1.0, max_len * RESPONSE_MEDIAN_FRACTION)
    count = steps * batch
    prompts = rng.lognormal(np.log(prompt_median), SIGMA, size=count)
    responses = rng.lognormal(np.log(response_median), SIGMA, size=count)
    pairs = [_pair(p, r, min_len, max_len) for p, r in zip(prompts, responses)]
    # The last step reaches the bound: its first pair is cut (or grown) to max_len tokens.
    prompt, _ = pairs[(steps - 1) * batch]
    pairs[(steps - 1) * batch] = (min(prompt, max_len - 1), max_len - min(prompt, max_len - 1))
    grouped = tuple(tuple(pairs[i * batch : (i + 1) * batch]) for i in range(steps))
    description = (
        f"{batch} (prompt, response) pairs a step; prompt log-normal(median={prompt_median:g}), "
        f"response log-normal(median={response_median:g}), sigma={SIGMA}, pair in "
        f"[{min_len}, {max_len}] (response cut), last step reaches {max_len}, seed {seed}"
    )
    return SftTrace(grouped, seed, batch, min_len, max_len, description)


def pairs_at(
    length: int, batch: int, min_len: int, max_len: int, seed: int = 0
) -> tuple[tuple[int, int], ...]:
    """``batch`` pairs drawn as :func:`sft_trace` draws them, the longest exactly ``length``.

    The first pair is cut (or grown) to ``length`` tokens, the others are drawn and cut to at
    most ``length``: a step of the trace whose padded length is ``length``. The bench measures
    each length of a trace on such a batch.
    """
    if not 2 <= min_len <= length <= max_len:
        raise ValueError(
            f"need 2 <= min_len <= length <= max_len, got {min_len}, {length}, {max_len}"
        )
    if batch < 1:
        raise ValueError(f"a batch needs at least one pair, got {batch}")
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(np.log(max(1.0, max_len * PROMPT_MEDIAN_FRACTION)), SIGMA, batch)
    responses = rng.lognormal(np.log(max(1.0, max_len * RESPONSE_MEDIAN_FRACTION)), SIGMA, batch)
    pairs = [_pair(p, r, min(min_len, length), length) for p, r in zip(prompts, responses)]
    prompt = min(pairs[0][0], length - 1)
    pairs[0] = (prompt, length - prompt)
    return tuple(pairs)


def _pair(prompt: float, response: float, min_len: int, max_len: int) -> tuple[int, int]:
    """Round, cut the response so the pair fits ``max_len``, grow it to reach ``min_len``."""
    p = int(np.clip(round(prompt), 1, max_len - 1))
    r = max(1, int(round(response)))
    r = min(r, max_len - p)
    r = max(r, min_len - p)
    return p, r


def pad_batch(
    pairs: Sequence[tuple[int, int]],
    vocab: int,
    *,
    padding_side: str = "right",
    pad_id: int = 0,
    seed: int = 0,
    length: int | None = None,
) -> dict[str, np.ndarray]:
    """A padded batch of ``pairs``, as ``DataCollatorForSeq2Seq`` yields it (numpy, int64).

    Parameters
    ----------
    pairs
        ``(prompt_len, response_len)`` per sequence.
    vocab
        Token ids are drawn from ``[1, vocab)`` (``pad_id`` is not drawn unless it is 0).
    padding_side
        ``"right"`` or ``"left"``, as a tokenizer's ``padding_side``.
    pad_id
        The id written on padding (its label is -100 and its mask 0, so its value is moot).
    seed
        Seed of the token ids.
    length
        Pad to this length (default: the longest pair).

    Returns
    -------
    dict
        ``input_ids``, ``attention_mask`` and ``labels``, each ``(len(pairs), length)``.
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, not {padding_side!r}")
    if not pairs:
        raise ValueError("a batch needs at least one (prompt, response) pair")
    longest = max(p + r for p, r in pairs)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length {length} is below the longest pair, {longest} tokens")
    rng = np.random.default_rng(seed)
    ids = np.full((len(pairs), length), pad_id, dtype="int64")
    mask = np.zeros((len(pairs), length), dtype="int64")
    labels = np.full((len(pairs), length), IGNORE_INDEX, dtype="int64")
    for row, (prompt, response) in enumerate(pairs):
        n = prompt + response
        start = 0 if padding_side == "right" else length - n
        tokens = rng.integers(1, max(vocab, 2), size=n)
        ids[row, start : start + n] = tokens
        mask[row, start : start + n] = 1
        labels[row, start + prompt : start + n] = tokens[prompt:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}

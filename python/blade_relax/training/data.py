"""Synthetic token data of varying length, for training runs that download nothing.

Lengths follow the bench's long-tailed trace (:func:`blade_relax.bench.trace.length_trace`: a
log-normal body with median ``max_len / 8`` and sigma 0.9, clipped to the model's range, the last
entry at ``max_len``). Tokens come from a seeded first-order Markov chain in which every token
has ``successors`` likely next tokens, so a model can learn the data and its loss falls below
the uniform ``log(vocab)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MarkovTokens", "synthetic_batches"]


@dataclass(frozen=True)
class MarkovTokens:
    """A seeded Markov chain over ``vocab`` tokens.

    Attributes
    ----------
    vocab
        Number of tokens.
    successors
        Likely next tokens per token (the rest share ``noise`` of the probability).
    noise
        Probability of a uniformly random next token.
    seed
        Seed of the transition table.
    """

    vocab: int
    successors: int = 4
    noise: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab < 2:
            raise ValueError(f"a vocabulary needs at least 2 tokens, got {self.vocab}")
        if not 1 <= self.successors <= self.vocab:
            raise ValueError(f"successors must lie in [1, {self.vocab}], got {self.successors}")
        if not 0 <= self.noise <= 1:
            raise ValueError(f"noise must lie in [0, 1], got {self.noise}")

    def table(self) -> np.ndarray:
        """``vocab x successors`` likely next tokens (drawn with replacement)."""
        rng = np.random.default_rng(self.seed)
        return rng.integers(0, self.vocab, size=(self.vocab, self.successors))

    def sample(self, length: int, batch: int, rng: np.random.Generator) -> np.ndarray:
        """``(batch, length)`` int64 token ids."""
        table = self.table()
        out = np.empty((batch, length), np.int64)
        out[:, 0] = rng.integers(0, self.vocab, size=batch)
        for t in range(1, length):
            pick = table[out[:, t - 1], rng.integers(0, self.successors, size=batch)]
            random = rng.integers(0, self.vocab, size=batch)
            out[:, t] = np.where(rng.random(batch) < self.noise, random, pick)
        return out


def synthetic_batches(
    vocab: int, lengths: Sequence[int], *, batch: int = 1, seed: int = 0
) -> list[np.ndarray]:
    """One ``(batch, length)`` batch of Markov-chain token ids per entry of ``lengths``."""
    chain = MarkovTokens(vocab, seed=seed)
    rng = np.random.default_rng(seed + 1)
    return [chain.sample(int(n), batch, rng) for n in lengths]

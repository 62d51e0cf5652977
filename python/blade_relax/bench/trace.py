"""The sequence-length trace every configuration is measured on.

Instruction-tuning data is mostly short prompts and answers with a long tail of long ones. The
trace models that with a log-normal distribution: ``median = max_len / 8`` and
``sigma = 0.9`` (about 78 % of the samples fall below ``max_len / 4``, about 1 % reach
``max_len``), clipped to ``[min_len, max_len]``. The last entry is always ``max_len`` itself, so
that every run exercises the tail and the bound-planned configurations are seen at their bound.
The generator is ``numpy.random.default_rng(seed)``: the same arguments give the same trace on
every machine, and every configuration of a run sees the same lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LengthTrace", "length_trace"]

MEDIAN_FRACTION = 1 / 8
SIGMA = 0.9


@dataclass(frozen=True)
class LengthTrace:
    """A seeded sequence-length trace.

    Attributes
    ----------
    lengths
        The lengths in trace order (repeats possible).
    seed, min_len, max_len
        The arguments that produced it.
    distribution
        A one-line description, for the JSON output.
    """

    lengths: tuple[int, ...]
    seed: int
    min_len: int
    max_len: int
    distribution: str

    @property
    def unique(self) -> list[int]:
        """Distinct lengths, ascending (what the results are reported per)."""
        return sorted(set(self.lengths))


def length_trace(count: int, min_len: int, max_len: int, seed: int = 0) -> LengthTrace:
    """``count`` lengths in ``[min_len, max_len]``: log-normal body, last entry ``max_len``.

    Parameters
    ----------
    count
        Number of entries (>= 1).
    min_len, max_len
        The admissible range (the model's exported range).
    seed
        Seed of the generator.
    """
    if count < 1:
        raise ValueError(f"a trace needs at least one entry, got {count}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    median = max(min_len, max_len * MEDIAN_FRACTION)
    body = rng.lognormal(mean=np.log(median), sigma=SIGMA, size=count - 1)
    lengths = [int(np.clip(round(x), min_len, max_len)) for x in body] + [max_len]
    description = (
        f"log-normal(median={median:g}, sigma={SIGMA}) clipped to [{min_len}, {max_len}], "
        f"last entry {max_len}, seed {seed}"
    )
    return LengthTrace(tuple(lengths), seed, min_len, max_len, description)

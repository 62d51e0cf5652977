"""Padding to buckets: the static-shape alternative to compiling once for every length.

A bucketed configuration compiles one static graph per *bucket* of lengths and pads every
input to its bucket's length: with buckets of ``K`` tokens a length ``n`` runs the graph of
``ceil(n / K) * K`` tokens; with ``pow2`` buckets the graph of the next power of two. Either is
capped at the exported maximum (the last bucket may be shorter than the others).

Padding must not change what the step computes. For the Hugging Face causal LMs the bench
imports (:func:`blade_relax.frontend.import_training_step`):

* token ids are padded with ``0`` at the end, and the labels with :data:`IGNORE_INDEX`
  (``-100``, the ``ignore_index`` of the models' cross-entropy), so that the padded positions
  add nothing to the loss;
* the loss is the *mean* over the positions whose label is not ignored (the models shift the
  labels inside and call ``cross_entropy(..., ignore_index=-100, reduction="mean")``): the
  denominator counts the same positions with or without the padding;
* attention is causal, so the padded positions at the end change no earlier position; their
  own outputs are masked out of the loss, so they receive zero gradients and add nothing to the
  gradients of the parameters.

The loss and gradients of a padded step therefore equal those of the unpadded step up to the
order of floating-point sums (tests/bench/test_bucketing.py checks it on the small Llama).
Workloads without a ``labels`` input (inference, the Relax-native MLPs) are not bucketed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..runtime.cuda_graphs import round_up_length

__all__ = ["IGNORE_INDEX", "bucket_length", "check_paddable", "pad_to_bucket", "parse_bucket"]

#: The label that the models' cross-entropy ignores (``torch.nn.CrossEntropyLoss``'s default).
IGNORE_INDEX = -100
#: Token id the padded positions get (any valid id will do: their outputs are masked).
PAD_TOKEN = 0


def parse_bucket(argument: str) -> int | str:
    """The bucket of ``tvm-bucketed@ARG``: a positive number of tokens, or ``"pow2"``.

    Raises
    ------
    ValueError
        For anything else.
    """
    if argument == "pow2":
        return "pow2"
    try:
        size = int(argument)
    except ValueError:
        raise ValueError(
            f"tvm-bucketed@{argument}: expected a bucket size in tokens or 'pow2'"
        ) from None
    if size < 1:
        raise ValueError(f"tvm-bucketed@{argument}: the bucket size must be at least 1")
    return size


def bucket_length(length: int, bucket: int | str, max_len: int) -> int:
    """The length of the bucket that ``length`` runs in (capped at ``max_len``).

    Parameters
    ----------
    length
        The sequence length of the batch.
    bucket
        Tokens per bucket, or ``"pow2"`` for powers of two.
    max_len
        The largest admissible length (the exported range's maximum).
    """
    if not 1 <= length <= max_len:
        raise ValueError(f"length {length} is outside [1, {max_len}]")
    return round_up_length(length, bucket, max_len)


def check_paddable(input_names: Sequence[str]) -> None:
    """Raise ``ValueError`` unless the inputs are the ``input_ids`` and ``labels`` of a causal
    LM training step (what :func:`pad_to_bucket` knows how to pad)."""
    if list(input_names) != ["input_ids", "labels"]:
        raise ValueError(
            "bucketing pads the input_ids and labels of a causal LM training step; this "
            f"workload takes {list(input_names)}"
        )


def pad_to_bucket(
    input_names: Sequence[str], inputs: Sequence[np.ndarray], length: int
) -> list[np.ndarray]:
    """``inputs`` (``input_ids``, ``labels``: ``(batch, s)``) padded at the end to ``length``.

    Token ids are padded with :data:`PAD_TOKEN`, labels with :data:`IGNORE_INDEX`.

    Raises
    ------
    ValueError
        When the inputs are not the ``input_ids`` and ``labels`` of a causal LM step, or are
        longer than ``length``.
    """
    check_paddable(input_names)
    out = []
    for name, array in zip(input_names, inputs):
        array = np.asarray(array)
        extra = length - array.shape[-1]
        if extra < 0:
            raise ValueError(f"{name} has length {array.shape[-1]}, above the bucket's {length}")
        fill = IGNORE_INDEX if name == "labels" else PAD_TOKEN
        widths = [(0, 0)] * (array.ndim - 1) + [(0, extra)]
        out.append(np.pad(array, widths, constant_values=fill))
    return out

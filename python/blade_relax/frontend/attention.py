"""Which attention a Hugging Face model runs, and in which mode, switched for a while.

The import exports a model with eager attention (the computation the converters know) and the
benchmark's ``torch-eager-sdpa`` runs PyTorch's scaled-dot-product attention (transformers'
default); both switch the model they are given and restore it, since the model is the user's
(or shared by the benchmark's configurations). :func:`export_settings` adds eval mode: what
the import exports under and the torch reference runs under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["attention_implementation", "export_settings"]


@contextlib.contextmanager
def attention_implementation(model: Any, implementation: str | None) -> Iterator[None]:
    """A Hugging Face model running ``implementation`` of attention for a while.

    Parameters
    ----------
    model
        A ``PreTrainedModel`` (or a PEFT model around one).
    implementation
        A name transformers knows (``"eager"``, ``"sdpa"``, ...); ``None`` changes nothing.
        The model's own implementation is restored on exit.
    """
    config = getattr(model, "config", None)
    old = getattr(config, "_attn_implementation", None)
    switch = implementation is not None and old not in (None, implementation)
    if switch:
        _set_attn(model, implementation)
    try:
        yield
    finally:
        if switch:
            _set_attn(model, old)


@contextlib.contextmanager
def export_settings(model: Any, implementation: str | None) -> Iterator[None]:
    """Eval mode and the requested attention implementation (:func:`attention_implementation`),
    restored on exit."""
    was_training = model.training
    with attention_implementation(model, implementation):
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)


def _set_attn(model: Any, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(implementation)
    if model.config._attn_implementation != implementation:
        # No setter, or one that declines (Falcon's attention is no AttentionInterface, so
        # transformers only logs that it cannot switch): models of that kind read the
        # implementation from their config when they run.
        model.config._attn_implementation = implementation

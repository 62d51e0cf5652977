"""Hugging Face gradient checkpointing of a workload's torch module, switched on for a while.

The PyTorch baselines ``torch-eager-ckpt`` and ``torch-compile-ckpt`` (and
:func:`blade_relax.training.torch_fit` with ``checkpointing=True``) run the model with
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``: every
decoder layer keeps only its input for the backward pass and recomputes the rest, through
``torch.utils.checkpoint`` (non-reentrant, saved-tensor hooks).

Hugging Face checkpoints only while ``module.training`` is True, so the module is put in train
mode while checkpointing is on (the workloads' models have no dropout: the step computes the
same loss and gradients). The module object is shared by the other configurations and the
reference, so :func:`gradient_checkpointing` restores everything on exit: checkpointing off,
every submodule's ``training`` flag as before, and the input-embedding hooks that enabling may
register removed.

Those hooks (``enable_input_require_grads``) make the embedding output require a gradient. A
model whose embedding is frozen (a PEFT adapter) needs them with *reentrant* checkpointing only,
whose recomputed segment otherwise sees no input requiring a gradient and returns none;
non-reentrant checkpointing differentiates through the recomputation whatever its inputs, so
removing them changes no gradient. Recent ``transformers`` releases register them on every
``gradient_checkpointing_enable`` of a text model; older ones for PEFT models only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["checkpointing_model", "gradient_checkpointing"]

CHECKPOINT_KWARGS = {"use_reentrant": False}
"""What ``torch.utils.checkpoint.checkpoint`` is called with."""


def checkpointing_model(module: Any) -> Any:
    """The Hugging Face model that ``module`` runs: ``module`` itself or its ``.model``.

    The step wrappers of :mod:`blade_relax.frontend.hf` keep the model as ``.model``; a PEFT
    model qualifies too (its ``gradient_checkpointing_enable`` is its base model's).

    Raises
    ------
    ValueError
        When neither has ``gradient_checkpointing_enable`` (a Relax-native workload's module).
    """
    for candidate in (module, getattr(module, "model", None)):
        if candidate is not None and hasattr(candidate, "gradient_checkpointing_enable"):
            return candidate
    raise ValueError(
        f"gradient checkpointing needs a Hugging Face model; the workload's torch module "
        f"({type(module).__name__}) holds none (only the Hugging Face workloads, e.g. "
        f"llama-train and gpt2-train, can checkpoint)"
    )


def _input_grad_hooks(model: Any) -> list[Any]:
    return list(getattr(model, "_require_grads_hooks", None) or [])


def _is_checkpointing(model: Any) -> bool:
    return any(getattr(sub, "gradient_checkpointing", False) for sub in model.modules())


@contextlib.contextmanager
def gradient_checkpointing(module: Any) -> Iterator[Any]:
    """Non-reentrant Hugging Face checkpointing and train mode for ``module``, then restored.

    Parameters
    ----------
    module
        A torch module holding a Hugging Face model (see :func:`checkpointing_model`).

    Yields
    ------
    Any
        The model whose checkpointing is on.

    Raises
    ------
    ValueError
        When ``module`` holds no Hugging Face model, or its checkpointing is already on (it
        could not be restored as it was), before anything changes.
    """
    model = checkpointing_model(module)
    if _is_checkpointing(model):
        raise ValueError("gradient checkpointing is already on for this model")
    training = {sub: sub.training for sub in module.modules()}
    hooks_before = _input_grad_hooks(model)
    with warnings.catch_warnings():
        # transformers 5 renamed the method (activation_checkpointing_enable) and warns.
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    try:
        # The input-embedding hooks enabling added: not needed (see the module docstring), and
        # removed so that the step runs the hooks the plain step runs.
        for hook in _input_grad_hooks(model):
            if all(hook is not old for old in hooks_before):
                hook.remove()
        if not hooks_before:
            model.disable_input_require_grads()
        module.train()
        yield model
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()
        for sub, flag in training.items():
            sub.training = flag

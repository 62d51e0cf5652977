"""What an imported Hugging Face graph is checked against: the same step run by torch.

:func:`inference_reference` and :func:`training_reference` run the model the graph was
exported from on the graph's numpy inputs and return its outputs as numpy arrays, in the
model's precision (``ImportedGraph.reference``). With ``float64=True`` they run a float64 copy
of it instead, copied at each call (``ImportedGraph.float64_reference``): the yardstick for an
output whose float32 value is rounding noise, such as the gradient of a bias added to every
key of an attention row, zero in exact arithmetic because a softmax ignores a constant shift
(OPT's ``k_proj.bias``). The benchmark's check (:mod:`blade_relax.bench.runner`) asks for it
only where the float32 comparison fails (once per length), so a model is copied only then.
transformers' causal-LM loss casts the logits to float32 (``logits.float()``), so the loss and
its gradient at the logits stay float32 in that copy; every gradient is still computed in
float64 from there, and a gradient zero in exact arithmetic comes out as float64 noise (norms
about 1e-20 where float32's are 1e-11).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .attention import export_settings

__all__ = ["inference_reference", "torch_to_numpy", "training_reference"]

Reference = Callable[[Sequence[np.ndarray]], list[np.ndarray]]


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A copy of a torch tensor as a numpy array.

    numpy has no bfloat16 (``Tensor.numpy()`` refuses it): a bfloat16 tensor becomes the
    ``ml_dtypes.bfloat16`` array that ``tvm.runtime.tensor`` takes, bit for bit.
    """
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return tensor.numpy().copy()


def inference_reference(model: Any, wrapper: Any, float64: bool = False) -> Reference:
    """The reference of an inference graph: ``wrapper`` (an ``InferenceStep`` of ``model``)
    run by torch on numpy token ids, in eval mode without gradients; returns ``[logits]``.
    ``float64``: on a float64 copy of both (:func:`_in_float64`)."""
    import torch

    if float64:
        return _in_float64(wrapper, lambda copied: inference_reference(copied.model, copied))

    def reference(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        (ids,) = inputs
        with export_settings(model, None), torch.no_grad():
            logits = wrapper(torch.from_numpy(np.asarray(ids)))
        return [torch_to_numpy(logits)]

    return reference


def training_reference(
    model: Any, wrapper: Any, trainable: Sequence[str], float64: bool = False
) -> Reference:
    """The reference of a training graph: one step of ``wrapper`` (a ``TrainingStep`` of
    ``model``) in torch; returns the loss and the gradients of ``trainable`` (by name in
    ``model.named_parameters()``; zeros for a parameter the step leaves without one).
    ``float64``: on a float64 copy of both, without autocast (:func:`_in_float64`)."""
    import torch

    if float64:
        return _in_float64(
            wrapper, lambda copied: training_reference(copied.model, copied, trainable)
        )
    named = dict(model.named_parameters(remove_duplicate=False))

    def reference(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        tensors = [torch.from_numpy(np.asarray(a)) for a in inputs]
        with export_settings(model, None):
            model.zero_grad(set_to_none=True)
            (loss,) = wrapper(*tensors)
            loss.backward()
        grads = []
        for name in trainable:
            grad = named[name].grad
            grads.append(
                torch_to_numpy(torch.zeros_like(named[name]))
                if grad is None
                else torch_to_numpy(grad)
            )
        model.zero_grad(set_to_none=True)
        return [torch_to_numpy(loss), *grads]

    return reference


def _in_float64(wrapper: Any, reference_of: Callable[[Any], Reference]) -> Reference:
    """``reference_of(copied)`` for a float64 deep copy of ``wrapper`` (its model inside), made
    at each call so that it has the model's weights of the moment, as the float32 reference
    does; without autocast (the exact step, not the mixed-precision one). It runs with float64
    as torch's default dtype, so that what the model builds without a dtype is float64 too
    (XGLM's ``torch.full((), finfo(float64).min)`` overflows a float32 default)."""
    import torch

    def reference(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        copied = copy.deepcopy(wrapper).to(torch.float64)
        if getattr(copied, "autocast", None) is not None:
            copied.autocast = None
        with _default_dtype(torch.float64):
            return reference_of(copied)(inputs)

    return reference


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

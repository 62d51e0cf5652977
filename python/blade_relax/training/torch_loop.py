"""The same training loop in PyTorch: what blade_relax's loop is compared with.

:func:`torch_fit` runs ``zero_grad(set_to_none=True); loss = model(batch); loss.backward();
opt.step()`` with the ``torch.optim`` optimizer that matches a blade_relax optimizer (same
hyperparameters, same learning-rate schedule), from the graph's initial parameters, on the same
batches. Peak bytes per step are counted the way blade_relax's are: the bytes held across steps
(parameters, and the optimizer state once it exists) plus the most bytes the step allocated, by
the dispatch counter of :mod:`blade_relax.training.torch_memory` (PyTorch has no CPU allocator
statistics). The gradients of the previous step are released before the step starts (the
``set_to_none`` in the loop), which is the most favourable accounting for PyTorch.

With ``checkpointing=True`` the copy of the model runs with Hugging Face gradient checkpointing
(non-reentrant, in train mode, :mod:`blade_relax.training.hf_checkpointing`), the loop labelled
``torch-eager-ckpt`` or ``torch-compile-ckpt``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..frontend.imported import ImportedGraph
from .optimizers import SGD, AdamW, InPlaceOptimizer
from .trainer import History, StepRecord, as_batch, check_batch

__all__ = ["model_copy", "torch_fit", "torch_optimizer"]


def torch_optimizer(optimizer: InPlaceOptimizer, params: list[Any]) -> Any:
    """The ``torch.optim`` optimizer computing what ``optimizer`` computes (single-tensor
    implementation, as on the CPU by default)."""
    import torch

    if isinstance(optimizer, AdamW):
        return torch.optim.AdamW(
            params,
            lr=optimizer.lr,
            betas=(optimizer.beta1, optimizer.beta2),
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            foreach=False,
        )
    if isinstance(optimizer, SGD):
        return torch.optim.SGD(
            params,
            lr=optimizer.lr,
            momentum=optimizer.momentum,
            dampening=optimizer.dampening,
            weight_decay=optimizer.weight_decay,
            nesterov=optimizer.nesterov,
            foreach=False,
        )
    raise TypeError(f"no torch counterpart for {type(optimizer).__name__}")


def model_copy(graph: ImportedGraph) -> tuple[Any, list[Any]]:
    """A copy of ``graph``'s torch module holding ``graph.params``, and its parameters in the
    graph's order (the loops train the copy: the graph's module stays as imported)."""
    import torch

    memo: dict[int, Any] = {}
    module = copy.deepcopy(graph.torch_module, memo)
    params = [memo.get(id(p), p) for p in graph.torch_params]
    with torch.no_grad():
        for p, value in zip(params, graph.params):
            p.copy_(torch.from_numpy(np.asarray(value)))
    return module, params


def _state_bytes(opt: Any) -> int:
    import torch

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes()
    return total


def torch_fit(
    graph: ImportedGraph,
    optimizer: InPlaceOptimizer,
    batches: Iterable[Any],
    steps: int | None = None,
    *,
    compile: bool = False,
    checkpointing: bool = False,
) -> History:
    """Run the PyTorch loop for ``graph``'s model (a copy, from ``graph.params``).

    Parameters
    ----------
    graph
        A training graph imported from torch (:func:`blade_relax.frontend.import_training_step`).
    optimizer
        The blade_relax optimizer whose torch counterpart runs.
    batches, steps
        As for :meth:`blade_relax.training.Trainer.fit`.
    compile
        Run the model through ``torch.compile(dynamic=True)`` (the backward and the optimizer
        stay eager).
    checkpointing
        Enable Hugging Face gradient checkpointing on the copy (``torch-eager-ckpt``,
        ``torch-compile-ckpt``): each decoder layer recomputes its activations in the backward
        pass. The graph's torch module must hold a Hugging Face model.

    Raises
    ------
    ValueError
        When the graph has no torch module, or ``checkpointing`` is asked of one that holds no
        Hugging Face model.
    """
    import torch

    from .hf_checkpointing import checkpointing_model, gradient_checkpointing
    from .torch_memory import LiveBytesCounter, visible_inductor_allocations

    if graph.torch_module is None or graph.torch_params is None:
        raise ValueError("the graph was not imported from torch: there is no torch loop to run")
    if checkpointing:
        checkpointing_model(graph.torch_module)  # raises before anything is copied
    module, params = model_copy(graph)
    opt = torch_optimizer(optimizer, params)
    step_fn = torch.compile(module, dynamic=True) if compile else module
    # Frozen parameters (a LoRA model's base weights) are held too, as in blade_relax's step.
    frozen = [p for p in module.parameters() if not p.requires_grad]
    param_bytes = sum(p.untyped_storage().nbytes() for p in [*params, *frozen])
    label = "torch-compile" if compile else "torch-eager"
    history = History(label=f"{label}-ckpt" if checkpointing else label)
    # On the copy, for the whole loop (and off again, as the copy is left behind).
    with gradient_checkpointing(module) if checkpointing else contextlib.nullcontext():
        stream = iter(batches)
        count = 0
        compile_start = time.perf_counter()
        compiled_once = False
        while steps is None or count < steps:
            batch = next(stream, None)
            if batch is None:
                break
            arrays = as_batch(graph, batch)
            dims = check_batch(graph, arrays)
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
            count += 1
            for group in opt.param_groups:
                group["lr"] = optimizer.lr_at(count)
            opt.zero_grad(set_to_none=True)
            gc.collect()
            held = param_bytes + _state_bytes(opt)
            counter = LiveBytesCounter()
            start = time.perf_counter()
            with visible_inductor_allocations() if compile else contextlib.nullcontext(), counter:
                (loss,) = step_fn(*tensors)
                loss.backward()
                opt.step()
            elapsed = time.perf_counter() - start
            counter.detach_all()
            if compile and not compiled_once:
                history.compile_time_s = time.perf_counter() - compile_start
                compiled_once = True
            history.records.append(
                StepRecord(
                    step=count,
                    length=int(dims.get("s", arrays[0].shape[-1])),
                    loss=float(loss.detach()),
                    peak_bytes=held + int(counter.peak_bytes),
                    step_peak_bytes=int(counter.peak_bytes),
                    time_s=elapsed,
                )
            )
    history.persistent_bytes = param_bytes + _state_bytes(opt)
    history.parameters = [p.detach().numpy().copy() for p in params]  # type: ignore[attr-defined]
    if compile:
        history.compilations = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return history

"""Training end to end: in-place optimizers, the whole step as one Relax function, a loop.

* :class:`SGD`, :class:`AdamW`: optimizers whose update of each parameter is one in-place
  kernel (``call_tir_inplace``), with per-step scalars computed as ``torch.optim`` does.
* :func:`build_training_step`: a training graph ``(inputs, params) -> (loss, grads)`` becomes
  ``(inputs, params, state, scalars) -> (loss, params, state)``, updated in place.
* :class:`Trainer` / :func:`fit`: compile once, run over batches of varying length, with a
  progress bar and a :class:`History` (length, loss, peak bytes, time, evictions per step).
* :func:`torch_fit`: the same loop in PyTorch, measured the same way (the reference), with
  :mod:`.torch_memory` (PyTorch's live bytes counted on the CPU) and :mod:`.hf_checkpointing`
  (Hugging Face gradient checkpointing), which the bench's PyTorch baselines use too.
"""

from .optimizers import SGD, AdamW, InPlaceOptimizer
from .sharding import ZeroSharding
from .step import TrainingStep, build_training_step
from .torch_loop import torch_fit, torch_optimizer
from .trainer import History, StepRecord, Trainer, as_batch, check_batch, fit

__all__ = [
    "SGD",
    "AdamW",
    "History",
    "InPlaceOptimizer",
    "StepRecord",
    "Trainer",
    "TrainingStep",
    "ZeroSharding",
    "as_batch",
    "build_training_step",
    "check_batch",
    "fit",
    "torch_fit",
    "torch_optimizer",
]

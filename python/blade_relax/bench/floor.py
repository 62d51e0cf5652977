"""Bytes a bench workload's step holds at least, from its sizes alone (nothing built).

``blade-relax train`` and ``blade-relax bench`` refuse sizes whose floor exceeds the memory
available before they build a model: building one draws its weights, and a step at such sizes
would end in numpy's ``MemoryError`` or the kernel's OOM killer, long after the cause.

The floor counts only what every version of the step must hold at once, whatever the passes
do: every parameter, the optimizer state (``train``: the optimizer runs in the step), the
step's inputs, and then the larger of the logits of the longest batch (one tensor, which no
pass splits) and, where the step returns them (the bench's training steps), every gradient.
Activations beyond those, kernel scratch, PyTorch's reference copy and the allocator's
rounding come on top, so a run can still need far more: this is a floor, not a prediction.

The parameter counts follow the models of :mod:`blade_relax.bench.workloads` (Llama without
tied embeddings, GPT-2 with a separate head, PEFT LoRA adapters of rank
:data:`~blade_relax.bench.workloads.LORA_RANK` on every projection, the Relax-native MLPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..util.cliargs import human_bytes

__all__ = ["DTYPE_BYTES", "MemoryFloor", "memory_floor", "parameter_counts"]

#: Bytes of one element by dtype name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Token ids (and labels) are int64 in every imported step.
_ID_BYTES = 8
# The workloads whose step returns the gradients (the bench's training steps) vs the forward.
_INFERENCE = ("gpt2-infer",)


def _widths(workload: str, sizes: Any) -> list[int]:
    from .workloads import TANH_MLP_WIDTHS

    if workload == "tanh-mlp-train":
        return list(TANH_MLP_WIDTHS)
    return [sizes.hidden] + [sizes.intermediate] * sizes.layers + [sizes.vocab]


def parameter_counts(workload: str, sizes: Any) -> tuple[int, int]:
    """Parameters of a workload's model: ``(all, trainable)`` element counts.

    Parameters
    ----------
    workload
        A name of :data:`blade_relax.bench.workloads.WORKLOADS`.
    sizes
        Its :class:`~blade_relax.bench.workloads.ModelSizes`.

    Returns
    -------
    tuple of int
        Every parameter, and those the step trains (all but the frozen model under LoRA).
    """
    from .workloads import LORA_RANK, WORKLOADS

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {sorted(WORKLOADS)}")
    h, i, v, layers = sizes.hidden, sizes.intermediate, sizes.vocab, sizes.layers
    if workload in ("mlp-train", "tanh-mlp-train"):
        widths = _widths(workload, sizes)
        total = sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))  # weight and bias
        return total, total
    if workload.startswith("gpt2"):
        positions = max(sizes.max_seq_len, 2)
        # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj: weights and biases.
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
        total = v * h + positions * h + layers * block + 2 * h + h * v
        return total, total
    kv = sizes.kv_heads * (h // sizes.heads)
    # q, k, v, o, gate, up, down (no biases) and the two RMS norms.
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    total = v * h + layers * block + h + h * v
    if workload != "llama-lora-sft":
        return total, total
    # Each adapter of rank r on an (in, out) projection: A (in, r) and B (r, out).
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    adapters = layers * sum(LORA_RANK * (a + b) for a, b in shapes)
    return total + adapters, adapters


@dataclass(frozen=True)
class MemoryFloor:
    """What a step holds at least, part by part.

    Attributes
    ----------
    parts
        ``(what, bytes)`` pairs; the floor is their sum.
    length
        The sequence length it was computed at.
    """

    parts: tuple[tuple[str, int], ...]
    length: int

    @property
    def total(self) -> int:
        """The floor in bytes."""
        return sum(nbytes for _, nbytes in self.parts)

    def describe(self) -> str:
        """``"parameters 1.00 GiB + AdamW state 2.00 GiB + ..."``, for a one-line message."""
        return " + ".join(f"{what} {human_bytes(nbytes)}" for what, nbytes in self.parts if nbytes)


def memory_floor(
    workload: str,
    sizes: Any,
    *,
    length: int | None = None,
    optimizer: str | None = None,
    state_per_param: int = 0,
    activations: bool = True,
) -> MemoryFloor:
    """The bytes one step of ``workload`` at ``sizes`` holds at least (see the module docstring).

    Parameters
    ----------
    workload
        A name of :data:`blade_relax.bench.workloads.WORKLOADS`.
    sizes
        Its :class:`~blade_relax.bench.workloads.ModelSizes` (a fine-tuning workload's batch
        as :func:`~blade_relax.bench.workloads.workload_sizes` resolves it).
    length
        The longest sequence length of the run (default: ``sizes.max_seq_len``, which both
        traces reach at their last step).
    optimizer, state_per_param
        An optimizer that runs in the step (``blade-relax train``) and the state tensors it
        keeps per trainable parameter (AdamW 2, SGD with momentum 1), in the parameters' dtype.
    activations
        Count the logits and gradients of a step; ``False`` counts what exists before any step
        runs (the parameters, the state and the inputs), as in the bench's predicted mode.
    """
    from .workloads import HF_WORKLOADS, workload_sizes

    sizes = workload_sizes(workload, sizes)
    length = sizes.max_seq_len if length is None else length
    total, trainable = parameter_counts(workload, sizes)
    hf = workload in HF_WORKLOADS
    param_bytes = DTYPE_BYTES[sizes.dtype] if hf else 4  # the Relax-native MLPs are float32
    parts: list[tuple[str, int]] = [("parameters", total * param_bytes)]
    if optimizer is not None and state_per_param:
        parts.append((f"{optimizer} state", state_per_param * trainable * param_bytes))
    if hf:
        # Under autocast the forward computes (and the head writes its logits) in that dtype.
        act_bytes = DTYPE_BYTES[sizes.autocast or sizes.dtype]
        parts.append(("token ids", sizes.batch * length * _ID_BYTES))
        largest = [("logits of the longest batch", sizes.batch * length * sizes.vocab * act_bytes)]
    else:
        widths = _widths(workload, sizes)
        # x and the one-hot labels (mlp-train) or the targets (tanh-mlp-train).
        parts.append(("inputs", length * (widths[0] + widths[-1]) * 4))
        largest = [("widest activation", length * max(widths) * 4)]
    if not activations:
        return MemoryFloor(tuple(parts), length)
    if optimizer is None and workload not in _INFERENCE:
        # The bench's training steps return every gradient: all live at the step's end.
        largest.append(("gradients", trainable * param_bytes))
    parts.append(max(largest, key=lambda part: part[1]))
    return MemoryFloor(tuple(parts), length)

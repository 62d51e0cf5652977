"""The training-loop benchmark: blade_relax's compiled step against PyTorch's loop.

:func:`compare_training` builds a model of a bench workload (same random init for both),
synthetic batches whose lengths follow the bench's long-tailed trace, and runs the same number
of optimizer steps with :class:`blade_relax.training.Trainer` (one compilation) and with
PyTorch (``zero_grad; loss.backward(); opt.step()``, eager and optionally ``torch.compile``).
Per step it records loss, length, the full step's peak bytes (parameters and optimizer state
counted once, plus what the step allocated) and time; it checks the losses and the final
parameters against PyTorch's. ``blade-relax train`` prints and plots the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..util.figures import save_png
from .sft import pad_batch, sft_trace
from .trace import length_trace
from .workloads import PRESETS, ModelSizes, build_workload

__all__ = [
    "SFT_MODELS",
    "TRAIN_MODELS",
    "TrainingComparison",
    "compare_training",
    "plot_training",
    "training_batches",
]

#: ``--model`` of ``blade-relax train`` -> bench workload.
TRAIN_MODELS = {"llama": "llama-train", "gpt2": "gpt2-train"}
#: The fine-tuning workloads of a model (``--sft``, ``--lora``): full, LoRA.
SFT_MODELS = {"llama": ("llama-sft", "llama-lora-sft")}


@dataclass
class TrainingComparison:
    """The runs of one comparison and what was checked.

    Attributes
    ----------
    ours
        blade_relax's :class:`~blade_relax.training.History`.
    torch_runs
        PyTorch's histories (``torch-eager``, and ``torch-compile`` when asked).
    lengths
        The trace, one length per step.
    trace
        How the lengths were drawn.
    max_loss_error
        Largest relative difference of the loss to torch-eager's over the steps.
    max_param_error
        Largest relative (Frobenius) difference of a parameter to torch-eager's after the run.
    budget
        The fractional memory budget blade_relax ran under (``None``: none).
    param_bytes
        Bytes of the parameters.
    """

    ours: Any
    torch_runs: list[Any]
    lengths: list[int]
    trace: str
    max_loss_error: float
    max_param_error: float
    budget: float | None
    param_bytes: int
    settings: dict[str, Any] = field(default_factory=dict)

    def by_length(self) -> list[dict[str, Any]]:
        """Per distinct length: blade_relax's peak, each torch peak and the ratios."""
        rows: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(self.ours.records):
            row = rows.setdefault(record.length, {"length": record.length, "blade_relax": 0})
            row["blade_relax"] = max(row["blade_relax"], record.peak_bytes)
            for run in self.torch_runs:
                if i < len(run.records):
                    row[run.label] = max(row.get(run.label, 0), run.records[i].peak_bytes)
        out = []
        for length in sorted(rows):
            row = rows[length]
            for run in self.torch_runs:
                if run.label in row:
                    row[f"ratio_{run.label}"] = row["blade_relax"] / row[run.label]
            out.append(row)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "trace": self.trace,
            "lengths": self.lengths,
            "budget": self.budget,
            "param_bytes": self.param_bytes,
            "max_loss_error": self.max_loss_error,
            "max_param_error": self.max_param_error,
            "by_length": self.by_length(),
            "runs": [self.ours.as_dict(), *(r.as_dict() for r in self.torch_runs)],
        }


def compare_training(
    model: str = "llama",
    *,
    size: str | ModelSizes = "small",
    steps: int = 50,
    optimizer: Any = None,
    budget: float | None = None,
    seed: int = 0,
    torch_compile: bool = False,
    torch_checkpointing: bool = False,
    sft: bool = False,
    lora: bool = False,
    padding_side: str = "right",
    updates: str = "end",
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> TrainingComparison:
    """Run blade_relax's loop and PyTorch's on the same model, init and batches.

    Pre-training runs (the default) train on Markov-chain token batches whose lengths follow
    the bench's trace. Fine-tuning runs (``sft`` or ``lora``) train as users fine-tune: each
    step ``sizes.batch`` (prompt, response) pairs of the SFT trace (:mod:`.sft`; 4 when
    ``sizes.batch`` is 1), padded to the longest with an ``attention_mask``, labels ``-100``
    on prompt and padding; with ``lora`` only PEFT LoRA adapters are trained, the model
    frozen.

    Parameters
    ----------
    model
        A key of :data:`TRAIN_MODELS`.
    size
        ``"small"`` or ``"real"`` (:data:`blade_relax.bench.workloads.PRESETS`), or sizes.
    steps
        Optimizer steps (one batch each; the trace's last batch has the maximum length).
    optimizer
        A :class:`~blade_relax.training.InPlaceOptimizer` (default ``AdamW(lr=1e-3)``).
    budget
        A fractional memory budget for blade_relax's steps (``None``: none).
    seed
        Seed of the weights, the trace and the tokens.
    torch_compile
        Also run PyTorch's loop with ``torch.compile``.
    torch_checkpointing
        Also run PyTorch's eager loop with Hugging Face gradient checkpointing
        (``torch-eager-ckpt``), and with ``torch_compile`` the compiled one too.
    sft, lora
        Fine-tune (see above); ``lora`` implies ``sft``.
    padding_side
        Where fine-tuning batches are padded: ``"right"`` or ``"left"``.
    updates
        Where blade_relax's step applies the optimizer's updates
        (:data:`~blade_relax.training.trainer.TRAINER_UPDATES`).
    """
    from ..training import AdamW, Trainer

    say = log or (lambda _m: None)
    if model not in TRAIN_MODELS:
        raise ValueError(f"unknown model {model!r}; one of {sorted(TRAIN_MODELS)}")
    sft = sft or lora
    if sft and model not in SFT_MODELS:
        raise ValueError(f"fine-tuning runs take one of {sorted(SFT_MODELS)}, not {model!r}")
    sizes = PRESETS[size] if isinstance(size, str) else size
    optimizer = optimizer if optimizer is not None else AdamW(lr=1e-3)
    name = SFT_MODELS[model][int(lora)] if sft else TRAIN_MODELS[model]
    say(f"building {model} ({name}) and its training graph")
    workload = build_workload(name, sizes, seed=seed)
    graph, sizes = workload.graph, workload.sizes
    lengths, description, batches = training_batches(sizes, steps, sft, padding_side, seed)
    trainer = Trainer(graph, optimizer, updates=updates)
    say("compiling the training step (once for every length)")
    trainer.compile()
    say(f"blade_relax: {steps} steps")
    ours = trainer.fit(batches, steps, budget, progress=progress)
    torch_runs = _torch_runs(
        graph, optimizer, batches, steps, torch_compile, torch_checkpointing, say
    )
    loss_error, param_error = _errors(ours, trainer.parameters(), torch_runs[0])
    return TrainingComparison(
        ours=ours,
        torch_runs=torch_runs,
        lengths=list(lengths),
        trace=description,
        max_loss_error=loss_error,
        max_param_error=param_error,
        budget=budget,
        param_bytes=graph.param_bytes,
        settings={
            "model": model,
            "workload": name,
            "trainable_bytes": int(sum(p.nbytes for p in graph.params[: graph.num_trainable])),
            "sizes": {k: getattr(sizes, k) for k in sizes.__dataclass_fields__},
            "steps": steps,
            "optimizer": type(optimizer).__name__,
            "lr": optimizer.lr,
            "seed": seed,
            "updates": updates,
            "data": _data_description(sizes, sft, padding_side),
        },
    )


def _data_description(sizes: ModelSizes, sft: bool, padding_side: str) -> str:
    """What the batches are, for the settings of a comparison."""
    if sft:
        return (
            f"SFT: {sizes.batch} (prompt, response) pairs a step, padded on the "
            f"{padding_side}, random tokens, labels -100 on prompt and padding"
        )
    return "first-order Markov chain, 4 likely successors per token, 5 % noise"


def _errors(ours: Any, parameters: Sequence[Any], eager: Any) -> tuple[float, float]:
    """The largest relative difference to torch-eager's run: of the loss over the steps, and
    of a parameter (Frobenius) after the run."""
    loss_error = max(
        abs(a.loss - b.loss) / max(abs(b.loss), 1e-12) for a, b in zip(ours.records, eager.records)
    )
    param_error = max(
        float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        for a, b in zip(parameters, eager.parameters)
    )
    return loss_error, param_error


def training_batches(
    sizes: ModelSizes, steps: int, sft: bool, padding_side: str, seed: int
) -> tuple[list[int], str, list[Any]]:
    """The lengths of the trace, how they were drawn, and one batch per step: padded
    (prompt, response) pairs for fine-tuning, Markov-chain token batches otherwise."""
    from ..training.data import synthetic_batches

    if sft:
        trace = sft_trace(steps, sizes.batch, sizes.min_seq_len, sizes.max_seq_len, seed=seed)
        batches = [
            pad_batch(pairs, sizes.vocab, padding_side=padding_side, seed=seed + i)
            for i, pairs in enumerate(trace.steps)
        ]
        return trace.lengths, trace.distribution, batches
    trace = length_trace(steps, sizes.min_seq_len, sizes.max_seq_len, seed=seed)
    batches = synthetic_batches(sizes.vocab, trace.lengths, batch=sizes.batch, seed=seed)
    return list(trace.lengths), trace.distribution, batches


def _torch_runs(
    graph: Any,
    optimizer: Any,
    batches: Sequence[Any],
    steps: int,
    torch_compile: bool,
    torch_checkpointing: bool,
    say: Callable[[str], None],
) -> list[Any]:
    """PyTorch's loop on the same batches: eager first (the reference the checks compare
    with), then compiled and checkpointed as asked."""
    from ..training import torch_fit

    torch_runs = []
    say(f"torch-eager: {steps} steps")
    torch_runs.append(torch_fit(graph, optimizer, batches, steps))
    if torch_compile:
        say(f"torch-compile: {steps} steps")
        torch_runs.append(torch_fit(graph, optimizer, batches, steps, compile=True))
    if torch_checkpointing:
        say(f"torch-eager-ckpt: {steps} steps")
        torch_runs.append(torch_fit(graph, optimizer, batches, steps, checkpointing=True))
        if torch_compile:
            say(f"torch-compile-ckpt: {steps} steps")
            torch_runs.append(
                torch_fit(graph, optimizer, batches, steps, compile=True, checkpointing=True)
            )
    return torch_runs


def plot_training(result: TrainingComparison, path: str) -> None:
    """Loss and peak bytes per step, blade_relax against PyTorch, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [result.ours, *result.torch_runs]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    steps = [r.step for r in result.ours.records]
    for run in runs:
        x = [r.step for r in run.records]
        top.plot(x, run.losses, label=run.label, marker=".")
        middle.plot(x, [p / 2**20 for p in run.peaks], label=run.label, marker=".")
    bottom.bar(steps, result.lengths[: len(steps)], color="grey")
    top.set_ylabel("loss")
    middle.set_ylabel("peak of the step (MiB)")
    bottom.set_ylabel("sequence length")
    bottom.set_xlabel("step")
    title = f"{result.settings.get('workload')}: {result.settings.get('optimizer')}"
    if result.budget is not None:
        title += f", blade_relax budget {result.budget:g} x its own peak"
    top.set_title(title)
    top.legend()
    middle.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def summary_lines(result: TrainingComparison) -> Sequence[str]:
    """The table ``blade-relax train`` prints: per length, peaks and ratios."""
    labels = [r.label for r in result.torch_runs]
    head = f"{'length':>7} {'blade_relax':>13} " + " ".join(
        f"{label:>13} {'ratio':>6}" for label in labels
    )
    lines = [head]
    for row in result.by_length():
        cells = [f"{row['length']:>7} {row['blade_relax']:>13,}"]
        for label in labels:
            if label in row:
                cells.append(f"{row[label]:>13,} {row[f'ratio_{label}']:>6.3f}")
        lines.append(" ".join(cells))
    return lines

"""``blade-relax train``: blade_relax's training loop against PyTorch's, on the same batches.

Trains a bench model (Llama or GPT-2, random init) for ``--steps`` optimizer steps on synthetic
token batches of long-tailed lengths, with blade_relax's compiled step (optimizer in the graph,
one compilation) and with PyTorch's loop on the same init and batches
(:func:`blade_relax.bench.training.compare_training`); prints loss and peak bytes per length
against PyTorch's, writes a plot and JSON. Losses that differ from PyTorch's by more than
:data:`TRAIN_LOSS_RTOL` end the command with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from .. import load
from ..util.cliargs import CliError, available_memory, check_output_path, refuse_beyond_memory
from .common import add_force, add_verbose, parse_fraction, progress, write_text

__all__ = ["DEFAULT_TRAIN_PLOT", "TRAIN_LOSS_RTOL", "add_train_arguments", "run_train"]

# Default outputs go under out/ (created when missing), never loose into the current directory.
DEFAULT_TRAIN_PLOT = "out/train.png"
#: Largest relative difference of a loss to PyTorch's that ``train`` accepts, by dtype. In
#: bfloat16 (8 bits of mantissa) every rounding of a sum's partial results can differ by
#: 2^-8 = 3.9e-3; both sides round at other places, and the difference grows over the steps.
TRAIN_LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-3}
#: ``--dtype`` -> (ModelSizes.dtype, ModelSizes.autocast).
_DTYPES = {
    "float32": ("float32", None),
    "fp32": ("float32", None),
    "bf16": ("float32", "bfloat16"),
    "bf16-pure": ("bfloat16", None),
}


def add_train_arguments(subparsers: Any) -> None:
    """Add ``train`` and its flags to the subcommands of ``blade-relax``."""
    train = subparsers.add_parser(
        "train",
        help="train a model with the optimizer in the compiled step, against PyTorch's loop",
        description="Train a bench model (random init) on synthetic token batches whose "
        "lengths follow the bench's long-tailed trace, once with blade_relax (forward, backward "
        "and the optimizer in one compiled step, updated in place, one compilation for every "
        "length) and once with PyTorch's zero_grad/backward/step loop on the same init and "
        "batches. Prints the peak bytes of the full step (parameters and optimizer state "
        "counted once) per length and the ratio to PyTorch's, and checks the losses agree.",
    )
    train.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    train.add_argument(
        "--size", choices=("small", "real"), default="small", help="model sizes (default: small)"
    )
    train.add_argument("--steps", type=int, default=50, metavar="N", help="steps (default: 50)")
    train.add_argument(
        "--sft",
        action="store_true",
        help="fine-tune as users do: each step a batch of (prompt, response) pairs padded to the "
        "longest, with an attention_mask and labels -100 on prompt and padding (llama)",
    )
    train.add_argument(
        "--lora",
        action="store_true",
        help="fine-tune LoRA adapters (PEFT, rank 16 on every projection) on the frozen model "
        "(implies --sft)",
    )
    train.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="B",
        help="sequences a step (default: 4 with --sft/--lora, else 1)",
    )
    train.add_argument(
        "--dtype",
        choices=("float32", "fp32", "bf16", "bf16-pure"),
        default="float32",
        help="bf16: mixed precision as Hugging Face's Trainer(bf16=True) runs it (float32 "
        "weights, gradients and AdamW state, the forward under torch.autocast(bfloat16)); "
        "bf16-pure: the model, its gradients and AdamW state in bfloat16 (default: float32)",
    )
    train.add_argument(
        "--padding",
        choices=("right", "left"),
        default="right",
        help="where --sft batches are padded (default: right)",
    )
    train.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="FRACTION",
        help="run blade_relax's steps under a memory budget: this fraction in (0, 1] of each "
        "step's own peak without evictions (default: no budget)",
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train data-parallel over N processes on torch.distributed (gloo), the optimizer "
        "state sharded (ZeRO-2), each rank a block of the --batch rows; under torchrun, give "
        "its --nproc-per-node (default: 1, one process)",
    )
    train.add_argument(
        "--updates",
        choices=("end", "early", "auto"),
        default="end",
        help="where blade_relax's step applies the optimizer's updates: after the backward "
        "pass (end), each where its gradient is complete (early), or per batch the one whose "
        "predicted peak is lower (auto: both compiled) (default: end)",
    )
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="seed of init, trace and tokens")
    train.add_argument(
        "--torch-compile", action="store_true", help="also run PyTorch's loop with torch.compile"
    )
    train.add_argument(
        "--torch-ckpt",
        action="store_true",
        help="also run PyTorch's loop with Hugging Face gradient checkpointing "
        "(and compiled, with --torch-compile)",
    )
    _add_output_arguments(train)


def _add_output_arguments(train: Any) -> None:
    """What ``train`` writes and shows: the plot, the JSON, the progress bar, and --force."""
    train.add_argument(
        "--plot",
        default=DEFAULT_TRAIN_PLOT,
        metavar="PATH",
        help=f"PNG of loss and peak per step (default: {DEFAULT_TRAIN_PLOT}; missing folders "
        "are created)",
    )
    train.add_argument("--no-plot", action="store_true", help="do not write the plot")
    train.add_argument("--json", metavar="PATH", help="write the runs as JSON here")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_force(
        train,
        "what the step at --size and --batch holds at least (parameters, optimizer state, "
        "token ids, logits of the longest batch)",
    )
    add_verbose(train)


def run_train(args: argparse.Namespace) -> int:
    """``blade-relax train``: blade_relax's training loop against PyTorch's."""
    if args.steps < 1:
        raise CliError(f"--steps must be positive, not {args.steps}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise CliError(f"--lr must be a positive number, not {args.lr}")
    budget = parse_fraction(args.budget) if args.budget is not None else None
    if args.batch is not None and args.batch < 1:
        raise CliError(f"--batch must be positive, not {args.batch}")
    sft = args.sft or args.lora
    if args.nproc < 1:
        raise CliError(f"--nproc must be positive, not {args.nproc}")
    if args.nproc > 1:
        for flag, given in (
            ("--budget", budget is not None),
            ("--torch-compile", args.torch_compile),
            ("--torch-ckpt", args.torch_ckpt),
        ):
            if given:
                raise CliError(f"{flag} is not offered with --nproc")
        if args.batch is not None and args.batch < args.nproc:
            raise CliError(f"--batch {args.batch} cannot be shared by --nproc {args.nproc} ranks")
    if sft and args.model != "llama":
        raise CliError(f"--sft and --lora fine-tune --model llama, not {args.model}")
    dtype, autocast = _DTYPES[args.dtype]
    plot = None if args.no_plot else check_output_path(args.plot, "--plot")
    json_path = check_output_path(args.json, "--json")
    load()
    from ..bench.training import SFT_MODELS, TRAIN_MODELS, compare_training, plot_training
    from ..bench.workloads import PRESETS
    from ..training import SGD, AdamW

    sizes = dataclasses.replace(PRESETS[args.size], dtype=dtype, autocast=autocast)
    if args.batch is not None or args.nproc > 1:
        sizes = dataclasses.replace(sizes, batch=args.batch or max(args.nproc, sizes.batch))
    workload = SFT_MODELS[args.model][int(args.lora)] if sft else TRAIN_MODELS[args.model]
    _refuse_training_beyond_memory(args, workload, sizes)
    optimizer = AdamW(lr=args.lr) if args.optimizer == "adamw" else SGD(args.lr, momentum=0.9)
    if args.nproc > 1:
        from .train_ranks import run_train_ranks

        return run_train_ranks(args, sizes, workload, optimizer)
    result = compare_training(
        args.model,
        size=sizes,
        steps=args.steps,
        optimizer=optimizer,
        budget=budget,
        seed=args.seed,
        torch_compile=args.torch_compile,
        torch_checkpointing=args.torch_ckpt,
        sft=sft,
        lora=args.lora,
        padding_side=args.padding,
        updates=args.updates,
        progress=not args.no_progress,
        log=progress,
    )
    _print_training(args, result, budget, sft)
    if json_path is not None:
        write_text(json_path, json.dumps(result.as_dict(), indent=2) + "\n", "--json")
    if plot is not None:
        plot_training(result, plot)
        progress(f"wrote {plot}")
    tolerance = TRAIN_LOSS_RTOL[autocast or dtype]
    if result.max_loss_error > tolerance:
        print(
            f"check failed: the losses differ from PyTorch's by {result.max_loss_error:.2e} "
            f"(> {tolerance:g})",
            file=sys.stderr,
        )
        return 1
    return 0


def _print_training(args: argparse.Namespace, result: Any, budget: float | None, sft: bool) -> None:
    """What the run was, its peaks per length against PyTorch's, its losses and its budget."""
    from ..bench.training import summary_lines

    ours = result.ours
    print(
        f"model: {result.settings['workload']} ({args.size}), {args.steps} steps of "
        f"{result.settings['optimizer']} (lr {args.lr:g}), seed {args.seed}"
    )
    print(f"lengths: {result.trace}")
    trainable = result.settings["trainable_bytes"]
    print(
        f"parameters: {result.param_bytes:,} bytes"
        + (f" ({trainable:,} trained, the rest frozen)" if trainable != result.param_bytes else "")
        + f"; blade_relax holds parameters, optimizer state and scalars: "
        f"{ours.persistent_bytes:,} bytes"
    )
    if sft:
        print(f"batches: {result.settings['data']}")
    print(
        f"blade_relax: {ours.compilations} compilation{'s' if ours.compilations != 1 else ''} "
        f"({ours.compile_time_s:.1f} s)"
        + (f", budget {budget:g} x each step's own peak" if budget is not None else "")
    )
    print(
        "peak bytes of the full step (parameters and optimizer state counted once), the "
        "highest at each length:"
    )
    for line in summary_lines(result):
        print("  " + line)
    first, last = ours.records[0], ours.records[-1]
    print(
        f"loss: step 1 {first.loss:.5f}, step {last.step} {last.loss:.5f}; largest relative "
        f"difference to torch-eager {result.max_loss_error:.2e} (loss), "
        f"{result.max_param_error:.2e} (parameters after the run)"
    )
    evictions = sum(r.evictions for r in ours.records)
    if budget is not None:
        held = sum(1 for r in ours.records if r.budget_reachable)
        print(
            f"budget held at {held} of {len(ours.records)} steps (elsewhere tensors no "
            f"eviction removes exceed it: those steps ran at their smallest reachable peak); "
            f"evictions over the run: {evictions}"
        )


def _refuse_training_beyond_memory(args: argparse.Namespace, workload: str, sizes: Any) -> None:
    """Refuse (one line, exit 2) a ``train`` whose step cannot fit, before the model is built.

    The floor (:func:`blade_relax.bench.floor.memory_floor`) is counted from the sizes alone:
    building the model draws its weights, and at such sizes the run would die of numpy's
    ``MemoryError`` or the OOM killer long after the cause.
    """
    from ..bench.floor import memory_floor

    # Per trainable parameter: AdamW keeps two moments, SGD (with momentum) one buffer.
    states = {"adamw": ("AdamW", 2), "sgd": ("SGD momentum", 1)}
    name, per_param = states[args.optimizer]
    floor = memory_floor(workload, sizes, optimizer=name, state_per_param=per_param)
    batch = f" --batch {args.batch}" if args.batch is not None else ""
    refuse_beyond_memory(
        f"--size {args.size}{batch}: blade_relax's {workload} step at s={floor.length}",
        floor.total,
        floor.describe(),
        available_memory(),
        force=args.force,
        before="building the model",
        floor=True,
    )

"""``blade-relax train --nproc N``: the training run data-parallel over N processes.

Without torchrun's environment the command launches itself N times through PyTorch's elastic
launcher (what ``torchrun --nproc-per-node N`` runs, one machine, a free port) and returns the
worst status of its ranks; under torchrun (``RANK`` and ``WORLD_SIZE`` set, e.g. ``torchrun
--nproc-per-node 2 -m blade_relax.cli train --nproc 2``) each process is one rank. Each rank
joins the process group (gloo on the CPU), builds the same model (same seed) with a dynamic
batch axis, and trains it with :class:`~blade_relax.training.data_parallel.DataParallelTrainer`
on the same global batches: its block of rows, the optimizer state sharded. Rank 0 then runs
PyTorch's single-process loop on the whole batches (the reference the losses are checked
against, as ``train`` does), and prints, per length, each rank's measured peak, the largest
difference of a rank's predicted peak
(:meth:`~blade_relax.training.data_parallel.DataParallelTrainer.predicted_batch_peak`) to its
measured one, and the single-process PyTorch peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ..util.cliargs import CliError
from .common import progress, write_text

__all__ = ["run_train_ranks"]


def run_train_ranks(args: argparse.Namespace, sizes: Any, workload: str, optimizer: Any) -> int:
    """Launch the ranks, or run this process's rank under torchrun's environment."""
    if "RANK" not in os.environ:
        return _launch(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.nproc:
        raise CliError(f"--nproc {args.nproc} but torchrun started {world} processes")
    return _run_rank(args, sizes, workload, optimizer)


def _launch(args: argparse.Namespace) -> int:
    """Run this command once per rank (PyTorch's elastic launcher); the worst status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"blade-relax-{os.getpid()}",
        max_restarts=0,
        monitor_interval=0.2,
    )
    from ..training.data_parallel import rank_threads

    try:
        with rank_threads(args.nproc) as threads:
            progress(f"launching {args.nproc} ranks (gloo), {threads} thread(s) each")
            elastic_launch(config, sys.executable)("-m", "blade_relax.cli", *args.argv)
    except ChildFailedError as failed:
        codes = [f.exitcode for f in failed.failures.values()]
        return max(codes) if all(c in (1, 2) for c in codes) else 1
    return 0


def _graph(args: argparse.Namespace, sizes: Any, workload: str) -> Any:
    """The model's training graph, with a dynamic batch axis (a rank runs its rows)."""
    from ..bench.workloads import build_workload, gpt2_model, import_sized, llama_model

    if workload not in ("llama-train", "gpt2-train"):
        return build_workload(workload, sizes, seed=args.seed).graph  # batches already dynamic
    model = (llama_model if workload == "llama-train" else gpt2_model)(sizes, seed=args.seed)
    return import_sized(model, sizes, max_batch_size=sizes.batch)


def _run_rank(args: argparse.Namespace, sizes: Any, workload: str, optimizer: Any) -> int:
    """Train as one rank; rank 0 checks the losses against PyTorch's and reports."""
    import torch.distributed as dist

    from ..bench.training import training_batches
    from ..training import torch_fit
    from ..training.data_parallel import DataParallelTrainer, init_from_environment

    rank, world = init_from_environment("gloo")
    try:
        sft = args.sft or args.lora
        _lengths, trace, batches = training_batches(sizes, args.steps, sft, args.padding, args.seed)
        graph = _graph(args, sizes, workload)
        trainer = DataParallelTrainer(graph, optimizer, updates=args.updates)
        trainer.compile()
        history = trainer.fit(batches, args.steps, progress=rank == 0 and not args.no_progress)
        predicted = [trainer.predicted_batch_peak(batch) for batch in batches[: args.steps]]
        peaks = [(r.peak_bytes, p) for r, p in zip(history.records, predicted)]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, peaks)
        if rank != 0:
            return 0
        # torch_fit reads the optimizer's hyperparameters only, and makes its own state.
        reference = torch_fit(graph, optimizer, batches, args.steps)
        return _report(args, history, reference, gathered, trace, sizes)
    finally:
        dist.destroy_process_group()


def _report(
    args: argparse.Namespace,
    history: Any,
    reference: Any,
    gathered: list[Any],
    trace: str,
    sizes: Any,
) -> int:
    """Print the per-length table and the loss check; write JSON; the status."""
    from .train import TRAIN_LOSS_RTOL

    rows: dict[int, dict[str, Any]] = {}
    for i, record in enumerate(history.records):
        row = rows.setdefault(record.length, {"ranks": [0] * args.nproc, "torch": 0, "off": 0})
        for rank, peaks in enumerate(gathered):
            measured, predicted = peaks[i]
            row["ranks"][rank] = max(row["ranks"][rank], measured)
            if abs(predicted - measured) > abs(row["off"]):
                row["off"] = predicted - measured
        row["torch"] = max(row["torch"], reference.records[i].peak_bytes)
    print(f"data-parallel over {args.nproc} ranks (gloo), sharded AdamW state; lengths: {trace}")
    ranks = " | ".join(f"rank {r}" for r in range(args.nproc))
    print(f"| s | {ranks} | predicted - measured | torch, 1 process |")
    print("|---:|" + "---:|" * (args.nproc + 2))
    for length in sorted(rows):
        row = rows[length]
        cells = " | ".join(f"{b:,}" for b in row["ranks"])
        print(f"| {length} | {cells} | {row['off']:+,} | {row['torch']:,} |")
    error = max(
        abs(a.loss - b.loss) / max(abs(b.loss), 1e-30)
        for a, b in zip(history.records, reference.records)
    )
    print(f"loss: largest relative difference to PyTorch's single-process loop {error:.2e}")
    if args.json:
        payload = {
            "nproc": args.nproc,
            "sizes": dataclasses.asdict(sizes),
            "lengths": [r.length for r in history.records],
            "losses": history.losses,
            "torch_losses": reference.losses,
            "rank_peaks": [[m for m, _ in peaks] for peaks in gathered],
            "predicted_peaks": [[p for _, p in peaks] for peaks in gathered],
            "torch_peaks": reference.peaks,
        }
        write_text(args.json, json.dumps(payload, indent=2) + "\n", "--json")
    tolerance = TRAIN_LOSS_RTOL[sizes.autocast or sizes.dtype]
    if error > tolerance:
        print(
            f"check failed: the losses differ from PyTorch's by {error:.2e} (> {tolerance:g})",
            file=sys.stderr,
        )
        return 1
    return 0

"""The data-parallel benchmark: blade_relax's sharded step (ZeRO stage 2) against PyTorch DDP and
FSDP2, per rank, on ``torch.distributed`` with gloo on the CPU.

``python -m blade_relax.bench.distributed`` spawns ``--nproc`` processes (default 2, gloo, a
free local port). Every process builds the same Llama (the bench's ``small`` sizes unless
overridden, seeded weights, imported with a dynamic batch axis up to the global batch) and the
same global batches: ``--rows`` rows per rank (default 2), token ids as labels, one batch per
entry of the bench's length trace (:mod:`.trace`, ``--trace-len`` entries). Each process then
runs three loops on those batches, one after the other, each after one warm-up step on the
trace's first batch that is not recorded (PyTorch's AdamW makes its state at its first step,
ours exists from the start: from the second step on every run holds what a long run holds):
blade_relax
(:class:`~blade_relax.training.data_parallel.DataParallelTrainer`), ``torch-ddp`` and
``torch-fsdp2`` (:func:`~blade_relax.training.torch_data_parallel.torch_data_parallel_fit`),
AdamW for all. Per length it reports the per-rank full-step peak (the largest over the ranks),
the median step time (time is noisy on a shared CPU: compare the ratios of one run), the
ratios of blade_relax's peak to FSDP2's and DDP's, the largest relative difference of the three
losses, and whether blade_relax's predicted peak equals its measured one on every rank.

``--predict`` runs no process: it predicts blade_relax's per-rank peak of the sharded step at
the 1.1B Llama (:data:`.workloads.LLAMA_1B`) and at Llama-2 7B's shape for ``--world`` ranks
(default 8), against the same step on one process, without compiling a kernel
(:func:`blade_relax.training.step_peak.predicted_step_peak`). The 7B model (27 GB of float32
parameters) is not built: its prediction is extrapolated, exactly for the parameters and
state and linearly in the layers for the step's own peak, from the same shape with 1 and 2
layers; the same extrapolation is checked against the direct prediction at 1.1B.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..training.step import UPDATE_PLACEMENTS
from ..training.trainer import TRAINER_UPDATES
from .trace import length_trace
from .workloads import LLAMA_1B, SMALL, ModelSizes

__all__ = [
    "LLAMA_7B",
    "compare_data_parallel",
    "format_table",
    "main",
    "predict_sharded",
    "run_label",
    "run_ranks",
]

#: Llama-2 7B's shape (multi-head attention: as many key/value heads as heads).
LLAMA_7B = ModelSizes(
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=32,
    intermediate=11008,
    vocab=32000,
    max_seq_len=4096,
)
RUNS = ("blade_relax", "torch-ddp", "torch-fsdp2")
LR = 1e-3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # reported to the parent, which raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 3600) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` spawned processes joined in a gloo process group,
    each with its share of the cores (:func:`~blade_relax.training.data_parallel.rank_threads`);
    the results in rank order. ``fn`` and ``args`` must pickle (a module-level function).

    Raises
    ------
    RuntimeError
        When a rank raised (with its traceback) or died.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world, port, queue, args))
        for rank in range(world)
    ]
    from ..training.data_parallel import rank_threads

    with rank_threads(world):  # the spawned ranks inherit the environment when started
        for proc in procs:
            proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    return [results[r] for r in range(world)]


def _graph(sizes: ModelSizes, rows: int) -> Any:
    from .workloads import import_sized, llama_model

    return import_sized(llama_model(sizes, seed=0), sizes, max_batch_size=rows)


def _batches(graph: Any, rows: int, lengths: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Global batches of ``rows`` rows, one per length: seeded ids, the ids as labels."""
    out = []
    for i, length in enumerate(lengths):
        ids = np.random.default_rng(i).integers(0, graph.int_input_high, (rows, length))
        out.append({"input_ids": ids.astype("int64"), "labels": ids.astype("int64")})
    return out


def _bench_rank(
    rank: int, world: int, sizes: ModelSizes, rows: int, lengths: list[int], updates: str
) -> dict:
    """One rank of :func:`compare_data_parallel`: the three runs' histories, blade_relax's
    predicted peaks."""
    from ..contract import owned_rows
    from ..training import AdamW
    from ..training.data_parallel import DataParallelTrainer
    from ..training.torch_data_parallel import torch_data_parallel_fit

    graph = _graph(sizes, rows * world)
    batches = _batches(graph, rows * world, lengths)
    # One warm-up step first, on the trace's first batch, not recorded: PyTorch's AdamW makes
    # its state at its first step (ours exists from the start), so only from the second step
    # on does every run hold what it holds in a long run.
    warmed = batches[:1] + batches
    local_rows = np.subtract(*owned_rows(rows * world, world, rank)[::-1])
    trainer = DataParallelTrainer(graph, AdamW(lr=LR), updates=updates)
    ours = trainer.fit(warmed, progress=False)
    predicted = [trainer.predicted_peak({"b": int(local_rows), "s": s}) for s in lengths]
    runs = [ours] + [
        torch_data_parallel_fit(graph, AdamW(lr=LR), warmed, mode=m) for m in ("ddp", "fsdp2")
    ]
    for history in runs:
        history.records = history.records[1:]
    return {"histories": [h.as_dict() for h in runs], "predicted": predicted}


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def _rows_by_length(per_rank: list[dict], lengths: list[int]) -> list[dict[str, Any]]:
    """Per distinct length: each run's peak (max over ranks) and median time."""
    table = []
    for length in sorted(set(lengths)):
        steps = [i for i, s in enumerate(lengths) if s == length]
        row: dict[str, Any] = {"length": length}
        for run_index, label in enumerate(RUNS):
            records = [r["histories"][run_index]["steps"] for r in per_rank]
            row[f"{label}_peak"] = max(rec[i]["peak_bytes"] for rec in records for i in steps)
            row[f"{label}_time_s"] = _median(
                [max(rec[i]["time_s"] for rec in records) for i in steps]
            )
        ours = row["blade_relax_peak"]
        row["ours/fsdp2"] = ours / row["torch-fsdp2_peak"]
        row["ours/ddp"] = ours / row["torch-ddp_peak"]
        row["predicted_equals_measured"] = all(
            r["predicted"][i] == r["histories"][0]["steps"][i]["peak_bytes"]
            for r in per_rank
            for i in steps
        )
        table.append(row)
    return table


def compare_data_parallel(
    sizes: ModelSizes = SMALL,
    lengths: Sequence[int] | None = None,
    *,
    rows: int = 2,
    world: int = 2,
    trace_len: int = 6,
    seed: int = 0,
    updates: str = "end",
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring) and return its JSON-ready result;
    ``updates`` places blade_relax's updates (:func:`~blade_relax.training.build_training_step`)."""
    trace = None
    if lengths is None:
        trace = length_trace(trace_len, sizes.min_seq_len, sizes.max_seq_len, seed=seed)
        lengths = list(trace.lengths)
    lengths = [int(s) for s in lengths]
    per_rank = run_ranks(_bench_rank, world, sizes, rows, lengths, updates)
    losses = np.array([[s["loss"] for s in h["steps"]] for h in per_rank[0]["histories"]])
    max_rel = float(np.max(np.abs(losses[1:] - losses[0]) / np.abs(losses[0])))
    return {
        "sizes": dataclasses.asdict(sizes),
        "world_size": world,
        "updates": updates,
        "rows_per_rank": rows,
        "lengths": lengths,
        "trace": None if trace is None else trace.distribution,
        "runs": list(RUNS),
        "rows": _rows_by_length(per_rank, lengths),
        "max_loss_rel_diff": max_rel,
        "losses": {label: losses[i].tolist() for i, label in enumerate(RUNS)},
        "per_rank": per_rank,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def format_table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`compare_data_parallel`'s result."""
    lines = [
        "| s | ours MiB | FSDP2 MiB | DDP MiB | ours/FSDP2 | ours/DDP | ours ms | FSDP2 ms "
        "| DDP ms | predicted == measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ms = [f"{row[f'{k}_time_s'] * 1e3:.0f}" for k in RUNS]
        lines.append(
            f"| {row['length']} | {_mib(row['blade_relax_peak'])} | "
            f"{_mib(row['torch-fsdp2_peak'])} | {_mib(row['torch-ddp_peak'])} | "
            f"{row['ours/fsdp2']:.3f} | {row['ours/ddp']:.3f} | {ms[0]} | {ms[2]} | {ms[1]} | "
            f"{row['predicted_equals_measured']} |"
        )
    lines.append(
        f"\nmax relative loss difference of the three runs: {result['max_loss_rel_diff']:.2e}"
    )
    return "\n".join(lines)


def _predicted_at(sizes: ModelSizes, world: int, rows: int, lengths: Sequence[int]) -> dict:
    """blade_relax's per-rank predicted peak of the sharded step of ``sizes`` over ``world``
    ranks and of the same step on one process, at ``rows`` rows per rank and each length, with
    the updates after the backward pass (``sharded``, ``one``) and each where it may first run
    (``sharded-early``, ``one-early``); also the bytes held across steps of each."""
    from ..frontend.hf import import_training_step
    from ..training import AdamW, ZeroSharding, build_training_step
    from ..training.step_peak import lower_step, persistent_step_bytes, predicted_step_peak
    from .workloads import llama_model

    graph = import_training_step(
        llama_model(sizes, seed=0, weights="empty"),
        max_seq_len=sizes.max_seq_len,
        max_batch_size=rows * world,
    )
    out: dict[str, Any] = {}
    runs = [("sharded", ZeroSharding(world)), ("one", None)]
    for (run, sharding), updates in itertools.product(runs, UPDATE_PLACEMENTS):
        label = run_label(run, updates)
        step = build_training_step(graph, AdamW(), sharding, updates=updates)
        lowered = lower_step(step)
        out[label] = {
            "persistent_bytes": persistent_step_bytes(step),
            "peaks": [
                predicted_step_peak(step, {"b": rows, "s": s}, lowered=lowered) for s in lengths
            ],
        }
    return out


def run_label(run: str, updates: str) -> str:
    """The key of a prediction of ``--predict``: ``run`` (``"sharded"``, ``"one"``) with the
    updates at the end, ``"<run>-<updates>"`` otherwise."""
    return run if updates == "end" else f"{run}-{updates}"


def _extrapolated(by_layers: dict[int, dict], layers: int) -> dict:
    """Predictions at ``layers`` from those at 1 and 2 layers: each figure linear in layers."""
    one, two = by_layers[1], by_layers[2]

    def line(a: float, b: float) -> int:
        return int(a + (b - a) * (layers - 1))

    out = {}
    for label in one:
        held = [one[label]["persistent_bytes"], two[label]["persistent_bytes"]]
        # The step's own peak is linear in the layers only while its moment stays where the
        # layers' part grows; where it falls from 1 to 2 layers the line means nothing: None.
        peaks = [
            line(a, b) if b - held[1] >= a - held[0] else None
            for a, b in zip(one[label]["peaks"], two[label]["peaks"])
        ]
        out[label] = {"persistent_bytes": line(*held), "peaks": peaks}
    return out


def predict_sharded(
    world: int = 8, lengths: Sequence[int] = (512, 2048), rows: int = 1, *, check: bool = True
) -> dict[str, Any]:
    """``--predict`` (see the module docstring): per model, the per-rank peaks of the sharded
    step and of the step on one process at ``rows`` rows per rank, at each length."""
    from .report import provenance

    command = f"python -m blade_relax.bench.distributed --predict --world {world}"
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "world_size": world,
        "rows_per_rank": rows,
        "lengths": list(lengths),
    }
    small = {
        n: _predicted_at(dataclasses.replace(LLAMA_1B, layers=n), world, rows, lengths)
        for n in (1, 2)
    }
    result["llama-1.1b"] = _predicted_at(LLAMA_1B, world, rows, lengths) if check else None
    result["llama-1.1b-extrapolated"] = _extrapolated(small, LLAMA_1B.layers)
    result["llama-1.1b-by-layers"] = small
    big = {
        n: _predicted_at(dataclasses.replace(LLAMA_7B, layers=n), world, rows, lengths)
        for n in (1, 2)
    }
    result["llama-7b-extrapolated"] = _extrapolated(big, LLAMA_7B.layers)
    result["llama-7b-by-layers"] = big
    return result


def format_prediction(result: dict[str, Any]) -> str:
    lines = [
        f"per-rank predicted full-step peak, {result['world_size']} ranks, "
        f"{result['rows_per_rank']} row(s) per rank (GiB)",
        "",
        "| model | updates | s | sharded | one process | sharded/one | held sharded | held one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in ("llama-1.1b", "llama-1.1b-extrapolated", "llama-7b-extrapolated"):
        got = result.get(model)
        if not got:
            continue
        for updates in UPDATE_PLACEMENTS:
            if run_label("sharded", updates) not in got:
                continue
            sharded_run = got[run_label("sharded", updates)]
            one_run = got[run_label("one", updates)]
            for i, s in enumerate(result["lengths"]):
                sharded, one = sharded_run["peaks"][i], one_run["peaks"][i]
                gib = [f"{x / 2**30:.2f}" if x else "n/a" for x in (sharded, one)]
                ratio = f"{sharded / one:.3f}" if sharded and one else "n/a"
                lines.append(
                    f"| {model} | {updates} | {s} | {gib[0]} | {gib[1]} | {ratio} | "
                    f"{sharded_run['persistent_bytes'] / 2**30:.2f} | "
                    f"{one_run['persistent_bytes'] / 2**30:.2f} |"
                )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m blade_relax.bench.distributed",
        description="Per-rank peak memory and step time of blade_relax's sharded data-parallel "
        "step against PyTorch DDP and FSDP2 (gloo, CPU); --predict: per-rank predictions at 1.1B "
        "and 7B.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--rows", type=int, default=2, help="rows per rank (default 2)")
    parser.add_argument("--trace-len", type=int, default=6, help="entries of the trace (6)")
    parser.add_argument("--lengths", help="comma-separated lengths instead of the trace")
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace (0)")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_seq_len"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override {name}")
    parser.add_argument(
        "--updates",
        choices=TRAINER_UPDATES,
        default="end",
        help="where our step applies the updates (end: after the backward pass; auto: per "
        "length, the placement predicted lower)",
    )
    parser.add_argument("--predict", action="store_true", help="predict at 1.1B and 7B instead")
    parser.add_argument("--world", type=int, default=8, help="ranks of --predict (8)")
    parser.add_argument("--predict-lengths", default="512,2048", help="lengths of --predict")
    parser.add_argument("--output", help="JSON path (default out/distributed[-predict].json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.predict:
        lengths = [int(x) for x in args.predict_lengths.split(",")]
        result = predict_sharded(args.world, lengths, rows=1)
        text = format_prediction(result)
    else:
        overrides = {
            k: getattr(args, k)
            for k in (
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "intermediate",
                "vocab",
                "max_seq_len",
            )
            if getattr(args, k) is not None
        }
        sizes = dataclasses.replace(SMALL, **overrides)
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
        result = compare_data_parallel(
            sizes,
            lengths,
            rows=args.rows,
            world=args.nproc,
            trace_len=args.trace_len,
            seed=args.seed,
            updates=args.updates,
        )
        text = format_table(result)
    print(text)
    default = "out/distributed-predict.json" if args.predict else "out/distributed.json"
    path = Path(args.output or default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

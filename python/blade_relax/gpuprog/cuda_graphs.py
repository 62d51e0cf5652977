"""The ``cuda-graphs`` step: gpt2-infer at short lengths, with and without CUDA graphs.

``python -m blade_relax.gpuprog cuda-graphs --carried .gpuprog --out $OUT/cuda-graphs.json``
reads the carried ``gpt2-infer`` graph (the dry run carries it with the benchmark workloads),
builds the model's weights with this machine's torch, and compiles two executables with one
static copy of ``main`` per bucket of :data:`~.plan.CUDA_GRAPH_BUCKETS`
(:func:`~blade_relax.gpuprog.buckets.compile_buckets`, blade_relax's pipeline
without remat): ``graphs`` (TVM's ``RewriteCUDAGraph`` on, one pool shared by all buckets) and
``plain`` (the same copies, kernels launched one by one). Both compile before the GPU is
taken (:data:`~.plan.LOCK_ENV`). Then, per executable: every bucket is called once (with
graphs: warm-up, capture, instantiation, timed as ``capture_s``), and at each length of
:data:`~.plan.CUDA_GRAPH_LENGTHS` the padded step is checked against torch and timed (wall
time of ``repeat`` calls, each synchronised, median), its memory counted by the accounting
(``call_peak_bytes``: what one call adds; ``resident_bytes``: what was live before it, the pool
with graphs; ``peak_bytes``: the highest live bytes over the whole run of that executable).

The JSON holds the rows, the pool as planned (:class:`~blade_relax.analysis.cuda_graph_pool.
PoolPlan`: each bucket's static storages, the pool's slots, what one pool per bucket would
cost) and as allocated by ``cuda_graph_alloc``; a Markdown table goes next to it (the program
folds it into its summary). ``--target llvm`` runs the same on the CPU (no graphs), to check
the step without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .plan import (
    CUDA_GRAPH_MODES,
    CUDA_GRAPH_WORKLOAD,
    LOCK_ENV,
    cuda_graph_buckets,
    cuda_graph_lengths,
)

__all__ = ["build_modes", "main", "markdown", "max_relative_error", "measure_mode"]


def _say(message: str) -> None:
    print(message, flush=True)


def build_modes(
    graph: Any, target: dict[str, str], buckets: Sequence[int], modes: Sequence[str]
) -> dict[str, Any]:
    """Compile the bucketed executable of each mode (``"graphs"``, ``"plain"``) for
    ``target``: mode -> :class:`~blade_relax.gpuprog.buckets.BucketedBuild`."""
    import tvm

    from ..runtime.devices import configure_cuda_compiler
    from .buckets import compile_buckets

    if target["kind"] == "cuda":
        configure_cuda_compiler()
    tgt = tvm.target.Target(target)
    builds = {}
    for mode in modes:
        builds[mode] = compile_buckets(graph.mod, tgt, buckets, graphs=mode == "graphs")
    return builds


def max_relative_error(got: Any, want: Any) -> float:
    """The largest absolute difference over the largest magnitude of ``want`` (in float64)."""
    import numpy as np

    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _time_calls(runner: Any, bucket: int, args: list[Any], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = runner.run_bucket(bucket, args)
        runner.device.sync()
        times.append(time.perf_counter() - start)
        del result
    return times


def measure_mode(
    mode: str,
    workload: Any,
    build: Any,
    device: Any,
    lengths: Sequence[int],
    repeat: int,
    tolerance: float,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the executable of ``mode`` at every length: the rows, and what the whole run
    cost."""
    from ..runtime import measure_memory, memory_stats, reset_memory_stats
    from ..runtime.cuda_graphs import BucketedRunner, LengthBuckets, Padding

    graph = workload.graph
    padding = Padding(tuple(build.input_axes), tuple(build.output_axes), causal=True)
    reset_memory_stats()
    runner = BucketedRunner(device=device, executable=build.executable,
                            buckets=LengthBuckets(build.lengths), padding=padding,
                            params=graph.params)  # fmt: skip
    capture = runner.capture(workload.inputs(min(lengths)))
    rows = []
    peak = 0  # measure_memory resets the thread's peak: the run's is the largest seen
    for length in lengths:
        inputs = workload.inputs(length)
        error = max_relative_error(runner(*inputs)[0], graph.reference(inputs)[0])
        bucket = runner.buckets.bucket_for(length)
        args = runner.to_device(inputs, bucket)
        times = _time_calls(runner, bucket, args, repeat)
        peak = max(peak, memory_stats()["peak_bytes"])
        with measure_memory(runner.vm) as memory:
            result = runner.run_bucket(bucket, args)
            runner.device.sync()
        del result
        peak = max(peak, memory.peak_absolute)
        rows.append(
            {
                "length": length,
                "bucket": bucket,
                "mode": mode,
                "captured": runner.graphs,
                "median_ms": round(statistics.median(times) * 1e3, 4),
                "min_ms": round(min(times) * 1e3, 4),
                "call_peak_bytes": memory.peak_bytes,
                "resident_bytes": memory.live_before,
                "rel_error": error,
                "correct": error <= tolerance,
            }
        )
        _say(f"{rows[-1]['mode']} s={length} (bucket {bucket}): {rows[-1]['median_ms']:.3f} ms, "
             f"rel. error {error:.1e}")  # fmt: skip
    whole = {
        "peak_bytes": max(peak, memory_stats()["peak_bytes"]),
        "capture_s": {str(b): round(s, 4) for b, s in capture.items()},
        "graphs": runner.graphs,
    }
    return rows, whole


def markdown(doc: dict[str, Any]) -> str:
    """The step's table: each length's time with and without graphs, and the pool."""
    mib = 1 << 20
    by = {(r["length"], r["mode"]): r for r in doc["rows"]}
    lines = [
        "| s | bucket | plain ms | graphs ms | speedup | call peak MiB (plain / graphs) | "
        "max rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for length in doc["lengths"]:
        plain, graphs = by.get((length, "plain")), by.get((length, "graphs"))
        either = graphs or plain
        speedup = f"{plain['median_ms'] / graphs['median_ms']:.2f}x" if plain and graphs else "-"
        peaks = " / ".join(
            f"{r['call_peak_bytes'] / mib:.2f}" if r else "-" for r in (plain, graphs)
        )
        error = max(r["rel_error"] for r in (plain, graphs) if r)
        lines.append(
            f"| {length} | {either['bucket']} | {plain['median_ms'] if plain else '-'} | "
            f"{graphs['median_ms'] if graphs else '-'} | {speedup} | {peaks} | {error:.1e} |"
        )
    pool = doc["pool"]
    lines += [
        "",
        f"Pool shared by buckets {doc['buckets']}: {pool['pool_bytes'] / mib:.2f} MiB planned "
        f"({pool['largest_bytes'] / mib:.2f} MiB for the largest bucket alone, "
        f"{pool['unshared_bytes'] / mib:.2f} MiB with one pool per bucket), "
        f"{pool['allocated_bytes'] / mib:.2f} MiB allocated by cuda_graph_alloc. Peak over the "
        "run: "
        + ", ".join(
            f"{mode} {whole['peak_bytes'] / mib:.2f} MiB" for mode, whole in doc["runs"].items()
        )
        + ".",
    ]
    return "\n".join(lines)


def _pool_doc(builds: dict[str, Any]) -> dict[str, Any]:
    build = builds.get("graphs") or next(iter(builds.values()))
    plan = build.pool
    return {
        "functions": {name: list(sizes) for name, sizes in plan.functions.items()},
        "slots": list(plan.pool),
        "pool_bytes": plan.pool_bytes,
        "largest_bytes": plan.largest_bytes,
        "excess_bytes": plan.excess_bytes,
        "unshared_bytes": plan.unshared_bytes,
        "allocated_bytes": sum(build.allocated_pool),
    }


def main(argv: Sequence[str]) -> int:
    """The step's command line; 0 when every row matched torch."""
    parser = argparse.ArgumentParser(prog="python -m blade_relax.gpuprog cuda-graphs")
    parser.add_argument("--carried", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=5e-4)
    parser.add_argument("--target", default="cuda", help="cuda (the GPU's arch) or llvm")
    parser.add_argument("--modes", default=",".join(CUDA_GRAPH_MODES))
    args = parser.parse_args(list(argv))

    import os

    from .. import quiet
    from .__main__ import _bench_target, gpu_lock
    from .carried import carried_workload

    quiet()
    target, where = _bench_target(args.target)
    start = time.perf_counter()
    workload = carried_workload(Path(args.carried), CUDA_GRAPH_WORKLOAD)
    upper = workload.graph.dims["s"].upper
    buckets, lengths = cuda_graph_buckets(upper), cuda_graph_lengths(upper)
    _say(f"{CUDA_GRAPH_WORKLOAD}: carried graph and model ready in "
         f"{time.perf_counter() - start:.1f} s; buckets {list(buckets)}, s in {lengths}")  # fmt: skip
    builds = build_modes(workload.graph, target, buckets, args.modes.split(","))
    for mode, build in builds.items():
        _say(f"built {mode} in {build.compile_s:.1f} s")
    from ..runtime.devices import device_for_target

    device = device_for_target(target)
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    with gpu_lock(os.environ.get(LOCK_ENV)):
        for mode, build in builds.items():
            found, whole = measure_mode(mode, workload, build, device, lengths, args.repeat,
                                        args.tolerance)  # fmt: skip
            rows += found
            runs[mode] = whole
    doc = {
        "workload": CUDA_GRAPH_WORKLOAD,
        "device": where,
        "buckets": list(buckets),
        "lengths": lengths,
        "repeat": args.repeat,
        "compile_s": {mode: round(b.compile_s, 2) for mode, b in builds.items()},
        "pool": _pool_doc(builds),
        "runs": runs,
        "rows": rows,
        "all_correct": all(r["correct"] for r in rows),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table = f"{CUDA_GRAPH_WORKLOAD} on {where}, CUDA graphs per length bucket\n\n{markdown(doc)}"
    out.with_suffix(".md").write_text(table + "\n")
    _say(table)
    return 0 if doc["all_correct"] else 1

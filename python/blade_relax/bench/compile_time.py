"""What the default pipeline costs at compile time, against TVM's stock pipeline.

``python -m blade_relax.bench.compile_time`` imports a workload's training step once per layer
count (``--layers``, default ``2,4,8,16,22``) and lowers it to the memory stage
(:func:`blade_relax.pipeline.lower_to_memory_stage`: everything up to ``VMShapeLower``, which is
where the memory passes end) twice, in fresh processes: with the stock pipeline and with the
default one (every pass of :class:`blade_relax.PipelineFlags` on). It reports per layer count:

* the seconds of each lowering and their ratio (the same run, the same machine); with
  ``--repeat N``, the lowerings alternate (stock, default, stock, ...) ``N`` times each and the
  table shows medians (the ratio of the medians; one machine's timings vary by tens of per
  cent from run to run, the stock pipeline's by up to 2x);
* the growth against the fewest layers measured: seconds per layer, relative to the first row,
  so that "linear in layers" reads as a column near 1;
* the peak resident memory of the process while it lowers (sampled every 5 ms from its
  ``/proc/<pid>/statm`` by the process that forked it, so that sampling costs the lowering
  nothing; plus the pages of the workers the passes fork that they do not share with it;
  minus nothing: the imported module is part of what a user's process holds);
* the bindings of the lowered module's Relax functions (what the passes walk; range copies
  of ``main`` included).

Each lowering runs in its own process, forked from the one that imported the module, so one
pipeline's caches and garbage never reach the other's figures, and the import (tens of seconds
for a 22-layer model) is paid once per layer count. (``tvm.ir.save_json`` cannot hand the
module to a fresh process: it crashes on these modules in TVM 0.27.)
The weights are left undrawn (``weights="empty"``): lowering never reads them. ``--size``
(default ``1b``, the 1.1B Llama) sets the widths. They change the time too, not only the
sizes inside the symbolic expressions: the passes compare byte counts, and at other widths
other comparisons decide, other candidates survive the screens and other range copies are
scheduled.

``--json PATH`` writes every row.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from queue import Empty
from typing import Any

from ..util.cliargs import CliError, OneLineParser, check_output_path, first_line

__all__ = ["CompileTiming", "LoweringRun", "build_parser", "main", "measure", "table"]

DEFAULT_PROG = "python -m blade_relax.bench.compile_time"
DEFAULT_LAYERS = "2,4,8,16,22"
_SAMPLE_S = 0.005


@dataclass(frozen=True)
class LoweringRun:
    """One lowering in a fresh process.

    Attributes
    ----------
    seconds
        Wall time of :func:`~blade_relax.pipeline.lower_to_memory_stage`.
    peak_rss
        The largest resident set sampled while it ran, in bytes.
    start_rss
        The resident set just before it started (the loaded module and the libraries).
    bindings
        Bindings of the lowered module's Relax functions.
    """

    seconds: float
    peak_rss: int
    start_rss: int
    bindings: int


@dataclass(frozen=True)
class CompileTiming:
    """Stock and default lowerings of one layer count.

    ``stock`` and ``default`` are the runs of median seconds (the lower median for an even
    number of runs); ``stock_runs`` and ``default_runs`` are every run's seconds, in order.
    """

    workload: str
    layers: int
    import_s: float
    stock: LoweringRun
    default: LoweringRun
    stock_runs: tuple[float, ...] = ()
    default_runs: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """Default pipeline's (median) seconds over the stock pipeline's."""
        return self.default.seconds / self.stock.seconds


def _median_run(runs: Sequence[LoweringRun]) -> LoweringRun:
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def _resident_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:  # exited, or a kernel without the children file: no children counted
        return []


def _private_bytes(pid: int) -> int:
    """Private_Clean + Private_Dirty of process ``pid`` (0 once it has exited): the pages a
    forked worker does not share with its parent (its resident set counts those again)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _lower_in_child(mod: Any, default: bool, queue: Any) -> None:
    """Child process: lower ``mod``, report a :class:`LoweringRun` as a dict (its peak RSS is
    what the parent sampled, or the resident set at the end if larger)."""
    try:
        from tvm import relax

        from ..pipeline import PipelineFlags, lower_to_memory_stage

        flags = PipelineFlags.defaults() if default else {}
        start = _resident_bytes(os.getpid())
        t0 = time.perf_counter()
        out = lower_to_memory_stage(mod, "llvm", **flags)
        seconds = time.perf_counter() - t0
        end = _resident_bytes(os.getpid())
        bindings = sum(
            len(block.bindings)
            for func in out.functions.values()
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr)
            for block in func.body.blocks
        )
        queue.put({"ok": asdict(LoweringRun(seconds, max(start, end), start, bindings))})
    except BaseException as err:  # reported in the parent with the child's message
        queue.put({"error": f"{type(err).__name__}: {first_line(err)}"})


def _lower(mod: Any, default: bool) -> LoweringRun:
    """Lower ``mod`` in a forked child and sample its resident memory from here: a sampling
    thread in the child would take the interpreter's lock from the lowering every 5 ms
    (measured: 5-8 % slower at 22 layers, both pipelines)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_lower_in_child, args=(mod, default, queue))
    child.start()
    peak = 0
    workers = 0
    samples = 0
    while True:
        try:
            result = queue.get(timeout=_SAMPLE_S)
            break
        except Empty:
            if not child.is_alive() and queue.empty():
                raise RuntimeError("the lowering process died without a result") from None
        resident = _resident_bytes(child.pid)
        # The workers' private pages change slowly and cost more to read: every 10th sample.
        if samples % 10 == 0:
            workers = sum(_private_bytes(pid) for pid in _children(child.pid))
        samples += 1
        peak = max(peak, resident + workers)
    child.join()
    if "error" in result:
        which = "default" if default else "stock"
        raise RuntimeError(f"lowering with the {which} pipeline failed: {result['error']}")
    run = LoweringRun(**result["ok"])
    return dataclasses.replace(run, peak_rss=max(run.peak_rss, peak))


def measure(
    workload: str,
    sizes: Any,
    layers: Sequence[int],
    *,
    repeat: int = 1,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[CompileTiming]:
    """Import ``workload`` at each layer count and time both lowerings ``repeat`` times each,
    alternating (see the module doc)."""
    import gc

    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")

    from .. import load
    from .workloads import build_workload

    load()
    rows = []
    for n in layers:
        progress(f"{workload}: importing {n} layers")
        t0 = time.perf_counter()
        built = build_workload(workload, dataclasses.replace(sizes, layers=n), weights="empty")
        import_s = time.perf_counter() - t0
        mod = built.graph.mod
        del built
        gc.collect()
        stocks, defaults = [], []
        for k in range(repeat):
            run = f" (run {k + 1} of {repeat})" if repeat > 1 else ""
            progress(f"{workload}: {n} layers, stock pipeline{run}")
            stocks.append(_lower(mod, default=False))
            progress(f"{workload}: {n} layers, default pipeline{run}")
            defaults.append(_lower(mod, default=True))
        stock, default = _median_run(stocks), _median_run(defaults)
        rows.append(
            CompileTiming(
                workload,
                n,
                import_s,
                stock,
                default,
                tuple(r.seconds for r in stocks),
                tuple(r.seconds for r in defaults),
            )
        )
        progress(
            f"{workload}: {n} layers: stock {stock.seconds:.1f} s, default "
            f"{default.seconds:.1f} s ({default.seconds / stock.seconds:.1f}x)"
        )
    return rows


def table(rows: Sequence[CompileTiming]) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = [
        "| layers | bindings | stock s | default s | default / stock | default s per layer "
        "(x first row) | peak RSS stock MiB | peak RSS default MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if not rows:
        return "\n".join(lines)
    first = rows[0].default.seconds / rows[0].layers
    for r in rows:
        growth = (r.default.seconds / r.layers) / first
        lines.append(
            f"| {r.layers} | {r.default.bindings:,} | {r.stock.seconds:.1f} | "
            f"{r.default.seconds:.1f} | {r.ratio:.1f} | {growth:.2f} | "
            f"{r.stock.peak_rss / 2**20:,.0f} | {r.default.peak_rss / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def build_parser(prog: str = DEFAULT_PROG) -> OneLineParser:
    """The argument parser; errors raise :class:`~blade_relax.util.cliargs.CliError`."""
    parser = OneLineParser(
        prog=prog,
        description="Time lowering a training step to the memory stage with the stock and the "
        "default pipeline, by number of layers.",
    )
    parser.add_argument("--workload", default="llama-train", help="workload (llama-train)")
    parser.add_argument("--size", default="1b", help="size preset (default: 1b)")
    parser.add_argument(
        "--layers", default=DEFAULT_LAYERS, help=f"comma-separated (default {DEFAULT_LAYERS})"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="lowerings per pipeline and layer count, alternating; the table shows medians (1)",
    )
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Entry point: prints the table; returns the exit status."""
    try:
        args = build_parser(prog).parse_args(argv)
        from .cli import WORKLOAD_NAMES

        if args.workload not in WORKLOAD_NAMES:
            raise CliError(f"unknown workload {args.workload!r}")
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise CliError(
                f"--layers takes comma-separated integers, not {args.layers!r}"
            ) from None
        if not layers or any(n < 1 for n in layers):
            raise CliError("--layers needs at least one count, each at least 1")
        if args.repeat < 1:
            raise CliError(f"--repeat must be at least 1, not {args.repeat}")
        check_output_path(args.json, "--json")
        from .workloads import PRESETS

        if args.size not in PRESETS:
            raise CliError(f"unknown size {args.size!r} (one of {', '.join(PRESETS)})")
    except CliError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        if not args.quiet:
            print(f"... {message}", file=sys.stderr, flush=True)

    rows = measure(args.workload, PRESETS[args.size], layers, repeat=args.repeat, progress=say)
    medians = f"; medians of {args.repeat} runs each" if args.repeat > 1 else ""
    print(f"## Lowering to the memory stage: {args.workload}, size {args.size} (llvm{medians})\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step-time overhead of one configuration against another, measured in interleaved blocks.

``python -m blade_relax.bench.overhead --workload llama-train --base blade-relax-schedule
--configs blade-relax --lengths 16,28,64`` compiles each configuration once (dynamic length),
then, per length, times ``--blocks`` blocks of ``--steps`` calls of each configuration in turn
(the order rotates from block to block), so that a slow spell of a shared machine hits every
configuration alike. A configuration's overhead at a length is the median over blocks of its
block time divided by the base's block time of the same round. The ruler's own step times
(``python -m blade_relax.bench``) run one configuration after the other and are too noisy for
differences of a few percent on a shared CPU.

It also reports what the remat runtime's decision costs per call: the ``blade_relax.
remat_active`` query that a rematerialized function's dispatcher makes when no budget is set
(called through the FFI, as the VM calls it), and the decision ``remat_begin`` makes under a
budget (0.9 of the configuration's unbudgeted step peak; cached after the first call at a
shape, as in a training loop).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import tvm
from tvm import relax

from ..contract import REMAT_ACTIVE

__all__ = ["OverheadRow", "active_query_us", "main", "measure_overhead"]


@dataclass
class OverheadRow:
    """One configuration at one length.

    Attributes
    ----------
    config, length
        What was measured.
    block_ratios
        Per round, this configuration's block time over the base's.
    median_ratio
        The median of ``block_ratios`` (1.0 for the base itself).
    median_step_s
        Median time of one call (block time / steps); absolute times from a CPU shared with
        other work are indicative only.
    decision_us
        Median wall time of the remat decision under a budget of 0.9 of the unbudgeted step
        peak (cached decisions), in microseconds; None when the configuration has no remat
        runtime.
    """

    config: str
    length: int
    block_ratios: list[float] = field(default_factory=list)
    median_ratio: float = 1.0
    median_step_s: float = 0.0
    decision_us: float | None = None


def active_query_us(calls: int = 100_000) -> float:
    """Microseconds per call of ``blade_relax.remat_active`` through the FFI (no budget set)."""
    from .. import runtime

    active = tvm.get_global_func(REMAT_ACTIVE)
    with runtime.set_memory_budget(None):
        start = time.perf_counter()
        for _ in range(calls):
            active()
        elapsed = time.perf_counter() - start
    return elapsed / calls * 1e6


def _decision_us(vm: Any, args: Sequence[Any], calls: int) -> float | None:
    """Median time of the (cached) remat decision under 0.9 of the unbudgeted step peak."""
    from .. import runtime

    unbudgeted = runtime.measure_call(vm, args, convert=None)
    base, peak = unbudgeted.live_before, unbudgeted.peak_bytes
    vm_main = vm["main"]
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unreachable budget warns; the timing still counts
        with runtime.set_memory_budget(base + max(1, int(0.9 * peak))):
            for _ in range(calls):
                before = runtime.last_remat_decision()
                vm_main(*args)
                decision = runtime.last_remat_decision()
                if decision is None or decision == before:
                    return None  # no remat runtime in this configuration
                if decision.get("cached"):
                    times.append(decision["decision_seconds"] * 1e6)
    return statistics.median(times) if times else None


def measure_overhead(
    workload: Any,
    base: str,
    configs: Sequence[str],
    lengths: Sequence[int],
    *,
    blocks: int = 15,
    steps: int = 5,
    target: str = "llvm",
    progress: Any = None,
) -> list[OverheadRow]:
    """Interleaved block timings of ``configs`` against ``base`` (see the module docstring).

    Parameters
    ----------
    workload
        A :class:`~blade_relax.bench.workloads.Workload`.
    base
        The configuration the others are divided by.
    configs
        Further configuration names (no budgeted or static configurations).
    lengths
        Sequence lengths.
    blocks, steps
        Rounds, and calls of each configuration per round.
    target
        ``"llvm"`` (CPU) or a CUDA target.
    progress
        Called with a line per stage.
    """
    from ..pipeline import as_target
    from .configs import TvmConfig, get_config

    if blocks < 1 or steps < 1:
        raise ValueError(f"blocks and steps must be at least 1, got {blocks} and {steps}")
    say = progress or (lambda _msg: None)
    tgt = as_target(target)
    device = tvm.cuda() if tgt.kind.name == "cuda" else tvm.cpu()
    names = [base, *[c for c in configs if c != base]]
    executables = {}
    for name in names:
        config = get_config(name)
        if not isinstance(config, TvmConfig) or config.static or config.budget is not None:
            raise ValueError(f"{name}: only dynamic TVM configurations without a budget")
        say(f"compiling {name}")
        variant = workload.graph.with_upper_bounds(config.keep_bounds)
        executables[name] = tvm.compile(variant.mod, tgt, relax_pipeline=config.pipeline(tgt))
    params = [tvm.runtime.tensor(p, device) for p in workload.graph.params]
    rows: list[OverheadRow] = []
    for length in lengths:
        args = [tvm.runtime.tensor(a, device) for a in workload.inputs(length)] + params
        vms = {n: relax.VirtualMachine(executables[n], device) for n in names}
        mains = {n: vm["main"] for n, vm in vms.items()}
        for main_fn in mains.values():  # warm up: first-call costs, caches
            main_fn(*args)
        block_times: dict[str, list[float]] = {n: [] for n in names}
        say(f"s={length}: {blocks} rounds of {steps} steps")
        for round_index in range(blocks):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                start = time.perf_counter()
                for _ in range(steps):
                    out = mains[name](*args)
                if tgt.kind.name == "cuda":
                    device.sync()
                block_times[name].append(time.perf_counter() - start)
                del out
        for name in names:
            ratios = [t / b for t, b in zip(block_times[name], block_times[base])]
            row = OverheadRow(
                config=name,
                length=length,
                block_ratios=ratios,
                median_ratio=statistics.median(ratios),
                median_step_s=statistics.median(block_times[name]) / steps,
            )
            row.decision_us = _decision_us(vms[name], args, max(3, steps))
            rows.append(row)
        del mains, vms
    return rows


def _table(rows: Sequence[OverheadRow], base: str, active_us: float) -> str:
    lines = [
        f"| config | s | step time / {base} (median of rounds) | median step (ms) "
        "| remat decision under a budget (us, cached) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        decision = "-" if r.decision_us is None else f"{r.decision_us:.1f}"
        lines.append(
            f"| {r.config} | {r.length} | {r.median_ratio:.3f} | {r.median_step_s * 1e3:.2f} "
            f"| {decision} |"
        )
    lines.append("")
    lines.append(f"blade_relax.remat_active (the no-budget dispatch), per call: {active_us:.2f} us")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    from .workloads import PRESETS, WORKLOADS, build_workload

    parser = argparse.ArgumentParser(
        prog="python -m blade_relax.bench.overhead",
        description="Step-time overhead of configurations against a base, timed in "
        "interleaved rounds on one machine.",
    )
    parser.add_argument("--workload", default="llama-train", choices=sorted(WORKLOADS))
    parser.add_argument("--size", default="small", choices=sorted(PRESETS))
    parser.add_argument("--base", default="blade-relax-schedule")
    parser.add_argument("--configs", default="blade-relax", help="comma-separated names")
    parser.add_argument("--lengths", default="16,28,64", help="comma-separated lengths")
    parser.add_argument("--blocks", type=int, default=15, help="rounds (15)")
    parser.add_argument("--steps", type=int, default=5, help="calls per block (5)")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
    except ValueError:
        print(f"--lengths: not a list of integers: {args.lengths!r}", file=sys.stderr)
        return 2
    workload = build_workload(args.workload, PRESETS[args.size])
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]

    def say(message: str) -> None:
        print(f"... {message}", file=sys.stderr)

    try:
        rows = measure_overhead(
            workload,
            args.base,
            configs,
            lengths,
            blocks=args.blocks,
            steps=args.steps,
            target=args.target,
            progress=say,
        )
    except (KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    active_us = active_query_us()
    print(_table(rows, args.base, active_us))
    if args.out:
        payload = {
            "workload": args.workload,
            "size": args.size,
            "base": args.base,
            "blocks": args.blocks,
            "steps": args.steps,
            "remat_active_us": active_us,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())

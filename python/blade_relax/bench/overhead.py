"""Step-time overhead of configurations against their bases, measured in interleaved blocks.

``python -m blade_relax.bench.overhead --workload llama-train --base blade-relax-schedule
--configs blade-relax-schedule-remat --lengths 16,28,64`` (the defaults: what ``Rematerialize``
costs without a budget) compiles each configuration once (dynamic length), then, per length,
times ``--blocks`` blocks of ``--steps`` calls of each configuration in turn
(the order rotates from block to block), so that a slow spell of a shared machine hits every
configuration alike. A configuration's overhead at a length is the median over blocks of its
block time divided by its base's block time of the same round. The ruler's own step times
(``python -m blade_relax.bench``) run one configuration after the other and are too noisy for
differences of a few percent on a shared CPU.

Every configuration is divided by ``--base`` unless ``--pairs`` names its own base, so that one
run answers "what do memory savings cost in time" for both systems::

    python -m blade_relax.bench.overhead --workload llama-train --base blade-relax \\
        --configs blade-relax@0.5,torch-eager,torch-eager-ckpt \\
        --pairs torch-eager:torch-eager,torch-eager-ckpt:torch-eager

Configurations are dynamic TVM ones, with or without a runtime budget, and PyTorch ones
(``torch-eager``, ``torch-eager-ckpt``, ``torch-compile``, ...). A budgeted configuration
(``blade-relax@0.5``) runs under a budget taken, once per length before the timing, as the
ruler (:func:`~blade_relax.bench.runner.run_benchmark`) takes it: the fraction times the step
peak its ``budget_of`` configuration measures at that length, applied as the runtime budget
(``set_memory_budget``) its own measured step ran under. A PyTorch configuration runs the
ruler's step inside its settings (Hugging Face gradient checkpointing for ``*-ckpt``, switched
on for that configuration's blocks only: the module is shared).

Each row also reports the configuration's step peak at the length, measured as the ruler
measures it (TVM: :func:`blade_relax.runtime.measure_call` on a fresh VM, under the budget;
PyTorch: the step counted by
:class:`~blade_relax.training.torch_memory.LiveBytesCounter` on the CPU, the allocator's peak on
CUDA), so that the peak a budget or checkpointing saves and the time it costs stand side by
side.

It also reports what the remat runtime's decision costs per call: the ``blade_relax.
remat_active`` query that a rematerialized function's dispatcher makes when no budget is set
(called through the FFI, as the VM calls it), and the decision ``remat_begin`` makes under a
budget (0.9 of the configuration's unbudgeted step peak; cached after the first call at a
shape, as in a training loop).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import tvm
from tvm import relax

from ..contract import REMAT_ACTIVE
from .report import compact_json

__all__ = [
    "OverheadRow",
    "RecordedOverhead",
    "active_query_us",
    "main",
    "measure_overhead",
    "parse_pairs",
    "read_overhead",
]


@dataclass
class OverheadRow:
    """One configuration at one length.

    Attributes
    ----------
    config, length
        What was measured.
    block_ratios
        Per round, this configuration's block time over its base's.
    median_ratio
        The median of ``block_ratios`` (1.0 for a configuration that is its own base).
    median_step_s
        Median time of one call (block time / steps); absolute times from a CPU shared with
        other work are indicative only.
    decision_us
        Median wall time of the remat decision under a budget of 0.9 of the unbudgeted step
        peak (cached decisions), in microseconds; None when the configuration has no remat
        runtime.
    base
        The configuration the ratios divide by.
    step_peak_bytes
        The step's peak at this length, under the budget for a budgeted configuration (see the
        module docstring).
    budget_bytes
        The budget the step ran under (bytes it may add to those live before it); None without
        one.
    block_times_s
        Per round, this configuration's block time (``steps`` calls), in seconds.
    """

    config: str
    length: int
    block_ratios: list[float] = field(default_factory=list)
    median_ratio: float = 1.0
    median_step_s: float = 0.0
    decision_us: float | None = None
    base: str = ""
    step_peak_bytes: int | None = None
    budget_bytes: int | None = None
    block_times_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RecordedOverhead:
    """An overhead run read back from the JSON ``--out`` writes (:func:`read_overhead`).

    Attributes
    ----------
    workload, blocks, steps
        What was timed, and how: ``blocks`` rounds of ``steps`` calls of each configuration.
    provenance
        The command, commit, and date of the run (empty for documents written without it).
    rows
        One per configuration and length.
    """

    workload: str
    blocks: int
    steps: int
    provenance: Mapping[str, Any]
    rows: tuple[OverheadRow, ...]

    def row(self, config: str, length: int) -> OverheadRow | None:
        """The row of ``config`` at ``length`` (``None`` when the run has none)."""
        for r in self.rows:
            if r.config == config and r.length == length:
                return r
        return None

    @property
    def lengths(self) -> list[int]:
        return sorted({r.length for r in self.rows})


def read_overhead(path: str | Any) -> RecordedOverhead:
    """Read the JSON document ``python -m blade_relax.bench.overhead --out`` wrote.

    Raises
    ------
    ValueError
        When the document lacks the keys of that format (``workload``, ``rows``).
    """
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "rows" not in doc or "workload" not in doc:
        raise ValueError(f"{path}: not an overhead document (no 'workload' and 'rows')")
    known = {f.name for f in dataclasses.fields(OverheadRow)}
    rows = tuple(OverheadRow(**{k: v for k, v in r.items() if k in known}) for r in doc["rows"])
    return RecordedOverhead(
        workload=doc["workload"],
        blocks=int(doc.get("blocks", 0)),
        steps=int(doc.get("steps", 0)),
        provenance=doc.get("provenance", {}),
        rows=rows,
    )


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
                # Cleared rather than compared with the one before: two cached decisions can
                # report the same decision_seconds on a coarse clock.
                runtime.clear_last_remat_decision()
                vm_main(*args)
                decision = runtime.last_remat_decision()
                if decision is None:
                    return None  # no remat runtime in this configuration
                if decision.get("cached"):
                    times.append(decision["decision_seconds"] * 1e6)
    return statistics.median(times) if times else None


def parse_pairs(text: str) -> dict[str, str]:
    """``"a:b,c:d"`` as ``{"a": "b", "c": "d"}``: each configuration and the base it is divided by.

    Raises
    ------
    ValueError
        When an item is not ``config:base`` or a configuration is named twice.
    """
    pairs: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        config, colon, of = (part.strip() for part in item.partition(":"))
        if not colon or not config or not of or ":" in of:
            raise ValueError(f"--pairs: expected CONFIG:BASE, got {item.strip()!r}")
        if config in pairs:
            raise ValueError(f"--pairs: {config!r} is given a base twice")
        pairs[config] = of
    return pairs


@dataclass
class _Plan:
    """What one run times: the timed names (base first), every configuration to build in run
    order (budget references before their users, references that are not timed included), and
    each timed name's base."""

    timed: list[str]
    configs: list[Any]
    bases: dict[str, str]


def _plan(base: str, configs: Sequence[str], pairs: Mapping[str, str] | None) -> _Plan:
    """Resolve and check the configurations and the pairs; raises ValueError (or KeyError).

    Deprecated names are replaced by their current ones (:func:`~.configs.canonical_name`), in
    the pairs too, so that the rows carry the current names."""
    from .configs import TvmConfig, canonical_name, resolve_configs

    timed = list(dict.fromkeys(canonical_name(n) for n in [base, *configs]))
    base = canonical_name(base)
    pairs = {canonical_name(k): canonical_name(v) for k, v in (pairs or {}).items()}
    ordered = [config for config, _requested in resolve_configs(timed)]
    for config in ordered:
        if isinstance(config, TvmConfig) and (config.static or config.bucket is not None):
            raise ValueError(
                f"{config.name}: only dynamic TVM configurations (with or without a budget) and "
                "PyTorch configurations, no static or bucketed ones"
            )
    bases = dict.fromkeys(timed, base)
    listed = ", ".join(timed)
    for name, of in pairs.items():
        if name not in bases:
            raise ValueError(
                f"pairs: {name!r} is not among the configurations timed ({listed}); "
                "add it to the configurations"
            )
        if of not in bases:
            raise ValueError(
                f"pairs: the base {of!r} of {name!r} is not among the configurations timed "
                f"({listed}); add it to the configurations"
            )
        bases[name] = of
    return _Plan(timed=timed, configs=ordered, bases=bases)


def measure_overhead(
    workload: Any,
    base: str,
    configs: Sequence[str],
    lengths: Sequence[int],
    *,
    pairs: Mapping[str, str] | None = None,
    blocks: int = 15,
    steps: int = 5,
    target: str = "llvm",
    progress: Callable[[str], None] | None = None,
) -> list[OverheadRow]:
    """Interleaved block timings of ``configs`` against their bases (see the module docstring).

    Parameters
    ----------
    workload
        A :class:`~blade_relax.bench.workloads.Workload`.
    base
        The configuration the others are divided by unless ``pairs`` names their own; it is
        timed too.
    configs
        Further configuration names: dynamic TVM ones, with or without a budget, and PyTorch
        ones. A budget's reference (``budget_of``) is built to measure its peak even when it
        is not timed.
    lengths
        Sequence lengths.
    pairs
        Configuration name -> the name of its base; both among ``base`` and ``configs``.
    blocks, steps
        Rounds, and calls of each configuration per round.
    target
        ``"llvm"`` (CPU) or a CUDA target.
    progress
        Called with a line per stage.

    Returns
    -------
    list[OverheadRow]
        Per length, one row per timed configuration, ``base`` first, then ``configs`` in order.

    Raises
    ------
    ValueError
        For an unknown, static or bucketed configuration, a pair naming a configuration that
        is not timed, a workload PyTorch cannot run, or fewer than one block or step.
    """
    from ..pipeline import as_target
    from .configs import TvmConfig
    from .runner import _TorchRunner

    if blocks < 1 or steps < 1:
        raise ValueError(f"blocks and steps must be at least 1, got {blocks} and {steps}")
    say = progress or (lambda _msg: None)
    plan = _plan(base, configs, pairs)
    tgt = as_target(target)
    cuda = tgt.kind.name == "cuda"
    device = tvm.cuda() if cuda else tvm.cpu()
    runners = {
        c.name: _TorchRunner(c, workload.graph, device)
        for c in plan.configs
        if not isinstance(c, TvmConfig)
    }
    compiled = _compile(workload, plan, tgt, say)
    params = [tvm.runtime.tensor(p, device) for p in workload.graph.params]
    bench = _Bench(workload, plan, runners, compiled, params, device, cuda)
    rows: list[OverheadRow] = []
    for length in lengths:
        rows += _measure_length(bench, length, blocks, steps, say)
    return rows


@dataclass
class _Bench:
    """What every length is measured with: the configurations built once for all lengths."""

    workload: Any
    plan: _Plan
    runners: dict[str, Any]  # PyTorch configuration name -> its runner
    compiled: dict[str, Any]  # TVM configuration name -> its CompiledModule
    params: list[Any]  # the workload's parameters on the device
    device: Any
    cuda: bool


def _compile(workload: Any, plan: _Plan, tgt: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Each TVM configuration compiled once (dynamic length); a budgeted one shares the
    executable of its reference when both build the same."""
    from ..analysis.workspace import compile_keeping_module
    from .configs import TvmConfig

    by_name = {c.name: c for c in plan.configs}
    compiled: dict[str, Any] = {}
    for config in plan.configs:  # run order: a budget's reference before its users
        if not isinstance(config, TvmConfig):
            continue
        reference = compiled.get(config.budget_of or "")
        same_build = (
            config.budget is not None
            and reference is not None
            and _build_of(by_name[config.budget_of]) == _build_of(config)
        )
        if same_build:  # a budget changes what the runtime does, not the executable
            compiled[config.name] = reference
            continue
        say(f"compiling {config.name}")
        variant = workload.graph.with_upper_bounds(config.keep_bounds)
        compiled[config.name] = compile_keeping_module(variant.mod, tgt, config.pipeline(tgt))
    return compiled


def _measure_length(
    bench: _Bench, length: int, blocks: int, steps: int, say: Callable[[str], None]
) -> list[OverheadRow]:
    """The rows of every timed configuration at one length: warm-up, step peaks, rounds."""
    timed = bench.plan.timed
    runners, compiled = bench.runners, bench.compiled
    inputs = bench.workload.inputs(length)
    args = [tvm.runtime.tensor(a, bench.device) for a in inputs] + bench.params
    vms = {
        n: relax.VirtualMachine(compiled[n].executable, bench.device)
        for n in timed
        if n in compiled
    }
    tensors = {n: runners[n]._tensors(inputs) for n in timed if n in runners}
    calls: dict[str, Callable[[], Any]] = {}
    for name in timed:
        if name in vms:
            calls[name] = _bound(vms[name]["main"], args)
        else:
            calls[name] = _bound(runners[name]._step, [tensors[name]])
    settings: dict[str, Callable[[], Any]] = {
        n: (runners[n]._settings if n in runners else contextlib.nullcontext) for n in timed
    }
    for name in timed:  # warm up: first-call costs, caches, torch.compile's graphs
        with settings[name]():
            calls[name]()

    say(f"s={length}: step peaks")
    peaks, budgets = _step_peaks(bench, args, tensors, vms, calls, settings)
    say(f"s={length}: {blocks} rounds of {steps} steps")
    block_times = _time_rounds(bench, calls, settings, blocks, steps)
    rows = []
    for name in timed:
        of = bench.plan.bases[name]
        ratios = [t / b for t, b in zip(block_times[name], block_times[of])]
        row = OverheadRow(
            config=name,
            length=length,
            block_ratios=ratios,
            median_ratio=statistics.median(ratios),
            median_step_s=statistics.median(block_times[name]) / steps,
            base=of,
            step_peak_bytes=peaks[name],
            budget_bytes=budgets.get(name),
            block_times_s=block_times[name],
        )
        if name in vms:
            row.decision_us = _decision_us(vms[name], args, max(3, steps))
        rows.append(row)
    return rows


def _step_peaks(
    bench: _Bench,
    args: Sequence[Any],
    tensors: Mapping[str, Any],
    vms: Mapping[str, Any],
    calls: Mapping[str, Callable[[], Any]],
    settings: dict[str, Callable[[], Any]],
) -> tuple[dict[str, int], dict[str, int | None]]:
    """Each configuration's step peak at this length, and each TVM one's budget (bytes).

    A budgeted configuration's budget is its fraction of its reference's peak, measured first;
    its timed calls then run under the runtime budget the measured step ran under (its entry
    in ``settings`` is replaced), with the decision at this shape made once and cached.
    """
    from ..runtime import measure_call, set_memory_budget

    runners, compiled = bench.runners, bench.compiled
    peaks: dict[str, int] = {}
    budgets: dict[str, int | None] = {}
    for config in bench.plan.configs:  # a budget's reference comes before its users
        name = config.name
        if name in runners:
            with runners[name]._settings():
                peak, outputs = runners[name]._peak_step(tensors[name])
            del outputs
            peaks[name] = peak
            continue
        budget = None
        if config.budget is not None:
            budget = max(1, int(config.budget * peaks[config.budget_of]))
        measured = measure_call(
            compiled[name].executable,
            args,
            budget=budget,
            workspaces=compiled[name].workspaces,
            device=bench.device,
            convert=None,
        )
        peaks[name], budgets[name] = int(measured.peak_bytes), budget
        if budget is not None and name in vms:
            # The timed calls run under the runtime budget the measured step ran under.
            settings[name] = _budget_setting(set_memory_budget, measured.runtime_budget)
            with settings[name]():
                calls[name]()  # the decision at this shape, cached as in a training loop
    return peaks, budgets


def _time_rounds(
    bench: _Bench,
    calls: Mapping[str, Callable[[], Any]],
    settings: Mapping[str, Callable[[], Any]],
    blocks: int,
    steps: int,
) -> dict[str, list[float]]:
    """Seconds of each block of ``steps`` calls, per timed configuration; the order of the
    configurations rotates from round to round."""
    timed = bench.plan.timed
    block_times: dict[str, list[float]] = {n: [] for n in timed}
    for round_index in range(blocks):
        shift = round_index % len(timed)
        for name in timed[shift:] + timed[:shift]:
            gc.collect()
            with settings[name]():
                call = calls[name]
                start = time.perf_counter()
                for _ in range(steps):
                    out = call()
                if bench.cuda:
                    bench.device.sync()
                block_times[name].append(time.perf_counter() - start)
                del out
    return block_times


def _build_of(config: Any) -> tuple[Any, bool]:
    """What a TVM configuration's executable depends on: its pipeline and its bounds."""
    return config.pipeline, config.keep_bounds


def _bound(fn: Callable[..., Any], args: Sequence[Any]) -> Callable[[], Any]:
    return lambda: fn(*args)


def _budget_setting(set_budget: Callable[[int], Any], budget: int) -> Callable[[], Any]:
    return lambda: set_budget(budget)


def _table(rows: Sequence[OverheadRow], active_us: float) -> str:
    from .report import format_bytes

    peaks = {(r.config, r.length): r.step_peak_bytes for r in rows}
    lines = [
        "| config | base | s | step time / base (median of rounds) | median step (ms) "
        "| step peak | peak / base's | budget | remat decision under a budget (us, cached) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decision = "-" if r.decision_us is None else f"{r.decision_us:.1f}"
        base_peak = peaks.get((r.base, r.length))
        peak_ratio = (
            f"{r.step_peak_bytes / base_peak:.3f}"
            if r.step_peak_bytes is not None and base_peak
            else "-"
        )
        lines.append(
            f"| {r.config} | {r.base} | {r.length} | {r.median_ratio:.3f} "
            f"| {r.median_step_s * 1e3:.2f} | {format_bytes(r.step_peak_bytes)} | {peak_ratio} "
            f"| {format_bytes(r.budget_bytes)} | {decision} |"
        )
    lines.append("")
    lines.append(f"blade_relax.remat_active (the no-budget dispatch), per call: {active_us:.2f} us")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    from .report import environment, provenance
    from .workloads import PRESETS, WORKLOADS, build_workload

    parser = argparse.ArgumentParser(
        prog="python -m blade_relax.bench.overhead",
        description="Step-time overhead of configurations against their bases, timed in "
        "interleaved rounds on one machine, with each configuration's step peak.",
    )
    parser.add_argument("--workload", default="llama-train", choices=sorted(WORKLOADS))
    parser.add_argument("--size", default="small", choices=sorted(PRESETS))
    parser.add_argument("--base", default="blade-relax-schedule")
    parser.add_argument(
        "--configs", default="blade-relax-schedule-remat", help="comma-separated names"
    )
    parser.add_argument(
        "--pairs",
        default="",
        help="comma-separated CONFIG:BASE, each configuration's own base (both timed; the "
        "others are divided by --base), e.g. torch-eager-ckpt:torch-eager",
    )
    parser.add_argument("--lengths", default="16,28,64", help="comma-separated lengths")
    parser.add_argument("--blocks", type=int, default=15, help="rounds (15)")
    parser.add_argument("--steps", type=int, default=5, help="calls per block (5)")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    arglist = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arglist)
    try:
        lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
    except ValueError:
        print(f"--lengths: not a list of integers: {args.lengths!r}", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        pairs = parse_pairs(args.pairs)
        _plan(args.base, configs, pairs)  # refuse bad names before building the workload
    except (KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    workload = build_workload(args.workload, PRESETS[args.size])

    def say(message: str) -> None:
        print(f"... {message}", file=sys.stderr)

    try:
        rows = measure_overhead(
            workload,
            args.base,
            configs,
            lengths,
            pairs=pairs,
            blocks=args.blocks,
            steps=args.steps,
            target=args.target,
            progress=say,
        )
    except (KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    active_us = active_query_us()
    print(_table(rows, active_us))
    if args.out:
        payload = {
            "environment": environment(),
            "provenance": provenance(f"{parser.prog} {shlex.join(arglist)}"),
            "workload": args.workload,
            "size": args.size,
            "base": args.base,
            "pairs": pairs,
            "blocks": args.blocks,
            "steps": args.steps,
            "remat_active_us": active_us,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.out, "w") as f:
            f.write(compact_json(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())

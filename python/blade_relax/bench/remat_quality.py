"""How close rematerialization gets to what is possible: floor, minimum, budgets and the optimum.

``python -m blade_relax.bench.remat_quality`` compiles each training workload once as the
bench's ``blade-relax`` configuration does (the default pipeline, upper bounds dropped) and,
at each length:

1. runs the step without a budget (the reference outputs and the unbudgeted peak);
2. runs it under a budget of one byte: the runtime runs at the smallest peak it can reach and
   reports the *floor* (``unevictable_peak`` of ``last_remat_decision()``, a bound no eviction
   set goes below); the measured minimum is compared with it;
3. runs it under budgets spread over ``[1.05 x floor, unbudgeted peak]`` and checks that each
   is held and that the loss and gradients are bitwise those of the unbudgeted step;
4. compares the runtime's decision with the exact optimum of the integer program of
   :mod:`.remat_optimum` on the same concrete timeline, at budgets of 0.9 / 0.8 / 0.7 x the
   unbudgeted peak: predicted peak and recomputed work (FLOPs of the recomputed kernels).

Peaks are the bytes the step allocates during the call (``measure_call``'s ``peak_bytes``:
parameters and inputs excluded); ``--json`` writes every row.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..util.cliargs import CliError, OneLineParser, check_output_path, first_line

if TYPE_CHECKING:
    from ..runtime import CallMeasurement
    from ..runtime.remat import RematProgram
    from ..runtime.remat_policy import ConcreteTimeline

__all__ = ["BudgetRow", "LengthReport", "OptimumRow", "build_parser", "main", "measure_workload"]

DEFAULT_PROG = "python -m blade_relax.bench.remat_quality"

# Workloads and the lengths measured by default (the tanh MLP at the batch of its issue).
DEFAULT_LENGTHS = {
    "mlp-train": (16, 64, 256),
    "gpt2-train": (16, 64, 256),
    "llama-train": (16, 64, 256),
    "tanh-mlp-train": (256, 1024),
}
# Fractions of the unbudgeted peak at which the decision is compared with the optimum.
OPTIMUM_FRACTIONS = (0.9, 0.8, 0.7)
# How far above the floor budgets must be held, and how many budgets are tried in between.
FLOOR_MARGIN = 1.05
HELD_BUDGETS = 5


@dataclass(frozen=True)
class BudgetRow:
    """One budgeted run: budget and measured peak in bytes added by the call."""

    budget: int
    peak: int
    predicted: int
    held: bool
    reachable: bool
    bitwise_equal: bool
    evictions: int
    recompute_cost: float


@dataclass(frozen=True)
class OptimumRow:
    """The runtime's decision against the integer program's optimum at one budget."""

    fraction: float
    budget: int
    runtime_peak: int
    runtime_cost: float
    runtime_reachable: bool
    optimum_peak: int
    optimum_cost: float
    optimum_feasible: bool
    optimal: bool
    runtime_seconds: float
    optimum_seconds: float

    @property
    def peak_ratio(self) -> float:
        return self.runtime_peak / max(self.optimum_peak, 1)

    @property
    def cost_ratio(self) -> float:
        if self.optimum_cost <= 0:
            return 1.0 if self.runtime_cost <= 0 else float("inf")
        return self.runtime_cost / self.optimum_cost


@dataclass
class LengthReport:
    """Everything measured for one workload at one length."""

    workload: str
    length: int
    slots: int
    unbudgeted: int
    floor: int
    minimum: int
    minimum_predicted: int
    minimum_bitwise_equal: bool
    budgets: list[BudgetRow] = field(default_factory=list)
    optimum: list[OptimumRow] = field(default_factory=list)

    @property
    def minimum_over_floor(self) -> float:
        return self.minimum / max(self.floor, 1)

    @property
    def budgets_held(self) -> int:
        return sum(row.held for row in self.budgets)


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


def _sizes(name: str, lengths: Sequence[int]):
    from .workloads import SMALL

    return dataclasses.replace(SMALL, max_seq_len=max(SMALL.max_seq_len, *lengths))


def measure_workload(
    name: str, lengths: Sequence[int], *, optimum_time_limit: float = 60.0, say=print
) -> list[LengthReport]:
    """Measure one workload at ``lengths`` (see the module docstring)."""
    import tvm

    from blade_relax.runtime.remat import remat_programs

    from .workloads import build_workload

    workload = build_workload(name, _sizes(name, lengths))
    say(f"... {name}: compiling")
    exe = _compile(workload)
    device = tvm.cpu()
    # Programs are registered per process under their metadata key, and every workload has a
    # `main`: the ones this executable registers are its own.
    earlier = set(remat_programs())
    reports = []
    for length in lengths:
        say(f"... {name}: s={length}")
        args = [tvm.runtime.tensor(a) for a in workload.inputs(length) + workload.graph.params]
        report, plain, program, dims = _minimum_report(name, length, exe, args, device, earlier)
        report.budgets += _held_budgets(exe, args, device, plain, report.floor)
        report.optimum += _optimum_rows(
            program.timeline(dims), plain.peak_bytes, optimum_time_limit
        )
        reports.append(report)
    return reports


def _compile(workload: Any) -> Any:
    """The workload's executable, compiled as the bench's ``blade-relax`` configuration."""
    import tvm

    from .configs import get_config

    # What the bench measures as blade-relax, so that the figures match its tables.
    config = get_config("blade-relax")
    target = tvm.target.Target("llvm")
    return tvm.compile(
        workload.graph.with_upper_bounds(config.keep_bounds).mod,
        target,
        relax_pipeline=config.pipeline(target),
    )


def _minimum_report(
    name: str, length: int, exe: Any, args: list[Any], device: Any, earlier: set[str]
) -> tuple[LengthReport, CallMeasurement, RematProgram, tuple[int, ...]]:
    """Steps 1 and 2 at one length: the unbudgeted run and the run at the smallest peak.

    Returns the report (without budget or optimum rows), the unbudgeted run, and the remat
    program that made the decision, with the dims it was made at (``earlier``: the program
    keys registered before this executable ran).
    """
    from blade_relax.runtime import last_remat_decision, measure_call
    from blade_relax.runtime.remat import remat_programs

    plain = measure_call(exe, args, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowest = measure_call(exe, args, device=device, budget=1)
    decision = lowest.decision or last_remat_decision()
    live = decision["live_at_entry"]
    # (A program met before under the same key has the same metadata: either will do.)
    mine = [p for key, p in remat_programs().items() if key not in earlier] or list(
        remat_programs().values()
    )
    program = next(p for p in mine if p.function == decision["function"])
    dims = tuple(decision["dims"][d] for d in program.dims)
    report = LengthReport(
        workload=name,
        length=length,
        slots=len(program.slots),
        unbudgeted=plain.peak_bytes,
        floor=decision["unevictable_peak"] - live,
        minimum=lowest.peak_bytes,
        minimum_predicted=decision["predicted_peak"] - live,
        minimum_bitwise_equal=_same(lowest.outputs, plain.outputs),
    )
    return report, plain, program, dims


def _held_budgets(
    exe: Any, args: list[Any], device: Any, plain: CallMeasurement, floor: int
) -> list[BudgetRow]:
    """Step 3: runs under budgets spread over ``[FLOOR_MARGIN x floor, unbudgeted peak]``,
    against the unbudgeted run ``plain``; none when that range is empty."""
    from blade_relax.runtime import last_remat_decision, measure_call

    rows: list[BudgetRow] = []
    low = int(FLOOR_MARGIN * floor)
    if low > plain.peak_bytes:
        return rows
    step = (plain.peak_bytes - low) / max(HELD_BUDGETS - 1, 1)
    for k in range(HELD_BUDGETS):
        budget = int(low + k * step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = measure_call(exe, args, device=device, budget=budget)
        made = run.decision or last_remat_decision()
        rows.append(
            BudgetRow(
                budget=budget,
                peak=run.peak_bytes,
                predicted=made["predicted_peak"] - made["live_at_entry"],
                held=run.peak_bytes <= budget,
                reachable=bool(made["reachable"]),
                bitwise_equal=_same(run.outputs, plain.outputs),
                evictions=run.evictions,
                recompute_cost=float(made["recompute_cost"]),
            )
        )
    return rows


def _optimum_rows(
    timeline: ConcreteTimeline, unbudgeted: int, time_limit: float
) -> list[OptimumRow]:
    """Step 4: the runtime's decision on ``timeline`` against the integer program's optimum,
    at each of :data:`OPTIMUM_FRACTIONS` of the unbudgeted peak."""
    from blade_relax.runtime.remat_policy import ConcreteTimeline, decide

    from .remat_optimum import optimal_decision, optimal_minimum_peak

    rows = []
    lowest_optimum = None
    for fraction in OPTIMUM_FRACTIONS:
        budget = int(fraction * unbudgeted)
        # A fresh timeline: the decision is timed without the searches' caches.
        fresh = ConcreteTimeline(base=timeline.base, slots=timeline.slots)
        start = time.perf_counter()
        runtime = decide(fresh, budget)
        runtime_seconds = time.perf_counter() - start
        best = optimal_decision(timeline, budget, time_limit=time_limit)
        if best is None:  # no eviction set fits: compare the smallest peaks
            if lowest_optimum is None:
                lowest_optimum = optimal_minimum_peak(timeline, time_limit=time_limit)
            best = lowest_optimum
            feasible = False
        else:
            feasible = True
        rows.append(
            OptimumRow(
                fraction=fraction,
                budget=budget,
                runtime_peak=runtime.peak,
                runtime_cost=runtime.cost,
                runtime_reachable=runtime.reachable,
                optimum_peak=best.peak,
                optimum_cost=best.cost,
                optimum_feasible=feasible,
                optimal=best.optimal,
                runtime_seconds=runtime_seconds,
                optimum_seconds=best.seconds,
            )
        )
    return rows


def _tables(reports: Sequence[LengthReport]) -> str:
    lines = [
        "| workload | s | slots | unbudgeted | floor | minimum | minimum / floor | budgets held "
        "(in [1.05 floor, unbudgeted]) | bitwise equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in reports:
        equal = r.minimum_bitwise_equal and all(b.bitwise_equal for b in r.budgets)
        lines.append(
            f"| {r.workload} | {r.length} | {r.slots} | {r.unbudgeted:,} | {r.floor:,} | "
            f"{r.minimum:,} | {r.minimum_over_floor:.3f} | {r.budgets_held}/{len(r.budgets)} | "
            f"{'yes' if equal else 'NO'} |"
        )
    lines += [
        "",
        "| workload | s | budget | runtime peak / optimum | runtime work / optimum | "
        "optimum fits | proven optimal |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in reports:
        for o in r.optimum:
            lines.append(
                f"| {r.workload} | {r.length} | {o.fraction:.1f} | {o.peak_ratio:.3f} | "
                f"{o.cost_ratio:.2f} | {'yes' if o.optimum_feasible else 'no (minimum)'} | "
                f"{'yes' if o.optimal else 'no'} |"
            )
    return "\n".join(lines)


def build_parser(prog: str = DEFAULT_PROG) -> OneLineParser:
    """The argument parser; errors raise :class:`~blade_relax.util.cliargs.CliError`."""
    parser = OneLineParser(
        prog=prog,
        description="Rematerialization against its floor, its budgets and the exact optimum.",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_LENGTHS),
        help="comma-separated training workloads (default: %(default)s)",
    )
    parser.add_argument(
        "--lengths", default=None, help="comma-separated lengths (default: per workload)"
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="per integer program (s)")
    parser.add_argument("--json", default=None, help="write every row to this file")
    return parser


def _check_light(args: Any) -> tuple[list[str], list[int] | None]:
    """Checks that need no TVM: names, lengths, the output path."""
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEFAULT_LENGTHS]
    if not names or unknown:
        raise CliError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(DEFAULT_LENGTHS)}"
        )
    lengths = None
    if args.lengths:
        try:
            lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            raise CliError(
                f"--lengths takes comma-separated integers, not {args.lengths!r}"
            ) from None
        if not lengths or min(lengths) < 2:
            raise CliError("--lengths needs lengths of at least 2")
    if not args.time_limit > 0:
        raise CliError("--time-limit must be positive")
    check_output_path(args.json, "--json")
    return names, lengths


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """Command line entry point; returns the exit status (2 on bad input)."""
    from ..util.quiet import quiet_stderr

    try:
        args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
        names, explicit = _check_light(args)
    except CliError as err:
        print(f"{prog}: error: {first_line(err)}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    reports: list[LengthReport] = []
    with quiet_stderr():
        for name in names:
            reports += measure_workload(
                name,
                explicit or DEFAULT_LENGTHS[name],
                optimum_time_limit=args.time_limit,
                say=lambda m: print(m, file=sys.stderr, flush=True),
            )
    print(_tables(reports))
    if args.json:
        rows = []
        for r in reports:
            row = dataclasses.asdict(r)
            row["minimum_over_floor"] = r.minimum_over_floor
            rows.append(row)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

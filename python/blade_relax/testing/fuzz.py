"""Command line of the differential fuzzer.

``python -m blade_relax.testing.fuzz`` checks the programs of a range of seeds (see
:mod:`blade_relax.testing.differential`) and prints the totals: programs, shapes, VM runs,
checks by kind, mismatches. The exit status is 1 when any mismatch was found.

``--long`` is the long mode (5,000 programs unless ``--count`` says otherwise). Programs then run
in worker processes: a crash of the VM (a segfault in a kernel or in TVM) is reported as a
mismatch of that seed and the run goes on with a fresh worker. ``--jobs`` workers share the
seeds.

Examples::

    python -m blade_relax.testing.fuzz --count 50
    python -m blade_relax.testing.fuzz --long --count 5000 --shapes 3 --jobs 2 --json fuzz.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FuzzTotals", "main", "report_record"]


def report_record(report: Any) -> dict[str, Any]:
    """A JSON-ready summary of one :class:`~blade_relax.testing.differential.ProgramReport`."""
    return {
        "seed": report.program.seed,
        "shapes": len(report.shapes),
        "runs": report.runs,
        "checks": dict(report.checks),
        "known": [f"{f.known} ({f.variant})" for f in report.findings if f.known],
        "mismatches": [str(f) for f in report.mismatches],
        "program": repr(report.program) if report.mismatches else None,
    }


@dataclass
class FuzzTotals:
    """Totals over the records of many programs."""

    programs: int = 0
    shapes: int = 0
    runs: int = 0
    checks: Counter = field(default_factory=Counter)
    known: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        self.programs += 1
        self.shapes += record["shapes"]
        self.runs += record["runs"]
        self.checks.update(record["checks"])
        self.known.update(record["known"])
        if record["mismatches"]:
            self.failures.append(record)

    @property
    def mismatches(self) -> int:
        return sum(len(r["mismatches"]) for r in self.failures)

    def text(self, variants: Sequence[str], seconds: float) -> str:
        lines = [
            f"programs: {self.programs}  shapes: {self.shapes}  VM runs: {self.runs}  "
            f"mismatches: {self.mismatches} (in {len(self.failures)} programs)  "
            f"({seconds:.0f} s)",
            f"variants: {', '.join(variants)}",
            "checks: " + ", ".join(f"{k}={v}" for k, v in sorted(self.checks.items())),
        ]
        if self.known:
            lines.append("known: " + ", ".join(f"{k}={v}" for k, v in sorted(self.known.items())))
        for record in self.failures:
            lines.append(f"seed {record['seed']}: {record['program']}")
            lines += [f"  {m}" for m in record["mismatches"]]
        return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m blade_relax.testing.fuzz",
        description="Differential fuzzing of the blade_relax pipelines against stock TVM.",
    )
    parser.add_argument("--long", action="store_true", help="long mode: 5000 programs, isolated")
    parser.add_argument("--count", type=int, default=None, help="number of programs")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--shapes", type=int, default=3, help="shapes per program")
    parser.add_argument("--budgets", type=int, default=2, help="budgets per shape (remat)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (long mode)")
    parser.add_argument(
        "--isolate", action="store_true", help="run in worker processes (implied by --long)"
    )
    parser.add_argument("--json", default=None, help="write the totals and failures here")
    parser.add_argument("--quiet", action="store_true", help="no per-program progress")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.count is None:
        args.count = 5000 if args.long else 50
    return args


def _worker(seeds: list[int], shapes: int, budgets: int) -> int:
    """Check ``seeds`` one by one, one JSON line before and after each (read by the parent)."""
    from .differential import check_program
    from .program_gen import program_from_seed

    out = sys.stdout
    # Lets the tests check that a crashing worker is reported and replaced.
    crash_seed = os.environ.get("BLADE_RELAX_FUZZ_CRASH_SEED")
    for seed in seeds:
        out.write(json.dumps({"event": "start", "seed": seed}) + "\n")
        out.flush()
        if crash_seed is not None and seed == int(crash_seed):
            os.abort()
        try:
            report = check_program(
                program_from_seed(seed), shapes=shapes, budgets_per_shape=budgets
            )
            record = report_record(report)
        except Exception as err:  # a harness failure is a finding of this seed too
            record = {
                "seed": seed,
                "shapes": 0,
                "runs": 0,
                "checks": {},
                "known": [],
                "mismatches": [f"harness error: {type(err).__name__}: {err}"],
                "program": None,
            }
        out.write(json.dumps({"event": "done", "record": record}) + "\n")
        out.flush()
    return 0


def _run_isolated(
    seeds: list[int], shapes: int, budgets: int, jobs: int, totals: FuzzTotals, quiet: bool
) -> None:
    """Run ``seeds`` in ``jobs`` worker processes, restarting a worker after a crash."""
    pending = [seeds[i::jobs] for i in range(jobs)]
    procs: dict[int, tuple[subprocess.Popen, list[int], dict[str, Any]]] = {}

    def spawn(slot: int) -> None:
        todo = pending[slot]
        if not todo:
            return
        cmd = [
            sys.executable,
            "-m",
            "blade_relax.testing.fuzz",
            "--worker",
            "--seeds",
            ",".join(map(str, todo)),
            "--shapes",
            str(shapes),
            "--budgets",
            str(budgets),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        procs[slot] = (proc, todo, {"current": None})

    for slot in range(jobs):
        spawn(slot)
    # Workers are read one after another: each line is short and the workers are symmetric.
    while procs:
        for slot in list(procs):
            proc, todo, state = procs[slot]
            line = proc.stdout.readline()
            if line:
                msg = json.loads(line)
                if msg["event"] == "start":
                    state["current"] = msg["seed"]
                else:
                    record = msg["record"]
                    totals.add(record)
                    todo.remove(record["seed"])
                    state["current"] = None
                    if not quiet:
                        _progress(totals, record)
                continue
            proc.wait()
            del procs[slot]
            if state["current"] is not None:
                seed = state["current"]
                record = {
                    "seed": seed,
                    "shapes": 0,
                    "runs": 0,
                    "checks": {},
                    "known": [],
                    "mismatches": [f"crash: worker died with status {proc.returncode}"],
                    "program": f"program_from_seed({seed})",
                }
                totals.add(record)
                todo.remove(seed)
                if not quiet:
                    _progress(totals, record)
            spawn(slot)


def _progress(totals: FuzzTotals, record: dict[str, Any]) -> None:
    flag = "MISMATCH" if record["mismatches"] else "ok"
    print(f"[{totals.programs}] seed {record['seed']}: {record['runs']} runs {flag}", flush=True)
    for m in record["mismatches"]:
        print(f"    {m[:400]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 when a mismatch was found)."""
    args = _parse(argv)
    if args.worker:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        return _worker(seeds, args.shapes, args.budgets)

    from .differential import STOCK, available_variants, check_program
    from .program_gen import program_from_seed

    variants = [STOCK.name, *[v.name for v in available_variants()]]
    seeds = list(range(args.start, args.start + args.count))
    totals = FuzzTotals()
    start = time.perf_counter()
    if args.long or args.isolate:
        _run_isolated(seeds, args.shapes, args.budgets, max(1, args.jobs), totals, args.quiet)
    else:
        for seed in seeds:
            report = check_program(
                program_from_seed(seed), shapes=args.shapes, budgets_per_shape=args.budgets
            )
            record = report_record(report)
            totals.add(record)
            if not args.quiet:
                _progress(totals, record)
    seconds = time.perf_counter() - start
    print(totals.text(variants, seconds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "programs": totals.programs,
                    "shapes": totals.shapes,
                    "runs": totals.runs,
                    "mismatches": totals.mismatches,
                    "variants": variants,
                    "checks": dict(totals.checks),
                    "known": dict(totals.known),
                    "seeds": [args.start, args.start + args.count],
                    "seconds": round(seconds, 1),
                    "failures": totals.failures,
                },
                f,
                indent=1,
            )
    return 1 if totals.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

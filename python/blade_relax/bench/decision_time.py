"""What the remat runtime's decision costs: cached, uncached and the minimum search.

``python -m blade_relax.bench.decision_time`` builds each workload (``--workloads``, default
``llama-train,gpt2-train,mlp-train`` at the ``small`` size), runs the default pipeline on it
and reads, per length (``--lengths``), the rematerialization metadata of the function that
runs there under a budget: the metadata the executable carries, parsed into the
:class:`~blade_relax.runtime.remat.RematProgram` that ``remat_begin`` builds. Nothing is run on
a device. Per length and budget (``--fractions`` of the unevicted peak) it times:

* the *cached* decision: :meth:`RematProgram.decision` for a shape and budget it has decided
  before, as every call of a training loop after the first (microseconds per call);
* the *uncached* decision: :func:`~blade_relax.runtime.remat_policy.decide` on a timeline
  built afresh for every repeat, so that none of the search's caches are warm (the first call
  at a new shape and budget; a budget no eviction set reaches runs the minimum search, unless
  no eviction lowers the peak at all);
* the *minimum search*: :func:`~blade_relax.runtime.remat_policy.minimum_peak` alone, on a
  fresh timeline (what an unreachable budget pays, and ``RematProgram.minimum_peak``).

Times are medians over ``--repeat`` repeats, on the wall clock (``--clock wall``, the default)
or as the CPU time of the deciding thread (``--clock cpu``: on a shared machine, a thread that
is not scheduled for a while counts only the time it ran, so medians taken minutes apart vary
less). A second table follows the number of slots
(evictable tensors) by building ``--sweep-workload`` (llama-train) with ``--layers`` decoder
layers (default 1,2,4). ``--json PATH`` writes every row, samples included.

Building the workloads and running the pipeline dominate the run: about three minutes with the
defaults on two cores, and four more for an eight-layer Llama (``--layers 1,2,4,8``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..util.cliargs import CliError, OneLineParser, check_output_path, first_line

__all__ = ["CLOCKS", "BudgetTiming", "TimelineTiming", "build_parser", "main", "time_timeline"]

DEFAULT_PROG = "python -m blade_relax.bench.decision_time"
DEFAULT_WORKLOADS = "llama-train,gpt2-train,mlp-train"
DEFAULT_LENGTHS = "16,64,256"
DEFAULT_FRACTIONS = "0.9,0.8,0.7"
# Eight layers take about four minutes more to build on two cores: --layers 1,2,4,8.
DEFAULT_LAYERS = "1,2,4"
# Cached decisions are timed in loops of this many calls (one call is well under the clock's
# resolution for a single reading to mean much).
_CACHED_CALLS = 200
# What ``--clock`` measures with.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
_CLOCK_WORDS = {"wall": "wall clock", "cpu": "CPU time of the deciding thread"}
# The size flags that override single fields of the preset (``--layers`` is the sweep).
_SIZE_FLAGS = ("hidden", "heads", "kv_heads", "intermediate", "vocab", "max_seq_len", "batch")


@dataclass
class BudgetTiming:
    """One budget at one timeline.

    Attributes
    ----------
    fraction, budget
        The budget, as a fraction of the unevicted peak and in bytes.
    uncached_ms
        Median time of an uncached decision (milliseconds); ``uncached_samples`` are all of
        them.
    cached_us
        Median time of a cached decision through ``RematProgram.decision`` (microseconds).
    peak, reachable, evicted, regime
        What the decision says: its predicted peak, whether it fits the budget, how many
        slots it evicts, and the regime of chained inputs (``cache``, ``temp`` or ``mixed``).
    """

    fraction: float
    budget: int
    uncached_ms: float
    cached_us: float
    peak: int
    reachable: bool
    evicted: int
    regime: str
    uncached_samples: list[float] = field(default_factory=list)


@dataclass
class TimelineTiming:
    """The decision times of one function at one length.

    Attributes
    ----------
    workload, layers, length
        What was built, and the sequence length.
    function
        The rematerialized function that runs at that length under a budget.
    slots, candidates, points
        Evictable tensors, those whose eviction frees anything (what the searches choose
        from), and points of the timeline.
    base_peak, floor
        The peak with nothing evicted, and the floor no eviction set goes below
        (``ConcreteTimeline.unevictable``).
    budgets
        One row per budget.
    minimum_ms, minimum_peak
        Median time of the minimum search (milliseconds), and the peak it reaches;
        ``minimum_samples`` are all the times.
    """

    workload: str
    layers: int
    length: int
    function: str
    slots: int
    candidates: int
    points: int
    base_peak: int
    floor: int
    budgets: list[BudgetTiming] = field(default_factory=list)
    minimum_ms: float = 0.0
    minimum_peak: int = 0
    minimum_samples: list[float] = field(default_factory=list)


def _regime(cache: Any) -> str:
    if isinstance(cache, bool):
        return "cache" if cache else "temp"
    return "mixed"


def _fresh_times(
    tl: Any, run: Callable[[Any], Any], repeat: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[float], Any]:
    """Seconds of ``run`` on a copy of ``tl`` with cold caches, ``repeat`` times, on
    ``clock``; its result."""
    from ..runtime.remat_policy import ConcreteTimeline

    times, result = [], None
    # Collected once, not before every repeat: a collection right before the call would time
    # it with cold caches.
    gc.collect()
    for _ in range(repeat):
        fresh = ConcreteTimeline(base=tl.base, slots=tl.slots)
        start = clock()
        result = run(fresh)
        times.append(clock() - start)
    return times, result


def _cached_us(
    program: Any,
    dims: tuple[int, ...],
    budget: int,
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median microseconds of a decision ``program`` has made before (the training loop's)."""
    program.decision(dims, budget)
    per_call = []
    for _ in range(repeat):
        start = clock()
        for _ in range(_CACHED_CALLS):
            program.decision(dims, budget)
        per_call.append((clock() - start) / _CACHED_CALLS * 1e6)
    return statistics.median(per_call)


def time_timeline(
    program: Any,
    dims: Sequence[int],
    fractions: Sequence[float],
    *,
    repeat: int = 5,
    workload: str = "",
    layers: int = 0,
    length: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> TimelineTiming:
    """Time the decisions of ``program`` at ``dims`` (see the module docstring).

    Parameters
    ----------
    program
        A :class:`~blade_relax.runtime.remat.RematProgram`.
    dims
        One value per name of ``program.dims``.
    fractions
        Budgets, as fractions of the unevicted peak at ``dims``.
    repeat
        Repeats per measurement; the tables show medians.
    workload, layers, length
        Recorded in the result.
    clock
        Seconds by this clock (:data:`CLOCKS`).

    Returns
    -------
    TimelineTiming
    """
    from ..runtime.remat_policy import decide, effective_slots, minimum_peak

    key = tuple(int(d) for d in dims)
    tl = program.timeline(key)
    row = TimelineTiming(
        workload=workload,
        layers=layers,
        length=length,
        function=program.function,
        slots=len(tl.slots),
        candidates=len(effective_slots(tl)),
        points=len(tl.base),
        base_peak=tl.base_peak,
        floor=tl.unevictable()[0],
    )
    for fraction in fractions:
        budget = max(1, int(fraction * tl.base_peak))
        times, decision = _fresh_times(tl, lambda t, b=budget: decide(t, b), repeat, clock)
        row.budgets.append(
            BudgetTiming(
                fraction=fraction,
                budget=budget,
                uncached_ms=statistics.median(times) * 1e3,
                cached_us=_cached_us(program, key, budget, repeat, clock),
                peak=decision.peak,
                reachable=decision.reachable,
                evicted=len(decision.evicted),
                regime=_regime(decision.cache),
                uncached_samples=[t * 1e3 for t in times],
            )
        )
    times, lowest = _fresh_times(tl, minimum_peak, repeat, clock)
    row.minimum_ms = statistics.median(times) * 1e3
    row.minimum_peak = lowest.peak
    row.minimum_samples = [t * 1e3 for t in times]
    return row


def _programs(workload: Any, lengths: Sequence[int]) -> dict[int, tuple[Any, tuple[int, ...]]]:
    """Per length, the remat program that runs there under a budget and its dims (none when
    the pass left the function alone)."""
    import tvm

    from .. import get_pipeline
    from ..contract import REMAT_META_ATTR
    from ..runtime.remat import RematProgram
    from ..transform.dispatch import version_for

    with tvm.target.Target("llvm"):
        mod = get_pipeline("llvm")(workload.graph.mod)
    found: dict[int, tuple[Any, tuple[int, ...]]] = {}
    programs: dict[str, Any] = {}
    for length in lengths:
        values = {"s": length, "b": workload.sizes.batch}
        name = version_for(mod, "main", values, budget=True)
        attrs = mod[name].attrs
        if attrs is None or REMAT_META_ATTR not in attrs:
            continue
        if name not in programs:
            programs[name] = RematProgram(json.loads(str(attrs[REMAT_META_ATTR])))
        program = programs[name]
        found[length] = (program, tuple(values[d] for d in program.dims))
    return found


def measure(
    workloads: Sequence[tuple[str, Any]],
    lengths: Sequence[int],
    fractions: Sequence[float],
    *,
    repeat: int = 5,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[TimelineTiming]:
    """Build each ``(name, sizes)`` workload and time its decisions at every length.

    Parameters
    ----------
    workloads
        Registry names and :class:`~blade_relax.bench.workloads.ModelSizes`.
    lengths
        Sequence lengths.
    fractions
        Budgets, as fractions of the unevicted peak.
    repeat
        Repeats per measurement.
    progress
        Called with a line per stage.
    clock
        Seconds by this clock (:data:`CLOCKS`).

    Returns
    -------
    list[TimelineTiming]
        One row per workload and length that has a rematerialized function.
    """
    from .workloads import build_workload

    say = progress or (lambda _msg: None)
    rows = []
    for name, sizes in workloads:
        say(f"building {name} with {sizes.layers} layer(s) and running the pipeline")
        started = time.perf_counter()
        programs = _programs(build_workload(name, sizes), lengths)
        say(f"{name}: built in {time.perf_counter() - started:.0f} s; timing decisions")
        for length in lengths:
            if length not in programs:
                say(f"{name} s={length}: no rematerialized function, skipped")
                continue
            program, dims = programs[length]
            rows.append(
                time_timeline(
                    program,
                    dims,
                    fractions,
                    repeat=repeat,
                    workload=name,
                    layers=sizes.layers,
                    length=length,
                    clock=clock,
                )
            )
    return rows


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def table(rows: Sequence[TimelineTiming], fractions: Sequence[float]) -> str:
    """The markdown table of ``rows``: medians, an unreachable budget marked ``*``."""
    head = ["workload", "layers", "s", "slots", "points"]
    head += [f"{f:g} uncached (ms)" for f in fractions]
    head += ["minimum search (ms)", "cached (us)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        slots = str(r.slots) if r.slots == r.candidates else f"{r.slots} ({r.candidates})"
        cells = [r.workload, str(r.layers), str(r.length), slots, str(r.points)]
        cells += [_ms(b.uncached_ms) + ("" if b.reachable else "*") for b in r.budgets]
        cached = statistics.median(b.cached_us for b in r.budgets) if r.budgets else 0.0
        cells += [_ms(r.minimum_ms), f"{cached:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _numbers(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated numbers, not {text!r}") from None
    return values


def build_parser(prog: str = DEFAULT_PROG) -> OneLineParser:
    """The argument parser; errors raise :class:`~blade_relax.util.cliargs.CliError`."""
    parser = OneLineParser(
        prog=prog,
        description="Time the remat runtime's eviction decision (cached, uncached, and the "
        "minimum search) on the timelines of real workloads.",
    )
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma-separated names")
    parser.add_argument("--size", default="small", choices=["small", "real"])
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated lengths")
    parser.add_argument(
        "--fractions",
        default=DEFAULT_FRACTIONS,
        help="budgets, as fractions of the unevicted peak (default: 0.9,0.8,0.7)",
    )
    parser.add_argument(
        "--layers",
        default=DEFAULT_LAYERS,
        help="layer counts of the slot sweep (default: 1,2,4; empty: no sweep)",
    )
    parser.add_argument("--sweep-workload", default="llama-train", help="workload of the sweep")
    parser.add_argument("--repeat", type=int, default=5, help="repeats per measurement (5)")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="wall clock, or the CPU time of the deciding thread (default: wall)",
    )
    for flag in _SIZE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _check_light(args: Any) -> tuple[list[str], list[int], list[float], list[int]]:
    """Checks that need no TVM: names, numbers, the output path."""
    from .cli import WORKLOAD_NAMES

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for name in [*names, args.sweep_workload]:
        if name not in WORKLOAD_NAMES:
            raise CliError(f"unknown workload {name!r} (one of {', '.join(WORKLOAD_NAMES)})")
    lengths = _numbers(args.lengths, "--lengths", int)
    fractions = _numbers(args.fractions, "--fractions", float)
    layers = _numbers(args.layers, "--layers", int)
    if not lengths or not fractions:
        raise CliError("--lengths and --fractions need at least one value each")
    if any(not f > 0 for f in fractions) or any(n < 1 for n in layers) or args.repeat < 1:
        raise CliError("--fractions must be positive, --layers and --repeat at least 1")
    for flag in _SIZE_FLAGS:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    check_output_path(args.json, "--json")
    return names, lengths, fractions, layers


def _run(args: Any) -> int:
    names, lengths, fractions, layers = _check_light(args)
    from .. import load

    load()  # what `import blade_relax` does elsewhere: accounting, builtins, pipeline
    from .workloads import PRESETS

    overrides = {f: getattr(args, f) for f in _SIZE_FLAGS if getattr(args, f) is not None}
    sizes = dataclasses.replace(PRESETS[args.size], **overrides)
    for n in lengths:
        if not sizes.min_seq_len <= n <= sizes.max_seq_len:
            raise CliError(f"length {n} is outside {sizes.min_seq_len} <= s <= {sizes.max_seq_len}")

    def say(message: str) -> None:
        if not args.quiet:
            print(f"... {message}", file=sys.stderr, flush=True)

    clock = CLOCKS[args.clock]
    main_rows = measure(
        [(n, sizes) for n in names],
        lengths,
        fractions,
        repeat=args.repeat,
        progress=say,
        clock=clock,
    )
    done = {(r.workload, r.layers) for r in main_rows}
    sweep_sizes = [dataclasses.replace(sizes, layers=n) for n in layers]
    todo = [
        (args.sweep_workload, s) for s in sweep_sizes if (args.sweep_workload, s.layers) not in done
    ]
    extra = measure(todo, lengths, fractions, repeat=args.repeat, progress=say, clock=clock)
    sweep_rows = sorted(
        [r for r in main_rows + extra if r.workload == args.sweep_workload and r.layers in layers],
        key=lambda r: (r.layers, r.length),
    )
    words = _CLOCK_WORDS[args.clock]
    print(f"## Remat decision time ({args.size}; medians of {args.repeat} repeats, {words})\n")
    print(table(main_rows, fractions))
    if layers:
        print(f"\n## Growth with the number of slots: {args.sweep_workload} by layers\n")
        print(table(sweep_rows, fractions))
    print(
        "\nslots: evictable tensors (in parentheses, those whose eviction frees memory, when "
        "fewer). *: no eviction set reaches the budget (the decision ran the minimum search, "
        "or found that no eviction lowers the peak)."
    )
    if args.json:
        payload = {
            "size": args.size,
            "sizes": asdict(sizes),
            "fractions": fractions,
            "repeat": args.repeat,
            "clock": args.clock,
            "rows": [asdict(r) for r in main_rows],
            "sweep": [asdict(r) for r in sweep_rows],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        say(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """Command line entry point; returns the exit status (2 on bad input)."""
    from ..util.quiet import quiet_stderr

    try:
        args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    except CliError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    with quiet_stderr():
        try:
            return _run(args)
        except CliError as err:
            print(f"{prog}: error: {first_line(err)}", file=sys.stderr, flush=True)
            return 2


if __name__ == "__main__":
    sys.exit(main())

"""``blade-relax demo``: stock TVM, blade_relax and blade_relax under a budget, side by side.

A built-in model with a dynamic dimension is compiled three ways and run at several sizes:
TVM's stock pipeline, blade_relax's pipeline (:func:`blade_relax.get_pipeline`), and the same
executable under a runtime memory budget (a fraction of its own measured peak). For each the
table gives the peak the symbolic timeline predicts next to the peak the runtime accounting
measures, the ratio to stock, the evictions and regenerations; a plot goes with it
(:mod:`.demo_plot`). A prediction that misses its measurement, or outputs that differ from
stock TVM's, end the command with status 1.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..util.cliargs import (
    CliError,
    available_memory,
    check_output_path,
    first_line,
    human_bytes,
    refuse_beyond_memory,
)
from .common import add_force, add_verbose, parse_fraction, progress, warn
from .demo_plot import write_demo_plot
from .lowering import blade_flags, function_label
from .models import (
    BENCH_PREFIX,
    DEFAULT_DEMO_MODEL,
    Model,
    load_model,
    models_help,
    precheck_bench_dims,
)

__all__ = ["DemoRow", "RunResult", "add_demo_arguments", "run_demo"]

DEFAULT_DEMO_SIZES = "16,128,1024"
DEFAULT_BUDGET = 0.9
# Default outputs go under out/ (created when missing), never loose into the current directory.
DEFAULT_DEMO_PLOT = "out/demo.png"
#: The largest size the models without a declared upper bound were tried at (the demo's
#: default sizes); sizes far beyond it get a warning with the predicted bytes first.
TRIED_SIZE = 1024
FAR_BEYOND = 8
# Outputs of blade_relax's executables are compared with stock TVM's: the kernels are the same,
# so anything beyond float rounding is a bug.
OUTPUT_RTOL = 1e-5


def add_demo_arguments(subparsers: Any) -> None:
    """Add ``demo`` and its flags to the subcommands of ``blade-relax``."""
    demo = subparsers.add_parser(
        "demo",
        help="stock TVM vs blade_relax vs blade_relax under a memory budget, on a small model",
        description="Compile a model with a dynamic dimension for the CPU with TVM's stock "
        "pipeline and with blade_relax's, run both at several sizes, then run blade_relax's "
        "executable again under a memory budget (a fraction of its own peak) so that the "
        "runtime evicts and regenerates tensors. Prints, per size and pipeline, the peak the "
        "compiler predicted and the peak the runtime accounting measured (bytes allocated by "
        "the VM during one call), the ratio to stock TVM, evictions, regenerations and whether "
        "the outputs equal stock TVM's; writes a plot. Exits with 1 when a prediction misses "
        "its measurement or outputs differ, with 2 on bad input.",
    )
    demo.add_argument(
        "--model",
        default=DEFAULT_DEMO_MODEL,
        metavar="NAME",
        help=f"the model (default: {DEFAULT_DEMO_MODEL}); one of: {models_help()}",
    )
    demo.add_argument(
        "--sizes",
        default=DEFAULT_DEMO_SIZES,
        metavar="N,N,...",
        help="comma-separated positive values for the dynamic dims; every dim of the model "
        f"takes each value in turn (default: {DEFAULT_DEMO_SIZES})",
    )
    demo.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="FRACTION",
        help="the memory budget of the third run, as a fraction in (0, 1] of blade_relax's "
        f"measured peak at the same size (default: {DEFAULT_BUDGET})",
    )
    demo.add_argument(
        "--plot",
        default=DEFAULT_DEMO_PLOT,
        metavar="PATH",
        help="PNG to write: live bytes during one call at the largest size (stock TVM, "
        "blade_relax, blade_relax under the budget; kernel scratch included) and measured peak "
        f"vs size (default: {DEFAULT_DEMO_PLOT}; missing folders are created)",
    )
    demo.add_argument("--no-plot", action="store_true", help="do not write the plot")
    add_force(
        demo,
        "the predicted peak at a size (the symbolic timelines' call plus its inputs and "
        "parameters)",
    )
    add_verbose(demo)


def _parse_sizes(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    try:
        sizes = [int(part) for part in parts if part]
    except ValueError:
        raise CliError(f"--sizes takes comma-separated integers, not {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise CliError(f"--sizes needs positive integers, got {text!r}")
    return sorted(set(sizes))


@dataclass
class RunResult:
    """One VM call of one executable at one size.

    Attributes
    ----------
    peak_bytes
        Peak of the call as the runtime accounting counts it, minus the bytes live before it.
    predicted_bytes
        What the compiler predicted for the same call: the evaluated symbolic timeline, or the
        remat runtime's decision under a budget (``None`` when nothing predicted it).
    evictions, regenerations
        Counters of :func:`blade_relax.runtime.memory_stats` for the call.
    outputs
        The flattened outputs as numpy arrays.
    budget_bytes
        The budget the call ran under, if any.
    reachable
        Whether the remat runtime found an eviction set within the budget.
    live_trace
        Live bytes (minus those live before the call) during each VM instruction of the call,
        kernel scratch (workspaces) included: its maximum is ``peak_bytes``.
    """

    peak_bytes: int
    predicted_bytes: int | None
    evictions: int = 0
    regenerations: int = 0
    outputs: list[Any] = field(default_factory=list)
    budget_bytes: int | None = None
    reachable: bool | None = None
    live_trace: list[int] = field(default_factory=list)


def _run_once(
    exe: Any,
    arrays: Sequence[Any],
    bindings: Mapping[str, int],
    budget: int | None = None,
    workspaces: Mapping[str, Any] | None = None,
) -> RunResult:
    from ..frontend import flatten_outputs
    from ..runtime import current_live_bytes, measure_call
    from ..runtime.remat import RematBudgetWarning

    live: list[int] = []

    scratch_of = workspaces or {}

    def instrument(_func: Any, name: str, before_run: bool, _ret: Any, *args: Any) -> int:
        # Memory over the program as the runtime sees it: the live bytes during every
        # instruction. A kernel's scratch (its workspace) counts only while the kernel runs and
        # is released before this hook sees the call end, so it is added back here: otherwise
        # the curve would top out below the measured peak, which includes it. A kernel
        # allocates nothing else (its outputs were allocated before the call), so the live
        # bytes after it plus its scratch are the live bytes while it ran.
        if not before_run:
            nbytes_of = scratch_of.get(name)
            on_device = any(hasattr(a, "device") for a in args)
            scratch = int(nbytes_of(args)) if nbytes_of is not None and on_device else 0
            live.append(current_live_bytes() + scratch)
        return 0  # run the instruction as usual

    # A fresh VM of ``exe`` (see measure_call); the kernels' workspaces (``workspaces``: the
    # compiled module's table) count while each kernel runs, as the symbolic timeline counts
    # them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematBudgetWarning)
        measured = measure_call(
            exe, arrays, budget=budget, workspaces=workspaces, instrument=instrument
        )
    base = measured.live_before
    result = RunResult(
        peak_bytes=measured.peak_bytes,
        predicted_bytes=None,
        evictions=measured.evictions,
        regenerations=measured.regenerations,
        outputs=flatten_outputs(measured.outputs),
        budget_bytes=budget,
        live_trace=[v - base for v in live],
    )
    decision = measured.decision
    if decision is not None:
        if {k: int(v) for k, v in decision["dims"].items()} == dict(bindings):
            result.predicted_bytes = int(decision["predicted_peak"]) - base
            result.reachable = bool(decision["reachable"])
    return result


def _outputs_note(reference: Sequence[Any], outputs: Sequence[Any]) -> tuple[str, bool]:
    import numpy as np

    if len(reference) != len(outputs):
        return "DIFFER", False
    worst = 0.0
    for ref, out in zip(reference, outputs):
        if ref.shape != out.shape:
            return "DIFFER", False
        if np.array_equal(ref, out):
            continue
        scale = max(float(np.linalg.norm(ref.astype("float64"))), 1e-30)
        worst = max(worst, float(np.linalg.norm((out - ref).astype("float64"))) / scale)
    if worst == 0.0:
        return "identical", True
    return (f"rel err {worst:.0e}", True) if worst <= OUTPUT_RTOL else ("DIFFER", False)


@dataclass
class DemoRow:
    """One line of the demo's table."""

    size: int
    pipeline: str
    result: RunResult
    stock_peak: int
    outputs: str
    outputs_ok: bool

    @property
    def matches(self) -> bool | None:
        if self.result.predicted_bytes is None:
            return None
        return self.result.predicted_bytes == self.result.peak_bytes


def _demo_table(rows: Sequence[DemoRow], dim_label: str) -> str:
    header = (
        f"| {dim_label:>6} | pipeline          | budget         | predicted peak | measured peak "
        "| match | vs stock | evictions | regenerations | outputs       |"
    )
    rule = (
        "|-------:|-------------------|----------------|---------------:|--------------:"
        "|:-----:|---------:|----------:|--------------:|---------------|"
    )
    lines = [header, rule]
    for row in rows:
        r = row.result
        predicted = f"{r.predicted_bytes:,}" if r.predicted_bytes is not None else "-"
        match = {None: "-", True: "yes", False: "NO"}[row.matches]
        if r.budget_bytes is None:
            budget = "-"
        else:
            budget = f"{r.budget_bytes:,} " + ("met" if r.peak_bytes <= r.budget_bytes else "over")
        lines.append(
            f"| {row.size:>6} | {row.pipeline:<17} | {budget:<14} | {predicted:>14} "
            f"| {r.peak_bytes:>13,} "
            f"| {match:^5} | {r.peak_bytes / row.stock_peak:>8.3f} | {r.evictions:>9} "
            f"| {r.regenerations:>13} | {row.outputs:<13} |"
        )
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    """Stock TVM vs blade_relax vs blade_relax under a budget; predicted vs measured peaks."""
    sizes = _parse_sizes(args.sizes)
    fraction = parse_fraction(args.budget)
    plot_path = None if args.no_plot else check_output_path(args.plot, "--plot")
    if args.model.startswith(BENCH_PREFIX):
        for size in sizes:
            precheck_bench_dims(args.model, {"s": size}, "--sizes")
    model = load_model(args.model)
    dims, all_bindings = _size_bindings(model, sizes)
    timelines = _predict(model, all_bindings, args.force)
    builds = _compile(model)

    dim_label = ",".join(dims)
    _warn_far_beyond(model, sizes, all_bindings, timelines)
    _print_header(model, dim_label, timelines, fraction)
    rows: list[DemoRow] = []
    for size, bindings in zip(sizes, all_bindings):
        rows += _run_size(model, size, bindings, dim_label, fraction, timelines, builds)

    print(_demo_table(rows, dim_label))
    print()
    status = _demo_summary(rows, dim_label, fraction)
    if plot_path is not None:
        write_demo_plot(plot_path, model.name, dim_label, rows, fraction)
        print(f"plot: {plot_path}")
    return status


def _size_bindings(model: Model, sizes: Sequence[int]) -> tuple[list[str], list[dict[str, int]]]:
    """The dynamic dims of ``model``'s ``main`` and, per size, every dim set to that size.

    Raises
    ------
    CliError
        When the model has no dynamic dim, or a size lies outside its declared ranges.
    """
    from ..symbolic import ShapeGraph

    dims = sorted(ShapeGraph.from_function(model.mod["main"]).dims)
    if not dims:
        raise CliError(f"model {model.name} has no dynamic dims to vary")
    all_bindings = [{d: size for d in dims} for size in sizes]
    if model.check_dims is not None:
        for bindings in all_bindings:
            try:
                model.check_dims(bindings)
            except ValueError as err:
                raise CliError(f"--sizes: {first_line(err)}") from None
    return dims, all_bindings


@dataclass
class _Timelines:
    """The symbolic memory timelines of both pipelines, read before anything is compiled.

    Attributes
    ----------
    stock
        Stock TVM's timeline of ``main``.
    blade_low
        The module lowered by blade_relax's passes. Its ``main`` is a dispatcher:
        ``MemoryAwareSchedule`` may have made range copies, each scheduled for its range of
        lengths, and ``Rematerialize`` a plain copy that runs without a budget next to the
        rewritten one.
    blade
        The timeline of every copy in ``blade_low`` that runs, unbudgeted, at one of the sizes.
    """

    stock: Any
    blade_low: Any
    blade: dict[str, Any]

    def blade_at(self, bindings: Mapping[str, int]) -> Any:
        """blade_relax's timeline at ``bindings``: that of the copy that runs unbudgeted."""
        from ..transform import version_for

        return self.blade[version_for(self.blade_low, "main", bindings)]


def _predict(model: Model, all_bindings: Sequence[Mapping[str, int]], force: bool) -> _Timelines:
    """Both pipelines' timelines, refusing (exit 2) the sizes that cannot fit as soon as known.

    The symbolic timelines say, before anything is compiled or allocated, what each size needs.
    The stock run comes first and its lowering is the quicker, so sizes that cannot fit are
    refused on its prediction alone, in seconds and in one line (no progress line before it);
    blade_relax's prediction is checked as soon as it is known.
    """
    from ..analysis import memory_timeline
    from ..pipeline import lower_to_memory_stage
    from ..transform import version_for

    stock_low = lower_to_memory_stage(model.mod)
    stock_tl = memory_timeline(stock_low["main"], mod=stock_low)
    _refuse_sizes_beyond_memory(all_bindings, lambda _b: {"stock TVM": stock_tl}, force)
    progress(f"lowering {model.name} with the blade_relax passes for its symbolic timeline")
    blade_low = lower_to_memory_stage(model.mod, **blade_flags())
    blade_fns = {version_for(blade_low, "main", b) for b in all_bindings}
    blade_tls = {fn: memory_timeline(blade_low[fn], mod=blade_low) for fn in sorted(blade_fns)}
    timelines = _Timelines(stock_tl, blade_low, blade_tls)
    _refuse_sizes_beyond_memory(
        all_bindings,
        lambda b: {"stock TVM": stock_tl, "blade_relax": timelines.blade_at(b)},
        force,
    )
    return timelines


@dataclass
class _Builds:
    """Both pipelines' executables for the CPU, with their kernels' workspace tables."""

    stock_exe: Any
    stock_ws: Any
    blade_exe: Any
    blade_ws: Any


def _compile(model: Model) -> _Builds:
    """Compile ``model`` with TVM's stock pipeline and with blade_relax's, for llvm."""
    from ..analysis import compile_keeping_module
    from ..pipeline import get_pipeline, stock_pipeline

    progress(f"compiling {model.name} with the stock TVM pipeline (llvm)")
    stock = compile_keeping_module(model.mod, "llvm", stock_pipeline("llvm"))
    stock_exe, stock_ws = stock.executable, stock.workspaces
    progress(f"compiling {model.name} with the blade_relax pipeline (llvm)")
    blade = compile_keeping_module(model.mod, "llvm", get_pipeline("llvm"))
    return _Builds(stock_exe, stock_ws, blade.executable, blade.workspaces)


def _print_header(model: Model, dim_label: str, timelines: _Timelines, fraction: float) -> None:
    """The model, its dims, the symbolic peaks of both pipelines and the budget rule."""
    print(f"model: {model.name}  ({model.description})")
    print(f"dynamic dims: {dim_label}  (every dim set to each size)")
    print(f"symbolic peak, stock TVM:   {timelines.stock.peak}")
    for fn, timeline in timelines.blade.items():
        where = "" if fn == "main" else f" ({function_label(timelines.blade_low, fn)})"
        print(f"symbolic peak, blade_relax{where}: {timeline.peak}")
    print(
        f"budget: {fraction:g} x blade_relax's measured peak at each size; predictions under "
        "the budget come from the remat runtime's decision"
    )
    print()


def _run_size(
    model: Model,
    size: int,
    bindings: Mapping[str, int],
    dim_label: str,
    fraction: float,
    timelines: _Timelines,
    builds: _Builds,
) -> list[DemoRow]:
    """The three runs at one size (stock TVM, blade_relax, blade_relax under the budget) as
    rows of the table, each compared with stock TVM's outputs."""
    started = time.perf_counter()
    at = f"{dim_label}={size}"
    arrays = model.make_args(bindings) if model.make_args else []
    stock_predicted = timelines.stock.evaluate(bindings).peak
    progress(f"{at} [1/3]: stock TVM (predicted peak {human_bytes(stock_predicted)})")
    stock = _run_once(builds.stock_exe, arrays, bindings, workspaces=builds.stock_ws)
    stock.predicted_bytes = stock_predicted
    blade_predicted = timelines.blade_at(bindings).evaluate(bindings).peak
    progress(f"{at} [2/3]: blade_relax (predicted peak {human_bytes(blade_predicted)})")
    blade = _run_once(builds.blade_exe, arrays, bindings, workspaces=builds.blade_ws)
    blade.predicted_bytes = blade_predicted
    budget = max(1, int(fraction * blade.peak_bytes))
    progress(f"{at} [3/3]: blade_relax under a budget of {human_bytes(budget)}")
    budgeted = _run_once(
        builds.blade_exe, arrays, bindings, budget=budget, workspaces=builds.blade_ws
    )
    progress(f"{at}: done in {time.perf_counter() - started:.1f} s")
    rows = []
    for label, result in (
        ("stock TVM", stock),
        ("blade_relax", blade),
        (f"blade_relax @{fraction:g}", budgeted),
    ):
        if result is stock:
            note, ok = "reference", True
        else:
            note, ok = _outputs_note(stock.outputs, result.outputs)
        rows.append(DemoRow(size, label, result, stock.peak_bytes, note, ok))
    return rows


def _refuse_sizes_beyond_memory(
    all_bindings: Sequence[Mapping[str, int]],
    timelines: Callable[[Mapping[str, int]], Mapping[str, Any]],
    force: bool,
) -> None:
    """Refuse (one line, exit 2) sizes whose predicted peak exceeds the memory available now.

    Called before anything is compiled or allocated, on the symbolic timelines alone: a call's
    arrays (inputs and parameters) plus the largest peak among the pipelines that will run at
    those sizes. ``timelines(bindings)`` maps each pipeline's label to its timeline.
    """
    if force:
        return
    free = available_memory()
    if free is None:
        return
    for bindings in all_bindings:
        evaluated = {label: tl.evaluate(bindings) for label, tl in timelines(bindings).items()}
        label, worst = max(evaluated.items(), key=lambda item: item[1].peak)
        at = ", ".join(f"{dim}={value}" for dim, value in bindings.items())
        refuse_beyond_memory(
            f"--sizes: {at}",
            worst.peak + worst.persistent,
            f"{label}'s call {human_bytes(worst.peak)} + {human_bytes(worst.persistent)} of inputs and "
            "parameters",
            free,
            force=force,
            before="compiling or allocating anything",
        )


def _warn_far_beyond(
    model: Model,
    sizes: Sequence[int],
    all_bindings: Sequence[Mapping[str, int]],
    timelines: _Timelines,
) -> None:
    """Warn before running sizes far beyond those the model was tried at, with their bytes.

    A model that declares an upper bound has its sizes checked against it already; one that
    declares none (the built-ins) was tried up to :data:`TRIED_SIZE`. The symbolic timelines
    say, without running anything, how many bytes a call at the asked size allocates.
    """
    from ..symbolic import ShapeGraph

    graph = ShapeGraph.from_function(model.mod["main"])
    if any(d.upper is not None for d in graph.dims.values()):
        return
    free = available_memory()
    for size, bindings in zip(sizes, all_bindings):
        if size <= FAR_BEYOND * TRIED_SIZE:
            continue
        stock = timelines.stock.evaluate(bindings)
        blade = timelines.blade_at(bindings).evaluate(bindings)
        inputs = stock.persistent
        need = max(stock.peak, blade.peak) + inputs
        message = (
            f"{','.join(bindings)}={size} is {size / TRIED_SIZE:.0f}x the largest size "
            f"{model.name} was tried at ({TRIED_SIZE}; it declares no upper bound). The symbolic "
            f"timelines predict a peak of {human_bytes(stock.peak)} (stock TVM) and "
            f"{human_bytes(blade.peak)} (blade_relax) per call, plus {human_bytes(inputs)} of inputs "
            "and parameters; each of the three runs takes time that grows with the size "
            "(progress lines follow)"
        )
        if free is not None and need > free:  # only with --force: refused up front otherwise
            message += (
                f"; that is more than the {human_bytes(free)} of memory available now (--force)"
            )
        warn(message)


def _demo_summary(rows: Sequence[DemoRow], dim_label: str, fraction: float) -> int:
    largest = max(r.size for r in rows)
    stock, blade, budget = (r for r in rows if r.size == largest)
    print(
        f"at {dim_label}={largest}: blade_relax peaks at {human_bytes(blade.result.peak_bytes)}, "
        f"{blade.result.peak_bytes / stock.result.peak_bytes:.3f} x stock TVM's "
        f"{human_bytes(stock.result.peak_bytes)}"
    )
    b = budget.result
    met = b.budget_bytes is not None and b.peak_bytes <= b.budget_bytes
    print(
        f"under a budget of {fraction:g} x that peak ({human_bytes(b.budget_bytes or 0)}): "
        f"{b.evictions} evictions, {b.regenerations} regenerations, peak "
        f"{human_bytes(b.peak_bytes)} ({b.peak_bytes / stock.result.peak_bytes:.3f} x stock): "
        + ("budget met" if met else "over budget, the smallest peak the runtime could reach")
    )
    for row in rows:
        r = row.result
        if r.budget_bytes is not None and r.reachable is False and row.size != largest:
            print(
                f"  {dim_label}={row.size}: the budget ({r.budget_bytes:,} B) is below what "
                f"evictions can reach; ran at {r.peak_bytes:,} B"
            )
    misses = [r for r in rows if r.matches is False]
    unpredicted = [r for r in rows if r.matches is None]
    wrong = [r for r in rows if not r.outputs_ok]
    checked = len(rows) - len(unpredicted)
    if misses:
        for r in misses:
            print(
                f"PREDICTION MISSED at {dim_label}={r.size}, {r.pipeline}: predicted "
                f"{r.result.predicted_bytes:,} B, measured {r.result.peak_bytes:,} B"
            )
    else:
        print(f"predicted == measured for all {checked} predicted runs")
    for r in wrong:
        print(f"OUTPUTS DIFFER from stock TVM at {dim_label}={r.size}, {r.pipeline}")
    return 1 if misses or wrong else 0

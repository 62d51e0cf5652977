"""The ``blade-relax`` command line: ``demo``, ``report``, ``train`` and ``bench``.

``demo``
    Compiles a built-in model with a dynamic dimension three ways and runs it at several sizes:
    TVM's stock pipeline, blade_relax's pipeline (:func:`blade_relax.get_pipeline`), and the
    same executable under a runtime memory budget (a fraction of its own measured peak). For
    each it prints the peak the symbolic timeline predicts next to the peak the runtime
    accounting measures, the ratio to stock, the evictions and regenerations, and writes a plot.
    A prediction that misses its measurement, or outputs that differ from stock TVM's, end the
    command with status 1.
``report``
    The :class:`blade_relax.analysis.MemoryReport` of one function of a module saved as
    TVMScript (``mod.script()``) or of a built-in model, before and after our passes, as a text
    table, JSON, a Chrome trace and a plot.
``train``
    Trains a bench model (Llama or GPT-2, random init) for ``--steps`` optimizer steps on
    synthetic token batches of long-tailed lengths, with blade_relax's compiled step (optimizer
    in the graph, one compilation) and with PyTorch's loop on the same init and batches
    (:func:`blade_relax.bench.training.compare_training`); prints loss and peak bytes per length
    against PyTorch's, writes a plot and JSON. Losses that differ from PyTorch's by more than
    ``1e-4`` (relative) end the command with status 1.
``bench``
    The benchmark ruler, :func:`blade_relax.bench.main`, with its own flags.

Bad input (an unknown model, a missing or unparsable file, malformed ``--dims``/``--sizes``,
an unwritable output path, sizes whose predicted memory exceeds what is available now unless
``--force``, ...) ends the command with status 2 and one line on stderr, before anything is
compiled or allocated. Default outputs go under ``out/``, which is created when missing. Progress
lines of long steps (building a model, compiling, lowering, every run) go to stderr, results to
stdout. TVM's native warnings and transformers' notes are filtered from stderr unless
``--verbose`` (or ``BLADE_RELAX_VERBOSE=1``).

``--help`` and the checks of the arguments import no TVM (it takes seconds to import on a small
machine); a command imports it when it starts its work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .bench.cli import WORKLOAD_NAMES
from .util.cliargs import (
    CliError,
    OneLineParser,
    available_memory,
    check_output_path,
    first_line,
    human_bytes,
    refuse_beyond_memory,
)
from .util.figures import save_png

if TYPE_CHECKING:
    from .bench.workloads import ModelSizes

__all__ = ["CliError", "Model", "build_parser", "load_model", "main", "model_names"]

DEFAULT_DEMO_MODEL = "mlp-deep-train"
DEFAULT_DEMO_SIZES = "16,128,1024"
DEFAULT_BUDGET = 0.9
# Default outputs go under out/ (created when missing), never loose into the current directory.
DEFAULT_DEMO_PLOT = "out/demo.png"
DEFAULT_TRAIN_PLOT = "out/train.png"
# Report dims that the user leaves out are evaluated at this value (clipped to the dim's range).
DEFAULT_REPORT_DIM = 128
BENCH_PREFIX = "bench:"
#: The names of :data:`blade_relax.frontend.builtin.BUILTIN_MODELS`, known without importing TVM.
BUILTIN_MODEL_NAMES = ("mlp", "attention", "layer-norm", "concat-split", "mlp-train")
#: The largest size the models without a declared upper bound were tried at (the demo's
#: default sizes); sizes far beyond it get a warning with the predicted bytes first.
TRIED_SIZE = 1024
FAR_BEYOND = 8
# Outputs of blade_relax's executables are compared with stock TVM's: the kernels are the same,
# so anything beyond float rounding is a bug.
OUTPUT_RTOL = 1e-5


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ models
@dataclass
class Model:
    """A module to report on or run, with a way to make arguments for its ``main``.

    Attributes
    ----------
    name
        The name it was asked for (a built-in name or a file path).
    mod
        The Relax module.
    description
        One line saying what it is.
    make_args
        Numpy arrays for the parameters of ``main`` at concrete dims (``None`` for a file).
    check_dims
        Raises ``ValueError`` when concrete dims lie outside the model's declared ranges.
    """

    name: str
    mod: Any
    description: str
    make_args: Callable[[Mapping[str, int]], list[Any]] | None = None
    check_dims: Callable[[Mapping[str, int]], None] | None = None


def _deep_mlp_sizes() -> ModelSizes:
    from .bench.workloads import ModelSizes

    return ModelSizes(layers=4, hidden=64, intermediate=256, vocab=128)


def _deep_mlp_train() -> Model:
    """A four-layer MLP classifier's training step (loss and every gradient), dynamic ``s``.

    Deep enough that rematerialization has activations to trade, small enough to compile in a
    couple of seconds; built in Relax and differentiated by ``relax.transform.Gradient``.
    """
    import numpy as np

    from .bench.workloads import mlp_forward_module
    from .frontend import relax_training_step

    sizes = _deep_mlp_sizes()
    forward = mlp_forward_module(sizes)
    rng = np.random.default_rng(0)
    params = []
    for param in forward["main"].params[2:]:
        shape = [int(v) for v in param.ty.shape.values]
        scale = 1.0 / math.sqrt(shape[0]) if len(shape) == 2 else 0.1
        params.append((rng.standard_normal(shape) * scale).astype("float32"))
    graph = relax_training_step(
        forward, params=params, num_input=2, dims={"s": (1, None)}, keep_upper_bound=False
    )
    return _graph_model(
        DEFAULT_DEMO_MODEL,
        graph,
        f"training step of an MLP classifier ({sizes.layers} hidden layers of {sizes.intermediate}, "
        f"input {sizes.hidden}, {sizes.vocab} classes), {len(params)} parameters; "
        "dynamic number of rows s",
    )


def _graph_model(name: str, graph: Any, description: str) -> Model:
    def make_args(dims: Mapping[str, int]) -> list[Any]:
        return [*graph.random_inputs(dims), *graph.params]

    return Model(name, graph.mod, description, make_args, graph.check_dims)


def _builtin_model(name: str) -> Model:
    from .frontend.builtin import BUILTIN_MODELS, random_arguments

    mod = BUILTIN_MODELS[name]()
    doc = (BUILTIN_MODELS[name].__doc__ or name).strip().splitlines()[0].replace("``", "")

    def make_args(dims: Mapping[str, int]) -> list[Any]:
        return random_arguments(mod["main"], dict(dims))

    return Model(name, mod, f"built-in: {doc}", make_args)


def _bench_ranges(name: str) -> dict[str, tuple[int, int]]:
    """The dim ranges benchmark workload ``name`` is exported with (the ``small`` preset)."""
    from .bench.workloads import SFT_WORKLOADS, SMALL, workload_sizes

    workload = name[len(BENCH_PREFIX) :]
    ranges = {"s": (SMALL.min_seq_len, SMALL.max_seq_len)}
    if workload in SFT_WORKLOADS:
        ranges["b"] = (1, workload_sizes(workload, SMALL).batch)
    return ranges


def _precheck_bench_dims(name: str, dims: Mapping[str, int], flag: str) -> None:
    """Refuse dims outside a benchmark workload's range before spending time on its export."""
    if not name.startswith(BENCH_PREFIX) or name not in model_names():
        return
    ranges = _bench_ranges(name)
    for dim, value in dims.items():
        if dim not in ranges:
            raise CliError(f"{flag}: unknown dim {dim!r}; {name} has {', '.join(sorted(ranges))}")
        low, high = ranges[dim]
        if not low <= value <= high:
            raise CliError(f"{flag}: {dim} = {value} is outside {name}'s range [{low}, {high}]")


def _bench_model(name: str) -> Model:
    from .bench.workloads import build_workload
    from .frontend.imported import set_dim_bounds

    workload_name = name[len(BENCH_PREFIX) :]
    _progress(f"building the {workload_name} workload (small sizes; PyTorch export for HF models)")
    try:
        workload = build_workload(workload_name)
    except ImportError as err:
        raise CliError(f"{name} needs PyTorch and transformers: {first_line(err)}") from None
    # Without upper bounds stock TVM plans buffers at their actual sizes; the batch keeps its
    # bound, the batch size the workload was exported for (an empty mapping drops them all).
    batch = workload.graph.dims.get("b")
    kept = {"b": batch.upper} if batch is not None and batch.upper is not None else {}
    graph = dataclasses.replace(workload.graph, mod=set_dim_bounds(workload.graph.mod, upper=kept))
    ranges = ", ".join(
        f"{d.lower} <= {n} <= {d.upper if d.upper is not None else 'inf'}"
        for n, d in graph.dims.items()
    )
    return _graph_model(name, graph, f"benchmark workload {workload_name} ({graph.kind}; {ranges})")


def model_names() -> list[str]:
    """Every model name ``demo --model`` and ``report`` accept."""
    return [
        DEFAULT_DEMO_MODEL,
        *BUILTIN_MODEL_NAMES,
        *(f"{BENCH_PREFIX}{name}" for name in WORKLOAD_NAMES),
    ]


def load_model(name: str) -> Model:
    """A model by name: the demo's MLP, a built-in model, or ``bench:<workload>``.

    Raises
    ------
    CliError
        When no model has that name.
    """
    if name not in model_names():
        raise CliError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")
    _load_package()
    if name == DEFAULT_DEMO_MODEL:
        return _deep_mlp_train()
    if name in BUILTIN_MODEL_NAMES:
        return _builtin_model(name)
    return _bench_model(name)


def _load_script(path: str) -> Model:
    _load_package()
    import tvm
    import tvm.script
    from tvm import relax

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError:
        raise CliError(f"{path} is not a text file") from None
    except OSError as err:
        raise CliError(f"cannot read {path}: {err.strerror}") from None
    problem = None
    try:
        parsed = tvm.script.from_source(source)
    except Exception as err:  # the parser raises SyntaxError, DiagnosticError, TVMError, ...
        problem = first_line(err).removeprefix("error: ")
        if "No result exists in IRBuilder" in problem:
            problem = "it defines no IRModule or function (save one with mod.script())"
    if problem is not None:
        # Raised outside the handler so that the parser's frames are not kept alive as context.
        _collect_quietly()
        raise CliError(f"cannot parse {path} as TVMScript: {problem}")
    if isinstance(parsed, relax.Function):
        parsed = tvm.IRModule({"main": parsed})
    if not isinstance(parsed, tvm.IRModule):
        raise CliError(
            f"{path} holds a {type(parsed).__name__}, not an IRModule of Relax functions"
        )
    return Model(path, parsed, f"TVMScript module from {path}")


def _resolve_input(text: str) -> Model:
    if text in model_names():
        return load_model(text)
    if os.path.isdir(text):
        raise CliError(f"{text} is a directory, not a TVMScript file or model name")
    if os.path.exists(text):
        return _load_script(text)
    looks_like_path = os.sep in text or text.endswith((".py", ".tvmscript", ".txt", ".relax"))
    if looks_like_path:
        raise CliError(f"no such file: {text}")
    raise CliError(
        f"{text!r} is neither a file nor a model name; models: {', '.join(model_names())}"
    )


# ------------------------------------------------------------------------------ argument text
def _parse_sizes(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    try:
        sizes = [int(part) for part in parts if part]
    except ValueError:
        raise CliError(f"--sizes takes comma-separated integers, not {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise CliError(f"--sizes needs positive integers, got {text!r}")
    return sorted(set(sizes))


def _parse_dims(text: str | None) -> dict[str, int]:
    """``"s=64,b=2"`` → ``{"s": 64, "b": 2}``; the names are checked later against the function."""
    if not text:
        return {}
    dims: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (p.strip() for p in part.partition("="))
        if not sep or not name or not value or not name.isidentifier():
            raise CliError(f"--dims takes name=value pairs separated by commas, not {part!r}")
        try:
            number = int(value)
        except ValueError:
            raise CliError(
                f"--dims: the value of {name} must be an integer, not {value!r}"
            ) from None
        if number < 1:
            raise CliError(f"--dims: {name} = {number}, but a dim must be at least 1")
        if name in dims:
            raise CliError(f"--dims: {name} is given twice")
        dims[name] = number
    return dims


def _parse_fraction(value: float) -> float:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise CliError(f"--budget is a fraction of blade_relax's peak in (0, 1], not {value}")
    return value


def _write_text(path: str, text: str, flag: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise CliError(f"{flag}: cannot write {path}: {err.strerror}") from None


# ---------------------------------------------------------------------------------- the demo
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
    from .frontend import flatten_outputs
    from .runtime import current_live_bytes, measure_call
    from .runtime.remat import RematBudgetWarning

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
        "| match | vs stock | evictions | regenerations | outputs   |"
    )
    rule = (
        "|-------:|-------------------|----------------|---------------:|--------------:"
        "|:-----:|---------:|----------:|--------------:|-----------|"
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
            f"| {r.regenerations:>13} | {row.outputs:<9} |"
        )
    return "\n".join(lines)


def _budget_unreachable(result: RunResult) -> bool:
    """Whether no eviction set could meet the run's budget (it then ran at the lowest peak the
    runtime could reach): the remat runtime's decision says so, or, without one, the peak."""
    if result.budget_bytes is None:
        return False
    if result.reachable is not None:
        return not result.reachable
    return result.peak_bytes > result.budget_bytes


def _demo_plot(
    path: str,
    model: str,
    dim_label: str,
    rows: Sequence[DemoRow],
    budget_fraction: float,
) -> None:
    """Write :func:`_demo_figure` to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = _demo_figure(model, dim_label, rows, budget_fraction)
    try:
        save_png(fig, path, dpi=110)
    except OSError as err:
        raise CliError(f"--plot: cannot write {path}: {err.strerror}") from None
    finally:
        plt.close(fig)


def _demo_figure(
    model: str,
    dim_label: str,
    rows: Sequence[DemoRow],
    budget_fraction: float,
) -> Any:
    """Left: live bytes over one call at the largest size; right: peak vs size.

    Curves and legends are on one basis, the runtime accounting's: live bytes during each VM
    instruction with the kernels' scratch (workspaces) included, so a curve tops out at the
    peak its legend names. Budgets no eviction set can meet are drawn hollow and say so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    mib = float(2**20)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.5))
    at_size = max(r.size for r in rows)
    budget_row = None
    for row in (r for r in rows if r.size == at_size):
        live = row.result.live_trace or [0]
        n = max(len(live) - 1, 1)
        label = f"{row.pipeline} (peak {human_bytes(row.result.peak_bytes)})"
        left.plot([i / n for i in range(len(live))], [v / mib for v in live], label=label)
        if row.result.budget_bytes is not None:
            budget_row = row
    if budget_row is not None:
        unreachable = _budget_unreachable(budget_row.result)
        left.axhline(
            budget_row.result.budget_bytes / mib,
            color="tab:red",
            linestyle="--",
            label=f"budget {human_bytes(budget_row.result.budget_bytes)} ({budget_fraction:g} x "
            "blade_relax peak)"
            + ("; unreachable: no eviction set meets it" if unreachable else ""),
        )
    left.set_xlabel("position in the call (VM instructions, scaled to [0, 1])")
    left.set_ylabel("live bytes allocated by the VM (MiB)\nkernel scratch included")
    left.set_title(f"{model}: memory during one call at {dim_label}={at_size}")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    # Legends below the axes: inside they hide the tops of the curves they name.
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "fontsize": 8}
    left.legend(**below)

    for pipeline, style in (("stock TVM", "o-"), ("blade_relax", "s-")):
        points = [(r.size, r.result.peak_bytes) for r in rows if r.pipeline == pipeline]
        right.plot([p[0] for p in points], [p[1] / mib for p in points], style, label=pipeline)
    budget_rows = [r for r in rows if r.result.budget_bytes is not None]
    (line,) = right.plot(
        [r.size for r in budget_rows], [r.result.peak_bytes / mib for r in budget_rows], "-"
    )
    color = line.get_color()
    # Filled: the budget was met; hollow: no eviction set meets it, the run went as low as the
    # runtime could reach.
    for unreachable in (False, True):
        points = [r for r in budget_rows if _budget_unreachable(r.result) == unreachable]
        right.plot(
            [r.size for r in points],
            [r.result.peak_bytes / mib for r in points],
            "^",
            color=color,
            markerfacecolor="none" if unreachable else color,
            markersize=11 if unreachable else 8,
            zorder=3,  # above blade_relax's point, which an unreachable budget run sits on
        )
    right.plot(
        [r.size for r in budget_rows],
        [r.result.budget_bytes / mib for r in budget_rows],
        ":",
        color="tab:red",
        label=f"budget ({budget_fraction:g} x blade_relax peak)",
    )
    handles, labels = right.get_legend_handles_labels()
    for unreachable, text in (
        (False, "budget met"),
        (True, "budget unreachable, no eviction set meets it (ran at its lowest peak)"),
    ):
        if any(_budget_unreachable(r.result) == unreachable for r in budget_rows):
            handles.append(
                Line2D(
                    [],
                    [],
                    marker="^",
                    color=color,
                    linestyle="none",
                    markerfacecolor="none" if unreachable else color,
                    markersize=11 if unreachable else 8,
                )
            )
            labels.append(f"blade_relax under the budget: {text}")
    sizes = sorted({r.size for r in rows})
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 10:
        # Sizes and peaks span decades: log axes, labelled at the sizes that ran and at 1-2-5
        # steps in MiB (matplotlib's default labels only the powers of ten, often just two).
        right.set_xscale("log")
        right.set_yscale("log")
        right.xaxis.set_major_locator(NullLocator())
        right.set_xticks(sizes)
        right.xaxis.set_minor_formatter(NullFormatter())
        right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        right.yaxis.set_minor_formatter(NullFormatter())
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    right.set_xlabel(f"{dim_label}")
    right.set_ylabel("measured peak of one call (MiB)\nkernel scratch included")
    right.set_title("measured peak of one call vs size")
    right.grid(alpha=0.3, which="major")
    right.legend(handles, labels, **below)
    fig.tight_layout()
    return fig


def run_demo(args: argparse.Namespace) -> int:
    """Stock TVM vs blade_relax vs blade_relax under a budget; predicted vs measured peaks."""
    sizes = _parse_sizes(args.sizes)
    fraction = _parse_fraction(args.budget)
    plot_path = None if args.no_plot else check_output_path(args.plot, "--plot")
    if args.model.startswith(BENCH_PREFIX):
        for size in sizes:
            _precheck_bench_dims(args.model, {"s": size}, "--sizes")
    model = load_model(args.model)

    from .analysis import compile_keeping_module, memory_timeline
    from .pipeline import get_pipeline, lower_to_memory_stage, stock_pipeline
    from .symbolic import ShapeGraph
    from .transform import version_for

    func = model.mod["main"]
    dims = sorted(ShapeGraph.from_function(func).dims)
    if not dims:
        raise CliError(f"model {model.name} has no dynamic dims to vary")
    all_bindings = [{d: size for d in dims} for size in sizes]
    if model.check_dims is not None:
        for bindings in all_bindings:
            try:
                model.check_dims(bindings)
            except ValueError as err:
                raise CliError(f"--sizes: {first_line(err)}") from None

    # The symbolic timelines first: they say, before anything is compiled or allocated, what
    # each size needs. The stock run comes first and its lowering is the quicker, so sizes
    # that cannot fit are refused on its prediction alone, in seconds and in one line (no
    # progress line before it); blade_relax's prediction is checked as soon as it is known.
    stock_low = lower_to_memory_stage(model.mod)
    stock_tl = memory_timeline(stock_low["main"], mod=stock_low)
    _refuse_sizes_beyond_memory(all_bindings, lambda _b: {"stock TVM": stock_tl}, args.force)
    _progress(f"lowering {model.name} with the blade_relax passes for its symbolic timeline")
    blade_low = lower_to_memory_stage(model.mod, **_blade_flags())
    # `main` is a dispatcher: MemoryAwareSchedule may have made range copies, each scheduled
    # for its range of lengths, and Rematerialize a plain copy that runs without a budget next
    # to the rewritten one. The timeline to read is that of the copy that runs unbudgeted.
    blade_fns = {version_for(blade_low, "main", b) for b in all_bindings}
    blade_tls = {fn: memory_timeline(blade_low[fn], mod=blade_low) for fn in sorted(blade_fns)}
    _refuse_sizes_beyond_memory(
        all_bindings,
        lambda b: {
            "stock TVM": stock_tl,
            "blade_relax": blade_tls[version_for(blade_low, "main", b)],
        },
        args.force,
    )

    _progress(f"compiling {model.name} with the stock TVM pipeline (llvm)")
    stock_build = compile_keeping_module(model.mod, "llvm", stock_pipeline("llvm"))
    stock_exe, stock_ws = stock_build.executable, stock_build.workspaces
    _progress(f"compiling {model.name} with the blade_relax pipeline (llvm)")
    blade_build = compile_keeping_module(model.mod, "llvm", get_pipeline("llvm"))
    blade_exe, blade_ws = blade_build.executable, blade_build.workspaces

    dim_label = ",".join(dims)
    _warn_far_beyond(model, func, sizes, all_bindings, stock_tl, blade_tls, blade_low)
    print(f"model: {model.name}  ({model.description})")
    print(f"dynamic dims: {dim_label}  (every dim set to each size)")
    print(f"symbolic peak, stock TVM:   {stock_tl.peak}")
    for fn, timeline in blade_tls.items():
        where = "" if fn == "main" else f" ({function_label(blade_low, fn)})"
        print(f"symbolic peak, blade_relax{where}: {timeline.peak}")
    print(
        f"budget: {fraction:g} x blade_relax's measured peak at each size; predictions under "
        "the budget come from the remat runtime's decision"
    )
    print()

    rows: list[DemoRow] = []
    for size, bindings in zip(sizes, all_bindings):
        started = time.perf_counter()
        at = f"{dim_label}={size}"
        arrays = model.make_args(bindings) if model.make_args else []
        stock_predicted = stock_tl.evaluate(bindings).peak
        _progress(f"{at} [1/3]: stock TVM (predicted peak {human_bytes(stock_predicted)})")
        stock = _run_once(stock_exe, arrays, bindings, workspaces=stock_ws)
        stock.predicted_bytes = stock_predicted
        blade_tl = blade_tls[version_for(blade_low, "main", bindings)]
        blade_predicted = blade_tl.evaluate(bindings).peak
        _progress(f"{at} [2/3]: blade_relax (predicted peak {human_bytes(blade_predicted)})")
        blade = _run_once(blade_exe, arrays, bindings, workspaces=blade_ws)
        blade.predicted_bytes = blade_predicted
        budget = max(1, int(fraction * blade.peak_bytes))
        _progress(f"{at} [3/3]: blade_relax under a budget of {human_bytes(budget)}")
        budgeted = _run_once(blade_exe, arrays, bindings, budget=budget, workspaces=blade_ws)
        _progress(f"{at}: done in {time.perf_counter() - started:.1f} s")
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

    print(_demo_table(rows, dim_label))
    print()
    status = _demo_summary(rows, dim_label, fraction)
    if plot_path is not None:
        _demo_plot(plot_path, model.name, dim_label, rows, fraction)
        print(f"plot: {plot_path}")
    return status


def _blade_flags() -> dict[str, bool]:
    """The passes :func:`blade_relax.get_pipeline` runs by default, as flags.

    :func:`blade_relax.pipeline.lower_to_memory_stage` turns every pass off unless asked; the
    IR it returns is the one the compiled executable runs only when it is asked for the same
    passes as ``get_pipeline("llvm")`` runs. ``check_dims`` is left off: its range check
    allocates nothing, and its lowered condition would show up as a dim of its own.
    """
    import inspect

    from .pipeline import get_pipeline

    return {
        name: param.default
        for name, param in inspect.signature(get_pipeline).parameters.items()
        if isinstance(param.default, bool) and name != "check_dims"
    }


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
    func: Any,
    sizes: Sequence[int],
    all_bindings: Sequence[Mapping[str, int]],
    stock_tl: Any,
    blade_tls: Mapping[str, Any],
    blade_low: Any,
) -> None:
    """Warn before running sizes far beyond those the model was tried at, with their bytes.

    A model that declares an upper bound has its sizes checked against it already; one that
    declares none (the built-ins) was tried up to :data:`TRIED_SIZE`. The symbolic timelines
    say, without running anything, how many bytes a call at the asked size allocates.
    """
    from .symbolic import ShapeGraph
    from .transform import version_for

    graph = ShapeGraph.from_function(func)
    if any(d.upper is not None for d in graph.dims.values()):
        return
    free = available_memory()
    for size, bindings in zip(sizes, all_bindings):
        if size <= FAR_BEYOND * TRIED_SIZE:
            continue
        stock = stock_tl.evaluate(bindings)
        blade = blade_tls[version_for(blade_low, "main", bindings)].evaluate(bindings)
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
        _warn(message)


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


# -------------------------------------------------------------------------------- the report
def function_label(mod: Any, name: str) -> str:
    """A user-facing name for a function, for copies the memory passes made of an entry.

    ``MemoryAwareSchedule`` may split ``main`` into range copies (``main__s110_inf``), and
    ``Rematerialize`` keeps the function as it was (``main__plain``) next to its rewritten
    copy for calls under a budget (``main__remat``). Those names are internal; this says which
    entry function a copy stands for and when it runs: ``"main for s >= 110"``, ``"main"``
    (what runs without a budget), ``"main under a budget"``.
    """
    from .transform.dispatch import budget_copy_of, range_of

    ranges: list[str] = []
    budget = False
    current = name
    for _ in range(8):  # copies of copies: a budget copy of a range copy, at most
        if current not in {gv.name_hint for gv in mod.get_global_vars()}:
            break
        func = mod[current]
        if (copy := budget_copy_of(func)) is not None:
            current, budget = copy[0], budget or copy[1]
        elif (version := range_of(func)) is not None:
            current = version[0]
            ranges.append(str(version[1]))
        else:
            break
    label = current
    if ranges:
        label += " for " + " and ".join(ranges)
    if budget:
        label += " under a budget"
    return label


def _function(mod: Any, name: str, where: str) -> Any:
    from tvm import relax

    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    if name not in names:
        raise CliError(f"no function {name!r} in {where}; it has: {', '.join(names)}")
    func = mod[name]
    if not isinstance(func, relax.Function):
        relax_names = [n for n in names if isinstance(mod[n], relax.Function)]
        raise CliError(
            f"{name!r} in {where} is a {type(func).__name__}, not a Relax function; Relax "
            f"functions: {', '.join(relax_names) or 'none'}"
        )
    return func


def _bind_dims(
    given: Mapping[str, int], dim_ranges: Mapping[str, Any], model: Model, func_name: str
) -> dict[str, int]:
    unknown = sorted(set(given) - set(dim_ranges))
    if unknown:
        have = ", ".join(sorted(dim_ranges)) or "no symbolic dims"
        raise CliError(f"--dims: unknown dim {unknown[0]!r}; {func_name} has {have}")
    bindings: dict[str, int] = {}
    for name, dim in sorted(dim_ranges.items()):
        lower, upper = dim.lower, dim.upper
        if name in given:
            value = given[name]
            if value < lower or (upper is not None and value > upper):
                top = upper if upper is not None else "inf"
                raise CliError(f"--dims: {name} = {value} is outside its range [{lower}, {top}]")
        else:
            value = max(lower, DEFAULT_REPORT_DIM)
            value = min(value, upper) if upper is not None else value
        bindings[name] = value
    if model.check_dims is not None and func_name == "main" and bindings:
        try:
            model.check_dims(bindings)
        except ValueError as err:
            raise CliError(f"--dims: {first_line(err)}") from None
    return bindings


def _merged_chrome_trace(reports: Sequence[Any]) -> dict[str, Any]:
    """One trace with a process (pid) per report, so Perfetto shows them one above the other."""
    events: list[dict[str, Any]] = []
    other: dict[str, Any] = {}
    for pid, report in enumerate(reports, start=1):
        trace = report.to_chrome_trace()
        for event in trace["traceEvents"]:
            events.append({**event, "pid": pid})
        other[report.label] = trace.get("otherData", {})
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}


def run_report(args: argparse.Namespace) -> int:
    """Print (and write) the memory report of one function, before and after our passes."""
    given = _parse_dims(args.dims)
    json_path = check_output_path(args.json, "--json")
    trace_path = check_output_path(args.chrome_trace, "--chrome-trace")
    plot_path = check_output_path(args.plot, "--plot")
    if args.rows < 1:
        raise CliError(f"--rows must be at least 1, not {args.rows}")
    _precheck_bench_dims(args.input, given, "--dims")
    model = _resolve_input(args.input)
    func = _function(model.mod, args.function, model.name)

    from .analysis import MemoryReport, memory_timeline
    from .analysis.report import LowerBound
    from .pipeline import lower_to_memory_stage
    from .symbolic import ShapeGraph

    # Dims are checked on the function as given, before the (slower) lowering.
    bindings = _bind_dims(given, ShapeGraph.from_function(func).dims, model, args.function)
    # One lower bound for every version, read once from the function before the passes: what
    # each version's own timeline would give depends on its fusion and memory plan, and two
    # versions of one function would report two "lower bounds" (one above the other's peak).
    try:
        bound = LowerBound.of_function(
            func, bindings, mod=model.mod, source=f"{args.function} before the passes"
        )
    except Exception as err:  # the analysis raises TVM's and its own errors
        raise CliError(
            f"cannot build the memory timeline of {args.function}: {first_line(err)}"
        ) from None

    target = {"llvm": "llvm", "cuda": {"kind": "cuda", "arch": "sm_90"}}[args.target]
    stages: list[tuple[str, Any]] = []
    # What each of our passes changed (its ``last_result``), per pipeline.
    pass_results: dict[str, list[Any]] = {}
    if args.pipeline == "none":
        stages.append(("input", model.mod))
    else:
        from .transform import collect_results

        flags_of = {"stock TVM": {}, "blade_relax": _blade_flags()}
        wanted = ["stock TVM"] + (["blade_relax"] if args.pipeline == "blade" else [])
        for label in wanted:
            _progress(f"lowering {model.name} with the {label} pipeline ({args.target})")
            try:
                with collect_results() as pass_results[label]:
                    lowered = lower_to_memory_stage(model.mod, target, **flags_of[label])
            except Exception as err:  # TVM's passes raise their own error types
                raise CliError(
                    f"the {label} pipeline cannot lower {model.name}: {first_line(err)}"
                ) from None
            stages.append((label, lowered))

    from .transform import version_for

    timelines = []
    for label, mod in stages:
        # A dispatcher (range copies of MemoryAwareSchedule, the plain and rewritten copies of
        # Rematerialize) calls the copy for these dims, without a budget: its timeline is what
        # runs.
        name = version_for(mod, args.function, bindings)
        shown = function_label(mod, name)
        if shown != args.function:
            label = f"{label} ({shown})"
        lowered_func = _function(mod, name, f"{model.name} after the {label} pipeline")
        try:
            timelines.append((label, memory_timeline(lowered_func, mod=mod)))
        except Exception as err:
            raise CliError(
                f"cannot build the memory timeline of {args.function}: {first_line(err)}"
            ) from None

    for _, timeline in timelines:
        # Lowering may name dims of its own (shape computations); they take the default.
        extra = {n: d for n, d in timeline.graph.dims.items() if n not in bindings}
        bindings.update(_bind_dims({}, extra, model, args.function))
    reports = []
    for label, timeline in timelines:
        try:
            evaluated = timeline.evaluate(bindings)
        except ValueError as err:
            raise CliError(f"--dims: {first_line(err)}") from None
        reports.append(
            MemoryReport(label=label, timeline=timeline, evaluated=evaluated, bound=bound)
        )

    print(f"input: {model.name}  ({model.description})")
    print(
        f"function: {args.function}   dims: "
        + (", ".join(f"{k}={v}" for k, v in bindings.items()) or "none")
    )
    for report in reports:
        print()
        print(report.to_text(max_rows=args.rows))
    if len(reports) == 2:
        before, after = reports
        print()
        print(
            f"blade_relax vs stock TVM at {bindings}: peak {after.peak:,} B vs {before.peak:,} B "
            f"({after.peak / max(before.peak, 1):.3f} x)"
        )
    for label, results in pass_results.items():
        if results:
            print()
            print(f"passes of the {label} pipeline (what each changed; peaks at these dims):")
            for result in results:
                print(result.summary(bindings, max_functions=args.rows))

    if json_path is not None:
        payload = {
            "schema": "blade_relax.report/1",
            "input": model.name,
            "function": args.function,
            "target": args.target,
            "pipeline": args.pipeline,
            "dims": bindings,
            "reports": [json.loads(r.to_json()) for r in reports],
            "passes": {
                label: [r.to_dict(bindings) for r in results]
                for label, results in pass_results.items()
            },
        }
        _write_text(json_path, json.dumps(payload, indent=2) + "\n", "--json")
        print(f"json: {json_path}")
    if trace_path is not None:
        _write_text(trace_path, json.dumps(_merged_chrome_trace(reports)) + "\n", "--chrome-trace")
        print(f"chrome trace: {trace_path}")
    if plot_path is not None:
        main_report, *others = reports[::-1]
        try:
            main_report.plot(
                plot_path, *others, title=f"{model.name}: {args.function} at {bindings}"
            )
        except OSError as err:
            raise CliError(f"--plot: cannot write {plot_path}: {err.strerror}") from None
        print(f"plot: {plot_path}")
    return 0


# ------------------------------------------------------------------------------------- bench
def run_bench(argv: Sequence[str]) -> int:
    """Hand the arguments to the benchmark's own command line."""
    from .bench.cli import main as bench_main

    return int(bench_main(list(argv), prog="blade-relax bench") or 0)


# ------------------------------------------------------------------------------------ parser
def _models_help() -> str:
    return (
        f"{DEFAULT_DEMO_MODEL} (a 4-layer MLP training step), the built-ins "
        f"{', '.join(BUILTIN_MODEL_NAMES)}, and the benchmark workloads "
        f"{', '.join(BENCH_PREFIX + w for w in WORKLOAD_NAMES)} (need PyTorch; dims within "
        "the exported range)"
    )


def _add_force(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"run even when {what} exceeds the memory available now (refused by default "
        "with exit status 2, before anything is allocated)",
    )


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show TVM's native warnings and transformers' notes on stderr (hidden by "
        "default; also BLADE_RELAX_VERBOSE=1)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``blade-relax`` (``bench`` is handed to :func:`blade_relax.bench.main`)."""
    parser = OneLineParser(
        prog="blade-relax",
        description="Peak-memory optimizations on symbolic shapes for Apache TVM Relax.\n"
        "See the story on a small model (demo), read the memory report of a module (report),\n"
        "train a model with the optimizer in the compiled step against PyTorch (train),\n"
        "or measure configurations side by side (bench).",
        epilog="examples:\n"
        "  blade-relax demo --plot out/demo.png\n"
        "  blade-relax demo --model mlp-train --sizes 64,512 --budget 0.95 --no-plot\n"
        "  blade-relax report attention --dims s=256 --json out/report.json --plot out/r.png\n"
        "  blade-relax report my_module.py --function main --dims n=64 --pipeline stock\n"
        "  blade-relax train --model llama --steps 50 --budget 0.8 --plot out/train.png\n"
        "  blade-relax bench --workload mlp-train --configs tvm-dynamic,blade-relax\n"
        "exit status: 0 on success, 1 when a check fails (demo, train), 2 on bad input (one line\n"
        "on stderr). Progress lines go to stderr, results to stdout; missing directories of\n"
        "output paths are created. TVM's native warnings are hidden unless --verbose.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,report,train,bench}")

    demo = sub.add_parser(
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
        help=f"the model (default: {DEFAULT_DEMO_MODEL}); one of: {_models_help()}",
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
    _add_force(
        demo,
        "the predicted peak at a size (the symbolic timelines' call plus its inputs and "
        "parameters)",
    )
    _add_verbose(demo)

    report = sub.add_parser(
        "report",
        help="the memory report of a TVMScript module or a named model",
        description="Build the symbolic memory timeline of one Relax function, evaluate it at "
        "concrete dims and print a table of live bytes per binding, the peak and the lower "
        "bound. The function is first lowered to the memory stage (the IR the VM runs, with its "
        "allocations and frees) by TVM's stock pipeline and, with --pipeline blade, by "
        "blade_relax's as well, so the report shows memory before and after our passes.",
    )
    report.add_argument(
        "input",
        metavar="INPUT",
        help="a file holding an IRModule as TVMScript (what mod.script() prints), or a model "
        f"name: {_models_help()}",
    )
    report.add_argument(
        "--function",
        default="main",
        metavar="NAME",
        help="the Relax function to report on (default: main)",
    )
    report.add_argument(
        "--dims",
        default=None,
        metavar="NAME=N,...",
        help="concrete values of the symbolic dims, e.g. s=64,b=2; dims left out take "
        f"{DEFAULT_REPORT_DIM} (clipped to their declared range)",
    )
    report.add_argument(
        "--pipeline",
        choices=("blade", "stock", "none"),
        default="blade",
        help="blade: report after TVM's stock pipeline and after blade_relax's (default); "
        "stock: after the stock pipeline only; none: the function as given, unlowered",
    )
    report.add_argument(
        "--target",
        choices=("llvm", "cuda"),
        default="llvm",
        help="target the pipelines lower for (default: llvm; cuda needs no GPU: sm_90)",
    )
    report.add_argument(
        "--rows",
        type=int,
        default=30,
        metavar="N",
        help="bindings shown in each table, those with the most live bytes (default: 30)",
    )
    report.add_argument("--json", metavar="PATH", help="write the reports as JSON here")
    report.add_argument(
        "--chrome-trace",
        metavar="PATH",
        help="write a Chrome trace-event JSON here (open in https://ui.perfetto.dev)",
    )
    report.add_argument(
        "--plot", metavar="PATH", help="write a PNG of live bytes over the program here"
    )
    _add_verbose(report)

    train = sub.add_parser(
        "train",
        help="train a model with the optimizer in the compiled step, against PyTorch's loop",
        description="Train a bench model (random init) on synthetic token batches whose "
        "lengths follow the bench's long-tailed trace, once with blade_relax (forward, backward "
        "and the optimizer in one compiled step, updated in place, one compilation for every "
        "length) and once with PyTorch's zero_grad/backward/step loop on the same init and "
        "batches. Prints the peak bytes of the full step (parameters and optimizer state "
        "counted once) per length and the ratio to PyTorch's, and checks the losses agree.",
    )
    train.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    train.add_argument(
        "--size", choices=("small", "real"), default="small", help="model sizes (default: small)"
    )
    train.add_argument("--steps", type=int, default=50, metavar="N", help="steps (default: 50)")
    train.add_argument(
        "--sft",
        action="store_true",
        help="fine-tune as users do: each step a batch of (prompt, response) pairs padded to the "
        "longest, with an attention_mask and labels -100 on prompt and padding (llama)",
    )
    train.add_argument(
        "--lora",
        action="store_true",
        help="fine-tune LoRA adapters (PEFT, rank 16 on every projection) on the frozen model "
        "(implies --sft)",
    )
    train.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="B",
        help="sequences a step (default: 4 with --sft/--lora, else 1)",
    )
    train.add_argument(
        "--dtype",
        choices=("float32", "fp32", "bf16", "bf16-pure"),
        default="float32",
        help="bf16: mixed precision as Hugging Face's Trainer(bf16=True) runs it (float32 "
        "weights, gradients and AdamW state, the forward under torch.autocast(bfloat16)); "
        "bf16-pure: the model, its gradients and AdamW state in bfloat16 (default: float32)",
    )
    train.add_argument(
        "--padding",
        choices=("right", "left"),
        default="right",
        help="where --sft batches are padded (default: right)",
    )
    train.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="FRACTION",
        help="run blade_relax's steps under a memory budget: this fraction in (0, 1] of each "
        "step's own peak without evictions (default: no budget)",
    )
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="seed of init, trace and tokens")
    train.add_argument(
        "--torch-compile", action="store_true", help="also run PyTorch's loop with torch.compile"
    )
    train.add_argument(
        "--torch-ckpt",
        action="store_true",
        help="also run PyTorch's loop with Hugging Face gradient checkpointing "
        "(and compiled, with --torch-compile)",
    )
    train.add_argument(
        "--plot",
        default=DEFAULT_TRAIN_PLOT,
        metavar="PATH",
        help=f"PNG of loss and peak per step (default: {DEFAULT_TRAIN_PLOT}; missing folders "
        "are created)",
    )
    train.add_argument("--no-plot", action="store_true", help="do not write the plot")
    train.add_argument("--json", metavar="PATH", help="write the runs as JSON here")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_force(
        train,
        "what the step at --size and --batch holds at least (parameters, optimizer state, "
        "token ids, logits of the longest batch)",
    )
    _add_verbose(train)

    sub.add_parser(
        "bench",
        help="the benchmark ruler; same flags as python -m blade_relax.bench "
        "(blade-relax bench --help lists them)",
        add_help=False,
    )
    return parser


# ------------------------------------------------------------------------------------- train
#: Largest relative difference of a loss to PyTorch's that ``train`` accepts, by dtype. In
#: bfloat16 (8 bits of mantissa) every rounding of a sum's partial results can differ by
#: 2^-8 = 3.9e-3; both sides round at other places, and the difference grows over the steps.
TRAIN_LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-3}
#: ``--dtype`` -> (ModelSizes.dtype, ModelSizes.autocast).
_DTYPES = {
    "float32": ("float32", None),
    "fp32": ("float32", None),
    "bf16": ("float32", "bfloat16"),
    "bf16-pure": ("bfloat16", None),
}


def run_train(args: argparse.Namespace) -> int:
    """``blade-relax train``: blade_relax's training loop against PyTorch's."""
    if args.steps < 1:
        raise CliError(f"--steps must be positive, not {args.steps}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise CliError(f"--lr must be a positive number, not {args.lr}")
    budget = _parse_fraction(args.budget) if args.budget is not None else None
    if args.batch is not None and args.batch < 1:
        raise CliError(f"--batch must be positive, not {args.batch}")
    sft = args.sft or args.lora
    if sft and args.model != "llama":
        raise CliError(f"--sft and --lora fine-tune --model llama, not {args.model}")
    dtype, autocast = _DTYPES[args.dtype]
    plot = None if args.no_plot else check_output_path(args.plot, "--plot")
    json_path = check_output_path(args.json, "--json")
    _load_package()
    from .bench.training import (
        SFT_MODELS,
        TRAIN_MODELS,
        compare_training,
        plot_training,
        summary_lines,
    )
    from .bench.workloads import PRESETS
    from .training import SGD, AdamW

    sizes = dataclasses.replace(PRESETS[args.size], dtype=dtype, autocast=autocast)
    if args.batch is not None:
        sizes = dataclasses.replace(sizes, batch=args.batch)
    workload = SFT_MODELS[args.model][int(args.lora)] if sft else TRAIN_MODELS[args.model]
    _refuse_training_beyond_memory(args, workload, sizes)
    optimizer = AdamW(lr=args.lr) if args.optimizer == "adamw" else SGD(args.lr, momentum=0.9)
    result = compare_training(
        args.model,
        size=sizes,
        steps=args.steps,
        optimizer=optimizer,
        budget=budget,
        seed=args.seed,
        torch_compile=args.torch_compile,
        torch_checkpointing=args.torch_ckpt,
        sft=sft,
        lora=args.lora,
        padding_side=args.padding,
        progress=not args.no_progress,
        log=_progress,
    )
    ours = result.ours
    print(
        f"model: {result.settings['workload']} ({args.size}), {args.steps} steps of "
        f"{result.settings['optimizer']} (lr {args.lr:g}), seed {args.seed}"
    )
    print(f"lengths: {result.trace}")
    trainable = result.settings["trainable_bytes"]
    print(
        f"parameters: {result.param_bytes:,} bytes"
        + (f" ({trainable:,} trained, the rest frozen)" if trainable != result.param_bytes else "")
        + f"; blade_relax holds parameters, optimizer state and scalars: "
        f"{ours.persistent_bytes:,} bytes"
    )
    if sft:
        print(f"batches: {result.settings['data']}")
    print(
        f"blade_relax: {ours.compilations} compilation ({ours.compile_time_s:.1f} s)"
        + (f", budget {budget:g} x each step's own peak" if budget is not None else "")
    )
    print(
        "peak bytes of the full step (parameters and optimizer state counted once), the "
        "highest at each length:"
    )
    for line in summary_lines(result):
        print("  " + line)
    first, last = ours.records[0], ours.records[-1]
    print(
        f"loss: step 1 {first.loss:.5f}, step {last.step} {last.loss:.5f}; largest relative "
        f"difference to torch-eager {result.max_loss_error:.2e} (loss), "
        f"{result.max_param_error:.2e} (parameters after the run)"
    )
    evictions = sum(r.evictions for r in ours.records)
    if budget is not None:
        held = sum(1 for r in ours.records if r.budget_reachable)
        print(
            f"budget held at {held} of {len(ours.records)} steps (elsewhere tensors no "
            f"eviction removes exceed it: those steps ran at their smallest reachable peak); "
            f"evictions over the run: {evictions}"
        )
    if json_path is not None:
        _write_text(json_path, json.dumps(result.as_dict(), indent=2) + "\n", "--json")
    if plot is not None:
        plot_training(result, plot)
        _progress(f"wrote {plot}")
    tolerance = TRAIN_LOSS_RTOL[autocast or dtype]
    if result.max_loss_error > tolerance:
        print(
            f"check failed: the losses differ from PyTorch's by {result.max_loss_error:.2e} "
            f"(> {tolerance:g})",
            file=sys.stderr,
        )
        return 1
    return 0


def _refuse_training_beyond_memory(args: argparse.Namespace, workload: str, sizes: Any) -> None:
    """Refuse (one line, exit 2) a ``train`` whose step cannot fit, before the model is built.

    The floor (:func:`blade_relax.bench.floor.memory_floor`) is counted from the sizes alone:
    building the model draws its weights, and at such sizes the run would die of numpy's
    ``MemoryError`` or the OOM killer long after the cause.
    """
    from .bench.floor import memory_floor

    # Per trainable parameter: AdamW keeps two moments, SGD (with momentum) one buffer.
    states = {"adamw": ("AdamW", 2), "sgd": ("SGD momentum", 1)}
    name, per_param = states[args.optimizer]
    floor = memory_floor(workload, sizes, optimizer=name, state_per_param=per_param)
    batch = f" --batch {args.batch}" if args.batch is not None else ""
    refuse_beyond_memory(
        f"--size {args.size}{batch}: blade_relax's {workload} step at s={floor.length}",
        floor.total,
        floor.describe(),
        available_memory(),
        force=args.force,
        before="building the model",
        floor=True,
    )


# --------------------------------------------------------------------------------------- main
def _collect_quietly() -> None:
    """Collect garbage with the native stderr silenced.

    When TVM's parser raises it can leave a half-built block builder behind, whose destructor
    warns on stderr whenever the garbage collector gets to it; collected here, after a failed
    parse, the warning does not add to the one-line error.
    """
    try:
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        gc.collect()
        return
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        gc.collect()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _load_package() -> None:
    """Import what ``import blade_relax`` imports outside the command lines (TVM included).

    The accounting, the runtime builtins and the registered pipeline are then in place before
    the command creates any VM, as in a program that imports the package.
    """
    from . import load

    load()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blade-relax`` console script.

    Parameters
    ----------
    argv
        The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 when a check fails (demo, train), 2 on bad input.
    """
    from .util.quiet import quiet_stderr

    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":
        return run_bench(args_list[1:])
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as done:  # --help
            return int(done.code or 0)
        handler = {"demo": run_demo, "report": run_report, "train": run_train}.get(args.command)
        if handler is None:
            raise CliError(f"unknown command {args.command!r}")
        with quiet_stderr(verbose=True if args.verbose else None):
            return handler(args)
    except CliError as err:
        print(f"blade-relax: error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

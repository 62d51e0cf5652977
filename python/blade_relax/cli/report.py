"""``blade-relax report``: the memory report of one function, before and after our passes.

The :class:`blade_relax.analysis.MemoryReport` of one function of a module saved as TVMScript
(``mod.script()``) or of a built-in model, lowered to the memory stage by TVM's stock pipeline
and by blade_relax's, as a text table, JSON, a Chrome trace and a plot.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..util.cliargs import CliError, check_output_path, first_line
from .common import add_verbose, progress, write_text
from .lowering import blade_flags, function_label
from .models import Model, models_help, precheck_bench_dims, resolve_input

__all__ = ["DEFAULT_REPORT_DIM", "add_report_arguments", "run_report"]

#: Report dims that the user leaves out are evaluated at this value (clipped to the dim's range).
DEFAULT_REPORT_DIM = 128


def add_report_arguments(subparsers: Any) -> None:
    """Add ``report`` and its flags to the subcommands of ``blade-relax``."""
    report = subparsers.add_parser(
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
        f"name: {models_help()}",
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
    add_verbose(report)


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
    precheck_bench_dims(args.input, given, "--dims")
    model = resolve_input(args.input)
    func = _function(model.mod, args.function, model.name)

    from ..symbolic import ShapeGraph

    # Dims are checked on the function as given, before the (slower) lowering.
    bindings = _bind_dims(given, ShapeGraph.from_function(func).dims, model, args.function)
    bound = _lower_bound(func, bindings, model, args.function)
    stages, pass_results = _lower(model, args.pipeline, args.target)
    timelines = _stage_timelines(stages, model, args.function, bindings)
    reports = _evaluate(timelines, bindings, bound, model, args.function)

    _print_reports(model, args.function, bindings, reports, pass_results, args.rows)
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
        write_text(json_path, json.dumps(payload, indent=2) + "\n", "--json")
        print(f"json: {json_path}")
    if trace_path is not None:
        write_text(trace_path, json.dumps(_merged_chrome_trace(reports)) + "\n", "--chrome-trace")
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


def _lower_bound(func: Any, bindings: Mapping[str, int], model: Model, name: str) -> Any:
    """The lower bound of every report, read once from the function before the passes.

    What each version's own timeline would give depends on its fusion and memory plan, and two
    versions of one function would report two "lower bounds" (one above the other's peak).
    """
    from ..analysis.report import LowerBound

    try:
        return LowerBound.of_function(
            func, bindings, mod=model.mod, source=f"{name} before the passes"
        )
    except Exception as err:  # the analysis raises TVM's and its own errors
        raise CliError(f"cannot build the memory timeline of {name}: {first_line(err)}") from None


def _lower(
    model: Model, pipeline: str, target_name: str
) -> tuple[list[tuple[str, Any]], dict[str, list[Any]]]:
    """The module at the memory stage per pipeline of ``--pipeline`` (the input itself for
    ``none``), and what each of our passes changed (its ``last_result``), per pipeline."""
    from ..pipeline import lower_to_memory_stage

    target = {"llvm": "llvm", "cuda": {"kind": "cuda", "arch": "sm_90"}}[target_name]
    stages: list[tuple[str, Any]] = []
    pass_results: dict[str, list[Any]] = {}
    if pipeline == "none":
        stages.append(("input", model.mod))
        return stages, pass_results
    from ..transform import collect_results

    flags_of = {"stock TVM": {}, "blade_relax": blade_flags()}
    wanted = ["stock TVM"] + (["blade_relax"] if pipeline == "blade" else [])
    for label in wanted:
        progress(f"lowering {model.name} with the {label} pipeline ({target_name})")
        try:
            with collect_results() as pass_results[label]:
                lowered = lower_to_memory_stage(model.mod, target, **flags_of[label])
        except Exception as err:  # TVM's passes raise their own error types
            raise CliError(
                f"the {label} pipeline cannot lower {model.name}: {first_line(err)}"
            ) from None
        stages.append((label, lowered))
    return stages, pass_results


def _stage_timelines(
    stages: Sequence[tuple[str, Any]], model: Model, name: str, bindings: Mapping[str, int]
) -> list[tuple[str, Any]]:
    """The memory timeline of function ``name`` at each stage, labelled with the copy read."""
    from ..analysis import memory_timeline
    from ..transform import version_for

    timelines = []
    for label, mod in stages:
        # A dispatcher (range copies of MemoryAwareSchedule, the plain and rewritten copies of
        # Rematerialize) calls the copy for these dims, without a budget: its timeline is what
        # runs.
        version = version_for(mod, name, bindings)
        shown = function_label(mod, version)
        if shown != name:
            label = f"{label} ({shown})"
        lowered_func = _function(mod, version, f"{model.name} after the {label} pipeline")
        try:
            timelines.append((label, memory_timeline(lowered_func, mod=mod)))
        except Exception as err:
            raise CliError(
                f"cannot build the memory timeline of {name}: {first_line(err)}"
            ) from None
    return timelines


def _evaluate(
    timelines: Sequence[tuple[str, Any]],
    bindings: dict[str, int],
    bound: Any,
    model: Model,
    name: str,
) -> list[Any]:
    """A :class:`~blade_relax.analysis.MemoryReport` per timeline at ``bindings``, which first
    take the default value of the dims that lowering named of its own (shape computations)."""
    from ..analysis import MemoryReport

    for _, timeline in timelines:
        extra = {n: d for n, d in timeline.graph.dims.items() if n not in bindings}
        bindings.update(_bind_dims({}, extra, model, name))
    reports = []
    for label, timeline in timelines:
        try:
            evaluated = timeline.evaluate(bindings)
        except ValueError as err:
            raise CliError(f"--dims: {first_line(err)}") from None
        reports.append(
            MemoryReport(label=label, timeline=timeline, evaluated=evaluated, bound=bound)
        )
    return reports


def _print_reports(
    model: Model,
    name: str,
    bindings: Mapping[str, int],
    reports: Sequence[Any],
    pass_results: Mapping[str, Sequence[Any]],
    rows: int,
) -> None:
    """The reports as tables, blade_relax's peak against stock TVM's, and what each pass
    changed."""
    print(f"input: {model.name}  ({model.description})")
    print(
        f"function: {name}   dims: "
        + (", ".join(f"{k}={v}" for k, v in bindings.items()) or "none")
    )
    for report in reports:
        print()
        print(report.to_text(max_rows=rows))
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
                print(result.summary(bindings, max_functions=rows))

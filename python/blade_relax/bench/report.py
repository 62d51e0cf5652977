"""Outputs of a benchmark run: the JSON document, the markdown table, the plot.

The JSON document (schema ``blade_relax.bench/1``; ``docs/bench-format.md`` documents every key)
holds the workload, the environment, where the figures come from (the command, the commit and
the date), the trace, one summary per configuration and one row per configuration and length.
:func:`read_json` reads a document back into a :class:`RecordedResult`, which every table and
plot function here accepts in place of a live :class:`~.runner.BenchResult`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.figures import save_png
from .runner import BenchResult, ConfigSummary, Measurement

__all__ = [
    "SCHEMA",
    "Acceptance",
    "BudgetPoint",
    "ConfigOverTrace",
    "RecordedResult",
    "RecordedWorkload",
    "acceptance",
    "acceptance_lines",
    "budget_points",
    "budget_table",
    "environment",
    "format_bytes",
    "markdown_table",
    "over_trace",
    "peak_grid",
    "provenance",
    "read_json",
    "result_to_json",
    "trace_summary_table",
    "write_budget_plot",
    "write_json",
    "write_plot",
]

SCHEMA = "blade_relax.bench/1"


def environment() -> dict[str, Any]:
    """The machine and library versions a run's figures come from."""
    import numpy
    import tvm

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "llvm_cpu": _llvm_cpu(),
        "tvm": tvm.__version__,
        "numpy": numpy.__version__,
    }
    gpu = tvm.cuda(0)
    if gpu.exist:
        env["gpu"] = gpu.device_name
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", None)
    return env


def _llvm_cpu() -> str | None:
    """The CPU LLVM names for this machine (what the ``"host"`` target compiles for)."""
    try:
        from tvm.target import codegen

        return str(codegen.llvm_get_system_cpu())
    except Exception:  # a TVM built without LLVM
        return None


def _git(*args: str) -> str | None:
    """``git args`` in the checkout this module was loaded from; ``None`` outside one."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def provenance(command: str | None) -> dict[str, Any]:
    """Where a run's figures come from: ``command``, ``commit``, ``dirty`` and ``date``.

    ``commit`` is the short hash of the checkout's ``HEAD`` (``None`` for an installed
    package); ``dirty`` says whether the tracked sources (``python/``) differed from it, in
    which case the figures belong to no commit.
    """
    commit = _git("rev-parse", "--short=7", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "python")
    return {
        "command": command,
        "commit": commit,
        "dirty": bool(status) if commit else None,
        "date": datetime.date.today().isoformat(),
    }


def result_to_json(result: BenchResult, *, command: str | None = None) -> dict[str, Any]:
    """The JSON document of ``result`` (plain dicts, lists, numbers and strings).

    ``command`` is the command line that produced ``result``, kept with the commit and the
    date (:func:`provenance`).
    """
    graph = result.workload.graph
    return {
        "schema": SCHEMA,
        "workload": {
            "name": result.workload.name,
            "kind": graph.kind,
            "sizes": dataclasses.asdict(result.workload.sizes),
            "dims": {n: [d.lower, d.upper] for n, d in graph.dims.items()},
            "num_params": len(graph.params),
            "param_bytes": graph.param_bytes,
            "outputs": list(graph.output_names),
        },
        "target": result.target,
        "environment": environment(),
        "provenance": provenance(command),
        "trace": {**result.trace, "measured_lengths": list(result.lengths)},
        "repeat": result.repeat,
        "tolerance": result.tolerance,
        "all_correct": result.all_correct,
        "configs": [dataclasses.asdict(c) for c in result.configs],
        # A measurement's null fields are left out (read back as null): most are null in most
        # rows, and the documents are committed (see compact_json).
        "results": [without_nulls(dataclasses.asdict(m)) for m in result.measurements],
    }


#: Significant digits of the floats a results document records (times, ratios, errors; a loss
#: keeps all of its digits, as the docs print it with five decimals).
SIGNIFICANT_DIGITS = 6


def without_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without the keys whose value is ``None``."""
    return {key: value for key, value in row.items() if value is not None}


def compact_json(document: Any) -> str:
    """``document`` as committed under ``docs/results``: no indentation, floats but losses to
    :data:`SIGNIFICANT_DIGITS` significant digits (the results are committed, and the tracked
    files travel to the GPU machine under a size limit)."""
    return json.dumps(_rounded(document), separators=(",", ":"), default=float) + "\n"


def _rounded(value: Any, key: str = "") -> Any:
    if isinstance(value, float) and key != "loss":
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, list | tuple):
        return [_rounded(v, key) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, k) for k, v in value.items()}
    return value


def write_json(result: BenchResult, path: str | os.PathLike, *, command: str | None = None) -> Path:
    """Write :func:`result_to_json` to ``path`` (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compact_json(result_to_json(result, command=command)))
    return out


@dataclass(frozen=True)
class RecordedWorkload:
    """The workload of a recorded run, as its JSON document describes it."""

    name: str
    kind: str
    sizes: dict[str, Any]
    dims: dict[str, list[int]]
    param_bytes: int


@dataclass
class RecordedResult(BenchResult):
    """A benchmark run read back from its JSON document (:func:`read_json`).

    A :class:`~.runner.BenchResult` whose workload is its description only (no graph, no
    weights), plus the run's ``environment`` and ``provenance``.
    """

    environment: dict[str, Any]
    provenance: dict[str, Any]


def read_json(path: str | os.PathLike) -> RecordedResult:
    """Read a document that :func:`write_json` wrote.

    Raises
    ------
    ValueError
        When the file is not a ``blade_relax.bench/1`` document.
    """
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    work = doc["workload"]
    return RecordedResult(
        workload=RecordedWorkload(
            name=work["name"],
            kind=work["kind"],
            sizes=work["sizes"],
            dims=work["dims"],
            param_bytes=work["param_bytes"],
        ),
        target=doc["target"],
        lengths=list(doc["trace"]["measured_lengths"]),
        trace={k: v for k, v in doc["trace"].items() if k != "measured_lengths"},
        repeat=doc["repeat"],
        tolerance=doc["tolerance"],
        configs=[ConfigSummary(**c) for c in doc["configs"]],
        measurements=[Measurement(**m) for m in doc["results"]],
        environment=doc.get("environment", {}),
        provenance=doc.get("provenance", {}),
    )


def format_bytes(nbytes: int | None) -> str:
    """``1.50 MiB``-style sizes; ``-`` for a missing value."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


def _ratio(row: Measurement) -> str:
    if row.peak_bytes is None or not row.lower_bound_bytes:
        return "-"
    return f"{row.peak_bytes / row.lower_bound_bytes:.2f}"


def _status(row: Measurement) -> str:
    if row.error is not None:
        return "error"
    if row.correct is None:
        return "-"
    return "yes" if row.correct else "NO"


def markdown_table(result: BenchResult) -> str:
    """One row per requested configuration and length, grouped by length."""
    requested = {c.name for c in result.configs if c.requested}
    order = [c.name for c in result.configs]
    rows = sorted(
        (m for m in result.measurements if m.config in requested),
        key=lambda m: (m.seq_len, order.index(m.config)),
    )
    header = (
        "| s | config | peak | peak / lower bound | step (ms) | compile (s) | compilations "
        "| loss | max rel err | matches torch |"
    )
    lines = [header, "|" + "---|" * 10]
    for m in rows:
        step = f"{m.step_time_s * 1e3:.1f}" if m.step_time_s is not None else "-"
        loss = f"{m.loss:.5f}" if m.loss is not None else "-"
        err = f"{m.max_rel_error:.1e}" if m.max_rel_error is not None else "-"
        lines.append(
            f"| {m.seq_len} | {m.config} | {format_bytes(m.peak_bytes)} | {_ratio(m)} | {step} "
            f"| {m.compile_time_s:.2f} | {m.compilations} | {loss} | {err} | {_status(m)} |"
        )
    errors = [m for m in rows if m.error]
    for m in errors:
        lines.append(f"\n- {m.config} at s={m.seq_len}: {m.error}")
    lower = {m.seq_len: m.lower_bound_bytes for m in rows}
    if any(v is not None for v in lower.values()):
        bounds = ", ".join(f"s={n}: {format_bytes(v)}" for n, v in sorted(lower.items()))
        lines.append(f"\nLower bound (parameters + inputs + largest single op): {bounds}")
    return "\n".join(lines)


def _finish(fig: Any, ax: Any, path: str | os.PathLike) -> Path:
    """Grid, legend, layout; write the figure to ``path`` as PNG and close it."""
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    ax.legend()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    save_png(fig, out, dpi=120)
    plt.close(fig)
    return out


def _unit(result: BenchResult) -> tuple[str, int]:
    """GiB when some peak reaches 4 GiB, MiB otherwise."""
    top = max((m.peak_bytes or 0 for m in result.measurements), default=0)
    return ("GiB", 2**30) if top >= 4 * 2**30 else ("MiB", 2**20)


def _sources(result: BenchResult) -> dict[str, str]:
    """Per configuration: ``measured``, ``predicted`` or ``not predicted`` (no figure)."""
    out: dict[str, str] = {}
    for m in result.measurements:
        if m.peak_bytes is not None:
            out[m.config] = m.source
        else:
            out.setdefault(m.config, "not predicted" if m.source == "predicted" else "error")
    return out


def write_plot(result: BenchResult, path: str | os.PathLike) -> Path:
    """Peak bytes vs sequence length, one line per requested configuration (PNG).

    Predicted configurations are drawn dashed and labelled ``(predicted)``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requested = [c.name for c in result.configs if c.requested]
    unit, scale = _unit(result)
    sources = _sources(result)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in requested:
        points = sorted(
            (m.seq_len, m.peak_bytes / scale)
            for m in result.measurements
            if m.config == name and m.peak_bytes is not None
        )
        if points:
            xs, ys = zip(*points)
            predicted = sources.get(name) == "predicted"
            label = f"{name} (predicted)" if predicted else name
            style = "--" if predicted else "-"
            ax.plot(xs, ys, style, marker="o", markersize=3, label=label)
    bounds = sorted(
        {(m.seq_len, m.lower_bound_bytes) for m in result.measurements if m.lower_bound_bytes}
    )
    if bounds:
        xs, ys = zip(*bounds)
        ax.plot(xs, [y / scale for y in ys], "k:", label="lower bound")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(f"{result.workload.name}: peak bytes per step ({result.target})")
    return _finish(fig, ax, path)


# --------------------------------------------------------------------------------------------
# Peak and step time against a memory budget


@dataclass(frozen=True)
class BudgetPoint:
    """One configuration of a budget sweep, summarized over the lengths of the trace.

    Attributes
    ----------
    config
        The configuration's name (``blade-relax@0.7``, ``torch-compile@0.4``).
    family
        ``"runtime budget"`` (a TVM config under ``set_memory_budget``) or
        ``"activation_memory_budget"`` (``torch.compile``).
    setting
        The budget fraction, or ``None`` for the family's unbudgeted configuration.
    peak_ratio
        Median over the lengths of ``peak_bytes`` over the reference's ``peak_bytes`` at the
        same length (the reference: the budgets' ``budget_of`` configuration).
    time_ratio
        Median over the lengths of the median step time over the unbudgeted configuration of
        the same family at the same length.
    budget_met
        Lengths whose step peak stayed within the budget, and the lengths measured (runtime
        budgets only).
    """

    config: str
    family: str
    setting: float | None
    peak_ratio: float
    time_ratio: float | None
    budget_met: tuple[int, int] | None


def budget_points(result: BenchResult) -> list[BudgetPoint]:
    """The budget sweep in ``result``: every runtime-budget configuration and its reference,
    and every ``torch.compile`` configuration without gradient checkpointing, as ratios (see
    :class:`BudgetPoint`).

    Returns an empty list when ``result`` holds no budgeted configuration.
    """
    references = {
        c.settings.get("budget_of")
        for c in result.configs
        if c.kind == "tvm" and c.settings.get("budget") is not None
    }
    references.discard(None)
    if not references:
        return []
    reference = sorted(references)[0]
    rows: dict[tuple[str, int], Measurement] = {
        (m.config, m.seq_len): m for m in result.measurements if m.error is None
    }
    lengths = sorted({m.seq_len for m in result.measurements})

    def ratios(name: str, base: str | None, attr: str) -> list[float]:
        out = []
        for n in lengths:
            row, ref = rows.get((name, n)), rows.get((base, n)) if base else None
            value = getattr(row, attr) if row else None
            ref_value = getattr(ref, attr) if ref else None
            if value is not None and ref_value:
                out.append(value / ref_value)
        return out

    torch_base = next(
        (
            c.name
            for c in result.configs
            if c.kind == "torch"
            and c.settings.get("compile")
            and not c.settings.get("checkpointing")
            and c.settings.get("activation_memory_budget") is None
        ),
        None,
    )
    points: list[BudgetPoint] = []
    for config in result.configs:
        settings = config.settings
        if config.kind == "tvm" and (
            config.name == reference or settings.get("budget_of") == reference
        ):
            family, setting, time_base = "runtime budget", settings.get("budget"), reference
        elif (
            config.kind == "torch"
            and settings.get("compile")
            and not settings.get("checkpointing")  # another curve: not plotted
        ):
            family = "activation_memory_budget"
            setting, time_base = settings.get("activation_memory_budget"), torch_base
        else:
            continue
        peaks = ratios(config.name, reference, "peak_bytes")
        if not peaks:
            continue
        times = ratios(config.name, time_base, "step_time_s")
        met = None
        if family == "runtime budget" and setting is not None:
            measured = [rows[(config.name, n)] for n in lengths if (config.name, n) in rows]
            held = sum(
                1
                for m in measured
                if m.budget_bytes is not None
                and m.step_peak_bytes is not None
                and m.step_peak_bytes <= m.budget_bytes
            )
            met = (held, len(measured))
        points.append(
            BudgetPoint(
                config=config.name,
                family=family,
                setting=setting,
                peak_ratio=statistics.median(peaks),
                time_ratio=statistics.median(times) if times else None,
                budget_met=met,
            )
        )
    return points


def budget_table(result: BenchResult) -> str:
    """Markdown: peak and step time against the budget, medians over the trace."""
    points = budget_points(result)
    if not points:
        return ""
    lines = [
        "| config | budget | peak / unbudgeted reference | step time / same system unbudgeted "
        "| budget held |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        setting = "-" if p.setting is None else f"{p.setting:g}"
        time_ratio = "-" if p.time_ratio is None else f"{p.time_ratio:.2f}"
        met = "-" if p.budget_met is None else f"{p.budget_met[0]}/{p.budget_met[1]}"
        lines.append(f"| {p.config} | {setting} | {p.peak_ratio:.2f} | {time_ratio} | {met} |")
    return "\n".join(lines)


def write_budget_plot(result: BenchResult, path: str | os.PathLike) -> Path:
    """Step-time ratio against peak ratio, one curve per budget family (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = budget_points(result)
    if not points:
        raise ValueError("the run holds no budgeted configuration to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, marker in (("runtime budget", "o"), ("activation_memory_budget", "s")):
        members = sorted(
            (p for p in points if p.family == family and p.time_ratio is not None),
            key=lambda p: -p.peak_ratio,
        )
        if not members:
            continue
        label = (
            "blade_relax runtime budget"
            if family == "runtime budget"
            else ("torch.compile activation_memory_budget")
        )
        ax.plot(
            [p.peak_ratio for p in members],
            [p.time_ratio for p in members],
            marker=marker,
            label=label,
        )
        for p in members:
            text = "none" if p.setting is None else f"{p.setting:g}"
            ax.annotate(
                text,
                (p.peak_ratio, p.time_ratio),
                fontsize=8,
                xytext=(3, 3),
                textcoords="offset points",
            )
    reference = next(p.config for p in points if p.family == "runtime budget")
    ax.set_xlabel(f"peak bytes / {reference} without a budget (median over the trace)")
    ax.set_ylabel("step time / same system without a budget")
    ax.set_title(f"{result.workload.name}: peak and step time against the budget")
    return _finish(fig, ax, path)


# --------------------------------------------------------------------------------------------
# Over the whole trace: peaks per length side by side, maximum and mean, compilations


def _trace_lengths(result: BenchResult) -> list[int]:
    """The trace's entries (repeats included), or the measured lengths without a trace."""
    lengths = result.trace.get("lengths") if result.trace else None
    return [int(n) for n in lengths] if lengths else list(result.lengths)


def _requested(result: BenchResult) -> list[str]:
    return [c.name for c in result.configs if c.requested]


def _peaks(result: BenchResult) -> dict[tuple[str, int], int]:
    return {
        (m.config, m.seq_len): m.peak_bytes
        for m in result.measurements
        if m.peak_bytes is not None and m.error is None
    }


def peak_grid(result: BenchResult) -> str:
    """Markdown: one row per length, the lower bound and each requested configuration's peak.

    Sizes in GiB when some peak reaches 4 GiB (MiB otherwise); ``-`` where a configuration has
    no figure.
    """
    unit, scale = _unit(result)
    names = _requested(result)
    peaks = _peaks(result)
    lower = {m.seq_len: m.lower_bound_bytes for m in result.measurements}
    lines = [
        f"| s | lower bound | {' | '.join(names)} |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for n in result.lengths:
        cells = [f"{lower[n] / scale:.2f}" if lower.get(n) else "-"]
        for name in names:
            value = peaks.get((name, n))
            cells.append("-" if value is None else f"{value / scale:.2f}")
        lines.append(f"| {n} | {' | '.join(cells)} |")
    lines.append(f"\nPeaks in {unit}.")
    return "\n".join(lines)


@dataclass(frozen=True)
class ConfigOverTrace:
    """One configuration over the trace's entries (repeated lengths count once per entry).

    Attributes
    ----------
    config, source
        The name, and ``measured`` / ``predicted`` / ``not predicted`` / ``error``.
    max_peak, mean_peak
        Largest and mean ``peak_bytes`` over the trace's entries (``None`` without figures).
    compilations, compile_time_s
        Compilations over the trace and their total time (for predicted TVM rows: lowerings
        to the memory stage).
    """

    config: str
    source: str
    max_peak: int | None
    mean_peak: float | None
    compilations: int
    compile_time_s: float


def over_trace(result: BenchResult) -> list[ConfigOverTrace]:
    """:class:`ConfigOverTrace` of every requested configuration, in run order."""
    trace = _trace_lengths(result)
    peaks = _peaks(result)
    sources = _sources(result)
    out = []
    for config in result.configs:
        if not config.requested:
            continue
        values = [peaks.get((config.name, n)) for n in trace]
        known = [v for v in values if v is not None]
        complete = bool(known) and len(known) == len(values)
        out.append(
            ConfigOverTrace(
                config=config.name,
                source=sources.get(config.name, "error"),
                max_peak=max(known) if complete else None,
                mean_peak=statistics.fmean(known) if complete else None,
                compilations=config.compilations,
                compile_time_s=config.compile_time_s,
            )
        )
    return out


def trace_summary_table(result: BenchResult) -> str:
    """Markdown: per configuration, the trace's maximum and mean peak, compilations, time."""
    unit, scale = _unit(result)
    predicted = any(m.source == "predicted" for m in result.measurements)
    time_label = "lowering (s)" if predicted else "compile (s)"
    lines = [
        f"| config | max peak ({unit}) | mean peak ({unit}) | compilations | {time_label} "
        "| figures |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in over_trace(result):
        top = "-" if row.max_peak is None else f"{row.max_peak / scale:.2f}"
        mean = "-" if row.mean_peak is None else f"{row.mean_peak / scale:.2f}"
        lines.append(
            f"| {row.config} | {top} | {mean} | {row.compilations} "
            f"| {row.compile_time_s:.1f} | {row.source} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Acceptance:
    """How ``ours`` compares with the static oracle and the bucketed configurations.

    Attributes
    ----------
    ours, static
        The configurations compared.
    at_or_below_static
        Trace entries where ``ours``'s peak is at most ``static``'s, and the entries that have
        both figures.
    above_buckets
        Per bucketed configuration of the run, the lengths where ``ours`` is above it.
    """

    ours: str
    static: str
    at_or_below_static: tuple[int, int]
    above_buckets: dict[str, list[int]]

    @property
    def static_share(self) -> float:
        met, total = self.at_or_below_static
        return met / total if total else 0.0


def acceptance(
    result: BenchResult,
    ours: str = "blade-relax",
    static: str = "tvm-static",
    bucket_prefix: str = "tvm-bucketed@",
) -> Acceptance | None:
    """Compare ``ours`` with ``static`` over the trace's entries and with every bucketed
    configuration at every length; ``None`` when the run lacks ``ours``."""
    peaks = _peaks(result)
    names = _requested(result)
    if ours not in names:
        return None
    pairs = [
        (peaks[(ours, n)], peaks[(static, n)])
        for n in _trace_lengths(result)
        if (ours, n) in peaks and (static, n) in peaks
    ]
    above = {
        name: [
            n
            for n in result.lengths
            if (ours, n) in peaks and (name, n) in peaks and peaks[(ours, n)] > peaks[(name, n)]
        ]
        for name in names
        if name.startswith(bucket_prefix)
    }
    return Acceptance(
        ours=ours,
        static=static,
        at_or_below_static=(sum(a <= b for a, b in pairs), len(pairs)),
        above_buckets=above,
    )


def acceptance_lines(result: BenchResult) -> list[str]:
    """The acceptance check in words (empty when the run lacks ``blade-relax``)."""
    check = acceptance(result)
    if check is None:
        return []
    met, total = check.at_or_below_static
    lines = []
    if total:
        verdict = "met" if check.static_share >= 0.95 else "NOT met"
        lines.append(
            f"- {check.ours} <= {check.static} at {met}/{total} trace entries "
            f"({100 * check.static_share:.0f} %; target >= 95 %: {verdict})"
        )
    for name, lengths in check.above_buckets.items():
        if lengths:
            lines.append(f"- {check.ours} > {name} at s = {', '.join(map(str, lengths))}")
        else:
            lines.append(f"- {check.ours} <= {name} at every length")
    return lines

"""Outputs of a benchmark run: the JSON document, the markdown table, the plot.

The JSON document (schema ``blade_relax.bench/1``; the README's "Benchmarks" section documents
every key) holds the workload, the environment, the trace, one summary per configuration and one
row per configuration and length.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from .runner import BenchResult, Measurement

__all__ = ["SCHEMA", "format_bytes", "markdown_table", "result_to_json", "write_json", "write_plot"]

SCHEMA = "blade_relax.bench/1"


def _environment() -> dict[str, Any]:
    import numpy
    import tvm

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
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


def result_to_json(result: BenchResult) -> dict[str, Any]:
    """The JSON document of ``result`` (plain dicts, lists, numbers and strings)."""
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
        "environment": _environment(),
        "trace": {**result.trace, "measured_lengths": list(result.lengths)},
        "repeat": result.repeat,
        "tolerance": result.tolerance,
        "all_correct": result.all_correct,
        "configs": [dataclasses.asdict(c) for c in result.configs],
        "results": [dataclasses.asdict(m) for m in result.measurements],
    }


def write_json(result: BenchResult, path: str | os.PathLike) -> Path:
    """Write :func:`result_to_json` to ``path`` (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result_to_json(result), indent=2) + "\n")
    return out


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


def write_plot(result: BenchResult, path: str | os.PathLike) -> Path:
    """Peak bytes vs sequence length, one line per requested configuration (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requested = [c.name for c in result.configs if c.requested]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in requested:
        points = sorted(
            (m.seq_len, m.peak_bytes / 2**20)
            for m in result.measurements
            if m.config == name and m.peak_bytes is not None
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    bounds = sorted(
        {(m.seq_len, m.lower_bound_bytes) for m in result.measurements if m.lower_bound_bytes}
    )
    if bounds:
        xs, ys = zip(*bounds)
        ax.plot(xs, [y / 2**20 for y in ys], "k--", label="lower bound")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"{result.workload.name}: peak bytes per step ({result.target})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

"""The demo's plot: live bytes over one call at the largest size, and the peak against size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..util.cliargs import CliError, human_bytes
from ..util.figures import save_png

if TYPE_CHECKING:
    from .demo import DemoRow, RunResult

__all__ = ["demo_figure", "write_demo_plot"]

_MIB = float(2**20)


def _budget_unreachable(result: RunResult) -> bool:
    """Whether no eviction set could meet the run's budget (it then ran at the lowest peak the
    runtime could reach): the remat runtime's decision says so, or, without one, the peak."""
    if result.budget_bytes is None:
        return False
    if result.reachable is not None:
        return not result.reachable
    return result.peak_bytes > result.budget_bytes


def write_demo_plot(
    path: str,
    model: str,
    dim_label: str,
    rows: Sequence[DemoRow],
    budget_fraction: float,
) -> None:
    """Write :func:`demo_figure` to ``path`` as a PNG.

    Raises
    ------
    CliError
        When ``path`` cannot be written.
    """
    import matplotlib.pyplot as plt

    fig = demo_figure(model, dim_label, rows, budget_fraction)
    try:
        save_png(fig, path, dpi=110)
    except OSError as err:
        raise CliError(f"--plot: cannot write {path}: {err.strerror}") from None
    finally:
        plt.close(fig)


def demo_figure(
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

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.5))
    # Legends below the axes: inside they hide the tops of the curves they name.
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "fontsize": 8}
    _draw_call(left, model, dim_label, rows, budget_fraction, below)
    _draw_peaks(right, dim_label, rows, budget_fraction, below)
    fig.tight_layout()
    return fig


def _draw_call(
    ax: Any,
    model: str,
    dim_label: str,
    rows: Sequence[DemoRow],
    budget_fraction: float,
    legend: dict[str, Any],
) -> None:
    """Live bytes over one call of each pipeline at the largest size, and the budget."""
    at_size = max(r.size for r in rows)
    budget_row = None
    for row in (r for r in rows if r.size == at_size):
        live = row.result.live_trace or [0]
        n = max(len(live) - 1, 1)
        label = f"{row.pipeline} (peak {human_bytes(row.result.peak_bytes)})"
        ax.plot([i / n for i in range(len(live))], [v / _MIB for v in live], label=label)
        if row.result.budget_bytes is not None:
            budget_row = row
    if budget_row is not None:
        unreachable = _budget_unreachable(budget_row.result)
        ax.axhline(
            budget_row.result.budget_bytes / _MIB,
            color="tab:red",
            linestyle="--",
            label=f"budget {human_bytes(budget_row.result.budget_bytes)} ({budget_fraction:g} x "
            "blade_relax peak)"
            + ("; unreachable: no eviction set meets it" if unreachable else ""),
        )
    ax.set_xlabel("position in the call (VM instructions, scaled to [0, 1])")
    ax.set_ylabel("live bytes allocated by the VM (MiB)\nkernel scratch included")
    ax.set_title(f"{model}: memory during one call at {dim_label}={at_size}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(**legend)


def _draw_peaks(
    ax: Any,
    dim_label: str,
    rows: Sequence[DemoRow],
    budget_fraction: float,
    legend: dict[str, Any],
) -> None:
    """The measured peak of one call against size, per pipeline and under the budget."""
    from matplotlib.ticker import FuncFormatter

    for pipeline, style in (("stock TVM", "o-"), ("blade_relax", "s-")):
        points = [(r.size, r.result.peak_bytes) for r in rows if r.pipeline == pipeline]
        ax.plot([p[0] for p in points], [p[1] / _MIB for p in points], style, label=pipeline)
    budget_rows = [r for r in rows if r.result.budget_bytes is not None]
    color = _draw_budget_runs(ax, budget_rows, budget_fraction)
    handles, labels = ax.get_legend_handles_labels()
    _add_budget_markers(handles, labels, budget_rows, color)
    sizes = sorted({r.size for r in rows})
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 10:
        _log_axes(ax, sizes)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel(f"{dim_label}")
    ax.set_ylabel("measured peak of one call (MiB)\nkernel scratch included")
    ax.set_title("measured peak of one call vs size")
    ax.grid(alpha=0.3, which="major")
    ax.legend(handles, labels, **legend)


def _draw_budget_runs(ax: Any, budget_rows: Sequence[DemoRow], budget_fraction: float) -> Any:
    """The peaks under the budget (a line, markers filled where the budget was met) and the
    budget itself; returns the colour of the budget runs' line."""
    (line,) = ax.plot(
        [r.size for r in budget_rows], [r.result.peak_bytes / _MIB for r in budget_rows], "-"
    )
    color = line.get_color()
    # Filled: the budget was met; hollow: no eviction set meets it, the run went as low as the
    # runtime could reach.
    for unreachable in (False, True):
        points = [r for r in budget_rows if _budget_unreachable(r.result) == unreachable]
        ax.plot(
            [r.size for r in points],
            [r.result.peak_bytes / _MIB for r in points],
            "^",
            color=color,
            markerfacecolor="none" if unreachable else color,
            markersize=11 if unreachable else 8,
            zorder=3,  # above blade_relax's point, which an unreachable budget run sits on
        )
    ax.plot(
        [r.size for r in budget_rows],
        [r.result.budget_bytes / _MIB for r in budget_rows],
        ":",
        color="tab:red",
        label=f"budget ({budget_fraction:g} x blade_relax peak)",
    )
    return color


def _add_budget_markers(
    handles: list[Any], labels: list[str], budget_rows: Sequence[DemoRow], color: Any
) -> None:
    """Legend entries for the filled (budget met) and hollow (unreachable) markers drawn."""
    from matplotlib.lines import Line2D

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


def _log_axes(ax: Any, sizes: Sequence[int]) -> None:
    """Sizes and peaks span decades: log axes, labelled at the sizes that ran and at 1-2-5
    steps in MiB (matplotlib's default labels only the powers of ten, often just two)."""
    from matplotlib.ticker import LogLocator, NullFormatter, NullLocator

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(NullLocator())
    ax.set_xticks(sizes)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_formatter(NullFormatter())

"""Memory reports: a timeline evaluated at concrete dims, in forms people and tools can read.

A :class:`MemoryReport` holds per-binding live bytes (symbolic and evaluated), the peak, the
lower bound and, when the program was run, the runtime's measured counters (evictions,
regenerations).

The lower bound (:class:`LowerBound`) is one figure per function, whichever version a report
shows: the bytes every version must hold at once, read from the function before the passes.
Those are its parameters and inputs (persistent) and its outputs (gradients, for a training
step), which are all live when it returns. Working sets of single operators are not counted:
they depend on the version (the stock pipeline fuses elementwise chains, ``FuseAttention`` keeps
attention scores out of memory), so the working sets of one version are no bound on another's
peak: the built-in attention block's largest operator of the function as given holds 2 MiB at
``s=256``, and blade_relax's version of it peaks at 257 KiB. It renders as a text table, JSON, a Chrome trace (loads in Perfetto or
``chrome://tracing``: one counter track of live bytes and one slice per binding) and a
matplotlib plot, optionally against a second report ("before" our passes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tvm import relax

from .timeline import EvaluatedTimeline, MemoryTimeline, memory_timeline

__all__ = ["LowerBound", "MemoryReport"]


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


@dataclass(frozen=True)
class LowerBound:
    """The bytes every version of a function holds at least, at concrete dims.

    Attributes
    ----------
    nbytes
        ``persistent + outputs``: no version (schedule, fusion, rematerialization) of the
        function goes below it.
    persistent
        Parameters and inputs, owned by the caller.
    outputs
        What the function returns and allocates (views of parameters cost nothing), all live
        when it returns.
    symbolic
        ``nbytes`` over the function's dims.
    source
        Which function it was read from (``"main before the passes"``).
    """

    nbytes: int
    persistent: int
    outputs: int
    symbolic: str
    source: str

    @classmethod
    def of_function(
        cls,
        func: relax.Function,
        dims: Mapping[str, int],
        *,
        mod: Any = None,
        source: str = "",
    ) -> LowerBound:
        """The bound of ``func``, read from it (pass the function before the passes).

        Parameters
        ----------
        func
            The function as given, before any pass: every version of it reports this bound.
        dims
            Concrete dims; those ``func`` does not have (lowering may add some) are ignored.
        mod
            The module ``func`` belongs to (tells its calls of PrimFuncs from those of Relax
            functions).
        source
            Names the function in reports.
        """
        # Kernel scratch is left out: it depends on the target the kernels are built for.
        return cls.of_timeline(memory_timeline(func, mod=mod, workspaces=False), dims, source)

    @classmethod
    def of_timeline(
        cls, timeline: MemoryTimeline, dims: Mapping[str, int], source: str = ""
    ) -> LowerBound:
        """The bound from a function's timeline (see :meth:`of_function`)."""
        graph = timeline.graph
        bindings = {name: value for name, value in dims.items() if name in graph.dims}
        persistent = graph.evaluate(timeline.persistent, bindings)
        outputs = graph.evaluate(timeline.output_bytes, bindings)
        return cls(
            nbytes=persistent + outputs,
            persistent=persistent,
            outputs=outputs,
            symbolic=str(timeline.persistent + timeline.output_bytes),
            source=source,
        )


@dataclass
class MemoryReport:
    """Live bytes of one function over its bindings, at concrete dims.

    Attributes
    ----------
    label
        A name for the program (e.g. ``"stock"`` or ``"blade_relax"``).
    timeline
        The symbolic timeline the report evaluates.
    evaluated
        The timeline at ``dims``.
    measured
        The runtime's ``memory_stats()`` after running the program, if it was run.
    bound
        The function's :class:`LowerBound`, shared by every version of it (read from this
        report's own timeline when not given: pass the one of the function before the passes
        so that the reports of its versions agree).
    """

    label: str
    timeline: MemoryTimeline
    evaluated: EvaluatedTimeline
    measured: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    bound: LowerBound | None = None

    def __post_init__(self) -> None:
        if self.bound is None:
            self.bound = LowerBound.of_timeline(self.timeline, self.evaluated.bindings)

    @classmethod
    def from_function(
        cls,
        func: relax.Function,
        dims: Mapping[str, int],
        *,
        label: str = "",
        mod: Any = None,
        measured: Mapping[str, Any] | None = None,
        bound: LowerBound | None = None,
    ) -> MemoryReport:
        """Build a report for ``func`` evaluated at ``dims``.

        ``bound``: the :class:`LowerBound` of the function before the passes
        (:meth:`LowerBound.of_function`), the same for every version; read from ``func``
        when omitted.
        """
        timeline = memory_timeline(func, mod=mod)
        return cls(
            label=label,
            timeline=timeline,
            evaluated=timeline.evaluate(dict(dims)),
            measured=dict(measured) if measured is not None else None,
            bound=bound,
        )

    @property
    def peak(self) -> int:
        """The largest live bytes of any binding (parameters excluded), kernel scratch included."""
        return self.evaluated.peak

    @property
    def lower_bound(self) -> int:
        """The function's :class:`LowerBound` in bytes, persistent bytes included."""
        assert self.bound is not None  # set by __post_init__
        return self.bound.nbytes

    def rows(self) -> list[dict[str, Any]]:
        """One row per binding: name, live bytes during and after it (``live_bytes`` includes
        ``workspace_bytes``, the workspace its kernel holds while it runs), and the symbolic
        live bytes."""
        steps = self.timeline.steps
        workspace = self.evaluated.workspace or [0] * len(steps)
        return [
            {
                "index": step.index,
                "name": step.name,
                "live_bytes": self.evaluated.live_during[step.index],
                "live_after_bytes": self.evaluated.live_after[step.index],
                "workspace_bytes": workspace[step.index],
                "live_symbolic": str(step.live_during),
            }
            for step in steps
        ]

    def summary(self) -> dict[str, Any]:
        """The headline numbers, as a JSON-ready dict."""
        out: dict[str, Any] = {
            "label": self.label,
            "stage": self.timeline.stage,
            "dims": dict(self.evaluated.bindings),
            "peak_bytes": self.evaluated.peak,
            "peak_binding": (
                self.timeline.steps[self.evaluated.peak_index].name
                if self.evaluated.peak_index is not None
                else None
            ),
            "peak_symbolic": str(self.timeline.peak),
            "peak_workspace_bytes": self.evaluated.peak_workspace,
            "persistent_bytes": self.evaluated.persistent,
            "lower_bound_bytes": self.bound.nbytes,
            "lower_bound_symbolic": self.bound.symbolic,
            "lower_bound_outputs_bytes": self.bound.outputs,
            "lower_bound_of": self.bound.source or "this function",
            "bindings": len(self.timeline.steps),
        }
        if self.measured is not None:
            for key in ("peak_bytes", "allocations", "evictions", "regenerations"):
                if key in self.measured:
                    out[f"measured_{key}"] = self.measured[key]
        out.update(self.extra)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The summary and every row as JSON."""
        return json.dumps({"summary": self.summary(), "rows": self.rows()}, indent=indent)

    def to_chrome_trace(self) -> dict[str, Any]:
        """Trace-event JSON (object form): load it in Perfetto or ``chrome://tracing``.

        Time is the binding index in microseconds (one binding = 1 µs); a counter event per
        binding carries the live bytes, and a complete event per binding names it.
        """
        pid = 1
        events: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"blade_relax {self.label}".strip()},
            }
        ]
        for row in self.rows():
            ts = row["index"]
            events.append(
                {
                    "name": row["name"],
                    "cat": "binding",
                    "ph": "X",
                    "ts": ts,
                    "dur": 1,
                    "pid": pid,
                    "tid": 1,
                    "args": {"live_bytes": row["live_bytes"], "symbolic": row["live_symbolic"]},
                }
            )
            events.append(
                {
                    "name": "live bytes",
                    "ph": "C",
                    "ts": ts,
                    "pid": pid,
                    "args": {"live": row["live_bytes"]},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {k: str(v) for k, v in self.summary().items()},
        }

    def to_text(self, max_rows: int = 30) -> str:
        """A readable table: the bindings with the largest live bytes, and the headline."""
        s = self.summary()
        bound = self.bound.nbytes - self.bound.persistent
        lines = [
            f"memory report {self.label}".rstrip() + f"  (stage: {s['stage']}, dims: {s['dims']})",
            f"  peak:        {s['peak_bytes']:>14,} B  ({_human(s['peak_bytes'])}) "
            f"at {s['peak_binding']}"
            + (
                f", {s['peak_workspace_bytes']:,} B of it kernel workspace"
                if s["peak_workspace_bytes"]
                else ""
            ),
            # On the peak's basis (parameters excluded), so that the two lines compare.
            f"  lower bound: {bound:>14,} B  ({_human(bound)}) excl. persistent: the outputs "
            f"of {s['lower_bound_of']}, the same for every version",
            f"  persistent:  {s['persistent_bytes']:>14,} B",
            f"  symbolic peak: {s['peak_symbolic']}",
        ]
        if self.measured is not None:
            lines.append(
                "  measured:    "
                + ", ".join(
                    f"{k}={self.measured[k]:,}"
                    for k in ("peak_bytes", "allocations", "evictions", "regenerations")
                    if k in self.measured
                )
            )
        rows = self.rows()
        shown = sorted(rows, key=lambda r: -r["live_bytes"])[:max_rows]
        shown.sort(key=lambda r: r["index"])
        width = max([len(r["name"]) for r in shown] + [7])
        lines.append("")
        lines.append(f"  {'#':>5}  {'binding':<{width}}  {'live bytes':>14}  symbolic")
        for r in shown:
            lines.append(
                f"  {r['index']:>5}  {r['name']:<{width}}  {r['live_bytes']:>14,}  "
                f"{r['live_symbolic']}"
            )
        if len(rows) > len(shown):
            lines.append(f"  ({len(rows) - len(shown)} bindings with fewer live bytes not shown)")
        return "\n".join(lines)

    def plot(self, path: str, *others: MemoryReport, title: str | None = None) -> str:
        """Plot live bytes over the program (this report and ``others``) to ``path``.

        The x axis is the position in the program, scaled to [0, 1] so that programs with
        different binding counts (before/after our passes) line up.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for report in (self, *others):
            live = report.evaluated.live_during
            n = max(len(live) - 1, 1)
            xs = [i / n for i in range(len(live))]
            label = f"{report.label or 'program'} (peak {_human(report.peak)})"
            ax.plot(xs, [v / 2**20 for v in live], label=label, linewidth=1.5)
        ax.axhline(
            self.bound.outputs / 2**20,
            color="gray",
            linestyle=":",
            label="lower bound (excl. persistent): the function's outputs",
        )
        ax.set_xlabel("position in the program")
        ax.set_ylabel("live bytes allocated by the VM (MiB)")
        ax.set_title(title or f"memory over the program at {self.evaluated.bindings}")
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

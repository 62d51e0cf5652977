"""Running the GPU program: steps as subprocesses, results flushed after each one.

Each step of :func:`~.plan.program_steps` runs as its own process group, from the project
root, with the step's budget as its time limit (killed past it) and never past the program's
deadline (a step that would start with less than :data:`MIN_STEP_S` left is skipped). Its
output goes to the terminal and to ``$OUT/gpu-log.txt``. Before a step starts and after it
ends, ``$OUT/gpu-summary.json`` and ``$OUT/gpu-results.md`` are rewritten (each to a temporary
file first, then renamed), so a run killed in the middle leaves every finished step's result
and the name of the one that was running.

What comes back from ``$OUT`` is at most 8 files: ``gpu-summary.json``, ``gpu-results.md``,
``gpu-log.txt``, ``preflight.json``, one ``bench-<workload>.json`` per benchmarked workload,
``cuda-graphs.json`` and ``gemm.json``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .plan import LOCK_ENV, PLAN_LIMIT_S, ProgramOptions, Step, plan_seconds, program_steps

__all__ = [
    "MAX_OUT_FILES",
    "MIN_STEP_S",
    "StepResult",
    "results_markdown",
    "run_program",
    "run_step",
]

#: Files that come back from ``$OUT``.
MAX_OUT_FILES = 8
#: A step does not start with less time left than this.
MIN_STEP_S = 20.0
SUMMARY = "gpu-summary.json"
RESULTS = "gpu-results.md"
LOG = "gpu-log.txt"


@dataclass
class StepResult:
    """What one step did.

    Attributes
    ----------
    name
        The step.
    status
        ``"ok"``, ``"failed"``, ``"timeout"``, ``"skipped"`` or ``"running"``.
    seconds
        Wall seconds it ran.
    estimate_s, budget_s
        Its plan.
    returncode
        The process's exit status (``None`` when it did not finish).
    detail
        One line: what it found, or why it failed.
    data
        What was read from its output (the benchmark's rows, pytest's counts, ...).
    """

    name: str
    status: str
    seconds: float = 0.0
    estimate_s: float = 0.0
    budget_s: float = 0.0
    returncode: int | None = None
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


_LOG_LOCK = threading.Lock()


def _pump(stream: Any, sinks: list[TextIO], tail: list[str], prefix: str) -> None:
    for line in iter(stream.readline, ""):
        with _LOG_LOCK:
            for sink in sinks:
                sink.write(prefix + line)
                sink.flush()
        tail.append(line)
        del tail[:-200]


@dataclass
class _Running:
    """A started step: its process, the thread copying its output, and that output's tail."""

    step: Step
    proc: subprocess.Popen
    pump: threading.Thread
    tail: list[str]
    started: float


def start_step(
    step: Step, root: Path, log: TextIO, out: Path, env: dict[str, str] | None = None
) -> _Running:
    """Start ``step`` from ``root`` in a process group of its own; its output goes to the
    terminal and ``log`` (each line prefixed with the step's name when it runs in the
    background)."""
    environ = dict(os.environ, **step.env, **(env or {}), OUT=str(out), PYTHONUNBUFFERED="1")
    python_dir = str(Path(root) / "python")
    if python_dir not in environ.get("PYTHONPATH", "").split(os.pathsep):
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (python_dir, environ.get("PYTHONPATH")) if p
        )
    proc = subprocess.Popen(
        step.command,
        cwd=root,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tail: list[str] = []
    prefix = f"[{step.name}] " if step.background else ""
    pump = threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout, log], tail, prefix))
    pump.start()
    return _Running(step, proc, pump, tail, time.monotonic())


def finish_step(running: _Running, limit_s: float) -> tuple[int | None, float, str]:
    """Wait at most ``limit_s`` more seconds for a started step, then kill its process group.

    Returns
    -------
    tuple
        The exit status (``None`` when it was killed), its seconds since it started, and the
        last lines of its output.
    """
    try:
        code: int | None = running.proc.wait(timeout=max(limit_s, 0.0))
    except subprocess.TimeoutExpired:
        os.killpg(running.proc.pid, signal.SIGKILL)
        running.proc.wait()
        code = None
    running.pump.join(timeout=10)
    return code, time.monotonic() - running.started, "".join(running.tail)


def run_step(
    step: Step, root: Path, limit_s: float, log: TextIO, out: Path
) -> tuple[int | None, float, str]:
    """Run ``step`` from ``root`` for at most ``limit_s`` seconds (see :func:`finish_step`)."""
    return finish_step(start_step(step, root, log, out), limit_s)


class _GpuLock:
    """A background step's GPU lock: the program holds it until it reaches that step in the
    order; the step takes it only to measure (:data:`~.plan.LOCK_ENV`). One lock per step,
    so that background steps measure in the program's order, one at a time, never while a
    foreground step runs (with one lock for all, whichever step finished compiling first took
    the GPU when the program let go of it, and the one the program waited for ran out of
    time on the first GPU run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "a")  # noqa: SIM115 - held for the whole program

    def take(self) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)

    def close(self) -> None:
        self.handle.close()


# ------------------------------------------------------------------------------------------
# Reading a step's results


def _read_preflight(out: Path, _output: str) -> tuple[str, dict[str, Any]]:
    path = out / "preflight.json"
    if not path.is_file():
        return "no preflight.json written", {}
    steps = json.loads(path.read_text()).get("steps", [])
    failed = [s["step"] for s in steps if not s.get("ok")]
    detail = f"{len(steps) - len(failed)} of {len(steps)} checks ok"
    return detail + (f"; failed: {'; '.join(failed)}" if failed else ""), {"steps": steps}


def _read_pytest(_out: Path, output: str) -> tuple[str, dict[str, Any]]:
    counts = {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)
    }
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
    detail = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no pytest summary"
    return detail, {"counts": counts, "failures": failures}


def _read_tutorial(_out: Path, output: str) -> tuple[str, dict[str, Any]]:
    agree = re.findall(r"^s=\d+: counted peak .*$", output, flags=re.M)
    table = [line for line in output.splitlines() if re.match(r"^\s*\d+ (stock|blade)", line)]
    return (agree[-1] if agree else "no driver check printed"), {"table": table}


def _read_json_step(
    step: Step, what: str, summarize: Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]
) -> tuple[str, dict[str, Any]]:
    """What a step that writes a JSON (its ``--out``) and a Markdown table beside it found:
    ``summarize(doc)`` gives the detail line and data of its own; the table goes into the data
    and is removed from ``$OUT`` (carried in the summary: the files there are counted)."""
    path = Path(step.command[step.command.index("--out") + 1])
    if not path.is_file():
        return f"no {what} JSON written", {}
    doc = json.loads(path.read_text())
    detail, extra = summarize(doc)
    data = {"json": path.name, "all_correct": doc.get("all_correct"), **extra}
    markdown = path.with_suffix(".md")
    if markdown.is_file():
        data["table"] = markdown.read_text()
        markdown.unlink()
    return detail, data


def _bench_found(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows = doc.get("results", [])
    wrong = [r for r in rows if r.get("error") or r.get("correct") is False]
    driver = [r for r in rows if r.get("driver_agrees") is not None]
    agree = sum(1 for r in driver if r["driver_agrees"])
    detail = (
        f"{len(rows) - len(wrong)} of {len(rows)} rows correct against torch; driver agrees "
        f"on {agree} of {len(driver)} TVM rows"
    )
    return detail, {}


def _cuda_graphs_found(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows = doc.get("rows", [])
    by = {(r["length"], r["mode"]): r["median_ms"] for r in rows}
    speedups = [
        f"s={n} {by[(n, 'plain')] / by[(n, 'graphs')]:.2f}x"
        for n in doc.get("lengths", [])
        if (n, "plain") in by and (n, "graphs") in by and by[(n, "graphs")] > 0
    ]
    pool = doc.get("pool", {})
    correct = sum(1 for r in rows if r.get("correct"))
    detail = (
        f"{correct} of {len(rows)} rows correct against torch; graphs vs plain: "
        f"{', '.join(speedups) or 'not both run'}; pool {pool.get('pool_bytes', 0) / (1 << 20):.2f}"
        f" MiB (largest bucket {pool.get('largest_bytes', 0) / (1 << 20):.2f} MiB)"
    )
    return detail, {"pool": pool}


def _gemm_found(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows = doc.get("rows", [])
    ratios = [r["tvm_over_torch"] for r in rows]
    correct = sum(1 for r in rows if r.get("correct"))
    detail = f"{correct} of {len(rows)} GEMMs correct against torch"
    if ratios:
        detail += f"; TVM's time / {doc.get('library')}'s: {min(ratios):.2f}x to {max(ratios):.2f}x"
    return detail, {}


def _read_bench(out: Path, output: str, step: Step) -> tuple[str, dict[str, Any]]:
    return _read_json_step(step, "benchmark", _bench_found)


def _read_cuda_graphs(out: Path, output: str, step: Step) -> tuple[str, dict[str, Any]]:
    return _read_json_step(step, "cuda-graphs", _cuda_graphs_found)


def _read_gemm(out: Path, output: str, step: Step) -> tuple[str, dict[str, Any]]:
    return _read_json_step(step, "gemm", _gemm_found)


def _read(step: Step, out: Path, output: str) -> tuple[str, dict[str, Any]]:
    if step.kind == "bench":
        return _read_bench(out, output, step)
    if step.kind == "cuda-graphs":
        return _read_cuda_graphs(out, output, step)
    if step.kind == "gemm":
        return _read_gemm(out, output, step)
    reader = {"preflight": _read_preflight, "pytest": _read_pytest, "tutorial": _read_tutorial}
    return reader[step.kind](out, output)


# ------------------------------------------------------------------------------------------
# The summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def results_markdown(summary: dict[str, Any]) -> str:
    """``gpu-results.md``: the steps, then each benchmark's table, ready for the README."""
    lines = [
        f"## GPU results ({summary.get('device') or 'no GPU found'}, {summary['started']})",
        "",
        f"Command: `{summary['command']}`; {summary['seconds']:.0f} s of "
        f"{summary['deadline_s']:.0f} s allowed.",
        "",
        "| step | status | seconds | estimate | what it found |",
        "|---|---|---|---|---|",
    ]
    for step in summary["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | "
            f"{step['estimate_s']:.0f} | {step['detail']} |"
        )
    for step in summary["steps"]:
        table = step.get("data", {}).get("table")
        if isinstance(table, str):
            lines += ["", f"### {step['name']}", "", table]
        elif table:
            lines += ["", f"### {step['name']}", "", "```", *table, "```"]
    return "\n".join(lines) + "\n"


def _device_name() -> str | None:
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def run_program(
    options: ProgramOptions, only: list[str] | None = None, say: Any = print
) -> dict[str, Any]:
    """Run the program's steps (those named in ``only``, when given); returns the summary.

    Background steps start first and prepare (compile) while the foreground steps before
    them hold the GPU; when the program reaches one, it lets go of the GPU and waits for it.
    """
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = program_steps(options)
    if only:
        # In the order given: a second run puts first what the first one did not reach.
        by_name = {s.name: s for s in steps}
        unknown = [name for name in only if name not in by_name]
        if unknown:
            raise ValueError(f"no step named {', '.join(unknown)}; steps: {', '.join(by_name)}")
        steps = [by_name[name] for name in only]
    started = time.monotonic()
    summary: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": _device_name(),
        "command": "bash ci/gpu.sh" + (f" --only {','.join(only)}" if only else ""),
        "deadline_s": options.deadline_s,
        "plan_s": plan_seconds(steps),
        "plan_limit_s": PLAN_LIMIT_S,
        "seconds": 0.0,
        "complete": False,
        "steps": [
            asdict(StepResult(s.name, "pending", 0.0, s.estimate_s, s.budget_s)) for s in steps
        ],
    }

    def flush() -> None:
        summary["seconds"] = time.monotonic() - started
        _write_atomic(out / SUMMARY, json.dumps(summary, indent=1, default=str) + "\n")
        _write_atomic(out / RESULTS, results_markdown(summary))

    def record(index: int, result: StepResult) -> None:
        summary["steps"][index] = asdict(result)
        flush()

    def left() -> float:
        return options.deadline_s - (time.monotonic() - started)

    with tempfile.TemporaryDirectory() as work, open(out / LOG, "a") as log:
        locks: dict[str, _GpuLock] = {}
        background: dict[str, _Running] = {}
        for index, step in enumerate(steps):
            if step.background and left() >= MIN_STEP_S:
                locks[step.name] = _GpuLock(Path(work) / f"gpu-{step.name}.lock")
                locks[step.name].take()
                env = {LOCK_ENV: str(locks[step.name].path)}
                background[step.name] = start_step(step, options.root, log, out, env)
                record(index, StepResult(step.name, "running", 0.0, step.estimate_s, step.budget_s))
                say(f"=== {step.name}: started in the background (budget {step.budget_s:.0f} s)")
        try:
            for index, step in enumerate(steps):
                result = StepResult(step.name, "running", 0.0, step.estimate_s, step.budget_s)
                if step.name not in background and left() < MIN_STEP_S:
                    result.status, result.detail = "skipped", f"{left():.0f} s left of the deadline"
                    record(index, result)
                    continue
                if step.background:
                    running = background.pop(step.name)
                    say(f"=== {step.name}: waiting for it (the GPU is its)")
                    locks[step.name].release()
                    limit = min(step.budget_s - (time.monotonic() - running.started), left())
                    code, seconds, output = finish_step(running, limit)
                else:
                    record(index, result)
                    banner = f"=== {step.name} (estimate {step.estimate_s:.0f} s, budget {step.budget_s:.0f} s)"
                    say(banner)
                    log.write(banner + "\n")
                    code, seconds, output = run_step(
                        step, options.root, min(step.budget_s, left()), log, out
                    )
                _conclude(result, step, code, seconds, output, out)
                record(index, result)
                say(f"=== {step.name}: {result.status} in {seconds:.0f} s: {result.detail}")
        finally:
            for running in background.values():
                finish_step(running, 0.0)
            for lock in locks.values():
                lock.close()
    summary["complete"] = True
    summary["out_files"] = sorted(p.name for p in out.iterdir())
    flush()
    return summary


def _conclude(
    result: StepResult, step: Step, code: int | None, seconds: float, output: str, out: Path
) -> None:
    """Fill ``result`` from a finished step's exit status and output."""
    result.seconds, result.returncode = round(seconds, 1), code
    try:
        result.detail, result.data = _read(step, out, output)
    except Exception as err:  # a result that cannot be read is a result too
        result.detail = f"results unreadable: {type(err).__name__}: {err}"
    if code is None:
        result.status = "timeout"
        result.detail = f"killed after {seconds:.0f} s; " + result.detail
    else:
        result.status = "ok" if code == 0 else "failed"
    if code not in (0, None):
        last = [line for line in output.splitlines() if line.strip()][-1:]
        result.data["last_line"] = last[0][:300] if last else ""

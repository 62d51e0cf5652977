"""Tutorials 1-4 and 6 run end to end at small sizes (tutorial 5 needs CUDA), quietly, and tell
the truth.

Each CPU tutorial runs once per session (with its output redirected, as in CI); the tests
read what it printed: no TVM native warning and no colour codes, the quickstart's peak and
lower bound on one basis, the Llama budget table's rows on one base and in agreement with the
runtime's warnings, the training loop's in-place updates, single compilation, peaks at or
below PyTorch's at every length, and budget.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tvm

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
CPU_TUTORIALS = sorted(p.name for p in TUTORIALS.glob("0[1-46]_*.py"))


def test_five_cpu_tutorials_exist():
    assert len(CPU_TUTORIALS) == 5, CPU_TUTORIALS


# A TVM log line on stderr: "[hh:mm:ss] /path/file.cc:123: Warning: ..."
TVM_LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", re.M)


@pytest.fixture(scope="session")
def tutorial_output(tmp_path_factory):
    """Runs a CPU tutorial once (small sizes, default verbosity) and keeps what it printed."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def run(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            env = dict(os.environ, BLADE_RELAX_TUTORIAL_SMALL="1", MPLBACKEND="Agg")
            env.pop("BLADE_RELAX_VERBOSE", None)
            cwd = tmp_path_factory.mktemp("tutorial")
            done[name] = subprocess.run(
                [sys.executable, str(TUTORIALS / name)],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            done[name].cwd = cwd  # where the tutorial wrote its files
        proc = done[name]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    return run


@pytest.mark.parametrize("name", CPU_TUTORIALS)
def test_tutorial_runs_quietly(name, tutorial_output):
    proc = tutorial_output(name)
    assert not TVM_LOG_LINE.search(proc.stderr), proc.stderr[-3000:]
    assert "[transformers]" not in proc.stderr
    assert "\x1b[" not in proc.stdout  # no colour codes in redirected output


def test_quickstart_puts_peak_and_lower_bound_on_one_basis(tutorial_output):
    """The lower bound includes parameters and inputs; the peak it is compared with too."""
    out = tutorial_output("01_quickstart.py").stdout
    pattern = re.compile(
        r"b=(\d+): peak ([\d,]+) B allocated \+ ([\d,]+) B parameters and inputs = ([\d,]+) B, "
        r"lower bound ([\d,]+) B"
    )
    found = pattern.findall(out)
    assert len(found) == 2, out
    for _, peak, persistent, total, lower in found:
        peak, persistent, total, lower = (
            int(v.replace(",", "")) for v in (peak, persistent, total, lower)
        )
        assert peak + persistent == total
        assert lower <= total


def test_budget_rows_share_one_base_and_agree_with_the_warnings(tutorial_output):
    """Tutorial 4: every row measured from the same (empty) base, as the runtime sees it.

    A budget row's peak is below its budget, or it is the smallest reachable peak that the
    runtime's warning for that length and budget names, with no bytes live at the call.
    """
    out = tutorial_output("04_llama_training_budget.py").stdout
    rows = re.findall(
        r"^\s*(\d+)\s+(none|0\.\d)\s+([\d,]+|-)\s+([\d,]+)\s+(\d+)\s+(\d+)\s+(yes|no \(min\)|-)\s",
        out,
        re.M,
    )
    assert len(rows) == 8, out
    warned = {
        (int(s), f): (int(budget), int(peak))
        for s, f, budget, live, peak in re.findall(
            r"s=(\d+) @(0\.\d): .*? the memory budget of (\d+) bytes \((\d+) bytes were already "
            r"live at the call\): the smallest reachable peak is (\d+) bytes",
            out,
        )
        if int(live) == 0
    }
    unbudgeted = {}
    for length, fraction, budget, peak, _evictions, _regens, met in rows:
        length, peak = int(length), int(peak.replace(",", ""))
        if fraction == "none":
            unbudgeted[length] = peak
            continue
        budget = int(budget.replace(",", ""))
        assert budget == int(unbudgeted[length] * float(fraction))
        if met == "yes":
            assert peak <= budget and (length, fraction) not in warned
        else:
            assert warned[(length, fraction)] == (budget, peak), (length, fraction, out)
    assert len(warned) == sum(1 for row in rows if row[6] == "no (min)")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def test_training_loop_updates_in_place_and_compiles_once(tutorial_output):
    """Tutorial 6: one in-place update per parameter, one compilation for every length, the
    progress bar on stderr, and a loss that goes down."""
    proc = tutorial_output("06_training_loop.py")
    out = proc.stdout
    params = int(re.search(r"^(\d+) parameter tensors", out, re.M).group(1))
    assert f"in-place updates in the IR: {params} call_tir_inplace" in out, out
    assert "updates share the gradients' dataflow block: True" in out
    steps, lengths = (int(v) for v in re.search(r"^(\d+) steps, (\d+) lengths", out, re.M).groups())
    assert lengths > 1 and re.search(r"compilations: 1 \(", out), out
    assert re.search(rf"train: 100%.*\| {steps}/{steps} ", proc.stderr), proc.stderr[-2000:]
    first, last = (
        float(v) for v in re.search(r"steps ([\d.]+), of the last \d+ steps ([\d.]+)", out).groups()
    )
    assert last < first
    worst = float(re.search(r"max relative difference ([\d.e+-]+)", out).group(1))
    assert worst <= 1e-4


def test_training_loop_peaks_at_or_below_torch_at_every_length(tutorial_output):
    """Tutorial 6's table: at every length the compiled step's full peak (parameters and state
    counted once) is at most PyTorch's on the same batch, the ratio column is the ratio, and
    the table reaches the longest length."""
    proc = tutorial_output("06_training_loop.py")
    rows = re.findall(r"^\s*(\d+)\s+([\d,]+)\s+([\d,]+)\s+(\d\.\d{3})$", proc.stdout, re.M)
    assert len(rows) >= 2, proc.stdout
    lengths = [int(r[0]) for r in rows]
    assert lengths == sorted(set(lengths))
    for length, ours, theirs, ratio in rows:
        ours, theirs = _int(ours), _int(theirs)
        assert ours <= theirs, (length, ours, theirs)
        assert abs(ours / theirs - float(ratio)) <= 5e-4
    longest = int(re.search(r"clipped to \[\d+, (\d+)\]", proc.stdout).group(1))
    assert lengths[-1] == longest


def test_training_loop_budget_and_plot(tutorial_output):
    """Tutorial 6's budgeted step stays under 0.8 of the rematerializing copy's peak where the
    runtime says the budget is reachable, and below the unbudgeted step either way; the plot is
    written when matplotlib exists."""
    proc = tutorial_output("06_training_loop.py")
    out = proc.stdout

    def value(label: str) -> int:
        return _int(re.search(rf"{re.escape(label)}\s+([\d,]+)", out).group(1))

    plain = value("no budget (plain step):")
    copy = value("rematerializing copy, no evictions:")
    budget = value("budget 0.8 of that:")
    used = value("with the budget:")
    assert abs(budget - copy * 0.8) <= 1 and copy >= plain
    evictions = int(re.search(r"with the budget:\s+[\d,]+ \((\d+) evictions", out).group(1))
    reachable = "the budget is reachable at this length" in out
    assert reachable != ("the budget is not reachable at this length" in out)
    if reachable:
        assert used <= budget and evictions > 0
    else:
        assert used > budget
    assert used <= plain
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (proc.cwd / "training_loop.png").stat().st_size > 0


GPU_TUTORIAL = TUTORIALS / "05_gpu.py"


def _run_gpu_tutorial(tmp_path):
    env = dict(os.environ, BLADE_RELAX_TUTORIAL_SMALL="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, str(GPU_TUTORIAL)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_gpu_tutorial_is_a_gallery_script():
    source = GPU_TUTORIAL.read_text()
    tree = ast.parse(source, filename=str(GPU_TUTORIAL))
    title, underline = ast.get_docstring(tree).splitlines()[:2]
    assert title and set(underline) == {"="} and len(underline) >= len(title)
    assert source.count("#" * 70) >= 3  # sphinx-gallery cells


def test_gpu_tutorial_without_cuda_says_so_and_exits_cleanly(tmp_path):
    if tvm.cuda(0).exist:
        pytest.skip("a CUDA device is present: test_gpu_tutorial_runs_on_cuda runs it")
    proc = _run_gpu_tutorial(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "needs a CUDA GPU" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_gpu_tutorial_runs_on_cuda(tmp_path):
    proc = _run_gpu_tutorial(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "needs a CUDA GPU" not in proc.stdout
    assert "agree: True" in proc.stdout

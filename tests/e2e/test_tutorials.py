"""Tutorials 1-4 run end to end at small sizes (tutorial 5 needs CUDA)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tvm

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
CPU_TUTORIALS = sorted(p.name for p in TUTORIALS.glob("0[1-4]_*.py"))


def test_four_cpu_tutorials_exist():
    assert len(CPU_TUTORIALS) == 4, CPU_TUTORIALS


@pytest.mark.parametrize("name", CPU_TUTORIALS)
def test_tutorial_runs(name, tmp_path):
    env = dict(os.environ, BLADE_RELAX_TUTORIAL_SMALL="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, str(TUTORIALS / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


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

"""Tutorials 1-4 run end to end at small sizes (tutorial 5 needs CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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

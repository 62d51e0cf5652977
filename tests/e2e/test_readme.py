"""The README's quickstart runs and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _quickstart() -> tuple[str, str]:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    after = section.index("```", section.index(code) + len(code)) + 3
    return code, section[after:].strip()


def test_quickstart_prints_what_the_readme_says():
    code, claims = _quickstart()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    printed = done.stdout.strip().splitlines()
    # "It prints `<first line>` (...) and `<second line>`"
    quoted = re.findall(r"`([^`]+)`", claims.split("\n\n")[0])
    assert printed[0] == quoted[0]
    assert printed[1] == quoted[1]


def test_quickstart_without_the_budget_peaks_where_the_readme_says():
    code, claims = _quickstart()
    # Drop the `with set_memory_budget(...)` line and run its body unbudgeted.
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("with "))
    body = lines[at + 1]
    unbudgeted = "\n".join([*lines[:at], body.strip(), *lines[at + 2 :]])
    done = subprocess.run(
        [sys.executable, "-c", unbudgeted], capture_output=True, text=True, timeout=600, check=True
    )
    peak, evictions, regenerations = done.stdout.strip().splitlines()[1].split()
    claimed = re.search(r"same executable peaks at\s+([\d,]+) bytes", claims).group(1)
    assert int(peak) == int(claimed.replace(",", ""))
    assert evictions == regenerations == "0"

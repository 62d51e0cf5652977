"""The README: its quickstart prints what it says, its commands set up and write where they say."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# Flags of the command lines that name a file to write.
OUTPUT_FLAGS = ("--plot", "--json", "--chrome-trace", "--out", "--budget-plot")


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _commands(title: str) -> list[list[str]]:
    """The shell commands of a section's bash blocks, as argument lists."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", _section(title), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word in ("&&", "||", ";"):
                    if command:
                        commands.append(command)
                    command = []
                else:
                    command.append(word)
    return commands


def test_first_command_installs_no_torch_and_runs_the_demo():
    first = re.search(r"```bash\n(.*?)```", _section("Set up"), re.S).group(1)
    assert "torch" not in first and "[hf" not in first and "nvidia" not in first
    assert 'pip install -e ".[plot]"' in first and "blade-relax demo" in first


def test_plain_pypi_users_get_the_cpu_build_of_torch():
    commands = _commands("Set up")
    torch = [c for c in commands if any(w.startswith("torch==") for w in c)]
    assert torch, "the README says how to install torch"
    for command in torch:
        assert "torch==2.13.0+cpu" in command
        assert command[command.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    ci = (README.parent / "ci" / "test.sh").read_text()
    assert 'TORCH_VERSION="2.13.0+cpu"' in ci and "download.pytorch.org/whl/cpu" in ci


def test_examples_write_into_an_output_folder_not_the_checkout():
    for title in ("Set up", "Command line", "Train it"):
        for command in _commands(title):
            for flag, value in zip(command, command[1:]):
                if flag in OUTPUT_FLAGS:
                    assert value.startswith(("out/", "/tmp/")), (title, command)
            for written in re.findall(r"open\('([^']+)', 'w'\)", " ".join(command)):
                assert written.startswith(("out/", "/tmp/")), (title, command)


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


def test_the_readme_stays_short_and_its_figures_are_generated():
    """At most ~400 lines; benchmark figures only in the generated block, none dated by hand."""
    from blade_relax.bench import docs

    text = README.read_text()
    assert len(text.splitlines()) <= 400
    for stale in ("Measured on the code up to", "measured before", "stale"):
        assert stale not in text, stale
    block = text[text.index(docs.HEADLINE_BEGIN) : text.index(docs.HEADLINE_END)]
    assert "| s |" in block
    assert "docs/benchmarks.md" in text


def test_the_readme_names_entry_points_that_exist():
    import blade_relax
    import blade_relax.runtime as runtime

    text = README.read_text()
    for name in ("import_training_step", "import_inference", "get_pipeline"):
        assert f"blade_relax.{name}(" in text and hasattr(blade_relax, name), name
    for name in ("set_memory_budget", "set_relative_budget", "memory_stats"):
        assert name in text and hasattr(runtime, name), name


def test_the_training_example_runs():
    """The "Train it" example: a LoRA model, a padded, prompt-masked batch, a budgeted step."""
    pytest.importorskip("peft")
    code = re.search(r"```python\n(.*?)```", _section("Train it"), re.S).group(1)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True
    )
    line = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"loss ([\d.]+) -> ([\d.]+); peak ([\d,]+) -> ([\d,]+) B", line)
    assert match, line
    assert float(match.group(2)) < float(match.group(1))  # the first step's update lowered it
    assert int(match.group(4).replace(",", "")) <= int(match.group(3).replace(",", ""))

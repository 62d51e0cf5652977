"""The ``blade-relax`` command line: demo, report, bench delegation, help and bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from blade_relax import cli
from blade_relax.analysis import compile_keeping_module, memory_timeline
from blade_relax.bench import WORKLOADS
from blade_relax.bench.cli import WORKLOAD_NAMES
from blade_relax.bench.floor import memory_floor, parameter_counts
from blade_relax.bench.workloads import ModelSizes
from blade_relax.cli import demo as cli_demo
from blade_relax.cli import demo_plot
from blade_relax.cli import models as cli_models
from blade_relax.cli import report as cli_report
from blade_relax.cli import train as cli_train
from blade_relax.frontend.builtin import BUILTIN_MODELS, attention_block, random_arguments
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline
from blade_relax.runtime import measure_memory
from blade_relax.util import quiet as stderr_filter
from blade_relax.util.cliargs import available_memory, human_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def attention_script(tmp_path_factory) -> Path:
    """The built-in attention block saved as TVMScript, as a user would save a module."""
    path = tmp_path_factory.mktemp("scripts") / "attention.py"
    path.write_text(attention_block().script())
    return path


def _run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _console_script() -> str:
    return shutil.which("blade-relax") or str(Path(sys.executable).parent / "blade-relax")


def _imported_modules(command: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run a Python command line with ``-X importtime``; the modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    modules = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    return proc, modules


# A TVM log line on stderr: "[hh:mm:ss] /path/file.cc:123: Warning: ..."
TVM_LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", re.M)


# ------------------------------------------------------------------------------------ help
def test_console_script_help():
    script = shutil.which("blade-relax") or str(Path(sys.executable).parent / "blade-relax")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "report", "bench"):
        assert command in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["report", "--help"],
        ["bench", "--help"],
        ["demo", "--sizes", "8,x"],
        ["demo", "--model", "no-such-model"],
        ["bench", "--lengths", "8,x"],
    ],
    ids=" ".join,
)
def test_help_and_bad_input_import_no_tvm(argv):
    """--help and argument errors answer without importing TVM, torch or sympy (seconds)."""
    proc, modules = _imported_modules([_console_script(), *argv])
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    assert "blade_relax.cli" in modules
    assert not modules & {"tvm", "torch", "sympy", "transformers"}


def test_console_script_runs_a_command_after_its_lazy_start():
    """In a real process the package starts lazily, then loads in full for the command."""
    proc = subprocess.run(
        [_console_script(), "demo", "--model", "mlp", "--sizes", "4", "--no-plot"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted == measured for all" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_bench_module_help_imports_no_tvm():
    proc, modules = _imported_modules(["-m", "blade_relax.bench", "--help"])
    assert proc.returncode == 0
    assert "blade_relax.bench.cli" in modules and "tvm" not in modules


def test_known_names_match_the_registries():
    """The names the command lines know without importing TVM are the registries' names."""
    assert set(cli_models.BUILTIN_MODEL_NAMES) == set(BUILTIN_MODELS)
    assert set(WORKLOAD_NAMES) == set(WORKLOADS)


@pytest.mark.parametrize("command", ["demo", "report"])
def test_every_flag_is_explained(command, capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command_parser = subparsers.choices[command]
    for action in command_parser._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
    code, out, _ = _run([command, "--help"], capsys)
    assert code == 0
    for action in command_parser._actions:
        for flag in action.option_strings:
            assert flag in out


# ------------------------------------------------------------------------------- bad input
BAD_INPUT = [
    (["demo", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["demo", "--sizes", "8,x"], "--sizes takes comma-separated integers"),
    (["demo", "--sizes", "0,8"], "--sizes needs positive integers"),
    (["demo", "--sizes", ","], "--sizes needs positive integers"),
    (["demo", "--budget", "0"], "--budget is a fraction"),
    (["demo", "--budget", "2"], "--budget is a fraction"),
    (["demo", "--budget", "half"], "invalid float value"),
    (["demo", "--plot", "AFILE/demo.png"], "is not a directory"),
    (["demo", "--plot", "TMPDIR"], "is not a file path"),
    (["demo", "--model", "bench:mlp-train", "--sizes", "4096"], "outside bench:mlp-train's range"),
    (["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["train", "--steps", "0"], "--steps must be positive"),
    (["train", "--budget", "1.5"], "--budget is a fraction"),
    (["train", "--lr", "-1"], "--lr must be a positive number"),
    (["train", "--model", "bert"], "invalid choice: 'bert'"),
    (["train", "--plot", "AFILE/t.png"], "is not a directory"),
    (["report", "no-such-model"], "is neither a file nor a model name"),
    (["report", "/no/such/module.py"], "no such file: /no/such/module.py"),
    (["report", "SCRIPT", "--dims", "s"], "--dims takes name=value pairs"),
    (["report", "SCRIPT", "--dims", "s=64;b=2"], "--dims: the value of s must be an integer"),
    (["report", "SCRIPT", "--dims", "=4"], "--dims takes name=value pairs"),
    (["report", "SCRIPT", "--dims", "s=1,s=2"], "--dims: s is given twice"),
    (["report", "SCRIPT", "--dims", "s=0"], "a dim must be at least 1"),
    (["report", "SCRIPT", "--dims", "s=-3"], "a dim must be at least 1"),
    (["report", "SCRIPT", "--dims", "n=4"], "unknown dim 'n'; main has s"),
    (["report", "SCRIPT", "--function", "forward"], "no function 'forward'"),
    (["report", "SCRIPT", "--pipeline", "fast"], "invalid choice: 'fast'"),
    (["report", "SCRIPT", "--rows", "0"], "--rows must be at least 1"),
    (["report", "SCRIPT", "--plot", "AFILE/r.png"], "--plot: "),
    (["report", "SCRIPT", "--json", "AFILE/sub/r.json"], "--json: "),
    (["report", "SCRIPT", "--chrome-trace", "TMPDIR"], "--chrome-trace: "),
    (["report", "bench:gpt2-infer", "--dims", "s=100000"], "outside bench:gpt2-infer's range"),
    (["report", "bench:gpt2-infer", "--dims", "b=2"], "unknown dim 'b'; bench:gpt2-infer has s"),
    (
        ["report", "bench:llama-lora-sft", "--dims", "b=5"],
        "b = 5 is outside bench:llama-lora-sft's range [1, 4]",
    ),
    (["report", "BROKEN"], "cannot parse"),
    (["report", "GARBAGE"], "cannot parse"),
    (["report", "EMPTY"], "defines no IRModule or function"),
    (["report", "PRIMFUNC"], "'add' in"),
    (["report"], "required: INPUT"),
    ([], "required"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]

BROKEN_SCRIPT = """# from tvm.script import ir as I
# from tvm.script import relax as R
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        y = R.no_such_operator(x)
        return y
"""

PRIMFUNC_SCRIPT = """# from tvm.script import ir as I
# from tvm.script import tirx as T
@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def add(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n,), "float32")
        B = T.match_buffer(b, (n,), "float32")
        for i in range(n):
            with T.sblock("b"):
                vi = T.axis.remap("S", [i])
                B[vi] = A[vi] + T.float32(1)
"""


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(argv, message, attention_script, tmp_path, capsys):
    files = {
        "SCRIPT": attention_script,
        "BROKEN": tmp_path / "broken.py",
        "GARBAGE": tmp_path / "garbage.txt",
        "EMPTY": tmp_path / "empty.py",
        "PRIMFUNC": tmp_path / "prim.py",
        "TMPDIR": tmp_path,
        "AFILE": tmp_path / "a-file",
    }
    files["AFILE"].write_text("not a directory\n")
    files["BROKEN"].write_text(BROKEN_SCRIPT)
    files["GARBAGE"].write_text("this is ( not python\n")
    files["EMPTY"].write_text("x = 1\n")
    files["PRIMFUNC"].write_text(PRIMFUNC_SCRIPT)
    if message == "'add' in":
        argv = [*argv, "--function", "add"]
    # A placeholder stands for its file, also as the first part of a path ("AFILE/demo.png").
    argv = [
        str(files[a.partition("/")[0]]) + a[len(a.partition("/")[0]) :]
        if a.partition("/")[0] in files
        else a
        for a in argv
    ]
    code, out, err = _run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blade-relax: error: ")
    assert message in lines[0]
    assert "Traceback" not in err
    assert out == ""


def test_unparsable_script_from_the_console_prints_one_line(tmp_path):
    """In a real process too: nothing but the error line reaches stderr, even native warnings."""
    path = tmp_path / "broken.py"
    path.write_text(BROKEN_SCRIPT)
    script = shutil.which("blade-relax") or str(Path(sys.executable).parent / "blade-relax")
    proc = subprocess.run(
        [script, "report", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"blade-relax: error: cannot parse {path} as TVMScript: module "
        "'tvm.relax.script.parser' has no attribute 'no_such_operator'"
    ]


# --------------------------------------------------------------------------------- report
def _measured_stock_peak(mod: tvm.IRModule, dims: dict[str, int]) -> int:
    """The stock executable's peak, kernel workspaces counted as the report counts them."""
    build = compile_keeping_module(mod, "llvm", stock_pipeline("llvm"))
    vm = relax.VirtualMachine(build.executable, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], dims)]
    with measure_memory(vm, workspaces=build.workspaces) as measured:
        out = vm["main"](*args)
    del out
    return measured.peak_bytes


def test_report_of_a_script_writes_json_trace_and_plot(attention_script, tmp_path, capsys):
    paths = {k: tmp_path / f"report.{k}" for k in ("json", "trace", "png")}
    code, out, err = _run(
        [
            "report",
            attention_script,
            "--dims",
            "s=48",
            "--json",
            paths["json"],
            "--chrome-trace",
            paths["trace"],
            "--plot",
            paths["png"],
        ],
        capsys,
    )
    assert code == 0, err
    assert "memory report stock TVM" in out and "memory report blade_relax" in out

    data = json.loads(paths["json"].read_text())
    assert data["schema"] == "blade_relax.report/1"
    assert data["dims"] == {"s": 48} and data["function"] == "main"
    stock, blade = data["reports"]
    # A dispatcher's label names the copy that runs at these dims without a budget.
    assert stock["summary"]["label"] == "stock TVM"
    assert re.fullmatch(r"blade_relax( \(main for [^)]+\))?", blade["summary"]["label"])
    for report in (stock, blade):
        summary, rows = report["summary"], report["rows"]
        assert summary["stage"] == "memory"
        assert summary["peak_bytes"] == max(r["live_bytes"] for r in rows)
        assert len(rows) == summary["bindings"] > 0
    # The stock report predicts what the runtime accounting measures for the compiled module.
    assert stock["summary"]["peak_bytes"] == _measured_stock_peak(attention_block(), {"s": 48})
    assert blade["summary"]["peak_bytes"] < stock["summary"]["peak_bytes"]
    assert f"{blade['summary']['peak_bytes']:,} B vs {stock['summary']['peak_bytes']:,} B" in out

    trace = json.loads(paths["trace"].read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert isinstance(events, list) and events
    for event in events:
        assert {"ph", "name", "pid"} <= set(event)
        if event["ph"] != "M":  # metadata events carry no timestamp
            assert isinstance(event["ts"], (int, float))
    assert {e["pid"] for e in events} == {1, 2}  # one process per report
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == 2]
    assert max(e["args"]["live"] for e in counters) == blade["summary"]["peak_bytes"]

    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


def test_report_of_a_builtin_with_stock_pipeline_and_default_dims(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    code, out, err = _run(["report", "mlp", "--pipeline", "stock", "--json", path], capsys)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["dims"] == {"s": cli_report.DEFAULT_REPORT_DIM}
    assert [r["summary"]["label"] for r in data["reports"]] == ["stock TVM"]
    assert "memory report blade_relax" not in out


def test_report_says_what_each_pass_of_the_pipeline_changed(tmp_path, capsys):
    path = tmp_path / "mlp-train.json"
    code, out, err = _run(["report", "mlp-train", "--dims", "b=16", "--json", path], capsys)
    assert code == 0, err
    passes = json.loads(path.read_text())["passes"]
    assert passes["stock TVM"] == []  # TVM's own passes report nothing
    names = [p["pass"] for p in passes["blade_relax"]]
    assert {"MemoryAwareSchedule", "Rematerialize", "PlanMemory"} <= set(names)
    text = out.split("passes of the blade_relax pipeline", 1)[1]
    for name in names:  # every pass's summary, in the order the passes ran
        assert f"\n{name}: " in text
    assert [line.split(":")[0] for line in text.splitlines() if line[:1].isupper()] == names
    schedule = next(p for p in passes["blade_relax"] if p["pass"] == "MemoryAwareSchedule")
    (main,) = [f for f in schedule["functions"] if f["function"] == "main"]
    assert main["changed"] and main["changes"]
    # The figures are evaluated at the report's dims.
    assert main["peak_before_bytes"] > 0 and main["peak_after_bytes"] > 0
    assert f"{main['peak_after_bytes']:,} B" in text


def test_report_without_lowering(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    code, out, err = _run(
        ["report", "mlp-train", "--pipeline", "none", "--dims", "b=8", "--json", path], capsys
    )
    assert code == 0, err
    (report,) = json.loads(path.read_text())["reports"]
    assert report["summary"]["stage"] == "relax"
    assert report["summary"]["dims"] == {"b": 8}


# ----------------------------------------------------------------------------------- demo
def _table_rows(out: str) -> list[list[str]]:
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_demo_tells_the_story_and_writes_its_plot(tmp_path, capsys):
    plot = tmp_path / "out" / "demo.png"  # a missing output folder is created
    code, out, err = _run(["demo", "--sizes", "8,1024", "--plot", plot], capsys)
    assert code == 0, out + err
    assert plot.read_bytes()[:8] == PNG_MAGIC
    # Copies the passes made of `main` are named for the user, not by internal names.
    assert "__" not in out and "symbolic peak, blade_relax" in out
    assert "predicted == measured for all 6 predicted runs" in out
    rows = _table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [
        (size, pipeline)
        for size in ("8", "1024")
        for pipeline in ("stock TVM", "blade_relax", "blade_relax @0.9")
    ]
    for row in rows:
        predicted, measured = (int(c.replace(",", "")) for c in row[3:5])
        assert row[5] == "yes" and predicted == measured
    stock, blade, budget = rows[3:]
    peak = {name: int(r[4].replace(",", "")) for name, r in zip("sbg", (stock, blade, budget))}
    assert peak["b"] < peak["s"]
    # Under the budget the runtime evicts and regenerates, and the budget holds.
    assert int(budget[7]) > 0 and int(budget[8]) >= int(budget[7])
    budget_bytes = int(budget[2].split()[0].replace(",", ""))
    assert budget_bytes == int(0.9 * peak["b"]) and peak["g"] <= budget_bytes
    assert budget[2].endswith("met")
    # The GEMMs run on ATen's BLAS: the outputs agree with stock TVM's to rounding.
    for row in (blade, budget):
        assert (
            row[9] == "identical" or float(row[9].removeprefix("rel err ")) <= cli_demo.OUTPUT_RTOL
        )
    # Progress lines went to stderr, not into the table: one per run.
    assert "... compiling" in err and "... compiling" not in out
    for step in ("[1/3]: stock TVM", "[2/3]: blade_relax", "[3/3]: blade_relax under a budget"):
        assert f"s=1024 {step}" in err
    assert "warning:" not in err  # 1024 is a size the model was tried at


def test_demo_warns_before_a_size_far_beyond_what_was_tried(capsys):
    size = cli_demo.FAR_BEYOND * cli_demo.TRIED_SIZE + 1
    code, out, err = _run(["demo", "--model", "mlp", "--sizes", size, "--no-plot"], capsys)
    assert code == 0, out + err
    lines = err.splitlines()
    (warning,) = [i for i, line in enumerate(lines) if line.startswith("warning: ")]
    first_run = next(i for i, line in enumerate(lines) if "[1/3]" in line)
    assert warning < first_run  # up front, before anything runs
    text = lines[warning]
    assert f"s={size} is " in text and "mlp was tried at" in text
    # With the bytes the symbolic timelines predict, the same the table then shows.
    stock_row = _table_rows(out)[0]
    predicted = int(stock_row[3].replace(",", ""))
    assert f"a peak of {human_bytes(predicted)} (stock TVM)" in text


def test_function_label_names_copies_for_the_user():
    @R.function
    def f(x: R.Tensor((2,), "float32")):
        return x

    version = {"of": "main", "dim": "s", "lower": 110}
    bounded = {"of": "main", "dim": "s", "lower": 1, "upper": 109}
    mod = tvm.IRModule(
        {
            "main": f,
            "main__s110_inf": f.with_attr("blade_relax.schedule_version", version),
            "main__s1_109": f.with_attr("blade_relax.schedule_version", bounded),
            "main__s110_inf__plain": f.with_attr(
                "blade_relax.remat_copy", {"of": "main__s110_inf", "budget": 0}
            ),
            "main__remat": f.with_attr("blade_relax.remat_copy", {"of": "main", "budget": 1}),
            "main__plain": f.with_attr("blade_relax.remat_copy", {"of": "main", "budget": 0}),
        }
    )
    assert cli.function_label(mod, "main") == "main"
    assert cli.function_label(mod, "main__plain") == "main"
    assert cli.function_label(mod, "main__remat") == "main under a budget"
    assert cli.function_label(mod, "main__s110_inf__plain") == "main for s >= 110"
    assert cli.function_label(mod, "main__s1_109") == "main for 1 <= s <= 109"


def test_demo_exits_1_when_a_prediction_misses(capsys, monkeypatch):
    real_run_once = cli_demo._run_once

    def off_by_one(*args, **kwargs):
        result = real_run_once(*args, **kwargs)
        result.peak_bytes += 1
        return result

    monkeypatch.setattr(cli_demo, "_run_once", off_by_one)
    code, out, _ = _run(["demo", "--model", "mlp", "--sizes", "4", "--no-plot"], capsys)
    assert code == 1
    assert "PREDICTION MISSED at s=4, stock TVM" in out
    assert "plot:" not in out


def test_outputs_note():
    a = [np.ones(3, "float32")]
    assert cli_demo._outputs_note(a, [np.ones(3, "float32")]) == ("identical", True)
    assert cli_demo._outputs_note(a, [np.full(3, 1 + 1e-7, "float32")])[1]
    assert cli_demo._outputs_note(a, [np.full(3, 1.1, "float32")]) == ("DIFFER", False)
    assert cli_demo._outputs_note(a, [np.ones(4, "float32")]) == ("DIFFER", False)


# ---------------------------------------------------------------------------------- bench
def test_bench_is_delegated(capsys):
    code, out, _ = _run(["bench", "--list-configs"], capsys)
    assert code == 0
    assert "tvm-dynamic" in out


BENCH_BAD_INPUT = [
    (["--lengths", "8,x"], "--lengths takes comma-separated integers"),
    (["--workload", "nope"], "invalid choice: 'nope'"),
    (["--configs", "no-such-config", "--lengths", "8"], "--configs: unknown config"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--repeat", "x"], "invalid int value: 'x'"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--hidden", "30", "--heads", "4"], "must be a multiple of --heads"),
    (["--lengths", "100000"], "outside the exported range"),
    (["--out", "AFILE/r.json"], "--out: "),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BENCH_BAD_INPUT, ids=[" ".join(a) for a, _ in BENCH_BAD_INPUT]
)
def test_bench_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    argv = [a.replace("AFILE", str(tmp_path / "a-file")) for a in argv]
    code, out, err = _run(["bench", "--workload", "mlp-train", *argv], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blade-relax bench: error: ")
    assert message in lines[0] and out == ""


def test_bench_module_bad_input_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "blade_relax.bench", "--lengths", "8,x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "python -m blade_relax.bench: error: --lengths takes comma-separated integers, not '8,x'"
    ]


# ---------------------------------------------------------------------------- quiet stderr
NATIVE_NOISE = [
    "[20:30:50] /project/src/tirx/op/op.cc:275: Warning: Detected pow(x, y) where y >= 3, it "
    "is recommended to avoid this as it may lead to uninteded behaviors when x < 0.",
    "[20:30:51] /project/include/tvm/topi/transform.h:1261: Warning: Fast mode segfaults when "
    "there are out-of-bounds indices. Make sure input indices are in bound",
    "[20:31:44] /project/src/target/llvm/codegen_cpu.cc:1183: Warning: Unknown pragma pragma_scope",
]


def test_noise_patterns():
    assert all(stderr_filter.is_noise(line) for line in NATIVE_NOISE)
    assert not stderr_filter.is_noise("[20:31:44] /project/src/x.cc:1: Warning: something else")
    assert not stderr_filter.is_noise("Traceback (most recent call last):")


_FILTER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from blade_relax.util.quiet import quiet_stderr
    noise = {noise!r}
    with quiet_stderr():
        print("python line 1", file=sys.stderr, flush=True)
        for line in noise:
            os.write(2, (line + "\\n").encode())  # as native code writes
        os.write(2, b"native line that matters\\n")
        print("python line 2", file=sys.stderr, flush=True)
    os.write(2, b"after the context\\n")
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_native_stderr_is_filtered_unless_verbose(verbose):
    env = dict(os.environ)
    env.pop(stderr_filter.VERBOSE_ENV, None)
    if verbose:
        env[stderr_filter.VERBOSE_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _FILTER_SCRIPT.format(noise=NATIVE_NOISE)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    # Python's lines pass straight through; native lines that are not noise are forwarded,
    # all of them before the context ends.
    wanted = ["python line 1", "native line that matters", "python line 2", "after the context"]
    assert set(wanted) <= set(lines)
    assert lines.index("python line 1") < lines.index("python line 2")
    assert lines.index("native line that matters") < lines.index("after the context")
    assert any(stderr_filter.is_noise(line) for line in lines) == verbose


def test_report_of_a_hugging_face_model_prints_no_tvm_warning(tmp_path):
    """A Hugging Face import makes TVM log hundreds of warnings; the command line hides them."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [_console_script(), "report", "bench:gpt2-infer", "--dims", "s=16", "--rows", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not TVM_LOG_LINE.search(proc.stderr), proc.stderr[-3000:]
    assert "[transformers]" not in proc.stderr
    assert all(line.startswith("... ") for line in proc.stderr.splitlines()), proc.stderr


# ------------------------------------------------------------- sizes beyond available memory
class _Reached(Exception):
    """Raised by the stand-ins of the steps that allocate: the run got past the check."""


def _forbid_allocation(monkeypatch) -> None:
    """Make every step of ``demo`` that compiles or allocates fail the test if reached."""
    import blade_relax.analysis as analysis

    def reached(*_args, **_kwargs):
        raise _Reached("an allocating step was reached")

    monkeypatch.setattr(analysis, "compile_keeping_module", reached)
    monkeypatch.setattr(cli_demo, "_run_once", reached)
    real_load = cli_demo.load_model

    def load_without_arrays(name):
        model = real_load(name)
        model.make_args = reached
        return model

    monkeypatch.setattr(cli_demo, "load_model", load_without_arrays)


def test_demo_refuses_sizes_beyond_available_memory_before_allocating(monkeypatch, capsys):
    _forbid_allocation(monkeypatch)
    monkeypatch.setattr(cli_demo, "available_memory", lambda: 1000)
    code, out, err = _run(["demo", "--model", "mlp", "--sizes", "4,64", "--no-plot"], capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()  # one line: no progress line, no traceback
    match = re.fullmatch(
        r"blade-relax: error: --sizes: s=4 needs a predicted peak of (.+) \(stock TVM's call "
        r"(.+) \+ (.+) of inputs and parameters\), more than the 1,000 B of memory available "
        r"now; refused before compiling or allocating anything \(--force runs it anyway\)",
        line,
    )
    assert match, line
    # The figures are the stock timeline's, the same the table would show as predicted.
    lowered = lower_to_memory_stage(BUILTIN_MODELS["mlp"]())
    at = memory_timeline(lowered["main"], mod=lowered).evaluate({"s": 4})
    assert match.groups() == tuple(
        human_bytes(n) for n in (at.peak + at.persistent, at.peak, at.persistent)
    )


def test_demo_runs_beyond_available_memory_with_force(monkeypatch, capsys):
    _forbid_allocation(monkeypatch)
    monkeypatch.setattr(cli_demo, "available_memory", lambda: 1000)
    with pytest.raises(_Reached):
        cli.main(["demo", "--model", "mlp", "--sizes", "4", "--no-plot", "--force"])
    assert "error" not in capsys.readouterr().err


def test_console_refuses_a_size_no_machine_holds():
    """The newcomer's command: one line and exit 2 instead of numpy's 46.6 TiB traceback."""
    proc = subprocess.run(
        [_console_script(), "demo", "--sizes", "100000000000", "--no-plot"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("blade-relax: error: --sizes: s=100000000000 needs a predicted peak")
    assert "GiB of memory available now" in line and "--force" in line
    assert proc.stdout == ""


def test_train_refuses_sizes_beyond_available_memory_before_building(monkeypatch, capsys):
    from blade_relax.bench import training as training_bench
    from blade_relax.bench import workloads

    def reached(*_args, **_kwargs):
        raise _Reached("the model was built")

    monkeypatch.setattr(training_bench, "compare_training", reached)
    monkeypatch.setattr(workloads, "build_workload", reached)
    monkeypatch.setattr(cli_train, "available_memory", lambda: 1000)
    code, out, err = _run(["train", "--batch", "2", "--no-plot"], capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    floor = memory_floor(
        "llama-train",
        dataclasses.replace(workloads.SMALL, batch=2),
        optimizer="AdamW",
        state_per_param=2,
    )
    assert line == (
        "blade-relax: error: --size small --batch 2: blade_relax's llama-train step at s=256 "
        f"needs at least {human_bytes(floor.total)} ({floor.describe()}), more than the "
        "1,000 B of memory available now; refused before building the model "
        "(--force runs it anyway)"
    )
    with pytest.raises(_Reached):
        cli.main(["train", "--batch", "2", "--no-plot", "--force"])


def test_bench_refuses_sizes_beyond_available_memory_before_building(monkeypatch, capsys):
    from blade_relax.bench import cli as bench_cli
    from blade_relax.bench import workloads

    def reached(*_args, **_kwargs):
        raise _Reached("the workload was built")

    monkeypatch.setattr(workloads, "build_workload", reached)
    monkeypatch.setattr(bench_cli, "available_memory", lambda: 1000)
    argv = ["bench", "--workload", "mlp-train", "--lengths", "8", "--configs", "tvm-dynamic"]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("blade-relax bench: error: --size small: the mlp-train step at s=8 ")
    assert "needs at least" in line and "1,000 B of memory available" in line
    assert "--force" in line
    with pytest.raises(_Reached):
        cli.main([*argv, "--force", "--predict"])


def test_available_memory_is_a_positive_count_here():
    free = available_memory()
    assert free is not None and 0 < free < 2**50


TINY_SIZES = ModelSizes(
    layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=64, max_seq_len=40
)


@pytest.mark.parametrize("workload", ["llama-train", "llama-lora-sft", "gpt2-train", "mlp-train"])
def test_floor_counts_the_parameters_of_the_models_the_workloads_build(workload):
    """The floor is counted without building the model: its counts are the built model's."""
    from blade_relax.bench import workloads

    if workload == "mlp-train":
        params = workloads.mlp_forward_module(TINY_SIZES)["main"].params[2:]
        counts = [int(np.prod([int(v) for v in p.ty.shape.values])) for p in params]
        total = trainable = sum(counts)
    else:
        pytest.importorskip("transformers")
        if workload.startswith("gpt2"):
            model = workloads.gpt2_model(TINY_SIZES)
        else:
            model = workloads.llama_model(TINY_SIZES)
        if workload == "llama-lora-sft":
            pytest.importorskip("peft")
            model = workloads.lora_model(model)
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert parameter_counts(workload, TINY_SIZES) == (total, trainable)


# ------------------------------------------------------------------------ default outputs
def _output_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {
        f"{parser.prog} {action.option_strings[0]}": action.default
        for action in parser._actions
        if action.dest in {"plot", "json", "chrome_trace", "out", "budget_plot"}
    }


def test_default_outputs_go_under_out():
    from blade_relax.bench.cli import build_parser as bench_parser

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    defaults = {}
    for command in ("demo", "report", "train"):
        defaults.update(_output_defaults(subparsers.choices[command]))
    defaults.update(_output_defaults(bench_parser()))
    assert defaults["blade-relax demo --plot"] == "out/demo.png"
    assert defaults["blade-relax train --plot"] == "out/train.png"
    for flag, default in defaults.items():
        assert default is None or str(default).startswith("out/"), flag


@pytest.mark.parametrize("command", ["demo", "train"])
def test_help_names_the_default_output(command, capsys):
    code, out, _ = _run([command, "--help"], capsys)
    assert code == 0
    assert f"out/{command}.png" in " ".join(out.split())


def test_demo_writes_its_default_plot_into_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(["demo", "--model", "mlp", "--sizes", "4"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "demo.png").read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing loose in the cwd
    assert "plot: out/demo.png" in out


# ------------------------------------------------------------------------------ demo plot
def test_demo_curves_top_out_at_the_peaks_their_legends_name(monkeypatch, capsys):
    """The live-bytes curves count kernel scratch as the measured peaks do."""
    seen = []
    monkeypatch.setattr(cli_demo, "write_demo_plot", lambda *args: seen.append(args))
    code, _, err = _run(["demo", "--model", "attention", "--sizes", "8,64"], capsys)
    assert code == 0, err
    ((_, _, _, rows, _),) = seen
    for row in rows:
        assert max(row.result.live_trace) == row.result.peak_bytes, row.pipeline
    # Stock TVM's peak at s=64 falls inside a kernel that holds scratch: a curve without the
    # scratch would top out below the peak.
    lowered = lower_to_memory_stage(attention_block())
    at = memory_timeline(lowered["main"], mod=lowered).evaluate({"s": 64})
    assert at.peak_workspace > 0
    stock = next(r for r in rows if r.size == 64 and r.pipeline == "stock TVM")
    assert stock.result.peak_bytes == at.peak


def _fake_row(size, pipeline, peak, budget=None, reachable=None, trace=None):
    result = cli_demo.RunResult(
        peak_bytes=peak,
        predicted_bytes=peak,
        budget_bytes=budget,
        reachable=reachable,
        live_trace=trace or [0, peak // 2, peak, 0],
    )
    return cli_demo.DemoRow(size, pipeline, result, peak, "identical", True)


def test_demo_plot_marks_unreachable_budgets_and_labels_its_axes():
    import matplotlib.pyplot as plt

    mib = 2**20
    rows = []
    for size, stock, blade, budget_peak, reachable in (
        (16, 1 * mib, mib, mib, False),
        (128, 2 * mib, mib + mib // 4, mib + mib // 4, False),
        (1024, 11 * mib, 6 * mib, 5 * mib, True),
    ):
        rows += [
            _fake_row(size, "stock TVM", stock),
            _fake_row(size, "blade_relax", blade),
            _fake_row(size, "blade_relax @0.9", budget_peak, int(0.9 * blade), reachable),
        ]
    fig = demo_plot.demo_figure("m", "s", rows, 0.9)
    try:
        left, right = fig.axes
        fig.canvas.draw()
        legend = [t.get_text() for t in right.get_legend().get_texts()]
        assert any("unreachable" in t and "no eviction set" in t for t in legend)
        assert any(t.endswith("budget met") for t in legend)
        # Unreachable budget runs are hollow markers, met ones filled.
        hollow = [
            line
            for line in right.get_lines()
            if line.get_marker() == "^" and line.get_markerfacecolor() == "none"
        ]
        (points,) = hollow
        assert list(points.get_xdata()) == [16, 128]
        # Readable axes: the sizes that ran on x, more than two labelled values in MiB on y.
        labels = [t.get_text() for t in right.get_xticklabels() if t.get_text()]
        assert labels == ["16", "128", "1024"]
        low, high = right.get_ylim()
        ticks = [v for v in right.get_yticks() if low <= v <= high]
        assert len(ticks) >= 3
        assert "kernel scratch included" in left.get_ylabel()
        # The legend's peak is the top of its curve.
        for line in left.get_lines()[:3]:
            peak = max(line.get_ydata()) * mib
            assert human_bytes(peak) in line.get_label()
    finally:
        plt.close(fig)


def test_budget_unreachable():
    assert not demo_plot._budget_unreachable(cli_demo.RunResult(peak_bytes=5, predicted_bytes=5))
    assert demo_plot._budget_unreachable(
        cli_demo.RunResult(peak_bytes=5, predicted_bytes=5, budget_bytes=4, reachable=False)
    )
    # Without the runtime's decision, a peak over the budget says it.
    assert demo_plot._budget_unreachable(
        cli_demo.RunResult(peak_bytes=5, predicted_bytes=5, budget_bytes=4)
    )
    assert not demo_plot._budget_unreachable(
        cli_demo.RunResult(peak_bytes=4, predicted_bytes=4, budget_bytes=4)
    )


# ---------------------------------------------------------------------- report lower bound
def test_report_gives_every_version_the_same_lower_bound(tmp_path, capsys):
    """One lower bound per function, read before the passes, and below every version's peak."""
    path = tmp_path / "attention.json"
    code, out, err = _run(["report", "attention", "--dims", "s=256", "--json", path], capsys)
    assert code == 0, err
    reports = [r["summary"] for r in json.loads(path.read_text())["reports"]]
    assert len(reports) == 2
    mod = attention_block()
    bound = memory_timeline(mod["main"], mod=mod, workspaces=False).evaluate({"s": 256})
    expected = bound.persistent + bound.output_bytes
    for summary in reports:
        assert summary["lower_bound_bytes"] == expected
        assert summary["lower_bound_of"] == "main before the passes"
        assert summary["lower_bound_bytes"] <= summary["peak_bytes"] + summary["persistent_bytes"]
    lines = [line for line in out.splitlines() if line.strip().startswith("lower bound:")]
    assert len(lines) == 2 and lines[0] == lines[1]
    assert f"{bound.output_bytes:,} B" in lines[0]

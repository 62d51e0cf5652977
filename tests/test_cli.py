"""The ``blade-relax`` command line: demo, report, bench delegation, help and bad input."""

from __future__ import annotations

import argparse
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

from blade_relax import _quiet, cli
from blade_relax.analysis import compile_keeping_module
from blade_relax.bench import WORKLOADS
from blade_relax.bench.cli import WORKLOAD_NAMES
from blade_relax.frontend.builtin import BUILTIN_MODELS, attention_block, random_arguments
from blade_relax.pipeline import stock_pipeline
from blade_relax.runtime import measure_memory

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
    assert set(cli.BUILTIN_MODEL_NAMES) == set(BUILTIN_MODELS)
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
    assert data["dims"] == {"s": cli.DEFAULT_REPORT_DIM}
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
    assert budget[2].endswith("met") and budget[9] == "identical"
    # Progress lines went to stderr, not into the table: one per run.
    assert "... compiling" in err and "... compiling" not in out
    for step in ("[1/3]: stock TVM", "[2/3]: blade_relax", "[3/3]: blade_relax under a budget"):
        assert f"s=1024 {step}" in err
    assert "warning:" not in err  # 1024 is a size the model was tried at


def test_demo_warns_before_a_size_far_beyond_what_was_tried(capsys):
    size = cli.FAR_BEYOND * cli.TRIED_SIZE + 1
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
    assert f"a peak of {cli._human(predicted)} (stock TVM)" in text


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
    real_run_once = cli._run_once

    def off_by_one(*args, **kwargs):
        result = real_run_once(*args, **kwargs)
        result.peak_bytes += 1
        return result

    monkeypatch.setattr(cli, "_run_once", off_by_one)
    code, out, _ = _run(["demo", "--model", "mlp", "--sizes", "4", "--no-plot"], capsys)
    assert code == 1
    assert "PREDICTION MISSED at s=4, stock TVM" in out
    assert "plot:" not in out


def test_outputs_note():
    a = [np.ones(3, "float32")]
    assert cli._outputs_note(a, [np.ones(3, "float32")]) == ("identical", True)
    assert cli._outputs_note(a, [np.full(3, 1 + 1e-7, "float32")])[1]
    assert cli._outputs_note(a, [np.full(3, 1.1, "float32")]) == ("DIFFER", False)
    assert cli._outputs_note(a, [np.ones(4, "float32")]) == ("DIFFER", False)


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
    assert all(_quiet.is_noise(line) for line in NATIVE_NOISE)
    assert not _quiet.is_noise("[20:31:44] /project/src/x.cc:1: Warning: something else")
    assert not _quiet.is_noise("Traceback (most recent call last):")


_FILTER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from blade_relax._quiet import quiet_stderr
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
    env.pop(_quiet.VERBOSE_ENV, None)
    if verbose:
        env[_quiet.VERBOSE_ENV] = "1"
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
    assert any(_quiet.is_noise(line) for line in lines) == verbose


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

"""The ``blade-relax`` command line: demo, report, bench delegation, help and bad input."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax import cli
from blade_relax.frontend.builtin import attention_block, random_arguments
from blade_relax.pipeline import stock_pipeline
from blade_relax.runtime import memory_stats, reset_memory_stats

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


# ------------------------------------------------------------------------------------ help
def test_console_script_help():
    script = shutil.which("blade-relax") or str(Path(sys.executable).parent / "blade-relax")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "report", "bench"):
        assert command in proc.stdout
    assert proc.stderr == ""


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
    (
        ["demo", "--plot", "/no/such/dir/demo.png"],
        "--plot: the directory /no/such/dir does not exist",
    ),
    (["demo", "--model", "bench:mlp-train", "--sizes", "4096"], "outside bench:mlp-train's range"),
    (["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
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
    (["report", "SCRIPT", "--plot", "/no/such/dir/r.png"], "--plot: the directory"),
    (["report", "SCRIPT", "--json", "/no/such/dir/r.json"], "--json: the directory"),
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
    }
    files["BROKEN"].write_text(BROKEN_SCRIPT)
    files["GARBAGE"].write_text("this is ( not python\n")
    files["EMPTY"].write_text("x = 1\n")
    files["PRIMFUNC"].write_text(PRIMFUNC_SCRIPT)
    if message == "'add' in":
        argv = [*argv, "--function", "add"]
    code, out, err = _run([files.get(a, a) for a in argv], capsys)
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
    exe = tvm.compile(mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], dims)]
    reset_memory_stats()
    base = memory_stats()["live_bytes"]
    out = vm["main"](*args)
    peak = memory_stats()["peak_bytes"] - base
    del out
    return peak


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
    assert re.fullmatch(r"blade_relax( \(main__\w+\))?", blade["summary"]["label"])
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
    plot = tmp_path / "demo.png"
    code, out, err = _run(["demo", "--sizes", "8,1024", "--plot", plot], capsys)
    assert code == 0, out + err
    assert plot.read_bytes()[:8] == PNG_MAGIC
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
    # Progress lines went to stderr, not into the table.
    assert "... compiling" in err and "... compiling" not in out


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

"""The GPU program without a GPU: the plan, the step runner, what travels, and the dry run.

The dry run itself (``bash ci/gpu.sh --dry-run --quick``) runs here at tiny sizes: the import
and the carried graph, a CUDA build from the carried graph (no GPU needed), the collection of
the GPU tests, the size check and the plan, so that the program cannot rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blade_relax.gpuprog import plan, program
from blade_relax.gpuprog.carried import merge_build_seconds, travel_bytes
from blade_relax.gpuprog.plan import (
    BENCH_CONFIGS,
    PLAN_LIMIT_S,
    TVM_BUILDS,
    Costs,
    ProgramOptions,
    Step,
    bench_estimate,
    format_plan,
    program_steps,
)

ROOT = Path(__file__).resolve().parents[2]


def _options(tmp_path: Path, **kw) -> ProgramOptions:
    return ProgramOptions(root=ROOT, carried=tmp_path / "carried", out=tmp_path / "out", **kw)


def test_the_plan_fits_one_command(tmp_path):
    steps = program_steps(_options(tmp_path))
    names = [s.name for s in steps]
    # The foreground steps that need no build run while the benchmarks compile.
    assert names == [
        "preflight",
        "gemm",
        "gpu-tests",
        "tutorial-5",
        "bench-llama-train",
        "cuda-graphs",
        "bench-gpt2-train",
    ]
    total = plan.plan_seconds(steps)
    assert total <= PLAN_LIMIT_S
    # The GEMM, benchmark and CUDA-graph steps compile in the background: the program takes less
    # than its steps' sum.
    assert [s.name for s in steps if s.background] == [
        "gemm",
        "bench-llama-train",
        "cuda-graphs",
        "bench-gpt2-train",
    ]
    assert total < sum(s.estimate_s for s in steps)
    assert all(s.estimate_s > 0 and s.budget_s >= s.estimate_s + 30 for s in steps)
    bench = steps[4]
    assert bench.command[bench.command.index("--out") + 1].endswith("bench-llama-train.json")
    text = format_plan(steps)
    assert "fits" in text and "DOES NOT FIT" not in text
    assert "DOES NOT FIT" in format_plan(steps, limit_s=10)


def test_measured_compile_times_replace_the_default(tmp_path):
    costs = Costs()
    lengths = [16, 64, 256]
    prep, gpu, detail = bench_estimate(costs, lengths)
    measured = dict.fromkeys(TVM_BUILDS, 300.0)
    slow_prep, slow_gpu, measured_detail = bench_estimate(costs, lengths, measured)
    expected = len(TVM_BUILDS) * (300.0 / costs.host_speedup - costs.tvm_compile_s)
    assert slow_prep - prep == pytest.approx(expected) and slow_gpu == gpu
    slower = slow_prep + slow_gpu
    assert "not measured" in detail and "measured by the dry run" in measured_detail
    # The plan reads the manifest the dry run wrote.
    options = _options(tmp_path)
    options.carried.mkdir()
    (options.carried / plan.MANIFEST).write_text(
        json.dumps(
            {
                "size": "real",
                "lengths": {"llama-train": lengths},
                "compile_s": {"llama-train": measured},
            }
        )  # fmt: skip
    )
    steps = {s.name: s for s in program_steps(options)}
    # The Llama step also runs the offloading configurations (more rows, the same builds) and
    # the default pipeline without GEMMs on cuBLAS (a build, estimated as blade-relax's).
    configs = plan.bench_configs("llama-train")
    assert (
        set(plan.EVICTION_CONFIGS) | set(plan.GEMM_CONFIGS) <= set(configs)
        and configs[: len(BENCH_CONFIGS)] == BENCH_CONFIGS
    )
    with_modes = sum(bench_estimate(costs, lengths, measured, configs)[:2])
    rows = len(lengths) * (len(plan.EVICTION_CONFIGS) + len(plan.GEMM_CONFIGS))
    extra = rows * costs.steps_per_row * costs.step_s + costs.eviction_s
    builds = len(plan.GEMM_CONFIGS) * 300.0 / costs.host_speedup
    assert with_modes == pytest.approx(slower + extra + builds)
    assert steps["bench-llama-train"].estimate_s == pytest.approx(with_modes)
    command = steps["bench-llama-train"].command
    assert command[command.index("--configs") + 1] == ",".join(configs)
    assert plan.bench_configs("gpt2-train") == BENCH_CONFIGS
    assert f"s in {lengths}" in steps["bench-llama-train"].summary
    assert len(BENCH_CONFIGS) == 5


def test_the_cuda_graph_step_reads_its_measured_builds(tmp_path):
    costs = Costs()
    prep, gpu, detail = plan.cuda_graph_estimate(costs)
    assert prep == costs.start_s + costs.model_s + 2 * costs.cuda_graph_compile_s
    assert gpu == costs.cuda_graph_gpu_s and "not measured" in detail
    measured = {"graphs": 30.0, "plain": 15.0}
    prep, _, detail = plan.cuda_graph_estimate(costs, measured)
    assert prep == costs.start_s + costs.model_s + 45.0 / costs.host_speedup
    options = _options(tmp_path, size="tiny")
    options.carried.mkdir()
    (options.carried / plan.MANIFEST).write_text(
        json.dumps({"cuda_graphs": {"compile_s": {plan.CUDA_GRAPH_WORKLOAD: measured}}})
    )
    step = {s.name: s for s in program_steps(options)}["cuda-graphs"]
    assert step.estimate_s == pytest.approx(prep + gpu) and step.gpu_s == gpu
    # At tiny sizes (lengths up to 64) the buckets and lengths stop at the bound.
    assert "s in [9, 16, 40], buckets [16, 32, 64]" in step.summary
    assert step.command[step.command.index("--out") + 1].endswith("cuda-graphs.json")
    assert plan.cuda_graph_buckets(8) == (8,) and plan.cuda_graph_lengths(4) == [4]
    assert plan.carried_workloads(("llama-train",)) == ("llama-train", plan.CUDA_GRAPH_WORKLOAD)


def test_a_partial_dry_run_keeps_earlier_build_seconds():
    manifest = {"compile_s": {"llama-train": {"tvm-dynamic": 24.0, "blade-relax": 56.0}}}
    merge_build_seconds(manifest, {"llama-train": {"tvm-dynamic": 14.0}}, with_kernels=False)
    assert manifest["compile_s"]["llama-train"] == {"tvm-dynamic": 24.0, "blade-relax": 56.0}
    merge_build_seconds(manifest, {"llama-train": {"tvm-dynamic": 20.0}}, with_kernels=True)
    merge_build_seconds(manifest, {"gpt2-train": {"tvm-dynamic": 9.0}}, with_kernels=False)
    assert manifest["compile_s"] == {
        "llama-train": {"tvm-dynamic": 20.0, "blade-relax": 56.0},
        "gpt2-train": {"tvm-dynamic": 9.0},
    }


def _step(name: str, kind: str, code: str, budget: float = 60.0) -> Step:
    return Step(name, f"runs {name}", kind, [sys.executable, "-c", code], 1.0, budget)


def test_plan_seconds_overlap_background_preparation():
    steps = [
        Step("first", "", "pytest", [], 50.0, 60.0),
        Step("bench", "", "bench", [], 100.0, 60.0, background=True, gpu_s=30.0),
        Step("last", "", "pytest", [], 10.0, 60.0),
    ]
    # The bench prepares for 70 s from the start: the GPU waits for it after "first" (50 s).
    assert plan.plan_seconds(steps) == 70.0 + 30.0 + 10.0
    steps[0] = Step("first", "", "pytest", [], 90.0, 60.0)
    assert plan.plan_seconds(steps) == 90.0 + 30.0 + 10.0


def test_a_background_step_measures_only_when_the_program_lets_go_of_the_gpu(tmp_path, monkeypatch):
    takes_gpu = (
        "import fcntl, os, time; t = time.monotonic(); print('prepared', flush=True);"
        f"f = open(os.environ['{plan.LOCK_ENV}'], 'a'); fcntl.flock(f, fcntl.LOCK_EX);"
        "print(f'gpu after {time.monotonic() - t:.1f} s', flush=True)"
    )
    steps = [
        _step("holds-gpu", "pytest", "import time; time.sleep(2); print('1 passed')"),
        Step("bg", "", "pytest", [sys.executable, "-c", takes_gpu], 1.0, 60.0, background=True),
    ]
    monkeypatch.setattr(program, "program_steps", lambda _options: steps)
    options = _options(tmp_path)
    summary = program.run_program(options, say=lambda _m: None)
    assert [s["status"] for s in summary["steps"]] == ["ok", "ok"]
    log = (options.out / program.LOG).read_text()
    assert "[bg] prepared" in log
    waited = float(log.split("[bg] gpu after ")[1].split()[0])
    assert waited >= 1.5  # it prepared at once, and measured after the foreground step


def test_background_steps_measure_in_the_programs_order(tmp_path, monkeypatch):
    """The second background step finishes compiling first, yet measures after the first."""

    def measures(name: str, prepare_s: float) -> str:
        return (
            f"import fcntl, os, time; time.sleep({prepare_s});"
            f"f = open(os.environ['{plan.LOCK_ENV}'], 'a'); fcntl.flock(f, fcntl.LOCK_EX);"
            f"print('measuring {name}', time.time(), flush=True); time.sleep(0.5)"
        )

    steps = [
        _step("holds-gpu", "pytest", "print('1 passed')"),
        Step("slow", "", "pytest", [sys.executable, "-c", measures("slow", 2.0)], 1.0, 60.0,
             background=True),
        Step("quick", "", "pytest", [sys.executable, "-c", measures("quick", 0.0)], 1.0, 60.0,
             background=True),
    ]  # fmt: skip
    monkeypatch.setattr(program, "program_steps", lambda _options: steps)
    options = _options(tmp_path)
    summary = program.run_program(options, say=lambda _m: None)
    assert [s["status"] for s in summary["steps"]] == ["ok", "ok", "ok"]
    log = (options.out / program.LOG).read_text()
    at = {name: float(log.split(f"measuring {name} ")[1].split()[0]) for name in ("slow", "quick")}
    assert at["quick"] >= at["slow"] + 0.5


def test_only_runs_the_named_steps_in_the_order_given(tmp_path, monkeypatch):
    steps = [_step(name, "pytest", f"print('{name}')") for name in ("a", "b", "c")]
    monkeypatch.setattr(program, "program_steps", lambda _options: steps)
    summary = program.run_program(_options(tmp_path), only=["c", "a"], say=lambda _m: None)
    assert [s["name"] for s in summary["steps"]] == ["c", "a"]
    with pytest.raises(ValueError, match="no step named d"):
        program.run_program(_options(tmp_path), only=["d"], say=lambda _m: None)


def test_steps_fail_time_out_and_are_skipped_independently(tmp_path, monkeypatch):
    summary_path = "os.path.join(os.environ['OUT'], 'gpu-summary.json')"
    steps = [
        _step("counts", "pytest", "print('3 passed, 1 skipped in 0.1s')"),
        _step(
            "sees-itself-running",
            "pytest",
            f"import json, os; s = json.load(open({summary_path}));"
            "print('statuses', [x['status'] for x in s['steps']]); raise SystemExit(3)",
        ),
        _step("hangs", "pytest", "import time; time.sleep(60)", budget=1.0),
        _step("too-late", "pytest", "print('never')"),
    ]
    monkeypatch.setattr(program, "program_steps", lambda _options: steps)
    options = _options(tmp_path, deadline_s=25.0)
    summary = program.run_program(options, say=lambda _m: None)
    by_name = {s["name"]: s for s in summary["steps"]}
    assert by_name["counts"]["status"] == "ok"
    assert by_name["counts"]["data"]["counts"] == {"passed": 3, "skipped": 1}
    assert by_name["sees-itself-running"]["status"] == "failed"
    assert by_name["sees-itself-running"]["returncode"] == 3
    assert by_name["hangs"]["status"] == "timeout" and by_name["hangs"]["returncode"] is None
    assert by_name["hangs"]["seconds"] < 30
    # The deadline leaves less than MIN_STEP_S for the last step only when the others took
    # long; here it runs, and a tighter deadline skips everything.
    assert by_name["too-late"]["status"] == "ok"
    out = options.out
    log = (out / program.LOG).read_text()
    # While a step runs, the summary on disk already names it as running.
    assert "statuses ['ok', 'running', 'pending', 'pending']" in log
    assert "=== hangs" in log
    saved = json.loads((out / program.SUMMARY).read_text())
    assert saved["complete"] and [s["status"] for s in saved["steps"]] == [
        "ok", "failed", "timeout", "ok"
    ]  # fmt: skip
    assert len(saved["out_files"]) <= program.MAX_OUT_FILES
    results = (out / program.RESULTS).read_text()
    assert "| hangs | timeout |" in results and "| counts | ok |" in results

    skipped = program.run_program(
        _options(tmp_path / "late", deadline_s=program.MIN_STEP_S - 1), say=lambda _m: None
    )
    assert {s["status"] for s in skipped["steps"]} == {"skipped"}


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_what_travels_counts_tracked_untracked_carried_and_kit(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("/.gpukit/\n/.gpuprog/\nignored.bin\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    _git(tmp_path, "add", ".gitignore", "tracked.txt")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / "ignored.bin").write_bytes(b"z" * 5000)
    (tmp_path / ".gpuprog").mkdir()
    (tmp_path / ".gpuprog" / "g.npz").write_bytes(b"c" * 200)
    sizes = travel_bytes(tmp_path, tmp_path / ".gpuprog")
    gitignore = len("/.gpukit/\n/.gpuprog/\nignored.bin\n")
    assert sizes["tracked"] == 1000 + gitignore
    assert sizes["untracked"] == 300
    assert sizes["carried"] == 200 and sizes["kit"] is None
    (tmp_path / ".gpukit").mkdir()
    (tmp_path / ".gpukit" / "site.tar.xz").write_bytes(b"k" * 7000)
    sizes = travel_bytes(tmp_path, tmp_path / ".gpuprog")
    assert sizes["kit"] == 7000
    assert sizes["total"] == 1000 + gitignore + 300 + 200 + 7000


@pytest.mark.slow
def test_dry_run_at_tiny_sizes(tmp_path):
    """The dry run's every stage, at its cheapest (about a minute on 2 cores)."""
    pytest.importorskip("transformers")
    carried = tmp_path / "carried"
    env = dict(os.environ, BLADE_RELAX_PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "ci/gpu.sh", "--dry-run", "--size", "tiny", "--quick", "--carried", str(carried)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "dry run: passed" in output
    assert "[ok] GPU tests collect" in output and "[ok] plan" in output
    manifest = json.loads((carried / plan.MANIFEST).read_text())
    assert manifest["size"] == "tiny"
    assert manifest["compile_s"]["llama-train"]["tvm-dynamic"] > 0
    assert manifest["imported_with"]["torch"] != "missing"
    from blade_relax.frontend.carry import load_graph

    graph = load_graph(carried / "llama-train.npz")
    assert graph.kind == "training" and graph.output_names[0] == "loss"
    assert graph.info["sizes"]["hidden"] == plan.SIZES["tiny"]["hidden"]
    # The CUDA-graph step's executable was built for sm_90, its pool that of its largest bucket.
    graphs = manifest["cuda_graphs"]
    assert graphs["compile_s"][plan.CUDA_GRAPH_WORKLOAD]["graphs"] > 0
    assert graphs["buckets"] == [16, 32, 64]
    assert graphs["allocated_bytes"] == graphs["pool_bytes"] == graphs["largest_bytes"] > 0
    assert graphs["unshared_bytes"] > graphs["pool_bytes"]
    assert load_graph(carried / "gpt2-infer.npz").kind == "inference"

    # The CUDA-graph step as the GPU machine runs it, on the CPU (nothing captured there).
    graph_out = tmp_path / "out" / "cuda-graphs.json"
    step_run = subprocess.run(
        [sys.executable, "-m", "blade_relax.gpuprog", "cuda-graphs", "--carried", str(carried),
         "--out", str(graph_out), "--target", "llvm", "--repeat", "2"],
        cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT / "python")), capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert step_run.returncode == 0, (step_run.stdout + step_run.stderr)[-4000:]
    step = Step("cuda-graphs", "", "cuda-graphs", ["x", "--out", str(graph_out)], 1.0, 1.0)
    detail, data = program._read_cuda_graphs(graph_out.parent, step_run.stdout, step)
    assert detail.startswith("6 of 6 rows correct against torch")
    assert "| 40 | 64 |" in data["table"] and data["pool"]["excess_bytes"] >= 0
    assert not graph_out.with_suffix(".md").exists()

    # The benchmark step as the GPU machine runs it, on the CPU: the carried graph with a
    # model built again, measured against torch, read back by the program.
    out = tmp_path / "out" / "bench-llama-train.json"
    bench = subprocess.run(
        [sys.executable, "-m", "blade_relax.gpuprog", "bench", "--carried", str(carried),
         "--workload", "llama-train", "--out", str(out), "--target", "llvm",
         "--configs", "tvm-dynamic,torch-eager", "--lengths", "9", "--repeat", "1"],
        cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT / "python")), capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert bench.returncode == 0, (bench.stdout + bench.stderr)[-4000:]
    # The GEMM step as the GPU machine runs it, on the CPU: TVM's GEMMs against torch's.
    gemm_out = tmp_path / "out" / "gemm.json"
    gemm = subprocess.run(
        [sys.executable, "-m", "blade_relax.gpuprog", "gemm", "--carried", str(carried),
         "--out", str(gemm_out), "--target", "llvm", "--calls", "2", "--repeat", "1"],
        cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT / "python")), capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert gemm.returncode == 0, (gemm.stdout + gemm.stderr)[-4000:]
    doc = json.loads(gemm_out.read_text())
    # Tiny: the LM head is attn_q_o's shape. Two token counts, three passes each.
    assert doc["all_correct"] and len(doc["rows"]) == 2 * 4 * 3
    assert {r["layout"] for r in doc["rows"]} == {"NT", "NN", "TN"}
    step = Step("bench-llama-train", "", "bench", ["x", "--out", str(out)], 1.0, 1.0)
    detail, data = program._read_bench(out.parent, bench.stdout, step)
    assert detail.startswith("2 of 2 rows correct against torch")
    assert data["all_correct"] is True and "| 9 | tvm-dynamic |" in data["table"]
    assert not out.with_suffix(".md").exists()  # folded into the summary: $OUT stays small


def test_shared_builds_compile_a_budget_variant_once():
    from blade_relax.bench import build_workload
    from blade_relax.bench.runner import run_benchmark
    from blade_relax.bench.workloads import ModelSizes

    workload = build_workload("mlp-train", ModelSizes(layers=2, hidden=16, intermediate=32))
    remat = "blade-relax-schedule-remat"
    result = run_benchmark(workload, [remat, f"{remat}@0.5"], [24], repeat=1, builds={})
    rows = {m.config: m for m in result.measurements}
    assert result.all_correct
    assert rows[remat].compile_time_s > 0 and rows[remat].compilations == 1
    budgeted = rows[f"{remat}@0.5"]
    assert budgeted.compile_time_s == 0 and budgeted.compilations == 0
    assert budgeted.evictions > 0


def test_the_benchmark_reports_each_row_as_it_is_measured():
    """A benchmark step killed at its time limit keeps the rows it measured: the runner hands
    the result so far to ``on_row`` after every row."""
    from blade_relax.bench import build_workload
    from blade_relax.bench.runner import run_benchmark
    from blade_relax.bench.workloads import ModelSizes

    workload = build_workload("mlp-train", ModelSizes(layers=1, hidden=16, intermediate=32))
    seen: list[list[tuple[str, int]]] = []
    result = run_benchmark(
        workload,
        ["tvm-dynamic", "torch-eager"],
        [12, 24],
        repeat=1,
        on_row=lambda partial: seen.append([(m.config, m.seq_len) for m in partial.measurements]),
    )
    assert result.all_correct
    assert seen == [
        [("tvm-dynamic", 12)],
        [("tvm-dynamic", 12), ("tvm-dynamic", 24)],
        [("tvm-dynamic", 12), ("tvm-dynamic", 24), ("torch-eager", 12)],
        [("tvm-dynamic", 12), ("tvm-dynamic", 24), ("torch-eager", 12), ("torch-eager", 24)],
    ]


def test_the_gemm_step_shapes_and_table(tmp_path):
    from blade_relax.gpuprog.gemm import GemmShape, llama_gemms, markdown

    sizes = dict(hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=32000)
    shapes = llama_gemms(sizes)
    assert [(s.name, s.k, s.n) for s in shapes] == [
        ("attn_q_o", 1024, 1024),
        ("attn_k_v", 1024, 512),
        ("mlp_gate_up", 1024, 2816),
        ("mlp_down", 2816, 1024),
        ("lm_head", 1024, 32000),
    ]
    # A shape that repeats another (vocabulary = hidden) is measured once.
    assert len(llama_gemms(dict(sizes, vocab=1024))) == 4
    row = {**GemmShape("attn_q_o", "q_proj, o_proj", 8, 4).__dict__, "pass": "dw",
           "computes": "dy.T @ x", "layout": "TN", "m": 2, "tvm_ms": 2.0, "cublas_ms": 1.0,
           "tvm_tflops": 1.0, "torch_tflops": 2.0, "tvm_over_torch": 2.0, "rel_error": 1e-7,
           "correct": True}  # fmt: skip
    doc = {"library": "cuBLAS", "rows": [row], "all_correct": True}
    table = markdown(doc)
    assert (
        "| attn_q_o (q_proj, o_proj) | dy.T @ x (TN) | 2 x 8 x 4 | 2.0 | 1.0 | 1.0 | 2.0 | 2.0x "
        "| 1.0e-07 |" in table
    )
    out = tmp_path / "gemm.json"
    out.write_text(json.dumps(doc))
    out.with_suffix(".md").write_text(table)
    step = Step("gemm", "", "gemm", ["x", "--out", str(out)], 1.0, 1.0)
    detail, data = program._read_gemm(tmp_path, "", step)
    assert detail == "1 of 1 GEMMs correct against torch; TVM's time / cuBLAS's: 2.00x to 2.00x"
    assert data["table"] == table and not out.with_suffix(".md").exists()


def test_the_gemm_step_times_tvm_kernels_not_aten():
    """The default pipeline would dispatch the GEMMs to ATen: the step's side of TVM must
    keep TVM's kernels (cuBLAS against cuBLAS would measure nothing)."""
    import tvm

    from blade_relax.gpuprog.gemm import compile_tvm_gemms, llama_gemms

    shapes = llama_gemms(dict(hidden=16, heads=2, kv_heads=1, intermediate=32, vocab=64))
    text = compile_tvm_gemms(shapes, tvm.target.Target("llvm")).as_text()
    assert "blade_relax.gemm" not in text and "matmul" in text


def test_the_eviction_modes_run_the_budgeted_build():
    """The offloading configurations of the Llama step, on a small workload: the same build,
    the same outputs, host copies where they offload, and their rows in the budget table."""
    from blade_relax.bench import build_workload
    from blade_relax.bench.report import budget_table
    from blade_relax.bench.runner import run_benchmark
    from blade_relax.bench.workloads import ModelSizes

    workload = build_workload("mlp-train", ModelSizes(layers=2, hidden=16, intermediate=32))
    remat = "blade-relax-schedule-remat"
    names = [f"{remat}@0.5", f"{remat}@0.5:offload", f"{remat}@0.5:auto"]
    result = run_benchmark(workload, [remat, *names], [24], repeat=1, builds={})
    rows = {m.config: m for m in result.measurements}
    assert result.all_correct
    assert all(rows[n].compilations == 0 and rows[n].evictions > 0 for n in names)
    assert rows[names[0]].offloads == 0 and rows[names[0]].regenerations > 0
    offload = rows[names[1]]
    assert offload.offloads == offload.evictions and offload.regenerations == 0
    assert offload.peak_host_bytes > 0
    assert offload.step_peak_bytes <= rows[remat].step_peak_bytes
    settings = {c.name: c.settings for c in result.configs}
    assert settings[names[2]]["eviction"] == "auto"
    table = budget_table(result)
    assert all(f"| {n} |" in table for n in names)


def test_the_docs_show_the_programs_commands_and_steps(tmp_path):
    """The README points to docs/gpu, whose first section gives the commands and the steps."""
    import re
    import shlex

    from blade_relax.gpuprog.__main__ import _parser

    assert "docs/gpu/README.md#how-the-program-runs" in (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "gpu" / "README.md").read_text()
    start = text.index("\n## How the program runs\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while "&&" in words:
                cut = words.index("&&")
                commands.append(words[:cut])
                words = words[cut + 1 :]
            commands.append(words)
    programs = [c for c in commands if c[:2] == ["bash", "ci/gpu.sh"]]
    assert {"--dry-run", "--plan"} <= {w for c in programs for w in c}
    for command in programs:
        _parser().parse_args(command[2:])  # exits on an unknown flag
    assert ["bash", "../shared/gpu/make-kit.sh"] in commands
    assert [".", ".gpukit/device-setup.sh"] in commands
    for step in program_steps(_options(tmp_path)):
        assert f"`{step.name}`" in section, step.name


def test_the_steps_outputs_are_read(tmp_path):
    (tmp_path / "preflight.json").write_text(
        json.dumps({"steps": [{"step": "environment", "ok": True}, {"step": "torch", "ok": False}]})
    )
    detail, data = program._read_preflight(tmp_path, "")
    assert detail == "1 of 2 checks ok; failed: torch" and len(data["steps"]) == 2
    assert program._read_preflight(tmp_path / "none", "")[0] == "no preflight.json written"

    tutorial = (
        "   16 stock TVM             1.20    1.000     0     0     0.50  1.0e-07\n"
        "   16 blade_relax @0.6      0.80    0.667     3     3     0.70  1.0e-07\n"
        "s=256: counted peak 3.50 MiB, driver 4.00 MiB over 120 readings; agree: True\n"
    )
    detail, data = program._read_tutorial(tmp_path, tutorial)
    assert detail.endswith("agree: True") and len(data["table"]) == 2

    output = "FAILED tests/a.py::test_x - boom\nERROR tests/b.py::test_y\n1 failed, 2 passed, 1 error in 3s"
    detail, data = program._read_pytest(tmp_path, output)
    assert data["counts"] == {"failed": 1, "passed": 2, "error": 1}
    assert data["failures"] == ["tests/a.py::test_x", "tests/b.py::test_y"]

"""``python -m blade_relax.gpuprog``: the GPU program (``ci/gpu.sh`` calls it).

``--plan`` prints the steps and their estimates; ``--dry-run`` prepares and checks everything
on a machine without a GPU; no flag runs the program (on the GPU machine). ``bench`` is one
benchmark step, ``cuda-graphs`` the CUDA-graph step (:mod:`.cuda_graphs`) and ``gemm`` the
GEMM step (:mod:`.gemm`); the program runs them as subprocesses.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .plan import (
    BENCH_CONFIGS,
    CUDA_GRAPH_MODES,
    GPU_TESTS_LEFT_OUT,
    LOCK_ENV,
    PLAN_LIMIT_S,
    SIZES,
    TVM_BUILDS,
    WORKLOADS,
    ProgramOptions,
    carried_workloads,
    environment_python,
    format_plan,
    gpu_test_files,
    plan_seconds,
    program_steps,
    read_manifest,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash ci/gpu.sh",
        description="The GPU program: --plan prints it, --dry-run prepares and checks it "
        "without a GPU, no flag runs it on the GPU machine.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the steps and estimates")
    mode.add_argument("--dry-run", action="store_true", help="everything but running on a GPU")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="model sizes (default: the "
        "prepared manifest's, else real); tiny is for checking the program itself",
    )
    parser.add_argument("--carried", default=".gpuprog", help="carried graphs (.gpuprog)")
    parser.add_argument("--out", default=None, help="results folder (default: $OUT, else gpu-out)")
    parser.add_argument("--only", default=None, help="comma-separated step names to run")
    parser.add_argument(
        "--deadline", type=float, default=560.0, help="seconds the run may take (560)"
    )
    parser.add_argument(
        "--no-cubin", action="store_true", help="dry run: skip compiling kernels to cubins"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="dry run: keep carried graphs of the same size"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="dry run at its cheapest, to check the program itself (CI): the first workload "
        "only, its stock build only, no cubins",
    )
    return parser


def _options(args: argparse.Namespace, root: Path) -> ProgramOptions:
    carried = (root / args.carried).resolve()
    manifest = read_manifest(carried) or {}
    size = args.size or manifest.get("size") or "real"
    out = Path(args.out or os.environ.get("OUT") or root / "gpu-out").resolve()
    return ProgramOptions(
        root=root,
        carried=carried,
        out=out,
        size=size,
        python=environment_python(),
        deadline_s=args.deadline,
        workloads=WORKLOADS[:1] if args.quick else WORKLOADS,
    )


def _say(message: str) -> None:
    print(message, flush=True)


def _check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    _say(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}")
    if not ok:
        failures.append(name)


def _collect_gpu_tests(options: ProgramOptions) -> tuple[bool, str]:
    files = gpu_test_files(options.root)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(options.root / "python"), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        [options.python, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
         "-k", GPU_TESTS_LEFT_OUT, "-p", "no:cacheprovider", *files],
        cwd=options.root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or [proc.stderr[-300:]]
    return proc.returncode == 0, f"{last[0]} ({len(files)} files)"


def dry_run(
    options: ProgramOptions, *, reuse: bool, cubin: bool, builds: tuple[str, ...] = TVM_BUILDS
) -> int:
    """Prepare and check the program without a GPU; 0 when every check passed."""
    from .carried import CARRY_LIMIT, build_executables, carried_path, prepare, travel_bytes

    failures: list[str] = []
    start = time.perf_counter()
    manifest = read_manifest(options.carried)
    complete = all(
        carried_path(options.carried, w).is_file() for w in carried_workloads(options.workloads)
    )
    if reuse and manifest and manifest.get("size") == options.size and complete:
        _say(f"reusing the carried graphs in {options.carried} ({options.size})")
    else:
        prepare(options, say=_say)
    modes = CUDA_GRAPH_MODES if builds == TVM_BUILDS else CUDA_GRAPH_MODES[:1]
    report = build_executables(
        options, cubin=cubin, builds=builds, cuda_graph_modes=modes, say=_say
    )
    _check(
        "CUDA builds",
        True,
        f"{sum(len(v) for v in report['compile_s'].values())} benchmark and "
        f"{len(report['cuda_graphs']['compile_s'])} CUDA-graph executable(s) for sm_90; kernels "
        + (f"compiled to {len(report['cubin'])} cubins" if report["cubin"] else
           f"not compiled to cubins ({report['compiler']})"),
        failures,
    )  # fmt: skip
    ok, detail = _collect_gpu_tests(options)
    _check("GPU tests collect", ok, detail, failures)
    tutorial = options.root / "tutorials" / "05_gpu.py"
    compile(tutorial.read_text(), str(tutorial), "exec")
    _check("tutorial 5 parses", True, str(tutorial.relative_to(options.root)), failures)
    sizes = travel_bytes(options.root, options.carried)
    mib = 1 << 20
    parts = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in sizes.items() if v is not None)
    if sizes["kit"] is None:
        _check("what travels", True, f"{parts}; no .gpukit here (make-kit.sh builds it)", failures)
    else:
        fits = sizes["total"] < CARRY_LIMIT
        _check("what travels", fits, f"{parts} (limit {CARRY_LIMIT / mib:.0f} MiB)", failures)
        preflight = (options.root / ".gpukit" / "preflight.py").is_file()
        _check("kit preflight", preflight, ".gpukit/preflight.py", failures)
    steps = program_steps(options)
    total = plan_seconds(steps)
    _say("\n" + format_plan(steps))
    _check("plan", total <= PLAN_LIMIT_S, f"{total:.0f} s of {PLAN_LIMIT_S:.0f} s", failures)
    _say(
        f"dry run: {'passed' if not failures else 'FAILED: ' + ', '.join(failures)} "
        f"in {time.perf_counter() - start:.0f} s"
    )
    return 1 if failures else 0


def _bench_target(name: str) -> tuple[dict[str, str], str]:
    """``"cuda"``: the GPU's own architecture and name (``SystemExit`` without a GPU);
    anything else is a TVM target kind run on the CPU (to check the step without a GPU)."""
    import tvm

    if name != "cuda":
        return {"kind": name}, "the CPU"
    dev = tvm.cuda(0)
    if not dev.exist:
        raise SystemExit("no CUDA device (tvm.cuda(0).exist is False)")
    major, minor = dev.compute_version.split(".")
    arch = f"sm_{major}{minor}"
    return {"kind": "cuda", "arch": arch}, f"{dev.device_name} ({arch})"


def _prebuild(workload, configs: list[str], target: dict, say) -> tuple[dict, dict[str, float]]:
    """Compile the TVM configurations' executables before the GPU is taken: the ``builds``
    of :func:`~blade_relax.bench.runner.run_benchmark`, and each build's seconds by the first
    configuration that uses it."""
    import tvm

    from blade_relax.analysis.workspace import compile_keeping_module
    from blade_relax.bench.configs import TvmConfig, get_config
    from blade_relax.runtime.devices import configure_cuda_compiler

    if target["kind"] == "cuda":
        configure_cuda_compiler()
    tgt = tvm.target.Target(target)
    builds: dict = {}
    seconds: dict[str, float] = {}
    for name in configs:
        config = get_config(name)
        if not isinstance(config, TvmConfig) or config.static or config.bucket is not None:
            continue
        key = (config.pipeline, config.keep_bounds)
        if key in builds:
            continue
        start = time.perf_counter()
        variant = workload.graph.with_upper_bounds(config.keep_bounds)
        compiled = compile_keeping_module(variant.mod, tgt, config.pipeline(tgt))
        builds[key] = (compiled.executable, compiled.workspaces)
        seconds[name] = time.perf_counter() - start
        say(f"{workload.name}: built {name} in {seconds[name]:.1f} s")
    return builds, seconds


@contextlib.contextmanager
def gpu_lock(path: str | None) -> Iterator[None]:
    """Hold the program's GPU lock (``flock`` on ``path``) while measuring; none when
    ``path`` is ``None`` (a step run alone)."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bench(argv: Sequence[str]) -> int:
    """One benchmark step from a carried graph (``bench --workload W ...``); 0 when every
    row matched torch."""
    parser = argparse.ArgumentParser(prog="python -m blade_relax.gpuprog bench")
    parser.add_argument("--carried", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=5e-4)
    parser.add_argument("--target", default="cuda", help="cuda (the GPU's arch) or llvm")
    parser.add_argument("--configs", default=",".join(BENCH_CONFIGS))
    parser.add_argument("--lengths", default=None, help="default: the manifest's")
    args = parser.parse_args(list(argv))

    from blade_relax import quiet
    from blade_relax.bench.report import budget_table, markdown_table, write_json
    from blade_relax.bench.runner import run_benchmark

    from .carried import carried_workload

    quiet()
    target, where = _bench_target(args.target)
    carried = Path(args.carried)
    if args.lengths:
        lengths = [int(n) for n in args.lengths.split(",")]
    else:
        lengths = (read_manifest(carried) or {})["lengths"][args.workload]
    start = time.perf_counter()
    workload = carried_workload(carried, args.workload)
    _say(f"{args.workload}: carried graph and model ready in {time.perf_counter() - start:.1f} s")
    configs = args.configs.split(",")
    builds, compile_s = _prebuild(workload, configs, target, _say)
    lock = os.environ.get(LOCK_ENV)
    waited = time.perf_counter()
    with gpu_lock(lock):
        if lock:
            _say(f"{args.workload}: GPU taken after {time.perf_counter() - waited:.1f} s")
        result = run_benchmark(
            workload,
            configs,
            lengths,
            target=target,
            repeat=args.repeat,
            tolerance=args.tolerance,
            trace={"kind": "explicit", "lengths": lengths},
            progress=_say,
            builds=builds,
            on_row=lambda partial: write_json(partial, args.out),
        )
    # The builds ran before the GPU was taken: their seconds go to the configuration that
    # made each, at its first length, as the runner would have counted them.
    for summary in result.configs:
        if summary.name in compile_s:
            summary.compile_time_s = compile_s[summary.name]
            summary.compilations = 1
            first = next(m for m in result.measurements if m.config == summary.name)
            first.compile_time_s = compile_s[summary.name]
            first.compilations = 1
    write_json(result, args.out)
    table = f"{args.workload} on {where}\n\n{markdown_table(result)}"
    sweep = budget_table(result)
    if sweep:
        table += "\n\nPeak and step time against the budget:\n\n" + sweep
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    _say(table)
    return 0 if result.all_correct else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["cuda-graphs"]:
        from .cuda_graphs import main as cuda_graphs

        return cuda_graphs(argv[1:])
    if argv[:1] == ["gemm"]:
        from .gemm import main as gemm

        return gemm(argv[1:])
    args = _parser().parse_args(argv)
    root = Path.cwd()
    options = _options(args, root)
    if args.plan:
        _say(format_plan(program_steps(options)))
        return 0
    from blade_relax import quiet

    quiet()
    if args.dry_run:
        return dry_run(
            options,
            reuse=args.reuse,
            cubin=not (args.no_cubin or args.quick),
            builds=TVM_BUILDS[:1] if args.quick else TVM_BUILDS,
        )
    from .program import run_program

    only = [s.strip() for s in args.only.split(",")] if args.only else None
    summary = run_program(options, only=only, say=_say)
    bad = [s["name"] for s in summary["steps"] if s["status"] != "ok"]
    _say(f"gpu program: {len(summary['steps']) - len(bad)} of {len(summary['steps'])} steps ok"
         + (f"; not ok: {', '.join(bad)}" if bad else ""))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

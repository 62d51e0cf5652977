"""What the GPU program runs, in which order, and how long each step is expected to take.

The steps, in the order they run (:data:`STEP_ORDER`): first the foreground steps, whose builds
are small (the tests', the tutorial's), which hold the GPU while the benchmarks compile in the
background (the Llama benchmark's builds, the longest, take longer than all of them together);
then the background steps, most valuable first (a run cut short by the deadline loses the
least), each measuring alone when the program reaches it.

``preflight``
    ``.gpukit/preflight.py``: the environment, TVM and blade_relax on the GPU, torch on the GPU
    (``$OUT/preflight.json``).
``gemm``
    The benchmarked Llama's GEMM shapes on TVM's kernels (dlight's, what blade_relax runs on a
    GPU with ``dispatch_gemm=False``) against cuBLAS (``torch.nn.functional.linear``): time, TFLOP/s, error
    (``$OUT/gemm.json``; :mod:`.gemm`).
``gpu-tests``
    The tests marked ``gpu``, but for :data:`GPU_TESTS_LEFT_OUT`.
``bench-llama-train``, ``bench-gpt2-train``
    The benchmark at the prepared size (``real``) on the GPU, from the graphs carried in
    ``.gpuprog/``: ``tvm-dynamic``, ``blade-relax``, ``blade-relax@0.7`` against
    ``torch-eager`` and ``torch-compile`` at three lengths of the trace (``$OUT/bench-*.json``,
    rewritten after every row). The Llama step also runs :data:`EVICTION_CONFIGS`: the same
    budget of 0.7 with evicted tensors offloaded to pinned host memory, and offloaded or
    recomputed per tensor, whichever is estimated faster; its budget table then gives the peak
    and step time of the three eviction modes side by side (issue #37).
``cuda-graphs``
    ``gpt2-infer`` at short lengths (:data:`CUDA_GRAPH_LENGTHS`), padded to length buckets
    (:data:`CUDA_GRAPH_BUCKETS`), with one CUDA graph per bucket in one shared pool and without
    graphs: step time, peak, the pool (``$OUT/cuda-graphs.json``; :mod:`.cuda_graphs`). It
    runs between the two benchmarks: its GPU part takes seconds.
``tutorial-5``
    ``tutorials/05_gpu.py`` in small mode.

Estimates
---------
Every estimate is a sum of the costs in :class:`Costs` (seconds on the GPU machine: one H100,
16 cores), each documented there. The largest one, compiling a real-size training step for
CUDA, is measured: the dry run compiles every executable here and records its seconds in the
manifest, and the plan then uses them divided by :attr:`Costs.host_speedup`. After a GPU run,
``gpu-summary.json`` holds each step's seconds next to its estimate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_CONFIGS",
    "CUDA_GRAPH_BUCKETS",
    "CUDA_GRAPH_LENGTHS",
    "CUDA_GRAPH_MODES",
    "CUDA_GRAPH_WORKLOAD",
    "EVICTION_CONFIGS",
    "EVICTION_WORKLOAD",
    "GEMM_CONFIGS",
    "GEMM_WORKLOAD",
    "GPU_TESTS_LEFT_OUT",
    "LOCK_ENV",
    "MANIFEST",
    "PLAN_LIMIT_S",
    "SIZES",
    "STEP_ORDER",
    "TVM_BUILDS",
    "WORKLOADS",
    "Costs",
    "ProgramOptions",
    "Step",
    "bench_configs",
    "bench_estimate",
    "carried_workloads",
    "cuda_graph_buckets",
    "cuda_graph_estimate",
    "cuda_graph_lengths",
    "format_plan",
    "plan_seconds",
    "gpu_test_files",
    "program_lengths",
    "program_steps",
    "read_manifest",
]

#: The estimated seconds of the whole plan may not exceed this (one command runs at most 10
#: minutes on the GPU machine; a minute is left for starting it and for the unexpected).
PLAN_LIMIT_S = 540.0
#: The workloads benchmarked on the GPU.
WORKLOADS = ("llama-train", "gpt2-train")
#: The configurations benchmarked, in the order the runner measures them.
BENCH_CONFIGS = (
    "tvm-dynamic",
    "blade-relax",
    "blade-relax@0.7",
    "torch-eager",
    "torch-compile",
)
#: The eviction modes compared at the budget of 0.7 (``blade-relax@0.7`` recomputes): they
#: run the ``blade-relax`` executable, so they add rows but no build.
EVICTION_CONFIGS = ("blade-relax@0.7:offload", "blade-relax@0.7:auto")
#: The one workload whose benchmark step also runs :data:`EVICTION_CONFIGS` and
#: :data:`GEMM_CONFIGS`.
EVICTION_WORKLOAD = "llama-train"
#: The default pipeline with TVM's own GEMM kernels (dlight's on a GPU), against
#: ``blade-relax``'s GEMMs on cuBLAS (``DispatchGemm``): what the dispatch gains in a whole
#: step. A build of its own, made in the background with the others.
GEMM_CONFIGS = ("blade-relax-no-dispatch-gemm",)
#: The workload whose GEMM shapes the ``gemm`` step measures.
GEMM_WORKLOAD = "llama-train"
#: The configurations whose executables the benchmark builds, one each per workload (the
#: budget variant runs its base's: ``run_benchmark(share_builds=True)``).
TVM_BUILDS = ("tvm-dynamic", "blade-relax")
#: The GPU tests left out of the ``gpu-tests`` step: tutorial 5's (the ``tutorial-5`` step runs
#: it), and those the benchmark steps check at real size (numerics against torch with and
#: without a budget, the driver's agreement on a training step, the benchmark itself): each of
#: them compiles a tiny model with blade_relax's pipeline, half a minute apiece.
GPU_TESTS_LEFT_OUT = (
    "not gpu_tutorial_runs_on_cuda and not benchmark_runs_on_cuda and not matches_torch"
    " and not agrees_with_driver_for_a_training_step"
)
#: ``size`` -> :class:`~blade_relax.bench.workloads.ModelSizes` keywords; ``real`` is the
#: benchmark's ``--size real``, ``tiny`` what CI's dry run builds.
SIZES: dict[str, dict[str, int]] = {
    "real": {},
    "tiny": dict(
        layers=1, hidden=128, heads=2, kv_heads=1, intermediate=256, vocab=128, max_seq_len=64
    ),
}
#: The workload the ``cuda-graphs`` step runs (carried with the benchmarked ones).
CUDA_GRAPH_WORKLOAD = "gpt2-infer"
#: Its bucket lengths (those up to the workload's upper bound): powers of two, short lengths
#: being where launch overhead dominates.
CUDA_GRAPH_BUCKETS = (16, 32, 64, 128)
#: The lengths it runs (those up to the upper bound): inside, on and between buckets.
CUDA_GRAPH_LENGTHS = (9, 16, 40, 100)
#: Its executables: one CUDA graph per bucket in one pool, and the same copies without graphs.
CUDA_GRAPH_MODES = ("graphs", "plain")
#: The order the steps run in (a step not named here, none at present, would run last).
STEP_ORDER = (
    "preflight",
    "gemm",
    "gpu-tests",
    "tutorial-5",
    "bench-llama-train",
    "cuda-graphs",
    "bench-gpt2-train",
)
#: The environment variable naming the program's GPU lock file: a step holds it while it uses
#: the GPU, so that a benchmark compiling in the background measures alone.
LOCK_ENV = "BLADE_GPUPROG_LOCK"
#: The manifest the dry run writes into the carried folder.
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Costs:
    """Seconds on the GPU machine that the estimates add up.

    Attributes
    ----------
    start_s
        A Python process that imports TVM, torch and transformers.
    preflight_s
        ``preflight.py`` (35 s on the first GPU run).
    tvm_compile_s
        One real-size training step compiled for CUDA, kernels included, when the dry run has
        not measured it: about the mean of the stock and the blade_relax build on the first GPU
        runs (16 to 21 s and 54 to 67 s).
    host_speedup
        CPU seconds the dry run measured for a build per wall second of the same build on the
        GPU machine. Below 1: on the first GPU runs (an H200's machine, 2026-11-28) the
        benchmark builds took 1.5 to 2.1 times the dry run's seconds there (Llama's
        blade_relax build 66.5 s and 54.2 s against 31.5), compiling side by side with the
        other background steps.
    torch_compile_s
        ``torch.compile(dynamic=True)`` of a real-size training step, cold (Inductor and
        Triton; the runner turns the caches off): 90 s for GPT-2's, three compilations, on
        the first GPU run.
    model_s
        Building a real-size model (random weights) and reading its carried graph.
    reference_s
        One torch reference step on the GPU machine's CPU at the largest length.
    step_s
        One real-size training step on the GPU at the largest length, with its synchronisation.
    steps_per_row
        Steps the runner makes per configuration and length: a warm-up, the measured step, the
        timed repeats and, for TVM, the driver's reading (two calls).
    tiny_compile_s
        A tiny model compiled for CUDA (the GPU tests, tutorial 5).
    tiny_import_s
        A tiny Hugging Face import (``torch.export``) on the GPU machine.
    tiny_blade_compile_s
        A tiny Hugging Face training step compiled for CUDA by blade_relax's default pipeline
        (its passes' analyses dominate, not the model's size).
    cuda_graph_compile_s
        One bucketed ``gpt2-infer`` executable (a static copy per bucket) compiled for CUDA,
        kernels included, when the dry run has not measured it.
    cuda_graph_gpu_s
        The ``cuda-graphs`` step on the GPU: two VMs, a capture per bucket, each length
        checked against torch (on the CPU, short lengths) and timed 50 times per mode.
    gemm_s
        The ``gemm`` step after its start: fifteen GEMM functions (five shapes, three passes)
        compiled for CUDA, kernels included, then each at two token counts checked against
        torch and timed (6 batches of 20 calls per side). The five forward GEMMs took 16 s,
        start included, on the first GPU run.
    gemm_gpu_s
        The part of it on the GPU (the step compiles in the background).
    eviction_s
        What the offloading configurations (:data:`EVICTION_CONFIGS`) add beyond their rows'
        steps: measuring the ``auto`` mode's rates once (a matmul compiled for CUDA and
        timed, 8 MiB copied to pinned memory and back) and the copies of the offloaded
        steps (each a synchronous copy there and back of the evicted bytes).
    """

    start_s: float = 8.0
    preflight_s: float = 35.0
    tvm_compile_s: float = 40.0
    host_speedup: float = 0.55
    torch_compile_s: float = 90.0
    model_s: float = 8.0
    reference_s: float = 8.0
    step_s: float = 0.15
    steps_per_row: int = 7
    tiny_compile_s: float = 8.0
    tiny_import_s: float = 4.0
    tiny_blade_compile_s: float = 30.0
    eviction_s: float = 25.0
    cuda_graph_compile_s: float = 40.0
    cuda_graph_gpu_s: float = 20.0
    gemm_s: float = 30.0
    gemm_gpu_s: float = 10.0


@dataclass(frozen=True)
class ProgramOptions:
    """How the program runs.

    Attributes
    ----------
    root
        The project root (``ci/gpu.sh`` runs from there).
    carried
        The folder of carried graphs and the manifest (``.gpuprog``).
    out
        Where results go (``$OUT``; at most 8 files come back).
    size
        ``"real"`` or ``"tiny"`` (only for checking the program itself).
    python
        The interpreter that runs the steps.
    deadline_s
        Seconds the whole program may take; a step that no longer fits is skipped.
    repeat
        Timed steps per configuration and length.
    tolerance
        Largest relative error counted as correct against torch (GPU kernels reduce in another
        order and use fast math).
    workloads
        The benchmarked workloads (the dry run builds theirs).
    costs
        What the estimates are built from.
    """

    root: Path
    carried: Path
    out: Path
    size: str = "real"
    python: str = sys.executable
    deadline_s: float = 560.0
    repeat: int = 3
    tolerance: float = 5e-4
    workloads: tuple[str, ...] = WORKLOADS
    costs: Costs = field(default_factory=Costs)


@dataclass(frozen=True)
class Step:
    """One step of the program: a command with a time budget.

    Attributes
    ----------
    name
        Short name (``"bench-llama-train"``).
    summary
        One line: what it runs.
    kind
        ``"preflight"``, ``"bench"``, ``"cuda-graphs"``, ``"pytest"`` or ``"tutorial"``: how
        its output is read.
    command
        The command line, run from the project root.
    estimate_s
        Expected seconds on the GPU machine.
    budget_s
        Seconds after which it is killed.
    env
        Extra environment variables.
    detail
        How the estimate is made up.
    background
        Started with the program, so that its part before the GPU (compiling) overlaps the
        steps before it; it takes the GPU (:data:`LOCK_ENV`) to measure, and the program waits
        for it at its place in the order. Its budget counts from the program's start.
    gpu_s
        The part of ``estimate_s`` that needs the GPU (background steps).
    """

    name: str
    summary: str
    kind: str
    command: list[str]
    estimate_s: float
    budget_s: float
    env: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    background: bool = False
    gpu_s: float = 0.0


def read_manifest(carried: Path) -> dict[str, Any] | None:
    """The manifest the dry run wrote into ``carried``, or ``None``."""
    path = Path(carried) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def program_lengths(size: str, count: int = 3, seed: int = 0) -> list[int]:
    """Three lengths of the benchmark's seeded trace at ``size``: its shortest, its median
    and its longest distinct length."""
    from ..bench.trace import length_trace
    from ..bench.workloads import REAL, ModelSizes

    sizes = dataclasses.replace(REAL, **SIZES[size]) if size in SIZES else ModelSizes()
    unique = length_trace(6, sizes.min_seq_len, sizes.max_seq_len, seed=seed).unique
    picks = sorted({unique[0], unique[len(unique) // 2], unique[-1]})
    return picks[:count]


def carried_workloads(workloads: tuple[str, ...]) -> tuple[str, ...]:
    """The workloads the dry run carries: the benchmarked ones and the ``cuda-graphs``
    step's."""
    return workloads + tuple(w for w in (CUDA_GRAPH_WORKLOAD,) if w not in workloads)


def _max_seq_len(size: str, manifest: dict[str, Any]) -> int:
    """The largest length of the carried workloads (the manifest's, else ``size``'s)."""
    if manifest.get("sizes"):
        return int(manifest["sizes"]["max_seq_len"])
    from ..bench.workloads import REAL

    return dataclasses.replace(REAL, **SIZES.get(size, {})).max_seq_len


def cuda_graph_buckets(upper: int) -> tuple[int, ...]:
    """The ``cuda-graphs`` step's buckets for a workload whose length is at most ``upper``
    (the upper bound itself when no bucket fits)."""
    return tuple(b for b in CUDA_GRAPH_BUCKETS if b <= upper) or (upper,)


def cuda_graph_lengths(upper: int) -> list[int]:
    """The ``cuda-graphs`` step's lengths up to ``upper``."""
    return [n for n in CUDA_GRAPH_LENGTHS if n <= upper] or [upper]


def cuda_graph_estimate(
    costs: Costs, compile_s: dict[str, float] | None = None
) -> tuple[float, float, str]:
    """Seconds of the ``cuda-graphs`` step before it needs the GPU and on it, and how they add
    up; ``compile_s`` maps a mode to the CPU seconds of its build in the dry run."""
    compile_s = compile_s or {}
    builds = sum(
        compile_s[m] / costs.host_speedup if m in compile_s else costs.cuda_graph_compile_s
        for m in CUDA_GRAPH_MODES
    )
    prep = costs.start_s + costs.model_s + builds
    measured = "measured by the dry run" if compile_s else "not measured yet"
    detail = (
        f"before the GPU: start {costs.start_s:.0f} + model {costs.model_s:.0f} + "
        f"{len(CUDA_GRAPH_MODES)} bucketed builds {builds:.0f} ({measured}); on it: "
        f"{costs.cuda_graph_gpu_s:.0f}"
    )
    return prep, costs.cuda_graph_gpu_s, detail


def _budget(estimate: float) -> float:
    """A step's budget: half its estimate again, and at least 30 s more."""
    return round(max(1.5 * estimate, estimate + 30.0))


def bench_configs(workload: str) -> tuple[str, ...]:
    """The configurations the benchmark step of ``workload`` runs."""
    if workload != EVICTION_WORKLOAD:
        return BENCH_CONFIGS
    return BENCH_CONFIGS + GEMM_CONFIGS + EVICTION_CONFIGS


def bench_estimate(
    costs: Costs,
    lengths: list[int],
    compile_s: dict[str, float] | None = None,
    configs: tuple[str, ...] = BENCH_CONFIGS,
) -> tuple[float, float, str]:
    """Seconds of one benchmark step before it needs the GPU and on the GPU, and how they
    add up.

    ``compile_s`` maps a configuration to the CPU seconds its executable took to build in the
    dry run (on this machine), divided by :attr:`Costs.host_speedup` here. ``configs`` are
    the configurations the step runs (rows), :data:`EVICTION_CONFIGS` among them adding
    :attr:`Costs.eviction_s` and :data:`GEMM_CONFIGS` a build each (the dry run does not make
    it: estimated as ``blade-relax``'s).
    """
    compile_s = compile_s or {}

    def build_s(config: str) -> float:
        measured = compile_s.get(config if config in TVM_BUILDS else "blade-relax")
        return measured / costs.host_speedup if measured is not None else costs.tvm_compile_s

    builds = TVM_BUILDS + tuple(c for c in configs if c in GEMM_CONFIGS)
    tvm = sum(build_s(c) for c in builds)
    rows = len(lengths) * len(configs)
    run = rows * costs.steps_per_row * costs.step_s + len(lengths) * costs.reference_s
    eviction = costs.eviction_s if set(configs) & set(EVICTION_CONFIGS) else 0.0
    prep = costs.start_s + costs.model_s + tvm
    gpu = costs.torch_compile_s + run + eviction
    measured = "measured by the dry run" if compile_s else "not measured yet"
    detail = (
        f"before the GPU: start {costs.start_s:.0f} + model {costs.model_s:.0f} + TVM builds "
        f"{tvm:.0f} ({measured}); on it: torch.compile {costs.torch_compile_s:.0f} + "
        f"{rows} rows {run:.0f}"
    )
    if eviction:
        detail += f" + offloading's rates and copies {eviction:.0f}"
    return prep, gpu, detail


def plan_seconds(steps: list[Step]) -> float:
    """Wall seconds of the program: the foreground steps one after the other, each background
    step's GPU part where the program reaches it, once its part before the GPU (started with
    the program) is done."""
    now = 0.0
    for step in steps:
        if step.background:
            now = max(now, step.estimate_s - step.gpu_s) + step.gpu_s
        else:
            now += step.estimate_s
    return now


def _finish_times(steps: list[Step]) -> list[float]:
    return [plan_seconds(steps[: i + 1]) for i in range(len(steps))]


def gpu_test_files(root: Path) -> list[str]:
    """The test files holding ``gpu``-marked tests, relative to ``root``."""
    files = []
    for path in sorted((Path(root) / "tests").rglob("test_*.py")):
        if "pytest.mark.gpu" in path.read_text():
            files.append(str(path.relative_to(root)))
    return files


def program_steps(options: ProgramOptions) -> list[Step]:
    """The steps of the program, in the order they run."""
    manifest = read_manifest(options.carried) or {}
    steps = [
        _preflight_step(options),
        *(_bench_step(options, manifest, workload) for workload in options.workloads),
        _cuda_graph_step(options, manifest),
        _gemm_step(options),
        _gpu_tests_step(options),
        _tutorial_step(options),
    ]
    rank = {name: i for i, name in enumerate(STEP_ORDER)}
    steps.sort(key=lambda step: rank.get(step.name, len(rank)))
    finish = _finish_times(steps)
    return [
        dataclasses.replace(s, budget_s=_budget(end)) if s.background else s
        for s, end in zip(steps, finish)
    ]


def _preflight_step(options: ProgramOptions) -> Step:
    """The kit's own checks of the machine, first."""
    costs = options.costs
    return Step(
        "preflight",
        "the kit's preflight: environment, TVM and blade_relax on the GPU, torch",
        "preflight",
        [options.python, ".gpukit/preflight.py"],
        costs.preflight_s,
        _budget(costs.preflight_s),
    )


def _bench_step(options: ProgramOptions, manifest: dict[str, Any], workload: str) -> Step:
    """The benchmark of one workload, in the background from the start (its budget is set
    once the steps are ordered)."""
    costs = options.costs
    lengths = manifest.get("lengths", {}).get(workload) or program_lengths(options.size)
    compiled = manifest.get("compile_s", {}).get(workload)
    configs = bench_configs(workload)
    prep, gpu, detail = bench_estimate(costs, lengths, compiled, configs)
    return Step(
        f"bench-{workload}",
        f"{workload} at size {options.size}, s in {lengths}: " + ", ".join(configs),
        "bench",
        [
            options.python,
            "-m",
            "blade_relax.gpuprog",
            "bench",
            "--carried",
            str(options.carried),
            "--workload",
            workload,
            "--out",
            str(options.out / f"bench-{workload}.json"),
            "--repeat",
            str(options.repeat),
            "--tolerance",
            str(options.tolerance),
            "--configs",
            ",".join(configs),
        ],
        prep + gpu,
        0.0,  # set by program_steps: counted from the program's start
        detail=detail,
        background=True,
        gpu_s=gpu,
    )


def _cuda_graph_step(options: ProgramOptions, manifest: dict[str, Any]) -> Step:
    """CUDA graphs per length bucket, in the background from the start."""
    upper = _max_seq_len(options.size, manifest)
    graph_builds = manifest.get("cuda_graphs", {}).get("compile_s", {}).get(CUDA_GRAPH_WORKLOAD)
    prep, gpu, detail = cuda_graph_estimate(options.costs, graph_builds)
    return Step(
        "cuda-graphs",
        f"{CUDA_GRAPH_WORKLOAD} at size {options.size}, s in {cuda_graph_lengths(upper)}, "
        f"buckets {list(cuda_graph_buckets(upper))}: " + " and ".join(CUDA_GRAPH_MODES),
        "cuda-graphs",
        [
            options.python,
            "-m",
            "blade_relax.gpuprog",
            "cuda-graphs",
            "--carried",
            str(options.carried),
            "--out",
            str(options.out / "cuda-graphs.json"),
            "--tolerance",
            str(options.tolerance),
        ],
        prep + gpu,
        0.0,  # set by program_steps: counted from the program's start
        detail=detail,
        background=True,
        gpu_s=gpu,
    )


def _gemm_step(options: ProgramOptions) -> Step:
    """The GEMM shapes of a workload on TVM's kernels against cuBLAS, in the background."""
    costs = options.costs
    gemm = costs.start_s + costs.gemm_s
    gemm_gpu = costs.gemm_gpu_s
    return Step(
        "gemm",
        f"{GEMM_WORKLOAD}'s GEMM shapes on TVM's kernels against cuBLAS",
        "gemm",
        [
            options.python,
            "-m",
            "blade_relax.gpuprog",
            "gemm",
            "--carried",
            str(options.carried),
            "--workload",
            GEMM_WORKLOAD,
            "--out",
            str(options.out / "gemm.json"),
            "--tolerance",
            str(options.tolerance),
        ],
        gemm,
        0.0,  # set by program_steps: counted from the program's start
        detail=f"before the GPU: start + 15 GEMMs compiled {gemm - gemm_gpu:.0f}; on it: 2 "
        f"token counts x 5 shapes x 3 passes timed {gemm_gpu:.0f}",
        background=True,
        gpu_s=gemm_gpu,
    )  # fmt: skip


def _gpu_tests_step(options: ProgramOptions) -> Step:
    """The ``gpu``-marked tests."""
    costs = options.costs
    files = gpu_test_files(options.root)
    # test_cuda_gpu: the accounting on the GPU (a tiny import, a blade_relax build), the
    # page-sized driver check (two MLP builds) and the GEMMs on cuBLAS (two MLP builds);
    # test_accounting: one stock build; test_cuda_graphs: one small bucketed build;
    # test_trainer_cuda: a tiny import and a blade_relax build of a one-layer step with its
    # optimizer (half a tiny build: 15 s on the CPU machine, against 30 for the two layers).
    tests = (
        costs.start_s
        + 2 * costs.tiny_import_s
        + 1.5 * costs.tiny_blade_compile_s
        + 6 * costs.tiny_compile_s
    )
    return Step(
        "gpu-tests",
        f"pytest -m gpu ({', '.join(Path(f).name for f in files)})",
        "pytest",
        [
            options.python,
            "-m",
            "pytest",
            "-q",
            "-rfE",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "-k",
            GPU_TESTS_LEFT_OUT,
            *files,
        ],
        tests,
        _budget(tests),
        detail="start + 2 tiny imports + 1.5 tiny blade_relax builds + 6 small builds",
    )


def _tutorial_step(options: ProgramOptions) -> Step:
    """The GPU tutorial at small sizes."""
    costs = options.costs
    tutorial = (
        costs.start_s + costs.tiny_import_s + costs.tiny_compile_s + costs.tiny_blade_compile_s + 20
    )
    return Step(
        "tutorial-5",
        "tutorials/05_gpu.py, small (BLADE_RELAX_TUTORIAL_SMALL=1)",
        "tutorial",
        [options.python, "tutorials/05_gpu.py"],
        tutorial,
        _budget(tutorial),
        env={"BLADE_RELAX_TUTORIAL_SMALL": "1", "MPLBACKEND": "Agg"},
        detail="start + a tiny import + a stock and a blade_relax build + 3 lengths x 4 runs "
        "(73 s on the first GPU run)",
    )


def format_plan(steps: list[Step], limit_s: float = PLAN_LIMIT_S) -> str:
    """The plan as text: one line per step, its estimate and budget, and the program's wall
    seconds (background steps overlap the steps before them)."""
    width = max(len(s.name) for s in steps)
    lines = [f"{'step':<{width}}  {'estimate':>8}  {'budget':>6}  what"]
    for step in steps:
        lines.append(
            f"{step.name:<{width}}  {step.estimate_s:>7.0f}s  {step.budget_s:>5.0f}s  "
            f"{step.summary}"
        )
        if step.detail:
            lines.append(f"{'':<{width}}  {'':>8}  {'':>6}  ({step.detail})")
        if step.background:
            lines.append(
                f"{'':<{width}}  {'':>8}  {'':>6}  (in the background from the start; "
                f"{step.gpu_s:.0f} s on the GPU)"
            )
    total = plan_seconds(steps)
    verdict = "fits" if total <= limit_s else "DOES NOT FIT"
    lines.append(
        f"total: {total:.0f} s estimated on the GPU machine ({total / 60:.1f} min; "
        f"{verdict} the {limit_s / 60:.0f}-minute plan limit)"
    )
    return "\n".join(lines)


def environment_python() -> str:
    """The interpreter to run steps with: ``$BLADE_RELAX_PYTHON`` or this one."""
    return os.environ.get("BLADE_RELAX_PYTHON", sys.executable)

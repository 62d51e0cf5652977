"""The benchmark workloads carried to the GPU machine, and what the dry run builds from them.

The choice (issue: "It must run with what the GPU machine has")
----------------------------------------------------------------
The GPU machine has torch 2.11 and transformers 5.17, no peft, and no time to spare; we import
with torch 2.13. The Hugging Face import (``torch.export``, torch's joint forward+backward
export, TVM's ``from_exported_program`` with our converters) is therefore done here, before the
run, and not there: :func:`prepare` imports each workload and writes its Relax module, without
weights, into the carried folder (``.gpuprog/``, git-ignored, about 25 KB a workload:
:mod:`blade_relax.frontend.carry`). On the GPU machine :func:`carried_workload` reads it, builds
the same model from its config with the torch and transformers found there, and takes the
weights from that model: TVM and the torch baselines run the same weights, and every output is
checked against that machine's torch. What differs between the two versions is thus reduced to
the model's parameters (names, shapes, dtypes: checked when attached) and its arithmetic
(checked by the benchmark's comparison with torch on every row). The GPU tests and tutorial 5
still import on the GPU machine (tiny models): they are the check that the import itself works
with that torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from .plan import (
    CUDA_GRAPH_MODES,
    CUDA_GRAPH_WORKLOAD,
    MANIFEST,
    SIZES,
    TVM_BUILDS,
    ProgramOptions,
    carried_workloads,
    cuda_graph_buckets,
    cuda_graph_lengths,
    program_lengths,
    read_manifest,
)

__all__ = [
    "CARRY_LIMIT",
    "build_cuda_graph_modes",
    "build_executables",
    "carried_path",
    "carried_workload",
    "merge_build_seconds",
    "model_sizes",
    "prepare",
    "travel_bytes",
]

#: What may travel to the GPU machine with one command, kit included (64 MiB, less a margin
#: for what the machinery adds): 63.5 MiB. The first GPU run carried 63.04 MiB.
CARRY_LIMIT = (127 << 20) // 2


def model_sizes(size: str) -> Any:
    """The :class:`~blade_relax.bench.workloads.ModelSizes` of a program size."""
    from ..bench.workloads import REAL

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, not {size!r}")
    return dataclasses.replace(REAL, **SIZES[size])


def carried_path(carried: Path, workload: str) -> Path:
    """Where the carried graph of ``workload`` is."""
    return Path(carried) / f"{workload}.npz"


def _versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": platform.python_version()}
    for name in ("apache-tvm", "torch", "transformers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def prepare(options: ProgramOptions, say: Any = print) -> dict[str, Any]:
    """Import every benchmarked workload at ``options.size``, and the ``cuda-graphs`` step's,
    and write them to the carried folder, with the manifest (sizes, lengths, versions). Weights
    are allocated, not drawn.

    Returns
    -------
    dict
        The manifest.
    """
    from ..bench.workloads import build_workload
    from ..frontend.carry import save_graph

    sizes = model_sizes(options.size)
    lengths = program_lengths(options.size)
    manifest: dict[str, Any] = {
        "size": options.size,
        "sizes": dataclasses.asdict(sizes),
        "seed": 0,
        "lengths": {},
        "imported_with": _versions(),
        "import_s": {},
        "bytes": {},
    }
    for workload in carried_workloads(options.workloads):
        start = time.perf_counter()
        built = build_workload(workload, sizes, seed=0, weights="empty")
        path = save_graph(
            built.graph,
            carried_path(options.carried, workload),
            info={"workload": workload, "sizes": dataclasses.asdict(built.sizes), "seed": 0},
        )
        seconds = time.perf_counter() - start
        manifest["lengths"][workload] = (
            lengths if workload in options.workloads else cuda_graph_lengths(sizes.max_seq_len)
        )
        manifest["import_s"][workload] = round(seconds, 1)
        manifest["bytes"][workload] = path.stat().st_size
        say(f"carried {workload}: {path} ({path.stat().st_size / 1024:.0f} KiB, {seconds:.0f} s)")
    _write_manifest(options.carried, manifest)
    return manifest


def _write_manifest(carried: Path, manifest: dict[str, Any]) -> None:
    path = Path(carried) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def _model(workload: str, sizes: Any, seed: int) -> Any:
    from ..bench.workloads import gpt2_model, llama_model

    if workload.startswith("llama"):
        return llama_model(sizes, seed=seed)
    if workload.startswith("gpt2"):
        return gpt2_model(sizes, seed=seed)
    raise ValueError(f"no model builder for carried workload {workload!r}")


def carried_workload(carried: Path, workload: str, *, with_model: bool = True) -> Any:
    """The :class:`~blade_relax.bench.workloads.Workload` of a carried graph.

    With ``with_model`` the model is built here from the carried sizes and seed (random
    weights, drawn by this machine's torch) and attached; without it (the dry run's builds)
    the graph has no weights, reference or torch module.
    """
    from ..bench.workloads import ModelSizes, Workload
    from ..frontend import ImportedGraph
    from ..frontend.carry import attach_model, load_graph

    path = carried_path(carried, workload)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run 'bash ci/gpu.sh --dry-run' on the CPU machine first"
        )
    graph = load_graph(path)
    sizes = ModelSizes(**graph.info["sizes"])
    if with_model:
        imported = attach_model(graph, _model(workload, sizes, int(graph.info["seed"])))
    else:
        imported = ImportedGraph(
            mod=graph.mod,
            params=[],
            input_names=graph.input_names,
            param_names=graph.param_names,
            output_names=graph.output_names,
            input_shapes=graph.input_shapes,
            input_dtypes=graph.input_dtypes,
            dims=graph.dims,
            kind=graph.kind,
            int_input_high=graph.int_input_high,
            num_frozen=graph.num_frozen,
            metadata=graph.metadata,
        )
    return Workload(name=workload, sizes=sizes, graph=imported)


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished children (``nvcc``)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def build_executables(
    options: ProgramOptions,
    arch: str = "sm_90",
    cubin: bool = True,
    builds: tuple[str, ...] = TVM_BUILDS,
    cuda_graph_modes: tuple[str, ...] = CUDA_GRAPH_MODES,
    say: Any = print,
) -> dict[str, Any]:
    """Build, from the carried graphs, every CUDA executable the benchmark steps and the
    ``cuda-graphs`` step compile.

    Each configuration of ``builds`` compiles the carried module for ``arch`` (no GPU
    needed); with ``cubin`` and a CUDA compiler present, the generated CUDA C is compiled to
    a cubin as well (``ptxas`` checks registers and shared memory). The CPU seconds each build
    took, kernels included, are written into the manifest (the plan's estimates read them):
    CPU seconds rather than wall seconds, because the CPU machine is shared and its wall
    seconds say more about the other jobs than about the build. ``cuda_graph_modes`` are the
    bucketed executables of the ``cuda-graphs`` step built (:func:`build_cuda_graph_modes`).

    Returns
    -------
    dict
        ``{"compile_s": {workload: {config: seconds}}, "cubin": {...} or a reason,
        "cuda_graphs": {...}}``.
    """
    import tvm

    from ..analysis.workspace import compile_keeping_module
    from ..bench.configs import get_config
    from ..runtime.devices import compile_cuda_source, cuda_source, find_cuda_compiler

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    compiler, where = find_cuda_compiler() if cubin else (None, "not asked for")
    report: dict[str, Any] = {"compile_s": {}, "cubin": {}, "compiler": compiler or where}
    for workload in options.workloads:
        graph = carried_workload(options.carried, workload, with_model=False).graph
        report["compile_s"][workload] = {}
        for name in builds:
            config = get_config(name)
            start, cpu = time.perf_counter(), _cpu_seconds()
            variant = graph.with_upper_bounds(config.keep_bounds)
            compiled = compile_keeping_module(variant.mod, target, config.pipeline(target))
            wall, seconds = time.perf_counter() - start, _cpu_seconds() - cpu
            say(
                f"built {workload} / {name} for CUDA {arch}: {seconds:.1f} CPU s ({wall:.0f} s wall)"
            )
            if compiler is not None:
                # On the GPU machine tvm.compile compiles the kernels too: counted with it.
                start, cpu = time.perf_counter(), _cpu_seconds()
                binary = compile_cuda_source(cuda_source(compiled.executable), arch)
                wall, kernels = time.perf_counter() - start, _cpu_seconds() - cpu
                seconds += kernels
                report["cubin"][f"{workload}/{name}"] = {
                    "bytes": len(binary),
                    "cpu_s": round(kernels, 1),
                }
                say(
                    f"compiled its kernels with {compiler}: {len(binary)} bytes, "
                    f"{kernels:.1f} CPU s ({wall:.0f} s wall)"
                )
            report["compile_s"][workload][name] = round(seconds, 2)
    report["cuda_graphs"] = build_cuda_graph_modes(
        options.carried, target, cuda_graph_modes, compiler, say=say
    )
    for mode, size in report["cuda_graphs"].get("cubin_bytes", {}).items():
        report["cubin"][f"{CUDA_GRAPH_WORKLOAD}/{mode}"] = {"bytes": size}
    manifest = read_manifest(options.carried) or {}
    merge_build_seconds(manifest, report["compile_s"], with_kernels=compiler is not None)
    # The cuda-graphs step's builds, by mode, merged the same way.
    graphs = manifest.setdefault("cuda_graphs", {})
    built = report["cuda_graphs"]
    merge_build_seconds(
        graphs, {CUDA_GRAPH_WORKLOAD: built["compile_s"]}, with_kernels=compiler is not None
    )
    graphs.update({k: v for k, v in built.items() if k != "compile_s"})
    manifest["compiled_for"] = arch
    _write_manifest(options.carried, manifest)
    return report


def build_cuda_graph_modes(
    carried: Path,
    target: Any,
    modes: tuple[str, ...],
    compiler: str | None,
    say: Any = print,
) -> dict[str, Any]:
    """Build the ``cuda-graphs`` step's bucketed executables (one per mode of ``modes``) for
    ``target`` from the carried graph, their kernels too when ``compiler`` is given.

    Returns
    -------
    dict
        ``compile_s`` (mode -> CPU seconds, kernels included), ``buckets``, ``cubin_bytes``
        (mode -> bytes, when kernels were compiled), and the pool the ``graphs`` build plans
        (``pool_bytes``, ``largest_bytes``, ``unshared_bytes``) and allocates
        (``allocated_bytes``, from its ``cuda_graph_alloc``).
    """
    from ..runtime.devices import compile_cuda_source, cuda_source
    from .buckets import compile_buckets

    graph = carried_workload(carried, CUDA_GRAPH_WORKLOAD, with_model=False).graph
    buckets = cuda_graph_buckets(graph.dims["s"].upper)
    found: dict[str, Any] = {"compile_s": {}, "buckets": list(buckets)}
    for mode in modes:
        cpu = _cpu_seconds()
        build = compile_buckets(graph.mod, target, buckets, graphs=mode == "graphs")
        if compiler is not None:
            binary = compile_cuda_source(cuda_source(build.executable), target.arch)
            found.setdefault("cubin_bytes", {})[mode] = len(binary)
        seconds = _cpu_seconds() - cpu
        found["compile_s"][mode] = round(seconds, 2)
        if mode == "graphs":
            plan = build.pool
            found.update(
                pool_bytes=plan.pool_bytes,
                largest_bytes=plan.largest_bytes,
                unshared_bytes=plan.unshared_bytes,
                allocated_bytes=sum(build.allocated_pool),
            )
        say(
            f"built {CUDA_GRAPH_WORKLOAD} / {mode}, buckets {list(buckets)}, for CUDA "
            f"{target.arch}: {seconds:.1f} CPU s"
            + (f" (kernels compiled with {compiler})" if compiler else "")
        )
    return found


def merge_build_seconds(
    manifest: dict[str, Any], measured: dict[str, dict[str, float]], *, with_kernels: bool
) -> None:
    """Merge build seconds into ``manifest["compile_s"]``: a partial dry run (``--quick``)
    keeps what an earlier one measured, and a build measured without its kernels never
    replaces one measured with them."""
    for workload, seconds in measured.items():
        known = manifest.setdefault("compile_s", {}).setdefault(workload, {})
        for name, value in seconds.items():
            if with_kernels or name not in known:
                known[name] = value


def _git_files(root: Path, *args: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z", *args], cwd=root, capture_output=True, check=True
    ).stdout
    return [root / name for name in out.decode().split("\0") if name]


def _tree_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def travel_bytes(root: Path, carried: Path) -> dict[str, int | None]:
    """What travels to the GPU machine with one command, in bytes.

    ``tracked`` (the checkout's tracked files), ``untracked`` (untracked files git does not
    ignore: they travel too), ``carried`` (the carried folder), ``kit`` (``.gpukit/``,
    ``None`` when absent) and ``total``.
    """
    root = Path(root)
    kit = root / ".gpukit"
    sizes: dict[str, int | None] = {
        "tracked": _tree_bytes(_git_files(root)),
        "untracked": _tree_bytes(_git_files(root, "--others", "--exclude-standard")),
        "carried": _tree_bytes([p for p in Path(carried).rglob("*")])
        if Path(carried).exists()
        else 0,
        "kit": _tree_bytes(list(kit.rglob("*"))) if kit.is_dir() else None,
    }
    sizes["total"] = sum(v for v in sizes.values() if v)
    return sizes

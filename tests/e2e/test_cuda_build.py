"""Every workload builds for CUDA without a GPU: scheduled kernels, CUDA C, and a cubin from nvcc.

What a build checks, per workload and pipeline variant (stock TVM, and blade_relax with all its
passes on):

* after the Relax pipeline, every device kernel has a GPU schedule (a thread binding): a kernel
  without one is what makes a CUDA build fail, and the message names it here;
* ``tvm.compile`` produces an executable whose CUDA module holds one ``__global__`` kernel per
  device PrimFunc;
* for the blade_relax variant, ``nvcc`` or NVRTC compiles that CUDA C to an ``sm_90`` cubin
  (``ptxas`` included, so register and shared-memory limits are checked). The stock variant has
  the same kernels (the memory passes change no kernel, which is checked), so it is not compiled
  twice.

The compiler is a CUDA toolkit's ``nvcc`` or NVRTC from PyPI (``pip install -e ".[cuda]"``).
On a machine with neither, everything up to the CUDA C is still built and checked, and the
blade_relax variants then skip with one line saying so: a missing tool is never a failure.

Sizes are tiny (one decoder layer) because CUDA compilation on a 2-core CI machine is slow.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

import blade_relax
from blade_relax.bench.workloads import ModelSizes, gpt2_model, llama_model
from blade_relax.frontend.builtin import BUILTIN_MODELS
from blade_relax.runtime import devices
from blade_relax.runtime.devices import compile_cuda_source, cuda_source, find_cuda_compiler

ARCH = "sm_90"
CUDA = {"kind": "cuda", "arch": ARCH}
MAX_LEN = 64
COMPILER, COMPILER_NOTE = find_cuda_compiler()


STOCK = {
    "schedule": False,
    "remat": False,
    "plan": False,
    "simplify": False,
    "fold_scatter": False,
    "inline_kernels": False,
    "recompute": False,
    "clone_generated": False,
    "check_dims": False,
}
BLADE = {"schedule": True, "remat": True, "plan": True}
# The memory passes alone: the graph passes (SimplifyTransposes, FoldZeroScatter) do emit kernels.
MEMORY_ONLY = {
    **BLADE,
    "simplify": False,
    "fold_scatter": False,
    "inline_kernels": False,
    "recompute": False,
    "clone_generated": False,
}
VARIANTS = {"stock": STOCK, "blade": BLADE}


def _target() -> tvm.target.Target:
    return tvm.target.Target(CUDA)


def lower(mod: tvm.IRModule, flags: dict[str, bool]) -> tvm.IRModule:
    """The module after blade_relax's Relax pipeline for CUDA (before TIR code generation)."""
    target = _target()
    with target:
        return blade_relax.get_pipeline(target, **flags)(mod)


def _has_thread_binding(func: tirx.PrimFunc) -> bool:
    found = False

    def visit_for(node: tirx.For) -> None:
        nonlocal found
        found = found or node.kind == tirx.ForKind.THREAD_BINDING

    def visit_attr(node: tirx.AttrStmt) -> None:
        nonlocal found
        found = found or node.attr_key == "thread_extent"

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit_for), (tirx.AttrStmt, visit_attr)])
    return found


def device_kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """PrimFuncs that run on the GPU (VMShapeLower's shape functions run on the host)."""
    return {
        gv.name_hint: func
        for gv, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc)
        and not (func.attrs is not None and func.attrs.get("tirx.is_host_func", False))
    }


def unscheduled_kernels(mod: tvm.IRModule) -> list[str]:
    """Names of device kernels without any thread binding."""
    return sorted(name for name, f in device_kernels(mod).items() if not _has_thread_binding(f))


def build(mod: tvm.IRModule, flags: dict[str, bool]) -> tuple[tvm.IRModule, object]:
    """Lower, check every kernel is scheduled, and generate code; returns (lowered, executable)."""
    lowered = lower(mod, flags)
    missing = unscheduled_kernels(lowered)
    assert not missing, f"kernels without a GPU schedule: {missing}"
    # The pipeline already ran: hand the lowered module straight to code generation.
    executable = tvm.compile(lowered, _target(), relax_pipeline=None)
    return lowered, executable


def global_kernels(source: str) -> set[str]:
    """Names of the ``__global__`` functions defined in CUDA C."""
    return set(
        re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', source)
    )


def check_build(mod: tvm.IRModule, variant: str) -> set[str]:
    """Build ``mod`` for CUDA in ``variant``; return the kernels' names."""
    lowered, executable = build(mod, VARIANTS[variant])
    source = cuda_source(executable)
    kernels = global_kernels(source)
    names = device_kernels(lowered)
    assert names, "no device kernel: nothing was built for the GPU"
    for name in names:
        # Code generation names a PrimFunc's launch "<name>_kernel" (more when it splits).
        assert any(k == f"{name}_kernel" or k.startswith(f"{name}_kernel") for k in kernels), (
            f"kernel {name} is missing from the CUDA module"
        )
    if variant == "blade":
        if COMPILER is None:
            pytest.skip(f"CUDA C built and checked, cubin not compiled: {COMPILER_NOTE}")
        binary = compile_cuda_source(source, ARCH, compiler=COMPILER)
        assert len(binary) > 0
    return kernels


# ---------------------------------------------------------------------- the compiler
def test_without_a_compiler_the_reason_is_one_line(monkeypatch):
    """No nvcc and no NVRTC: a one-line reason that says what to install, never a crash."""
    monkeypatch.setattr(devices, "_nvcc_path", lambda: None)
    monkeypatch.setattr(devices, "_has_nvrtc_bindings", lambda: False)
    compiler, reason = find_cuda_compiler()
    assert compiler is None
    assert "\n" not in reason and "nvcc" in reason and '".[cuda]"' in reason
    with pytest.raises(RuntimeError) as err:
        compile_cuda_source('extern "C" __global__ void k() {}', ARCH)
    assert str(err.value) == reason


def test_nvrtc_from_wheels_is_found(monkeypatch, tmp_path):
    """NVRTC with the headers of the PyPI wheels (nvidia/cu13), no toolkit anywhere."""
    root = tmp_path / "nvidia" / "cu13"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libnvrtc.so.13").write_bytes(b"")
    (root / "include" / "cccl").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(devices, "_nvcc_path", lambda: None)
    monkeypatch.setattr(devices, "_has_nvrtc_bindings", lambda: True)
    monkeypatch.setattr(devices, "_nvidia_dirs", lambda: [str(tmp_path / "nvidia")])
    compiler, where = find_cuda_compiler()
    assert compiler == "nvrtc" and str(root) in where
    with devices._nvrtc_headers() as options:
        assert os.environ["CUDA_PATH"] == str(root)
        assert options == [f"-I{root / 'include' / 'cccl'}"]
    assert "CUDA_PATH" not in os.environ

    # The bindings without the library or headers: not usable, and the reason says so.
    monkeypatch.setattr(devices, "_nvidia_dirs", lambda: [])
    compiler, reason = find_cuda_compiler()
    assert compiler is None and "cuda-bindings is installed" in reason


# ---------------------------------------------------------------------- built-in models
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_model_builds_for_cuda(name: str, variant: str) -> None:
    check_build(BUILTIN_MODELS[name](), variant)


def test_memory_passes_change_no_kernel() -> None:
    """The stock build and the memory passes' build have the same kernels (nvcc runs on one)."""
    mod = BUILTIN_MODELS["mlp-train"]()
    stock = lower(mod, STOCK)
    ours = lower(mod, MEMORY_ONLY)
    assert set(device_kernels(stock)) == set(device_kernels(ours))
    for name, func in device_kernels(stock).items():
        tvm.ir.assert_structural_equal(func, device_kernels(ours)[name])


def test_registered_pipeline_builds_for_cuda() -> None:
    """``relax.get_pipeline("blade_relax", target=...)`` is the same pipeline, usable by name."""
    target = _target()
    pipeline = relax.get_pipeline("blade_relax", target=target, **BLADE)
    executable = tvm.compile(BUILTIN_MODELS["mlp"](), target, relax_pipeline=pipeline)
    assert global_kernels(cuda_source(executable))


def test_memory_planner_reads_scheduled_kernels() -> None:
    """On a GPU, PlanMemory must judge in-place reuse on the kernels as they will run.

    Its in-place rule "every read of the input precedes the stage that writes the output" holds
    for a serial CPU kernel but not once the GPU schedule inlines the stages into one parallel
    launch (``matmul -> multiply`` becomes one kernel whose thread blocks read inputs that other
    blocks already overwrite). The CUDA pipeline therefore schedules every kernel before the
    planner runs; this checks it at the moment PlanMemory starts.
    """
    seen: list[list[str]] = []

    @tvm.instrument.pass_instrument
    class UnscheduledAtPlan:
        def run_before_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
            if info.name == "PlanMemory":
                seen.append(unscheduled_kernels(mod))

    with tvm.transform.PassContext(instruments=[UnscheduledAtPlan()]):
        lower(BUILTIN_MODELS["attention"](), BLADE)
    assert seen == [[]]


def test_unscheduled_kernel_is_reported() -> None:
    """The check in :func:`build` does find a kernel without thread bindings."""
    from tvm.script import ir as I
    from tvm.script import tirx as T

    @I.ir_module
    class Bare:
        @T.prim_func(s_tir=True)
        def copy(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
            for i in range(8):
                with T.sblock("copy"):
                    vi = T.axis.spatial(8, i)
                    b[vi] = a[vi]

    assert unscheduled_kernels(Bare) == ["copy"]


# ---------------------------------------------------------------------- Hugging Face workloads
# One decoder layer: the build tests check compilation, not numerics.
TINY = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=128, vocab=128, max_seq_len=MAX_LEN
)


def _tiny_llama():
    pytest.importorskip("transformers")
    return llama_model(dataclasses.replace(TINY, intermediate=64), attn_implementation=None)


def _tiny_gpt2():
    pytest.importorskip("transformers")
    return gpt2_model(TINY, attn_implementation=None)


MODELS = {"llama": _tiny_llama, "gpt2": _tiny_gpt2}


@pytest.fixture(scope="module")
def hf_graphs():
    """Imported graphs, built on first use and shared by the tests of this module."""
    from blade_relax.frontend import import_inference, import_training_step

    importers = {"inference": import_inference, "training": import_training_step}
    cache: dict[tuple[str, str], object] = {}

    def get(model: str, kind: str):
        key = (model, kind)
        if key not in cache:
            cache[key] = importers[kind](MODELS[model](), max_seq_len=MAX_LEN)
        return cache[key]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_hf_workload_builds_for_cuda(hf_graphs, model: str, kind: str, variant: str) -> None:
    graph = hf_graphs(model, kind)
    check_build(graph.mod, variant)


def test_softmax_backward_kernel_builds_for_cuda(hf_graphs) -> None:
    """The opt-in ``RewriteSoftmaxBackward`` emits a GEMM with an epilogue over ``P``: dlight
    schedules it like the other GEMMs, and it is compiled with them."""
    graph = hf_graphs("llama", "training")
    lowered, executable = build(graph.mod, {**BLADE, "softmax_backward": True})
    rewritten = [n for n in device_kernels(lowered) if n.startswith("softmax_grad_NT_matmul")]
    assert rewritten, "the training step has no score-gradient kernel"
    source = cuda_source(executable)
    assert all(any(k.startswith(f"{n}_kernel") for k in global_kernels(source)) for n in rewritten)
    if COMPILER is None:
        pytest.skip(f"CUDA C built and checked, cubin not compiled: {COMPILER_NOTE}")
    assert len(compile_cuda_source(source, ARCH, compiler=COMPILER)) > 0

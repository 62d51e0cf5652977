"""The pipeline's structure: TVM's phases mirrored and checked, the flags, the stages."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_phases
from tvm.relax.backend.cuda import pipeline as cuda_phases
from tvm.script import ir as I
from tvm.script import relax as R

from blade_relax.bench.configs import get_config
from blade_relax.pipeline import (
    PHASES,
    PipelineFlags,
    check_tvm_phases,
    get_pipeline,
    lower_to_memory_stage,
    pipeline_keeping_memory_stage,
    pipeline_phases,
    stock_pipeline,
)
from blade_relax.testing.differential import ALL_VARIANTS, STOCK, Variant

CUDA = {"kind": "cuda", "arch": "sm_90"}


@I.ir_module
class Small:
    @R.function
    def main(x: R.Tensor(("s", 64), "float32"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            a = R.matmul(x, w)
            b = R.nn.relu(a)
            c = R.sum(b, axis=[1])
            d = R.exp(x)
            e = R.add(c, R.sum(d, axis=[1]))
            R.output(e)
        return e


def _names(passes) -> list[str]:
    return [p.info.name for p in passes]


def _all_names(phases: dict) -> list[str]:
    return [p.info.name for passes in phases.values() for p in passes]


# ------------------------------------------------------------------------- the phase check
@pytest.mark.parametrize("target", ["llvm", CUDA], ids=["llvm", "cuda"])
def test_tvm_finalize_phase_is_the_one_mirrored(target):
    check_tvm_phases(target)  # raises on a mismatch
    phases = pipeline_phases(target, **dict.fromkeys(PipelineFlags.switches(), False))
    tvm_phases = cpu_phases if target == "llvm" else cuda_phases
    tgt = tvm.target.Target(target)
    assert _names(phases["finalize"] + phases["vm_lower"]) == _names(
        tvm_phases.finalize_passes(tgt)
    )
    assert _names(phases["vm_lower"])[0] == "VMShapeLower"


def _without(name: str):
    original = cpu_phases.finalize_passes

    def finalize_passes(target):
        return [p for p in original(target) if p.info.name != name]

    return finalize_passes


def _renamed(name: str, new_name: str):
    original = cpu_phases.finalize_passes

    @tvm.transform.module_pass(opt_level=0, name=new_name)
    def renamed(mod, _ctx):
        return mod

    def finalize_passes(target):
        return [renamed if p.info.name == name else p for p in original(target)]

    return finalize_passes


def test_check_fails_loudly_on_a_missing_pass(monkeypatch):
    monkeypatch.setattr(cpu_phases, "finalize_passes", _without("StaticPlanBlockMemory"))
    message = (
        r"finalize phase for llvm targets \(tvm\.relax\.backend\.cpu_generic\.pipeline"
        r"\.finalize_passes\).*: StaticPlanBlockMemory missing\. TVM: \['LowerAllocTensor'"
    )
    with pytest.raises(RuntimeError, match=message):
        check_tvm_phases("llvm")
    # Every entry point checks (the phase function changed since the last check).
    with pytest.raises(RuntimeError, match="StaticPlanBlockMemory missing"):
        get_pipeline("llvm")
    with pytest.raises(RuntimeError, match="StaticPlanBlockMemory missing"):
        stock_pipeline("llvm")
    with pytest.raises(RuntimeError, match="StaticPlanBlockMemory missing"):
        lower_to_memory_stage(Small, "llvm")
    # The CUDA phase list is checked on its own.
    check_tvm_phases(CUDA)


def test_check_fails_loudly_on_a_renamed_pass(monkeypatch):
    monkeypatch.setattr(
        cpu_phases, "finalize_passes", _renamed("KillAfterLastUse", "KillAfterLastUse2")
    )
    with pytest.raises(RuntimeError, match="KillAfterLastUse became KillAfterLastUse2"):
        get_pipeline("llvm", remat=True)


def test_check_fails_loudly_on_an_added_pass(monkeypatch):
    original = cpu_phases.finalize_passes
    monkeypatch.setattr(
        cpu_phases,
        "finalize_passes",
        lambda target: [*original(target), relax.transform.DeadCodeElimination()],
    )
    with pytest.raises(RuntimeError, match="DeadCodeElimination added"):
        lower_to_memory_stage(Small, "llvm")


def test_check_fails_loudly_on_a_cuda_mismatch(monkeypatch):
    original = cuda_phases.finalize_passes
    monkeypatch.setattr(
        cuda_phases,
        "finalize_passes",
        lambda target: [p for p in original(target) if p.info.name != "RewriteCUDAGraph"],
    )
    with pytest.raises(RuntimeError, match="cuda targets .*RewriteCUDAGraph missing"):
        get_pipeline(CUDA)
    get_pipeline("llvm")


def test_check_passes_again_once_tvm_phases_are_restored(monkeypatch):
    monkeypatch.setattr(cpu_phases, "finalize_passes", _without("VMShapeLower"))
    with pytest.raises(RuntimeError, match="VMShapeLower missing"):
        get_pipeline("llvm")
    monkeypatch.undo()
    get_pipeline("llvm")


# ------------------------------------------------------------------- equal to stock TVM
def test_all_passes_off_is_tvm_default_pipeline_structurally():
    target = tvm.target.Target("llvm")
    off = dict.fromkeys(PipelineFlags.switches(), False)
    tvm_passes = (
        cpu_phases.library_dispatch_passes(target)
        + cpu_phases.legalize_passes(target)
        + cpu_phases.dataflow_lower_passes(target)
        + cpu_phases.finalize_passes(target)
    )
    assert _all_names(pipeline_phases(target, **off)) == _names(tvm_passes)
    expected = relax.get_default_pipeline(target)(Small)
    tvm.ir.assert_structural_equal(stock_pipeline(target)(Small), expected)
    with target:
        ours = get_pipeline(target, **off)(Small)
    tvm.ir.assert_structural_equal(ours, expected)
    # The memory stage is TVM's pipeline stopped before VMShapeLower.
    cut = _names(tvm_passes).index("VMShapeLower")
    with target:
        expected_memory = tvm.transform.Sequential(tvm_passes[:cut])(Small)
    tvm.ir.assert_structural_equal(lower_to_memory_stage(Small, target), expected_memory)


@pytest.mark.parametrize("flags", [{}, {"check_dims": False, "remat": False}])
def test_a_compilation_keeps_the_memory_stage_that_lowering_gives(flags):
    """``pipeline_keeping_memory_stage``: the executable of ``get_pipeline`` and, kept on the
    way, the module ``lower_to_memory_stage`` gives with the same flags."""
    target = tvm.target.Target("llvm")
    kept: list[tvm.IRModule] = []
    exe = tvm.compile(
        Small, target, relax_pipeline=pipeline_keeping_memory_stage(target, kept, **flags)
    )
    every = {f.name: getattr(PipelineFlags(), f.name) for f in dataclasses.fields(PipelineFlags)}
    (stage,) = kept
    tvm.ir.assert_structural_equal(
        stage, lower_to_memory_stage(Small, target, **{**every, **flags})
    )
    x = np.random.default_rng(0).standard_normal((5, 64)).astype("float32")
    w = np.random.default_rng(1).standard_normal((64, 32)).astype("float32")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    want = np.maximum(x @ w, 0).sum(1) + np.exp(x).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_unplanned_stock_pipeline_leaves_out_only_static_planning():
    target = tvm.target.Target("llvm")
    tvm_passes = (
        cpu_phases.library_dispatch_passes(target)
        + cpu_phases.legalize_passes(target)
        + cpu_phases.dataflow_lower_passes(target)
        + [p for p in cpu_phases.finalize_passes(target) if p.info.name != "StaticPlanBlockMemory"]
    )
    with target:
        expected = tvm.transform.Sequential(tvm_passes)(Small)
    tvm.ir.assert_structural_equal(stock_pipeline(target, plan_memory=False)(Small), expected)


# ------------------------------------------------------------------------------ the phases
def test_our_passes_are_placed_by_phase():
    phases = pipeline_phases("llvm")
    assert tuple(phases) == PHASES
    assert _names(phases["graph"]) == [
        "FuseAttention",
        "FoldBroadcastMatmul",
        "SimplifyTransposes",
        "FoldZeroScatter",
        "CloneGeneratedTensors",
    ]
    assert _names(phases["legalize"])[-1] == "FuseTIR"
    assert _names(phases["fused"]) == [
        "InlineKernelIntermediates",
        "VectorizeSoftmax",
        "VectorizeScoreGrad",
        "VectorizeColumnReductions",
        "MemoryAwareSchedule",
        "RecomputeCheapValues",
        "FuseIntoSoleReader",
    ]
    assert _names(phases["finalize"]) == [
        "Rematerialize",
        "CheckDimRanges",
        "PlanMemory",
        "LowerAllocTensor",
        "KillAfterLastUse",
        "RematTimeline",
        "DispatchGemm",
        "ExpandMathIntrinsics",  # it changes nothing on "llvm", which names no CPU
        "LowerRuntimeBuiltin",
        "ComputePrimValue",
    ]
    assert _names(phases["vm_lower"]) == ["VMShapeLower", "AttachGlobalSymbol"]
    # Every switch enables its pass, and only it.
    off = dict.fromkeys(PipelineFlags.switches(), False)
    stock = _all_names(pipeline_phases("llvm", **off))
    for switch, pass_name in PipelineFlags.passes().items():
        names = _all_names(pipeline_phases("llvm", **{**off, switch: True}))
        added = [n for n in names if n not in stock]
        assert added == [pass_name] + (["RematTimeline"] if switch == "remat" else [])
    # On CUDA, FuseAttention and InlineKernelIntermediates are left to dlight.
    cuda = _all_names(pipeline_phases(CUDA))
    assert not {"FuseAttention", "InlineKernelIntermediates", "FuseIntoSoleReader"} & set(cuda)
    assert cuda.index("PlanMemory") < cuda.index("RewriteCUDAGraph")


def test_gemm_dispatch_is_on_by_default_and_can_be_turned_off():
    assert "DispatchGemm" not in _all_names(pipeline_phases("llvm", dispatch_gemm=False))
    phases = pipeline_phases("llvm")
    finalize = _names(phases["finalize"])
    assert finalize.index("DispatchGemm") == finalize.index("RematTimeline") + 1
    assert finalize[-4:] == [
        "DispatchGemm",
        "ExpandMathIntrinsics",
        "LowerRuntimeBuiltin",
        "ComputePrimValue",
    ]
    assert _all_names(phases).count("DispatchGemm") == 1
    assert "MarkGemmKernels" not in _all_names(phases)
    # On CUDA the kernels are marked before dlight schedules them, dispatched at the same place.
    cuda = pipeline_phases(CUDA)
    legalize = _names(cuda["legalize"])
    assert legalize.index("MarkGemmKernels") == legalize.index("ApplyDefaultSchedule") - 1
    assert _names(cuda["finalize"])[-3:] == [
        "DispatchGemm",
        "LowerRuntimeBuiltin",
        "ComputePrimValue",
    ]
    assert "MarkGemmKernels" not in _all_names(pipeline_phases(CUDA, dispatch_gemm=False))


def test_stages_compose_and_reject_bad_names():
    fused = lower_to_memory_stage(Small, "llvm", stop_before="dataflow_lower", schedule=True)
    assert any(isinstance(b, relax.DataflowBlock) for b in fused["main"].body.blocks)
    rest = lower_to_memory_stage(fused, "llvm", start_at="dataflow_lower", schedule=True)
    tvm.ir.assert_structural_equal(rest, lower_to_memory_stage(Small, "llvm", schedule=True))
    with pytest.raises(ValueError, match="unknown pipeline phase 'fusion'"):
        lower_to_memory_stage(Small, "llvm", stop_before="fusion")
    with pytest.raises(ValueError, match="runs after"):
        lower_to_memory_stage(Small, "llvm", start_at="finalize", stop_before="legalize")
    with pytest.raises(TypeError, match=r"unknown pipeline options: \['schedul'\]"):
        lower_to_memory_stage(Small, "llvm", schedul=True)
    with pytest.raises(TypeError, match="unknown pipeline options"):
        pipeline_phases("llvm", remat_option=None)
    with pytest.raises(ValueError, match="llvm and cuda"):
        get_pipeline("c")


# ------------------------------------------------------------------------------- the flags
def test_get_pipeline_keywords_are_the_pipeline_flags():
    """The documented keyword signature and the dataclass list the same flags and defaults."""
    params = inspect.signature(get_pipeline).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f.default for f in dataclasses.fields(PipelineFlags)}
    assert keywords == fields
    assert all(PipelineFlags.options_field(s) in fields for s in PipelineFlags.switches())
    assert PipelineFlags.defaults() == {s: keywords[s] for s in PipelineFlags.switches()}
    assert set(PipelineFlags.switches()) == {
        "schedule",
        "remat",
        "plan",
        "fold_broadcast",
        "softmax_backward",
        "simplify",
        "fold_scatter",
        "inline_kernels",
        "vectorize_softmax",
        "vectorize_score_grad",
        "vectorize_reductions",
        "recompute",
        "fuse_readers",
        "clone_generated",
        "fuse_attention",
        "dispatch_gemm",
        "expand_math",
        "check_dims",
    }
    assert PipelineFlags.stock(plan=True) == PipelineFlags(
        **{**dict.fromkeys(PipelineFlags.switches(), False), "plan": True}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        PipelineFlags().plan = False  # type: ignore[misc]


def test_variants_and_configs_cover_every_switch():
    variant_fields = {f.name for f in dataclasses.fields(Variant)}
    switches = PipelineFlags.switches("memory") + PipelineFlags.switches("graph")
    assert set(switches) <= variant_fields
    assert tuple(Variant("v").flags) == switches
    for switch in PipelineFlags.switches("graph"):
        on_by_default = PipelineFlags.defaults("graph")[switch]
        name = f"blade-relax-{'no' if on_by_default else 'with'}-{switch.replace('_', '-')}"
        assert get_config(name)
    # The differential reference is TVM's pipeline: no blade_relax pass, not even the check.
    target = tvm.target.Target("llvm")
    with target:
        reference = STOCK.pipeline(target)(Small)
    tvm.ir.assert_structural_equal(reference, stock_pipeline(target)(Small))


def test_host_is_llvm_for_this_machines_cpu():
    from tvm.target import codegen

    from blade_relax.pipeline import as_target, host_target
    from blade_relax.runtime.devices import device_for_target

    host = as_target("host")
    assert host.kind.name == "llvm"
    assert host.attrs["mcpu"] == codegen.llvm_get_system_cpu()
    assert str(host) == str(host_target())
    assert device_for_target("host").dlpack_device_type() == tvm.cpu().dlpack_device_type()
    assert "mcpu" not in as_target("llvm").attrs


def test_schedule_options_are_derived_from_the_passes_that_follow():
    from blade_relax.pipeline import derived_schedule_options
    from blade_relax.transform import FuseReaderOptions, RecomputeOptions, ScheduleOptions

    recompute = RecomputeOptions(max_chain=1)
    default = derived_schedule_options(PipelineFlags(recompute_options=recompute))
    assert (default.planner, default.recompute_after) == ("plan", True)
    assert default.recompute_options is recompute
    # A user's options keep their own fields; those that depend on the pipeline follow it.
    given = ScheduleOptions(planner="plan", recompute_after=True, max_versions=1)
    derived = derived_schedule_options(
        PipelineFlags(plan=False, recompute=False, schedule_options=given)
    )
    assert (derived.planner, derived.recompute_after, derived.max_versions) == ("static", False, 1)
    off = ScheduleOptions(recompute_after=False)
    assert not derived_schedule_options(PipelineFlags(schedule_options=off)).recompute_after
    # FuseIntoSoleReader follows on CPU targets only, with the pipeline's options.
    fuse = FuseReaderOptions(max_rounds=2)
    assert (default.fuse_readers, default.fuse_reader_options) == (True, None)
    flags = PipelineFlags(fuse_reader_options=fuse)
    assert derived_schedule_options(flags).fuse_reader_options is fuse
    assert not derived_schedule_options(flags, cpu=False).fuse_readers
    assert not derived_schedule_options(PipelineFlags(fuse_readers=False)).fuse_readers
    with pytest.raises(TypeError, match="fuse_reader_options must be FuseReaderOptions"):
        ScheduleOptions(fuse_reader_options=3)


def test_orders_are_scored_with_the_recompute_options_the_pipeline_runs(monkeypatch):
    """The schedule's trial runs of RecomputeCheapValues use the options the pipeline runs
    that pass with, not its defaults."""
    from blade_relax.bench import ModelSizes, build_workload
    from blade_relax.transform import RecomputeCheapValues, RecomputeOptions

    used = []
    original = RecomputeCheapValues.__init__

    def recording(self, options=None):
        used.append(options)
        original(self, options)

    monkeypatch.setattr(RecomputeCheapValues, "__init__", recording)
    sizes = ModelSizes(layers=1, hidden=32, intermediate=64, vocab=64, max_seq_len=128)
    mod = build_workload("mlp-train", sizes).graph.mod
    recompute = RecomputeOptions(max_chain=1, min_gap=3)
    flags = {**next(v for v in ALL_VARIANTS if v.name == "all").flags, "remat": False}
    lower_to_memory_stage(mod, "llvm", recompute_options=recompute, **flags)
    # The pipeline's own instance, then the schedule's trial runs.
    assert len(used) > 1 and all(options is recompute for options in used)

"""VectorizeScoreGrad: structure (Before / Expected), what it leaves alone, its workspace, and
results bit for bit against the unscheduled kernel, alone and in a training step."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.analysis.inplace_reuse import inplace_verdict
from blade_relax.analysis.workspace import kernel_workspace
from blade_relax.pipeline import PipelineFlags, pipeline_phases
from blade_relax.transform import ScoreGradOptions, VectorizeScoreGrad
from blade_relax.transform.inline_kernel_intermediates import inline_intermediates
from blade_relax.transform.rewrite_softmax_backward import score_grad_kernel
from blade_relax.transform.vectorize_score_grad import score_grad_scale, vectorized_score_grad

from ._kernels import LLVM
from ._steps import run_step, tiny_training_graph


# fmt: off
@T.prim_func(private=True, s_tir=True)
def before(a: T.Buffer((2, 4, 8), "float32"), v: T.Buffer((2, 20, 8), "float32"), p: T.Buffer((2, 4, 20), "float32"), r: T.Buffer((2, 4, 1), "float32"), softmax_grad: T.Buffer((2, 4, 20), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    NT_matmul = T.sblock_alloc_buffer((2, 4, 20))
    for i0, i1, i2 in T.grid(2, 4, 20):
        for k in range(8):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(a[v_i0, v_i1, v_k], v[v_i0, v_i2, v_k])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = NT_matmul[v_i0, v_i1, v_i2] + a[v_i0, v_i1, v_k] * v[v_i0, v_i2, v_k]
        with T.sblock("softmax_grad"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(p[v_i0, v_i1, v_i2], NT_matmul[v_i0, v_i1, v_i2], r[v_i0, v_i1, 0])
            T.writes(softmax_grad[v_i0, v_i1, v_i2])
            softmax_grad[v_i0, v_i1, v_i2] = p[v_i0, v_i1, v_i2] * (NT_matmul[v_i0, v_i1, v_i2] - r[v_i0, v_i1, 0]) * T.float32(0.5)


@T.prim_func(private=True, s_tir=True)
def expected(a: T.Buffer((2, 4, 8), "float32"), v: T.Buffer((2, 20, 8), "float32"), p: T.Buffer((2, 4, 20), "float32"), r: T.Buffer((2, 4, 1), "float32"), softmax_grad: T.Buffer((2, 4, 20), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    v_pad_local = T.sblock_alloc_buffer((2, 8, 32), scope="local")
    NT_matmul_pad_local = T.sblock_alloc_buffer((2, 4, 32), scope="local")
    for i0 in range(2):
        for i2_0 in T.serial(2, annotations={"pragma_loop_partition_hint": 1}):
            for ax0, ax1 in T.grid(16, 8):
                with T.sblock("v_pad"):
                    v0 = T.axis.spatial(2, i0)
                    v1 = T.axis.spatial(32, i2_0 * 16 + ax0)
                    v2 = T.axis.spatial(8, ax1)
                    T.reads(v[v0, v1, v2])
                    T.writes(v_pad_local[v0, v2, v1])
                    v_pad_local[v0, v2, v1] = T.if_then_else(v1 < 20, v[v0, v1, v2], T.float32(0.0))
            for i1 in range(4):
                for i2_1_init in T.vectorized(16):
                    with T.sblock("NT_matmul_init"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        v_i2 = T.axis.spatial(32, i2_0 * 16 + i2_1_init)
                        T.reads()
                        T.writes(NT_matmul_pad_local[v_i0, v_i1, v_i2])
                        NT_matmul_pad_local[v_i0, v_i1, v_i2] = T.float32(0.0)
                for k in range(8):
                    for i2_1 in T.vectorized(16):
                        with T.sblock("NT_matmul_update"):
                            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                            v_i2 = T.axis.spatial(32, i2_0 * 16 + i2_1)
                            v_k = T.axis.reduce(8, k)
                            T.reads(NT_matmul_pad_local[v_i0, v_i1, v_i2], a[v_i0, v_i1, v_k], v_pad_local[v_i0, v_k, v_i2])
                            T.writes(NT_matmul_pad_local[v_i0, v_i1, v_i2])
                            NT_matmul_pad_local[v_i0, v_i1, v_i2] = NT_matmul_pad_local[v_i0, v_i1, v_i2] + a[v_i0, v_i1, v_k] * v_pad_local[v_i0, v_k, v_i2]
                for ax0 in T.vectorized(16):
                    with T.sblock("softmax_grad"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        v_i2 = T.axis.spatial(20, i2_0 * 16 + ax0)
                        T.where(i2_0 * 16 + ax0 < 20)
                        T.reads(p[v_i0, v_i1, v_i2], NT_matmul_pad_local[v_i0, v_i1, v_i2], r[v_i0, v_i1, 0])
                        T.writes(softmax_grad[v_i0, v_i1, v_i2])
                        softmax_grad[v_i0, v_i1, v_i2] = p[v_i0, v_i1, v_i2] * (NT_matmul_pad_local[v_i0, v_i1, v_i2] - r[v_i0, v_i1, 0]) * T.float32(0.5)
# fmt: on


def _kernel(batch: int = 2, d: int = 8, scale: float | None = 0.5, inline: bool = True):
    """The score-gradient kernel over a symbolic length ``s``: ``batch`` batch axes (the first
    of extent 1, the others 2), queries ``2 * s`` (grouped heads), head dimension ``d``."""
    s = tirx.Var("s", "int64")
    lead = [tirx.IntImm("int64", 1 if i == 0 else 2) for i in range(batch)]
    d_ = tirx.IntImm("int64", d)
    one = tirx.IntImm("int64", 1)
    a = te.placeholder((*lead, 2 * s, d_), name="a")
    v = te.placeholder((*lead, s, d_), name="v")
    p = te.placeholder((*lead, 2 * s, s), name="p")
    r = te.placeholder((*lead, 2 * s, one), name="r")
    func = te.create_prim_func([a, v, p, r, score_grad_kernel(scale)(a, v, p, r)])
    func = func.with_attr("op_pattern", 4)
    return inline_intermediates(func)[0] if inline else func


def test_the_score_gradient_becomes_tiles(well_formed_checks):
    pass_ = VectorizeScoreGrad()
    out = pass_(tvm.IRModule({"k": before}))
    tvm.ir.assert_structural_equal(out["k"], expected)
    assert pass_.kernels == 1


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("scale", [None, 0.125])
def test_the_kernel_is_recognized_in_both_forms(inline, scale):
    assert score_grad_scale(_kernel(scale=scale, inline=inline)) == (True, scale)


def _other_kernels() -> list[tirx.PrimFunc]:
    """Kernels the pass must leave as they are: one that fused an ``exp`` into the epilogue
    (same buffers, blocks of the same names), a GEMM with no epilogue, a plain ``exp``."""
    s = tirx.Var("s", "int64")
    a = te.placeholder((2, s, 8), name="a")
    v = te.placeholder((2, s, 8), name="v")
    p = te.placeholder((2, s, s), name="p")
    r = te.placeholder((2, s, 1), name="r")
    k = te.reduce_axis((0, 8), name="k")
    gemm = te.compute(
        (2, s, s), lambda b, i, j: te.sum(a[b, i, k] * v[b, j, k], axis=k), "NT_matmul"
    )
    fused = te.compute(
        (2, s, s),
        lambda b, i, j: p[b, i, j] * tvm.tirx.exp(gemm[b, i, j] - r[b, i, 0]),
        "softmax_grad",
    )
    plain = te.compute((2, s, s), lambda b, i, j: tvm.tirx.exp(p[b, i, j]), "softmax_grad")
    return [
        te.create_prim_func([a, v, p, r, fused]),
        te.create_prim_func([a, v, gemm]),
        te.create_prim_func([p, plain]),
    ]


@pytest.mark.parametrize("index", range(3))
def test_other_kernels_are_left_alone(index):
    kernel = _other_kernels()[index]
    assert score_grad_scale(kernel) == (False, None)
    mod = tvm.IRModule({"k": kernel})
    pass_ = VectorizeScoreGrad()
    assert pass_(mod).same_as(mod)
    assert pass_.kernels == 0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        ScoreGradOptions(tile=12)
    with pytest.raises(ValueError, match="power of two"):
        ScoreGradOptions(tile=128)
    with pytest.raises(TypeError, match="expects ScoreGradOptions"):
        VectorizeScoreGrad(object())


def test_the_workspace_is_the_tile_and_its_accumulators():
    """``(d, tile)`` floats of ``V`` and ``tile`` accumulators per loop partition (the full
    tiles and the last one), of constant size; no parallel loop, so the figure is exact."""
    for d, tile in ((8, 16), (32, 16), (32, 8)):
        kernel = vectorized_score_grad(_kernel(d=d), tile)
        workspace = kernel_workspace(kernel, "k", LLVM)
        assert workspace.notes == ()
        total = sum(int(a.nbytes) for a in workspace.allocations)
        assert total == 2 * 4 * tile * (d + 1)
    assert kernel_workspace(_kernel(), "k", LLVM).allocations == ()


def test_the_gradient_may_still_be_written_over_p():
    """The epilogue reads ``P`` only at the element it stores: ``PlanMemory``'s in-place
    placement of ``dS`` over ``P`` stays allowed; over ``V`` (read by many elements) it is not."""
    kernel = vectorized_score_grad(_kernel())
    assert inplace_verdict(kernel, [2], 4).ok
    assert not inplace_verdict(kernel, [1], 4).ok


def _run(kernel: tirx.PrimFunc, arrays: list[np.ndarray]) -> np.ndarray:
    compiled = tvm.compile(tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")}), LLVM)
    tensors = [tvm.runtime.tensor(x) for x in arrays]
    compiled["k"](*tensors)
    return tensors[-1].numpy()


@pytest.mark.parametrize(
    ("batch", "d", "scale", "tile"), [(2, 8, 0.5, 16), (1, 32, None, 16), (0, 5, 0.25, 8)]
)
@pytest.mark.parametrize("s", [1, 5, 16, 33])
def test_results_are_the_unscheduled_kernels_bit_for_bit(batch, d, scale, tile, s):
    """Full tiles, a partial last tile, a length below one tile; no batch axis, one, two."""
    plain = _kernel(batch, d, scale)
    scheduled = vectorized_score_grad(plain, tile)
    assert scheduled is not plain
    lead = [1 if i == 0 else 2 for i in range(batch)]
    rng = np.random.default_rng(s)
    shapes = [(*lead, 2 * s, d), (*lead, s, d), (*lead, 2 * s, s), (*lead, 2 * s, 1)]
    arrays = [rng.standard_normal(x).astype("float32") for x in shapes]
    arrays.append(np.zeros((*lead, 2 * s, s), "float32"))
    np.testing.assert_array_equal(_run(scheduled, arrays), _run(plain, arrays))


def test_the_cpu_pipeline_runs_it_and_cuda_does_not():
    fused = [p.info.name for p in pipeline_phases("llvm")["fused"]]
    assert fused.index("VectorizeScoreGrad") == fused.index("VectorizeSoftmax") + 1
    assert "VectorizeScoreGrad" not in [
        p.info.name for p in pipeline_phases("llvm", vectorize_score_grad=False)["fused"]
    ]
    cuda = pipeline_phases({"kind": "cuda", "arch": "sm_90"})
    assert "VectorizeScoreGrad" not in [p.info.name for ph in cuda.values() for p in ph]


def test_a_training_step_is_the_same_bit_for_bit():
    """A two-layer Llama step with ``softmax_backward``: both layers' kernels are scheduled,
    the loss and every gradient are those of the unscheduled kernels, bit for bit, and the peak
    at s = 1024 is the same but for the kernels' workspace (``P`` still takes ``dS``)."""
    graph, sizes = tiny_training_graph("llama-train")
    peaks, outs, scheduled = [], [], []
    for on in (False, True):
        flags = {
            **PipelineFlags.defaults(),
            "schedule": False,
            "remat": False,
            "softmax_backward": True,
            "vectorize_score_grad": on,
        }
        stage, out = run_step(graph, sizes, flags)
        outs.append(out)
        scheduled.append(
            sum(
                "NT_matmul_pad_local" in f.script()
                for g, f in stage.functions.items()
                if g.name_hint.startswith("softmax_grad_NT_matmul")
            )
        )
        peaks.append(memory_timeline(stage["main"], mod=stage).evaluate({"s": 1024}).peak)
    assert scheduled[0] == 0 and scheduled[1] >= 1
    workspace = 2 * 4 * 16 * (sizes.hidden // sizes.heads + 1)
    assert peaks[0] <= peaks[1] <= peaks[0] + workspace, peaks
    for ours, theirs in zip(outs[1], outs[0]):
        np.testing.assert_array_equal(ours, theirs)

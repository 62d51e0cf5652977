# ruff: noqa: E501, F841
"""FoldBroadcastMatmul: a key or value shared by several query heads is read once by each
matmul, the heads as rows of one GEMM; the broadcast copy is not made; a broadcast of a tensor
to its own shape is the tensor; bit for bit the same results."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax import get_pipeline
from blade_relax.analysis import memory_timeline
from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage, pipeline_phases
from blade_relax.transform import BroadcastMatmulOptions, FoldBroadcastMatmul


# fmt: off
@I.ir_module
class MultiQuery:
    """Attention's scores and ``dQ`` with one key head for four query heads, as GPT-BigCode's
    ``key.expand(...)`` imports: expand_dims, broadcast_to, reshape, transpose, reshape."""

    @R.function
    def main(q: R.Tensor((4, "s", 8), "float32"), k: R.Tensor((1, 1, "s", 8), "float32"), ds: R.Tensor((4, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            k1 = R.expand_dims(k, axis=[2])
            k2 = R.broadcast_to(k1, R.shape([1, 1, 4, s, 8]))
            k3 = R.reshape(k2, R.shape([1, 4, s, 8]))
            kt = R.permute_dims(k3, axes=[0, 1, 3, 2])
            kt2 = R.reshape(kt, R.shape([4, 8, s]))
            scores = R.matmul(q, kt2, out_dtype="float32")
            p = R.nn.softmax(scores, axis=-1)
            kt3 = R.permute_dims(kt2, axes=[0, 2, 1])
            dq0 = R.matmul(ds, kt3, out_dtype="float32")
            dq = R.multiply(dq0, R.const(2.0, "float32"))
            R.output(p, dq)
        return (p, dq)


@I.ir_module
class MultiQueryExpected:
    @R.function
    def main(q: R.Tensor((4, "s", 8), "float32"), k: R.Tensor((1, 1, "s", 8), "float32"), ds: R.Tensor((4, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            q_rows = R.reshape(q, R.shape([4 * s, 8]))
            key = R.reshape(k, R.shape([s, 8]))
            key_t = R.permute_dims(key, axes=[1, 0])
            scores_rows = R.matmul(q_rows, key_t, out_dtype="float32")
            scores = R.reshape(scores_rows, R.shape([4, s, s]))
            p = R.nn.softmax(scores, axis=-1)
            ds_rows = R.reshape(ds, R.shape([4 * s, s]))
            key2 = R.reshape(k, R.shape([s, 8]))
            dq_rows = R.matmul(ds_rows, key2, out_dtype="float32")
            dq0 = R.reshape(dq_rows, R.shape([4, s, 8]))
            dq = R.multiply(dq0, R.const(2.0, "float32"))
            R.output(p, dq)
        return (p, dq)


@I.ir_module
class GroupedQuery:
    """``P @ V`` with two value heads for four query heads (``repeat_kv``)."""

    @R.function
    def main(p: R.Tensor((1, 4, "s", "s"), "float32"), v: R.Tensor((1, 2, "s", 8), "float32")):
        s = T.int64()
        with R.dataflow():
            v1 = R.expand_dims(v, axis=[2])
            v2 = R.broadcast_to(v1, R.shape([1, 2, 2, s, 8]))
            v3 = R.reshape(v2, R.shape([1, 4, s, 8]))
            o = R.matmul(p, v3, out_dtype="float32")
            out = R.multiply(o, R.const(2.0, "float32"))
            R.output(out)
        return out


@I.ir_module
class GroupedQueryExpected:
    @R.function
    def main(p: R.Tensor((1, 4, "s", "s"), "float32"), v: R.Tensor((1, 2, "s", 8), "float32")):
        s = T.int64()
        with R.dataflow():
            p_rows = R.reshape(p, R.shape([1, 2, 2 * s, s]))
            o_rows = R.matmul(p_rows, v, out_dtype="float32")
            o = R.reshape(o_rows, R.shape([1, 4, s, 8]))
            out = R.multiply(o, R.const(2.0, "float32"))
            R.output(out)
        return out


@I.ir_module
class AttentionStep:
    """``P @ V`` as torch exports it (an ``expand`` of ``P`` to its own shape, a ``view``, a
    ``bmm``), and ``P`` read by the softmax's backward while the copy is live."""

    @R.function
    def main(scores: R.Tensor((1, 4, "s", "s"), "float32"), v: R.Tensor((4, "s", 8), "float32"), dp: R.Tensor((1, 4, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            p = R.nn.softmax(scores, axis=-1)
            p_copy = R.broadcast_to(p, R.shape([1, 4, s, s]))
            p_heads = R.reshape(p_copy, R.shape([4, s, s]))
            ds = R.multiply(p, dp)
            o = R.matmul(p_heads, v, out_dtype="float32")
            R.output(o, ds)
        return (o, ds)


@I.ir_module
class AttentionStepExpected:
    @R.function
    def main(scores: R.Tensor((1, 4, "s", "s"), "float32"), v: R.Tensor((4, "s", 8), "float32"), dp: R.Tensor((1, 4, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            p = R.nn.softmax(scores, axis=-1)
            p_heads = R.reshape(p, R.shape([4, s, s]))
            ds = R.multiply(p, dp)
            o = R.matmul(p_heads, v, out_dtype="float32")
            R.output(o, ds)
        return (o, ds)


@I.ir_module
class IdentityRefusals:
    """Broadcasts that are not removed: one to another dim (``t`` is not provably ``s``), one
    that broadcasts, and one bound to a variable that leaves the block."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), y: R.Tensor((1, 8), "float32")):
        s = T.int64()
        t = T.int64()
        with R.dataflow():
            x_t = R.match_cast(x, R.Tensor((t, 8), "float32"))
            to_other = R.broadcast_to(x, R.shape([t, 8]))
            widened = R.broadcast_to(y, R.shape([s, 8]))
            total = R.add(to_other, x_t)
            same = R.broadcast_to(widened, R.shape([s, 8]))
            R.output(total, same)
        return (total, same)
# fmt: on


def _unchanged(mod: tvm.IRModule) -> None:
    options = BroadcastMatmulOptions(identities=False)
    tvm.ir.assert_structural_equal(FoldBroadcastMatmul(options)(mod), mod)


def test_a_broadcast_to_its_own_shape_is_the_tensor(well_formed_checks):
    fold = FoldBroadcastMatmul()
    tvm.ir.assert_structural_equal(fold(AttentionStep), AttentionStepExpected)
    assert (fold.report.folded, fold.report.identities) == (0, 1)
    assert fold.last_result["main"].changes == ("1 copy of a tensor to its own shape removed",)


def test_broadcasts_that_are_not_identities_stay(well_formed_checks):
    fold = FoldBroadcastMatmul()
    tvm.ir.assert_structural_equal(fold(IdentityRefusals), IdentityRefusals)
    assert fold.report.identities == 0


def test_a_shared_key_is_read_once_by_both_matmuls(well_formed_checks):
    tvm.ir.assert_structural_equal(FoldBroadcastMatmul()(MultiQuery), MultiQueryExpected)


def test_grouped_heads_become_rows_of_one_gemm_per_group(well_formed_checks):
    tvm.ir.assert_structural_equal(FoldBroadcastMatmul()(GroupedQuery), GroupedQueryExpected)


def test_report_says_what_was_folded():
    fold = FoldBroadcastMatmul()
    fold(MultiQuery)
    assert fold.report.folded == 2
    (changed,) = fold.last_result.functions
    assert changed.function == "main"
    assert changed.changes == ("2 matmuls read a broadcast operand in place",)


def _module(lhs_shape, source_shape, full_shape, view_shape, *, swap=False, output=False):
    """``matmul(lhs, reshape(broadcast_to(x, full_shape), view_shape))`` (operands swapped
    with ``swap``), bound to a block output with ``output``, else read by a multiply."""
    bb = relax.BlockBuilder()
    s = tvm.tirx.Var("s", "int64")

    def shape(dims):
        return [s if d == "s" else d for d in dims]

    lhs = relax.Var("lhs", relax.TensorType(shape(lhs_shape), "float32"))
    x = relax.Var("x", relax.TensorType(shape(source_shape), "float32"))
    with bb.function("main", [lhs, x]):
        with bb.dataflow():
            full = bb.emit(relax.op.broadcast_to(x, shape(full_shape)))
            view = bb.emit(relax.op.reshape(full, shape(view_shape)))
            args = (view, lhs) if swap else (lhs, view)
            if output:
                out = bb.emit_output(relax.op.matmul(*args))
            else:
                product = bb.emit(relax.op.matmul(*args))
                out = bb.emit_output(relax.op.multiply(product, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def test_the_builder_makes_what_the_pass_folds():
    """The refusals below differ from this accepted case in one respect each."""
    mod = _module([4, "s", 8], [1, "s", 8], [4, "s", 8], [4, "s", 8])
    fold = FoldBroadcastMatmul()
    fold(mod)
    assert fold.report.folded == 1


@pytest.mark.parametrize(
    "case",
    [
        # The product leaves the block: restoring its shape would copy it.
        dict(
            lhs_shape=[4, "s", 8],
            source_shape=[1, "s", 8],
            full_shape=[4, "s", 8],
            view_shape=[4, "s", 8],
            output=True,
        ),
        # The broadcast operand on the left.
        dict(
            lhs_shape=[4, 8, "s"],
            source_shape=[1, "s", 8],
            full_shape=[4, "s", 8],
            view_shape=[4, "s", 8],
            swap=True,
        ),
        # A broadcast axis before a real one: its heads are not consecutive rows.
        dict(
            lhs_shape=[4, "s", 8],
            source_shape=[1, 2, "s", 8],
            full_shape=[2, 2, "s", 8],
            view_shape=[4, "s", 8],
        ),
        # The matrix axes broadcast themselves.
        dict(
            lhs_shape=[4, "s", 8],
            source_shape=[4, 1, 8],
            full_shape=[4, "s", 8],
            view_shape=[4, "s", 8],
        ),
        # The left operand's batch axes are not the right one's (a two-dimensional left).
        dict(
            lhs_shape=["s", 8],
            source_shape=[1, 8, "s"],
            full_shape=[4, 8, "s"],
            view_shape=[4, 8, "s"],
        ),
        # Nothing is broadcast.
        dict(
            lhs_shape=[4, "s", 8],
            source_shape=[4, "s", 8],
            full_shape=[4, "s", 8],
            view_shape=[4, "s", 8],
        ),
    ],
    ids=[
        "block-output",
        "left-operand",
        "inner-axis",
        "matrix-axes",
        "batch-mismatch",
        "no-broadcast",
    ],
)
def test_what_is_not_folded_passes_through(case, well_formed_checks):
    _unchanged(_module(**case))


def test_options():
    with pytest.raises(TypeError, match="BroadcastMatmulOptions"):
        FoldBroadcastMatmul(1)
    off = FoldBroadcastMatmul(BroadcastMatmulOptions(enabled=False))
    tvm.ir.assert_structural_equal(off(MultiQuery), MultiQuery)
    assert off.last_result.notes == ("disabled by its options",)
    kept = FoldBroadcastMatmul(BroadcastMatmulOptions(identities=False))
    tvm.ir.assert_structural_equal(kept(AttentionStep), AttentionStep)


def _stock_with(**flags):
    off = dict.fromkeys(PipelineFlags.switches(), False)
    return {**off, **flags}


@pytest.mark.parametrize("s", [1, 7, 64])
def test_the_copies_are_gone_and_results_are_bit_identical(s):
    """With ``SimplifyTransposes`` (as in the pipeline) the key is never copied. Unfolded, the
    broadcast ``[1, 1, 4, s, 8]`` is freed once transposed, and the transpose ``[1, 4, 8, s]``
    (128 s bytes) is live at the peak until ``dQ``; folded, neither exists."""
    peaks = {}
    outs = {}
    rng = np.random.default_rng(s)
    q = rng.standard_normal((4, s, 8)).astype("float32")
    k = rng.standard_normal((1, 1, s, 8)).astype("float32")
    ds = rng.standard_normal((4, s, s)).astype("float32")
    for fold in (False, True):
        flags = _stock_with(simplify=True, fold_broadcast=fold)
        stage = lower_to_memory_stage(MultiQuery, **flags)
        peaks[fold] = memory_timeline(stage["main"], mod=stage).evaluate({"s": s}).peak
        exe = tvm.compile(MultiQuery, "llvm", relax_pipeline=get_pipeline("llvm", **flags))
        vm = relax.VirtualMachine(exe, tvm.cpu())
        result = vm["main"](*(tvm.runtime.tensor(a) for a in (q, k, ds)))
        outs[fold] = [t.numpy() for t in result]
    assert peaks[True] == peaks[False] - 128 * s
    for ours, theirs in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(ours, theirs)


def _softmax_recomputations(func: relax.Function) -> int:
    return sum(
        b.var.name.endswith("_recompute") and "softmax" in b.value.args[0].name_hint
        for block in func.body.blocks
        for b in block.bindings
    )


@pytest.mark.parametrize(
    "workload, static, recomputed",
    [("gpt2-train", None, (1, 2)), ("llama-train", 40, (0, 2))],
    ids=["gpt2-unbounded", "llama-static"],
)
def test_every_layers_probabilities_are_recomputed_and_results_are_bit_identical(
    workload, static, recomputed
):
    """Two-layer training steps with their dims as the benchmark compiles them: GPT-2 with the
    length unbounded, Llama for one exact length. With the copies of ``P`` (and of the mask,
    and under the transposes) gone, ``RecomputeCheapValues`` recomputes both layers'
    probabilities for the backward, where it recomputed the first layer's only (GPT-2) or none
    (Llama); the peak is lower and higher nowhere, and the step computes the same bits. The
    blocks keep their imported order (``MemoryAwareSchedule`` off: the same verdicts, in a
    tenth of the time), and without a budget ``Rematerialize``'s plain copy is the function
    planned as it is (the pass off)."""
    pytest.importorskip("transformers")
    from blade_relax.bench.workloads import ModelSizes, build_workload
    from blade_relax.frontend import flatten_outputs
    from blade_relax.frontend.imported import specialize

    sizes = ModelSizes(
        layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
    )
    graph = build_workload(workload, sizes).graph.with_upper_bounds(False)
    mod, lengths, runs = graph.mod, [{"s": 8}, {"s": 40}, {"s": 64}], (3, 40)
    if static is not None:
        mod = specialize(tvm.IRModule({"main": graph.main}), {"s": static})
        lengths, runs = [{}], (static,)
    flags = {**PipelineFlags.defaults(), "schedule": False, "remat": False}
    params = [tvm.runtime.tensor(p) for p in graph.params]
    counts, peaks, outs = [], [], []
    for identities in (False, True):
        flags["fold_broadcast_options"] = BroadcastMatmulOptions(identities=identities)
        fused = lower_to_memory_stage(mod, stop_before="dataflow_lower", **flags)
        counts.append(_softmax_recomputations(fused["main"]))
        stage = lower_to_memory_stage(fused, start_at="dataflow_lower", **flags)
        timeline = memory_timeline(stage["main"], mod=stage)
        peaks.append([timeline.evaluate(dims).peak for dims in lengths])
        # The module the timeline read, built: the rest of the pipeline is VMShapeLower on.
        rest = tvm.transform.Sequential(pipeline_phases("llvm", **flags)["vm_lower"])
        vm = relax.VirtualMachine(tvm.compile(stage, "llvm", relax_pipeline=rest), tvm.cpu())
        outs.append([])
        for s in runs:
            ids = tvm.runtime.tensor(np.random.default_rng(s).integers(0, sizes.vocab, (1, s)))
            outs[-1] += [t.numpy() for t in flatten_outputs(vm["main"](ids, ids, *params))]
    assert tuple(counts) == recomputed
    assert all(ours <= theirs for ours, theirs in zip(peaks[1], peaks[0])), peaks
    assert peaks[1][-1] < peaks[0][-1], peaks
    for ours, theirs in zip(outs[1], outs[0]):
        np.testing.assert_array_equal(ours, theirs)

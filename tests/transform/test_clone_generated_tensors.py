# ruff: noqa: E501, F841
"""CloneGeneratedTensors: a tensor built from inputs alone is built again before later readers."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.pipeline import lower_to_memory_stage
from blade_relax.transform import CloneGeneratedTensors, CloneOptions
from blade_relax.transform.clone_generated_tensors import GENERATOR_OPS


# fmt: off
@I.ir_module
class Mask:
    """A causal mask read by two layers."""

    @R.function
    def main(x: R.Tensor((1, "s", "s"), "float32"), y: R.Tensor((1, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            rows = R.arange(0, s, 1, dtype="int64")
            col = R.expand_dims(rows, axis=[1])
            keep = R.greater_equal(col, rows)
            mask = R.where(keep, R.const(0.0, "float32"), R.const(-1e9, "float32"))
            a = R.add(x, mask)
            b = R.nn.softmax(a)
            c = R.add(y, mask)
            d = R.nn.softmax(c)
            e = R.add(b, d)
            R.output(e)
        return e


@I.ir_module
class MaskExpected:
    @R.function
    def main(x: R.Tensor((1, "s", "s"), "float32"), y: R.Tensor((1, "s", "s"), "float32")) -> R.Tensor((1, "s", "s"), dtype="float32"):
        s = T.int64()
        with R.dataflow():
            rows: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            col: R.Tensor((s, 1), dtype="int64") = R.expand_dims(rows, axis=[1])
            rows_for_2: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            keep: R.Tensor((s, s), dtype="bool") = R.greater_equal(col, rows_for_2)
            mask: R.Tensor((s, s), dtype="float32") = R.where(keep, R.const(0.0, "float32"), R.const(-1e9, "float32"))
            a: R.Tensor((1, s, s), dtype="float32") = R.add(x, mask)
            b: R.Tensor((1, s, s), dtype="float32") = R.nn.softmax(a, axis=-1)
            rows_for_6: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            col_for_6: R.Tensor((s, 1), dtype="int64") = R.expand_dims(rows_for_6, axis=[1])
            keep_for_6: R.Tensor((s, s), dtype="bool") = R.greater_equal(col_for_6, rows_for_6)
            mask_for_6: R.Tensor((s, s), dtype="float32") = R.where(keep_for_6, R.const(0.0, "float32"), R.const(-1e9, "float32"))
            c: R.Tensor((1, s, s), dtype="float32") = R.add(y, mask_for_6)
            d: R.Tensor((1, s, s), dtype="float32") = R.nn.softmax(c, axis=-1)
            e: R.Tensor((1, s, s), dtype="float32") = R.add(b, d)
            R.output(e)
        return e


@I.ir_module
class NotGenerated:
    """``h`` depends on a computed activation (a softmax, not a generator op); ``m`` is read
    after the block; ``n`` has one reader."""

    @R.function
    def main(x: R.Tensor(("s", 4), "float32")):
        s = T.int64()
        with R.dataflow():
            sm = R.nn.softmax(x)
            h = R.multiply(sm, R.const(2.0, "float32"))
            a = R.add(h, x)
            b = R.add(h, a)
            m = R.zeros(R.shape([s, 4]), dtype="float32")
            c = R.add(m, b)
            n = R.ones(R.shape([s, 4]), dtype="float32")
            d = R.add(n, c)
            R.output(d, m)
        return (d, m)
# fmt: on


def test_mask_is_built_again_for_the_later_layer():
    pass_ = CloneGeneratedTensors()
    tvm.ir.assert_structural_equal(pass_(Mask), MaskExpected)
    assert (pass_.report.cloned, pass_.report.copies) == (2, 2)


def test_computed_escaping_and_single_reader_values_stay():
    pass_ = CloneGeneratedTensors()
    assert pass_(NotGenerated).same_as(NotGenerated)
    assert pass_.report.copies == 0


def test_last_result_says_what_changed_per_function():
    pass_ = CloneGeneratedTensors()
    pass_(Mask)
    assert pass_.last_result["main"].changed
    assert pass_.last_result["main"].changes == (
        "2 generated tensors built again for later readers (2 copies)",
    )
    pass_(NotGenerated)
    assert not pass_.last_result.changed and not pass_.last_result["main"].changed


def test_options():
    assert CloneGeneratedTensors(CloneOptions(enabled=False))(Mask).same_as(Mask)
    # The mask's tree has four bindings: with at most three nothing but ``rows`` is cloned.
    small = CloneGeneratedTensors(CloneOptions(max_tree=3))
    small(Mask)
    assert small.report.cloned == 1
    with pytest.raises(ValueError, match="max_tree"):
        CloneOptions(max_tree=0)
    with pytest.raises(TypeError, match="CloneOptions"):
        CloneGeneratedTensors(3)
    assert "relax.matmul" not in GENERATOR_OPS


def test_fused_mask_is_not_materialized_and_results_are_equal():
    """After the CPU pipeline, no (s, s) mask buffer stays live from the first layer to the
    second: the copy is fused into the second reader."""

    def allocations(mod):
        lowered = lower_to_memory_stage(mod, "llvm")
        text = lowered["main"].script()
        return text.count("alloc_storage")

    assert allocations(CloneGeneratedTensors()(Mask)) <= allocations(Mask)
    rng = np.random.default_rng(0)
    for s in (1, 7):
        args = [rng.standard_normal((1, s, s)).astype("float32") for _ in range(2)]
        outs = []
        for mod in (Mask, CloneGeneratedTensors()(Mask)):
            vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
            outs.append(vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy())
        np.testing.assert_array_equal(outs[1], outs[0])


# fmt: off
@I.ir_module
class LossGradient:
    """The backward of a mean cross-entropy: the one-hot gradient ``g`` is built from the labels
    and ``1 / count``, a rank-0 tensor computed by a sum, and read by the row sum and by the
    subtraction. ``valid`` has two readers too, but no more elements than ``labels``."""

    @R.function
    def main(logits: R.Tensor(("n", 8), "float32"), labels: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            ls = R.nn.log_softmax(logits, axis=1)
            valid = R.not_equal(labels, R.const(-100, "int64"))
            ones = R.astype(valid, "float32")
            count = R.sum(ones)
            scale = R.divide(R.const(1.0, "float32"), count)
            col = R.expand_dims(labels, axis=[1])
            classes = R.arange(0, 8, 1, dtype="int64")
            hit = R.equal(col, classes)
            onehot = R.where(hit, R.const(-1.0, "float32"), R.const(0.0, "float32"))
            vcol = R.expand_dims(valid, axis=[1])
            w = R.where(vcol, scale, R.const(0.0, "float32"))
            g = R.multiply(onehot, w)
            rs = R.sum(g, axis=[1], keepdims=True)
            e = R.exp(ls)
            es = R.multiply(e, rs)
            out = R.subtract(g, es)
            R.output(out)
        return out


@I.ir_module
class LossGradientExpected:
    @R.function
    def main(logits: R.Tensor(("n", 8), dtype="float32"), labels: R.Tensor(("n",), dtype="int64")) -> R.Tensor(("n", 8), dtype="float32"):
        n = T.int64()
        with R.dataflow():
            ls: R.Tensor((n, 8), dtype="float32") = R.nn.log_softmax(logits, axis=1)
            valid: R.Tensor((n,), dtype="bool") = R.not_equal(labels, R.const(-100, "int64"))
            ones: R.Tensor((n,), dtype="float32") = R.astype(valid, dtype="float32")
            count: R.Tensor((), dtype="float32") = R.sum(ones, axis=None, keepdims=False)
            scale: R.Tensor((), dtype="float32") = R.divide(R.const(1.0, "float32"), count)
            col: R.Tensor((n, 1), dtype="int64") = R.expand_dims(labels, axis=[1])
            classes: R.Tensor((8,), dtype="int64") = R.arange(0, 8, 1, dtype="int64")
            hit: R.Tensor((n, 8), dtype="bool") = R.equal(col, classes)
            onehot: R.Tensor((n, 8), dtype="float32") = R.where(hit, R.const(-1.0, "float32"), R.const(0.0, "float32"))
            vcol: R.Tensor((n, 1), dtype="bool") = R.expand_dims(valid, axis=[1])
            w: R.Tensor((n, 1), dtype="float32") = R.where(vcol, scale, R.const(0.0, "float32"))
            g: R.Tensor((n, 8), dtype="float32") = R.multiply(onehot, w)
            rs: R.Tensor((n, 1), dtype="float32") = R.sum(g, axis=[1], keepdims=True)
            e: R.Tensor((n, 8), dtype="float32") = R.exp(ls)
            es: R.Tensor((n, 8), dtype="float32") = R.multiply(e, rs)
            # The whole tree again, reading the rank-0 ``scale``; the original is read by ``rs``.
            valid_for_15: R.Tensor((n,), dtype="bool") = R.not_equal(labels, R.const(-100, "int64"))
            col_for_15: R.Tensor((n, 1), dtype="int64") = R.expand_dims(labels, axis=[1])
            classes_for_15: R.Tensor((8,), dtype="int64") = R.arange(0, 8, 1, dtype="int64")
            hit_for_15: R.Tensor((n, 8), dtype="bool") = R.equal(col_for_15, classes_for_15)
            onehot_for_15: R.Tensor((n, 8), dtype="float32") = R.where(hit_for_15, R.const(-1.0, "float32"), R.const(0.0, "float32"))
            vcol_for_15: R.Tensor((n, 1), dtype="bool") = R.expand_dims(valid_for_15, axis=[1])
            w_for_15: R.Tensor((n, 1), dtype="float32") = R.where(vcol_for_15, scale, R.const(0.0, "float32"))
            g_for_15: R.Tensor((n, 8), dtype="float32") = R.multiply(onehot_for_15, w_for_15)
            out: R.Tensor((n, 8), dtype="float32") = R.subtract(g_for_15, es)
            R.output(out)
        return out


@I.ir_module
class Rotary:
    """Rotary tables ``cos`` and ``sin`` of ``concat`` of positions times frequencies, read by
    two heads."""

    @R.function
    def main(q: R.Tensor((1, "s", 4), "float32"), k: R.Tensor((1, "s", 4), "float32")):
        s = T.int64()
        with R.dataflow():
            pos = R.arange(0, s, 1, dtype="int64")
            p = R.expand_dims(pos, axis=[0, 2])
            pf = R.astype(p, "float32")
            f = R.multiply(pf, R.const([1.0, 0.5], "float32"))
            emb = R.concat((f, f), axis=-1)
            cos = R.cos(emb)
            sin = R.sin(emb)
            qr = R.add(R.multiply(q, cos), R.multiply(q, sin))
            kr = R.add(R.multiply(k, cos), R.multiply(k, sin))
            out = R.add(qr, kr)
            R.output(out)
        return out


@I.ir_module
class RotaryExpected:
    @R.function
    def main(q: R.Tensor((1, "s", 4), dtype="float32"), k: R.Tensor((1, "s", 4), dtype="float32")) -> R.Tensor((1, "s", 4), dtype="float32"):
        s = T.int64()
        with R.dataflow():
            pos: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            p: R.Tensor((1, s, 1), dtype="int64") = R.expand_dims(pos, axis=[0, 2])
            pf: R.Tensor((1, s, 1), dtype="float32") = R.astype(p, dtype="float32")
            f: R.Tensor((1, s, 2), dtype="float32") = R.multiply(pf, R.const([1.0, 0.5], "float32"))
            emb: R.Tensor((1, s, 4), dtype="float32") = R.concat((f, f), axis=-1)
            cos: R.Tensor((1, s, 4), dtype="float32") = R.cos(emb)
            pos_for_6: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            p_for_6: R.Tensor((1, s, 1), dtype="int64") = R.expand_dims(pos_for_6, axis=[0, 2])
            pf_for_6: R.Tensor((1, s, 1), dtype="float32") = R.astype(p_for_6, dtype="float32")
            f_for_6: R.Tensor((1, s, 2), dtype="float32") = R.multiply(pf_for_6, R.const([1.0, 0.5], "float32"))
            emb_for_6: R.Tensor((1, s, 4), dtype="float32") = R.concat((f_for_6, f_for_6), axis=-1)
            sin: R.Tensor((1, s, 4), dtype="float32") = R.sin(emb_for_6)
            lv: R.Tensor((1, s, 4), dtype="float32") = R.multiply(q, cos)
            lv1: R.Tensor((1, s, 4), dtype="float32") = R.multiply(q, sin)
            qr: R.Tensor((1, s, 4), dtype="float32") = R.add(lv, lv1)
            pos_for_10: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            p_for_10: R.Tensor((1, s, 1), dtype="int64") = R.expand_dims(pos_for_10, axis=[0, 2])
            pf_for_10: R.Tensor((1, s, 1), dtype="float32") = R.astype(p_for_10, dtype="float32")
            f_for_10: R.Tensor((1, s, 2), dtype="float32") = R.multiply(pf_for_10, R.const([1.0, 0.5], "float32"))
            emb_for_10: R.Tensor((1, s, 4), dtype="float32") = R.concat((f_for_10, f_for_10), axis=-1)
            cos_for_10: R.Tensor((1, s, 4), dtype="float32") = R.cos(emb_for_10)
            lv2: R.Tensor((1, s, 4), dtype="float32") = R.multiply(k, cos_for_10)
            pos_for_11: R.Tensor((s,), dtype="int64") = R.arange(0, s, 1, dtype="int64")
            p_for_11: R.Tensor((1, s, 1), dtype="int64") = R.expand_dims(pos_for_11, axis=[0, 2])
            pf_for_11: R.Tensor((1, s, 1), dtype="float32") = R.astype(p_for_11, dtype="float32")
            f_for_11: R.Tensor((1, s, 2), dtype="float32") = R.multiply(pf_for_11, R.const([1.0, 0.5], "float32"))
            emb_for_11: R.Tensor((1, s, 4), dtype="float32") = R.concat((f_for_11, f_for_11), axis=-1)
            sin_for_11: R.Tensor((1, s, 4), dtype="float32") = R.sin(emb_for_11)
            lv3: R.Tensor((1, s, 4), dtype="float32") = R.multiply(k, sin_for_11)
            kr: R.Tensor((1, s, 4), dtype="float32") = R.add(lv2, lv3)
            out: R.Tensor((1, s, 4), dtype="float32") = R.add(qr, kr)
            R.output(out)
        return out
# fmt: on


def test_loss_gradient_one_hot_is_built_for_each_reader():
    pass_ = CloneGeneratedTensors()
    tvm.ir.assert_structural_equal(pass_(LossGradient), LossGradientExpected)
    assert (pass_.report.cloned, pass_.report.copies) == (1, 1)


def test_rotary_tables_are_built_for_each_reader():
    pass_ = CloneGeneratedTensors()
    tvm.ir.assert_structural_equal(pass_(Rotary), RotaryExpected)
    assert (pass_.report.cloned, pass_.report.copies) == (3, 3)


def test_one_hot_gradient_is_never_materialized_and_results_are_equal():
    """Lowered for the CPU, the one-hot gradient is fused into the row sum and into the
    subtraction instead of being allocated at the size of the logits; the values are those of
    the unchanged module."""
    from blade_relax.analysis import memory_timeline

    peaks = {}
    for name, mod in (("before", LossGradient), ("after", CloneGeneratedTensors()(LossGradient))):
        lowered = lower_to_memory_stage(mod, "llvm", inline_kernels=True, plan=True)
        peaks[name] = memory_timeline(lowered["main"], mod=lowered).evaluate({"n": 64}).peak
    # Before: ``g`` (64 x 8 float32), the row sums ``rs`` and the result; after: the result,
    # ``rs`` and ``1 / count``.
    assert peaks == {"before": 2048 + 256 + 2048, "after": 2048 + 256 + 4}
    rng = np.random.default_rng(0)
    for n in (1, 5):
        logits = rng.standard_normal((n, 8)).astype("float32")
        labels = rng.integers(0, 8, n).astype("int64")
        labels[0] = -100
        outs = []
        for mod in (LossGradient, CloneGeneratedTensors()(LossGradient)):
            vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
            outs.append(vm["main"](tvm.runtime.tensor(logits), tvm.runtime.tensor(labels)).numpy())
        np.testing.assert_array_equal(outs[1], outs[0])

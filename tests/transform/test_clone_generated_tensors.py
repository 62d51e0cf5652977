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
class UpdatedBetween:
    """A transposed weight read before and after the weight's in-place update."""

    @T.prim_func(private=True, s_tir=True)
    def scale(w: T.Buffer((4, 4), "float32")):
        T.func_attr({"tir.noalias": True})
        for i, j in T.grid(4, 4):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] * T.float32(0.5)

    @R.function
    def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 4), "float32")):
        cls = UpdatedBetween
        with R.dataflow():
            wt = R.permute_dims(w)
            a = R.matmul(x, wt)
            w2 = R.call_tir_inplace(cls.scale, (w,), inplace_indices=[0], out_ty=R.Tensor((4, 4), "float32"))
            b = R.matmul(a, wt)
            c = R.add(b, w2)
            R.output(c)
        return c
# fmt: on


def test_no_copy_reads_a_parameter_after_its_update():
    """Built again before ``b``, ``wt`` would read ``w`` after ``scale`` wrote it: not copied."""
    clone = CloneGeneratedTensors()
    after = clone(UpdatedBetween)
    tvm.ir.assert_structural_equal(after, UpdatedBetween)
    assert clone.report.cloned == 0

"""Minimal programs for bugs the differential fuzzer found, one test per bug.

Each test is named after what it caught and checks the property that failed, on the smallest
program that showed it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.testing.differential import (
    STOCK,
    Variant,
    compile_checked,
    measure_call,
    outputs_equal,
    predicted_peak,
)

REMAT = Variant("remat", remat=True)


@I.ir_module
class ReshapeOfRelu:
    # Fuzz seed 1: the evict/regenerate pair around `a` made RematTimeline rebuild the
    # remat_begin call without a type ("The ty of Expr R.call_builtin_with_ctx(...) is missing").
    @R.function
    def main(x: R.Tensor(("n", "n"), "float32")):
        n = T.int64()
        with R.dataflow():
            a = R.nn.relu(x)
            b = R.reshape(a, R.shape([n * n]))
            c = R.permute_dims(x, [1, 0])
            R.output(b, c)
        return (c, b)


def test_remat_timeline_output_is_well_formed():
    # compile_checked raises IllFormedIR naming the pass when any pass leaves ill-formed IR.
    compiled = compile_checked(ReshapeOfRelu, REMAT)
    assert relax.analysis.check_well_formed(compiled.memory_stage)


@I.ir_module
class KeptEvictionCandidate:
    # Fuzz seed 27: `a` is evictable between its two readers; without a budget the remat
    # runtime keeps it in the frame's stash, so it stays live across `c`, but the timeline of
    # the final IR frees it at its kill after `evict` (seed 27: predicted 560 B, measured 700 B
    # at m=3; here 400 B against 500 B at m=1).
    # (A plain block, so that nothing fuses.)
    @R.function
    def main(x: R.Tensor((5, 5, "m"), "float32"), w: R.Tensor(("m", 2), "float32")):
        a = R.permute_dims(x, axes=[1, 0, 2])
        b = R.matmul(a, w)
        c = R.subtract(R.const(0.5, "float32"), b)
        d = R.mean(a, axis=[1], keepdims=True)
        return (d, c)


def test_timeline_predicts_remat_peak_without_budget():
    stock = compile_checked(KeptEvictionCandidate, STOCK)
    remat = compile_checked(KeptEvictionCandidate, REMAT)
    rng = np.random.default_rng(0)
    for m in (1, 3, 8):
        args = [
            rng.uniform(-1, 1, (5, 5, m)).astype("float32"),
            rng.uniform(-1, 1, (m, 2)).astype("float32"),
        ]
        expected = measure_call(relax.VirtualMachine(stock.executable, tvm.cpu()), args)
        got = measure_call(relax.VirtualMachine(remat.executable, tvm.cpu()), args)
        assert outputs_equal(expected.outputs, got.outputs) is None
        assert got.peak == predicted_peak(remat.memory_stage, {"m": m}), m

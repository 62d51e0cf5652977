"""Minimal programs for bugs the differential fuzzer found, one test per bug.

Each test is named after what it caught and checks the property that failed, on the smallest
program that showed it.
"""

from __future__ import annotations

import numpy as np
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
    # the final IR freed it at its kill after `evict` (seed 27: predicted 560 B, measured 700 B
    # at m=3; here 400 B against 500 B at m=1). The timeline now follows the tensor into the
    # frame (ValueEffect.keeps) and out of it at `regenerate` (ValueEffect.takes).
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
        expected = measure_call(stock.vm(), args)
        got = measure_call(remat.vm(), args)
        assert outputs_equal(expected.outputs, got.outputs) is None
        assert got.peak == predicted_peak(remat.memory_stage, {"m": m}), m


@I.ir_module
class EvictionAroundCall:
    # Fuzz seed 131: the remat metadata left out what a called Relax function allocates
    # (it marked itself inexact), yet the decision called budgets reachable that the call then
    # exceeded: at n=17, m=1 the budgets 98..101 B were "reachable" and the peak was 116 B.
    # The metadata now simulates the callee at the call site, and an inexact timeline never
    # calls a budget reachable.
    @R.function(private=True)
    def helper(p: R.Tensor(("h",), "float32")):
        with R.dataflow():
            e = R.exp(p)
            R.output(e)
        return e

    @R.function
    def main(x0: R.Tensor(("n",), "float32"), x1: R.Tensor(("m", 6), "float32")):
        m = T.int64()
        cls = EvictionAroundCall
        a = R.nn.relu(x1)
        g = cls.helper(x0)
        b = R.reshape(a, R.shape([m * 6]))
        return (b, g)


def test_reachable_budget_holds_around_a_call():
    remat = compile_checked(EvictionAroundCall, REMAT)
    vm = remat.vm()
    args = [np.linspace(-1, 1, 17, dtype="float32"), np.linspace(-1, 1, 6, dtype="float32")[None]]
    free = measure_call(remat.vm(), args)
    checked = 0
    for budget in range(free.peak // 2, free.peak + 1):
        got = measure_call(vm, args, budget)
        if got.decision is not None and got.decision["reachable"]:
            checked += 1
            assert got.peak_absolute <= budget, (budget, got.decision)
    assert checked


def test_peak_of_a_range_versioned_main_is_read_from_the_copy_that_runs():
    # Fuzz seed 4925 (long run): MemoryAwareSchedule turned `main` into a dispatcher over range
    # copies (n <= 3, n >= 4); the harness read the dispatcher's timeline, whose `If` counts as
    # a fresh result, and predicted 88 B where 32 B were measured at n=2. `predicted_peak` now
    # reads the copy that runs at the given dims.
    from blade_relax.testing import program_from_seed
    from blade_relax.testing.differential import available_variants, check_program

    report = check_program(program_from_seed(4925), shapes=3, variants=available_variants())
    assert report.ok, report.describe()
    assert report.checks["peak"] >= 12
    assert report.checks.get("peak_skipped_control_flow", 0) == 0

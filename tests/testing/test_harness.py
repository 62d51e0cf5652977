"""The differential harness itself: each of its checks can fail, and says what failed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from blade_relax.pipeline import get_pipeline, lower_to_memory_stage, stock_pipeline
from blade_relax.testing import program_from_seed
from blade_relax.testing.differential import (
    STOCK,
    Builds,
    CompiledVariant,
    IllFormedIR,
    ProgramReport,
    Variant,
    _Case,
    _check_variant,
    check_program,
    compile_checked,
    measure_call,
    outputs_equal,
    predicted_peak,
)


def test_outputs_equal_is_bitwise():
    a = np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4)
    assert outputs_equal(a, a.copy()) is None
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(2))
    assert "(1, 2)" in outputs_equal(a, b)
    nan = a.copy()
    nan[0, 0] = np.nan
    assert outputs_equal(nan, nan.copy()) is None
    assert "float16" in outputs_equal(a, a.astype("float16"))
    assert "[4, 3]" in outputs_equal(a, a.T.copy())
    assert "tuple" in outputs_equal([a, a], [a])
    assert outputs_equal([a, [a]], [a.copy(), [a.copy()]]) is None


def _add_becomes_subtract() -> tvm.transform.Pass:
    @relax.expr_functor.mutator
    class Swap(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.add":
                return relax.op.subtract(*call.args)
            return call

    @tvm.transform.module_pass(opt_level=0, name="AddBecomesSubtract")
    def swap(mod, _ctx):
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod[gv] = Swap().visit_expr(func)
        return mod

    return swap


def _drop_first_binding() -> tvm.transform.Pass:
    """Leaves a use of a variable that is no longer defined."""

    @tvm.transform.module_pass(opt_level=0, name="DropFirstBinding")
    def drop(mod, _ctx):
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        func = mod["main"]
        block = func.body.blocks[0]
        cls = type(block)
        body = relax.SeqExpr([cls(block.bindings[1:]), *func.body.blocks[1:]], func.body.body)
        mod["main"] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
        return mod

    return drop


@I.ir_module
class AddChain:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), y: R.Tensor(("n", 4), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.add(a, y)
            c = R.multiply(b, a)
            R.output(c)
        return c


def _program():
    program = program_from_seed(0)
    program.mod = AddChain
    program.dims = (type(program.dims[0])("n", 1, 9),)
    program.ops = ["unary exp", "binary add", "binary multiply"]
    return program


def test_wrong_outputs_are_reported():
    broken = Variant(
        "broken",
        pipeline=lambda t: tvm.transform.Sequential(
            [_add_becomes_subtract(), get_pipeline(t, schedule=False, remat=False, plan=False)]
        ),
    )
    report = check_program(_program(), shapes=2, variants=[broken])
    kinds = {(f.kind, f.variant) for f in report.mismatches}
    assert kinds == {("outputs", "broken")}, report.describe()
    assert report.checks["outputs"] == 4  # stock and broken, two shapes each


def test_ill_formed_ir_names_the_pass():
    with pytest.raises(IllFormedIR) as info:
        compile_checked(
            AddChain,
            Variant(
                "broken",
                pipeline=lambda t: tvm.transform.Sequential(
                    [
                        _drop_first_binding(),
                        get_pipeline(t, schedule=False, remat=False, plan=False),
                    ]
                ),
            ),
        )
    # The first pass of the pipeline is handed the broken module.
    assert info.value.when == "before"
    assert "lv" in info.value.detail or "not defined" in info.value.detail


def test_memory_stage_is_what_lower_to_memory_stage_gives():
    for seed in (0, 4, 7):
        mod = program_from_seed(seed).mod
        compiled = compile_checked(mod, STOCK)
        tvm.ir.assert_structural_equal(compiled.memory_stage, lower_to_memory_stage(mod))


def test_variants_that_produce_one_module_share_its_build():
    builds = Builds()
    stock = compile_checked(AddChain, STOCK, builds=builds)
    # Nothing to schedule or plan differently in the chain: the stock module, the stock build.
    planned = compile_checked(AddChain, Variant("plan", plan=True), builds=builds)
    assert planned.executable is stock.executable
    # InlineKernelIntermediates rewrites the fused kernel: a module of its own, built.
    inlined = compile_checked(AddChain, Variant("inline", inline_kernels=True), builds=builds)
    assert inlined.executable is not stock.executable
    assert (
        compile_checked(AddChain, Variant("inline", inline_kernels=True), builds=builds).executable
        is inlined.executable
    )
    # Each shared build runs as its own build would.
    alone = compile_checked(AddChain, Variant("plan", plan=True))
    assert alone.executable is not stock.executable
    args = _program().arguments({"n": 5})
    shared_out, alone_out = (measure_call(c.vm(), args).outputs for c in (planned, alone))
    assert outputs_equal(alone_out, shared_out) is None


@I.ir_module
class AddChainWithTemp:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), y: R.Tensor(("n", 4), "float32")):
        with R.dataflow():
            a = R.exp(x)
            t = R.exp(y)
            b = R.add(a, t)
            c = R.multiply(b, a)
            R.output(c, t)
        return (c, t)


def test_peak_check_fails_on_a_wrong_prediction():
    good = compile_checked(AddChain, STOCK)
    dims = {"n": 7}
    args = _program().arguments(dims)
    vm = good.vm()
    measured = measure_call(vm, args)
    # One fused kernel: its output, and the two (n, 4) intermediates it allocates inside as
    # workspace while it runs (counted by both the timeline and the measurement).
    assert measured.peak == predicted_peak(good.memory_stage, dims) == 7 * 4 * 4 * 3
    del vm
    # The executable of one program with the IR of another, which also returns a temporary.
    other = compile_checked(AddChainWithTemp, STOCK).memory_stage
    assert predicted_peak(other, dims) > measured.peak
    report = ProgramReport(program=_program())
    wrong = CompiledVariant(Variant("wrong"), good.executable, other)
    case = _Case(dims, args, measured.outputs)
    _check_variant(report, wrong, [case], True, random.Random(0), 0, tvm.cpu())
    assert [f.kind for f in report.mismatches] == ["peak"]
    assert str(measured.peak) in report.mismatches[0].detail


def test_stock_pipeline_checks_are_green_on_a_known_program():
    report = check_program(_program(), shapes=3, variants=[])
    assert report.ok, report.describe()
    assert report.checks["outputs"] == 3 and report.checks["peak"] == 3
    assert report.checks["leak"] == 1
    # The checks ran the stock pipeline's executable; it computes what numpy does.
    exe = tvm.compile(AddChain, "llvm", relax_pipeline=stock_pipeline())
    x, y = (np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4) * k for k in (1, 2))
    out = tvm.relax.VirtualMachine(exe, tvm.cpu())["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(y)
    )
    np.testing.assert_allclose(out.numpy(), (np.exp(x) + y) * np.exp(x), rtol=1e-6)

"""Bad input and faults: clear errors, best effort under impossible budgets, no corruption.

The workload is the built-in MLP training step (dynamic batch ``b``): at ``b = 32`` the remat
runtime evicts one activation for budgets a little under the unconstrained peak and calls lower
budgets unreachable.
"""

from __future__ import annotations

import random
import threading
import warnings

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax import runtime
from blade_relax.frontend.builtin import mlp, mlp_training_step, random_arguments
from blade_relax.pipeline import get_pipeline
from blade_relax.testing.differential import (
    STOCK,
    Variant,
    compile_checked,
    measure_call,
    outputs_equal,
)
from blade_relax.testing.program_gen import COPY_PACKED_FUNC

ALL = Variant("all", schedule=True, remat=True, plan=True)
# A narrow input and a wide hidden layer: activations that rematerialization can trade,
# whatever order the scheduler picks (the eviction asserts below check it).
TRAIN_SIZES = {"hidden": 16, "intermediate": 128}


@pytest.fixture(scope="module")
def train():
    """The training step compiled by the stock pipeline and by every pass together."""
    mod = mlp_training_step(**TRAIN_SIZES)
    return mod, compile_checked(mod, STOCK), compile_checked(mod, ALL)


def _vm(compiled):
    # measure_call counts the kernels' workspaces of a VM made this way, as the timeline and
    # the remat runtime's decision do.
    return compiled.vm()


def _unconstrained(train, b=32):
    mod, stock, blade = train
    args = random_arguments(mod["main"], {"b": b})
    expected = measure_call(_vm(stock), args).outputs
    # A fresh VM holds nothing from an earlier call: peaks are then relative to zero.
    free = measure_call(_vm(blade), args)
    assert outputs_equal(expected, free.outputs) is None
    return args, expected, free


# ----------------------------------------------------------------------------- dims out of range
def _bounded_mlp():
    mod = mlp(8, 16)
    main = mod["main"].with_attr("tir_var_upper_bound", {"s": 16})
    mod["main"] = main.with_attr("tir_var_lower_bound", {"s": 2})
    return mod


# Our pipelines, each with the dim-range check on (the default), also with every pass off.
CHECKED = (
    Variant("checks-only"),
    Variant("schedule", schedule=True),
    Variant("remat", remat=True),
    Variant("plan", plan=True),
    ALL,
)
# What the VM may run before the check fails: its shape-matching prologue and the check itself
# (the condition computed by a ComputePrimValue host function, then the assertion).
_PROLOGUE = (
    "vm.builtin.alloc_shape_heap",
    "vm.builtin.check_tensor_info",
    "vm.builtin.match_shape",
    "vm.builtin.make_prim_value",
    "shape_func",
    "compute_symbolic_expr",
    "relax.run.assert_op",
)


@pytest.fixture(scope="module")
def bounded_compiled():
    """The bounded MLP compiled once per variant (the tests share them)."""
    cache: dict[str, object] = {}

    def get(variant):
        if variant.name not in cache:
            cache[variant.name] = compile_checked(_bounded_mlp(), variant)
        return cache[variant.name]

    return get


def _calls_until_error(vm, args, match):
    calls = []

    def instrument(func, name, before_run, ret_value, *iargs):
        if before_run:
            calls.append(name)

    vm.set_instrument(instrument)
    with pytest.raises(Exception, match=match) as info:
        vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return calls, str(info.value)


@pytest.mark.parametrize("variant", CHECKED, ids=lambda v: v.name)
@pytest.mark.parametrize("s", [1, 17])
def test_dim_outside_declared_range_is_a_clear_error(bounded_compiled, variant, s):
    mod = _bounded_mlp()
    vm = _vm(bounded_compiled(variant))
    args = random_arguments(mod["main"], {"s": s})
    calls, message = _calls_until_error(
        vm, args, rf"dim s = {s} is outside its declared range \[2, 16\]"
    )
    assert "storage allocation failure" not in message
    # Nothing but the shape prologue and the check ran: no allocation, no kernel.
    assert calls and calls[-1] == "relax.run.assert_op", calls
    ran = [c for c in calls if not c.startswith(_PROLOGUE)]
    assert ran == [], f"ran before the error: {ran}"


def test_stock_pipeline_has_no_dim_check():
    """The baseline stays TVM's: below the lower bound it runs, silently."""
    mod = _bounded_mlp()
    out = measure_call(_vm(compile_checked(mod, STOCK)), random_arguments(mod["main"], {"s": 1}))
    assert out.outputs.shape == (1, 8)


# The "plan" variant's passes (the Variant's flags switch every other pass off).
CHECKED_PLAN_FLAGS = Variant("plan", plan=True).flags


def test_dim_check_adds_no_allocation_and_keeps_the_predicted_peak(bounded_compiled):
    from blade_relax.analysis import memory_timeline

    mod = _bounded_mlp()
    unchecked = {
        "checks-only": STOCK,
        "plan": Variant(
            "plan-unchecked",
            pipeline=lambda t: get_pipeline(t, **{**CHECKED_PLAN_FLAGS, "check_dims": False}),
        ),
    }
    for name, without in unchecked.items():
        checked = bounded_compiled(next(v for v in CHECKED if v.name == name))
        plain = compile_checked(mod, without)
        for s in (2, 9, 16):
            args = random_arguments(mod["main"], {"s": s})
            a, b = measure_call(_vm(checked), args), measure_call(_vm(plain), args)
            assert outputs_equal(b.outputs, a.outputs) is None
            assert a.peak == b.peak, (name, s)
            # The timeline of the IR the VM runs counts the check as no memory.
            predicted = [
                memory_timeline(c.memory_stage["main"], mod=c.memory_stage).evaluate({"s": s}).peak
                for c in (checked, plain)
            ]
            assert predicted == [a.peak, a.peak], (name, s, predicted)


def _bounded_training_step():
    mod = mlp_training_step(**TRAIN_SIZES)
    mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {"b": 32})
    return mod


def test_training_step_with_remat_checks_before_the_remat_runtime(train):
    mod = _bounded_training_step()
    compiled = compile_checked(mod, ALL)
    # The same passes as ALL, without the check.
    unchecked = compile_checked(
        mod,
        Variant("all-unchecked", pipeline=lambda t: get_pipeline(t, check_dims=False, **ALL.flags)),
    )
    _, reference, _ = train
    # Inside the range: the values of the unbounded step, and the bytes, evictions and remat
    # decision of the same pipeline without the check, with and without a budget.
    args = random_arguments(mod["main"], {"b": 32})
    expected = measure_call(_vm(reference), args).outputs
    for budget in (None, 1):
        got = measure_call(_vm(compiled), args, budget=budget)
        plain = measure_call(_vm(unchecked), args, budget=budget)
        assert outputs_equal(expected, got.outputs) is None
        assert (got.peak, got.evictions) == (plain.peak, plain.evictions)
        if budget is not None:
            assert got.decision["predicted_peak"] == plain.decision["predicted_peak"]
    # Above it: the check fails before the remat runtime is asked for a decision.
    calls, _ = _calls_until_error(
        _vm(compiled),
        random_arguments(mod["main"], {"b": 33}),
        r"dim b = 33 is outside its declared range \(-inf, 32\]",
    )
    ran = [c for c in calls if not c.startswith(_PROLOGUE)]
    assert ran == [], f"ran before the error: {ran}"


def test_dims_inside_declared_range_run():
    mod = _bounded_mlp()
    stock, blade = _vm(compile_checked(mod, STOCK)), _vm(compile_checked(mod, ALL))
    for s in (2, 9, 16):
        args = random_arguments(mod["main"], {"s": s})
        assert (
            outputs_equal(measure_call(stock, args).outputs, measure_call(blade, args).outputs)
            is None
        )


# ----------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("bad", [0, -1, -(2**40)])
def test_zero_or_negative_budget_is_refused(bad):
    with runtime.set_memory_budget(4096):
        with pytest.raises(ValueError, match="positive"):
            runtime.set_memory_budget(bad)
        # The refused value changed nothing.
        assert runtime.get_memory_budget() == 4096
    assert runtime.get_memory_budget() is None


@pytest.mark.parametrize("bad", [1.5, True, "1024", [1]])
def test_budget_of_wrong_type_is_refused(bad):
    with pytest.raises(TypeError, match="integer"):
        runtime.set_memory_budget(bad)
    assert runtime.get_memory_budget() is None


def test_budget_below_lower_bound_warns_and_runs_best_effort(train):
    mod, stock, blade = train
    args, expected, free = _unconstrained(train)
    # Decisions are cached per program, and programs with equal metadata are one: another
    # compilation of this step in an earlier test may have decided for this budget already.
    for program in runtime.remat_programs().values():
        program._decisions.clear()
    vm = _vm(blade)
    # measure_call records the warnings raised during the call.
    first = measure_call(vm, args, budget=1)
    assert not first.decision["cached"]
    assert first.budget_warnings == 1
    assert outputs_equal(expected, first.outputs) is None
    decision = first.decision
    assert decision is not None and not decision["reachable"]
    # Best effort: the smallest peak the decision can reach, exactly what was measured, and
    # never above the unconstrained one (the schedule's order already peaks at what evictions
    # reach on this step: the eviction brings the rewritten copy down to it).
    assert first.evictions >= 1
    assert first.peak_absolute == decision["predicted_peak"]
    assert first.peak <= free.peak
    # Repeating the call: a decision is made once per shape and budget (and bytes live at the
    # call), so the warning comes once; by the third call the decision is cached and silent.
    second = measure_call(vm, args, budget=1)
    assert second.budget_warnings == (0 if second.decision["cached"] else 1)
    again = measure_call(vm, args, budget=1)
    assert again.budget_warnings == 0 and again.decision["cached"]
    assert outputs_equal(expected, again.outputs) is None
    assert again.peak_absolute == again.decision["predicted_peak"]


def test_budget_changed_between_calls(train):
    mod, stock, blade = train
    args, expected, free = _unconstrained(train)
    vm = _vm(blade)
    measure_call(vm, args)  # the VM now holds the outputs of a call, as in steady use
    # What the runtime counts as live when a budgeted call starts, then a budget just under
    # the unconstrained peak on top of it: one eviction reaches it.
    entry = measure_call(vm, args, 2**40).decision["live_at_entry"]
    tight = entry + int(free.peak * 0.95)
    seen = []
    for budget in (None, entry + 2 * free.peak, tight, 1, tight, None):
        m = measure_call(vm, args, budget)
        # One warning per decision made for an unreachable budget (none for a cached one).
        unreachable = m.decision is not None and not m.decision["reachable"]
        assert m.budget_warnings == (1 if unreachable and not m.decision["cached"] else 0)
        assert outputs_equal(expected, m.outputs) is None
        if budget is None:
            assert m.decision is None and m.evictions == 0
            assert m.peak == free.peak
        else:
            assert m.decision["budget"] == budget
            if m.decision["reachable"]:
                assert m.peak_absolute <= budget
        seen.append((budget, m.evictions))
    assert seen[1][1] == 0, "a budget above the peak evicts nothing"
    assert seen[2][1] >= 1 and seen[4][1] == seen[2][1], "the tight budget evicts, every time"


def test_two_threads_two_budgets_do_not_see_each_other(train):
    mod, stock, blade = train
    args, expected, free = _unconstrained(train)
    calls = 15
    barrier = threading.Barrier(2)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def worker(name, budget_fraction):
        try:
            vm = _vm(blade)
            barrier.wait()
            out = []
            budget = None if budget_fraction is None else int(free.peak * budget_fraction)
            for _ in range(calls):
                out.append((budget, measure_call(vm, args, budget)))
            results[name] = out
        except BaseException as err:  # surfaced in the main thread
            errors.append(err)

    threads = [
        threading.Thread(target=worker, args=("free", None)),
        threading.Thread(target=worker, args=("tight", 0.95)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for _budget, m in results["free"]:
        assert outputs_equal(expected, m.outputs) is None
        assert m.evictions == 0 and m.decision is None
        # Only this thread's allocations: the unconstrained peak, to the byte.
        assert m.peak == free.peak
    for budget, m in results["tight"]:
        assert outputs_equal(expected, m.outputs) is None
        assert m.decision["budget"] == budget
        assert m.peak_absolute == m.decision["predicted_peak"]
        if m.decision["reachable"]:
            assert m.peak_absolute <= budget
    # The fresh thread starts with nothing live: its first call must evict to fit.
    assert results["tight"][0][1].evictions >= 1
    assert runtime.get_memory_budget() is None  # the threads' budgets stayed in the threads


# ----------------------------------------------------------------------------- faults
class InjectedFault(RuntimeError):
    pass


@pytest.mark.parametrize("when", ["before", "after"])
def test_exception_in_regeneration_propagates_without_leak(train, when):
    mod, stock, blade = train
    args, expected, free = _unconstrained(train)
    name = "blade_relax.regenerate"
    original = tvm.get_global_func(name)
    calls = []

    def failing(*fargs):
        calls.append(when)
        if when == "after":
            original(*fargs)  # the regenerated tensor exists, then the fault
        raise InjectedFault(f"injected fault {when} regeneration")

    base = runtime.memory_stats()["live_bytes"]
    tvm.register_global_func(name, failing, override=True)
    try:
        vm = _vm(blade)  # binds the failing builtin
        tensors = [tvm.runtime.tensor(a) for a in args]
        with runtime.set_memory_budget(base + int(free.peak * 0.95)):
            with pytest.raises(Exception, match=f"injected fault {when} regeneration"):
                vm["main"](*tensors)
        assert calls, "the call never reached a regeneration"
        del vm
    finally:
        tvm.register_global_func(name, original, override=True)
    assert runtime.memory_stats()["live_bytes"] == base, "storage leaked by the failed call"
    # The runtime is not left in a broken state: a new VM computes the right values.
    again = measure_call(_vm(blade), args, budget=base + int(free.peak * 0.95))
    assert outputs_equal(expected, again.outputs) is None
    assert again.regenerations >= 1


def test_thousand_calls_with_random_shapes_do_not_leak(train):
    mod, stock, blade = train
    rng = random.Random(0)
    base = runtime.memory_stats()["live_bytes"]
    vm = _vm(blade)
    inputs = {
        b: [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], {"b": b})]
        for b in (1, 2, 3, 5, 8, 13, 21, 32)
    }
    retained = set()
    for i in range(1000):
        b = rng.choice(sorted(inputs))
        budget = rng.choice([None, None, 1, 2**30, base + 30000 + rng.randrange(30000)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", runtime.RematBudgetWarning)
            with runtime.set_memory_budget(budget):
                out = vm["main"](*inputs[b])
        loss, grads = out[0], out[1]
        out_bytes = sum(t.numpy().nbytes for t in (loss, grads[0], grads[1]))
        del out, loss, grads
        # Between calls the VM keeps only the outputs of the last call.
        live = runtime.memory_stats()["live_bytes"] - base
        assert live <= out_bytes, (i, b, budget, live, out_bytes)
        retained.add(live)
    del vm
    assert runtime.memory_stats()["live_bytes"] == base
    # Bounded by one call's outputs (the two weight gradients and the loss), never growing.
    assert max(retained) == 2 * 32 * 64 * 4 + 4


# ----------------------------------------------------------------------------- unknown ops
def _observe(tensor):
    """An impure packed function the passes know nothing of."""
    del tensor


tvm.register_global_func("blade_relax.testing.observe", _observe, override=True)


@I.ir_module
class UnknownOps:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        with R.dataflow():
            a = R.call_dps_packed(COPY_PACKED_FUNC, (x,), out_ty=R.Tensor((n, 4), "float32"))
            b = R.call_dps_packed(COPY_PACKED_FUNC, (a,), out_ty=R.Tensor((n, 4), "float32"))
            R.output(b)
        _ = R.call_packed("blade_relax.testing.observe", b, ty_args=R.Tuple())
        c = R.call_dps_packed(COPY_PACKED_FUNC, (b,), out_ty=R.Tensor((n, 4), "float32"))
        return c


_OUR_PASSES = ("MemoryAwareSchedule", "Rematerialize")


def test_unknown_ops_are_left_unchanged():
    seen = {}

    @tvm.instrument.pass_instrument
    class Capture:
        def run_before_pass(self, mod, info):
            if info.name in _OUR_PASSES:
                seen[info.name] = [mod]

        def run_after_pass(self, mod, info):
            if info.name in _OUR_PASSES:
                seen[info.name].append(mod)

    from blade_relax.pipeline import get_pipeline

    with tvm.transform.PassContext(opt_level=3, instruments=[Capture()]):
        tvm.compile(UnknownOps, "llvm", relax_pipeline=get_pipeline("llvm"))
    assert set(seen) == set(_OUR_PASSES)
    for before, after in seen.values():
        tvm.ir.assert_structural_equal(after, before)

    # And the whole pipeline (PlanMemory included) computes what stock TVM computes.
    stock, blade = compile_checked(UnknownOps, STOCK), compile_checked(UnknownOps, ALL)
    args = [np.arange(12, dtype="float32").reshape(3, 4)]
    expected = measure_call(_vm(stock), args)
    got = measure_call(_vm(blade), args)
    assert outputs_equal(expected.outputs, got.outputs) is None
    np.testing.assert_array_equal(got.outputs, args[0])
    assert got.peak <= expected.peak

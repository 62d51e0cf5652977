"""Rematerialization end to end: identical loss and gradients, measured bytes vs the budget.

A Relax-native MLP training step (``relax.transform.Gradient``, dynamic batch ``n``) is compiled
with and without ``Rematerialize`` and run at several batch sizes under budgets of 0.9, 0.7 and
0.5 times the no-budget peak.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.analysis import compile_keeping_module, memory_timeline
from blade_relax.contract import REMAT_META_ATTR
from blade_relax.runtime import (
    RematBudgetWarning,
    last_remat_decision,
    measure_call,
    remat_programs,
)
from blade_relax.testing.differential import Variant, compile_checked
from blade_relax.transform import RematOptions, version_for

LAYERS, WIDTH = 4, 32
LENGTHS = (7, 64, 300)
BUDGETS = (0.9, 0.7, 0.5)


def _mlp_training_step() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, WIDTH], "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType([WIDTH, WIDTH], "float32")) for i in range(LAYERS)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            h = x
            for w in ws:
                h = bb.emit(relax.op.tanh(relax.op.matmul(h, w)))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(h, h)))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=ws)(bb.get())
    return relax.transform.DeadCodeElimination(["main_adjoint"])(mod)


@pytest.fixture(scope="module")
def executables():
    mod = _mlp_training_step()
    variants = {
        "reference": dict(schedule=False, remat=False, plan=False),
        "plan": dict(schedule=False, remat=False, plan=True),
        "remat": dict(schedule=False, remat=True, plan=True),
        "remat-stock-plan": dict(schedule=False, remat=True, plan=False),
        "remat-own-storage": dict(
            schedule=False,
            remat=True,
            plan=False,
            remat_options=RematOptions(own_storage_fraction=0.0),
        ),
    }
    # Each executable with its kernels' workspace table: the measured peaks count the kernels'
    # workspaces, as the timeline and the remat runtime's decision do.
    return {
        name: compile_keeping_module(mod, "llvm", blade_relax.get_pipeline("llvm", **flags))
        for name, flags in variants.items()
    }


def _run(compiled, args, budget=None):
    """One call of ``main_adjoint`` on a fresh VM: the loss and gradients, and the measurement.

    ``measure_call`` counts what the call adds to the bytes this thread already holds (tensors
    an earlier test keeps alive are not the call's), and ``budget`` is the bytes the call may
    add on top of them.
    """
    measured = measure_call(
        compiled.executable,
        args,
        function="main_adjoint",
        budget=budget,
        workspaces=compiled.workspaces,
    )
    loss, gradients = measured.outputs
    return [loss, *gradients], measured


def _args(n: int):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, WIDTH)).astype("float32")
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype("float32") for _ in range(LAYERS)]
    return [tvm.runtime.tensor(a) for a in (x, *ws)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def remat_memory_stage():
    # The IR the "remat" executable runs: the same pipeline, stopped before VMShapeLower.
    pipeline = Variant(
        "remat",
        pipeline=lambda t: blade_relax.get_pipeline(t, schedule=False, remat=True, plan=True),
    )
    return compile_checked(_mlp_training_step(), pipeline, well_formed=False).memory_stage


def test_dispatch_names_the_copy_that_runs(remat_memory_stage):
    low = remat_memory_stage
    assert version_for(low, "main_adjoint", {"n": 7}) == "main_adjoint__plain"
    assert version_for(low, "main_adjoint", {"n": 7}, budget=True) == "main_adjoint__remat"
    assert REMAT_META_ATTR in low["main_adjoint__remat"].attrs
    assert REMAT_META_ATTR not in low["main_adjoint__plain"].attrs


@pytest.mark.parametrize("n", LENGTHS)
def test_no_budget_runs_the_plain_copy(executables, remat_memory_stage, n):
    args = _args(n)
    reference, _ = _run(executables["reference"], args)
    planned, planned_run = _run(executables["plan"], args)
    values, run = _run(executables["remat"], args)
    assert _same(values, reference) and _same(planned, reference)
    assert run.evictions == run.regenerations == 0
    # Without a budget the dispatcher calls the unrewritten copy: the runtime makes no
    # decision (measure_call cleared the last one before the call), and the call peaks where
    # the same pipeline without Rematerialize does.
    assert last_remat_decision() is None
    assert run.peak_bytes == planned_run.peak_bytes
    # The timeline of the copy that runs predicts the bytes the VM allocates.
    low = remat_memory_stage
    plain = low[version_for(low, "main_adjoint", {"n": n})]
    assert memory_timeline(plain, mod=low).evaluate({"n": n}).peak == run.peak_bytes


@pytest.mark.parametrize("n", LENGTHS)
def test_generous_budget_evicts_nothing(executables, n):
    """Under a budget the rewritten copy runs; one it meets without evicting evicts nothing,
    and the timeline read from its planned IR predicts the bytes the VM allocates."""
    args = _args(n)
    reference, _ = _run(executables["reference"], args)
    values, run = _run(executables["remat"], args, 2**40)
    assert _same(values, reference)
    assert run.evictions == run.regenerations == 0
    program = next(p for p in remat_programs().values() if p.function == "main_adjoint")
    assert program.timeline([n]).base_peak == run.peak_bytes
    # The runtime counts every live byte of the thread, the call's base included.
    assert run.decision["predicted_peak"] == run.peak_absolute


@pytest.mark.parametrize("variant", ["remat", "remat-stock-plan", "remat-own-storage"])
@pytest.mark.parametrize("n", LENGTHS)
def test_budgets_identical_numerics_and_bytes(executables, variant, n):
    args = _args(n)
    reference, _ = _run(executables["reference"], args)
    _, free = _run(executables[variant], args)
    evicted_somewhere = False
    for fraction in BUDGETS:
        budget = int(fraction * free.peak_bytes)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values, run = _run(executables[variant], args, budget)
        decision = run.decision
        assert _same(values, reference), f"{variant} n={n} budget {fraction}"
        # The runtime's prediction is what the VM allocates.
        assert run.peak_absolute == decision["predicted_peak"]
        warned = [w for w in caught if issubclass(w.category, RematBudgetWarning)]
        if decision["reachable"]:
            assert run.peak_bytes <= budget
            assert not warned
        else:
            assert len(warned) == 1 and str(run.runtime_budget) in str(warned[0].message)
        evicted_somewhere |= run.evictions > 0
        assert run.regenerations >= run.evictions
    if n >= 64:
        assert evicted_somewhere


def test_tightest_reachable_budget_holds(executables):
    """At the smallest peak the runtime says it can reach, the measured peak stays within it."""
    n = 300
    args = _args(n)
    reference, _ = _run(executables["reference"], args)
    _, free = _run(executables["remat"], args)
    _run(executables["remat"], args, 2**40)  # under a budget: the rewritten copy's program
    program = next(p for p in remat_programs().values() if p.function == "main_adjoint")
    assert program.exact
    lowest = program.minimum_peak([n]).peak
    assert lowest < free.peak_bytes
    values, run = _run(executables["remat"], args, lowest)
    assert run.decision["reachable"]
    assert run.peak_bytes <= lowest and _same(values, reference)
    with pytest.warns(RematBudgetWarning, match="cannot stay within") as warned:
        values, run = _run(executables["remat"], args, lowest - 1)
    assert f"budget of {run.runtime_budget} bytes" in str(warned[0].message)
    assert run.peak_bytes == lowest and _same(values, reference)


# --------------------------------------------------------------------------- calls
def _module_with_a_call() -> tvm.IRModule:
    """``a`` (2n floats) waits over a large concatenation and a call of ``helper``, whose
    result ``g`` dies right after its one reader; ``a`` is read again before the last ops.

    The VM keeps ``g`` in its return register until the next function returns. Without the
    release the pass inserts after the call, that moment would depend on the decision (the
    last op when ``a`` is kept, its regeneration when it is evicted) and the final
    concatenation would peak below the prediction. Every run must peak where the decision
    predicts.
    """
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function(private=True)
        def helper(p: R.Tensor(("h",), "float32")):
            with R.dataflow():
                e = R.exp(p)
                R.output(e)
            return e

        @R.function
        def main(x: R.Tensor(("n",), "float32")):
            cls = Module
            a = R.concat([x, x])
            c = R.concat([x, x, x, x, x, x])
            d = R.sum(c)
            g = cls.helper(x)
            b = R.tanh(g)
            s = R.sum(b)
            t = R.add(d, s)
            e = R.multiply(a, t)
            f = R.concat([e, e])
            return f

    return Module


@pytest.mark.parametrize("n", (3, 500))
def test_budget_around_a_call_is_exact(n):
    """The callee's storages and its result in the VM's return register are on the timeline:
    the decision predicts the measured peak, and every budget it calls reachable holds."""
    from blade_relax.transform import RematOptions

    options = RematOptions(min_bytes=0, min_fraction=0.0)
    pipeline = blade_relax.get_pipeline("llvm", remat_options=options)
    exe = compile_keeping_module(_module_with_a_call(), "llvm", pipeline)
    x = tvm.runtime.tensor(np.linspace(-1, 1, n, dtype="float32"))
    reference = compile_keeping_module(_module_with_a_call(), "llvm")

    def run(compiled, budget=None):
        return measure_call(compiled.executable, [x], budget=budget, workspaces=compiled.workspaces)

    expected = run(reference).outputs
    free = run(exe)
    assert np.array_equal(free.outputs, expected)
    reachable = 0
    # About 40 budgets spread over the upper half (each one is a decision and a run).
    for budget in range(free.peak_bytes // 2, free.peak_bytes + 1, max(1, free.peak_bytes // 80)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RematBudgetWarning)
            got = run(exe, budget)
        decision = got.decision
        assert decision["exact"] and np.array_equal(got.outputs, expected)
        assert got.peak_absolute == decision["predicted_peak"], (budget, decision)
        if decision["reachable"]:
            reachable += 1
            assert got.peak_bytes <= budget
    assert reachable


def test_without_a_budget_the_runtime_is_asked_once_per_call(executables):
    """The no-budget path costs one ``remat_active`` query per call: no ``remat_begin``, no
    ``evict`` or ``regenerate`` (the VM binds its builtins when it is constructed, so counting
    wrappers registered before it see every call)."""
    names = [
        "blade_relax.remat_active",
        "blade_relax.remat_begin",
        "blade_relax.evict",
        "blade_relax.regenerate",
    ]
    originals = {name: tvm.get_global_func(name) for name in names}
    counts = dict.fromkeys(names, 0)

    def counting(name):
        original = originals[name]

        def wrapper(*args):
            counts[name] += 1
            return original(*args)

        return wrapper

    args = _args(64)
    try:
        for name in names:
            tvm.register_global_func(name, counting(name), override=True)
        _run(executables["remat"], args)
        no_budget = dict(counts)
        _run(executables["remat"], args, 2**40)
    finally:
        for name, original in originals.items():
            tvm.register_global_func(name, original, override=True)
    assert no_budget == {names[0]: 1, names[1]: 0, names[2]: 0, names[3]: 0}
    # Under a budget the rewritten copy runs: one decision, an evict and a regenerate per slot.
    assert counts[names[0]] == 2 and counts[names[1]] == 1
    assert counts[names[2]] == counts[names[3]] > 0


# ------------------------------------------------------------------ two symbolic dims (b, s)
def _two_dim_training_step() -> tvm.IRModule:
    """A forward and a backward-like sweep over rows ``x: (b * s, W)`` with a per-position
    term ``p: (s, W)``: every layer's output lives until the sweep comes back to it.

    The rows are flattened, as in imported graphs: a tensor of shape ``(b * s, W)`` does not
    define ``b`` and ``s``, so its regeneration takes them as a shape. (Written by hand:
    ``relax.transform.Gradient`` cannot differentiate a reshape to a symbolic shape.)
    """
    bb = relax.BlockBuilder()
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([b * s, WIDTH], "float32"))
    p = relax.Var("p", relax.TensorType([s, WIDTH], "float32"))
    shape = relax.Var("shape", relax.ShapeType([b, s]))
    ws = [relax.Var(f"w{i}", relax.TensorType([WIDTH, WIDTH], "float32")) for i in range(LAYERS)]
    op = relax.op
    with bb.function("main_adjoint", [shape, p, x, *ws]):  # the signature's dims: b, s
        with bb.dataflow():
            h, saved = x, []
            for w in ws:
                rows = bb.emit(op.reshape(op.matmul(h, w), [b, s, WIDTH]))
                h = bb.emit(op.reshape(op.tanh(op.add(rows, p)), [b * s, WIDTH]))
                saved.append(h)
            g = h
            for w, a in zip(reversed(ws), reversed(saved)):
                g = bb.emit(op.matmul(op.multiply(g, a), op.permute_dims(w)))
            loss = bb.emit(op.sum(op.multiply(g, g)))
            out = bb.emit_output(relax.Tuple([loss, relax.Tuple([g])]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def two_dim_executables():
    mod = _two_dim_training_step()
    flags = {
        "reference": dict(schedule=False, remat=False, plan=False),
        "remat": dict(schedule=False, remat=True, plan=True),
    }
    return {
        name: compile_keeping_module(mod, "llvm", blade_relax.get_pipeline("llvm", **f))
        for name, f in flags.items()
    }


@pytest.mark.parametrize(("batch", "length"), [(3, 17), (2, 40), (4, 9)])
def test_two_dims_regenerate_with_their_own_values(two_dim_executables, batch, length):
    """Each regeneration binds ``b`` and ``s`` to their own values (a shape of the dims passed
    by position in another order binds ``b`` to ``s``'s value: the call fails)."""
    rng = np.random.default_rng(batch * length)
    x = rng.standard_normal((batch * length, WIDTH)).astype("float32")
    p = rng.standard_normal((length, WIDTH)).astype("float32")
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype("float32") for _ in range(LAYERS)]
    shape = tvm.runtime.ShapeTuple([batch, length])
    args = [shape, *(tvm.runtime.tensor(a) for a in (p, x, *ws))]
    reference, _ = _run(two_dim_executables["reference"], args)
    _, free = _run(two_dim_executables["remat"], args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematBudgetWarning)
        values, run = _run(two_dim_executables["remat"], args, int(0.5 * free.peak_bytes))
    assert run.regenerations > 0
    assert _same(values, reference)


def test_regenerations_take_the_signatures_dims_in_its_order():
    pipeline = Variant(
        "remat",
        pipeline=lambda t: blade_relax.get_pipeline(t, schedule=False, remat=True, plan=True),
    )
    stage = compile_checked(_two_dim_training_step(), pipeline, well_formed=False).memory_stage
    regens = [
        func
        for gv, func in stage.functions.items()
        if isinstance(func, relax.Function) and "_remat" in gv.name_hint and func.params
    ]
    with_dims = [f for f in regens if f.params[-1].name == "remat_dims"]
    assert with_dims
    for func in with_dims:
        assert [str(v) for v in func.params[-1].ty.values] == ["b", "s"]

"""Measuring one call: kernel workspaces counted while the kernel runs, through the VM's
instrument, composed with the caller's own instrument and removed afterwards; ``measure_call``'s
rules (a fresh VM, the budget on top of the bytes live before the call, the peak above them).

``TwoAdds`` after the stock pipeline allocates two ``(n, 4)`` float32 tensors (``16 n`` bytes
each): ``a = x + x``, then the output ``b = a + x`` while ``a`` is still live, then ``a`` is
killed. The call's peak is ``32 n`` bytes above the bytes live before it, and ``16 n`` (the
output) stay live while the VM holds its result.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax  # installs the runtime accounting
from blade_relax.runtime import (
    RematBudgetWarning,
    current_live_bytes,
    get_memory_budget,
    measure_call,
    measure_memory,
    memory_stats,
    reset_memory_stats,
    workspace_instrument,
)


@I.ir_module
class TwoKernels:
    """``scale`` holds an (n, 8) float scratch while it runs; ``plus_one`` holds nothing."""

    @T.prim_func(s_tir=True)
    def scale(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        scratch = T.alloc_buffer((n, 8), "float32")
        for i, j in T.grid(n, 8):
            with T.sblock("fill"):
                vi, vj = T.axis.remap("SS", [i, j])
                scratch[vi, vj] = X[vi, vj % 4] * T.float32(2)
        for i, j in T.grid(n, 4):
            with T.sblock("sum"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = scratch[vi, vj] + scratch[vi, vj + 4]

    @T.prim_func(s_tir=True)
    def plus_one(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        for i, j in T.grid(n, 4):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = X[vi, vj] + T.float32(1)

    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        cls = TwoKernels
        with R.dataflow():
            a = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((n, 4), "float32"))
            b = R.call_tir(cls.plus_one, (a,), out_ty=R.Tensor((n, 4), "float32"))
            R.output(b)
        return b


def _scratch_bytes(args) -> int:
    """The table entry of ``scale``, written by hand: (n, 8) float32."""
    return args[0].shape[0] * 8 * 4


TABLE = {"scale": _scratch_bytes}


@pytest.fixture(scope="module")
def vm():
    exe = tvm.compile(TwoKernels, "llvm")
    return relax.VirtualMachine(exe, tvm.cpu())


def _x(n: int):
    return tvm.runtime.tensor(np.arange(n * 4, dtype="float32").reshape(n, 4))


def test_workspace_counted_while_the_kernel_runs(vm):
    n = 50
    with measure_memory(vm, workspaces=TABLE) as m:
        out = vm["main"](_x(n))
    # a (16n), then scale's scratch (32n) on top of it while scale runs; b comes after.
    assert m.peak_bytes == 16 * n + 32 * n
    assert m.workspace_bytes == 32 * n
    assert m.stats["workspaces"] == 1 and m.stats["workspace_bytes"] == 32 * n
    # Released when the kernel returned: only the output is live.
    del out
    assert memory_stats()["live_bytes"] == m.live_before + 16 * n


def test_without_a_table_the_workspace_is_not_seen(vm):
    n = 50
    with measure_memory(vm) as m:
        vm["main"](_x(n))
    assert m.peak_bytes == 2 * 16 * n and m.workspace_bytes == 0
    assert m.stats["workspaces"] == 0


def test_instrument_changes_no_result(vm):
    x = _x(33)
    plain = vm["main"](x).numpy()
    with measure_memory(vm, workspaces=TABLE):
        counted = vm["main"](x).numpy()
    np.testing.assert_array_equal(plain, counted)
    np.testing.assert_array_equal(counted, (np.arange(33 * 4).reshape(33, 4) * 4).astype("f4") + 1)


def test_instrument_is_removed_on_exit(vm):
    with measure_memory(vm, workspaces=TABLE):
        vm["main"](_x(8))
    reset_memory_stats()
    vm["main"](_x(8))
    assert memory_stats()["workspaces"] == 0


def test_callers_instrument_sees_every_call_with_the_workspace_released(vm):
    n = 20
    seen = []

    def trace(_func, symbol, before_run, _ret, *_args):
        if not before_run:
            seen.append((symbol, current_live_bytes()))
        return 0

    with measure_memory(vm, workspaces=TABLE, instrument=trace) as m:
        vm["main"](_x(n))
    symbols = [s for s, _ in seen]
    assert "scale" in symbols and "plus_one" in symbols
    # After scale returned, its scratch is gone: live is a's storage only.
    after_scale = dict(seen)["scale"]
    assert after_scale - m.live_before == 16 * n
    assert m.peak_bytes == 48 * n


def test_callers_instrument_may_skip_a_kernel():
    """An inner instrument that skips the call (SKIP_RUN) also skips its workspace."""
    calls = []

    def skip_scale(_func, symbol, before_run, _ret, *_args):
        calls.append((symbol, before_run))
        return 1 if (symbol == "scale" and before_run) else 0

    instrument = workspace_instrument(TABLE, skip_scale)
    x = _x(4)
    reset_memory_stats()
    assert instrument(None, "scale", True, None, x, x) == 1
    assert instrument(None, "scale", False, None, x, x) == 0
    assert calls == [("scale", True), ("scale", False)]
    assert memory_stats()["workspaces"] == 0


def test_measure_memory_needs_the_vm_for_a_table():
    with pytest.raises(ValueError, match="needs the VM"):
        with measure_memory(None, workspaces=TABLE):
            pass


# --------------------------------------------------------------------------- measure_call
@I.ir_module
class TwoAdds:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        with R.dataflow():
            a = R.add(x, x)
            b = R.add(a, x)
            R.output(b)
        return b


def _two_adds_peak(n: int) -> int:
    """``a`` and ``b``, both (n, 4) float32, live together while ``b`` is computed."""
    return 2 * (n * 4 * 4)


@pytest.fixture(scope="module")
def two_adds():
    return tvm.compile(TwoAdds, "llvm")


def _rows(n: int) -> np.ndarray:
    return np.arange(n * 4, dtype="float32").reshape(n, 4)


@pytest.mark.parametrize("n", [1, 7, 100])
def test_measure_call_peak_is_exact(two_adds, n):
    m = measure_call(two_adds, [_rows(n)])
    assert m.peak_bytes == _two_adds_peak(n)
    assert m.peak_absolute == m.live_before + _two_adds_peak(n)
    assert m.allocations == 2 and m.evictions == 0 and m.regenerations == 0
    assert m.workspace_bytes == 0
    assert m.runtime_budget is None and m.decision is None
    np.testing.assert_array_equal(m.outputs, _rows(n) * 3)


def test_measure_call_drops_its_fresh_vm(two_adds):
    """Given an executable, the call runs on a VM of its own, which holds nothing afterwards."""
    n = 9
    m = measure_call(two_adds, [_rows(n)])
    assert memory_stats()["live_bytes"] == m.live_before
    assert isinstance(m.outputs, np.ndarray)


def test_measure_call_budget_is_on_top_of_the_live_bytes(two_adds):
    """The runtime budget is the bytes live before the call plus the call's budget; a function
    without rematerialization runs as without one."""
    n = 12
    held = relax.VirtualMachine(two_adds, tvm.cpu())
    kept = held["main"](tvm.runtime.tensor(_rows(n)))  # 16 n bytes live before the call
    seen = []

    def read_budget(_func, _symbol, before_run, _ret, *_args):
        if before_run:
            seen.append(get_memory_budget())
        return 0

    m = measure_call(two_adds, [_rows(n)], budget=100, instrument=read_budget)
    assert m.live_before >= 16 * n
    assert m.runtime_budget == m.live_before + 100
    assert seen and set(seen) == {m.live_before + 100}
    assert get_memory_budget() is None  # only during the call
    assert m.peak_bytes == _two_adds_peak(n)  # nothing to evict: the budget changes nothing
    assert m.evictions == 0 and m.decision is None
    absolute = measure_call(two_adds, [_rows(n)], runtime_budget=m.live_before + 100)
    assert absolute.runtime_budget == m.live_before + 100
    del kept, held


def test_measure_call_does_not_count_the_vms_previous_result(two_adds):
    """A reused VM still holds its previous result when the next call starts: it is in the base
    (``live_before``), not in the call's peak."""
    n = 25
    vm = relax.VirtualMachine(two_adds, tvm.cpu())
    first = measure_call(vm, [_rows(n)])
    second = measure_call(vm, [_rows(n)])
    assert first.peak_bytes == second.peak_bytes == _two_adds_peak(n)
    assert second.live_before == first.live_before + 16 * n  # the VM's last result
    # Released once the second call returned: the VM now holds the second result only.
    assert memory_stats()["live_bytes"] == first.live_before + 16 * n
    del vm
    assert memory_stats()["live_bytes"] == first.live_before


def test_measure_call_releases_storage_only_a_reference_cycle_holds(two_adds, monkeypatch):
    """Rule 1: a VM result that only a reference cycle holds is collected before the call, so
    it is not in ``live_before``; a collection runs only while counted bytes are live (with
    none, it could change no figure, and it walks every object of the process)."""
    import gc

    n = 11
    vm = relax.VirtualMachine(two_adds, tvm.cpu())
    cycle: list = [vm["main"](tvm.runtime.tensor(_rows(n))), vm]
    cycle.append(cycle)
    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or collect(*args))
    gc.disable()  # no collection but measure_call's own
    try:
        held = memory_stats()["live_bytes"]
        del vm, cycle
        assert memory_stats()["live_bytes"] == held  # the cycle still holds the result
        m = measure_call(two_adds, [_rows(n)])
        assert collections == [()]
        assert m.live_before == held - 16 * n  # the result, collected
        assert m.peak_bytes == _two_adds_peak(n)
        live = memory_stats()
        again = measure_call(two_adds, [_rows(n)])
        assert len(collections) == 1 + (live["live_bytes"] > 0 or live["host_bytes"] > 0)
        assert again.live_before == m.live_before
    finally:
        gc.enable()


def test_without_a_collection_garbage_is_live_at_entry_and_the_peak_unchanged(two_adds):
    """Rule 1 without ``collect_garbage``: a result only a cycle holds stays live through the
    call, in ``live_before``, and ``peak_bytes`` is the call's own; the collector is paused
    while the call runs (a collection there would free those bytes inside the call)."""
    import gc

    n = 11
    enabled_during_call = []

    def trace(_func, _symbol, before_run, _ret, *_args):
        if before_run:
            enabled_during_call.append(gc.isenabled())
        return 0

    vm = relax.VirtualMachine(two_adds, tvm.cpu())
    cycle: list = [vm["main"](tvm.runtime.tensor(_rows(n))), vm]
    cycle.append(cycle)
    held = memory_stats()["live_bytes"]
    del vm, cycle
    try:
        m = measure_call(two_adds, [_rows(n)], collect_garbage=False, instrument=trace)
        assert m.live_before >= held
        assert m.peak_bytes == _two_adds_peak(n)
        assert enabled_during_call and not any(enabled_during_call)
        assert gc.isenabled()  # as it was found
    finally:
        gc.collect()


def test_measure_call_counts_workspaces_and_runs_the_callers_instrument():
    exe = tvm.compile(TwoKernels, "llvm")
    n = 30
    symbols = []

    def trace(_func, symbol, before_run, _ret, *_args):
        if not before_run:
            symbols.append(symbol)
        return 0

    m = measure_call(exe, [_rows(n)], workspaces=TABLE, instrument=trace)
    assert m.peak_bytes == 16 * n + 32 * n and m.workspace_bytes == 32 * n
    assert "scale" in symbols and "plus_one" in symbols
    np.testing.assert_array_equal(m.outputs, _rows(n) * 4 + 1)


def test_measure_call_options(two_adds):
    x = _rows(3)
    assert measure_call(two_adds, [x], convert=None).outputs is None
    raw = measure_call(two_adds, [tvm.runtime.tensor(x)], convert=lambda out: out)
    assert isinstance(raw.outputs, tvm.runtime.Tensor)
    with pytest.raises(ValueError, match="not both"):
        measure_call(two_adds, [x], budget=1, runtime_budget=1)


# A (n, 64) tensor read again at the end, over a (n, 64) peak in the middle that it need not
# stay live for: rematerialization evicts it under a budget and computes it again at the end.
@I.ir_module
class KeptAcross:
    @R.function
    def main(
        x: R.Tensor(("n", 4), "float32"),
        w1: R.Tensor((4, 64), "float32"),
        w2: R.Tensor((64, 4), "float32"),
        w3: R.Tensor((64, 4), "float32"),
    ):
        with R.dataflow():
            a = R.matmul(x, w1)
            b = R.matmul(a, w2)
            c = R.nn.relu(R.matmul(b, w1))
            e = R.matmul(c, w2)
            f = R.add(R.matmul(a, w3), e)
            R.output(f)
        return f


@pytest.fixture(scope="module")
def kept_across():
    # No reordering or compile-time recomputation: the runtime rematerialization is what acts.
    pipeline = blade_relax.get_pipeline("llvm", schedule=False, recompute=False)
    return tvm.compile(KeptAcross, "llvm", relax_pipeline=pipeline)


def _kept_across_args(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = [(n, 4), (4, 64), (64, 4), (64, 4)]
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def test_measure_call_under_a_budget_the_remat_runtime_evicts(kept_across):
    n = 40
    args = _kept_across_args(n)
    free = measure_call(kept_across, args)
    # a (n, 64), b (n, 4) and c (n, 64) are live together while c is computed.
    assert free.peak_bytes == (64 + 4 + 64) * 4 * n
    assert free.evictions == 0 and free.decision is None
    budget = 400 * n
    m = measure_call(kept_across, args, budget=budget)
    decision = m.decision
    assert decision is not None and decision["budget"] == m.live_before + budget
    assert decision["reachable"] and m.peak_bytes <= budget < free.peak_bytes
    assert m.peak_absolute == decision["predicted_peak"]
    assert m.evictions >= 1 and m.regenerations == m.evictions
    np.testing.assert_allclose(m.outputs, free.outputs, rtol=1e-5, atol=1e-5)


def test_measure_call_records_the_budget_warnings(kept_across):
    args = _kept_across_args(8)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        m = measure_call(kept_across, args, budget=1, record_warnings=True)
    assert not outside  # recorded, not shown
    assert not m.decision["reachable"]
    assert m.budget_warnings == 1
    assert issubclass(m.recorded_warnings[0].category, RematBudgetWarning)

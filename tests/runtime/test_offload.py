"""Offloading evicted tensors to host memory: the choice, the bookkeeping, the host bytes.

The pure parts (the choice against recomputation, the timeline the decision runs on) are
tested on hand-made timelines; the rest on a Relax-native MLP training step
(``relax.transform.Gradient``, dynamic batch ``n``) compiled once with ``Rematerialize`` and
run on the CPU in the three eviction modes under a budget that forces evictions.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.analysis import compile_keeping_module
from blade_relax.runtime import (
    EvictionMode,
    EvictionRates,
    choose_eviction,
    clear_host_pool,
    eviction_timeline,
    get_eviction_mode,
    host_bandwidth,
    last_remat_decision,
    measure_host_bandwidth,
    measure_memory,
    measure_recompute_rate,
    memory_stats,
    offload_choices,
    remat_programs,
    reset_memory_stats,
    resolve_rates,
    set_eviction_mode,
    set_memory_budget,
)
from blade_relax.runtime import offload as offload_module
from blade_relax.runtime import remat as remat_module
from blade_relax.runtime.remat_policy import ConcreteTimeline, SlotTimeline, decide

LAYERS, WIDTH = 4, 32
LENGTHS = (64, 160, 300)
MODES = ("recompute", "offload", "auto")
# Rates given, not measured: the tests do not depend on the machine's speed. With these,
# 2 * rate / bandwidth = 30 cost units per byte: "auto" recomputes the step's cheapest slots
# (16 units per byte) and offloads the others (49 to 114 units per byte).
BANDWIDTH, RATE = 1e10, 1.5e11


@pytest.fixture(autouse=True)
def no_budget_no_mode():
    set_memory_budget(None)
    set_eviction_mode("recompute")
    yield
    set_memory_budget(None)
    set_eviction_mode("recompute")


# --------------------------------------------------------------------------- the choice
@pytest.mark.parametrize(
    ("nbytes", "cost", "expected"),
    [
        (1000, 10**6, "offload"),  # copy 2e-7 s, recompute 1e-5 s
        (10**6, 1000, "recompute"),  # copy 2e-4 s, recompute 1e-8 s
        (500, 2 * 500 * 10, "recompute"),  # equal times: recompute (no host memory)
        (501, 2 * 500 * 10, "recompute"),
        (499, 2 * 500 * 10, "offload"),
        (0, 0, "recompute"),
    ],
)
def test_choose_eviction_takes_the_faster(nbytes, cost, expected):
    assert choose_eviction(nbytes, cost, bandwidth=1e10, recompute_rate=1e11) == expected


def test_choose_eviction_refuses_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        choose_eviction(-1, 10, bandwidth=1.0, recompute_rate=1.0)
    with pytest.raises(ValueError, match="positive"):
        choose_eviction(1, 10, bandwidth=0.0, recompute_rate=1.0)
    with pytest.raises(ValueError, match="positive"):
        choose_eviction(1, 10, bandwidth=1.0, recompute_rate=-2.0)


def _chain(a_cost: float = 90000.0) -> ConcreteTimeline:
    """Three slots of 100 bytes in a chain: ``c``, then ``b`` from ``c``, then ``a`` from
    ``b``; recomputing ``a`` peaks high (its regeneration allocates 400 bytes)."""
    return ConcreteTimeline(
        base=np.array([300, 500, 500, 500, 400, 400, 400]),
        slots=(
            SlotTimeline("c", 100, 1000.0, start=1, site=4, regen_peak=100, plan=((0, ()),)),
            SlotTimeline(
                "b", 100, 5000.0, start=1, site=5, regen_peak=200, plan=((0, ()), (1, (0,)))
            ),
            SlotTimeline(
                "a",
                100,
                a_cost,
                start=1,
                site=6,
                regen_peak=400,
                plan=((0, ()), (1, (0,)), (2, (1,))),
            ),
        ),
    )


def test_offloaded_slot_regenerates_into_its_own_bytes():
    tl = _chain()
    # Only "a" is worth a copy: 2 * 100 / 1e3 = 0.2 s against 90000 / 1e5 = 0.9 s.
    rates = EvictionRates("auto", bandwidth=1e3, recompute_rate=1e5)
    assert offload_choices(tl, rates) == frozenset({2})
    out, offloaded = eviction_timeline(tl, rates)
    assert offloaded == frozenset({2})
    a = out.slots[2]
    assert a.plan == ((2, ()),) and a.regen_peak == 100
    assert a.cost == pytest.approx(0.2e9)  # nanoseconds
    b = out.slots[1]
    assert b.plan == tl.slots[1].plan and b.regen_peak == 200
    assert b.cost == pytest.approx(5000 / 1e5 * 1e9)
    assert np.array_equal(out.base, tl.base)


def test_a_recomputed_slot_copies_back_an_offloaded_input():
    # Cost units per byte: c 10, b 50, a 30; offloaded above 2 * rate / bandwidth = 40.
    tl = _chain(a_cost=3000.0)
    out, offloaded = eviction_timeline(tl, EvictionRates("auto", bandwidth=1e3, recompute_rate=2e4))
    assert offloaded == frozenset({1})
    assert out.slots[1].plan == ((1, ()),)
    # "a" recomputes from the copy of "b"; "c", which only b's recomputation read, is left out.
    assert out.slots[2].plan == ((1, ()), (2, (1,)))
    assert out.slots[0].plan == tl.slots[0].plan


def test_offload_mode_offloads_every_slot():
    tl = _chain()
    out, offloaded = eviction_timeline(tl, EvictionRates("offload", bandwidth=1e3))
    assert offloaded == frozenset(range(3))
    assert [s.plan for s in out.slots] == [((k, ()),) for k in range(3)]
    assert [s.regen_peak for s in out.slots] == [100, 100, 100]


def test_offloading_lowers_the_peak_a_recomputation_sets():
    tl = _chain()
    recompute = decide(tl, 450)
    offload = decide(eviction_timeline(tl, EvictionRates("offload", bandwidth=1e3))[0], 450)
    # Recomputing "a" needs its 400 bytes of regeneration on top of what is live at its site;
    # its copy needs only its own 100.
    assert offload.reachable and offload.peak <= 450
    assert offload.peak <= recompute.peak


# --------------------------------------------------------------------------- the setting
def test_default_mode_is_recompute_in_every_thread():
    set_eviction_mode("offload", bandwidth=1e9)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(get_eviction_mode()))
    worker.start()
    worker.join()
    assert seen == [EvictionMode()]
    assert get_eviction_mode() == EvictionMode("offload", bandwidth=1e9)
    assert resolve_rates(EvictionMode()) is None


def test_mode_scope_restores_the_previous():
    set_eviction_mode("auto", bandwidth=2e9, recompute_rate=3e11)
    with set_eviction_mode("offload") as mode:
        assert mode == get_eviction_mode() == EvictionMode("offload")
    assert get_eviction_mode() == EvictionMode("auto", 2e9, 3e11)
    rates = resolve_rates(get_eviction_mode())
    assert rates == EvictionRates("auto", 2e9, 3e11)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("swap",), {}, ValueError, "unknown eviction mode 'swap'"),
        (("Offload",), {}, ValueError, "unknown eviction mode"),
        ((None,), {}, TypeError, "must be a string"),
        (("offload",), {"bandwidth": 0}, ValueError, "bandwidth.*positive"),
        (("offload",), {"bandwidth": -1e9}, ValueError, "bandwidth.*positive"),
        (("auto",), {"bandwidth": float("nan")}, ValueError, "positive finite"),
        (("auto",), {"recompute_rate": float("inf")}, ValueError, "positive finite"),
        (("auto",), {"recompute_rate": 0.0}, ValueError, "recompute rate"),
        (("auto",), {"bandwidth": True}, TypeError, "positive number"),
        (("auto",), {"bandwidth": "1e9"}, TypeError, "positive number"),
    ],
)
def test_bad_mode_is_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        set_eviction_mode(*args, **kwargs)
    assert get_eviction_mode() == EvictionMode()


# --------------------------------------------------------------------------- measuring
def test_bandwidth_is_measured_and_cached_per_device():
    assert measure_host_bandwidth(tvm.cpu(), nbytes=1 << 20, repeat=2) > 0
    first = host_bandwidth(tvm.cpu())
    assert first > 0 and host_bandwidth(tvm.cpu()) == first


def test_recompute_rate_is_measured_outside_the_callers_statistics():
    reset_memory_stats()
    before = memory_stats()
    assert measure_recompute_rate(tvm.cpu(), size=32, repeat=2) > 0
    after = memory_stats()
    assert after["allocations"] == before["allocations"] == 0
    assert after["peak_bytes"] == before["peak_bytes"]


# --------------------------------------------------------------------------- host bytes
def test_host_copies_are_counted_apart_from_device_bytes():
    tensor = tvm.runtime.tensor(np.arange(12, dtype="float32").reshape(3, 4))
    clear_host_pool()
    reset_memory_stats()
    live = memory_stats()["live_bytes"]
    copy = offload_module.to_host(tensor, 48)
    buffer = copy.buffer
    stats = memory_stats()
    assert stats["host_bytes"] == stats["peak_host_bytes"] == 48
    assert stats["offloads"] == 1 and stats["offloaded_bytes"] == 48
    assert stats["live_bytes"] == live  # host copies are not what the budget bounds
    assert np.array_equal(copy.view.numpy(), tensor.numpy())
    copy.release()
    copy.release()  # once only
    stats = memory_stats()
    assert stats["host_bytes"] == 0 and stats["peak_host_bytes"] == 48
    # The buffer went back to the pool: the next copy of that size reuses it.
    again = offload_module.to_host(tensor, 48)
    assert again.buffer.same_as(buffer)
    again.release()
    assert clear_host_pool() == 48 and clear_host_pool() == 0
    reset_memory_stats()
    assert memory_stats()["peak_host_bytes"] == 0


def test_a_frame_that_ends_early_releases_its_host_copies():
    tensor = tvm.runtime.tensor(np.ones(8, dtype="float32"))
    reset_memory_stats()
    frame = remat_module._Frame(None, None, frozenset({0}), True, None, (), frozenset({0}))
    frame.hosts[0] = offload_module.to_host(tensor, 32)
    assert memory_stats()["host_bytes"] == 32
    del frame
    assert memory_stats()["host_bytes"] == 0


# --------------------------------------------------------------------------- end to end
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
def compiled():
    pipeline = blade_relax.get_pipeline("llvm", schedule=False, remat=True, plan=True)
    return compile_keeping_module(_mlp_training_step(), "llvm", pipeline)


def _args(n: int) -> list:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, WIDTH)).astype("float32")
    ws = [(rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype("float32") for _ in range(LAYERS)]
    return [tvm.runtime.tensor(a) for a in (x, *ws)]


class _ClosureCount:
    """Counts the regeneration closures the runtime invokes (the release closure, which takes
    no argument, is not counted)."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = remat_module._invoke_closure

    def __call__(self, ctx, closure, *values):
        if values:
            self.calls += 1
        return self.original(ctx, closure, *values)


def _run(compiled, args, budget=None, mode="recompute", monkeypatch=None):
    """One call on a fresh VM: the outputs, the statistics, and the closures invoked."""
    count = _ClosureCount()
    if monkeypatch is not None:
        monkeypatch.setattr(remat_module, "_invoke_closure", count)
    vm = relax.VirtualMachine(compiled.executable, tvm.cpu())
    with set_eviction_mode(mode, bandwidth=BANDWIDTH, recompute_rate=RATE):
        with measure_memory(vm, workspaces=compiled.workspaces) as measured:
            # The budget and the peak are the call's own: tensors an earlier test keeps alive
            # in this thread are live at entry, and the runtime counts them.
            runtime_budget = None if budget is None else measured.live_before + budget
            with set_memory_budget(runtime_budget):
                out = vm["main_adjoint"](*args)
    values = [out[0].numpy()] + [g.numpy() for g in out[1]]
    del out, vm
    stats = dict(
        measured.stats,
        peak_bytes=measured.peak_bytes,
        live_before=measured.live_before,
        host_after=memory_stats()["host_bytes"],
    )
    if monkeypatch is not None:
        monkeypatch.setattr(remat_module, "_invoke_closure", count.original)
    return values, stats, count.calls


def _close(a, b) -> bool:
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


@pytest.mark.filterwarnings("ignore::blade_relax.runtime.RematBudgetWarning")
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_the_unbudgeted_step(compiled, monkeypatch, mode, n):
    args = _args(n)
    reference, free, _ = _run(compiled, args)
    budget = int(0.7 * free["peak_bytes"])
    values, stats, closures = _run(compiled, args, budget, mode, monkeypatch)
    decision = last_remat_decision()
    assert _close(values, reference)
    assert stats["evictions"] > 0
    assert decision["eviction_mode"] == mode
    assert decision["cost_unit"] == ("iterations" if mode == "recompute" else "ns")
    # Every mode's model predicts the bytes the VM allocates, and none exceeds the peak
    # without a budget.
    assert stats["peak_bytes"] == decision["predicted_peak"] - stats["live_before"]
    assert stats["peak_bytes"] <= free["peak_bytes"]
    assert stats["host_after"] == 0
    if mode == "recompute":
        assert stats["offloads"] == stats["peak_host_bytes"] == 0
        assert closures == stats["regenerations"] > 0
    if mode == "offload":
        assert closures == stats["regenerations"] == 0
        assert stats["offloads"] == stats["reloads"] == stats["evictions"]
        assert stats["peak_host_bytes"] > 0
        assert stats["offloaded_bytes"] == stats["reloaded_bytes"] == stats["evicted_bytes"]
        assert decision["offloaded"] == decision["evicted"]


def test_auto_chooses_per_slot(compiled, monkeypatch):
    n = 300
    args = _args(n)
    reference, free, _ = _run(compiled, args)
    program = next(p for p in remat_programs().values() if p.function == "main_adjoint")
    rates = EvictionRates("auto", BANDWIDTH, RATE)
    offloaded = program.offloaded([n], rates)
    assert 0 < len(offloaded) < len(program.slots)  # some slots of each kind
    lowest = program.minimum_peak([n], rates).peak
    values, stats, closures = _run(compiled, args, lowest, "auto", monkeypatch)
    decision = last_remat_decision()
    assert decision["reachable"] and stats["peak_bytes"] <= lowest
    assert _close(values, reference)
    evicted = set(decision["evicted"])
    names = {program.slots[k].name for k in offloaded}
    assert set(decision["offloaded"]) == evicted & names
    assert stats["offloads"] == len(evicted & names)
    assert stats["host_after"] == 0


def test_offload_reaches_a_lower_peak_than_recompute(compiled):
    """Copying back needs only the tensor's bytes, where recomputing also allocates the
    recomputation's intermediates: the smallest reachable peak under offloading is no higher."""
    n = 64
    args = _args(n)
    _run(compiled, args, 2**40)  # the rewritten copy's program
    program = next(p for p in remat_programs().values() if p.function == "main_adjoint")
    recompute = program.minimum_peak([n]).peak
    offload = program.minimum_peak([n], EvictionRates("offload", BANDWIDTH)).peak
    assert offload <= recompute
    values, stats, _ = _run(compiled, args, offload, "offload")
    assert stats["peak_bytes"] <= offload


def test_a_recomputed_slot_reads_an_offloaded_input(compiled, monkeypatch):
    """``auto`` with the first slot offloaded and the second, whose recomputation reads it,
    recomputed: the runtime copies the first back at the second's site."""
    n = 300
    args = _args(n)
    reference, free, _ = _run(compiled, args)
    program = next(p for p in remat_programs().values() if p.function == "main_adjoint")
    chained = [k for k, s in enumerate(program.slots) if any(node.slot != k for node in s.plan)]
    assert chained, "the step has a chained regeneration"
    reader = chained[0]
    source = next(node.slot for node in program.slots[reader].plan if node.slot != reader)
    monkeypatch.setattr(offload_module, "offload_choices", lambda tl, rates: frozenset({source}))
    program._eviction_timelines.clear()
    program._decisions.clear()
    try:
        rates = EvictionRates("auto", BANDWIDTH, RATE)
        timeline = program.timeline([n], rates)
        assert dict(timeline.slots[reader].plan)[source] == ()
        # Any budget that evicts both: the smallest reachable peak does.
        lowest = program.minimum_peak([n], rates)
        budget = lowest.peak if {reader, source} <= lowest.evicted else None
        if budget is None:
            pytest.skip("no decision evicts both slots of the chain")
        values, stats, closures = _run(compiled, args, budget, "auto", monkeypatch)
        assert _close(values, reference)
        assert stats["reloads"] >= 1 and closures >= 1
        assert stats["host_after"] == 0
    finally:
        program._eviction_timelines.clear()
        program._decisions.clear()

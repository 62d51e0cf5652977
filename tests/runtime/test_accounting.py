"""Runtime memory accounting: exact bytes of every storage a Relax VM allocates.

The workload is a dynamic Relax function compiled by the stock ``tvm.compile(mod, "llvm")``.
After the stock pipeline its ``main`` allocates three storages of ``n * 32 * 4 = 128 n`` bytes
(print ``relax.get_pipeline("default")(Module)["main"]`` to see them):

    storage   = R.vm.alloc_storage(128 n)   # y = matmul(x, w)
    storage1  = R.vm.alloc_storage(128 n)   # z = relu(y)
    matmul(x, w, y); relu(y, z); kill y
    storage_1 = R.vm.alloc_storage(128 n)   # o = add(z, b), the output (outputs are not planned)
    add(z, b, o); kill z

Live bytes over the call: 128 n, 256 n, 128 n (y killed), 256 n, 128 n (z killed). The peak is
therefore ``256 n`` bytes above the live bytes before the call, and ``128 n`` stay live after it
(the output). StaticPlanBlockMemory cannot give ``z`` the storage of ``y``: both are live while
relu runs.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import blade_relax  # noqa: F401  (installs the accounting)
from blade_relax.runtime import (
    accounting_installed,
    current_live_bytes,
    install_accounting,
    memory_stats,
    record_eviction,
    record_regeneration,
    reset_memory_stats,
    track_allocation,
)

ROW_BYTES = 32 * 4  # one row of y, z or o: 32 float32


@I.ir_module
class MatmulReluAdd:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"),
        w: R.Tensor((16, 32), "float32"),
        b: R.Tensor((32,), "float32"),
    ) -> R.Tensor(("n", 32), "float32"):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            o = R.add(z, b)
            R.output(o)
        return o


def expected_peak_increase(n: int) -> int:
    """Peak minus the live bytes before the call: y and z live together, then z and o."""
    return 2 * ROW_BYTES * n


@pytest.fixture(scope="module")
def executable():
    return tvm.compile(MatmulReluAdd, "llvm")


@pytest.fixture(scope="module")
def params():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype("float32")
    b = rng.standard_normal(32).astype("float32")
    return w, b


def make_input(n: int) -> np.ndarray:
    return np.arange(n * 16, dtype="float32").reshape(n, 16) / 7.0


def run(vm, n: int, params) -> np.ndarray:
    w, b = params
    out = vm["main"](
        tvm.runtime.tensor(make_input(n)), tvm.runtime.tensor(w), tvm.runtime.tensor(b)
    )
    return out.numpy()


def reference(n: int, params) -> np.ndarray:
    w, b = params
    return np.maximum(make_input(n) @ w, 0) + b


def count_alloc_storage(func: relax.Function) -> int:
    op = tvm.ir.Op.get("relax.vm.alloc_storage")
    calls = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op.same_as(op) else None,
    )
    return len(calls)


def test_installed_on_import():
    assert accounting_installed()


def test_stock_pipeline_allocates_three_storages():
    """The derivation in the module docstring rests on this lowering of the stock pipeline."""
    lowered = relax.get_pipeline("default")(MatmulReluAdd)
    assert count_alloc_storage(lowered["main"]) == 3


@pytest.mark.parametrize("n", [1, 5, 17, 64])
def test_peak_is_exact(executable, params, n):
    before = current_live_bytes()
    vm = relax.VirtualMachine(executable, tvm.cpu())
    reset_memory_stats()
    w, b = params
    out = vm["main"](
        tvm.runtime.tensor(make_input(n)), tvm.runtime.tensor(w), tvm.runtime.tensor(b)
    )
    np.testing.assert_allclose(out.numpy(), reference(n, params), rtol=1e-5, atol=1e-5)
    stats = memory_stats()
    assert stats["peak_bytes"] - before == expected_peak_increase(n)
    assert stats["allocations"] == 3
    assert stats["allocated_bytes"] == 3 * ROW_BYTES * n
    assert stats["live_bytes"] - before == ROW_BYTES * n  # the output
    cpu = stats["devices"]["cpu:0"]
    assert cpu["peak_bytes"] == stats["peak_bytes"]
    assert cpu["allocations"] == 3
    del out, vm
    assert current_live_bytes() == before


def test_naive_allocator_measures_the_same(executable, params):
    """Requested bytes are counted, not what the allocator rounds or pools."""
    peaks = []
    for cfg in ("pooled", "naive"):
        vm = relax.VirtualMachine(executable, tvm.cpu(), memory_cfg=cfg)
        before = current_live_bytes()
        reset_memory_stats()
        run(vm, 9, params)
        peaks.append(memory_stats()["peak_bytes"] - before)
        del vm
    assert peaks == [expected_peak_increase(9)] * 2


def test_reused_vm_keeps_its_last_output(executable, params):
    """A VM holds the value it returned last until its next return (TVM's ``return_value_``).

    So the previous call's output is live during the next call and counts in its peak, and
    dropping the caller's reference does not free it; destroying the VM does.
    """
    base = current_live_bytes()
    vm = relax.VirtualMachine(executable, tvm.cpu())
    run(vm, 6, params)  # the caller's output is dropped at once
    assert current_live_bytes() - base == ROW_BYTES * 6
    reset_memory_stats()
    before = memory_stats()["live_bytes"]
    run(vm, 10, params)
    stats = memory_stats()
    assert stats["peak_bytes"] - base == ROW_BYTES * 6 + expected_peak_increase(10)
    # Measured from the live bytes just before the call, the peak is the call's own.
    assert stats["peak_bytes"] - before == expected_peak_increase(10)
    assert stats["live_bytes"] - base == ROW_BYTES * 10
    del vm
    assert current_live_bytes() == base


def test_live_bytes_return_after_outputs_dropped(executable, params):
    base = current_live_bytes()
    vm = relax.VirtualMachine(executable, tvm.cpu())
    run(vm, 12, params)
    after_first = current_live_bytes()
    for _ in range(5):
        w, b = params
        out = vm["main"](
            tvm.runtime.tensor(make_input(12)), tvm.runtime.tensor(w), tvm.runtime.tensor(b)
        )
        assert current_live_bytes() == after_first  # the new output replaced the VM's old one
        held = current_live_bytes()
        del out
        assert current_live_bytes() == held  # the VM still holds it
    del vm
    assert current_live_bytes() == base


def test_no_growth_over_many_calls(executable, params):
    rng = random.Random(1234)
    base = current_live_bytes()
    vm = relax.VirtualMachine(executable, tvm.cpu())
    reset_memory_stats()
    ns = [rng.randint(1, 48) for _ in range(200)]
    previous = 0
    expected_peak = 0
    for n in ns:
        out = run(vm, n, params)
        assert out.shape == (n, 32)
        # Only the output the VM keeps is live between calls.
        assert current_live_bytes() - base == ROW_BYTES * n
        expected_peak = max(expected_peak, ROW_BYTES * previous + expected_peak_increase(n))
        previous = n
    stats = memory_stats()
    assert stats["allocations"] == 3 * len(ns)
    assert stats["frees"] == 3 * len(ns) - 1
    assert stats["peak_bytes"] - base == expected_peak
    del vm
    stats = memory_stats()
    assert stats["live_bytes"] == base
    assert stats["frees"] == stats["allocations"]


def test_threads_have_independent_stats(executable, params):
    main_before = memory_stats()
    shapes = {"a": 7, "b": 31}
    barrier = threading.Barrier(len(shapes))
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            vm = relax.VirtualMachine(executable, tvm.cpu())
            assert memory_stats()["allocations"] == 0  # a new thread starts from zero
            barrier.wait()
            for _ in range(20):
                run(vm, shapes[name], params)
            results[name] = memory_stats()
            del vm
            results[name + "-end"] = memory_stats()
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(name,)) for name in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, n in shapes.items():
        stats = results[name]
        assert stats["allocations"] == 3 * 20
        # The previous output of the same shape is live during each later call.
        assert stats["peak_bytes"] == ROW_BYTES * n + expected_peak_increase(n)
        assert stats["live_bytes"] == ROW_BYTES * n
        assert results[name + "-end"]["live_bytes"] == 0
    main_after = memory_stats()
    for key in ("peak_bytes", "live_bytes", "allocations", "frees"):
        assert main_after[key] == main_before[key]


def test_to_device_copy_is_counted():
    """``R.to_vdevice`` copies through ``vm.builtin.to_device``, not ``alloc_storage``."""

    @I.ir_module
    class ToVDevice:
        I.module_global_infos({"vdevice": [I.vdevice("llvm")]})

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            y = R.add(x, x)
            out = R.to_vdevice(y, "llvm")
            return out

    ex = tvm.compile(ToVDevice, "llvm")
    base = current_live_bytes()
    vm = relax.VirtualMachine(ex, tvm.cpu())
    reset_memory_stats()
    out = vm["main"](tvm.runtime.tensor(np.ones((3, 4), "float32")))
    np.testing.assert_array_equal(out.numpy(), 2 * np.ones((3, 4), "float32"))
    stats = memory_stats()
    assert stats["allocations"] == 2  # y's storage and the copy
    assert stats["peak_bytes"] - base == 2 * 48
    assert stats["live_bytes"] - base == 48
    # The copy stays counted while the caller holds it, after the VM is gone.
    del vm
    assert current_live_bytes() - base == 48
    del out
    assert current_live_bytes() == base


def test_track_allocation():
    base = current_live_bytes()
    reset_memory_stats()
    t = tvm.runtime.tensor(np.zeros((10, 10), "float32"))
    holder = tvm.runtime.convert([t])  # a native holder, as a VM register would be
    del t
    track_allocation(holder[0], 400, tvm.cpu())
    assert current_live_bytes() - base == 400
    assert memory_stats()["devices"]["cpu:0"]["allocations"] == 1
    del holder
    assert current_live_bytes() == base
    # A tensor held only from Python counts until the last Python reference goes.
    t = tvm.runtime.tensor(np.zeros(25, "float32"))
    track_allocation(t, 100, tvm.cpu())
    assert current_live_bytes() - base == 100
    del t
    assert current_live_bytes() == base
    with pytest.raises(TypeError, match="FFI object"):
        track_allocation(np.zeros(3), 12, tvm.cpu())
    with pytest.raises(ValueError, match="-1"):
        track_allocation(tvm.runtime.tensor(np.zeros(1, "float32")), -1, tvm.cpu())


def test_eviction_and_regeneration_counters():
    reset_memory_stats()
    record_eviction(100)
    record_eviction(28)
    record_regeneration(100)
    stats = memory_stats()
    assert (stats["evictions"], stats["evicted_bytes"]) == (2, 128)
    assert (stats["regenerations"], stats["regenerated_bytes"]) == (1, 100)
    reset_memory_stats()
    stats = memory_stats()
    assert (stats["evictions"], stats["regenerations"]) == (0, 0)
    with pytest.raises(ValueError, match="-5"):
        record_eviction(-5)
    with pytest.raises(TypeError, match="2.5"):
        record_regeneration(2.5)


def test_reset_sets_peak_to_live(executable, params):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    run(vm, 20, params)
    stats = memory_stats()
    assert stats["peak_bytes"] > stats["live_bytes"]
    reset_memory_stats()
    stats = memory_stats()
    assert stats["peak_bytes"] == stats["live_bytes"]
    assert stats["allocations"] == stats["allocated_bytes"] == stats["frees"] == 0
    assert stats["devices"]["cpu:0"]["peak_bytes"] == stats["devices"]["cpu:0"]["live_bytes"]
    del vm


def test_install_twice_counts_once(executable, params):
    install_accounting()
    assert accounting_installed()
    vm = relax.VirtualMachine(executable, tvm.cpu())
    reset_memory_stats()
    run(vm, 4, params)
    stats = memory_stats()
    assert stats["allocations"] == 3
    assert stats["allocated_bytes"] == 3 * ROW_BYTES * 4
    del vm


@pytest.mark.gpu
def test_cuda_bytes_are_counted_on_the_device(params):
    """On CUDA the stock pipeline fuses the three ops: one storage of ``128 n`` bytes, on the GPU."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        lowered = relax.get_default_pipeline(target)(MatmulReluAdd)
    assert count_alloc_storage(lowered["main"]) == 1
    ex = tvm.compile(MatmulReluAdd, target)
    dev = tvm.cuda(0)
    base = memory_stats()
    vm = relax.VirtualMachine(ex, dev)
    w, b = params
    for n in (3, 40):
        before = current_live_bytes()
        reset_memory_stats()
        out = vm["main"](
            tvm.runtime.tensor(make_input(n), dev),
            tvm.runtime.tensor(w, dev),
            tvm.runtime.tensor(b, dev),
        )
        np.testing.assert_allclose(out.numpy(), reference(n, params), rtol=1e-4, atol=1e-4)
        stats = memory_stats()
        assert stats["peak_bytes"] - before == ROW_BYTES * n
        gpu = stats["devices"]["cuda:0"]
        assert gpu["allocations"] == 1 and gpu["allocated_bytes"] == ROW_BYTES * n
        host = stats["devices"].get("cpu:0", {"live_bytes": 0, "allocations": 0})
        assert host["allocations"] == 0
        assert host["live_bytes"] == base["devices"].get("cpu:0", {"live_bytes": 0})["live_bytes"]
        del out
    del vm
    assert current_live_bytes() == base["live_bytes"]


def test_device_read_from_storage_header_is_checked(executable, params):
    """The fast path reads the device from the StorageObj layout; it must have been validated."""
    from blade_relax.runtime import accounting

    vm = relax.VirtualMachine(executable, tvm.cpu())
    run(vm, 2, params)
    assert accounting._raw_device_read_ok
    assert accounting._device_word(tvm.cpu()) in accounting._checked_device_words
    del vm


def test_slow_device_path_measures_the_same(executable, params, monkeypatch):
    from blade_relax.runtime import accounting

    monkeypatch.setattr(accounting, "_raw_device_read_ok", False)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    before = current_live_bytes()
    reset_memory_stats()
    run(vm, 11, params)
    stats = memory_stats()
    assert stats["peak_bytes"] - before == expected_peak_increase(11)
    assert stats["devices"]["cpu:0"]["allocations"] == 3
    del vm


def many_outputs_module(k: int) -> tvm.IRModule:
    """``main(x: (n, 4))`` returns ``k`` tensors ``x + x``: outputs are not planned, so each has
    its own storage of ``16 n`` bytes and all ``k`` are live when the call returns (one PrimFunc
    serves all k, which keeps the build short)."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    with bb.function("main", [x]):
        outs = [bb.emit(relax.op.add(x, x)) for _ in range(k)]
        bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


def test_many_live_allocations_with_holes():
    """Enough live storages for the gathered scan; outputs kept at random leave holes."""
    k = 64
    ex = tvm.compile(many_outputs_module(k), "llvm")
    base = current_live_bytes()
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = random.Random(7)
    kept = []
    kept_bytes = 0
    for n in (5, 9, 2, 13):
        before = current_live_bytes()
        reset_memory_stats()
        outs = vm["main"](tvm.runtime.tensor(np.ones((n, 4), "float32")))
        stats = memory_stats()
        assert stats["allocations"] == k
        assert stats["peak_bytes"] - before == k * 16 * n
        for j in rng.sample(range(k), 10):
            kept.append(outs[j])
            kept_bytes += 16 * n
        del outs
        # The VM holds this call's outputs; the caller holds the ones it kept from earlier calls.
        this_call_kept = 10 * 16 * n
        assert current_live_bytes() - base == k * 16 * n + kept_bytes - this_call_kept
    np.testing.assert_array_equal(kept[-1].numpy().shape, (13, 4))
    del vm
    assert current_live_bytes() - base == kept_bytes
    rng.shuffle(kept)
    while kept:
        t = kept.pop()
        kept_bytes -= t.numpy().size * 4
        del t
        assert current_live_bytes() - base == kept_bytes
    assert current_live_bytes() == base

"""Measuring one call: kernel workspaces counted while the kernel runs, through the VM's
instrument, composed with the caller's own instrument and removed afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax  # noqa: F401  (installs the runtime accounting)
from blade_relax.runtime import (
    current_live_bytes,
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

"""The relative memory budget: each call of a rematerialized function allows itself a share of
its own peak without evictions, on top of the bytes live when it starts."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import blade_relax
from blade_relax.bench.workloads import ModelSizes, mlp_forward_module
from blade_relax.contract import REMAT_ACTIVE
from blade_relax.frontend import relax_training_step
from blade_relax.runtime import (
    RematBudgetWarning,
    get_memory_budget,
    get_relative_budget,
    last_remat_decision,
    measure_call,
    set_memory_budget,
    set_relative_budget,
)
from blade_relax.runtime.remat import _remat_active
from blade_relax.training import AdamW, build_training_step


@pytest.fixture(autouse=True)
def no_budget():
    set_memory_budget(None)
    set_relative_budget(None)
    yield
    set_memory_budget(None)
    set_relative_budget(None)


# --------------------------------------------------------------------------- set / get
def test_default_is_none():
    assert get_relative_budget() is None


def test_set_persists_without_with():
    set_relative_budget(0.25)
    assert get_relative_budget() == 0.25
    set_relative_budget(None)
    assert get_relative_budget() is None


def test_context_manager_restores_previous():
    set_relative_budget(0.9)
    with set_relative_budget(0.5) as fraction:
        assert fraction == 0.5 and get_relative_budget() == 0.5
        with set_relative_budget(None):
            assert get_relative_budget() is None
        assert get_relative_budget() == 0.5
    assert get_relative_budget() == 0.9


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with set_relative_budget(0.5):
            raise RuntimeError("boom")
    assert get_relative_budget() is None


def test_independent_of_the_absolute_budget():
    with set_relative_budget(0.5), set_memory_budget(4096):
        assert get_memory_budget() == 4096 and get_relative_budget() == 0.5
    assert get_memory_budget() is None and get_relative_budget() is None


@pytest.mark.parametrize("fraction", [1, 1.0, 0.5, 1e-9, np.float64(0.75)])
def test_numbers_in_the_unit_interval_are_accepted_as_floats(fraction):
    set_relative_budget(fraction)
    assert get_relative_budget() == float(fraction)
    assert type(get_relative_budget()) is float


@pytest.mark.parametrize("bad", ["0.5", True, False, [0.5], b"1"])
def test_non_numbers_raise_type_error(bad):
    set_relative_budget(0.5)
    with pytest.raises(TypeError, match="a relative budget is a number"):
        set_relative_budget(bad)
    assert get_relative_budget() == 0.5  # unchanged


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -1, 2, math.inf, math.nan])
def test_numbers_outside_the_unit_interval_raise_value_error(bad):
    set_relative_budget(0.5)
    with pytest.raises(ValueError, match=r"lies in \(0, 1\]"):
        set_relative_budget(bad)
    assert get_relative_budget() == 0.5


def test_per_thread():
    set_relative_budget(0.5)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(get_relative_budget()))
    worker.start()
    worker.join()
    assert seen == [None]
    assert get_relative_budget() == 0.5


def test_remat_active_with_either_budget():
    active = tvm.get_global_func(REMAT_ACTIVE)
    assert not _remat_active() and not active()
    with set_relative_budget(0.5):
        assert _remat_active() and active()
    assert not _remat_active()
    with set_memory_budget(1 << 20):
        assert _remat_active() and active()
    assert not _remat_active()


# --------------------------------------------------------------------------- end to end
SIZES = ModelSizes(layers=2, hidden=8, intermediate=64, vocab=128, max_seq_len=256, min_seq_len=1)


@pytest.fixture(scope="module")
def training_step():
    """An AdamW step of a Relax-native MLP, compiled with the full pipeline (it has evictable
    tensors), and the arguments of a step at a given length."""
    forward = mlp_forward_module(SIZES)
    rng = np.random.default_rng(0)
    params = []
    for param in forward["main"].params[2:]:
        shape = [int(v) for v in param.ty.shape.values]
        params.append((rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32"))
    graph = relax_training_step(
        forward,
        params=params,
        num_input=2,
        dims={"s": (SIZES.min_seq_len, SIZES.max_seq_len)},
        param_names=[p.name for p in forward["main"].params[2:]],
    )
    step = build_training_step(graph, AdamW(1e-2))
    executable = tvm.compile(step.mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm"))
    state = step.initial_state()
    scalars = step.optimizer.scalars(1)

    def args(length: int) -> list[np.ndarray]:
        data = np.random.default_rng(length)
        x = data.standard_normal((length, SIZES.hidden)).astype("float32")
        onehot = np.eye(SIZES.vocab, dtype="float32")[data.integers(0, SIZES.vocab, length)]
        # Fresh copies: the step updates the parameters and the state in place.
        return [x, onehot, *(p.copy() for p in params), *(s.copy() for s in state), scalars]

    return executable, args


def _measure(executable, args, fraction: float):
    with warnings.catch_warnings():
        # Below the smallest reachable peak the runtime runs at that peak and warns.
        warnings.simplefilter("ignore", RematBudgetWarning)
        with set_relative_budget(fraction):
            measured = measure_call(executable, args)
    return measured, last_remat_decision()


@pytest.mark.parametrize("length", [160, 230])
def test_relative_budget_is_a_share_of_the_calls_own_peak(training_step, length):
    executable, args = training_step
    plain = measure_call(executable, args(length))
    assert last_remat_decision() is None  # no budget: no decision
    # Another VM's result stays live across the call: the share is added on top of it.
    other = relax.VirtualMachine(executable, tvm.cpu())
    kept = other["main"](*(tvm.runtime.tensor(a) for a in args(length)))
    measured, decision = _measure(executable, args(length), 0.5)
    del kept
    assert decision is not None and decision["dims"] == {"s": length}
    live = decision["live_at_entry"]
    assert live > 0
    own_peak = decision["no_remat_peak"] - live
    assert own_peak > 0
    assert decision["budget"] == live + max(1, int(0.5 * own_peak))
    # The runtime evicted to approach it, and the step computed the same values.
    assert decision["evicted"] and measured.evictions >= 1
    assert measured.peak_bytes < plain.peak_bytes
    assert len(measured.outputs) == len(plain.outputs)
    for got, expected in zip(measured.outputs, plain.outputs):
        np.testing.assert_array_equal(got, expected)


def test_each_call_takes_its_share_at_its_own_sizes(training_step):
    executable, args = training_step
    budgets = {}
    for length in (60, 100):
        _, decision = _measure(executable, args(length), 0.5)
        budgets[length] = decision["budget"] - decision["live_at_entry"]
    assert budgets[60] < budgets[100]


def test_whole_peak_needs_no_eviction(training_step):
    executable, args = training_step
    plain = measure_call(executable, args(100))
    measured, decision = _measure(executable, args(100), 1.0)
    assert decision["budget"] == decision["no_remat_peak"]
    assert decision["reachable"] and decision["evicted"] == []
    assert measured.evictions == 0
    for got, expected in zip(measured.outputs, plain.outputs):
        np.testing.assert_array_equal(got, expected)


def test_absolute_budget_takes_precedence(training_step):
    executable, args = training_step
    absolute = 1 << 40
    with set_memory_budget(absolute):
        _, decision = _measure(executable, args(100), 0.01)
    assert decision["budget"] == absolute
    assert decision["evicted"] == []

"""The per-thread memory budget read by the rematerialization runtime."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from blade_relax.runtime import BudgetScope, get_memory_budget, set_memory_budget


@pytest.fixture(autouse=True)
def no_budget():
    set_memory_budget(None)
    yield
    set_memory_budget(None)


def test_default_is_none():
    assert get_memory_budget() is None


def test_set_persists_without_with():
    scope = set_memory_budget(4096)
    assert isinstance(scope, BudgetScope)
    assert get_memory_budget() == 4096
    set_memory_budget(None)
    assert get_memory_budget() is None


def test_context_manager_restores_previous():
    set_memory_budget(10_000)
    with set_memory_budget(2**20) as nbytes:
        assert nbytes == 2**20
        assert get_memory_budget() == 2**20
        with set_memory_budget(None):
            assert get_memory_budget() is None
        assert get_memory_budget() == 2**20
    assert get_memory_budget() == 10_000


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with set_memory_budget(512):
            raise RuntimeError("boom")
    assert get_memory_budget() is None


def test_numpy_integer_accepted():
    set_memory_budget(np.int64(1 << 30))
    budget = get_memory_budget()
    assert budget == 1 << 30 and type(budget) is int


@pytest.mark.parametrize("bad", [0, -1, -(2**40)])
def test_non_positive_budget_raises(bad):
    set_memory_budget(100)
    with pytest.raises(ValueError, match=f"positive.*got {bad}$"):
        set_memory_budget(bad)
    assert get_memory_budget() == 100  # a refused value changes nothing


@pytest.mark.parametrize("bad", [1.5, 1e6, "4096", True, np.float64(8.0), [1]])
def test_non_integer_budget_raises(bad):
    with pytest.raises(TypeError, match="integer number of bytes"):
        set_memory_budget(bad)
    assert get_memory_budget() is None


def test_message_names_the_value():
    with pytest.raises(TypeError, match="2.5"):
        set_memory_budget(2.5)
    with pytest.raises(ValueError, match="-7"):
        set_memory_budget(-7)


def test_budget_is_per_thread():
    set_memory_budget(1000)
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["start"] = get_memory_budget()
        set_memory_budget(5)
        seen["set"] = get_memory_budget()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"start": None, "set": 5}
    assert get_memory_budget() == 1000

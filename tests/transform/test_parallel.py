"""Work spread over forked processes gives what it gives in one process, whatever a child
does: finishes, raises, dies, hangs or returns what does not pickle."""

from __future__ import annotations

import os
import time

import pytest

from blade_relax.transform import _parallel
from blade_relax.transform._parallel import map_forked

pytestmark = pytest.mark.skipif(
    not _parallel._can_fork(), reason="needs the fork start method (POSIX)"
)


def _square_with_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
def test_results_are_in_order_and_children_did_their_share(jobs):
    got = map_forked(_square_with_pid, list(range(7)), jobs)
    assert [value for value, _ in got] == [x * x for x in range(7)]
    pids = {pid for _, pid in got}
    # Item i ran in the process of share i % jobs: this one for share 0.
    assert len(pids) == min(jobs, 7)
    assert all(pid == os.getpid() for _, pid in got[:: min(jobs, 7)])


def test_no_items_and_one_item_run_here():
    assert map_forked(_square_with_pid, [], 4) == []
    assert map_forked(_square_with_pid, [3], 4) == [(9, os.getpid())]


def _fails_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad item {x}")
    return x


def test_an_error_in_a_child_is_raised_here_from_the_same_code():
    # Item 3 is in the child's share (odd items): the child fails, the parent redoes the
    # share and raises the error itself.
    with pytest.raises(ValueError, match="bad item 3"):
        map_forked(_fails_on_three, [0, 1, 2, 3], 2)


def _dies_in_a_child(x: int) -> int:
    if _parallel._in_child:
        os._exit(3)
    return x + 1


def test_a_child_that_dies_has_its_share_done_here():
    assert map_forked(_dies_in_a_child, [1, 2, 3, 4], 2) == [2, 3, 4, 5]


def _unpicklable(x: int):
    return lambda: x


def test_a_result_that_does_not_pickle_is_computed_here():
    got = map_forked(_unpicklable, [1, 2, 3], 2)
    assert [f() for f in got] == [1, 2, 3]


def _hangs_in_a_child(x: int) -> int:
    if _parallel._in_child:
        time.sleep(600)
    return -x


def test_a_child_still_running_long_after_the_parent_is_stopped(monkeypatch):
    monkeypatch.setattr(_parallel, "_MIN_WAIT_S", 0.5)
    start = time.perf_counter()
    assert map_forked(_hangs_in_a_child, [1, 2], 2) == [-1, -2]
    assert time.perf_counter() - start < 60


def _nested(x: int) -> list[tuple[int, int]]:
    return map_forked(_square_with_pid, [x, x + 1], 2)


def test_a_child_forks_no_children_of_its_own():
    here, child = map_forked(_nested, [1, 5], 2)
    assert [v for v, _ in here] == [1, 4] and [v for v, _ in child] == [25, 36]
    # The child ran its nested call alone, in order.
    assert len({pid for _, pid in child}) == 1
    assert child[0][1] != os.getpid()


def _spread_in_a_pool_worker(_: int) -> list[tuple[int, int]]:
    return map_forked(_square_with_pid, [1, 2, 3], 2)


def test_a_daemonic_process_runs_everything_itself():
    # A multiprocessing.Pool worker is daemonic: it may not have children of its own.
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        (got,) = pool.map(_spread_in_a_pool_worker, [0])
    assert [v for v, _ in got] == [1, 4, 9]
    assert len({pid for _, pid in got}) == 1 and got[0][1] != os.getpid()


def test_available_cpus_is_positive():
    assert _parallel.available_cpus() >= 1

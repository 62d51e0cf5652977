"""Independent pieces of a pass's work, run in forked processes on cores the pass leaves idle.

The searches of the passes are Python, and Python runs one thread at a time: a second core
helps only through a second process. A forked child starts with everything the parent built
(the module, the shape graph, the block models) without copying it up front, and hands back
only its results, pickled (orders, peaks, reports: no IR).

The result never depends on where a piece ran. Where forking is unsafe or impossible (see
:func:`_can_fork`) or one CPU is usable, everything runs here, in order. A child that fails
in any way (it raised, it died, its result does not unpickle, it is still running long after
the parent finished its own share) is stopped and its share is done here instead, so that an
error is raised as it would be without children, from the same code.

``concurrent.futures.ProcessPoolExecutor`` pickles each task's function and arguments (here:
TVM objects, which do not pickle) and keeps its processes alive between calls; a pass needs
one fork per call and nothing pickled but the results, which ``multiprocessing``'s fork
context gives with a ``Process`` and a ``Pipe`` per child.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["available_cpus", "map_forked"]

_T = TypeVar("_T")
_R = TypeVar("_R")

# A child still running this long after the parent finished its own share, and at least
# _MIN_WAIT_S seconds, is taken for stuck: its share is done here.
_WAIT_FACTOR = 10.0
_MIN_WAIT_S = 60.0

# Set in a child: nested calls run in order there (a child forks no children).
_in_child = False


def available_cpus() -> int:
    """The CPUs this process may run on (1 where that cannot be told)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _can_fork() -> bool:
    """Whether children may be forked here: on Linux (macOS offers ``fork``, but forking a
    process that loaded its system frameworks may crash the child), outside a daemonic
    process (``multiprocessing`` forbids it children: a ``Pool`` worker is one) and outside
    a child of :func:`map_forked`."""
    return (
        not _in_child
        and sys.platform.startswith("linux")
        and not multiprocessing.current_process().daemon
        and "fork" in multiprocessing.get_all_start_methods()
    )


def _work(fn: Callable[[Any], Any], items: list[Any], send: Any) -> None:
    """A child's share: ``("ok", results)``, or ``("error", message)`` when ``fn`` raised."""
    global _in_child
    _in_child = True
    try:
        message: tuple[str, Any] = ("ok", [fn(item) for item in items])
    except BaseException as err:  # the parent redoes the share and raises it there
        message = ("error", f"{type(err).__name__}: {err}")
    try:
        send.send(message)
    except Exception:  # an unpicklable result: the parent redoes the share
        send.send(("error", "result could not be pickled"))
    finally:
        send.close()


def _collect(recv: Any, timeout: float) -> list[Any] | None:
    """A child's results, or None when it failed or ran out of ``timeout``."""
    try:
        if not recv.poll(timeout):
            return None
        status, value = recv.recv()
    except Exception:  # it died (EOFError, OSError) or sent what does not unpickle
        return None
    return value if status == "ok" else None


def map_forked(fn: Callable[[_T], _R], items: Sequence[_T], jobs: int) -> list[_R]:
    """``[fn(item) for item in items]``, the items spread over up to ``jobs`` processes.

    This process takes items ``0, jobs, 2 * jobs, ...``; forked child ``j`` takes items
    ``j, j + jobs, ...``. ``fn``'s results must pickle; ``fn`` must not rely on side effects
    of the other items (a child's side effects stay in the child).

    Parameters
    ----------
    fn
        The work per item.
    items
        The items, in the order of the results.
    jobs
        Most processes to use, this one included (1: everything here, in order).

    Returns
    -------
    list
        One result per item, in order: the same as without children.
    """
    items = list(items)
    jobs = max(1, min(jobs, len(items)))
    if jobs == 1 or not _can_fork():
        return [fn(item) for item in items]
    ctx = multiprocessing.get_context("fork")
    shares = [list(range(j, len(items), jobs)) for j in range(jobs)]
    workers = []
    out: list[Any] = [None] * len(items)
    try:
        for share in shares[1:]:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_work, args=(fn, [items[i] for i in share], send))
            proc.daemon = True
            proc.start()
            send.close()
            workers.append((share, proc, recv))
        start = time.perf_counter()
        for i in shares[0]:
            out[i] = fn(items[i])
        timeout = max(_MIN_WAIT_S, _WAIT_FACTOR * (time.perf_counter() - start))
        for share, proc, recv in workers:
            results = _collect(recv, timeout)
            if results is None or len(results) != len(share):
                proc.kill()
                results = [fn(items[i]) for i in share]
            for i, result in zip(share, results):
                out[i] = result
    finally:
        for _, proc, recv in workers:
            if proc.is_alive():
                proc.kill()
            proc.join()
            recv.close()
    return out

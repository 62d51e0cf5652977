"""The schedules :class:`~.memory_aware_schedule.MemoryAwareSchedule` made in this process,
remembered for an input it meets again.

A module is often lowered twice in one process: once to the memory stage for its predicted
peaks (``lower_to_memory_stage``, as ``blade_relax.bench.predict`` does) and once more to be
built, or compiled again by a second ``Trainer`` of the same step. The schedule is
most of the default pipeline's time (8 of 14 s on the small Llama's training step), and it is
a function of what the pass reads: the module (its Relax functions and kernels), the pass's
options, and the target and ``PassContext`` configuration under which kernel workspaces are
read. A run whose input equals a remembered one in all of these (structural equality, not a
hash alone) takes the remembered result and report instead of searching again; the result is
the one the search would give, which is deterministic (see ``.._parallel`` for the forked
parts).

``functools.lru_cache`` keys by ``==`` and ``hash``, which TVM objects define by identity; the
structurally equal modules of two lowerings are distinct objects, so the memo is written here.
The seconds a hit did not spend again are counted (:func:`remembered_seconds`), so that a
benchmark's compile time can stay that of a cold compile.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi

__all__ = ["CompileClock", "forget_schedules", "remembered_seconds"]


@dataclass
class _Entry:
    source: tvm.IRModule
    config: Any  # the PassContext's config the run read (the rest of its context is keyed)
    result: tvm.IRModule
    report: Any
    seconds: float
    warnings: list[warnings.WarningMessage]


def _context() -> tuple[tuple, Any]:
    """What the pass reads from the ambient contexts: the target (kernel workspaces are read
    from the kernels lowered for it) and the ``PassContext`` options that lowering runs with,
    as a hashable key and the config (a TVM map, compared structurally)."""
    target = tvm.target.Target.current(allow_none=True)
    ctx = tvm.transform.PassContext.current()
    key = (
        None if target is None else str(target),
        int(ctx.opt_level),
        tuple(sorted(str(name) for name in ctx.disabled_pass)),
    )
    return key, ctx.config


class ScheduleMemo:
    """The last ``size`` runs of the pass: input, context, options, result and report.

    ``size`` is small: each entry holds two modules (most of their kernels shared), and the
    repeats worth catching are a lowering for predictions followed by the build, or a second
    trainer of one step, each a few runs apart at most.
    """

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.seconds_saved = 0.0

    def run(
        self, mod: tvm.IRModule, options: Any, schedule: Callable[[], tuple[tvm.IRModule, Any]]
    ) -> tuple[tvm.IRModule, Any]:
        """``schedule()`` (the pass's own run on ``mod`` with ``options``) or the remembered
        result of an equal input; the report is a copy either way (callers may annotate it),
        and the warnings the run gave are given again."""
        context, config = _context()
        key = (tvm_ffi.structural_hash(mod), options, context)
        entry = self._entries.get(key)
        if (
            entry is not None
            and tvm_ffi.structural_equal(entry.config, config)
            and tvm_ffi.structural_equal(entry.source, mod)
        ):
            self._entries.move_to_end(key)
            self.seconds_saved += entry.seconds
            _reissue(entry.warnings)
            # An unchanged module is handed back as the caller's own object.
            result = mod if entry.result.same_as(entry.source) else entry.result
            return result, copy.deepcopy(entry.report)
        start = time.perf_counter()
        # The run's warnings (a fallback, say) are given again by every hit.
        with warnings.catch_warnings(record=True) as caught:
            result, report = schedule()
        seconds = time.perf_counter() - start
        _reissue(caught)
        self._entries[key] = _Entry(mod, config, result, copy.deepcopy(report), seconds, caught)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return result, report

    def clear(self) -> None:
        self._entries.clear()


def _reissue(caught: list[warnings.WarningMessage]) -> None:
    """Warn again what a run warned, each where it was first raised."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


MEMO = ScheduleMemo()


def forget_schedules() -> None:
    """Drop every remembered run: the next run of each input searches again. For code that
    changes what the pass computes while the process runs (a test patching its parts)."""
    MEMO.clear()


def remembered_seconds() -> float:
    """Seconds of scheduling that runs of ``MemoryAwareSchedule`` in this process did not
    spend, because an earlier run had scheduled an equal input (the seconds that run took)."""
    return MEMO.seconds_saved


class CompileClock:
    """The time of a compile as a cold one costs: the wall time since the clock was made,
    plus the scheduling that remembered runs skipped meanwhile (:func:`remembered_seconds`).
    Compile times that benchmarks and the ``Trainer`` report are read from it, so that a
    module lowered twice in one process does not report a second compile cheaper than a
    user's first."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._remembered = remembered_seconds()

    def seconds(self) -> float:
        return time.perf_counter() - self._start + remembered_seconds() - self._remembered

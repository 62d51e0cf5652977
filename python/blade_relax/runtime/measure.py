"""How one VM call is measured: the one helper every measuring path goes through.

:func:`measure_call` measures one call of a VM function by the rules below and returns a
:class:`CallMeasurement`; the command line's demo, the benchmark ruler, the differential
harness and the overhead benchmark all measure through it. :func:`measure_memory` is the block
it is built on, for callers that run the call themselves.

The rules, in the order they apply:

1. The call runs with the cyclic garbage collector paused (:mod:`blade_relax.util.collection`):
   a collection during the call could free a tensor of an earlier call that only a reference
   cycle still holds, and ``peak_bytes`` would not count bytes the call itself held. Such
   tensors are live bytes at entry, then, and ``peak_bytes`` and a ``budget`` are exact
   with or without them. Garbage is collected first (``collect_garbage``) so that
   ``live_before`` and ``peak_absolute`` do not count them either; only when the thread holds
   counted bytes (storage or host copies) at all: a full collection walks every object of
   the process (0.2 s once TVM is imported, 0.5 s once a Hugging Face model is), and with
   nothing counted alive there is nothing it could release that the figures would see. A
   caller that reads only ``peak_bytes`` skips it (``collect_garbage=False``, as the
   Trainer's step does).
2. Given an executable, the call runs on a fresh VM, dropped once the outputs are
   converted. A Relax VM keeps the value it returned last alive until its next call
   *returns* (``return_value_`` in TVM's ``vm.cc``), so a reused VM enters the call with
   its previous result live. Without a budget that changes nothing (those bytes are in the
   base and stay live until after the call's last allocation), but under a budget they
   count against it and the remat runtime may let them go during the call, which would
   credit the call with bytes the previous one left behind. Given a VM, the call reuses it
   (to check, say, what a VM releases once dropped); its previous result is then part of
   ``live_before``, not of ``peak_bytes``.
3. The thread's statistics are reset and the bytes live at entry read: ``live_before``, the
   base (:func:`measure_memory`, which also counts the kernels' workspaces when a table is
   given, and runs the caller's ``instrument``).
4. The memory budget counts every live byte of the thread (the caller's tensors a VM
   allocated, other VMs' results, ...), not the call's alone: a call allowed ``x`` bytes
   runs under ``set_memory_budget(live_before + x)`` (``budget=x``). A caller that computed
   the runtime's figure itself passes ``runtime_budget`` instead.
5. ``peak_bytes`` is the thread's peak during the call minus ``live_before``.
6. The last remat decision is cleared before the call, so that ``decision`` is this call's
   (kept only when made for this call's budget).

``measure_memory`` wraps what runs inside its block (one call of a VM function, usually) and
reads the accounting of :mod:`blade_relax.runtime.accounting` around it:

* the thread's peak is reset to the bytes live at entry, which the record keeps as
  ``live_before`` (a VM still holds the result of its previous call: see "Measuring one call"
  in the accounting's docstring);
* when a workspace table is given, the VM's instrument counts every kernel's workspace while
  the kernel runs (:func:`~blade_relax.runtime.accounting.workspace_instrument`), composed with
  the caller's own instrument if any; the instrument is removed on exit;
* on exit the statistics are read into the record.

The table comes from the module that was compiled (``blade_relax.analysis.workspace
.workspace_table(mod)``); this module only reads it, so the runtime stays free of the
compiler. Without a table, kernel workspaces are not counted (the figures are those of the
VM's own allocations).

Usage::

    table = workspace_table(compiled_module)
    m = measure_call(executable, args, budget=budget, workspaces=table)
    m.peak_bytes, m.workspace_bytes, m.evictions, m.outputs

    # or, running the call oneself:
    with measure_memory(vm, workspaces=table) as m:
        with set_memory_budget(m.live_before + budget):
            out = vm["main"](*args)
    m.peak_bytes, m.workspace_bytes
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax

from ..util.collection import collection_paused
from .accounting import memory_stats, reset_memory_stats, workspace_instrument
from .budget import set_memory_budget

__all__ = [
    "CallMeasurement",
    "CallMemory",
    "WorkspaceTable",
    "measure_call",
    "measure_memory",
    "outputs_to_numpy",
]

WorkspaceTable = Mapping[str, Callable[[Sequence[Any]], int]]
"""Kernel symbol -> ``f(kernel_args) -> bytes`` (see :func:`measure_memory`)."""


@dataclass
class CallMemory:
    """What one measured block did to memory (filled in when the block exits).

    Attributes
    ----------
    live_before
        Bytes live in this thread at entry (the VM's previous result, the caller's tensors
        when they were allocated by a VM, ...).
    peak_bytes
        Highest live bytes during the block minus ``live_before``: what the block added.
    peak_absolute
        Highest live bytes during the block (what a memory budget is compared with).
    workspace_bytes
        Kernel workspace included in that peak.
    stats
        ``memory_stats()`` at exit.
    """

    live_before: int = 0
    peak_bytes: int = 0
    peak_absolute: int = 0
    workspace_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def measure_memory(
    vm: Any = None,
    *,
    workspaces: WorkspaceTable | None = None,
    instrument: Callable[..., Any] | None = None,
) -> Iterator[CallMemory]:
    """Measure the memory of the block (see the module docstring).

    Parameters
    ----------
    vm
        The ``tvm.relax.VirtualMachine`` the block calls; needed for ``workspaces`` and
        ``instrument`` (its instrument is replaced during the block and removed after).
    workspaces
        Kernel workspace table of the executable the VM runs; its kernels' workspaces are
        counted while they run.
    instrument
        The caller's own VM instrument, run as well.

    Yields
    ------
    CallMemory
        ``live_before`` is set at once; the rest when the block exits.
    """
    reset_memory_stats()
    record = CallMemory(live_before=memory_stats()["live_bytes"])
    hook = None
    if workspaces:
        hook = workspace_instrument(workspaces, instrument)
    elif instrument is not None:
        hook = instrument
    if hook is not None:
        if vm is None:
            raise ValueError("measure_memory: a workspace table or an instrument needs the VM")
        vm.set_instrument(hook)
    try:
        yield record
    finally:
        if hook is not None:
            vm.set_instrument(None)
    stats = memory_stats()
    record.stats = stats
    record.peak_absolute = stats["peak_bytes"]
    record.peak_bytes = stats["peak_bytes"] - record.live_before
    record.workspace_bytes = stats["peak_workspace_bytes"]


def outputs_to_numpy(value: Any) -> Any:
    """What a VM function returned, as numpy: tensors become arrays, tuples lists, the rest
    stays as it is (the default ``convert`` of :func:`measure_call`)."""
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":
        return [outputs_to_numpy(v) for v in value]
    return value


@dataclass(frozen=True)
class CallMeasurement:
    """One measured call of a VM function (see :func:`measure_call`).

    Attributes
    ----------
    outputs
        What the call returned, passed through ``convert`` (numpy by default; ``None`` when the
        result was dropped).
    peak_bytes
        Highest live bytes during the call minus ``live_before``: what the call added, kernel
        workspaces included when a table was given.
    peak_absolute
        Highest live bytes of the thread during the call (what a memory budget is compared
        with).
    live_before
        Bytes live in this thread when the call started (the base).
    workspace_bytes
        Kernel workspace included in the peak.
    evictions, regenerations, allocations
        The call's counters in :func:`~blade_relax.runtime.memory_stats`.
    runtime_budget
        The memory budget the call ran under, in the runtime's terms (every live byte of the
        thread: ``live_before`` plus the step's budget); ``None`` without one.
    decision
        The rematerialization runtime's decision for this call
        (:func:`~blade_relax.runtime.last_remat_decision`): ``None`` without a budget or when
        the function made none.
    recorded_warnings
        The warnings raised during the call, when asked to record them.
    budget_warnings
        How many of those are :class:`~blade_relax.runtime.RematBudgetWarning` (an unreachable
        budget, an inexact timeline).
    stats
        ``memory_stats()`` when the call returned.
    """

    outputs: Any
    peak_bytes: int
    peak_absolute: int
    live_before: int
    workspace_bytes: int
    evictions: int
    regenerations: int
    allocations: int
    runtime_budget: int | None = None
    decision: dict[str, Any] | None = None
    recorded_warnings: tuple[warnings.WarningMessage, ...] = ()
    budget_warnings: int = 0
    stats: Mapping[str, Any] = field(default_factory=dict)


def _holds_counted_bytes() -> bool:
    """Whether this thread holds storage or host copies the accounting counts (rule 1)."""
    stats = memory_stats()
    return stats["live_bytes"] > 0 or stats["host_bytes"] > 0


def measure_call(
    vm: Any,
    args: Sequence[Any],
    *,
    function: str = "main",
    budget: int | None = None,
    runtime_budget: int | None = None,
    workspaces: WorkspaceTable | None = None,
    instrument: Callable[..., Any] | None = None,
    device: Any = None,
    convert: Callable[[Any], Any] | None = outputs_to_numpy,
    collect_garbage: bool = True,
    record_warnings: bool = False,
) -> CallMeasurement:
    """Call ``vm[function](*args)`` once and measure its memory, by the rules of the module
    docstring (numbered there): garbage collected first, an executable run on a fresh VM, the
    budget counted on top of the bytes live at entry, and the remat decision kept only when
    it is this call's.

    Parameters
    ----------
    vm
        A ``tvm.relax.VirtualMachine`` to call (reused), or the executable to run on a fresh
        VM on ``device`` (rule 2; the way to measure a step).
    args
        The arguments; tensors, shape tuples and Python scalars (a ``R.Prim`` parameter) are
        passed as they are, the rest (numpy arrays) is copied to ``device`` first, outside
        the measured bytes.
    function
        The VM function to call.
    budget
        Bytes the call may add on top of ``live_before`` (rule 4); ``None``: no budget.
    runtime_budget
        The budget as the runtime takes it (``live_before`` included); not with ``budget``.
    workspaces
        The executable's kernel workspace table
        (``blade_relax.analysis.workspace.workspace_table``), counted while each kernel runs.
    instrument
        A VM instrument of the caller's own, run around every VM call of the measured call.
    device
        Where a fresh VM runs and numpy arguments go (default: the CPU).
    convert
        Applied to the result before a fresh VM is dropped (default: numpy arrays, tuples as
        lists); ``None`` drops the result.
    collect_garbage
        Run ``gc.collect()`` first, where it could change ``live_before`` or
        ``peak_absolute`` (rule 1; ``peak_bytes`` and a ``budget`` are exact without it).
    record_warnings
        Catch every warning the call raises (none is shown) into ``recorded_warnings``, and
        count the :class:`~blade_relax.runtime.RematBudgetWarning` among them; otherwise
        warnings go through the caller's filters.

    Returns
    -------
    CallMeasurement
        The outputs, the bytes and what the remat runtime did.
    """
    from .remat import clear_last_remat_decision

    if budget is not None and runtime_budget is not None:
        raise ValueError("measure_call: give budget or runtime_budget, not both")
    device = device if device is not None else tvm.cpu()
    if collect_garbage and _holds_counted_bytes():
        gc.collect()
    if not isinstance(vm, relax.VirtualMachine):
        vm = relax.VirtualMachine(vm, device)
    call = vm[function]
    tensors = _on_device(args, device)
    clear_last_remat_decision()
    with _warnings_recorded(record_warnings) as caught, collection_paused():
        with measure_memory(vm, workspaces=workspaces, instrument=instrument) as measured:
            if budget is not None:
                runtime_budget = measured.live_before + budget
            out = _call_within(call, tensors, runtime_budget)
    outputs = convert(out) if convert is not None else None
    del out, call, vm
    return _measurement(outputs, measured, runtime_budget, tuple(caught))


def _on_device(args: Sequence[Any], device: Any) -> list[Any]:
    """The arguments as the VM takes them: tensors, shape tuples and Python scalars as they
    are, the rest (numpy arrays) copied to ``device``."""
    passed_as_is = (tvm.runtime.Tensor, tvm.runtime.ShapeTuple, bool, int, float)
    return [a if isinstance(a, passed_as_is) else tvm.runtime.tensor(a, device) for a in args]


@contextlib.contextmanager
def _warnings_recorded(record: bool) -> Iterator[list[warnings.WarningMessage]]:
    """Every warning the block raises, caught into the yielded list (none is shown) when
    ``record``; otherwise the caller's filters apply and the list stays empty."""
    if not record:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _call_within(call: Callable[..., Any], tensors: Sequence[Any], runtime_budget: int | None):
    """``call(*tensors)``, under ``runtime_budget`` when one is given (rule 4)."""
    if runtime_budget is None:
        return call(*tensors)
    with set_memory_budget(runtime_budget):
        return call(*tensors)


def _measurement(
    outputs: Any,
    measured: CallMemory,
    runtime_budget: int | None,
    recorded: tuple[warnings.WarningMessage, ...],
) -> CallMeasurement:
    """The record of a measured call: its bytes and counters, and the remat decision when
    the runtime made it for this call's budget (rule 6)."""
    from .remat import RematBudgetWarning, last_remat_decision

    decision = last_remat_decision() if runtime_budget is not None else None
    if decision is not None and decision.get("budget") != runtime_budget:
        decision = None
    stats = measured.stats
    return CallMeasurement(
        outputs=outputs,
        peak_bytes=measured.peak_bytes,
        peak_absolute=measured.peak_absolute,
        live_before=measured.live_before,
        workspace_bytes=measured.workspace_bytes,
        evictions=stats.get("evictions", 0),
        regenerations=stats.get("regenerations", 0),
        allocations=stats.get("allocations", 0),
        runtime_budget=runtime_budget,
        decision=decision,
        recorded_warnings=recorded,
        budget_warnings=sum(1 for w in recorded if issubclass(w.category, RematBudgetWarning)),
        stats=stats,
    )

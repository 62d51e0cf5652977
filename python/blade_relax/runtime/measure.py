"""How one VM call is measured: the one helper every measuring path goes through.

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
    with measure_memory(vm, workspaces=table) as m:
        with set_memory_budget(m.live_before + budget):
            out = vm["main"](*args)
    m.peak_bytes, m.workspace_bytes
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .accounting import memory_stats, reset_memory_stats, workspace_instrument

__all__ = ["CallMemory", "WorkspaceTable", "measure_memory"]

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

"""The memory budget that the rematerialization runtime works under.

The compiler inserts ``evict`` / ``regenerate`` builtins; whether an eviction happens is decided
at run time from the concrete sizes and this budget: the remat runtime reads
:func:`get_memory_budget` and compares it with the live bytes the accounting measures
(:func:`blade_relax.runtime.current_live_bytes`). ``None`` (the default) means no budget: the
runtime evicts nothing.

Like the accounting, the budget is per thread: a VM call runs in the calling thread and sees the
budget that thread set. A new thread starts without a budget.

Usage::

    set_memory_budget(64 * 2**20)          # from now on, in this thread
    with set_memory_budget(2**20):         # only inside the block
        vm["main"](x)
    set_memory_budget(None)                # no budget
    with set_relative_budget(0.8):         # each call: 0.8 x its own peak without evictions
        vm["main"](x)

A relative budget is for callers that do not know a call's peak in advance (a training loop
over varying lengths): each call that makes a remat decision allows itself ``fraction`` times
the peak its timeline predicts without evictions, at its own sizes, on top of the bytes live
when it starts. An absolute budget, when set too, takes precedence.

The eviction mode
-----------------
What happens to a tensor the decision evicts, per thread like the budget
(:func:`set_eviction_mode`):

``"recompute"`` (the default)
    It is dropped at ``evict`` and recomputed by its regeneration closure at ``regenerate``.
``"offload"``
    It is copied to host memory (pinned on CUDA) at ``evict``, its device storage freed, and
    copied back into a fresh device tensor at ``regenerate``: nothing is recomputed.
``"auto"``
    Per evicted tensor, the cheaper of the two by estimated time: the copy there and back,
    ``2 * bytes / bandwidth``, against the recomputation, ``cost / recompute_rate`` (see
    :mod:`blade_relax.runtime.offload`).

Usage::

    with set_eviction_mode("offload"), set_memory_budget(2**30):
        vm["main"](x)
    set_eviction_mode("auto", bandwidth=20e9, recompute_rate=5e11)   # rates given, not measured
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "EVICTION_MODES",
    "BudgetScope",
    "EvictionMode",
    "EvictionScope",
    "check_budget",
    "check_fraction",
    "get_eviction_mode",
    "get_memory_budget",
    "get_relative_budget",
    "set_eviction_mode",
    "set_memory_budget",
    "set_relative_budget",
]

#: The eviction modes, the default first.
EVICTION_MODES = ("recompute", "offload", "auto")

_local = threading.local()


def check_budget(nbytes: Any) -> int | None:
    """An absolute budget checked as :func:`set_memory_budget` checks it.

    Parameters
    ----------
    nbytes
        A positive integer number of bytes (anything with ``__index__`` but a bool), or None.

    Returns
    -------
    int or None
        The budget as an ``int``, or None for no budget.

    Raises
    ------
    TypeError
        For anything but None or an integer (a bool or a float is refused).
    ValueError
        For zero or a negative number.
    """
    if nbytes is None:
        return None
    # bool is an int subclass, and True bytes is surely a mistake.
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(
            "memory budget must be an integer number of bytes or None, "
            f"got {nbytes!r} ({type(nbytes).__name__})"
        )
    value = int(nbytes.__index__())
    if value <= 0:
        raise ValueError(f"memory budget must be a positive number of bytes, got {value}")
    return value


def check_fraction(fraction: Any) -> float | None:
    """A relative budget checked as :func:`set_relative_budget` checks it.

    Parameters
    ----------
    fraction
        A real number in ``(0, 1]`` (a bool is refused), or None.

    Returns
    -------
    float or None
        The fraction as a ``float``, or None for no relative budget.

    Raises
    ------
    TypeError
        For anything but None or a real number.
    ValueError
        For a number outside ``(0, 1]``.
    """
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"a relative budget is a number in (0, 1] or None, not {fraction!r}")
    if not 0 < float(fraction) <= 1:
        raise ValueError(f"a relative budget lies in (0, 1], got {fraction!r}")
    return float(fraction)


class BudgetScope:
    """What :func:`set_memory_budget` returns: the budget is already set when it exists.

    Used as a context manager, it restores on exit the budget that was in force before the
    :func:`set_memory_budget` call that made it (in the thread that exits the block). Used as a
    plain statement, it can be ignored.

    Attributes
    ----------
    nbytes : int or None
        The budget that was set.
    previous : int or None
        The budget in force before it.
    """

    __slots__ = ("nbytes", "previous")

    def __init__(self, nbytes: int | None, previous: int | None) -> None:
        self.nbytes = nbytes
        self.previous = previous

    def __enter__(self) -> int | None:
        return self.nbytes

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _local.budget = self.previous

    def __repr__(self) -> str:
        return f"BudgetScope(nbytes={self.nbytes}, previous={self.previous})"


def set_memory_budget(nbytes: int | None) -> BudgetScope:
    """Set this thread's memory budget.

    Parameters
    ----------
    nbytes : int or None
        The most bytes of VM-allocated storage the remat runtime should keep live (compared with
        the accounting's ``live_bytes``); a positive integer, or None for no budget.

    Returns
    -------
    BudgetScope
        A context manager that restores the previous budget on exit
        (``with set_memory_budget(2**20): ...``); it may be ignored.

    Raises
    ------
    TypeError
        If ``nbytes`` is neither None nor an integer (a bool or a float is refused).
    ValueError
        If ``nbytes`` is zero or negative.
    """
    value = check_budget(nbytes)
    previous = get_memory_budget()
    _local.budget = value
    return BudgetScope(value, previous)


def get_memory_budget() -> int | None:
    """This thread's memory budget in bytes, or None when there is none."""
    return getattr(_local, "budget", None)


class _RelativeScope:
    __slots__ = ("fraction", "previous")

    def __init__(self, fraction: float | None, previous: float | None) -> None:
        self.fraction = fraction
        self.previous = previous

    def __enter__(self) -> float | None:
        return self.fraction

    def __exit__(self, *exc: object) -> None:
        _local.relative = self.previous


def set_relative_budget(fraction: float | None) -> _RelativeScope:
    """Set this thread's relative memory budget (see the module docstring).

    Parameters
    ----------
    fraction : float or None
        In ``(0, 1]``: each call may add ``fraction`` times its own unbudgeted peak; ``None``
        removes it.

    Returns
    -------
    A context manager restoring the previous relative budget on exit (may be ignored).

    Raises
    ------
    TypeError, ValueError
        For anything but ``None`` or a number in ``(0, 1]``.
    """
    fraction = check_fraction(fraction)
    previous = get_relative_budget()
    _local.relative = fraction
    return _RelativeScope(fraction, previous)


def get_relative_budget() -> float | None:
    """This thread's relative memory budget, or None when there is none."""
    return getattr(_local, "relative", None)


@dataclass(frozen=True)
class EvictionMode:
    """What an evicted tensor becomes (see the module docstring), and the rates ``"auto"`` and
    ``"offload"`` weigh it with.

    Attributes
    ----------
    mode
        ``"recompute"``, ``"offload"`` or ``"auto"``.
    bandwidth
        Host-device bandwidth in bytes per second, one way; ``None``: measured on first use
        (:func:`blade_relax.runtime.host_bandwidth`).
    recompute_rate
        Recompute cost units (the kernels' loop iterations, as the compiler writes a slot's
        cost) per second; ``None``: measured on first use
        (:func:`blade_relax.runtime.recompute_rate`).
    device
        The device the rates are measured on when not given; ``None``: ``cuda:0`` when a CUDA
        device exists, else the CPU.
    """

    mode: str = "recompute"
    bandwidth: float | None = None
    recompute_rate: float | None = None
    device: object | None = None


_RECOMPUTE = EvictionMode()


def _check_rate(value: object, what: str) -> float | None:
    """A rate as a positive finite float, or None; a clear error for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a positive number or None, not {value!r}")
    rate = float(value)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return rate


class EvictionScope:
    """What :func:`set_eviction_mode` returns: a context manager restoring the previous mode.

    Attributes
    ----------
    mode : EvictionMode
        The mode that was set.
    previous : EvictionMode
        The mode in force before it.
    """

    __slots__ = ("mode", "previous")

    def __init__(self, mode: EvictionMode, previous: EvictionMode) -> None:
        self.mode = mode
        self.previous = previous

    def __enter__(self) -> EvictionMode:
        return self.mode

    def __exit__(self, *exc: object) -> None:
        _local.eviction = self.previous

    def __repr__(self) -> str:
        return f"EvictionScope(mode={self.mode}, previous={self.previous})"


def set_eviction_mode(
    mode: str = "recompute",
    *,
    bandwidth: float | None = None,
    recompute_rate: float | None = None,
    device: object | None = None,
) -> EvictionScope:
    """Set what this thread's evicted tensors become (see the module docstring).

    Parameters
    ----------
    mode : str
        ``"recompute"`` (the default), ``"offload"`` or ``"auto"``.
    bandwidth : float, optional
        Host-device bandwidth in bytes per second (one way); measured once per device when
        ``None`` and the mode needs it.
    recompute_rate : float, optional
        Recompute cost units per second (``"auto"`` only); measured once per device when
        ``None``.
    device : tvm.runtime.Device, optional
        Where the rates that are not given are measured (default: ``cuda:0`` when a CUDA
        device exists, else the CPU).

    Returns
    -------
    EvictionScope
        A context manager that restores the previous mode on exit; it may be ignored.

    Raises
    ------
    ValueError
        For an unknown mode, or a bandwidth or rate that is not positive and finite.
    TypeError
        For a mode that is not a string, or a rate that is not a number.
    """
    if not isinstance(mode, str):
        raise TypeError(f"eviction mode must be a string, one of {EVICTION_MODES}, not {mode!r}")
    if mode not in EVICTION_MODES:
        raise ValueError(f"unknown eviction mode {mode!r}; expected one of {EVICTION_MODES}")
    value = EvictionMode(
        mode,
        _check_rate(bandwidth, "host-device bandwidth (bytes per second)"),
        _check_rate(recompute_rate, "recompute rate (cost units per second)"),
        device,
    )
    previous = get_eviction_mode()
    _local.eviction = value
    return EvictionScope(value, previous)


def get_eviction_mode() -> EvictionMode:
    """This thread's eviction mode (``EvictionMode("recompute")`` unless set)."""
    return getattr(_local, "eviction", _RECOMPUTE)

"""CPython's cyclic garbage collector paused: around every pass, and around a measured VM call.

The passes build many long-lived Python objects: per-binding effects, symbolic sizes, memo
tables, wrappers of IR nodes. CPython's collector decides when to run a full collection by how
many objects survived the younger generations, and a full collection walks every tracked
object of the process, the IR wrappers and sympy's caches included. Lowering a 22-layer Llama
training step with every pass on (about 850,000 tracked objects) paid 2.3 s of 16.8 s in five
full collections, where the stock pipeline paid none. Reference counting still frees nearly
everything a pass drops; the cycles it leaves are collected by the first collection after the
pass (with the collector paused over that whole lowering, they were about 69,000 objects; paused
per pass, the lowering's peak RSS is the same as without a pause).

A measured VM call (:func:`blade_relax.runtime.measure_call`) runs paused for another reason: a
collection during the call could free a tensor of an earlier call that only a reference cycle
held, and the call would be credited with bytes it did not release (its peak is measured above
the bytes live at entry).

The pause is re-entrant (a pass run by another pass, as ``MemoryAwareSchedule`` runs
``RecomputeCheapValues``, leaves the outer pause in place) and leaves the collector as it found
it: a caller that disabled it keeps it disabled. It is process-wide, as the collector is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["collection_paused", "pauses_collection"]

_F = TypeVar("_F", bound=Callable)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause automatic garbage collection for the ``with`` block, if it is enabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pauses_collection(method: _F) -> _F:
    """Decorate a pass's ``transform_module`` to run under :func:`collection_paused`."""

    @functools.wraps(method)
    def paused(*args, **kwargs):
        with collection_paused():
            return method(*args, **kwargs)

    return paused  # type: ignore[return-value]

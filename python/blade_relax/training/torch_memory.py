"""Live bytes of PyTorch on the CPU, counted by a ``TorchDispatchMode``.

PyTorch has no allocator statistics for the CPU. :class:`LiveBytesCounter` sees every ATen op
while it is active and records each storage an op *creates* (an output whose storage is not one
of the op's inputs: views, in-place and ``out=`` ops allocate nothing), with a weak-reference
finalizer that subtracts its bytes when the storage dies. ``peak_bytes`` is the highest total of
live recorded storage: what a step allocates on top of what existed before (parameters,
inputs), outputs and gradients included. With ``meta=True`` it counts a step run on the
``meta`` device the same way (sizes without data: a prediction of the CPU peak, no compute).

``torch.compile`` needs two things to be measured the same way:

* the mode declares ``ignore_compile_internals``, without which dynamo refuses to run compiled
  code under a dispatch mode and silently falls back to eager;
* Inductor's CPU wrapper allocates buffers with ``torch._C._dynamo.guards._empty_strided_cpu``,
  which bypasses the dispatcher. :func:`visible_inductor_allocations` replaces it, while
  compiled code is generated and run, by ``torch.empty_strided`` (the same allocation, through
  the dispatcher, so the mode sees it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["LiveBytesCounter", "inductor_kernels_skipped", "visible_inductor_allocations"]


def _mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def _storages(tree: Any, meta: bool = False) -> list[Any]:
    """The storages of the tensors in ``tree``; a wrapper subclass (a ``DTensor``, as FSDP2's
    sharded parameters and their optimizer state are) by the storages of its inner tensors."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_flatten

    found = []
    leaves = tree_flatten(tree)[0]
    while leaves:
        leaf = leaves.pop()
        if is_traceable_wrapper_subclass(leaf):
            leaves.extend(getattr(leaf, name) for name in leaf.__tensor_flatten__()[0])
        elif isinstance(leaf, torch.Tensor) and (meta or leaf.device.type != "meta"):
            found.append(leaf.untyped_storage())
    return found


def _identity(storage: Any) -> int:
    """What tells two storages apart: the data pointer, or on ``meta`` (where every data
    pointer is 0) the storage object itself."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def _make_counter_class() -> type:
    base = _mode_base()

    class _LiveBytesCounter(base):  # type: ignore[misc, valid-type]
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __init__(self, meta: bool = False) -> None:
            super().__init__()
            self.meta = meta
            self.live_bytes = 0
            self.peak_bytes = 0
            self.allocations = 0
            self._tracked: dict[int, weakref.finalize] = {}

        def _release(self, key: int, nbytes: int) -> None:
            self.live_bytes -= nbytes
            self._tracked.pop(key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            meta = self.meta
            inputs = {_identity(st) for st in _storages((args, kwargs), meta) if st.nbytes()}
            for storage in _storages(out, meta):
                nbytes = storage.nbytes()
                key = id(storage)
                if nbytes == 0 or key in self._tracked or _identity(storage) in inputs:
                    continue
                self._tracked[key] = weakref.finalize(storage, self._release, key, nbytes)
                self.live_bytes += nbytes
                self.allocations += 1
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return out

        def detach_all(self) -> None:
            """Stop watching the recorded storages (their finalizers will not fire)."""
            for finalizer in self._tracked.values():
                finalizer.detach()
            self._tracked.clear()

    return _LiveBytesCounter


_COUNTER_CLASS: type | None = None


def LiveBytesCounter(*, meta: bool = False) -> Any:  # noqa: N802  (a factory that reads as a class)
    """A fresh counter: ``with LiveBytesCounter() as c: step(); c.peak_bytes``.

    Parameters
    ----------
    meta
        Count tensors on the ``meta`` device too (by default they are skipped). A step run on
        meta tensors allocates nothing and computes nothing, yet every ATen op still creates
        its outputs' storages with their sizes: the counter sees the same storages, so the
        same peak, as on the CPU (``tests/bench/test_torch_memory.py`` checks the equality on
        the Llama training step). :mod:`.predict` counts PyTorch eager at sizes too large to
        run this way.

    Attributes of the returned mode: ``peak_bytes``, ``live_bytes`` and ``allocations``.
    """
    global _COUNTER_CLASS
    if _COUNTER_CLASS is None:
        _COUNTER_CLASS = _make_counter_class()
    return _COUNTER_CLASS(meta)


@contextlib.contextmanager
def visible_inductor_allocations() -> Iterator[None]:
    """Route Inductor's CPU buffer allocations through the dispatcher while active."""
    import torch

    guards = torch._C._dynamo.guards
    original = getattr(guards, "_empty_strided_cpu", None)
    if original is None:  # pragma: no cover - other torch versions
        yield
        return

    def empty_strided_cpu(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    guards._empty_strided_cpu = empty_strided_cpu
    try:
        yield
    finally:
        guards._empty_strided_cpu = original


@contextlib.contextmanager
def inductor_kernels_skipped() -> Iterator[None]:
    """Run what Inductor compiles for the CPU without its kernels, while active.

    The generated wrapper still runs: it allocates every buffer (through
    :func:`visible_inductor_allocations`, when that is active too) and frees it where the
    compiled code does, so :class:`LiveBytesCounter` counts the same storages as on a real run,
    as long as no shape depends on data (none does in the bench's models). What is skipped:

    * C++ kernels: each becomes a function that does nothing, and is never compiled;
    * the GEMMs Inductor calls through ``extern_kernels`` (``mm``, ``bmm``, ``addmm``,
      ``baddbmm``): each returns its ``out`` buffer unwritten.

    ATen ops that the wrapper calls directly (fallbacks) still run, on unwritten memory. This is
    how :mod:`.predict` counts ``torch.compile`` at sizes too large to run; the counts equal
    the real run's at the small size (``tests/bench/test_predict.py``). PyTorch offers no dry
    run of compiled code, and Inductor cannot compile for the ``meta`` device.

    Dynamo's caches and the generated modules Inductor keeps in memory are cleared on entry
    and on exit, so that no code compiled with kernels runs without them and no code compiled
    without kernels is ever reused. Pair it with ``fx_graph_cache=False`` and
    ``enable_autograd_cache=False`` (as :mod:`.predict` does), which keep compiled graphs out of
    the on-disk caches.
    """
    import torch
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.select_algorithm import extern_kernels

    def cpp_pybinding(_self: Any, _argtypes: Any, _source_code: str) -> Any:
        return _skipped_kernel

    def gemm(*_args: Any, out: Any = None, **_kwargs: Any) -> Any:
        return out

    def forget_compiled() -> None:
        # Compiled code is remembered per process (dynamo's caches, and the generated modules,
        # whose kernels are bound when a module is loaded): code compiled with its kernels must
        # not run here, and code compiled without them must never run after.
        torch._dynamo.reset()
        PyCodeCache.cache_clear()

    forget_compiled()
    original_binding = AsyncCompile.cpp_pybinding
    gemms = ("mm", "bmm", "addmm", "baddbmm")
    originals = {name: getattr(extern_kernels, name) for name in gemms}
    AsyncCompile.cpp_pybinding = cpp_pybinding
    for name in gemms:
        setattr(extern_kernels, name, gemm)
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding = original_binding
        for name, function in originals.items():
            setattr(extern_kernels, name, function)
        forget_compiled()


def _skipped_kernel(*_args: Any, **_kwargs: Any) -> None:
    return None

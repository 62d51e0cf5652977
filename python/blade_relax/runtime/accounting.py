"""Byte-exact accounting of the tensor storage that Relax VMs allocate.

Where it sits
-------------
Importing :mod:`blade_relax` calls :func:`install_accounting`, which replaces the global packed
functions ``vm.builtin.alloc_storage`` and ``vm.builtin.to_device`` with wrappers that call the
originals and record what they return. A ``VirtualMachine`` binds its builtins when it is constructed, so every VM
created after the import is measured, whatever pipeline compiled it (stock TVM executables
included): baselines and blade_relax are measured by the same ruler. VMs created before the
import are not measured.

What is counted
---------------
* Every ``Storage`` returned by ``vm.builtin.alloc_storage``, at the size the VM asks for
  (``prod(shape) * itemsize`` of the request, in bytes; the allocator's own rounding and pooling
  are not counted, so the figures do not depend on ``memory_cfg``). In the stock pipeline every
  tensor the VM creates lives in such a storage: ``StaticPlanBlockMemory`` emits
  ``R.memory.alloc_storage``, ``LowerAllocTensor`` turns the remaining ``R.builtin.alloc_tensor``
  into ``R.memory.alloc_storage``, and both lower to ``vm.builtin.alloc_storage``.
  ``vm.builtin.alloc_tensor`` only creates a view into a storage, as do ``vm.builtin.reshape``
  and ``vm.builtin.copy`` (a register move): none of them allocates.
* Tensors returned by ``vm.builtin.to_device`` (``R.to_vdevice`` in heterogeneous programs),
  which copies into a fresh allocation behind ``alloc_storage``'s back.
* Anything registered through :func:`track_allocation` (for runtime builtins that allocate
  device memory themselves).

Not counted, by design: the caller's arguments and the executable's constants (persistent, owned
outside the VM call); the per-call shape heap (``vm.builtin.alloc_shape_heap``, a few int64);
the one-element host copies made by ``vm.builtin.read_if_cond`` / ``vm.builtin.tensor_to_shape``
for device tensors; the copy ``vm.builtin.ensure_zero_offset`` makes for a misaligned offset
(only reachable through an explicit ``R.memory.ensure_zero_offset``); vendor-library workspaces;
kernel workspaces (``TVMBackendAllocWorkspace`` inside compiled PrimFuncs) unless the call is
measured with a workspace table (below); arguments
copied by ``set_input`` / ``save_function`` when they live on another device; tensors created by
user packed functions (``R.call_packed`` to Python code that builds a tensor), unless they call
:func:`track_allocation`.

Kernel workspaces
-----------------
A compiled kernel takes its scratch memory (intermediate buffers of a fused kernel, e.g. the
softmax's ``(b, h, s, s)`` exponentials) from the device's workspace pool while it runs, behind
the VM's allocator: no builtin can see it. :func:`workspace_instrument` counts it from outside
instead: it is a VM instrument (``vm.set_instrument``, called before and after every VM call
with the callee's symbol and arguments) that looks the kernel up in a *workspace table*, a plain
mapping ``kernel symbol -> f(args) -> bytes`` built from the compiled module
(:func:`blade_relax.analysis.workspace.workspace_table`), and counts the bytes as one transient
allocation: live from just before the kernel runs (after a sweep, so the peak is exact) to just
after it returns. The runtime reads the table and nothing else of the compiler; the table, not
this module, knows what a kernel allocates. :func:`blade_relax.runtime.measure_memory` installs
the instrument around one measured call. Kernels the VM does not call itself (a PrimFunc handed
to a packed function and called from Python) are not seen.

How frees are detected
----------------------
The tracker keeps one reference to each storage and reads the strong reference count in the FFI
object header (the low 32 bits of ``combined_ref_count``, the first word of ``TVMFFIObject``).
When it is 1 (and no Python code shares the tracker's wrapper object), only the tracker holds
the storage: the VM and every tensor built on it have let go, and the tracker drops its
reference (which returns the buffer to the allocator). Dead storages are swept before each
allocation, before the original allocator is called, so the peak is exact and the allocator can
reuse the freed buffer at once; they are also swept whenever the statistics are read. A storage that dies after the last allocation of a call is held until the
next allocation or read: with ``memory_cfg="naive"`` its buffer returns to the system that much
later (the pooled allocator keeps freed buffers anyway).

Measuring one call
------------------
A VM keeps the value it returned last (``return_value_`` in TVM's ``vm.cc``) until its next
return or its destruction. The previous call's outputs therefore stay live, and counted, through
the whole next call even when the caller has dropped them; they are released when that call
returns. The peak a call adds is measured as::

    reset_memory_stats()
    before = memory_stats()["live_bytes"]
    out = vm["main"](*args)
    call_peak = memory_stats()["peak_bytes"] - before

``before`` contains whatever the VM still holds from its previous call, and that stays live
until after the call's last allocation, so ``call_peak`` is the call's own peak on a fresh or a
reused VM alike.

Cost
----
The wrapper runs in Python for every VM allocation: about 2 us for the VM to call a Python
function at all, plus about 1.5 us of bookkeeping. Looking for dead storages reads one reference
count per allocation this thread tracks as live: 30-80 ns each in a Python loop below 48 live
allocations, a numpy gather of about 2 us from there on, so the cost stays flat for graphs with
hundreds of live tensors. Measured through real VM calls on a 2-core x86 CPU.

The workspace instrument, when a call is measured with a table, is a Python call before and
after every VM call (not only kernels): 5-10 us per VM call on the same machine, e.g. +1.2 to
+16 ms on a 1,400-1,700-call training step of the small Llama (0.2-3 % of the step at s = 256,
up to 65 % of a 25 ms step at s = 20). It changes no result (the instrument always lets the
call run) and is installed only around the measured call: timed steps run without it.

Threads
-------
All statistics are per thread. A VM call runs in the calling thread, so the storage it allocates
is counted in that thread's statistics only; two VMs driven from two threads do not see each
other's numbers. A storage allocated in one thread and freed by another is still counted in the
thread that allocated it (its death is noticed at that thread's next sweep).

Statistics (``memory_stats()``)
-------------------------------
``peak_bytes``
    Highest ``live_bytes`` reached since the last :func:`reset_memory_stats`, all devices summed.
``live_bytes``
    Bytes of counted storage alive now, all devices summed.
``allocations`` / ``allocated_bytes``
    Number and bytes of counted allocations since the last reset.
``frees`` / ``freed_bytes``
    Number and bytes of counted allocations found dead since the last reset.
``peak_workspace_bytes``
    Bytes of kernel workspace included in ``peak_bytes`` (the workspace of the kernel running
    when the peak was reached; 0 when the peak fell between kernels or no table was given).
``workspaces`` / ``workspace_bytes``
    Number of kernel calls counted with a workspace, and their bytes, since the last reset.
``evictions`` / ``evicted_bytes``, ``regenerations`` / ``regenerated_bytes``
    Bumped by the rematerialization runtime through :func:`record_eviction` and
    :func:`record_regeneration`.
``offloads`` / ``offloaded_bytes``, ``reloads`` / ``reloaded_bytes``
    Evicted tensors copied to host memory (``"offload"`` and ``"auto"`` eviction modes), and
    host copies copied back to the device, through :func:`record_offload` and
    :func:`record_reload`. An offload is also an eviction; a reload is not a regeneration
    (no regeneration closure runs).
``host_bytes`` / ``peak_host_bytes``
    Bytes of host copies of evicted tensors held now, and their highest value since the last
    reset. Counted apart: they are in neither ``live_bytes`` nor ``peak_bytes`` (the device
    memory a budget bounds), even on the CPU, where host and device memory are one. The
    device tensor a reload makes is VM storage, counted as any other.
``devices``
    One entry per device that holds or held counted storage, keyed by the device's name
    (``"cpu:0"``, ``"cuda:0"``, ...): ``{"live_bytes", "peak_bytes", "allocations",
    "allocated_bytes"}``. ``peak_bytes`` there is that device's own peak, so device memory on a
    GPU is measured apart from host memory.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tvm
import tvm_ffi

__all__ = [
    "accounting_installed",
    "current_live_bytes",
    "install_accounting",
    "memory_stats",
    "record_eviction",
    "record_host_release",
    "record_offload",
    "record_regeneration",
    "record_reload",
    "reset_memory_stats",
    "track_allocation",
    "workspace_instrument",
]

_ALLOC_STORAGE = "vm.builtin.alloc_storage"
_TO_DEVICE = "vm.builtin.to_device"
# The originals are kept under these names so that installing twice (a reload of the package)
# wraps the C++ builtins, never an earlier wrapper.
_ORIGINAL_PREFIX = "blade_relax.runtime.original."

# The strong count is the low half of the 64-bit combined count at offset 0 of the header.
_STRONG_COUNT_OFFSET = 0 if sys.byteorder == "little" else 4
# ``StorageObj`` (tvm/runtime/memory/memory_manager.h) is the 24-byte object header followed by
# ``Buffer {void* data; size_t size; DLDevice device; ...}``: the device sits at byte 40. Reading
# it is four times cheaper than asking a view of the storage for its device. Each new value read
# there is checked once against such a view; on any mismatch the raw read is abandoned for good.
_STORAGE_DEVICE_OFFSET = 40
_raw_device_read_ok = True
# Raw 64-bit device words already checked -> the device they stand for (shared by all threads).
_checked_device_words: dict[int, Any] = {}

_EMPTY_SHAPE = tvm_ffi.Shape((0,))


def _tracker_py_refs() -> int:
    """What ``sys.getrefcount(entry[0])`` reads in ``_sweep`` when only the tracker holds it.

    Measured rather than assumed (the entry tuple and the call's argument on CPython today),
    because how ``getrefcount`` counts borrowed references differs between Python versions.
    """
    entries = [(object(), 0, None)]
    entry = entries[0]
    return sys.getrefcount(entry[0])


_TRACKER_PY_REFS = _tracker_py_refs()


def _device_word(device: Any) -> int:
    """The 64-bit word a ``DLDevice`` {int32 type, int32 id} reads as in memory."""
    dev_type, dev_id = device.dlpack_device_type(), device.index
    if sys.byteorder == "little":
        return (dev_type & 0xFFFFFFFF) | (dev_id & 0xFFFFFFFF) << 32
    return (dev_type & 0xFFFFFFFF) << 32 | (dev_id & 0xFFFFFFFF)


class _DeviceStats:
    """Counters of one device in one thread."""

    __slots__ = ("name", "live", "peak", "allocations", "allocated_bytes")

    def __init__(self, name: str) -> None:
        self.name = name
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self.allocated_bytes = 0


class _ThreadStats:
    """Everything the tracker knows in one thread.

    Three parallel sequences describe the live (or not yet swept) allocations, in no order:
    ``entries[i] = (object, nbytes, device_stats)`` holds the tracker's reference;
    ``views[i]`` reads the object's strong reference count; ``slots[i]`` is the index of that
    same count in ``_MEMORY`` (see there). Entries are removed by moving the last one into the
    hole, so a sweep costs the number of dead entries, not the number of live ones.
    """

    __slots__ = (
        "views",
        "entries",
        "slots",
        "live",
        "peak",
        "allocations",
        "allocated_bytes",
        "frees",
        "freed_bytes",
        "evictions",
        "evicted_bytes",
        "regenerations",
        "regenerated_bytes",
        "offloads",
        "offloaded_bytes",
        "reloads",
        "reloaded_bytes",
        "host_live",
        "host_peak",
        "devices",
        "transient",
        "peak_transient",
        "workspaces",
        "workspace_bytes",
    )

    def __init__(self) -> None:
        self.views: list[ctypes.c_uint32] = []
        self.entries: list[tuple[Any, int, _DeviceStats]] = []
        self.slots = np.zeros(64, dtype=np.int64)
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self.allocated_bytes = 0
        self.frees = 0
        self.freed_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.regenerations = 0
        self.regenerated_bytes = 0
        self.offloads = 0
        self.offloaded_bytes = 0
        self.reloads = 0
        self.reloaded_bytes = 0
        # Host copies of evicted tensors (not part of ``live``).
        self.host_live = 0
        self.host_peak = 0
        # Device word (see ``_device_word``) -> counters of that device.
        self.devices: dict[int, _DeviceStats] = {}
        # Kernel workspace live now (part of ``live``), and the part of ``peak`` it made up.
        self.transient = 0
        self.peak_transient = 0
        self.workspaces = 0
        self.workspace_bytes = 0


class _AddressSpace:
    """Exposes the process's memory to numpy as one read-only uint32 array (nothing is copied)."""

    def __init__(self, base: int, size: int) -> None:
        self.__array_interface__ = {
            "shape": (size // 4,),
            "typestr": "<u4" if sys.byteorder == "little" else ">u4",
            "data": (base, True),
            "version": 3,
        }


# Looking for dead entries reads one reference count per live allocation before every
# allocation. A Python loop costs 30-80 ns per count; with many live allocations a numpy gather
# through a view of the whole user address space is much cheaper (about 2 us whatever the count).
# Only the counts of objects the tracker keeps alive are ever read through it.
_MEMORY_BASE = 4096
_MEMORY_SIZE = (1 << 48) - _MEMORY_BASE  # user space of x86-64 and 48-bit arm64
_MEMORY: np.ndarray | None
try:
    _MEMORY = np.asarray(_AddressSpace(_MEMORY_BASE, _MEMORY_SIZE))
except (ValueError, TypeError, OverflowError):  # a platform where numpy refuses such a view
    _MEMORY = None
# Below this many live allocations the Python loop is the cheaper scan.
_GATHER_MIN = 48


_local = threading.local()
# Device word -> device name, shared by all threads (dict reads and writes are atomic).
_device_names: dict[int, str] = {}
# The wrappers registered by the last install_accounting, by builtin name.
_installed_wrappers: dict[str, Any] = {}


def _stats() -> _ThreadStats:
    try:
        return _local.stats
    except AttributeError:
        stats = _local.stats = _ThreadStats()
        return stats


def _device_stats(stats: _ThreadStats, word: int, device: Any) -> _DeviceStats:
    dev = stats.devices.get(word)
    if dev is None:
        name = _device_names.get(word)
        if name is None:
            name = _device_names[word] = str(device)
        dev = stats.devices[word] = _DeviceStats(name)
    return dev


def _sweep(stats: _ThreadStats) -> None:
    """Drop every entry whose object only the tracker still holds, and uncount its bytes."""
    views = stats.views
    entries = stats.entries
    slots = stats.slots
    if len(views) < _GATHER_MIN or _MEMORY is None:
        candidates = [i for i, view in enumerate(views) if view.value == 1]
    else:
        candidates = np.flatnonzero(_MEMORY[slots[: len(views)]] == 1).tolist()
    getrefcount = sys.getrefcount
    freed = 0
    frees = 0
    # Highest index first: the entry moved into a hole always comes from above it, and every
    # dead entry above has been removed already, so the moved one is live.
    for i in reversed(candidates):
        entry = entries[i]
        # A strong count of 1 is the tracker's Python wrapper. Python code may share that very
        # wrapper (an object given to ``track_allocation`` and still held by its caller; the
        # FFI can also hand an object's cached wrapper back to Python), so the object is dead
        # only when the entry tuple holds the wrapper's last Python reference.
        if getrefcount(entry[0]) > _TRACKER_PY_REFS:
            continue
        last = len(views) - 1
        views[i] = views[last]
        entries[i] = entries[last]
        slots[i] = slots[last]
        views.pop()
        entries.pop()
        nbytes = entry[1]
        entry[2].live -= nbytes
        freed += nbytes
        frees += 1
        # Rebinding ``entry`` drops the tracker's last reference: the object is destroyed and
        # its buffer goes back to the allocator.
    stats.live -= freed
    stats.frees += frees
    stats.freed_bytes += freed


def _append(stats: _ThreadStats, obj: Any, handle: int, nbytes: int, dev: _DeviceStats) -> None:
    """Start tracking ``obj`` (``handle`` is its ``__chandle__()``)."""
    global _MEMORY
    count_address = handle + _STRONG_COUNT_OFFSET
    n = len(stats.views)
    if n == len(stats.slots):
        stats.slots = np.concatenate([stats.slots, np.zeros(n, dtype=np.int64)])
    if _MEMORY is not None:
        if _MEMORY_BASE <= count_address < _MEMORY_BASE + _MEMORY_SIZE:
            stats.slots[n] = (count_address - _MEMORY_BASE) >> 2
        else:
            _MEMORY = None  # an address beyond the view: scan with the Python loop from now on
    stats.views.append(ctypes.c_uint32.from_address(count_address))
    stats.entries.append((obj, nbytes, dev))


def _count(stats: _ThreadStats, obj: Any, nbytes: int, dev: _DeviceStats) -> None:
    """Record a new allocation; ``_sweep`` must have run just before the allocation."""
    _append(stats, obj, obj.__chandle__(), nbytes, dev)
    stats.allocations += 1
    stats.allocated_bytes += nbytes
    live = stats.live = stats.live + nbytes
    if live > stats.peak:
        stats.peak = live
        stats.peak_transient = stats.transient
    dev.allocations += 1
    dev.allocated_bytes += nbytes
    live = dev.live = dev.live + nbytes
    if live > dev.peak:
        dev.peak = live


def _make_alloc_storage(original: Any) -> Any:
    alloc_tensor = tvm.get_global_func("vm.builtin.alloc_tensor")
    itemsizes: dict[Any, int] = {}
    read_word = ctypes.c_int64.from_address

    def storage_device(stats: _ThreadStats, storage: Any, dtype: Any) -> _DeviceStats:
        """Slow path: the device of a storage, by a zero-size view, checking the raw read."""
        global _raw_device_read_ok
        device = alloc_tensor(storage, 0, _EMPTY_SHAPE, dtype).device
        word = _device_word(device)
        if _raw_device_read_ok:
            if read_word(storage.__chandle__() + _STORAGE_DEVICE_OFFSET).value == word:
                _checked_device_words[word] = device
            else:
                _raw_device_read_ok = False
        return _device_stats(stats, word, device)

    def alloc_storage(ctx: Any, shape: Any, device_index: int, dtype: Any, scope: Any) -> Any:
        try:
            stats = _local.stats
        except AttributeError:
            stats = _stats()
        # Sweep first: the freed bytes are uncounted before the new ones (exact peak), and the
        # allocator gets the dead buffers back before it is asked for a new one.
        # Is any entry held by the tracker alone? The same two scans as in ``_sweep``.
        views = stats.views
        if len(views) < _GATHER_MIN or _MEMORY is None:
            for view in views:
                if view.value == 1:
                    _sweep(stats)
                    break
        elif (_MEMORY[stats.slots[: len(views)]] == 1).any():
            _sweep(stats)
        storage = original(ctx, shape, device_index, dtype, scope)
        itemsize = itemsizes.get(dtype)
        if itemsize is None:
            # Under ``vm.set_instrument`` the VM hands the dtype over as a string.
            dt = tvm_ffi.dtype(dtype) if isinstance(dtype, str) else dtype
            itemsize = itemsizes[dtype] = (dt.bits * dt.lanes + 7) // 8
        nbytes = (shape[0] if len(shape) == 1 else math.prod(shape)) * itemsize
        handle = storage.__chandle__()
        dev = None
        if _raw_device_read_ok:
            word = read_word(handle + _STORAGE_DEVICE_OFFSET).value
            if word in _checked_device_words:
                dev = stats.devices.get(word)
                if dev is None:
                    dev = _device_stats(stats, word, _checked_device_words[word])
        if dev is None:
            dev = storage_device(stats, storage, dtype)
        _append(stats, storage, handle, nbytes, dev)
        # The rest of ``_count``, inlined: this is the hot path of every VM allocation.
        stats.allocations += 1
        stats.allocated_bytes += nbytes
        live = stats.live = stats.live + nbytes
        if live > stats.peak:
            stats.peak = live
            stats.peak_transient = stats.transient
        dev.allocations += 1
        dev.allocated_bytes += nbytes
        live = dev.live = dev.live + nbytes
        if live > dev.peak:
            dev.peak = live
        return storage

    return alloc_storage


def _tensor_nbytes(tensor: Any) -> int:
    dtype = tensor.dtype
    return (math.prod(tensor.shape) * dtype.bits * dtype.lanes + 7) // 8


def _count_tensor_like(stats: _ThreadStats, obj: Any, nbytes: int, device: Any) -> None:
    word = _device_word(device)
    dev = stats.devices.get(word)
    if dev is None:
        dev = _device_stats(stats, word, device)
    _count(stats, obj, nbytes, dev)


def _make_to_device(original: Any) -> Any:
    def to_device(*args: Any) -> Any:
        stats = _stats()
        _sweep(stats)
        out = original(*args)
        _count_tensor_like(stats, out, _tensor_nbytes(out), out.device)
        return out

    return to_device


def _original(name: str) -> Any:
    saved = tvm.get_global_func(_ORIGINAL_PREFIX + name, allow_missing=True)
    if saved is None:
        saved = tvm.get_global_func(name)
        tvm.register_global_func(_ORIGINAL_PREFIX + name, saved)
    return saved


def install_accounting() -> None:
    """Install the accounting wrappers around the VM's allocating builtins.

    Called on ``import blade_relax``; calling it again is harmless (the wrappers always wrap the
    original C++ builtins). Only VMs constructed afterwards are measured.
    """
    for name, make in ((_ALLOC_STORAGE, _make_alloc_storage), (_TO_DEVICE, _make_to_device)):
        original = _original(name)
        wrapper = make(original)
        tvm.register_global_func(name, wrapper, override=True)
    _installed_wrappers.clear()
    _installed_wrappers.update(
        {name: tvm.get_global_func(name) for name in (_ALLOC_STORAGE, _TO_DEVICE)}
    )


def accounting_installed() -> bool:
    """Whether the accounting wrapper is the current ``vm.builtin.alloc_storage``.

    Returns
    -------
    bool
        False when another library re-registered the builtin after blade_relax was imported; VMs
        created from then on are not measured (call :func:`install_accounting` again).
    """
    current = tvm.get_global_func(_ALLOC_STORAGE, allow_missing=True)
    ours = _installed_wrappers.get(_ALLOC_STORAGE)
    return current is not None and ours is not None and current.same_as(ours)


def track_allocation(obj: Any, nbytes: int, device: Any) -> None:
    """Count an allocation made outside ``vm.builtin.alloc_storage``.

    For runtime builtins that allocate memory themselves (a host copy of an evicted tensor, a
    buffer built by a packed function): the allocation counts as live until only the tracker
    holds ``obj``.

    Parameters
    ----------
    obj : tvm_ffi.core.CObject
        The FFI object (a ``Tensor``, a ``Storage``) that owns the memory; the tracker keeps a
        reference to it until every other holder has dropped it.
    nbytes : int
        Size of the allocation in bytes.
    device : tvm.runtime.Device
        Device the memory lives on.
    """
    if not isinstance(obj, tvm_ffi.core.CObject) or not obj.__chandle__():
        raise TypeError(f"track_allocation needs a live FFI object, got {type(obj).__name__}")
    nbytes = _check_nbytes(nbytes, "track_allocation")
    stats = _stats()
    _sweep(stats)
    _count_tensor_like(stats, obj, nbytes, device)


def _check_nbytes(nbytes: Any, where: str) -> int:
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(f"{where}: nbytes must be an integer, got {nbytes!r}")
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"{where}: nbytes must be non-negative, got {nbytes}")
    return nbytes


def _begin_workspace(nbytes: int, device: Any) -> _DeviceStats | None:
    """Count ``nbytes`` of kernel workspace as live from now (see the module docstring)."""
    if nbytes <= 0:
        return None
    stats = _stats()
    _sweep(stats)
    word = _device_word(device)
    dev = stats.devices.get(word)
    if dev is None:
        dev = _device_stats(stats, word, device)
    stats.transient += nbytes
    stats.workspaces += 1
    stats.workspace_bytes += nbytes
    live = stats.live = stats.live + nbytes
    if live > stats.peak:
        stats.peak = live
        stats.peak_transient = stats.transient
    live = dev.live = dev.live + nbytes
    if live > dev.peak:
        dev.peak = live
    return dev


def _end_workspace(nbytes: int, dev: _DeviceStats | None) -> None:
    if dev is None:
        return
    stats = _stats()
    stats.transient -= nbytes
    stats.live -= nbytes
    dev.live -= nbytes


# VMInstrumentReturnKind.NO_OP: run the instruction as usual.
_NO_OP = 0


def workspace_instrument(
    table: Mapping[str, Callable[[Sequence[Any]], int]],
    inner: Callable[..., Any] | None = None,
) -> Callable[..., int]:
    """A VM instrument that counts the workspace of every kernel call found in ``table``.

    Parameters
    ----------
    table
        Kernel symbol -> ``f(args) -> bytes``, where ``args`` are the arguments the VM passes
        the kernel (tensors in parameter order); see the module docstring.
    inner
        Another instrument to run as well (a trace of live bytes, a driver reading): it is
        called before the workspace is counted and after it is released, and its return value
        is the instrument's (``VMInstrumentReturnKind``).

    Returns
    -------
    Callable
        ``instrument(func, symbol, before_run, ret, *args)`` for ``vm.set_instrument``.
    """
    # One entry per kernel call in flight (a kernel does not call back into the VM, but a
    # closure invoked from a packed function nests calls): bytes and the device counted.
    pending: list[tuple[int, _DeviceStats | None]] = []

    def instrument(func: Any, symbol: str, before_run: bool, ret: Any, *args: Any) -> int:
        nbytes_of = table.get(symbol)
        if nbytes_of is None:
            return inner(func, symbol, before_run, ret, *args) if inner is not None else _NO_OP
        if before_run:
            action = inner(func, symbol, before_run, ret, *args) if inner is not None else _NO_OP
            nbytes = 0 if action else nbytes_of(args)
            device = next((a.device for a in args if hasattr(a, "device")), None)
            if device is None:
                nbytes = 0
            pending.append((nbytes, _begin_workspace(nbytes, device) if nbytes else None))
            return action
        nbytes, dev = pending.pop() if pending else (0, None)
        _end_workspace(nbytes, dev)
        return inner(func, symbol, before_run, ret, *args) if inner is not None else _NO_OP

    return instrument


def record_eviction(nbytes: int) -> None:
    """Count one eviction of ``nbytes`` bytes in this thread (called by the remat runtime)."""
    nbytes = _check_nbytes(nbytes, "record_eviction")
    stats = _stats()
    stats.evictions += 1
    stats.evicted_bytes += nbytes


def record_regeneration(nbytes: int) -> None:
    """Count one regeneration of ``nbytes`` bytes in this thread (called by the remat runtime)."""
    nbytes = _check_nbytes(nbytes, "record_regeneration")
    stats = _stats()
    stats.regenerations += 1
    stats.regenerated_bytes += nbytes


def record_offload(nbytes: int) -> None:
    """Count one evicted tensor copied to host memory: ``nbytes`` host bytes held from now on
    (called by the remat runtime; :func:`record_host_release` ends them)."""
    nbytes = _check_nbytes(nbytes, "record_offload")
    stats = _stats()
    stats.offloads += 1
    stats.offloaded_bytes += nbytes
    stats.host_live += nbytes
    if stats.host_live > stats.host_peak:
        stats.host_peak = stats.host_live


def record_host_release(nbytes: int) -> None:
    """Count ``nbytes`` of host copies released (called by the remat runtime)."""
    nbytes = _check_nbytes(nbytes, "record_host_release")
    stats = _stats()
    stats.host_live = max(0, stats.host_live - nbytes)


def record_reload(nbytes: int) -> None:
    """Count one host copy copied back to the device (called by the remat runtime)."""
    nbytes = _check_nbytes(nbytes, "record_reload")
    stats = _stats()
    stats.reloads += 1
    stats.reloaded_bytes += nbytes


def current_live_bytes(device: str | None = None) -> int:
    """Bytes of counted storage alive now in this thread.

    Cheaper than :func:`memory_stats` (no dict is built); the remat runtime compares it with the
    memory budget.

    Parameters
    ----------
    device : str, optional
        A device name as in ``memory_stats()["devices"]`` (``"cuda:0"``); all devices when None.

    Returns
    -------
    int
        Live bytes, exact (dead storages are swept first).
    """
    stats = _stats()
    _sweep(stats)
    if device is None:
        return stats.live
    for dev in stats.devices.values():
        if dev.name == device:
            return dev.live
    return 0


def memory_stats() -> dict[str, Any]:
    """The memory statistics of this thread.

    Returns
    -------
    dict
        ``peak_bytes``, ``live_bytes``, ``allocations``, ``allocated_bytes``, ``frees``,
        ``freed_bytes``, ``evictions``, ``evicted_bytes``, ``regenerations``,
        ``regenerated_bytes``, ``offloads``, ``offloaded_bytes``, ``reloads``,
        ``reloaded_bytes``, ``host_bytes``, ``peak_host_bytes``, ``peak_workspace_bytes``,
        ``workspaces``, ``workspace_bytes`` (ints) and ``devices`` (device name -> ``{"live_bytes", "peak_bytes", "allocations",
        "allocated_bytes"}``); see the module docstring.
    """
    stats = _stats()
    _sweep(stats)
    return {
        "peak_bytes": stats.peak,
        "live_bytes": stats.live,
        "allocations": stats.allocations,
        "allocated_bytes": stats.allocated_bytes,
        "frees": stats.frees,
        "freed_bytes": stats.freed_bytes,
        "evictions": stats.evictions,
        "evicted_bytes": stats.evicted_bytes,
        "regenerations": stats.regenerations,
        "regenerated_bytes": stats.regenerated_bytes,
        "offloads": stats.offloads,
        "offloaded_bytes": stats.offloaded_bytes,
        "reloads": stats.reloads,
        "reloaded_bytes": stats.reloaded_bytes,
        "host_bytes": stats.host_live,
        "peak_host_bytes": stats.host_peak,
        "peak_workspace_bytes": stats.peak_transient,
        "workspaces": stats.workspaces,
        "workspace_bytes": stats.workspace_bytes,
        "devices": {
            dev.name: {
                "live_bytes": dev.live,
                "peak_bytes": dev.peak,
                "allocations": dev.allocations,
                "allocated_bytes": dev.allocated_bytes,
            }
            for dev in stats.devices.values()
        },
    }


def reset_memory_stats() -> None:
    """Reset this thread's peak to its current live bytes and zero its counters.

    Live allocations stay tracked: their later frees still lower ``live_bytes``.
    """
    stats = _stats()
    _sweep(stats)
    stats.peak = stats.live
    stats.allocations = stats.allocated_bytes = 0
    stats.frees = stats.freed_bytes = 0
    stats.evictions = stats.evicted_bytes = 0
    stats.regenerations = stats.regenerated_bytes = 0
    stats.offloads = stats.offloaded_bytes = 0
    stats.reloads = stats.reloaded_bytes = 0
    stats.host_peak = stats.host_live
    stats.peak_transient = stats.transient
    stats.workspaces = stats.workspace_bytes = 0
    for dev in stats.devices.values():
        dev.peak = dev.live
        dev.allocations = dev.allocated_bytes = 0


install_accounting()

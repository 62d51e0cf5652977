"""Offloading evicted tensors to host memory: the choice against recomputation, and the copies.

An evicted tensor can be brought back in two ways (the thread's eviction mode,
:func:`blade_relax.runtime.set_eviction_mode`, says which): recomputed by its regeneration
closure, or copied to host memory at ``evict`` and back into a fresh device tensor at
``regenerate``. This module holds what the second way needs.

The choice (``"auto"``)
-----------------------
Per evictable tensor (*slot*), from two estimated times (:func:`choose_eviction`, a pure
function):

* the copy, there and back: ``2 * nbytes / bandwidth``, with ``bandwidth`` the host-device
  bandwidth in bytes per second, one way (:func:`host_bandwidth` measures it once per device:
  a few MiB copied to host memory and back, timed);
* the recomputation: ``cost / recompute_rate``, with ``cost`` the slot's symbolic recompute
  cost evaluated at the call's dims (what ``Rematerialize`` writes: the loop iterations of the
  regeneration's kernels, one per store a kernel executes, or its output bytes for a kernel
  it cannot read), and ``recompute_rate`` those iterations per second
  (:func:`recompute_rate` measures it once per device: a matmul and an add compiled by TVM's
  stock pipeline for the device, timed, their iterations counted as the compiler counts
  them). One rate per device is a coarse model: a matmul runs more iterations per second
  than a memory-bound elementwise kernel, so elementwise recomputations are estimated cheaper
  than they are. Pass a rate to override it.

The choice is made per slot before the eviction decision, whatever is evicted: it depends on
the slot's bytes and cost only. The decision then runs on the timeline that the choice gives
(:func:`eviction_timeline`): an offloaded slot costs its copy time, its regeneration
allocates exactly its own bytes (``regen_peak = nbytes``) and reads nothing (its plan is the
slot alone), and a recomputed slot costs its recompute time, its plan pruned of what only
offloaded slots' recomputations read. Costs are then nanoseconds, so that the decision weighs
copies and recomputations on one scale.

The copies
----------
:func:`to_host` copies a device tensor into a host buffer: pinned memory on CUDA
(``cudaMallocHost``, TVM's ``cuda_host`` device), plain memory on the CPU, where host and
device memory are one (the copy then moves the bytes out of the VM's storage, which the
budget bounds, into memory it does not count). Host buffers are kept in a per-thread pool of
exact sizes (at most :data:`HOST_POOL_LIMIT` bytes) because pinned allocations are slow.
:func:`to_device` allocates the device tensor through the VM's own allocator
(``vm.builtin.alloc_storage``, so it is counted and pooled as every VM tensor) and copies the
host buffer into it.

TVM 0.27 copies through ``runtime.TVMTensorCopyFromTo``, which takes no stream. Its CUDA
device API (``cuda_device_api.cc``) issues the copy as ``cudaMemcpyAsync`` on the default
stream, the stream the VM's kernels run on: copies and kernels are ordered (an evicted
tensor's storage, freed right after ``evict``, is reused only by kernels queued after its
copy), and a copy between the device and pinned memory does not block the host. Copies do not
overlap kernels, though: that needs a second stream, and TVM gives no Python copy one. The
estimate above charges the copy's whole time for that reason.

The host bytes are counted apart from the device bytes (``memory_stats()["host_bytes"]`` and
``["peak_host_bytes"]``; see :mod:`blade_relax.runtime.accounting`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import tvm
import tvm_ffi

from .accounting import record_host_release, record_offload, record_reload, track_allocation
from .budget import EvictionMode
from .remat_policy import ConcreteTimeline, SlotTimeline

__all__ = [
    "HOST_POOL_LIMIT",
    "EvictionRates",
    "choose_eviction",
    "clear_host_pool",
    "default_rate_device",
    "eviction_timeline",
    "host_bandwidth",
    "measure_host_bandwidth",
    "measure_recompute_rate",
    "offload_choices",
    "recompute_rate",
    "resolve_rates",
]

#: Most bytes of free host buffers kept per thread for reuse.
HOST_POOL_LIMIT = 4 << 30
# DLPack's kDLCUDAHost: pinned host memory that the CUDA device API allocates.
_CUDA_HOST = 3
_NS = 1e9


# --------------------------------------------------------------------------- the choice
def choose_eviction(nbytes: int, cost: float, *, bandwidth: float, recompute_rate: float) -> str:
    """Offload or recompute one evicted tensor: the one of least estimated time.

    Parameters
    ----------
    nbytes
        The tensor's bytes.
    cost
        Its recompute cost (the compiler's unit: kernel loop iterations).
    bandwidth
        Host-device bandwidth, bytes per second one way.
    recompute_rate
        Recompute cost units per second.

    Returns
    -------
    str
        ``"offload"`` when ``2 * nbytes / bandwidth < cost / recompute_rate``, else
        ``"recompute"`` (a tie recomputes: it needs no host memory).

    Raises
    ------
    ValueError
        For negative bytes or cost, or a rate that is not positive.
    """
    if nbytes < 0 or cost < 0:
        raise ValueError(f"bytes and cost must be non-negative, got {nbytes} and {cost}")
    if not (bandwidth > 0 and recompute_rate > 0):
        raise ValueError(f"rates must be positive, got {bandwidth} and {recompute_rate}")
    copy_s = 2.0 * nbytes / bandwidth
    recompute_s = cost / recompute_rate
    return "offload" if copy_s < recompute_s else "recompute"


@dataclass(frozen=True)
class EvictionRates:
    """An eviction mode with its rates known: what a decision depends on (and is cached by).

    Attributes
    ----------
    mode
        ``"offload"`` or ``"auto"``.
    bandwidth
        Host-device bandwidth, bytes per second one way.
    recompute_rate
        Recompute cost units per second (``None`` in ``"offload"``: nothing is recomputed).
    """

    mode: str
    bandwidth: float
    recompute_rate: float | None = None


def offload_choices(tl: ConcreteTimeline, rates: EvictionRates) -> frozenset[int]:
    """The slots of ``tl`` that are offloaded when evicted: all of them in ``"offload"``, those
    :func:`choose_eviction` sends to the host in ``"auto"``."""
    if rates.mode == "offload":
        return frozenset(range(len(tl.slots)))
    if rates.recompute_rate is None:
        raise ValueError("the auto eviction mode needs a recompute rate")
    return frozenset(
        k
        for k, slot in enumerate(tl.slots)
        if choose_eviction(
            slot.nbytes,
            max(slot.cost, 0.0),
            bandwidth=rates.bandwidth,
            recompute_rate=rates.recompute_rate,
        )
        == "offload"
    )


def _pruned_plan(
    plan: tuple[tuple[int, tuple[int, ...]], ...], offloaded: frozenset[int]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A regeneration plan where offloaded entries are copied back, not recomputed: they read
    nothing, and what only their recomputation read is left out."""
    needed = {plan[-1][0]}
    for slot, inputs in reversed(plan):
        if slot in needed and slot not in offloaded:
            needed.update(inputs)
    return tuple(
        (slot, () if slot in offloaded else inputs) for slot, inputs in plan if slot in needed
    )


def _offloaded_slot(slot: SlotTimeline, k: int, bandwidth: float) -> SlotTimeline:
    return replace(
        slot, cost=2.0 * slot.nbytes / bandwidth * _NS, regen_peak=slot.nbytes, plan=((k, ()),)
    )


def eviction_timeline(
    tl: ConcreteTimeline, rates: EvictionRates
) -> tuple[ConcreteTimeline, frozenset[int]]:
    """The timeline the decision runs on under ``rates``, and the slots offloaded when evicted.

    Offloaded slots cost their copy time, regenerate into their own bytes and read nothing;
    recomputed slots cost their recompute time (costs in nanoseconds) and read what their
    pruned plan reads (see the module docstring).
    """
    offloaded = offload_choices(tl, rates)
    slots = []
    for k, slot in enumerate(tl.slots):
        if k in offloaded:
            slots.append(_offloaded_slot(slot, k, rates.bandwidth))
        else:
            assert rates.recompute_rate is not None  # auto: offload_choices checked it
            slots.append(
                replace(
                    slot,
                    cost=slot.cost / rates.recompute_rate * _NS,
                    plan=_pruned_plan(slot.plan, offloaded),
                )
            )
    return ConcreteTimeline(base=tl.base, slots=tuple(slots)), offloaded


# --------------------------------------------------------------------------- rates
_rates_lock = threading.Lock()
_bandwidths: dict[str, float] = {}
_recompute_rates: dict[str, float] = {}


_default_device: list[tvm.runtime.Device] = []


def default_rate_device() -> tvm.runtime.Device:
    """Where rates are measured when the eviction mode names no device: ``cuda:0`` when a
    CUDA device exists, else the CPU (looked up once)."""
    if not _default_device:
        cuda = tvm.cuda(0)
        _default_device.append(cuda if cuda.exist else tvm.cpu())
    return _default_device[0]


# Devices whose pinned host memory failed once (to allocate or to copy): plain memory since.
_unpinned: set[str] = set()


def _host_device(device: tvm.runtime.Device) -> tvm.runtime.Device:
    """The host memory that copies of ``device``'s tensors go to: pinned memory for CUDA
    (plain host memory where pinned memory failed before)."""
    if (
        device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        and str(device) not in _unpinned
    ):
        return tvm.device(_CUDA_HOST, device.index)
    return tvm.cpu()


def _copy_out(tensor: Any, nbytes: int) -> tuple[Any, Any]:
    """Copy ``tensor`` into a pooled host buffer: the buffer and the tensor's view of it.

    Pinned memory that cannot be allocated or copied into is given up for the device, once
    and for all, and plain host memory used instead.
    """
    device = tensor.device
    shape = tuple(int(d) for d in tensor.shape)
    while True:
        host = _host_device(device)
        try:
            buffer = _take_buffer(host, nbytes)
            view = buffer._create_view(shape, str(tensor.dtype))
            tensor._copyto(view)
            return buffer, view
        except Exception:
            if host.dlpack_device_type() == tvm.cpu().dlpack_device_type():
                raise
            _unpinned.add(str(device))


def measure_host_bandwidth(
    device: tvm.runtime.Device | None = None, nbytes: int = 8 << 20, repeat: int = 5
) -> float:
    """Time copies of ``nbytes`` from ``device`` to host memory and back.

    Parameters
    ----------
    device
        The device (default: :func:`default_rate_device`). On the CPU the "host" copy is a
        copy within host memory, measured the same way.
    nbytes
        Bytes copied each way.
    repeat
        Timed round trips after one warm-up; the median counts.

    Returns
    -------
    float
        Bytes per second, one way (the round trip moves ``2 * nbytes``).
    """
    device = device or default_rate_device()
    source = tvm.runtime.empty((nbytes,), "uint8", device)
    host = _copy_out(source, nbytes)[0]
    seconds = []
    for i in range(repeat + 1):
        device.sync()
        start = time.perf_counter()
        source._copyto(host)
        host._copyto(source)
        device.sync()
        if i:
            seconds.append(time.perf_counter() - start)
    return 2.0 * nbytes / max(statistics.median(seconds), 1e-9)


def _rate_module(m: int, k: int, n: int) -> tvm.IRModule:
    """``matmul(x, w) + b``: the kernels whose iterations per second stand for recomputation."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, k], "float32"))
    w = relax.Var("w", relax.TensorType([k, n], "float32"))
    b = relax.Var("b", relax.TensorType([m, n], "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(relax.op.matmul(x, w), b))
        bb.emit_func_output(out)
    return bb.get()


def _rate_target(device: tvm.runtime.Device) -> Any:
    if device.dlpack_device_type() == tvm.cuda().dlpack_device_type():
        from .devices import configure_cuda_compiler

        configure_cuda_compiler()
        major, minor = device.compute_version.split(".")
        return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
    return tvm.target.Target("llvm")


def _time_rate_module(device: tvm.runtime.Device, size: int, repeat: int) -> float:
    """Seconds of one call of :func:`_rate_module` at ``size`` (median of ``repeat``)."""
    import numpy as np
    from tvm import relax

    executable = tvm.compile(_rate_module(size, size, size), _rate_target(device))
    vm = relax.VirtualMachine(executable, device)
    rng = np.random.default_rng(0)
    args = [
        tvm.runtime.tensor(rng.standard_normal((size, size)).astype("float32"), device)
        for _ in range(3)
    ]
    seconds = []
    for i in range(repeat + 1):
        device.sync()
        start = time.perf_counter()
        vm["main"](*args)
        device.sync()
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure_recompute_rate(
    device: tvm.runtime.Device | None = None, size: int | None = None, repeat: int = 5
) -> float:
    """Recompute cost units per second on ``device``: ``matmul(x, w) + b`` of square
    ``size`` matrices compiled by TVM's stock pipeline, timed.

    Its cost is counted as the compiler counts a regeneration's (one unit per store a kernel
    executes): ``size**3`` updates and ``size**2`` initialisations of the matmul, ``size**2``
    stores of the add. It runs in a thread of its own, so that its VM allocations do not enter
    the calling thread's memory statistics (it may be measured during a budgeted call).

    Parameters
    ----------
    device
        The device (default: :func:`default_rate_device`).
    size
        Matrix size (default: 1024 on CUDA, 128 on the CPU).
    repeat
        Timed calls after one warm-up; the median counts.

    Returns
    -------
    float
        Cost units per second.
    """
    device = device or default_rate_device()
    cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
    size = size or (1024 if cuda else 128)
    result: dict[str, Any] = {}

    def measure() -> None:
        try:
            result["seconds"] = _time_rate_module(device, size, repeat)
        except Exception as err:  # re-raised in the caller's thread
            result["error"] = err

    worker = threading.Thread(target=measure, name="blade_relax-recompute-rate")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    cost = size**3 + 2 * size**2
    return cost / max(result["seconds"], 1e-9)


def _cached(cache: dict[str, float], device: tvm.runtime.Device, measure: Any) -> float:
    key = str(device)
    with _rates_lock:
        found = cache.get(key)
        if found is None:
            found = cache[key] = float(measure(device))
        return found


def host_bandwidth(device: tvm.runtime.Device | None = None) -> float:
    """:func:`measure_host_bandwidth` on ``device``, measured once per device and cached."""
    return _cached(_bandwidths, device or default_rate_device(), measure_host_bandwidth)


def recompute_rate(device: tvm.runtime.Device | None = None) -> float:
    """:func:`measure_recompute_rate` on ``device``, measured once per device and cached."""
    return _cached(_recompute_rates, device or default_rate_device(), measure_recompute_rate)


def resolve_rates(mode: EvictionMode) -> EvictionRates | None:
    """The rates an eviction mode decides with: the ones it gives, the others measured once
    per device (cached); ``None`` for ``"recompute"`` (the decision as without offloading)."""
    if mode.mode == "recompute":
        return None
    device = mode.device
    bandwidth = mode.bandwidth or host_bandwidth(device)
    if mode.mode == "offload":
        return EvictionRates("offload", bandwidth)
    return EvictionRates("auto", bandwidth, mode.recompute_rate or recompute_rate(device))


# --------------------------------------------------------------------------- copies
_pool_local = threading.local()


class _HostPool:
    """Free host buffers of one thread, by (host device, bytes)."""

    __slots__ = ("free", "nbytes")

    def __init__(self) -> None:
        self.free: dict[tuple[str, int], list[Any]] = {}
        self.nbytes = 0


def _pool() -> _HostPool:
    try:
        return _pool_local.pool
    except AttributeError:
        pool = _pool_local.pool = _HostPool()
        return pool


def _take_buffer(host: tvm.runtime.Device, nbytes: int) -> Any:
    """A flat ``uint8`` buffer of ``nbytes`` on ``host``, from the pool when it has one."""
    pool = _pool()
    free = pool.free.get((str(host), nbytes))
    if free:
        pool.nbytes -= nbytes
        return free.pop()
    return tvm.runtime.empty((nbytes,), "uint8", host)


def _give_buffer(buffer: Any, nbytes: int) -> None:
    pool = _pool()
    if pool.nbytes + nbytes > HOST_POOL_LIMIT:
        return  # dropped: freed
    pool.free.setdefault((str(buffer.device), nbytes), []).append(buffer)
    pool.nbytes += nbytes


def clear_host_pool() -> int:
    """Free this thread's pooled host buffers; returns how many bytes they held."""
    pool = _pool()
    freed = pool.nbytes
    pool.free.clear()
    pool.nbytes = 0
    return freed


class HostCopy:
    """The host copy of one evicted tensor, counted in ``host_bytes`` until released.

    Attributes
    ----------
    view
        The host tensor (the tensor's shape and dtype over a pooled buffer).
    device
        The device the tensor came from.
    nbytes
        Its bytes.
    """

    __slots__ = ("buffer", "view", "device", "nbytes")

    def __init__(self, buffer: Any, view: Any, device: tvm.runtime.Device, nbytes: int) -> None:
        self.buffer = buffer
        self.view = view
        self.device = device
        self.nbytes = nbytes

    def release(self) -> None:
        """Return the buffer to the pool and uncount its bytes (once; later calls do nothing)."""
        if self.buffer is None:
            return
        buffer, self.buffer, self.view = self.buffer, None, None
        _give_buffer(buffer, self.nbytes)
        record_host_release(self.nbytes)


def to_host(tensor: Any, nbytes: int) -> HostCopy:
    """Copy ``tensor`` (``nbytes`` bytes) into a host buffer and count it as host bytes."""
    buffer, view = _copy_out(tensor, nbytes)
    record_offload(nbytes)
    return HostCopy(buffer, view, tensor.device, nbytes)


_UINT8 = tvm_ffi.dtype("uint8")


def to_device(ctx: Any, copy: HostCopy) -> Any:
    """A fresh device tensor holding ``copy``, allocated by the VM of ``ctx``.

    The storage comes from ``vm.builtin.alloc_storage`` on the VM's first device (where its
    kernels write, so where evicted tensors live): counted by the accounting and taken from
    the VM's pool like any tensor the VM allocates. A tensor from another device is allocated
    with ``tvm.runtime.empty`` and counted through
    :func:`~blade_relax.runtime.accounting.track_allocation` instead.
    """
    view = copy.view
    shape = tvm_ffi.Shape(tuple(int(d) for d in view.shape))
    storage = tvm.get_global_func("vm.builtin.alloc_storage")(
        ctx, tvm_ffi.Shape((copy.nbytes,)), 0, _UINT8, "global"
    )
    out = tvm.get_global_func("vm.builtin.alloc_tensor")(storage, 0, shape, view.dtype)
    del storage
    if out.device != copy.device:
        out = tvm.runtime.empty(tuple(shape), str(view.dtype), copy.device)
        track_allocation(out, copy.nbytes, copy.device)
    view._copyto(out)
    record_reload(copy.nbytes)
    return out

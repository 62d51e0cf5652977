"""Devices: CUDA compilation settings, generated kernel code, and the driver's view of memory.

What is here and why
--------------------
* **The CUDA compiler.** A ``tvm.compile`` for a CUDA target emits CUDA C. On a machine without
  a GPU the executable keeps that source as it is; on a machine with one, TVM compiles it while
  building, through ``tvm_callback_cuda_compile``, which uses NVRTC from the ``cuda-bindings``
  package unless ``TVM_CUDA_COMPILE_MODE=nvcc``. :func:`configure_cuda_compiler` picks a
  compiler that exists before anything is compiled, so a missing ``cuda-bindings`` does not fail
  the first GPU build.
* **Two ways to a compiler.** A CUDA toolkit (``nvcc`` on ``PATH``, or ``CUDA_PATH``), or
  nothing but PyPI wheels: ``pip install -e ".[cuda]"`` installs ``cuda-bindings`` with NVRTC,
  the CUDA runtime headers and CCCL (``nvidia/cu13`` in site-packages, about 200 MB), and
  NVRTC then compiles with those headers (:func:`find_cuda_compiler` says which is used, or in
  one line why none is).
* **The kernels.** :func:`cuda_source` returns the CUDA C of an executable and
  :func:`compile_cuda_source` compiles it to a cubin with ``nvcc`` or NVRTC (no GPU needed), so
  CI proves that every generated kernel compiles for a given architecture.
* **The driver's view of memory.** :func:`measure_driver_memory` runs one VM call and samples
  the free device memory reported by the driver (``cudaMemGetInfo``) after every instruction of
  the call. Its :class:`DriverMemory` is the independent check of the byte counts of
  :func:`blade_relax.runtime.memory_stats`: with the VM's ``"naive"`` allocator each storage is a
  ``cudaMalloc`` of its own, so the driver's drop of free memory at the peak equals the counted
  peak up to the driver's allocation granularity (:func:`agrees_with_driver`).

Nothing here imports a pass; the module only talks to the TVM runtime and the CUDA toolchain.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import glob
import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import tvm

__all__ = [
    "DRIVER_GRANULARITY",
    "DriverMemory",
    "agrees_with_driver",
    "compile_cuda_source",
    "configure_cuda_compiler",
    "cuda_available",
    "cuda_source",
    "device_for_target",
    "find_cuda_compiler",
    "driver_free_bytes",
    "measure_driver_memory",
]

#: Granularity of device memory as the CUDA driver reports it: ``cudaMalloc`` maps memory in
#: 2 MiB pages, so a free-memory reading moves in steps of this size.
DRIVER_GRANULARITY = 2 << 20

_COMPILE_MODE = "TVM_CUDA_COMPILE_MODE"


def cuda_available(index: int = 0) -> bool:
    """Whether CUDA device ``index`` exists (a CUDA runtime and a GPU are both present)."""
    return bool(tvm.cuda(index).exist)


def device_for_target(target: Any, index: int = 0) -> tvm.runtime.Device:
    """The runtime device that executables built for ``target`` run on.

    Parameters
    ----------
    target
        A ``tvm.target.Target``, a target dict (``{"kind": "cuda", "arch": "sm_90"}``) or a
        string (``"llvm"``, ``"cuda"``).
    index
        Device ordinal for GPU targets.

    Returns
    -------
    tvm.runtime.Device
        ``tvm.cuda(index)`` for CUDA targets, ``tvm.cpu()`` for ``llvm``.
    """
    if isinstance(target, str) and target == "host":  # blade_relax.pipeline.host_target
        return tvm.cpu()
    tgt = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    kind = tgt.kind.name
    if kind == "cuda":
        return tvm.cuda(index)
    if kind in ("llvm", "c"):
        return tvm.cpu()
    raise ValueError(f"no runtime device known for target kind {kind!r} (llvm or cuda)")


def _has_nvrtc_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings.nvrtc") is not None
    except (ImportError, ValueError):
        return False


def _nvidia_dirs() -> list[str]:
    """The folders of the ``nvidia`` namespace package the CUDA wheels install into."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def _wheel_cuda_root() -> str | None:
    """The folder of CUDA installed from PyPI wheels with NVRTC and the runtime headers.

    ``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime`` and ``nvidia-cuda-cccl`` (CUDA 13) install
    into ``site-packages/nvidia/cu13``: ``lib/libnvrtc.so*``, ``include/cuda_runtime.h``,
    ``include/cccl``. ``None`` when no such folder has all three.
    """
    for base in _nvidia_dirs():
        for root in sorted(glob.glob(os.path.join(base, "cu[0-9]*")), reverse=True):
            if (
                glob.glob(os.path.join(root, "lib", "libnvrtc.so*"))
                and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))
                and os.path.isdir(os.path.join(root, "include", "cccl"))
            ):
                return root
    return None


def _toolkit_root() -> str | None:
    """A CUDA toolkit's root (``CUDA_PATH``, or where ``nvcc`` lives), with its headers."""
    candidates = [os.environ.get("CUDA_PATH")]
    nvcc = _nvcc_path()
    if nvcc is not None:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
        if root and glob.glob(os.path.join(root, "targets", "*", "include", "cuda_runtime.h")):
            return root
    return None


def _has_nvrtc() -> bool:
    """Whether NVRTC can compile here: the bindings, the library and the CUDA headers."""
    if not _has_nvrtc_bindings():
        return False
    if _wheel_cuda_root() is not None:
        return True
    return _toolkit_root() is not None and ctypes.util.find_library("nvrtc") is not None


def find_cuda_compiler() -> tuple[str | None, str]:
    """The compiler :func:`compile_cuda_source` uses by default, and where it comes from.

    Returns
    -------
    tuple
        ``("nvcc", path)``, ``("nvrtc", where its headers are)``, or ``(None, reason)`` with a
        one-line reason that says what to install.
    """
    nvcc = _nvcc_path()
    if nvcc is not None:
        return "nvcc", nvcc
    if _has_nvrtc():
        root = _wheel_cuda_root() or _toolkit_root()
        return "nvrtc", f"NVRTC (cuda-bindings) with the CUDA headers in {root}"
    if _has_nvrtc_bindings():
        return None, (
            "cuda-bindings is installed but NVRTC or the CUDA headers are not: "
            'pip install -e ".[cuda]" or put a CUDA toolkit\'s nvcc on PATH'
        )
    return None, (
        "no CUDA compiler: nvcc is not on PATH and NVRTC is not installed "
        '(pip install -e ".[cuda]" installs it from PyPI, about 200 MB)'
    )


def _wheel_include_options(root: str) -> list[str]:
    return [f"-I{os.path.join(root, 'include', 'cccl')}"]


@contextlib.contextmanager
def _nvrtc_headers() -> Iterator[list[str]]:
    """Point TVM's NVRTC wrapper at the wheels' headers when no toolkit is found.

    TVM finds the headers through ``CUDA_PATH`` (or ``nvcc``) and looks for CCCL under a
    toolkit's ``targets/<arch>/include``; the wheels keep it in ``include/cccl``. Yields extra
    compiler options.
    """
    root = _wheel_cuda_root()
    if _toolkit_root() is not None or root is None:
        yield []
        return
    saved = os.environ.get("CUDA_PATH")
    os.environ["CUDA_PATH"] = root
    try:
        yield _wheel_include_options(root)
    finally:
        if saved is None:
            os.environ.pop("CUDA_PATH", None)
        else:
            os.environ["CUDA_PATH"] = saved


def _nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        from tvm.support import nvcc

        candidate = os.path.join(nvcc.find_cuda_path(), "bin", "nvcc")
    except (RuntimeError, OSError):
        return None
    return candidate if os.path.isfile(candidate) else None


def configure_cuda_compiler() -> str:
    """Make sure TVM can compile CUDA C when it builds for a GPU; return the compiler used.

    An explicit ``TVM_CUDA_COMPILE_MODE`` is respected. Otherwise NVRTC is used when the
    ``cuda-bindings`` package is installed (TVM's default), and ``nvcc`` (the variable is set
    to ``"nvcc"`` for this process) when only the toolkit is. NVRTC from PyPI wheels without a
    toolkit gets ``CUDA_PATH`` and ``TVM_CUDA_NVRTC_EXTRA_OPTS`` (the CCCL headers) set for
    this process, so TVM's own NVRTC wrapper finds the headers.

    Returns
    -------
    str
        ``"nvrtc"`` or ``"nvcc"``.

    Raises
    ------
    RuntimeError
        When neither NVRTC bindings nor ``nvcc`` can be found.
    """
    mode = os.environ.get(_COMPILE_MODE)
    if mode:
        return mode.lower()
    if _has_nvrtc():
        root = _wheel_cuda_root()
        if _toolkit_root() is None and root is not None:
            os.environ.setdefault("CUDA_PATH", root)
            extra = os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS", "")
            options = " ".join(_wheel_include_options(root))
            if options not in extra:
                os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = f"{extra} {options}".strip()
        return "nvrtc"
    if _nvcc_path() is not None:
        os.environ[_COMPILE_MODE] = "nvcc"
        return "nvcc"
    raise RuntimeError(
        "TVM cannot compile CUDA kernels here: install the NVRTC bindings "
        "(pip install cuda-bindings) or put the CUDA toolkit's nvcc on PATH"
    )


def _walk_modules(module: Any) -> list[Any]:
    found = [module]
    for child in module.imports:
        found.extend(_walk_modules(child))
    return found


def cuda_source(executable: Any) -> str:
    """The CUDA C of every kernel in ``executable`` (one translation unit).

    Parameters
    ----------
    executable
        A ``tvm.relax.VMExecutable`` (``tvm.compile``'s result) or a ``tvm.runtime.Module``.

    Returns
    -------
    str
        The source, as generated by TVM's CUDA code generator.

    Raises
    ------
    ValueError
        When the executable holds no CUDA module (it was built for another target).
    """
    root = executable.mod if hasattr(executable, "mod") else executable
    for module in _walk_modules(root):
        if module.kind == "cuda":
            # Built on a GPU machine the module holds a binary and keeps the source under
            # "cuda"; built without a GPU it holds the source itself.
            source = module.inspect_source("cuda") or module.inspect_source("")
            if source:
                return source
    raise ValueError("the executable holds no CUDA module with source code")


def compile_cuda_source(
    source: str,
    arch: str = "sm_90",
    *,
    target_format: str = "cubin",
    compiler: str | None = None,
) -> bytes:
    """Compile CUDA C to a binary for ``arch``; no GPU is needed.

    Parameters
    ----------
    source
        CUDA C, e.g. from :func:`cuda_source`.
    arch
        The architecture (``"sm_90"``).
    target_format
        ``"cubin"`` (runs ``ptxas`` too, so register and shared-memory limits are checked) or
        ``"ptx"``.
    compiler
        ``"nvcc"`` or ``"nvrtc"``; by default ``nvcc`` when found, NVRTC otherwise (see
        :func:`find_cuda_compiler`).

    Returns
    -------
    bytes
        The compiled binary.

    Raises
    ------
    RuntimeError
        With the compiler's messages when the source does not compile, or when no compiler is
        available.
    """
    from tvm.support import nvcc

    if compiler is None:
        compiler, reason = find_cuda_compiler()
        if compiler is None:
            raise RuntimeError(reason)
    # TVM's compiler wrappers read the architecture from the current target.
    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        if compiler == "nvrtc":
            with _nvrtc_headers() as options, warnings.catch_warnings():
                # cuda-pathfinder cannot read the version of a wheel's libnvrtc: harmless.
                warnings.filterwarnings("ignore", "Cannot determine the NVRTC version")
                binary = nvcc.compile_cuda(
                    source, target_format=target_format, compiler=compiler, options=options or None
                )
        else:
            binary = nvcc.compile_cuda(source, target_format=target_format, compiler=compiler)
    return bytes(binary)


def driver_free_bytes(device: tvm.runtime.Device) -> int:
    """Free memory of ``device`` as the driver reports it (``cudaMemGetInfo``), in bytes.

    Raises
    ------
    ValueError
        When the device does not report free memory (CPUs, or no GPU present).
    """
    free = device.available_global_memory if device.exist else None
    if free is None:
        raise ValueError(f"device {device} does not report its free memory")
    return int(free)


@dataclass(frozen=True)
class DriverMemory:
    """Free device memory seen by the driver around and during one call.

    Attributes
    ----------
    free_before
        Free bytes right before the call (after a synchronisation).
    min_free
        Lowest free bytes read after any instruction of the call.
    free_after
        Free bytes after the call returned, its outputs still alive.
    samples
        Number of readings taken during the call.
    """

    free_before: int
    min_free: int
    free_after: int
    samples: int

    @property
    def peak_bytes(self) -> int:
        """Largest drop of free memory during the call: the call's peak in the driver's view."""
        return self.free_before - self.min_free

    @property
    def retained_bytes(self) -> int:
        """Drop of free memory still there after the call (its outputs and any cached memory)."""
        return self.free_before - self.free_after


def measure_driver_memory(
    vm: Any,
    function: str,
    args: Sequence[Any],
    device: tvm.runtime.Device,
    *,
    free_bytes: Callable[[tvm.runtime.Device], int] = driver_free_bytes,
    instrument: Callable[..., Any] | None = None,
) -> tuple[Any, DriverMemory]:
    """Call ``vm[function](*args)`` and read the driver's free memory after every instruction.

    For a reading that matches allocations one to one, create the VM with
    ``memory_cfg="naive"`` (every storage is its own ``cudaMalloc`` and is returned at once) and
    run the function once before measuring (kernel modules and the kernels' local memory are
    loaded on first use). Pooled memory is released before the call, so a pooled VM is measured
    from an empty pool too, but it keeps freed blocks during the call.

    Parameters
    ----------
    vm
        A ``tvm.relax.VirtualMachine``; its instrument is replaced during the call and removed
        afterwards.
    function, args
        What to call.
    device
        The device whose memory is read.
    free_bytes
        The reader of free memory (tests substitute their own).
    instrument
        Another VM instrument to run as well (e.g.
        :func:`~blade_relax.runtime.accounting.workspace_instrument`, so that the accounting
        counts the kernels' workspaces the driver sees); the free memory is read after it.

    Returns
    -------
    tuple
        The call's result and the :class:`DriverMemory`.
    """
    clear = tvm.get_global_func("vm.builtin.memory_manager.clear", allow_missing=True)
    if clear is not None:
        clear()
    device.sync()
    free_before = free_bytes(device)
    lowest = [free_before]
    samples = [0]

    inner = instrument

    def read_free(func: Any, name: str, before_run: bool, ret: Any, *args: Any) -> int:
        action = inner(func, name, before_run, ret, *args) if inner is not None else 0
        if not before_run:
            free = free_bytes(device)
            samples[0] += 1
            if free < lowest[0]:
                lowest[0] = free
        return action  # VMInstrumentReturnKind.NO_OP (0): run the instruction as usual

    vm.set_instrument(read_free)
    try:
        result = vm[function](*args)
    finally:
        vm.set_instrument(None)
    device.sync()
    free_after = free_bytes(device)
    lowest[0] = min(lowest[0], free_after)
    return result, DriverMemory(free_before, lowest[0], free_after, samples[0])


def agrees_with_driver(
    counted_peak: int,
    driver: DriverMemory,
    allocations: int,
    granularity: int = DRIVER_GRANULARITY,
) -> bool:
    """Whether a counted peak matches the driver's within allocation rounding.

    Each of the ``allocations`` storages may occupy up to one ``granularity`` more than its size
    in the driver's view (page rounding); one granule of slack is allowed the other way, for a
    small storage placed in a page the driver had already mapped.

    Parameters
    ----------
    counted_peak
        Peak bytes of the call as counted by ``memory_stats()`` (relative to the bytes live
        before the call).
    driver
        The driver's readings of the same call.
    allocations
        Number of storages the call allocated (``memory_stats()["allocations"]``).
    granularity
        The driver's allocation granularity.

    Returns
    -------
    bool
        ``counted_peak - granularity <= driver.peak_bytes <= counted_peak + (allocations + 1)
        * granularity``.
    """
    low = counted_peak - granularity
    high = counted_peak + (allocations + 1) * granularity
    return low <= driver.peak_bytes <= high

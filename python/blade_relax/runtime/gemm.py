"""GEMMs on ATen: the packed functions that :class:`~blade_relax.transform.DispatchGemm`'s calls
run.

Each function of :data:`~blade_relax.contract.GEMM_FUNCS` computes ``out = op_a(a) @ op_b(b)``
with ``torch.mm`` / ``torch.bmm`` on zero-copy DLPack views of the VM's tensors and writes into
``out``, the tensor the VM allocated for the result (destination passing): the accounting
counts every byte as it counts a TVM kernel's output. A transposed operand is a strided view
(BLAS reads it transposed); batch axes are folded with ``view``, which raises rather than copy.
The library may use scratch memory of its own while it runs (oneDNN / MKL packing buffers on
the CPU, cuBLAS workspace on the GPU), as it does under PyTorch eager; no tensor is allocated.
On a GPU, ATen runs on PyTorch's current stream and TVM's kernels on TVM's: both are the
device's default stream unless a caller sets another, which orders them (a caller that runs
TVM on a stream of its own must make it PyTorch's current stream too).

The functions are registered when this module is imported, if PyTorch can be imported (found
with :func:`importlib.util.find_spec`; torch itself is imported at the first call, so importing
blade_relax does not pay for it). Without torch nothing is registered and ``DispatchGemm``,
which dispatches only to registered functions, leaves every matmul to TVM's kernels.

Nothing here imports a pass: the IR names the functions (:mod:`blade_relax.contract`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi

from ..contract import GEMM_FUNCS

__all__ = ["register_gemm_functions", "torch_found"]

_torch: Any = None


def torch_found() -> bool:
    """Whether PyTorch can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def _load_torch() -> Any:
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def _gemm(trans_a: bool, trans_b: bool) -> Callable[[Any, Any, Any], None]:
    """The packed function of one layout: ``out = op_a(a) @ op_b(b)``."""

    def gemm(a: Any, b: Any, out: Any) -> None:
        torch = _torch or _load_torch()
        x, y, z = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack(out)
        if trans_a:
            x = x.transpose(-1, -2)
        if trans_b:
            y = y.transpose(-1, -2)
        if y.dim() == 2:
            if x.dim() == 2:
                torch.mm(x, y, out=z)
            else:
                # A weight: the batch axes of `a` (stored as is) are rows of one GEMM.
                torch.mm(x.view(-1, x.shape[-1]), y, out=z.view(-1, z.shape[-1]))
        else:
            torch.bmm(
                x.view(-1, x.shape[-2], x.shape[-1]),
                y.view(-1, y.shape[-2], y.shape[-1]),
                out=z.view(-1, z.shape[-2], z.shape[-1]),
            )

    gemm.__name__ = gemm.__qualname__ = f"gemm_{'T' if trans_a else 'N'}{'T' if trans_b else 'N'}"
    return gemm


def register_gemm_functions() -> bool:
    """Register the functions of :data:`GEMM_FUNCS` if torch is found, else remove them.

    Returns whether they are registered. Runs on import; call it again after installing or
    removing torch in the same process (tests do, to run the pipeline without them).
    """
    if torch_found():
        for layout, name in GEMM_FUNCS.items():
            tvm.register_global_func(name, _gemm(layout[0] == "T", layout[1] == "T"), override=True)
        return True
    for name in GEMM_FUNCS.values():
        if tvm.get_global_func(name, allow_missing=True) is not None:
            tvm_ffi.remove_global_func(name)
    return False


register_gemm_functions()

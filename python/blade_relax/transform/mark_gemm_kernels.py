"""MarkGemmKernels: each kernel that is a GEMM records so, before a GPU schedule rewrites it.

``DispatchGemm`` swaps GEMM kernels for ATen's GEMMs once memory is planned, and recognizes a
GEMM by its one block (``C[..] += A[..] * B[..]``, see dispatch_gemm.py). On a CUDA target
that block is gone by then: TVM's CUDA pipeline schedules every kernel with dlight right after
``FuseTIR`` (shared-memory tiles, thread bindings, several blocks), so nothing in the planned
module reads as a GEMM any more. This pass runs before dlight and writes what the recognizer
finds into the kernel's attributes (:data:`~blade_relax.contract.GEMM_KERNEL_ATTR`: layout,
ranks, dtype, buffer positions), which dlight's schedule keeps; ``DispatchGemm`` reads it.

A GEMM fused with an elementwise tail is not marked: on a CPU ``DispatchGemm`` splits such a
kernel into the GEMM and its tail, which on a GPU would need the tail scheduled again. Those
kernels stay dlight's.

Where it runs
-------------
In :func:`blade_relax.get_pipeline` with ``dispatch_gemm`` (on by default) on CUDA targets: in
the ``legalize`` phase, after ``FuseTIR`` and before dlight's ``ApplyDefaultSchedule``. On CPU
targets it is not needed (``DispatchGemm`` reads the kernels themselves). It changes no
computation and no buffer: only attributes of PrimFuncs.

What it assumes
---------------
Kernels in block form, as ``FuseTIR`` leaves them. A kernel already marked is left as it is.
"""

from __future__ import annotations

import tvm

from ..contract import GEMM_KERNEL_ATTR
from .dispatch_gemm import gemm_layout
from .result import with_functions

__all__ = ["MarkGemmKernels"]


@tvm.transform.module_pass(opt_level=0, name="MarkGemmKernels")
class MarkGemmKernels:
    """Record on each GEMM kernel what it computes (see the module docstring).

    After the pass ran, ``pass_obj.marked`` holds the names of the kernels it marked.
    """

    name = "MarkGemmKernels"

    def __init__(self) -> None:
        self.marked: tuple[str, ...] = ()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if func.attrs is not None and GEMM_KERNEL_ATTR in func.attrs:
                continue
            kernel = gemm_layout(func)
            if kernel is not None:
                updates[gv] = func.with_attr(GEMM_KERNEL_ATTR, kernel.encode())
        self.marked = tuple(sorted(gv.name_hint for gv in updates))
        return with_functions(mod, updates)

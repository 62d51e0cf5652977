"""VectorizeSoftmax: a (log-)softmax kernel becomes loops a CPU vectorizes, with the same results.

TVM legalizes ``relax.nn.softmax`` over the last axis to ``topi.nn.softmax``: per row the
maximum (one running ``max``), the sum of ``exp(x - max)`` (one running sum) and the quotient
``exp(x - max) / sum``. On the CPU every one of these loops runs one element at a time: the two
reductions are chains of dependent operations, and the sum's loop also computes an ``exp`` per
element that it cannot vectorize (a strict floating-point sum is not reordered), which the
quotient's loop then computes again (``InlineKernelIntermediates`` inlines the ``exp`` stage into
both readers, to hold no ``exp`` tensor). Measured on the benchmark's gpt2-train step at
s = 256, its two softmax kernels took 1.7 of the step's 12 ms.

This pass replaces the body of each PrimFunc that is exactly that softmax (blocks
``T_softmax_maxelem``, ``T_softmax_expsum`` and ``T_softmax_norm``, the ``T_softmax_exp`` stage
inlined or not, nothing else; one input and one output buffer of the same shape and float
dtype; the norm block's ``axis`` annotation the last axis) by loops written with TVM's TIR
builder. Per row ``r`` of the ``n`` elements ``x[r, :]``::

    M[l] = max over jo < n // 16 of x[r, 16 jo + l]     # 16 lanes: vector max
    m = max(max over l of M[l], max over the last n % 16 of x[r, :])
    y[r, j] = exp(x[r, j] - m)                          # each exp once, vectorized
    z = sum over j of y[r, j]                           # in ascending j, as topi's
    y[r, j] = y[r, j] / z                               # in place, vectorized

A maximum does not depend on the order in which it is taken, the sum keeps topi's order, and
every ``exp`` has topi's argument, so every value is the stock kernel's, bit for bit (on a
target without fused multiply-adds; on one with them LLVM may contract the two kernels'
products differently). The scratch is the 16 lanes and two scalars, on the stack (constant-size
buffers of global scope, which ``LowerTVMBuiltin`` leaves an ``alloca`` on a CPU): the kernel
allocates no workspace, where ``topi``'s maximum and sum were buffers of a row each.

``relax.nn.log_softmax`` over the last axis legalizes to ``topi.nn.log_softmax``, the same
maximum and sum (blocks ``T_softmax_maxelem`` and ``compute``, the ``exp`` computed inside the
sum's loop) and ``x - max - log(sum)`` per element (block ``compute_1``, a ``log`` per element of
the one value of the row). Its rows become the same loops, the ``exp`` written into the output
row to be summed, and a last loop ``y[r, j] = x[r, j] - m - log(z)`` with ``log(z)`` taken
once: bit for bit topi's values again. On the benchmark's mlp-train step at s = 256 (a
cross-entropy over 512 classes), the stock kernel took 0.52 of the step's 3.6 ms.

Where it runs
-------------
On CPU targets, on PrimFuncs, after ``FuseTIR`` and ``InlineKernelIntermediates`` and before the
memory passes (``MemoryAwareSchedule`` onwards), so that every memory analysis sees the kernel
that runs; in :func:`blade_relax.get_pipeline` right after ``InlineKernelIntermediates``. With
``ExpandMathIntrinsics`` (later in the pipeline) the ``exp`` loop is vectorized too.

What it assumes
---------------
Kernels in block form; a kernel that fused anything else with the softmax (another block, more
buffers) is not matched and keeps TVM's code. Relax functions are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as T

from ..analysis.tir_fields import blocks, is_buffer
from ..contract import SOFTMAX_KERNEL_ATTR
from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish, with_functions

__all__ = [
    "SoftmaxOptions",
    "VectorizeSoftmax",
    "is_softmax_kernel",
    "log_softmax_axis",
    "softmax_axis",
]

#: Lanes of the running maximum (16 single floats: one AVX-512 register, four SSE ones).
_LANES = 16
_REQUIRED = frozenset({"T_softmax_maxelem", "T_softmax_expsum", "T_softmax_norm"})
_ALLOWED = _REQUIRED | {"T_softmax_exp"}
#: ``topi.nn.log_softmax``'s blocks: the maximum, the sum of ``exp`` and the result (its two
#: computes are unnamed in topi, so TE numbers them).
_LOG_SUM, _LOG_NORM = "compute", "compute_1"
_LOG_BLOCKS = frozenset({"T_softmax_maxelem", _LOG_SUM, _LOG_NORM})


@dataclass(frozen=True)
class SoftmaxOptions:
    """Options of :class:`VectorizeSoftmax`.

    Attributes
    ----------
    lanes
        Lanes of the running maximum (a power of two from 1 to 64).
    """

    lanes: int = _LANES

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.lanes > 64 or self.lanes & (self.lanes - 1):
            raise ValueError(f"lanes must be a power of two from 1 to 64, got {self.lanes}")


def _row_kernel_blocks(func: tirx.PrimFunc) -> dict[str, tvm.s_tir.SBlock] | None:
    """The blocks of ``func`` by name when it maps one float buffer to another of the same
    shape and dtype and names no block twice, else ``None``."""
    if len(func.params) != 2 or not all(is_buffer(p) for p in func.params):
        return None
    src, dst = (p.ty for p in func.params)
    if str(src.dtype) != str(dst.dtype) or not str(src.dtype).startswith("float"):
        return None
    if len(src.shape) != len(dst.shape) or not src.shape:
        return None
    if not all(tvm_ffi.structural_equal(a, b) for a, b in zip(src.shape, dst.shape)):
        return None
    found = blocks(func)
    by_name = {b.name_hint: b for b in found}
    return by_name if len(by_name) == len(found) else None  # a name twice: not topi's kernel


def _over_last_axis(block: tvm.s_tir.SBlock, func: tirx.PrimFunc) -> int | None:
    """The last axis of ``func``'s input when ``block``'s ``axis`` annotation names it."""
    axis = block.annotations.get("axis")
    last = len(func.params[0].ty.shape) - 1
    return last if axis is not None and int(axis) == last else None


def _calls(node: Any, op_name: str) -> bool:
    """Whether ``node`` calls the TIR intrinsic ``op_name`` (``"tirx.log"``)."""
    found = []

    def call(c: tvm.ir.Call) -> tvm.ir.Call:
        if isinstance(c.op, tvm.ir.Op) and c.op.name == op_name:
            found.append(c)
        return c

    tvm_ffi.structural_map(node, [(tvm.ir.Call, call)])
    return bool(found)


def softmax_axis(func: tirx.PrimFunc) -> int | None:
    """The axis of the softmax ``func`` is, when it is exactly ``topi.nn.softmax`` over the last
    axis of its one input (see the module docstring), else ``None``."""
    blocks = _row_kernel_blocks(func)
    if blocks is None or not _REQUIRED <= set(blocks) or not set(blocks) <= _ALLOWED:
        return None
    return _over_last_axis(blocks["T_softmax_norm"], func)


def is_softmax_kernel(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is a softmax over its input's last axis: topi's (:func:`softmax_axis`)
    or one this pass rewrote (marked with :data:`~blade_relax.contract.SOFTMAX_KERNEL_ATTR`)."""
    if func.attrs is not None and SOFTMAX_KERNEL_ATTR in func.attrs:
        return True
    return softmax_axis(func) is not None


def log_softmax_axis(func: tirx.PrimFunc) -> int | None:
    """The axis of the log-softmax ``func`` is, when it is exactly ``topi.nn.log_softmax``
    over the last axis of its one input (see the module docstring), else ``None``."""
    blocks = _row_kernel_blocks(func)
    if blocks is None or set(blocks) != _LOG_BLOCKS:
        return None
    # topi's names are generic ones: check that the sum sums exps and the result takes a log.
    if not _calls(blocks[_LOG_SUM].body, "tirx.exp"):
        return None
    if not _calls(blocks[_LOG_NORM].body, "tirx.log"):
        return None
    return _over_last_axis(blocks[_LOG_NORM], func)


def vectorized_softmax(
    func: tirx.PrimFunc, lanes: int = _LANES, log: bool = False
) -> tirx.PrimFunc:
    """The softmax ``func`` (:func:`softmax_axis` not ``None``), or with ``log`` the log-softmax
    (:func:`log_softmax_axis` not ``None``), as the loops of the module docstring, with
    ``func``'s parameters and attributes."""
    src, dst = (p.ty for p in func.params)
    dtype = str(src.dtype)
    rows = list(src.shape[:-1])
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            x = T.arg(func.params[0].name, T.buffer(src.shape, dtype))
            y = T.arg(func.params[1].name, T.buffer(dst.shape, dtype))
            T.func_attr({"tirx.noalias": True})
            # A root block and nothing under it: TVM's later passes (HasReshapePattern) expect
            # block form at the top; the loops are opaque to them, as TVM's own serial kernels.
            with T.sblock("root"):
                T.reads([])
                T.writes([])
                if not rows:
                    _softmax_row(x, y, [], src.shape[-1], dtype, lanes, log)
                else:
                    with T.grid(*rows) as r:
                        row = list(r) if len(rows) > 1 else [r]
                        _softmax_row(x, y, row, src.shape[-1], dtype, lanes, log)
    out = builder.get()
    return out.with_attrs(func.attrs) if func.attrs else out


def _softmax_row(x: Any, y: Any, r: list[Any], n: Any, dtype: str, lanes: int, log: bool) -> None:
    """The loops of one row ``r`` (see the module docstring), in the builder's scope."""
    whole = tirx.floordiv(n, lanes)
    # "global" scope, not "local": on a CPU, TVM's LowerTVMBuiltin keeps a constant-size global
    # buffer under 1 KiB on the stack, and takes every "local" one from the workspace pool (a
    # TVMBackendAllocWorkspace call per row, and bytes the workspace analysis must count).
    best = T.decl_buffer((lanes,), dtype)
    acc = T.decl_buffer((2,), dtype)  # the maximum, the sum
    with T.serial(0, lanes) as lane:
        T.buffer_store(best, tirx.min_value(dtype), [lane])  # topi's initial maximum
    with T.serial(0, whole) as jo:
        with T.serial(0, lanes) as lane:
            T.buffer_store(best, tirx.max(best[lane], x[(*r, jo * lanes + lane)]), [lane])
    T.buffer_store(acc, tirx.min_value(dtype), [0])
    with T.serial(0, lanes) as lane:
        T.buffer_store(acc, tirx.max(acc[0], best[lane]), [0])
    with T.serial(0, n - whole * lanes) as t:
        T.buffer_store(acc, tirx.max(acc[0], x[(*r, whole * lanes + t)]), [0])
    with T.serial(0, n) as j:
        T.buffer_store(y, tirx.exp(x[(*r, j)] - acc[0]), [*r, j])
    T.buffer_store(acc, tirx.const(0, dtype), [1])
    with T.serial(0, n) as j:
        T.buffer_store(acc, acc[1] + y[(*r, j)], [1])
    if log:
        T.buffer_store(acc, tirx.log(acc[1]), [1])
        with T.serial(0, n) as j:
            T.buffer_store(y, x[(*r, j)] - acc[0] - acc[1], [*r, j])
    else:
        with T.serial(0, n) as j:
            T.buffer_store(y, y[(*r, j)] / acc[1], [*r, j])


@tvm.transform.module_pass(opt_level=0, name="VectorizeSoftmax")
class VectorizeSoftmax:
    """Compute each ``topi.nn.softmax`` and ``topi.nn.log_softmax`` kernel with loops a CPU
    vectorizes, bit for bit (see the module docstring).

    Parameters
    ----------
    options
        A :class:`SoftmaxOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.last_result`` is a
    :class:`~blade_relax.transform.result.PassResult` (no byte figures: the kernel allocates no
    workspace and no Relax function changes) and ``pass_obj.kernels`` the number of kernels
    replaced.
    """

    name = "VectorizeSoftmax"

    def __init__(self, options: SoftmaxOptions | None = None) -> None:
        if options is not None and not isinstance(options, SoftmaxOptions):
            raise TypeError(
                f"VectorizeSoftmax expects SoftmaxOptions, got {type(options).__name__}"
            )
        self.options = options or SoftmaxOptions()
        self.kernels = 0
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates, changes = {}, {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            for log, axis_of in ((False, softmax_axis), (True, log_softmax_axis)):
                axis = axis_of(func)
                if axis is not None:
                    updates[gv] = vectorized_softmax(func, self.options.lanes, log=log)
                    if not log:
                        updates[gv] = updates[gv].with_attr(SOFTMAX_KERNEL_ATTR, axis)
                    kind = "log-softmax" if log else "softmax"
                    changes[gv.name_hint] = [f"{kind} over vectorizable loops"]
        out = with_functions(mod, updates)
        self.kernels = len(changes)
        notes = (counted(self.kernels, "softmax kernel") + " replaced",)
        publish(
            self,
            PassResult(
                "VectorizeSoftmax",
                function_results(mod, out, changes, kind=tirx.PrimFunc),
                notes=notes,
            ),
        )
        return out

"""Converters for the operators of a mixture-of-experts layer, as transformers exports it.

transformers' default experts implementation (``grouped_mm``) routes each token to its top-k
experts, sorts the ``S = tokens * k`` (token, expert) pairs by expert, counts the pairs of each
expert with ``histc`` and runs every expert's GEMM on its contiguous run of rows:
``grouped_mm_fallback(x[S, K], w[E, K, N], offsets[E]) -> [S, N]``, where ``offsets`` is the
running sum of the counts. Where a torch build has no grouped GEMM kernel for the dtype, the
graph holds transformers' own custom operators (``transformers::grouped_mm_fallback`` and its
backward, ``grouped_mm_fallback_backward``), which TVM's importer does not know.

How many rows each expert receives is known only at run time. No buffer depends on it here:
every buffer of the layer has ``S`` rows (a symbolic size, ``b * s * k``), and the counts are
loop bounds read inside the kernels below, so an expert that receives no token costs nothing
and one that receives all of them costs what a dense GEMM would, with no capacity and no token
dropped. The memory passes see ``[S, N]`` buffers like any other.

The kernels are hand-written TIR because neither Relax nor TE can express a loop whose bounds
are values of a tensor: a TE reduction over all ``S`` rows with a predicate would do every
expert's work for every row (``E`` times the arithmetic). They accumulate in float32, as torch's
GEMMs do for 16-bit inputs, and are not scheduled for a GPU (on CUDA a model with them needs a
schedule that binds threads; the CPU backend compiles them as they are).

``histc.default``
    ``torch.histc(x, bins, min, max)`` with ``min < max``: counts of ``x`` per equal-width bin,
    values outside ``[min, max]`` not counted, ``max`` in the last bin; a one-hot comparison
    summed over the values (``S * bins`` booleans, ``bins`` being the number of experts).
    ``min == max`` (bins from the data's own range) is refused.
``grouped_mm_fallback.default``
    The grouped GEMM; rows past the last offset are zero, as transformers' fallback leaves them.
``grouped_mm_fallback_backward.default``
    ``(grad_input, grad_weight)``: each expert's rows of ``grad_output @ w[e].T`` (the forward
    kernel reading the weight transposed), and ``x[rows].T @ grad_output[rows]`` per expert
    (zero for an expert without rows).
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import relax
from tvm.script import tirx as T

from ..symbolic import is_integer

__all__ = ["MOE_CONVERTERS"]


def _row_range(offsets: Any, expert: Any) -> tuple[Any, Any]:
    """The first row and one past the last row of ``expert``, as int64."""
    first = T.if_then_else(expert == 0, T.int64(0), T.Cast("int64", offsets[expert - 1]))
    return first, T.Cast("int64", offsets[expert])


@functools.cache
def _grouped_kernels(dtype: str, offset_dtype: str, transposed: bool) -> dict[str, Any]:
    """The grouped GEMM and its weight gradient for one value dtype and offset dtype.

    ``transposed``: the weight is stored ``[E, N, K]`` (the layout of transformers' expert
    parameters, which the graph transposes before the grouped GEMM) and read in place, and the
    weight gradient is written in that layout too.
    """

    def weight_shape(experts: Any, k_size: Any, n_size: Any) -> tuple:
        return (experts, n_size, k_size) if transposed else (experts, k_size, n_size)

    def weight(w: Any, e: Any, k: Any, n: Any) -> Any:
        return T.Cast("float32", w[e, n, k] if transposed else w[e, k, n])

    def store_weight(out: Any, value: Any, e: Any, k: Any, n: Any) -> Any:
        return T.buffer_store(out, value, [e, n, k] if transposed else [e, k, n])

    @T.prim_func(private=True)
    def grouped_mm(x_h: T.handle, w_h: T.handle, offsets_h: T.handle, out_h: T.handle):
        T.func_attr({"tir.noalias": True})
        rows, k_size, n_size, experts = T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (rows, k_size), dtype)
        w = T.match_buffer(w_h, weight_shape(experts, k_size, n_size), dtype)
        offsets = T.match_buffer(offsets_h, (experts,), offset_dtype)
        out = T.match_buffer(out_h, (rows, n_size), dtype)
        acc = T.alloc_buffer((1,), "float32")
        for i, n in T.grid(rows, n_size):
            out[i, n] = T.Cast(dtype, 0)
        for e in range(experts):
            first, end = _row_range(offsets, e)
            for i in T.serial(first, end):
                for n in range(n_size):
                    acc[0] = T.float32(0)
                    for k in range(k_size):
                        acc[0] = acc[0] + T.Cast("float32", x[i, k]) * weight(w, e, k, n)
                    out[i, n] = T.Cast(dtype, acc[0])

    @T.prim_func(private=True)
    def grouped_mm_grad_weight(x_h: T.handle, g_h: T.handle, offsets_h: T.handle, out_h: T.handle):
        T.func_attr({"tir.noalias": True})
        rows, k_size, n_size, experts = T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (rows, k_size), dtype)
        g = T.match_buffer(g_h, (rows, n_size), dtype)
        offsets = T.match_buffer(offsets_h, (experts,), offset_dtype)
        out = T.match_buffer(out_h, weight_shape(experts, k_size, n_size), dtype)
        acc = T.alloc_buffer((1,), "float32")
        for e in range(experts):
            first, end = _row_range(offsets, e)
            for k, n in T.grid(k_size, n_size):
                acc[0] = T.float32(0)
                for i in T.serial(first, end):
                    acc[0] = acc[0] + T.Cast("float32", x[i, k]) * T.Cast("float32", g[i, n])
                store_weight(out, T.Cast(dtype, acc[0]), e, k, n)

    return {"grouped_mm": grouped_mm, "grouped_mm_grad_weight": grouped_mm_grad_weight}


def _call_kernel(
    importer: Any, kernel: str, args: list, shape: Any, dtype: str, transposed: bool
) -> relax.Var:
    """``call_tir`` of one grouped kernel (added to the module once per variant)."""
    bb = importer.block_builder
    offset_dtype = str(args[2].ty.dtype)
    layout = "_wt" if transposed else ""
    name = f"{kernel}{layout}_{dtype}_{offset_dtype}"
    module = bb.get()
    if any(gv.name_hint == name for gv in module.functions):
        gvar = module.get_global_var(name)
    else:
        gvar = bb.add_func(_grouped_kernels(dtype, offset_dtype, transposed)[kernel], name)
    return bb.emit(relax.call_tir(gvar, args, relax.TensorType(shape, dtype)))


def _is_last_two_swapped(node: Any) -> bool:
    """Whether the FX value ``node`` is ``permute(w, [0, 2, 1])`` of a three-dimensional ``w``."""
    if getattr(node, "op", None) != "call_function" or "permute" not in str(node.target):
        return False
    dims = [int(d) % 3 for d in node.args[1]]
    return dims == [0, 2, 1]


def _weight(node: Any, importer: Any, x: relax.Expr, offsets: relax.Expr) -> tuple[Any, bool]:
    """The grouped GEMM's weight, and whether it is read in place from the transpose's
    operand: transformers stores expert weights ``[E, N, K]`` and transposes them for the GEMM;
    a Relax transpose is a copy of every expert's weight (and its gradient another), which
    reading the stored layout avoids."""
    source = node.args[1]
    transposed = _is_last_two_swapped(source)
    w = importer.env[source.args[0]] if transposed else importer.env[source]
    if x.ty.ndim != 2 or w.ty.ndim != 3 or offsets.ty.ndim != 1:
        raise ValueError(
            "grouped_mm_fallback: expected input [S, K], weight [E, K, N] and offsets [E], got "
            f"{x.ty.ndim}, {w.ty.ndim} and {offsets.ty.ndim} dimensions"
        )
    if not is_integer(offsets):
        raise ValueError(f"grouped_mm_fallback: offsets must be integers, not {offsets.ty.dtype}")
    return w, transposed


def _grouped_mm(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x, offsets = args[0], args[2]
    w, transposed = _weight(node, importer, x, offsets)
    n_size = w.ty.shape[1 if transposed else 2]
    return _call_kernel(
        importer,
        "grouped_mm",
        [x, w, offsets],
        [x.ty.shape[0], n_size],
        str(x.ty.dtype),
        transposed,
    )


def _grouped_mm_backward(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x, offsets, grad = args[0], args[2], args[3]
    w, transposed = _weight(node, importer, x, offsets)
    dtype = str(x.ty.dtype)
    # grad_input[i, k] = sum over n of grad[i, n] * w[e, k, n]: the forward GEMM of ``grad``
    # reading the weight the other way round.
    grad_input = _call_kernel(
        importer,
        "grouped_mm",
        [grad, w, offsets],
        list(x.ty.shape),
        dtype,
        not transposed,
    )
    grad_weight = _call_kernel(
        importer,
        "grouped_mm_grad_weight",
        [x, grad, offsets],
        list(w.ty.shape),
        dtype,
        transposed,
    )
    bb = importer.block_builder
    if transposed:
        # The graph expects the gradient of the transposed weight, and transposes it back to
        # the parameter's layout: the two transposes compose to nothing (SimplifyTransposes).
        grad_weight = bb.emit(relax.op.permute_dims(grad_weight, [0, 2, 1]))
    return bb.emit(relax.Tuple([grad_input, grad_weight]))


def _histc(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x = args[0]
    bins = int(args[1]) if len(args) > 1 else 100
    low = float(args[2]) if len(args) > 2 else 0.0
    high = float(args[3]) if len(args) > 3 else 0.0
    if not low < high:
        raise ValueError(
            f"histc with min={low} and max={high}: bins from the data's own range are not "
            "supported (the edges would be known only at run time); pass min < max"
        )
    bb = importer.block_builder
    dtype = str(x.ty.dtype)
    flat = bb.emit(relax.op.reshape(x, [-1]))
    # torch's CPU and CUDA kernels: (x - min) / (max - min) * bins, truncated; max is in the
    # last bin.
    position = relax.op.multiply(
        relax.op.divide(
            relax.op.subtract(flat, relax.const(low, dtype)), relax.const(high - low, dtype)
        ),
        relax.const(float(bins), dtype),
    )
    index = relax.op.minimum(
        relax.op.astype(relax.op.floor(position), "int64"), relax.const(bins - 1, "int64")
    )
    inside = relax.op.logical_and(
        relax.op.greater_equal(flat, relax.const(low, dtype)),
        relax.op.less_equal(flat, relax.const(high, dtype)),
    )
    # A value outside [min, max] gets bin -1, which matches no bin.
    index = bb.emit(relax.op.where(inside, index, relax.const(-1, "int64")))
    edges = relax.op.arange(0, bins, 1, "int64")
    one_hot = relax.op.equal(relax.op.expand_dims(index, 1), relax.op.expand_dims(edges, 0))
    return bb.emit(relax.op.sum(relax.op.astype(one_hot, dtype), axis=[0]))


#: The mixture-of-experts converters, by the name the exported graph gives the operator.
MOE_CONVERTERS = {
    "grouped_mm_fallback.default": _grouped_mm,
    "grouped_mm_fallback_backward.default": _grouped_mm_backward,
    "histc.default": _histc,
}

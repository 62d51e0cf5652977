"""Converters for ATen operators that TVM 0.27's ``from_exported_program`` gets wrong or lacks.

They are handed to ``from_exported_program(custom_convert_map=...)`` for every graph this package
imports (inference graphs and joint forward+backward training graphs). Each converter takes the
FX node and the importer, emits Relax through ``importer.block_builder`` and returns the result.

Those of a mixture-of-experts layer are in :mod:`.moe`, the backward of a convolution in
:mod:`.convolution`. Why each one here exists:

``empty_permuted.default``, ``empty.memory_format``, ``empty.default``
    Emitted by the joint graph for gradient buffers (and by DeepSeek-V3's and MiniCPM3's latent
    attention for a buffer of the length's size); its sizes hold symbolic values, which the
    built-in converters pass through unconverted.
``index_put.default`` with one index tensor
    The backward of ``embedding``: ``zeros[V, H].index_put_([ids], grad, accumulate=True)``, and
    of a gather along an inner axis (Falcon's grouped keys: ``[None, None, None, idx]``). It
    becomes one ``scatter_elements`` along that axis (``reduction="add"`` when accumulating)
    over flattened indices, which legalizes for any symbolic number of indices.
``index.Tensor`` with one index tensor
    ``x[:, :, :, [-2]]`` (Falcon's keys) indexes from the end. TVM's converter makes it a
    ``take`` in its ``"fast"`` mode, which reads a negative index out of bounds (no error, the
    wrong values: a 1 % error in Falcon's loss). The ``take`` here wraps negative indices as
    torch does (``mode="wrap"``; valid torch indices are never beyond the axis).
``native_layer_norm.default``
    Must return the triple ``(out, mean, rstd)``: the backward graph reads ``mean`` and ``rstd``.
    The built-in converter returns ``out`` alone, and ``getitem(out, 1)`` on a tensor then
    silently yields ``out`` again, which corrupts GPT-2's gradients without any error.
``mm.default``, ``matmul.default``, ``bmm.default``, ``addmm.default``
    The built-in converters compute every product in float32 (``out_dtype="float32"``
    whatever the inputs), which turns a bfloat16 graph into a mixed one: twice the bytes for
    every product, and ops that require equal dtypes (``slice_scatter`` in the backward of
    rotary embeddings; ``addmm``'s bias add, which rejects a bfloat16 GPT-2 outright) are
    rejected. The product takes the dtype torch gives it (the FX node's value; float32
    graphs are unchanged). By default a 16-bit product also sums in that dtype; with
    ``custom_convert_map(accumulate="float32")`` it sums in float32 and is rounded once at the
    end (``addmm`` adds its bias before that rounding), as torch's CPU and CUDA kernels do:
    what mixed-precision (autocast) imports use.
``pow.Tensor_Scalar``
    An exponent of 0, 1, 2, 3, -1 or -2 becomes what torch's CPU and CUDA kernels compute for
    it: ones, ``x``, ``x * x``, ``(x * x) * x``, ``1 / x``, ``1 / (x * x)``. TVM's ``power``
    becomes ``powf``, and TVM compiles CUDA with ``--use_fast_math``, which makes ``powf`` an
    approximation through ``log2`` that is NaN for every negative base: on an H200, Llama's
    RMSNorm (``x.pow(2)``, and ``x.pow(1)`` in its backward) and GPT-2's ``gelu_new``
    (``x ** 3``) gave NaN losses and logits, with TVM's stock pipeline too. Other exponents
    stay ``power``; on bfloat16, which TVM's ``power`` rejects (``power only applies to
    float``), computed in float32 and rounded once.
``new_empty_strided.default``
    Falcon's backward allocates the gradient of a batched matmul with it (sizes and strides
    over the symbolic length). TVM has no converter; an empty tensor's contents are undefined,
    so it becomes zeros of the requested size, which is right while the strides are the
    contiguous ones of that size (Relax tensors have no other layout): other strides are
    refused with an error naming them.
``pow`` (Python's, on symbolic sizes)
    The same graph computes a stride as ``s ** 2`` on a ``SymInt``; TVM has no converter for
    the builtin. An integer power of a size is a product of the size with itself.
``view.default``, ``reshape.default``
    TVM's converter skips a reshape to the shape its input has by comparing the two shapes as
    Python lists, which asks a symbolic comparison for a truth value and fails
    (GPT-BigCode's multi-query attention: "Cannot use and / or / not operator to Expr"). The
    shapes are compared with TVM's symbolic analyzer (``tvm.sym.Analyzer``) instead.
``div.Tensor``, ``div.Scalar`` (true division)
    torch divides integer tensors as floats (Ministral 3 scales its queries by
    ``log(1 + floor(position_ids / n))``, ``position_ids`` being int64); TVM's converter
    divides them as integers, and ``log`` of the int64 result is rejected. The operands take
    the dtype torch gives the quotient (the FX node's value), a Python number too (an int64
    tensor divided by ``2.5`` would otherwise divide by a constant rounded to 2).
``div.Tensor_mode`` with a Python number
    ``perm // top_k`` (a mixture-of-experts layer's token of each sorted pair) divides an
    int64 tensor by a Python ``int``; TVM's converter makes the number an int32 constant and
    the division is rejected (operands of different dtypes). The number takes the tensor's
    dtype. Relax has no truncating integer division, and JetMoE's router divides with
    ``rounding_mode="trunc"`` (``index_sorted_experts.div(top_k, rounding_mode="trunc")``): it
    is the floor quotient plus one where the division is inexact and the operands have
    opposite signs.
``cumsum.default``
    torch sums booleans and integers as int64 (``cumsum`` of a bool mask, as Llama 4's export
    has); TVM's converter keeps the input's dtype, and LLVM's code generator rejects an add of
    booleans. Where no ``dtype`` is passed, the input is cast to the dtype torch gives the sum
    (the FX node's value) first.
``full.default``, ``full_like.default`` with an infinite or NaN value
    Llama 4's chunked attention masks with ``full_like(scores, -inf)``. TVM's legalization of
    ``full`` tests the dtype of an infinite fill value as a string while it is a ``PrimType``
    (``TypeError: argument of type 'PrimType' is not iterable``), for every dtype. The tensor
    becomes the value broadcast to the shape (``broadcast_to`` of a constant), which legalizes;
    finite values keep the built-in converters.
``amax.default``, ``amin.default``
    Absent from TVM's importer. torch decomposes ``logsumexp`` with ``amax`` (the sinks of
    Granite's sliding-window variants scale each head's output by
    ``sigmoid(logsumexp(scores) - sink)``); an empty ``dim`` reduces over every axis, as in
    torch. They are Relax's ``max`` and ``min`` (the backward torch exports for them is built
    from comparisons and sums, which TVM converts).
``scatter_add.default``
    Absent from TVM's importer; routers of several mixture-of-experts models (GLM-4-MoE,
    ERNIE-4.5-MoE, PhiMoE) and the backward of ``gather`` use it. It is ``scatter_elements``
    with ``reduction="add"`` (an index tensor may be smaller than the data, as torch allows).
``topk.default`` with ``sorted=False``
    TVM's converter refuses it. torch leaves the order of an unsorted top-k unspecified, so
    the sorted result is one it allows; the routers that ask for it (GLM-4-MoE's group and
    expert choice) use the values and indices as sets or as pairs.
``slice.Tensor`` on a symbolic axis
    ``labels[..., 1:]`` arrives with ``end = 2**63 - 1``. The built-in converter keeps that end,
    so shapes become ``min(2**63 - 2, s)`` and byte counts overflow int64 during lowering. The
    end is replaced by the axis size (and negative bounds are made relative to it).
``slice.Tensor`` with a symbolic bound
    MPT slices its ALiBi bias ``[:, :, max(0, 2048 - s):]``. The built-in converter keeps
    TVM's clamping of the bounds in the shape (``2048 - max(2048 - s, 0)``, not ``s``), so the
    sum with the ``s``-long scores has no known shape and cannot be lowered. Where torch proves
    ``0 <= start <= end <= size`` over the exported lengths, the slice is taken as in bounds. A
    bound torch proves negative counts from the end, as in torch, symbolic ones too: LFM2's
    ``attention_mask[:, -s:]`` is the whole mask, where TVM's converter gives it a clamped
    shape (and ``slice_scatter`` a wrong number of elements).
``slice_scatter.default`` with a symbolic bound
    The backward of a slice (GPT-OSS's attention sinks: the scores' gradient is the first ``s``
    columns of an ``s + 1``-wide one) scatters into ``[..., 0:s]``. TVM legalizes
    ``slice_scatter`` with ``topi.slice_scatter``, which needs the axis size and the bounds to be
    constants ("Expect value to be constant int"). With a step of one it becomes
    ``concat(x[:start], src, x[end:])`` (empty parts left out), which lowers for any size;
    constant bounds keep TVM's converter, as do other steps and bounds that torch does not
    prove within the axis over the exported lengths (once negative ones are taken from its
    end). (A TE kernel emitted while importing does not do: the renaming of the symbolic dims
    afterwards rewrites ``1 + s`` in the graph as ``s + 1`` but not in the kernel, and FuseTIR
    then rejects the two buffers as different.)
``sym_max``, ``sym_min`` (on symbolic sizes)
    MPT's ``max(0, position_bias.size(2) - key_length)`` exports as ``torch.sym_max``, for which
    TVM has no converter. Where torch proves which operand is the larger (smaller) over the
    exported range of lengths, it is that operand, so the shapes it bounds stay simple (the
    slice above); otherwise the TIR ``max`` (``min``) of the two.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax

from ..symbolic.relax_ir import as_int64
from .convolution import CONVOLUTION_CONVERTERS
from .moe import MOE_CONVERTERS

__all__ = ["CUSTOM_CONVERTERS", "custom_convert_map"]

# torch uses INT64_MAX for "to the end"; anything this large cannot be a real index.
_OPEN_END = 1 << 62


def _empty(node: Any, importer: Any) -> relax.Var:
    import torch

    size = importer.retrieve_args(node)[0]
    dtype = importer._convert_data_type(
        node.kwargs.get("dtype", torch.get_default_dtype()), importer.env
    )
    # The contents of an empty tensor are undefined; zeros are a valid choice.
    return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(list(size)), dtype))


def _contiguous_strides(size: list[Any]) -> list[Any]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step = step * extent
    return strides[::-1]


def _same_shape(current: Any, dims: list[Any]) -> bool:
    """Whether two lists of sizes (ints, symbolic expressions) are provably equal."""
    if len(current) != len(dims):
        return False
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(current, dims))


def _new_empty_strided(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    source, size, stride = args[0], list(args[1]), list(args[2])
    expected = _contiguous_strides(size)
    if not _same_shape(stride, expected):
        raise NotImplementedError(
            f"new_empty_strided with strides {stride} for size {size}: only the contiguous "
            f"strides {expected} have a Relax layout"
        )
    dtype = node.kwargs.get("dtype")
    dtype = source.ty.dtype if dtype is None else importer._convert_data_type(dtype, importer.env)
    # The contents of an empty tensor are undefined; zeros are a valid choice.
    return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(size), dtype))


def _size_pow(node: Any, importer: Any) -> Any:
    base, exponent = importer.retrieve_args(node)[:2]
    if not isinstance(exponent, int) or isinstance(exponent, bool) or exponent < 0:
        raise NotImplementedError(f"pow of a size by {exponent!r}: only integer powers >= 0")
    if isinstance(base, int):
        return base**exponent
    return functools.reduce(operator.mul, [base] * exponent, 1)


def _as_size(value: Any) -> Any:
    """A size as a Python ``int`` where it is a constant, else the symbolic expression."""
    if isinstance(value, tvm.ir.GenericConst):  # what ``sym_size.int`` gives a static axis
        return int(value.value.numpy())
    if isinstance(value, tvm.tirx.IntImm):
        return int(value.value)
    return value


def _fx_value(arg: Any) -> Any:
    """What torch traced for an FX argument (a ``SymInt``, a fake tensor), else the argument."""
    import torch

    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _absolute_bounds(
    start: Any, end: Any, size: Any, from_end: tuple[bool, bool] = (False, False)
) -> tuple[Any, Any]:
    """``(start, end)`` of a slice along an axis of ``size`` as torch reads them: ``None`` is
    the axis's start (end), an end of ``_OPEN_END`` or more the axis's end, and a negative
    integer, or a bound marked in ``from_end`` (see :func:`_from_end`), counts from the end
    (out-of-range bounds are left for the caller to prove)."""
    start = 0 if start is None else start
    end = size if end is None or (isinstance(end, int) and end >= _OPEN_END) else end
    bounds = []
    for bound, back in zip((start, end), from_end):
        if back or (isinstance(bound, int) and bound < 0):
            bound = size + bound
            if isinstance(bound, tvm.ir.Expr):  # a TIR size, not torch's: s + -s is 0
                bound = tvm.sym.Analyzer().simplify(bound)
        bounds.append(bound)
    return bounds[0], bounds[1]


def _from_end(bounds: Any) -> tuple[bool, bool]:
    """For the ``(start, end)`` FX arguments of a slice (either may be missing or ``None``),
    whether each is a symbolic size that torch proves negative over the exported lengths, and
    so counts from the axis's end (``attention_mask[:, -s:]``)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    values = [_fx_value(b) for b in (*bounds, None, None)[:2]]
    return tuple(
        v is not None and not isinstance(v, int) and bool(statically_known_true(v < 0))
        for v in values
    )


def _size_extremum(node: Any, importer: Any, largest: bool) -> Any:
    """``sym_max`` / ``sym_min`` of two sizes: the one torch proves is the larger (smaller) over
    the exported range of lengths, else the TIR ``max`` (``min``) of the two."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    first, second = (_as_size(v) for v in importer.retrieve_args(node)[:2])
    if isinstance(first, int) and isinstance(second, int):
        return max(first, second) if largest else min(first, second)
    a, b = (_fx_value(v) for v in node.args[:2])
    if a is not None and b is not None:
        if statically_known_true(a >= b if largest else a <= b):
            return first
        if statically_known_true(b >= a if largest else b <= a):
            return second
    pick = tvm.tirx.max if largest else tvm.tirx.min
    return pick(as_int64(first), as_int64(second))


def _reshape(node: Any, importer: Any) -> relax.Var:
    import torch

    args = importer.retrieve_args(node)
    x = args[0]
    dims = args[1] if isinstance(args[1], torch.Size | tuple | list) else args[1:]
    current = importer.shape_of(x)
    if current is not None and _same_shape(list(current), list(dims)):
        return x  # a reshape to the input's own shape
    return importer._emit_torch_reshape(x, dims)


def _index_tensor(node: Any, importer: Any) -> relax.Var:
    data, indices = importer.retrieve_args(node)[:2]
    given = [(axis, index) for axis, index in enumerate(indices) if index is not None]
    if len(given) != 1:
        return importer._index_tensor(node)
    axis, index = given[0]
    return importer.block_builder.emit(relax.op.take(data, index, axis=axis, mode="wrap"))


def _index_put(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    data = args[0]
    indices = args[1] if len(args) > 1 else node.kwargs.get("indices")
    values = args[2] if len(args) > 2 else node.kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else node.kwargs.get("accumulate", False)
    given = [k for k, index in enumerate(indices or ()) if index is not None]
    if (
        not isinstance(indices, list | tuple)
        or len(given) != 1
        or not isinstance(data.ty, relax.TensorType)
        or data.ty.shape is None
    ):
        return importer._index_put(node)
    # One index tensor, at ``axis`` (the axes before it are full slices, as are those after).
    axis = given[0]
    index = indices[axis]
    bb = importer.block_builder
    data_shape = list(data.ty.shape.values)
    before, after = data_shape[:axis], data_shape[axis + 1 :]
    index_shape = list(index.ty.shape.values)
    # values broadcast to before + index.shape + after; the index dims flattened into one.
    values = bb.emit(relax.op.broadcast_to(values, relax.ShapeExpr(before + index_shape + after)))
    flat_values = bb.emit(relax.op.reshape(values, [*before, -1, *after]))
    expanded = bb.emit(relax.op.reshape(index, [*([1] * len(before)), -1, *([1] * len(after))]))
    expanded = bb.emit(relax.op.broadcast_to(expanded, flat_values.ty.shape))
    reduction = "add" if accumulate else "update"
    return bb.emit(
        relax.op.scatter_elements(data, expanded, flat_values, axis=axis, reduction=reduction)
    )


def _native_layer_norm(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x = args[0]
    normalized_shape = node.args[1]
    weight = args[2] if len(args) > 2 else None
    bias = args[3] if len(args) > 3 else None
    eps = float(args[4]) if len(args) > 4 else 1e-5
    bb = importer.block_builder
    dtype = x.ty.dtype
    axes = list(range(-len(normalized_shape), 0))
    mean = bb.emit(relax.op.mean(x, axes, keepdims=True))
    centered = bb.emit(relax.op.subtract(x, mean))
    squared = bb.emit(relax.op.multiply(centered, centered))
    variance = bb.emit(relax.op.mean(squared, axes, keepdims=True))
    rstd = bb.emit(relax.op.rsqrt(relax.op.add(variance, relax.const(eps, dtype))))
    out = bb.emit(relax.op.multiply(centered, rstd))
    if weight is not None:
        out = bb.emit(relax.op.multiply(out, weight))
    if bias is not None:
        out = bb.emit(relax.op.add(out, bias))
    return bb.emit(relax.Tuple([out, mean, rstd]))


def _div_mode(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    lhs, rhs = args[0], args[1]
    mode = args[2] if len(node.args) > 2 else node.kwargs.get("rounding_mode")
    tensor = lhs if isinstance(lhs, relax.Expr) else rhs
    dtype = str(tensor.ty.dtype)
    if mode is None:
        return _true_divide(node, importer)
    lhs, rhs = (x if isinstance(x, relax.Expr) else relax.const(x, dtype) for x in (lhs, rhs))
    bb = importer.block_builder
    if mode == "floor":
        return bb.emit(relax.op.floor_divide(lhs, rhs))
    if mode == "trunc" and "float" in dtype:
        return bb.emit(relax.op.trunc(relax.op.divide(lhs, rhs)))
    if mode == "trunc" and "int" in dtype:
        return _trunc_divide(bb, lhs, rhs, dtype)
    raise ValueError(f"div with rounding_mode={mode!r} on {dtype} is not supported")


def _true_divide(node: Any, importer: Any) -> relax.Var:
    """``lhs / rhs`` in the dtype torch gives the quotient: integer tensors divide as floats (a
    Python number is a constant of that dtype)."""
    lhs, rhs = importer.retrieve_args(node)[:2]
    operands = (lhs, rhs)
    numbers = all(_is_tensor(x) or isinstance(x, int | float) for x in operands)
    if not numbers or not any(map(_is_tensor, operands)):
        return importer._binary_op(relax.op.divide, operator.truediv)(node)  # sizes, as TVM
    tensor = lhs if _is_tensor(lhs) else rhs
    dtype = _value_dtype(node, importer, str(tensor.ty.dtype))
    bb = importer.block_builder
    lhs, rhs = (_cast(bb, x, dtype) if _is_tensor(x) else relax.const(x, dtype) for x in (lhs, rhs))
    return bb.emit(relax.op.divide(lhs, rhs))


def _is_tensor(value: Any) -> bool:
    return isinstance(getattr(value, "ty", None), relax.TensorType)


def _trunc_divide(bb: Any, lhs: relax.Expr, rhs: relax.Expr, dtype: str) -> relax.Var:
    """Integer division rounded towards zero, from the floor division Relax has.

    The two differ by one where the division is inexact and the operands have opposite signs.
    """
    quotient = bb.emit(relax.op.floor_divide(lhs, rhs))
    remainder = bb.emit(relax.op.subtract(lhs, relax.op.multiply(quotient, rhs)))
    zero = relax.const(0, dtype)
    opposite = relax.op.logical_xor(relax.op.less(lhs, zero), relax.op.less(rhs, zero))
    inexact = relax.op.not_equal(remainder, zero)
    adjust = bb.emit(relax.op.astype(relax.op.logical_and(opposite, inexact), dtype))
    return bb.emit(relax.op.add(quotient, adjust))


def _cumsum(node: Any, importer: Any) -> relax.Var:
    """``cumsum`` in the dtype torch gives the sum where no ``dtype`` is passed (int64 for
    booleans and integers); TVM's own converter where one is, or where the input has it."""
    x = importer.retrieve_args(node)[0]
    dtype = _value_dtype(node, importer, fallback=str(x.ty.dtype))
    if node.kwargs.get("dtype") is not None or dtype == str(x.ty.dtype):
        return importer._cumsum(node)
    axis = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    bb = importer.block_builder
    return bb.emit(relax.op.cumsum(_cast(bb, x, dtype), axis=axis))


def _full(node: Any, importer: Any, like: bool) -> relax.Var:
    """``full`` / ``full_like``: a non-finite value broadcast to the shape, else TVM's own."""
    args = importer.retrieve_args(node)
    value = args[1]
    if not isinstance(value, float) or math.isfinite(value):
        return importer._full_like(node) if like else importer._full(node)
    dtype = importer._convert_data_type(node.meta["val"].dtype, importer.env)
    if like:
        shape = importer.shape_of(args[0])
    else:
        shape = relax.ShapeExpr(args[0] if isinstance(args[0], list | tuple) else (args[0],))
    return importer.block_builder.emit(relax.op.broadcast_to(relax.const(value, dtype), shape))


def _extreme(node: Any, importer: Any, largest: bool) -> relax.Var:
    """``amax`` / ``amin``: the largest (smallest) values along ``dim`` (every axis when it is
    empty, as in torch)."""
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    axes = [dim] if isinstance(dim, int) else list(dim)
    reduce = relax.op.max if largest else relax.op.min
    return importer.block_builder.emit(reduce(x, axes or None, bool(keepdim)))


def _scatter_add(node: Any, importer: Any) -> relax.Var:
    x, dim, index, src = importer.retrieve_args(node)[:4]
    return importer.block_builder.emit(
        relax.op.scatter_elements(x, index, src, axis=int(dim), reduction="add")
    )


def _topk(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x = args[0]
    k = args[1] if len(args) > 1 else node.kwargs.get("k", 1)
    dim = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else node.kwargs.get("largest", True)
    return importer.block_builder.emit(
        relax.op.topk(x, k=k, axis=dim, largest=largest, ret_type="both", dtype="int64")
    )


def _slice(node: Any, importer: Any) -> relax.Var:
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    shape = getattr(getattr(x, "ty", None), "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return importer._slice(node)
    axis = dim % len(values)
    size = values[axis]
    start = 0 if start is None else start
    end = _OPEN_END if end is None else end
    constant_bounds = all(isinstance(v, int) for v in (start, end, step))
    if not constant_bounds and step == 1:
        inbound = _inbound_slice(node, importer, x, axis)
        return importer._slice(node) if inbound is None else inbound
    if isinstance(size, tvm.tirx.IntImm) or not constant_bounds or step != 1:
        return importer._slice(node)
    begin = size + start if start < 0 else start
    if end >= _OPEN_END:
        stop = size
    elif end < 0:
        stop = size + end
    else:
        return importer._slice(node)
    if isinstance(begin, int) and begin == 0 and stop is size:
        return x
    # In bounds by construction: the stop is the axis size (or relative to it) and the start a
    # small constant the exported length range admits.
    return importer.block_builder.emit(
        relax.op.strided_slice(x, [axis], [begin], [stop], [1], assume_inbound=True)
    )


# Where ``slice_scatter``'s start and end are, as positional arguments or keywords.
_BOUNDS = ((3, "start"), (4, "end"))


def _slice_scatter(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    x, src = args[0], args[1]
    dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
    start = args[3] if len(args) > 3 else node.kwargs.get("start")
    end = args[4] if len(args) > 4 else node.kwargs.get("end")
    step = _as_size(args[5] if len(args) > 5 else node.kwargs.get("step", 1))
    shape = getattr(getattr(x, "ty", None), "shape", None)
    values = getattr(shape, "values", None)
    if values is None or step != 1:
        return importer._slice_scatter(node)
    axis = dim % len(values)
    size = _as_size(values[axis])
    bounds = [node.args[i] if len(node.args) > i else node.kwargs.get(k) for i, k in _BOUNDS]
    from_end = _from_end(bounds)
    start, end = _absolute_bounds(_as_size(start), _as_size(end), size, from_end)
    if all(isinstance(v, int) for v in (size, start, end)):
        return importer._slice_scatter(node)  # constant bounds: TVM's legalization works
    # Bounds past the axis (torch clamps them) keep TVM's converter.
    if not _proven_inbound(node.args[0], axis, bounds, from_end):
        return importer._slice_scatter(node)
    # x[:start] ++ src ++ x[end:], leaving out the parts that are provably empty.
    bb = importer.block_builder
    analyzer = tvm.sym.Analyzer()
    parts = [src]
    if not (isinstance(start, int) and start == 0):
        head = relax.op.strided_slice(x, [axis], [0], [start], [1], assume_inbound=True)
        parts.insert(0, bb.emit(head))
    if not analyzer.can_prove_equal(as_int64(end), as_int64(size)):
        tail = relax.op.strided_slice(x, [axis], [end], [size], [1], assume_inbound=True)
        parts.append(bb.emit(tail))
    if len(parts) == 1:
        return src
    return bb.emit(relax.op.concat(parts, axis=axis))


def _proven_inbound(data: Any, axis: int, bounds: Any, from_end: tuple[bool, bool]) -> bool:
    """Whether torch proves ``0 <= start <= end <= size`` over the exported range of lengths
    for the ``(start, end)`` FX arguments ``bounds`` (either may be missing or ``None``: the
    axis's start and end; a negative integer, or a bound marked in ``from_end``, counts from
    the end: :func:`_from_end` of ``bounds``) of a slice of ``data`` along ``axis``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    data = _fx_value(data)
    if data is None or not hasattr(data, "shape"):
        return False
    size = data.shape[axis]
    values = (_fx_value(b) for b in (*bounds, None, None)[:2])
    start, end = _absolute_bounds(*values, size, from_end)
    return all(statically_known_true(a <= b) for a, b in ((0, start), (start, end), (end, size)))


def _inbound_slice(node: Any, importer: Any, x: relax.Expr, axis: int) -> relax.Var | None:
    """``x[start:end]`` along ``axis`` with a symbolic bound that torch proves lies within the
    axis, ``0 <= start <= end <= size``, over the exported range of lengths; else ``None``."""
    from_end = _from_end(node.args[2:4])
    if not _proven_inbound(node.args[0], axis, node.args[2:4], from_end):
        return None
    args = importer.retrieve_args(node)
    bounds = (_as_size(args[i]) if len(args) > i else None for i in (2, 3))
    begin, stop = _absolute_bounds(*bounds, x.ty.shape.values[axis], from_end)
    return importer.block_builder.emit(
        relax.op.strided_slice(x, [axis], [begin], [stop], [1], assume_inbound=True)
    )


def _pow(node: Any, importer: Any) -> relax.Var:
    base, exponent = importer.retrieve_args(node)[:2]
    ty = getattr(base, "ty", None)
    if (
        not isinstance(ty, relax.TensorType)
        or not isinstance(exponent, int | float)
        or isinstance(exponent, bool)
    ):
        return importer._pow(node)
    bb = importer.block_builder
    if exponent == 0:
        return bb.emit(relax.op.ones_like(base))
    if exponent == 1:
        return base
    if exponent in (2, 3, -1, -2):
        result = base
        if abs(exponent) >= 2:
            result = bb.emit(relax.op.multiply(base, base))
        if exponent == 3:
            result = bb.emit(relax.op.multiply(result, base))
        if exponent < 0:
            result = bb.emit(relax.op.divide(relax.const(1.0, ty.dtype), result))
        return result
    if ty.dtype != "bfloat16":
        return importer._pow(node)
    wide = bb.emit(relax.op.astype(base, "float32"))
    raised = bb.emit(relax.op.power(wide, relax.const(float(exponent), "float32")))
    return bb.emit(relax.op.astype(raised, "bfloat16"))


def _value_dtype(node: Any, importer: Any, fallback: str) -> str:
    """The dtype torch gives the node's value (a product, a quotient), else ``fallback``."""
    dtype = getattr(node.meta.get("val"), "dtype", None)
    return fallback if dtype is None else importer._convert_data_type(dtype, importer.env)


def _widened(dtype: str, accumulate: str | None) -> str:
    """The dtype a product of ``dtype`` sums in (``accumulate`` only widens 16-bit floats)."""
    return accumulate if accumulate and dtype in ("float16", "bfloat16") else dtype


def _cast(bb: Any, value: relax.Expr, dtype: str) -> relax.Expr:
    return value if value.ty.dtype == dtype else bb.emit(relax.op.astype(value, dtype))


def _matmul(node: Any, importer: Any, accumulate: str | None = None) -> relax.Var:
    lhs, rhs = importer.retrieve_args(node)[:2]
    tensors = (lhs, rhs)
    if not all(map(_is_tensor, tensors)):
        # Not two tensors: what the built-in converter does.
        builtin = functools.partial(relax.op.linear_algebra.matmul, out_dtype="float32")
        return importer._binary_op(builtin, operator.matmul)(node)
    dtype = _value_dtype(node, importer, lhs.ty.dtype)
    wide = _widened(dtype, accumulate)
    bb = importer.block_builder
    lhs, rhs = _cast(bb, lhs, dtype), _cast(bb, rhs, dtype)
    product = bb.emit(relax.op.linear_algebra.matmul(lhs, rhs, out_dtype=wide))
    return _cast(bb, product, dtype)


def _addmm(node: Any, importer: Any, accumulate: str | None = None) -> relax.Var:
    """``beta * bias + alpha * (lhs @ rhs)`` in the dtype torch gives it."""
    bias, lhs, rhs = importer.retrieve_args(node)[:3]
    alpha = node.kwargs.get("alpha", 1)
    beta = node.kwargs.get("beta", 1)
    tensors = (bias, lhs, rhs)
    if alpha == 0 or not all(map(_is_tensor, tensors)):
        return importer._addmm(node)
    dtype = _value_dtype(node, importer, lhs.ty.dtype)
    wide = _widened(dtype, accumulate)
    bb = importer.block_builder
    lhs, rhs = _cast(bb, lhs, dtype), _cast(bb, rhs, dtype)
    result = bb.emit(relax.op.linear_algebra.matmul(lhs, rhs, out_dtype=wide))
    if alpha != 1:
        result = bb.emit(relax.op.multiply(result, relax.const(alpha, wide)))
    if beta != 0:
        bias = _cast(bb, bias, wide)
        if beta != 1:
            bias = bb.emit(relax.op.multiply(bias, relax.const(beta, wide)))
        result = bb.emit(relax.op.add(bias, result))
    return _cast(bb, result, dtype)


CUSTOM_CONVERTERS: dict[str, Callable[[Any, Any], relax.Var]] = {
    "addmm.default": _addmm,
    "amax.default": functools.partial(_extreme, largest=True),
    "amin.default": functools.partial(_extreme, largest=False),
    "bmm.default": _matmul,
    "cumsum.default": _cumsum,
    "div.Scalar": _true_divide,
    "div.Tensor": _true_divide,
    "div.Tensor_mode": _div_mode,
    "empty.default": _empty,
    "empty.memory_format": _empty,
    "empty_permuted.default": _empty,
    "full.default": functools.partial(_full, like=False),
    "full_like.default": functools.partial(_full, like=True),
    "index.Tensor": _index_tensor,
    "index_put.default": _index_put,
    "matmul.default": _matmul,
    "mm.default": _matmul,
    "native_layer_norm.default": _native_layer_norm,
    "new_empty_strided.default": _new_empty_strided,
    "pow": _size_pow,
    "pow.Tensor_Scalar": _pow,
    "reshape.default": _reshape,
    "scatter_add.default": _scatter_add,
    "slice.Tensor": _slice,
    "slice_scatter.default": _slice_scatter,
    "sym_max": functools.partial(_size_extremum, largest=True),
    "sym_min": functools.partial(_size_extremum, largest=False),
    "topk.default": _topk,
    "view.default": _reshape,
    **CONVOLUTION_CONVERTERS,
    **MOE_CONVERTERS,
}


def custom_convert_map(
    extra: dict[str, Callable[[Any, Any], relax.Var]] | None = None,
    *,
    accumulate: str | None = None,
) -> dict:
    """The converters above, updated with ``extra`` (a user's own converters win).

    Parameters
    ----------
    extra
        More converters, by ATen name; they replace ours.
    accumulate
        ``None``: a product sums in its own dtype. ``"float32"``: a float16 or bfloat16 product
        sums in float32 and is rounded to its dtype once, at the end.
    """
    if accumulate not in (None, "float32"):
        raise ValueError(f"accumulate must be None or 'float32', not {accumulate!r}")
    converters = dict(CUSTOM_CONVERTERS)
    if accumulate is not None:
        for name, convert in CUSTOM_CONVERTERS.items():
            if convert in (_matmul, _addmm):
                converters[name] = functools.partial(convert, accumulate=accumulate)
    converters.update(extra or {})
    return converters

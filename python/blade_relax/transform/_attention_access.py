"""Every value of an attention group as an *accessor*: an index -> the element's expression.

Layout operators compose index maps, so the kernel of ``FuseAttention`` reads the heads where
they lie in ``qkv`` and writes its result in the layout its reader wants; a mask is computed
element by element as TVM's legalization computes it. Only the two matmuls and the softmax are
TE stages (``_attention_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tvm
from tvm import relax, te, tirx

from ..symbolic import is_integer
from ._attention_match import (
    COMPARISONS,
    FILL_OPS,
    LOGICAL_OPS,
    Unsupported,
    const_int,
    constant_array,
    shape_of,
)

#: An index (one expression per axis) -> the element's expression.
Accessor = Callable[[Sequence[tvm.ir.Expr]], tvm.ir.Expr]


def _zero(shape: Sequence[tvm.ir.Expr]) -> tvm.ir.Expr:
    """Index 0 in the index type of ``shape``."""
    return tirx.IntImm(str(shape[0].ty) if shape else "int64", 0)


def reshape_map(
    src: Sequence[tvm.ir.Expr], dst: Sequence[tvm.ir.Expr]
) -> Callable[[Sequence[tvm.ir.Expr]], list[tvm.ir.Expr]]:
    """Index map of ``reshape(src -> dst)``: a destination index -> the source index.

    ``topi.reshape`` ravels and unravels over the whole shape, which leaves ``floormod(x, s)``
    terms TVM's simplifier cannot remove for a symbolic ``s`` (and schedules then cannot
    relate the loops). Here the axes are matched in groups of equal size (unit axes apart, a
    symbolic axis only with an equal one, constant axes merged or split), so every index is a
    mixed-radix conversion over constant extents.
    """
    analyzer = tvm.sym.Analyzer()
    src_axes = [i for i, e in enumerate(src) if const_int(e) != 1]
    dst_axes = [i for i, e in enumerate(dst) if const_int(e) != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src_axes) and j < len(dst_axes):
        a, b = src[src_axes[i]], dst[dst_axes[j]]
        if analyzer.can_prove_equal(a, b):
            groups.append(([src_axes[i]], [dst_axes[j]]))
            i, j = i + 1, j + 1
            continue
        size_a, size_b = const_int(a), const_int(b)
        if size_a is None or size_b is None:
            raise Unsupported("a reshape mixes a symbolic axis with others")
        group_src, group_dst = [src_axes[i]], [dst_axes[j]]
        i, j = i + 1, j + 1
        while size_a != size_b:
            if size_a < size_b:
                extent = const_int(src[src_axes[i]]) if i < len(src_axes) else None
                if extent is None:
                    raise Unsupported("reshape groups do not line up")
                size_a *= extent
                group_src.append(src_axes[i])
                i += 1
            else:
                extent = const_int(dst[dst_axes[j]]) if j < len(dst_axes) else None
                if extent is None:
                    raise Unsupported("reshape groups do not line up")
                size_b *= extent
                group_dst.append(dst_axes[j])
                j += 1
        groups.append((group_src, group_dst))
    if i != len(src_axes) or j != len(dst_axes):
        raise Unsupported("a reshape that changes the size")

    def index_map(idx: Sequence[tvm.ir.Expr]) -> list[tvm.ir.Expr]:
        out = [_zero(src) for _ in src]
        for group_src, group_dst in groups:
            flat = idx[group_dst[0]]
            for axis in group_dst[1:]:
                flat = flat * dst[axis] + idx[axis]
            for axis in reversed(group_src[1:]):
                out[axis] = tirx.floormod(flat, src[axis])
                flat = tirx.floordiv(flat, src[axis])
            out[group_src[0]] = flat
        return out

    return index_map


def broadcast_index(idx: Sequence[tvm.ir.Expr], src: Sequence[tvm.ir.Expr]) -> list[tvm.ir.Expr]:
    """The index into a tensor of shape ``src`` broadcast (numpy rules) to ``len(idx)`` axes."""
    offset = len(idx) - len(src)
    if offset < 0:
        raise Unsupported("a broadcast to a lower rank")
    return [
        _zero(src) if const_int(extent) == 1 else idx[offset + axis]
        for axis, extent in enumerate(src)
    ]


def permuted(inner: Accessor, axes: Sequence[int]) -> Accessor:
    """``permute_dims(x, axes)`` of the tensor ``inner`` reads."""

    def access(idx):
        src_idx = [idx[0]] * len(axes)
        for position, axis in enumerate(axes):
            src_idx[axis] = idx[position]
        return inner(src_idx)

    return access


def shifted(inner: Accessor, axis: int, start: int) -> Accessor:
    """An item of a ``split``: ``inner`` read from ``start`` on along ``axis``."""

    def access(idx):
        idx = list(idx)
        idx[axis] = idx[axis] + start
        return inner(idx)

    return access


def elementwise(name: str, lhs: tvm.ir.Expr, rhs: tvm.ir.Expr) -> tvm.ir.Expr:
    """The element of the score operator ``name`` (``SCORE_OPS``) of two elements."""
    if name == "relax.add":
        return lhs + rhs
    if name == "relax.subtract":
        return lhs - rhs
    if name == "relax.multiply":
        return lhs * rhs
    if name == "relax.divide":
        return lhs / rhs
    if name == "relax.maximum":
        return tirx.max(lhs, rhs)
    return tirx.min(lhs, rhs)


def elements(accessor: Accessor) -> Callable[..., tvm.ir.Expr]:
    """A TE compute body (one argument per axis) from an accessor."""
    return lambda *idx: accessor(idx)


def of_tensor(tensor: te.Tensor) -> Accessor:
    """The elements of a TE tensor (a placeholder or a stage)."""
    return lambda idx: tensor(*idx)


def operand(expr: relax.Expr, access: dict, rank: int) -> Accessor:
    """An argument of an elementwise operator, broadcast to ``rank`` axes."""
    if isinstance(expr, tvm.ir.expr.Constant):
        data = constant_array(expr)
        if data.ndim != 0:
            raise Unsupported("a constant that is not a scalar")
        value = tirx.const(data.item(), str(data.dtype))
        return lambda idx: value
    if expr not in access:
        raise Unsupported("an operand outside the group")
    src, inner = shape_of(expr), access[expr]
    return lambda idx: inner(broadcast_index(idx, src))


def mask_accessor(
    name: str, call: relax.Call, shape: Sequence[tvm.ir.Expr], dtype: str, access: dict
) -> Accessor:
    """The elements of a mask operator's result, as TVM's legalization computes them."""
    args, rank = call.args, len(shape)
    if name in FILL_OPS:
        fill = {"relax.zeros": 0, "relax.ones": 1}.get(name)
        if fill is None:
            if not isinstance(args[1], tvm.ir.expr.Constant):
                raise Unsupported("a fill with a value that is not a constant")
            data = constant_array(args[1])
            if data.ndim != 0:
                raise Unsupported("a fill with a value that is not a constant scalar")
            fill = data.item()
        value = tirx.const(fill, dtype)
        return lambda idx: value
    if name == "relax.arange":
        start, _end, step = (getattr(a, "value", a) for a in args)
        start, step = (tirx.IntImm("int64", x) if isinstance(x, int) else x for x in (start, step))
        if not dtype.startswith("int") or not all(is_integer(x) for x in (start, step)):
            raise Unsupported("an arange that is not of integers")
        return lambda idx: tirx.Cast(dtype, start + step * idx[0])
    if name == "relax.astype":
        inner = operand(args[0], access, rank)
        return lambda idx: tirx.Cast(dtype, inner(idx))
    if name == "relax.where":
        if str(args[0].ty.dtype) != "bool":
            raise Unsupported("a where whose condition is not bool")
        cond, then, other = (operand(a, access, rank) for a in args)
        return lambda idx: tirx.Select(cond(idx), then(idx), other(idx))
    if name in COMPARISONS:
        lhs, rhs, compare = (*(operand(a, access, rank) for a in args), COMPARISONS[name])
        return lambda idx: compare(lhs(idx), rhs(idx))
    if name in LOGICAL_OPS:
        if any(str(a.ty.dtype) != "bool" for a in args):
            raise Unsupported(f"{name} of tensors that are not bool")
        operands = [operand(a, access, rank) for a in args]
        if name == "relax.logical_not":
            return lambda idx: tirx.Not(operands[0](idx))
        combine = tirx.And if name.endswith("_and") else tirx.Or
        return lambda idx: combine(operands[0](idx), operands[1](idx))
    return _index_tensor(args, access)


def _index_tensor(args: Sequence[relax.Expr], access: dict) -> Accessor:
    """``index_tensor(data, (i0, ..., ik))`` as ``topi.adv_index`` computes it: the indices
    broadcast to one shape, read as they are (no wrap of negative ones)."""
    data, indices = args
    if not isinstance(indices, relax.Tuple) or data not in access:
        raise Unsupported("an index_tensor of tensors outside the group")
    index_shapes = [shape_of(i) for i in indices.fields]
    if any(i not in access for i in indices.fields):
        raise Unsupported("an index_tensor of tensors outside the group")
    width = max(len(shape) for shape in index_shapes)
    inner, readers = access[data], [access[i] for i in indices.fields]

    def element(idx):
        front = [
            read(broadcast_index(idx[:width], shape)) for read, shape in zip(readers, index_shapes)
        ]
        return inner([*front, *idx[width:]])

    return element

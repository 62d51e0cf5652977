"""What the symbolic layer reads of Relax IR: element sizes, types and their dims, bindings,
the declared ranges of the dims; and sizes as the int64 TIR expressions shapes hold.

Each reader answers ``None`` (or nothing) where the IR does not say (an unparsable dtype, a
non-normalized expression, a tensor of unknown shape), so that the shape graph learns less,
never something wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..contract import LOWER_BOUND_ATTR, UPPER_BOUND_ATTR


def element_bits(dtype: str | None) -> int | None:
    """Storage bits per element of ``dtype`` (``bits * lanes``); None if unknown.

    ``bool`` is stored in one byte per element: the Relax VM allocates 80 bytes for a
    ``(16, 5)`` bool tensor (checked by wrapping ``vm.builtin.alloc_storage``), as for ``int8``.
    Sub-byte types (``int4``, ``float4_e2m1fn``...) report their packed width; the Relax VM
    memory planner rejects them, and a runtime tensor of them takes the packed size rounded up
    to whole bytes.
    """
    import tvm

    if dtype is None or dtype in ("", "void", "None", "handle"):
        return None
    try:
        dt = tvm.DataType(dtype)
    except Exception:  # an unparsable dtype: unknown size rather than a crash
        return None
    if dtype.startswith("bool"):
        return 8 * int(dt.lanes)
    bits = int(dt.bits) * int(dt.lanes)
    return bits if bits > 0 else None


def element_bytes(dtype: str | None) -> int | None:
    """Bytes per element of a byte-sized ``dtype`` (``bool``: 1); None if unknown or sub-byte."""
    bits = element_bits(dtype)
    return None if bits is None or bits % 8 else bits // 8


def as_int64(value: Any) -> Any:
    """An ``int`` or a TIR integer expression as an int64 ``PrimExpr``: a constant, the
    expression itself, or a cast (folded for a constant), as Relax shapes hold sizes."""
    import tvm

    if isinstance(value, int):
        return tvm.tirx.const(value, "int64")
    dtype = str(getattr(getattr(value, "ty", None), "dtype", "int64"))
    return value if dtype == "int64" else value.astype("int64")


def type_of(node: Any) -> Any:
    """The type of a Relax expression (``None`` where it has none yet)."""
    try:
        return node.ty
    except Exception:  # a non-normalized expression has no type yet
        return None


def shape_values(ty: Any, nested: bool = False) -> list[Any] | None:
    """PrimExpr dims of a tensor / shape type (None if unknown); with ``nested``, all dims
    found inside tuples too (for collection)."""
    from tvm import relax

    if ty is None:
        return [] if nested else None
    if isinstance(ty, relax.TupleType):
        if not nested:
            return None
        out: list[Any] = []
        for f in ty.fields:
            out.extend(shape_values(f, nested=True) or [])
        return out
    if isinstance(ty, relax.TensorType):
        shape = ty.shape
        if shape is None:
            return [] if nested else None
        if isinstance(shape, relax.ShapeExpr):
            return list(shape.values)
        shape_ty = type_of(shape)
        if isinstance(shape_ty, relax.ShapeType) and shape_ty.values is not None:
            return list(shape_ty.values)
        return [] if nested else None
    if isinstance(ty, relax.ShapeType):
        if ty.values is None:
            return [] if nested else None
        return list(ty.values)
    return [] if nested else None


def bindings_in_order(expr: Any, in_branch: bool) -> Iterable[tuple[Any, bool]]:
    """Bindings in program order, each with whether it sits inside an If branch."""
    from tvm import relax

    if isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            for b in block.bindings:
                yield b, in_branch
                if isinstance(b.value, (relax.If, relax.SeqExpr)):
                    yield from bindings_in_order(b.value, in_branch)
    elif isinstance(expr, relax.If):
        yield from bindings_in_order(expr.true_branch, True)
        yield from bindings_in_order(expr.false_branch, True)


def read_bound_attrs(func: Any) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """The declared ranges of a function's dims: lower bounds, upper bounds (by dim name) and
    the dims declared non-negative (``tir_non_negative_var``)."""
    attrs = func.attrs
    lower: dict[str, int] = {}
    upper: dict[str, int] = {}
    nonneg: set[str] = set()
    if attrs is None:
        return lower, upper, nonneg
    if LOWER_BOUND_ATTR in attrs:
        lower = {str(k): int(v) for k, v in attrs[LOWER_BOUND_ATTR].items()}
    if UPPER_BOUND_ATTR in attrs:
        upper = {str(k): int(v) for k, v in attrs[UPPER_BOUND_ATTR].items()}
    if "tir_non_negative_var" in attrs:
        nonneg = {str(getattr(v, "name", v)) for v in attrs["tir_non_negative_var"]}
    return lower, upper, nonneg

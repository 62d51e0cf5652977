"""Reading TIR nodes generically: their type key and their fields.

TVM 0.27 has no TIR visitor in Python; the walks over PrimFunc bodies (which parameters a
kernel stores to, how a kernel reads its buffers) step through each node's reflected fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

__all__ = ["blocks", "code_fields", "field_names", "is_buffer", "occurrences", "type_key"]

_FIELD_CACHE: dict[type, tuple[str, ...]] = {}
_CODE_FIELD_CACHE: dict[type, tuple[str, ...]] = {}
# Fields that hold no code: source positions and type annotations.
_NOT_CODE = frozenset({"span", "ty"})


def type_key(node: Any) -> str:
    """The FFI type key of ``node`` (``"tirx.BufferStore"``), ``""`` for non-objects."""
    info = getattr(type(node), "__tvm_ffi_type_info__", None)
    return info.type_key if info is not None else ""


def field_names(node: Any) -> tuple[str, ...]:
    """The reflected fields of ``node``'s class, base classes first (cached per class)."""
    cls = type(node)
    cached = _FIELD_CACHE.get(cls)
    if cached is not None:
        return cached
    names: list[str] = []
    info = getattr(cls, "__tvm_ffi_type_info__", None)
    while info is not None:
        names = [f.name for f in info.fields] + names
        info = info.parent_type_info
    result = tuple(names)
    _FIELD_CACHE[cls] = result
    return result


def code_fields(node: Any) -> tuple[str, ...]:
    """The reflected fields of ``node``'s class that hold code: all but its source position
    and its type annotation (cached per class)."""
    cls = type(node)
    cached = _CODE_FIELD_CACHE.get(cls)
    if cached is None:
        cached = _CODE_FIELD_CACHE[cls] = tuple(
            name for name in field_names(node) if name not in _NOT_CODE
        )
    return cached


def occurrences(node: Any, matches: Callable[[Any], bool]) -> int:
    """How many nodes under ``node`` (itself included) ``matches`` accepts, a subexpression
    shared by several parents counted once per parent: the program as written, which is what
    TVM's passes and its printer walk. Each distinct node is read once, so the walk is linear
    in the graph's size even where the count is exponential in it."""
    counted: dict[int, int] = {}

    def count(current: Any) -> int:
        if isinstance(current, list | tuple | tvm_ffi.Array):
            return sum(count(item) for item in current)
        if not isinstance(current, tvm_ffi.Object) or isinstance(current, tirx.Buffer):
            return 0
        handle = current.__chandle__()
        if handle not in counted:
            own = int(bool(matches(current)))
            counted[handle] = own + sum(
                count(getattr(current, name)) for name in code_fields(current)
            )
        return counted[handle]

    return count(node)


def blocks(func: tirx.PrimFunc) -> list[tvm.s_tir.SBlock]:
    """The blocks of ``func`` but its root, in program order (``tvm_ffi.structural_map`` walks
    the tree, each node returned unchanged)."""
    found: list[tvm.s_tir.SBlock] = []

    def block(node: tvm.s_tir.SBlock) -> tvm.s_tir.SBlock:
        if node.name_hint != "root":
            found.append(node)
        return node

    tvm_ffi.structural_map(func.body, [(tvm.s_tir.SBlock, block)])
    return found


def is_buffer(param: Any) -> bool:
    """Whether a PrimFunc parameter is a buffer (not a scalar)."""
    return isinstance(getattr(param, "ty", None), tirx.BufferType)

"""In-place reuse: may a kernel write its output into the memory of a dying input?

Which input a kernel may overwrite with its output: the fact PlanMemory's in-place placements
and MemoryAwareSchedule's cost model (which orders let an output take a dying input's storage)
both read, from the kernel's TIR.

The question answered here: may a kernel write its output buffer ``Y`` into the memory of its
input buffer(s) ``X`` (both starting at offset 0) and still compute what it computes with
disjoint buffers? The answer is read from the TIR itself, not from an operator list, so fused
kernels of any composition are covered.

Why the rule is about data flow, not about statement order:
Kernels are compiled under the promise that their buffers never alias (``tirx.noalias``; the
host/device split re-asserts it for every compute function, whatever the PrimFunc says). A code
generator may therefore move a load of ``X`` past any store to ``Y`` unless the stored value
depends on the loaded one; it may, for instance, forward a copy ``T = reshape(X)`` so that a later
stage reads ``X`` directly, after earlier elements of ``Y`` were written. "Every read of ``X``
comes before the stage that writes ``Y``" is therefore *not* enough. What is enough:

    every value read from ``X`` flows, through the kernel's intermediate buffers, only into the
    element of ``Y`` at the same flat position (and into nothing else the kernel writes).

Then each load of ``X[p]`` is a data-dependence ancestor of the store to ``Y[p]``, the only store
that can overwrite it, and no legal reordering can put the store first.

The analysis marks every buffer of the kernel as independent of ``X``, *aligned* (element ``q``
depends on ``X`` only at flat position ``q``) or *misaligned*, block by block in program order:
a block that reads ``X``-dependent data writes aligned data when it has only spatial iterators,
every ``X``-dependent load is at the flat offset of the block's store (proven with the
arithmetic analyzer over the block's iteration domain), and no such load feeds an index. The
kernel qualifies when ``Y`` is aligned, no other written parameter depends on ``X``, ``X`` is
never written, ``Y`` is never read, ``X`` and ``Y`` have the same element size, and nothing
reaches memory through pointers (``address_of``, ``buffer.data``, ``match_buffer`` views).
``exp``, ``add``, casts of equal width, ``reshape``-then-elementwise chains and fused elementwise
kernels qualify; matmuls, reductions, transposes, splits and softmax do not.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx

from ..contract import SOFTMAX_KERNEL_ATTR
from ..symbolic.relax_ir import as_int64
from .tir_fields import code_fields, is_buffer, type_key

__all__ = ["InplaceVerdict", "inplace_inputs", "inplace_verdict"]

# Iterator type of a spatial (data-parallel) block iterator.
_DATA_PAR = 0
_POINTER_OPS = frozenset(
    {"tirx.address_of", "tirx.tvm_access_ptr", "tirx.ptr_byte_offset", "tirx.buffer_data"}
)
_NONE, _ALIGNED, _MISALIGNED = 0, 1, 2


@dataclass(frozen=True)
class InplaceVerdict:
    """Whether an output may share memory with some inputs, and why (for reports and tests)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class _Access:
    kind: str  # "load", "store" or "opaque"
    var: Any  # the buffer var accessed
    indices: tuple = ()
    in_index: bool = False  # the load sits inside another access's index


@dataclass
class _TirBlock:
    block: Any
    accesses: list[_Access] = field(default_factory=list)


class _AccessCollector:
    """Collects, per block in program order, the accesses to a set of buffers."""

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers = buffers
        self.blocks: list[_TirBlock] = []
        self.outside: list[_Access] = []  # accesses not in any non-root block

    def _record(self, current: _TirBlock | None, access: _Access) -> None:
        (current.accesses if current is not None else self.outside).append(access)

    def visit(self, node: Any, current: _TirBlock | None, in_index: bool = False) -> None:
        if node is None or isinstance(node, (int, float, str, bool)):
            return
        if isinstance(node, (list, tuple)) or type_key(node) in ("ffi.Array", "ffi.List"):
            for item in node:
                self.visit(item, current, in_index)
            return
        if type_key(node) in ("ffi.Map", "ffi.Dict"):
            for value in node.values():
                self.visit(value, current, in_index)
            return
        if not isinstance(node, tvm.runtime.Object):
            return
        key = type_key(node)
        if key == "s_tir.SBlock":
            self._visit_block(node)
            return
        if key == "tirx.BufferStore":
            if _find(node.buffer, self.buffers) is not None:
                self._record(current, _Access("store", node.buffer, tuple(node.indices)))
            self.visit(node.indices, current, True)
            self.visit(node.value, current, in_index)
            return
        if key in ("ir.TensorLoad", "tirx.BufferLoad"):
            source = node.source if key == "ir.TensorLoad" else node.buffer
            if _find(source, self.buffers) is not None:
                self._record(current, _Access("load", source, tuple(node.indices), in_index))
            self.visit(node.indices, current, True)
            return
        if key == "ir.Call" and str(getattr(node.op, "name", "")) in _POINTER_OPS:
            for var in _vars_in(node, self.buffers):
                self._record(current, _Access("opaque", var))
            return
        if _find(node, self.buffers) is not None:
            # A buffer used as a plain value (e.g. its data pointer handed to a call).
            self._record(current, _Access("opaque", node))
            return
        for name in code_fields(node):
            self.visit(getattr(node, name), current, in_index)

    def _visit_block(self, blk: Any) -> None:
        entry = _TirBlock(blk)
        for match in blk.match_buffers:
            for var in _vars_in(match, self.buffers):
                entry.accesses.append(_Access("opaque", var))
        # Register the block before its children so that program order is kept for nesting.
        self.blocks.append(entry)
        # reads/writes annotations only summarise the body; the body is what is checked.
        if blk.init is not None:
            self.visit(blk.init, entry)
        self.visit(blk.body, entry)


def _is_row_softmax(func: tirx.PrimFunc, input_params: tuple[int, ...], output_param: int) -> bool:
    """Whether ``func`` is a softmax kernel that ``VectorizeSoftmax`` wrote (its attribute,
    :data:`~blade_relax.contract.SOFTMAX_KERNEL_ATTR`) asked to write its output over its input.

    The data-flow check below refuses any reduction (an output element depends on its whole
    row), but that kernel may run in place: per row it reads the input for the maximum, then
    writes ``exp(x[j] - max)`` at ``j`` right after reading ``x[j]``, and reads only the output
    after that (the sum, then the division). A row is never read after any of it is written.
    (Its log-softmax reads the input again at the end and carries no attribute.)"""
    attrs = func.attrs
    if attrs is None or SOFTMAX_KERNEL_ATTR not in attrs or len(func.params) != 2:
        return False
    return input_params == (0,) and output_param == 1


@functools.lru_cache(maxsize=4096)
def _verdict(
    func: tirx.PrimFunc, input_params: tuple[int, ...], output_param: int
) -> InplaceVerdict:
    """The verdict of :func:`inplace_verdict`, remembered per kernel object and positions (as
    :func:`reshape_pattern` is: the cache holds the kernels it remembers)."""
    params = list(func.params)
    if any(p < 0 or p >= len(params) for p in [*input_params, output_param]):
        return InplaceVerdict(False, "argument position outside the kernel's parameters")
    if output_param in input_params or not input_params:
        return InplaceVerdict(False, "no input distinct from the output")
    out_var = params[output_param]
    in_vars = [params[i] for i in input_params]
    for var in [out_var, *in_vars]:
        if not _is_dense(var):
            return InplaceVerdict(False, f"parameter {var.name} is not a dense buffer")
    out_bits = tvm.runtime.DataType(str(out_var.ty.dtype)).bits
    if any(tvm.runtime.DataType(str(v.ty.dtype)).bits != out_bits for v in in_vars):
        return InplaceVerdict(False, "input and output element sizes differ")

    if _is_row_softmax(func, input_params, output_param):
        return InplaceVerdict(
            True, "a softmax kernel of VectorizeSoftmax reads each row before writing it"
        )
    buffers = [p for p in params if is_buffer(p)]
    buffers += _alloc_buffers(func.body)
    collector = _AccessCollector(buffers)
    body = func.body
    if type_key(body) == "s_tir.SBlockRealize" and not body.block.iter_vars:
        # The root block: its allocations are intermediates, its body the kernel.
        collector.visit(body.block.body, None)
    else:
        collector.visit(body, None)
    every = collector.outside + [a for b in collector.blocks for a in b.accesses]
    if any(a.kind == "opaque" for a in every):
        return InplaceVerdict(False, "a buffer is accessed through a pointer or sub-view")
    if collector.outside:
        return InplaceVerdict(False, "buffers are accessed outside blocks")
    if any(a.kind == "store" and _find(a.var, in_vars) is not None for a in every):
        return InplaceVerdict(False, "the kernel writes an input")
    if any(a.kind == "load" and a.var.same_as(out_var) for a in every):
        return InplaceVerdict(False, "the kernel reads its output back")

    state = {id(v): _ALIGNED for v in in_vars}
    written_params = set()
    # Two rounds reach the fixed point when a buffer is read before a later block writes it.
    for _ in range(2):
        for entry in collector.blocks:
            _propagate(entry, state, buffers)
    for entry in collector.blocks:
        for access in entry.accesses:
            if access.kind == "store":
                written_params.add(id(_canon(access.var, params)))
    if state.get(id(out_var), _NONE) == _MISALIGNED:
        return InplaceVerdict(False, "an output element depends on other input elements")
    for param in params:
        if param.same_as(out_var) or id(param) not in written_params:
            continue
        if state.get(id(param), _NONE) != _NONE:
            return InplaceVerdict(False, f"output {param.name} also depends on the input")
    if state.get(id(out_var), _NONE) == _NONE:
        return InplaceVerdict(True, "the output does not depend on the input")
    return InplaceVerdict(
        True, "each output element depends only on the input element it overwrites"
    )


def inplace_verdict(
    func: tirx.PrimFunc, input_params: Sequence[int], output_param: int
) -> InplaceVerdict:
    """Decide whether ``func`` may write parameter ``output_param`` over ``input_params``.

    Parameters
    ----------
    func
        The kernel, as found in the IRModule (after ``FuseTIR``; possibly scheduled).
    input_params
        Positions of the parameters that alias the memory to be overwritten (an argument passed
        twice appears twice).
    output_param
        Position of the output parameter that would be placed in that memory.

    Returns
    -------
    InplaceVerdict
        ``ok`` only when the data-flow condition above is proven. Cached per kernel object.
    """
    return _verdict(func, tuple(int(p) for p in input_params), int(output_param))


def inplace_inputs(
    func: tirx.PrimFunc, args: Sequence[relax.Expr], output_param: int
) -> tuple[tuple[relax.Var, tuple[int, ...]], ...]:
    """The arguments of a kernel call whose memory its output ``output_param`` may take.

    Each variable among ``args`` (the kernel's arguments before its outputs, in the order of
    their first position) whose positions pass :func:`inplace_verdict`, with those positions.
    Whether the variable dies at the call and whether its storage is large enough is the
    caller's question (it depends on the order and on the planner).
    """
    positions: dict[relax.Var, list[int]] = {}
    for k, arg in enumerate(args):
        if isinstance(arg, relax.Var) and isinstance(arg.ty, relax.TensorType):
            positions.setdefault(arg, []).append(k)
    return tuple(
        (var, tuple(ks)) for var, ks in positions.items() if inplace_verdict(func, ks, output_param)
    )


def _propagate(entry: _TirBlock, state: dict[int, int], buffers: list[Any]) -> None:
    """Update the dependence state of the buffers ``entry`` writes."""
    stores = [a for a in entry.accesses if a.kind == "store"]
    if not stores:
        return
    dependent = [
        a for a in entry.accesses if a.kind == "load" and state.get(id(_canon(a.var, buffers)), 0)
    ]
    if not dependent:
        return
    result = _ALIGNED
    blk = entry.block
    if any(int(iv.iter_type) != _DATA_PAR for iv in blk.iter_vars) or blk.init is not None:
        result = _MISALIGNED
    elif (
        any(a.in_index for a in dependent) or len({id(_canon(s.var, buffers)) for s in stores}) > 1
    ):
        result = _MISALIGNED
    elif any(state.get(id(_canon(a.var, buffers))) == _MISALIGNED for a in dependent):
        result = _MISALIGNED
    else:
        analyzer = _analyzer_for(blk)
        for store in stores:
            target = _flat(store.indices, store.var.ty.shape)
            for load in dependent:
                offset = _flat(load.indices, load.var.ty.shape)
                if not _prove_equal(analyzer, offset, target):
                    result = _MISALIGNED
                    break
            if result == _MISALIGNED:
                break
    for store in stores:
        key = id(_canon(store.var, buffers))
        state[key] = max(state.get(key, _NONE), result)


def _analyzer_for(blk: Any) -> Any:
    analyzer = tvm.sym.Analyzer()
    for iv in blk.iter_vars:
        dom = iv.dom
        for var in _free_prim_vars(dom.extent, blk.name_hint):
            # Shape dims are at least 1 (an empty tensor has no element to overwrite).
            analyzer.bind(var, tvm.ir.Range(1, 1 << 40))
        analyzer.bind(iv.var, dom)
    return analyzer


def _flat(indices: Sequence[Any], shape: Sequence[Any]) -> Any:
    if not indices:
        return tirx.IntImm("int64", 0)
    offset = as_int64(indices[0])
    for index, extent in zip(indices[1:], list(shape)[1:]):
        offset = offset * as_int64(extent) + as_int64(index)
    return offset


def _prove_equal(analyzer: Any, a: Any, b: Any) -> bool:
    a = analyzer.simplify(_tighten(analyzer, a))
    b = analyzer.simplify(_tighten(analyzer, b))
    return bool(analyzer.can_prove_equal(a, b))


def _tighten(analyzer: Any, e: Any) -> Any:
    """Drop ``floormod``/``floordiv`` whose operand provably lies in ``[0, divisor)``.

    Legalized reshapes index with ``(i // c + j) % n``; the analyzer does not use the bound
    ``j < n`` of a symbolic ``n`` by itself.
    """
    key = type_key(e)
    if key in ("prim.FloorMod", "ir.FloorMod", "tirx.FloorMod"):
        a, m = _tighten(analyzer, e.a), _tighten(analyzer, e.b)
        if _in_range(analyzer, a, m):
            return a
        return tirx.floormod(a, m)
    if key in ("prim.FloorDiv", "ir.FloorDiv", "tirx.FloorDiv"):
        a, m = _tighten(analyzer, e.a), _tighten(analyzer, e.b)
        if _in_range(analyzer, a, m):
            return tirx.IntImm(_dtype(e), 0)
        return tirx.floordiv(a, m)
    if key in ("prim.Add", "ir.Add", "tirx.Add"):
        return _tighten(analyzer, e.a) + _tighten(analyzer, e.b)
    if key in ("prim.Sub", "ir.Sub", "tirx.Sub"):
        return _tighten(analyzer, e.a) - _tighten(analyzer, e.b)
    if key in ("prim.Mul", "ir.Mul", "tirx.Mul"):
        return _tighten(analyzer, e.a) * _tighten(analyzer, e.b)
    return e


def _in_range(analyzer: Any, a: Any, m: Any) -> bool:
    if not analyzer.can_prove(a >= 0):
        return False
    if analyzer.can_prove(a < m):
        return True
    # floordiv(x, c) < m  <=  x < m * c for a positive constant c.
    if type_key(a) in ("prim.FloorDiv", "ir.FloorDiv", "tirx.FloorDiv") and isinstance(
        a.b, tirx.IntImm
    ):
        c = int(a.b.value)
        return c > 0 and bool(analyzer.can_prove(a.a < m * c))
    return False


# ---------------------------------------------------------------------- helpers
def _alloc_buffers(body: Any) -> list[Any]:
    found: list[Any] = []

    def walk(node: Any) -> None:
        if node is None or isinstance(node, (int, float, str, bool)):
            return
        if isinstance(node, (list, tuple)) or type_key(node) in ("ffi.Array", "ffi.List"):
            for item in node:
                walk(item)
            return
        if not isinstance(node, tvm.runtime.Object):
            return
        key = type_key(node)
        if key == "s_tir.SBlock":
            found.extend(node.alloc_buffers)
        if key in ("tirx.AllocBuffer", "tirx.DeclBuffer") and hasattr(node, "buffer"):
            found.append(node.buffer)
        if key.startswith(("ir.", "prim.")) and key != "ir.Range":
            return  # expressions hold no allocations
        for name in code_fields(node):
            walk(getattr(node, name))

    walk(body)
    return [b for b in found if isinstance(getattr(b, "ty", None), tirx.BufferType)]


def _is_dense(var: Any) -> bool:
    ty = getattr(var, "ty", None)
    if not isinstance(ty, tirx.BufferType) or len(ty.strides) != 0:
        return False
    offset = ty.elem_offset
    return isinstance(offset, tirx.IntImm) and int(offset.value) == 0


def _find(node: Any, candidates: Sequence[Any]) -> Any:
    if not isinstance(node, tvm.runtime.Object):
        return None
    for c in candidates:
        if node.same_as(c):
            return c
    return None


def _canon(var: Any, buffers: Sequence[Any]) -> Any:
    found = _find(var, buffers)
    return var if found is None else found


def _vars_in(node: Any, targets: Sequence[Any]) -> list[Any]:
    found: list[Any] = []

    def walk(n: Any) -> None:
        if n is None or isinstance(n, (int, float, str, bool)):
            return
        if isinstance(n, (list, tuple)) or type_key(n) in ("ffi.Array", "ffi.List"):
            for item in n:
                walk(item)
            return
        if not isinstance(n, tvm.runtime.Object):
            return
        hit = _find(n, targets)
        if hit is not None:
            found.append(hit)
            return
        for name in code_fields(n):
            walk(getattr(n, name))

    walk(node)
    return found


def _free_prim_vars(e: Any, block: str) -> list[Any]:
    if isinstance(e, tirx.IntImm):
        return []
    try:
        return list(tirx.analysis.undefined_vars(e))
    except (RuntimeError, TypeError) as err:  # not a PrimExpr (TVM's InternalError): no bounds
        warnings.warn(
            f"in-place analysis: the extents of block {block} are read without bounds: "
            f"{type(err).__name__}: {err}",
            stacklevel=2,
        )
        return []


def _dtype(e: Any) -> str:
    return str(getattr(getattr(e, "ty", None), "dtype", "int64"))

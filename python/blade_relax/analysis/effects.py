"""What one Relax binding does to memory: the op table every memory model reads.

Every model of memory in blade_relax (the symbolic timeline of :mod:`.timeline`, the block
model ``MemoryAwareSchedule`` scores orders with, the allocations ``PlanMemory`` shares, the
function model and storage walk of ``Rematerialize``) starts from the same question about each
binding: does it allocate, alias an earlier value, carve a tensor out of a storage, drop a
register, call a kernel that writes into its arguments, hand a tensor to the remat runtime, or
do something no model understands? :func:`classify` answers it once, as an
:class:`Instruction`; the models differ only in what they do with the answer (simulate
liveness, pool buffers, prove sharing, follow calls), never in which operator means what.

:func:`binding_effect` turns an instruction into its symbolic :class:`ValueEffect` (bytes
allocated, variables aliased, kept and taken), the description the timeline simulates; packed
functions and operators this table does not know are taught with
:func:`register_timeline_rule`.

The operator sets (:data:`VIEW_OPS`, :data:`VIEW_PACKED`, ...) are defined here only.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx

from ..contract import EVICT, REGENERATE, REMAT_BEGIN, SOFTMAX_KERNEL_ATTR
from ..symbolic import ShapeGraph, SymbolicExpr
from .liveness import BindingInfo
from .tir_fields import field_names, type_key
from .workspace import call_workspace

__all__ = [
    "KILLS",
    "PACKED_CALL_OPS",
    "SHAPE_ONLY_OPS",
    "STORAGE_ALLOCS",
    "TENSOR_ALLOCS",
    "TENSOR_IN_STORAGE",
    "VIEW_OPS",
    "VIEW_PACKED",
    "InPlaceWrites",
    "InplaceVerdict",
    "Instruction",
    "Kind",
    "ValueEffect",
    "binding_effect",
    "call_name",
    "callee_name",
    "classify",
    "in_place_writes",
    "inplace_inputs",
    "inplace_verdict",
    "kernel_written_params",
    "register_timeline_rule",
    "reshape_pattern",
    "written_operands",
]

#: Operators whose result shares its (first) argument's memory.
VIEW_OPS = frozenset(
    {
        "relax.reshape",
        "relax.memory.view",
        "relax.memory.ensure_zero_offset",
    }
)
#: Packed functions whose result shares its first argument's memory.
VIEW_PACKED = frozenset({"vm.builtin.reshape", "vm.builtin.tensor_view"})
#: Operators that allocate a storage (planned memory).
STORAGE_ALLOCS = frozenset({"relax.memory.alloc_storage", "relax.vm.alloc_storage"})
#: Operators that place a tensor in a storage (the tensor keeps the storage alive).
TENSOR_IN_STORAGE = frozenset({"relax.memory.alloc_tensor", "relax.vm.alloc_tensor"})
#: Operators that allocate a tensor of its own (before memory planning).
TENSOR_ALLOCS = frozenset({"relax.builtin.alloc_tensor"})
#: Operators that drop a register.
KILLS = frozenset({"relax.memory.kill_storage", "relax.memory.kill_tensor", "relax.vm.kill_object"})
#: Operators whose first argument names the packed function they call.
PACKED_CALL_OPS = frozenset(
    {
        "relax.call_pure_packed",
        "relax.call_builtin_with_ctx",
        "relax.call_inplace_packed",
        "relax.call_packed",
    }
)
#: Operators that read only the shape or type of their argument.
SHAPE_ONLY_OPS = frozenset({"relax.shape_of", "relax.tensor_to_shape"})
#: The lowered form of a kernel call with symbolic shape arguments.
CALL_TIR_DYN = "relax.vm.call_tir_dyn"
#: Kernel calls that allocate their result (before ``CallTIRRewrite``).
_DPS_CALLS = frozenset({"relax.call_tir", "relax.call_dps_packed"})


class Kind(enum.Enum):
    """What a binding is, as far as memory goes."""

    ALIAS = "alias"  # y = x, match_cast(x)
    TUPLE = "tuple"
    ITEM = "item"  # tuple item
    VIEW = "view"  # result shares its first argument's memory
    TENSOR_ALLOC = "tensor_alloc"  # builtin.alloc_tensor: a tensor with its own memory
    STORAGE_ALLOC = "storage_alloc"
    TENSOR_IN_STORAGE = "tensor_in_storage"
    KILL = "kill"
    KERNEL = "kernel"  # a PrimFunc writing into its arguments (destination passing)
    CALL_TIR = "call_tir"  # call_tir / call_dps_packed: a kernel allocating its result
    INPLACE = "inplace"  # call_tir_inplace / call_inplace_packed: args are the tensor args
    EVICT = "evict"
    REGENERATE = "regenerate"
    REMAT_BEGIN = "remat_begin"
    RELAX_CALL = "relax_call"  # a call of a Relax function (or of an unknown GlobalVar)
    SHAPE_ONLY = "shape_only"
    PACKED = "packed"  # another packed function
    OPERATOR = "operator"  # another Relax operator
    IF = "if"
    FUNCTION = "function"  # a nested function (closure)
    LEAF = "leaf"  # constants, shapes, prim values, strings: nothing the VM allocates


@dataclass(frozen=True)
class Instruction:
    """One binding's value, classified (see :func:`classify`).

    Attributes
    ----------
    kind
        What it is.
    name
        The operator's name or the packed function's symbol (``None`` for a direct call of a
        ``GlobalVar`` and for non-calls).
    args
        The data arguments: for a packed call the arguments after the function (the tuple of
        ``call_builtin_with_ctx`` unpacked); for a kernel call the kernel's arguments; for an
        alias, item or view the value read first.
    callee
        The ``GlobalVar`` called (kernels, Relax calls), else ``None``.
    """

    kind: Kind
    name: str | None = None
    args: tuple[relax.Expr, ...] = ()
    callee: tvm.ir.GlobalVar | None = None

    @property
    def source(self) -> relax.Expr | None:
        """The value whose memory an alias, item, view or tensor-in-storage refers to."""
        return self.args[0] if self.args else None


def callee_name(call: relax.Call) -> tuple[str | None, list[relax.Expr]]:
    """The operator or packed-function name of a call and its arguments after the name."""
    op = call.op
    args = list(call.args)
    if (
        isinstance(op, tvm.ir.Op)
        and op.name in PACKED_CALL_OPS
        and args
        and isinstance(args[0], relax.ExternFunc)
    ):
        return args[0].global_symbol, args[1:]
    return call_name(call), args


def call_name(call: relax.Call) -> str | None:
    """The operator or packed-function name of a call (:func:`callee_name` without reading
    the arguments, each of which is an FFI read)."""
    op = call.op
    if isinstance(op, tvm.ir.Op):
        name = op.name
        if name in PACKED_CALL_OPS:
            args = call.args
            if len(args) and isinstance(args[0], relax.ExternFunc):
                return args[0].global_symbol
        return name
    if isinstance(op, relax.ExternFunc):
        return op.global_symbol
    return None


def _data_args(call: relax.Call) -> list[relax.Expr]:
    """The data arguments of a call, unpacking ``call_builtin_with_ctx``'s tuple."""
    _, args = callee_name(call)
    if (
        isinstance(call.op, tvm.ir.Op)
        and call.op.name == "relax.call_builtin_with_ctx"
        and len(args) == 1
        and isinstance(args[0], relax.Tuple)
    ):
        return list(args[0].fields)
    return args


def classify(binding: relax.Binding | relax.Expr, mod: tvm.IRModule | None = None) -> Instruction:
    """What ``binding`` (or a bound value) does, as far as memory goes.

    Parameters
    ----------
    binding
        A binding, or the value of one.
    mod
        The module, to tell a call of a PrimFunc (:attr:`Kind.KERNEL`) from a call of a Relax
        function (:attr:`Kind.RELAX_CALL`); without it every ``GlobalVar`` call is the latter.
    """
    value = binding.value if isinstance(binding, relax.Binding) else binding
    if isinstance(binding, relax.MatchCast) or isinstance(value, relax.Var):
        return Instruction(Kind.ALIAS, args=(value,))
    if isinstance(value, relax.Tuple):
        return Instruction(Kind.TUPLE, args=tuple(value.fields))
    if isinstance(value, relax.TupleGetItem):
        return Instruction(Kind.ITEM, args=(value.tuple_value,))
    if isinstance(value, relax.If):
        return Instruction(Kind.IF)
    if isinstance(value, relax.Function):
        return Instruction(Kind.FUNCTION)
    if not isinstance(value, relax.Call):
        return Instruction(Kind.LEAF)
    return _classify_call(value, mod)


def _classify_call(call: relax.Call, mod: tvm.IRModule | None) -> Instruction:
    op = call.op
    if isinstance(op, relax.GlobalVar):
        callee = mod[op] if mod is not None and op in mod.functions else None
        kind = Kind.KERNEL if isinstance(callee, tvm.tirx.PrimFunc) else Kind.RELAX_CALL
        return Instruction(kind, args=tuple(call.args), callee=op)
    # Any other call's class depends on the call node alone. The passes classify the same
    # nodes over and over (each trial order of a block, each analysis of a binding), and
    # reading a call's fields goes through the FFI: remember the class per node. The entry
    # holds the node, so its handle, the key, is not reused while it is remembered.
    key = hash(call)
    entry = _CLASSIFIED.get(key)
    if entry is not None and entry[0].same_as(call):
        return entry[1]
    inst = _classify_op_call(call, op)
    if len(_CLASSIFIED) >= _CLASSIFIED_LIMIT:
        _CLASSIFIED.clear()
    _CLASSIFIED[key] = (call, inst)
    return inst


_CLASSIFIED: dict[int, tuple[relax.Call, Instruction]] = {}
_CLASSIFIED_LIMIT = 1 << 16


def _classify_op_call(call: relax.Call, op: Any) -> Instruction:
    """:func:`_classify_call` of a call whose callee is not a ``GlobalVar``."""
    name = call_name(call)
    args = tuple(_data_args(call))
    by_name = {
        EVICT: Kind.EVICT,
        REGENERATE: Kind.REGENERATE,
        REMAT_BEGIN: Kind.REMAT_BEGIN,
    }
    if name in by_name:
        return Instruction(by_name[name], name, args)
    if name in KILLS:
        return Instruction(Kind.KILL, name, args)
    if name in STORAGE_ALLOCS:
        return Instruction(Kind.STORAGE_ALLOC, name, args)
    if name in TENSOR_IN_STORAGE:
        return Instruction(Kind.TENSOR_IN_STORAGE, name, args)
    if name in TENSOR_ALLOCS:
        return Instruction(Kind.TENSOR_ALLOC, name, args)
    if name in VIEW_OPS or name in VIEW_PACKED:
        return Instruction(Kind.VIEW, name, args)
    if name in SHAPE_ONLY_OPS:
        return Instruction(Kind.SHAPE_ONLY, name, args)
    if isinstance(op, tvm.ir.Op) and op.name == "relax.call_tir_inplace":
        packed = call.args[1]
        fields = packed.fields if isinstance(packed, relax.Tuple) else [packed]
        return Instruction(Kind.INPLACE, op.name, tuple(fields), callee=call.args[0])
    if isinstance(op, tvm.ir.Op) and op.name == "relax.call_inplace_packed":
        return Instruction(Kind.INPLACE, op.name, args)
    if name == CALL_TIR_DYN and len(args) == 2 and isinstance(args[1], relax.Tuple):
        return Instruction(Kind.KERNEL, name, tuple(args[1].fields), callee=args[0])
    if name in _DPS_CALLS:
        return Instruction(Kind.CALL_TIR, name, args)
    if isinstance(op, tvm.ir.Op) and op.name not in PACKED_CALL_OPS:
        return Instruction(Kind.OPERATOR, name, args)
    return Instruction(Kind.PACKED, name, args)


# --------------------------------------------------------------------- symbolic effects
@dataclass(frozen=True)
class ValueEffect:
    """What evaluating one bound value does to memory.

    Attributes
    ----------
    allocates
        Bytes of a fresh allocation the value creates (``None``: none).
    aliases
        Variables whose memory the result refers to (views, tuples, tensors in a storage).
    kills
        A variable whose register the binding drops.
    keeps
        ``(owner, key, var)``: the callee keeps ``var``'s memory alive inside the object
        ``owner`` (a runtime frame) under ``key``, until a later binding takes it or ``owner``
        is dropped. Rematerialization's ``evict`` does this when it decides to keep the tensor.
    takes
        ``(owner, key)``: the result is the memory kept under ``key`` in ``owner``, which lets
        go of it. When nothing is kept there, the result is a fresh allocation of its size.
    workspace
        Bytes the callee holds only while it runs (a kernel's workspace).
    """

    allocates: SymbolicExpr | None = None
    aliases: tuple[relax.Var, ...] = ()
    kills: relax.Var | None = None
    keeps: tuple[relax.Var, object, relax.Var] | None = None
    takes: tuple[relax.Var, object] | None = None
    workspace: SymbolicExpr | None = None


TimelineRule = Callable[[relax.Call, relax.Var, ShapeGraph], ValueEffect]
_RULES: dict[str, TimelineRule] = {}


def register_timeline_rule(name: str, rule: TimelineRule) -> None:
    """Tell the memory models what a packed function or operator does to memory.

    Parameters
    ----------
    name
        The packed function's global symbol (``"my.packed"``) or the operator's name
        (``"relax.my_op"``).
    rule
        ``rule(call, bound_var, graph) -> ValueEffect``.
    """
    _RULES[name] = rule


def _tensor_vars(exprs: Sequence[relax.Expr]) -> tuple[relax.Var, ...]:
    return tuple(e for e in exprs if isinstance(e, relax.Var))


def _slot_key(expr: relax.Expr) -> object:
    # Relax integer constants are IntImm expressions in TVM 0.27.
    if isinstance(expr, tvm.tirx.IntImm):
        return int(expr.value)
    return expr


def _remat_evict_rule(call: relax.Call, var: relax.Var, graph: ShapeGraph) -> ValueEffect:
    # blade_relax.evict(frame, slot, tensor): without an eviction decision (no budget) the
    # runtime keeps the tensor in the frame until its regenerate, so that is what the timeline
    # of the final IR predicts; the runtime's own decision timeline models real evictions.
    args = _data_args(call)
    if len(args) == 3 and isinstance(args[0], relax.Var) and isinstance(args[2], relax.Var):
        return ValueEffect(keeps=(args[0], _slot_key(args[1]), args[2]))
    return ValueEffect()


def _remat_regenerate_rule(call: relax.Call, var: relax.Var, graph: ShapeGraph) -> ValueEffect:
    # blade_relax.regenerate(frame, slot, ...): returns the kept tensor, or recomputes it.
    args = _data_args(call)
    if len(args) >= 2 and isinstance(args[0], relax.Var):
        return ValueEffect(takes=(args[0], _slot_key(args[1])))
    return ValueEffect(allocates=graph.bytes_of(var))


def _remat_begin_rule(call: relax.Call, var: relax.Var, graph: ShapeGraph) -> ValueEffect:
    # The frame object holds no tensor memory of its own.
    return ValueEffect()


_RULES.update(
    {
        EVICT: _remat_evict_rule,
        REGENERATE: _remat_regenerate_rule,
        REMAT_BEGIN: _remat_begin_rule,
    }
)


def returns_nothing(var: relax.Var) -> bool:
    """Whether ``var`` holds no tensor (an empty tuple, a shape, a primitive value, ...)."""
    ty = var.ty
    if isinstance(ty, relax.TupleType):
        return len(ty.fields) == 0
    return not isinstance(ty, relax.TensorType | relax.TupleType)


def _storage_size(call: relax.Call, graph: ShapeGraph) -> SymbolicExpr:
    size = call.args[0]
    if isinstance(size, relax.ShapeExpr) and len(size.values) == 1:
        return graph.canonical(SymbolicExpr.from_prim_expr(size.values[0]))
    values = getattr(getattr(size, "ty", None), "values", None)
    if values is not None and len(values) == 1:
        return graph.canonical(SymbolicExpr.from_prim_expr(values[0]))
    warnings.warn(
        f"alloc_storage with a size the timeline cannot read ({size}); counted as unknown",
        stacklevel=3,
    )
    return SymbolicExpr.unknown(f"alloc_storage size {size}")


def _call_effect(
    call: relax.Call,
    var: relax.Var,
    graph: ShapeGraph,
    mod: tvm.IRModule | None,
    bytes_of: Callable[[relax.Var], SymbolicExpr] | None = None,
) -> ValueEffect:
    bytes_of = graph.bytes_of if bytes_of is None else bytes_of
    name = call_name(call)
    if name is not None and name in _RULES:
        return _RULES[name](call, var, graph)
    inst = _classify_call(call, mod)
    if inst.kind is Kind.KILL:
        target = inst.source if isinstance(inst.source, relax.Var) else None
        return ValueEffect(kills=target)
    if inst.kind is Kind.STORAGE_ALLOC:
        return ValueEffect(allocates=_storage_size(call, graph))
    if inst.kind in (Kind.TENSOR_IN_STORAGE, Kind.VIEW):
        return ValueEffect(aliases=_tensor_vars(inst.args[:1]))
    if inst.kind is Kind.INPLACE:
        # The result is written into the arguments named by `inplace_indices`.
        indices = [int(i) for i in call.attrs.inplace_indices]
        aliased = [inst.args[i] for i in indices if 0 <= i < len(inst.args)]
        fresh_bytes = None
        if any(i < 0 for i in indices):
            fresh_bytes = bytes_of(var)
        return ValueEffect(allocates=fresh_bytes, aliases=_tensor_vars(aliased))
    if inst.kind is Kind.KERNEL and inst.name is None:
        # Destination-passing kernel call: it writes into buffers passed as arguments.
        return ValueEffect()
    if returns_nothing(var):
        return ValueEffect()
    return ValueEffect(allocates=bytes_of(var))


def binding_effect(
    binding: BindingInfo,
    graph: ShapeGraph,
    mod: tvm.IRModule | None,
    workspaces: bool = False,
    target: Any = None,
    bytes_of: Callable[[relax.Var], SymbolicExpr] | None = None,
) -> ValueEffect:
    """The symbolic effect of one binding (see :class:`ValueEffect`).

    Parameters
    ----------
    binding
        The binding, as :func:`blade_relax.analysis.liveness` lists it.
    graph
        The function's shape graph (sizes are canonical in it).
    mod
        The module (tells kernel calls from other calls, and gives kernels' workspaces).
    workspaces
        Count the workspace of a kernel call (needs ``mod``).
    target
        The target the kernels are built for (see :mod:`blade_relax.analysis.workspace`).
    bytes_of
        ``graph.bytes_of`` of a result variable, or a function that returns the same (such as
        :meth:`blade_relax.analysis.timeline.TimelineMemo.bytes_of`, which remembers it per
        type).
    """
    value = binding.value
    if binding.is_match_cast or isinstance(value, relax.Var):
        return ValueEffect(aliases=_tensor_vars([value]))
    if isinstance(value, relax.Tuple):
        return ValueEffect(aliases=_tensor_vars(list(value.fields)))
    if isinstance(value, relax.TupleGetItem):
        return ValueEffect(aliases=_tensor_vars([value.tuple_value]))
    if isinstance(value, relax.Call):
        effect = _call_effect(value, binding.var, graph, mod, bytes_of)
        if mod is None or not workspaces:
            return effect
        workspace = call_workspace(value, binding.var, mod, graph, target)
        if workspace is None or (workspace.is_constant and workspace.expr == 0):
            return effect
        return dataclasses.replace(effect, workspace=workspace)
    if isinstance(value, relax.If):
        # Conservative for control flow: the result is a fresh value of its type's size.
        return ValueEffect(allocates=graph.bytes_of(binding.var))
    # Constants live in the executable, shapes and primitive values are not tensors.
    return ValueEffect()


# --------------------------------------------------------------------- in-place writes
def kernel_written_params(func: tvm.tirx.PrimFunc) -> frozenset[int]:
    """Positions of the parameters whose buffers ``func`` stores to.

    For a destination-passing kernel these are its outputs; for the kernel of a
    ``call_tir_inplace`` they include the inputs it updates in place.
    """
    cached = _WRITTEN_CACHE.get(func)
    if cached is not None:
        return cached
    # In TVM 0.27 a buffer parameter is the buffer: stores name it directly.
    position_of = {param: position for position, param in enumerate(func.params)}
    written: set[int] = set()
    for store in _buffer_stores(func.body):
        position = position_of.get(store.buffer)
        if position is not None:
            written.add(position)
    result = frozenset(written)
    _WRITTEN_CACHE[func] = result
    return result


_WRITTEN_CACHE: dict[Any, frozenset[int]] = {}
_ARRAYS = ("ffi.Array", "ffi.List")
_SKIPPED_FIELDS = ("span", "ty")


def _buffer_stores(root: Any) -> list[Any]:
    """Every ``BufferStore`` under a TIR statement."""
    found: list[Any] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)) or type_key(node) in _ARRAYS:
            stack.extend(node)
            continue
        if not isinstance(node, tvm.runtime.Object):
            continue
        if isinstance(node, tvm.tirx.BufferStore):
            found.append(node)
            continue
        for name in field_names(node):
            child = getattr(node, name, None) if name not in _SKIPPED_FIELDS else None
            if child is not None:
                stack.append(child)
    return found


def written_operands(value: relax.Expr, mod: tvm.IRModule | None) -> tuple[relax.Expr, ...]:
    """The existing tensors a bound value writes into (not fresh results).

    ``call_tir_inplace`` and ``call_inplace_packed`` write the arguments at their in-place
    indices. A direct kernel call (after ``CallTIRRewrite``) writes every argument its PrimFunc
    stores to; arguments that are fresh allocations are its outputs, which the caller tells
    apart (see :class:`InPlaceWrites`).
    """
    if not isinstance(value, relax.Call):
        return ()
    op = value.op
    if isinstance(op, tvm.ir.Op) and op.name in (
        "relax.call_tir_inplace",
        "relax.call_inplace_packed",
    ):
        inst = classify(value, mod)
        indices = [int(k) for k in value.attrs.inplace_indices]
        return tuple(inst.args[k] for k in indices if 0 <= k < len(inst.args))
    inst = classify(value, mod)
    if inst.kind is Kind.KERNEL and inst.callee is not None and mod is not None:
        callee = mod[inst.callee] if inst.callee in mod.functions else None
        if isinstance(callee, tvm.tirx.PrimFunc):
            positions = kernel_written_params(callee)
            return tuple(a for k, a in enumerate(inst.args) if k in positions)
    return ()


@functools.lru_cache(maxsize=4096)
def reshape_pattern(func: tirx.PrimFunc) -> bool:
    """``relax.analysis.has_reshape_pattern(func)``, remembered per kernel.

    The check walks the kernel's body, and the passes ask it of every ``call_tir`` binding, so
    of the same kernel many times (once per layer, once per trial order). Kernels are
    immutable and compare by identity; the cache holds the ones it remembers, so an identity
    is never reused while remembered. Errors of the check are raised, never remembered.

    A kernel whose body is not in block form (hand-written loops: a mixture-of-experts
    grouped GEMM, a serial scatter) is no reshape; TVM's check asserts on it.
    """
    if not isinstance(func.body, tvm.s_tir.SBlockRealize):
        return False
    return bool(relax.analysis.has_reshape_pattern(func))


def _reshape_source(call: relax.Call, mod: tvm.IRModule | None) -> relax.Expr | None:
    """The tensor a ``call_tir`` of a reshape-pattern kernel reshapes (else ``None``)."""
    if mod is None or call.op.name != "relax.call_tir":
        return None
    callee, args = call.args[0], call.args[1]
    fields = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    if len(fields) != 1 or not isinstance(callee, tvm.ir.GlobalVar) or callee not in mod.functions:
        return None
    func = mod[callee]
    if not isinstance(func, tvm.tirx.PrimFunc):
        return None
    try:
        return fields[0] if reshape_pattern(func) else None
    except (RuntimeError, ValueError):  # a kernel the pattern check cannot read
        return None


@dataclass
class InPlaceWrites:
    """Which bindings of a sequence write into memory that existed before them.

    A *root* is a variable that owns memory: a parameter of the function (or a value from
    outside the sequence), or the result of a binding that allocates. Aliases, views, tuple
    items and the results of in-place calls refer to their sources' roots.

    Attributes
    ----------
    roots
        The roots of every variable defined in or read by the bindings.
    writes
        ``binding index -> roots it writes`` for every binding that updates existing memory
        (an in-place call, or a kernel call writing an argument that is not a fresh
        allocation).
    """

    roots: dict[relax.Var, frozenset[relax.Var]]
    writes: dict[int, frozenset[relax.Var]]

    def roots_of(self, var: relax.Var) -> frozenset[relax.Var]:
        return self.roots.get(var, frozenset({var}))

    def written_between(self, var: relax.Var, after: int, before: int) -> bool:
        """Whether memory ``var`` refers to is written by a binding in ``(after, before)``."""
        roots = self.roots_of(var)
        return any(after < i < before and roots & w for i, w in self.writes.items())

    @property
    def written_roots(self) -> frozenset[relax.Var]:
        return frozenset().union(*self.writes.values()) if self.writes else frozenset()


def in_place_writes(bindings: Sequence[relax.Binding], mod: tvm.IRModule | None) -> InPlaceWrites:
    """The in-place writes of ``bindings`` (one block, or a function's blocks in order)."""
    roots: dict[relax.Var, frozenset[relax.Var]] = {}
    writes: dict[int, frozenset[relax.Var]] = {}
    fresh: set[relax.Var] = set()  # allocations not yet written by a kernel

    def of(expr: relax.Expr) -> frozenset[relax.Var]:
        if isinstance(expr, relax.Var):
            return roots.get(expr, frozenset({expr}))
        if isinstance(expr, relax.Tuple):
            return frozenset().union(*(of(f) for f in expr.fields)) if expr.fields else frozenset()
        return frozenset()

    for i, binding in enumerate(bindings):
        var, value = binding.var, binding.value
        if isinstance(binding, relax.MatchCast) or isinstance(value, relax.Var | relax.Tuple):
            roots[var] = of(value)
            continue
        if isinstance(value, relax.TupleGetItem):
            roots[var] = of(value.tuple_value)
            continue
        if not isinstance(value, relax.Call):
            continue
        inst = classify(value, mod)
        if inst.kind is Kind.VIEW and inst.args:
            roots[var] = of(inst.args[0])
            continue
        reshaped = _reshape_source(value, mod) if inst.kind is Kind.CALL_TIR else None
        if reshaped is not None:
            # RewriteDataflowReshape turns it into a view later: the same memory.
            roots[var] = of(reshaped)
            continue
        if inst.kind is Kind.TENSOR_IN_STORAGE or inst.kind is Kind.TENSOR_ALLOC:
            fresh.add(var)
            continue
        written = written_operands(value, mod)
        if inst.kind is Kind.INPLACE:
            targets = frozenset().union(*(of(a) for a in written)) if written else frozenset()
            roots[var] = targets
            if targets:
                writes[i] = targets
            continue
        if inst.kind is Kind.KERNEL:
            outputs = [a for a in written if isinstance(a, relax.Var) and a in fresh]
            fresh.difference_update(outputs)
            existing = [a for a in written if not (isinstance(a, relax.Var) and a in outputs)]
            targets = frozenset().union(*(of(a) for a in existing)) if existing else frozenset()
            if targets:
                writes[i] = targets
    return InPlaceWrites(roots, writes)


# --------------------------------------------------------------------- in-place reuse
# Which input a kernel may overwrite with its output: the fact PlanMemory's in-place placements
# and MemoryAwareSchedule's cost model (which orders let an output take a dying input's storage)
# both read, from the kernel's TIR.
#
# The question answered here: may a kernel write its output buffer ``Y`` into the memory of its
# input buffer(s) ``X`` (both starting at offset 0) and still compute what it computes with
# disjoint buffers? The answer is read from the TIR itself, not from an operator list, so fused
# kernels of any composition are covered.
#
# Why the rule is about data flow, not about statement order
# -----------------------------------------------------------
# Kernels are compiled under the promise that their buffers never alias (``tirx.noalias``; the
# host/device split re-asserts it for every compute function, whatever the PrimFunc says). A code
# generator may therefore move a load of ``X`` past any store to ``Y`` unless the stored value
# depends on the loaded one; it may, for instance, forward a copy ``T = reshape(X)`` so that a later
# stage reads ``X`` directly, after earlier elements of ``Y`` were written. "Every read of ``X``
# comes before the stage that writes ``Y``" is therefore *not* enough. What is enough:
#
#     every value read from ``X`` flows, through the kernel's intermediate buffers, only into the
#     element of ``Y`` at the same flat position (and into nothing else the kernel writes).
#
# Then each load of ``X[p]`` is a data-dependence ancestor of the store to ``Y[p]``, the only store
# that can overwrite it, and no legal reordering can put the store first.
#
# The analysis marks every buffer of the kernel as independent of ``X``, *aligned* (element ``q``
# depends on ``X`` only at flat position ``q``) or *misaligned*, block by block in program order:
# a block that reads ``X``-dependent data writes aligned data when it has only spatial iterators,
# every ``X``-dependent load is at the flat offset of the block's store (proven with the
# arithmetic analyzer over the block's iteration domain), and no such load feeds an index. The
# kernel qualifies when ``Y`` is aligned, no other written parameter depends on ``X``, ``X`` is
# never written, ``Y`` is never read, ``X`` and ``Y`` have the same element size, and nothing
# reaches memory through pointers (``address_of``, ``buffer.data``, ``match_buffer`` views).
# ``exp``, ``add``, casts of equal width, ``reshape``-then-elementwise chains and fused elementwise
# kernels qualify; matmuls, reductions, transposes, splits and softmax do not.

# Iterator type of a spatial (data-parallel) block iterator.
_DATA_PAR = 0
# Fields never holding buffer accesses: source positions and type annotations.
_TIR_SKIPPED = frozenset({"span", "ty"})
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
        for name in field_names(node):
            if name not in _TIR_SKIPPED:
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
    buffers = [p for p in params if isinstance(getattr(p, "ty", None), tirx.BufferType)]
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
    offset = _int64(indices[0])
    for index, extent in zip(indices[1:], list(shape)[1:]):
        offset = offset * _int64(extent) + _int64(index)
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
        for name in field_names(node):
            if name not in _TIR_SKIPPED:
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
        for name in field_names(n):
            if name not in _TIR_SKIPPED:
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


def _int64(e: Any) -> Any:
    if isinstance(e, int):
        return tirx.IntImm("int64", e)
    if _dtype(e) != "int64":
        return tirx.Cast("int64", e)
    return e


def _dtype(e: Any) -> str:
    return str(getattr(getattr(e, "ty", None), "dtype", "int64"))

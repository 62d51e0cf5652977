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
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax, tirx

from ..contract import COLLECTIVE_FUNCS, EVICT, REGENERATE, REMAT_BEGIN
from ..symbolic import ShapeGraph, SymbolicExpr
from .liveness import BindingInfo
from .tir_fields import code_fields, type_key
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
    "Instruction",
    "Kind",
    "ValueEffect",
    "binding_effect",
    "call_name",
    "callee_name",
    "classify",
    "in_place_writes",
    "inplace_indices",
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
    if name in COLLECTIVE_FUNCS:  # a lowered call_inplace_packed of a collective
        return Instruction(Kind.INPLACE, name, args)
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
    field_allocates
        For a model that follows the fields of a call's tuple result (a kernel with several
        outputs): one fresh allocation per field of the result type, in field order (``None``:
        that field allocates nothing), made after ``allocates``.
    field_aliases
        With ``field_allocates`` or alone (an in-place call with a tuple result): per field,
        the variables whose memory the field is, or ``None`` when the field is its fresh
        allocation. A field read of the result then keeps only its field.
    """

    allocates: SymbolicExpr | None = None
    aliases: tuple[relax.Var, ...] = ()
    kills: relax.Var | None = None
    keeps: tuple[relax.Var, object, relax.Var] | None = None
    takes: tuple[relax.Var, object] | None = None
    workspace: SymbolicExpr | None = None
    field_allocates: tuple[SymbolicExpr | None, ...] = ()
    field_aliases: tuple[tuple[relax.Var, ...] | None, ...] = ()


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
        indices = inplace_indices(call)
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
        for name in code_fields(node):
            child = getattr(node, name, None)
            if child is not None:
                stack.append(child)
    return found


def inplace_indices(call: relax.Call) -> tuple[int, ...]:
    """Per result of an in-place call, the argument it is written into (``-1``: a fresh
    tensor): the call's ``inplace_indices``, or the first argument for a collective
    (:data:`~blade_relax.contract.COLLECTIVE_FUNCS`), whose lowered form (a plain
    ``call_packed``) keeps no attributes."""
    attrs = call.attrs
    if attrs is not None and hasattr(attrs, "inplace_indices"):
        return tuple(int(k) for k in attrs.inplace_indices)
    if call_name(call) in COLLECTIVE_FUNCS:
        return (0,)
    raise ValueError(f"{call_name(call)} is no in-place call")


def written_operands(value: relax.Expr, mod: tvm.IRModule | None) -> tuple[relax.Expr, ...]:
    """The existing tensors a bound value writes into (not fresh results).

    ``call_tir_inplace`` and ``call_inplace_packed`` (and a collective, lowered) write the
    arguments at their in-place indices (:func:`inplace_indices`). A direct kernel call (after ``CallTIRRewrite``) writes every argument its PrimFunc
    stores to; arguments that are fresh allocations are its outputs, which the caller tells
    apart (see :class:`InPlaceWrites`).
    """
    if not isinstance(value, relax.Call):
        return ()
    inst = classify(value, mod)
    if inst.kind is Kind.INPLACE:
        indices = inplace_indices(value)
        return tuple(inst.args[k] for k in indices if 0 <= k < len(inst.args))
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

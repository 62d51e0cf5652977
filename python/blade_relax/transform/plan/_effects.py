"""What ``PlanMemory`` trusts each binding to do with memory (private helper).

The planner reads a function through :func:`blade_relax.analysis.storage_flow`, walked with
the effects this module gives the bindings. They differ from the op table's
(:func:`blade_relax.analysis.effects.binding_effect`) in what the planner may not assume: a
call whose memory behaviour it does not analyse (a packed function it does not trust, a Relax
function, an operator, an ``If``) may return any of its arguments, so its result aliases every
variable it reads, and those allocations are refused (:class:`Reading`). Allocating calls
(``builtin.alloc_tensor``, ``alloc_storage``) allocate; kernels write into their arguments and
return nothing; views and tensors placed in a storage alias their source.

The runtime's rematerialization protocol: ``evict(frame, k, x)`` may keep ``x`` in the
frame's stash (so ``x`` is refused), and ``x' = regenerate(frame, k, ...)`` hands back what
was evicted under ``k`` (or a recomputation of the same size): ``x'`` aliases every variable
evicted under ``k`` before it. ``regenerate`` only reads its other arguments during the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ...analysis.effects import Instruction, Kind, ValueEffect
from ...analysis.liveness import BindingInfo
from ...symbolic import SymbolicExpr

__all__ = ["UNSIZED", "Reading", "planner_readings"]

# The flow's allocations carry a size; the planner sizes its allocations itself.
UNSIZED = SymbolicExpr.constant(0)


@dataclass(frozen=True)
class Reading:
    """What the planner reads of one binding.

    Attributes
    ----------
    effect
        The binding's effect, for the storage flow.
    refusals
        ``(variables, reason, hazard)``: the allocations those variables keep alive may not be
        planned, for that reason (``hazard``: the stock planner would share them unsafely), in
        the order the planner gives the reasons.
    """

    effect: ValueEffect
    refusals: tuple[tuple[tuple[relax.Var, ...], str, bool], ...] = ()


# The readings of most bindings (an allocation, a kernel call, a constant), made once.
_NOTHING = Reading(ValueEffect())
_ALLOCATES = Reading(ValueEffect(allocates=UNSIZED))


def planner_readings(
    bindings: Sequence[BindingInfo],
    insts: Sequence[Instruction | None],
    mod: tvm.IRModule,
    trusted: frozenset[str],
) -> list[Reading]:
    """The reading of each binding (``insts``: the classified calls, ``None`` for non-calls)."""
    # Slot -> variables handed to ``evict`` under it so far.
    evicted: dict[int, tuple[relax.Var, ...]] = {}
    return [_reading(b, inst, mod, trusted, evicted) for b, inst in zip(bindings, insts)]


def _reading(
    binding: BindingInfo,
    inst: Instruction | None,
    mod: tvm.IRModule,
    trusted: frozenset[str],
    evicted: dict[int, tuple[relax.Var, ...]],
) -> Reading:
    value = binding.value
    if binding.is_match_cast:
        return Reading(ValueEffect(aliases=_vars(value)))
    if isinstance(value, relax.Var | relax.Tuple):
        return Reading(ValueEffect(aliases=_vars(value)))
    if isinstance(value, relax.TupleGetItem):
        # The flow keeps only the field when the tuple's fields are known.
        return Reading(ValueEffect(aliases=_vars(value.tuple_value)))
    if isinstance(value, relax.Call):
        return _call_reading(value, inst, mod, trusted, evicted)
    if isinstance(value, (tvm.ir.GenericConst, relax.ShapeExpr, tvm.ir.StringImm)):
        return _NOTHING
    if tvm.ir.is_prim_expr(value):
        return _NOTHING
    # If, closures, anything else: whatever it reads may escape through it.
    reason = f"read by a {type(value).__name__} the planner does not analyse"
    return _escapes(_vars(value), reason)


def _call_reading(
    call: relax.Call,
    inst: Instruction,
    mod: tvm.IRModule,
    trusted: frozenset[str],
    evicted: dict[int, tuple[relax.Var, ...]],
) -> Reading:
    remat, before = _remat_reading(inst, evicted)
    if remat is not None:
        return remat
    reading = _plain_call_reading(call, inst, mod, trusted)
    return Reading(reading.effect, before + reading.refusals) if before else reading


def _plain_call_reading(
    call: relax.Call, inst: Instruction, mod: tvm.IRModule, trusted: frozenset[str]
) -> Reading:
    kind = inst.kind
    if kind in (Kind.TENSOR_ALLOC, Kind.STORAGE_ALLOC):
        return _ALLOCATES
    if kind in (Kind.TENSOR_IN_STORAGE, Kind.VIEW):
        return Reading(ValueEffect(aliases=_vars(inst.source) if inst.args else ()))
    if kind in (Kind.SHAPE_ONLY, Kind.KILL):
        return _NOTHING
    if kind is Kind.KERNEL and inst.name is None:
        return _NOTHING  # a PrimFunc of the module (classify looked): writes its arguments
    if kind in (Kind.KERNEL, Kind.RELAX_CALL) and inst.callee is not None:
        callee = inst.callee
        func = (
            mod[callee] if isinstance(callee, relax.GlobalVar) and callee in mod.functions else None
        )
        if isinstance(func, tirx.PrimFunc):
            return _NOTHING  # writes into its arguments, returns nothing
        used = tuple(v for a in inst.args for v in _vars(a))
        return _escapes(used, "passed to a Relax function call")
    used = _vars(call)
    if isinstance(call.op, relax.ExternFunc):
        if inst.name in trusted:
            return _NOTHING
        return _escapes(used, f"passed to the packed function {inst.name}", hazard=True)
    if isinstance(call.op, tvm.ir.Op):
        return _escapes(used, f"passed to {call.op.name}, whose memory behaviour is not analysed")
    return _escapes(used, "passed to a call the planner does not analyse")


def _remat_reading(
    inst: Instruction, evicted: dict[int, tuple[relax.Var, ...]]
) -> tuple[Reading | None, tuple[tuple[tuple[relax.Var, ...], str, bool], ...]]:
    """The rematerialization protocol (see the module docstring): the reading, or ``None``
    and the refusals to give before the reading of a plain call."""
    args = inst.args
    if inst.kind is Kind.EVICT and len(args) == 3:
        slot = _int_value(args[1])
        kept = _vars(args[2])
        refusals = ((kept, "handed to the runtime for eviction", True),)
        if slot is None:
            every = tuple(v for a in args for v in _vars(a))
            return None, refusals + ((every, "evicted through an unknown slot", False),)
        evicted[slot] = evicted.get(slot, ()) + kept
        return Reading(ValueEffect(), refusals), ()
    if inst.kind is Kind.REGENERATE and len(args) >= 2:
        slot = _int_value(args[1])
        if slot is not None:
            return Reading(ValueEffect(aliases=evicted.get(slot, ()))), ()
    return None, ()


def _escapes(used: tuple[relax.Var, ...], reason: str, hazard: bool = False) -> Reading:
    """The result may be any of ``used``: it aliases them, and they are refused."""
    return Reading(ValueEffect(aliases=used), ((used, reason, hazard),))


def _int_value(expr: relax.Expr) -> int | None:
    """The integer a Relax constant holds (a slot of the remat protocol), else ``None``."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    value = getattr(expr, "value", None)
    return int(value.value) if isinstance(value, tirx.IntImm) else None


def _vars(expr: relax.Expr) -> tuple[relax.Var, ...]:
    """The variables ``expr`` reads (its value escapes through any of them)."""
    if isinstance(expr, relax.Var):
        return (expr,)
    return tuple(relax.analysis.free_vars(expr))

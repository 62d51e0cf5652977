"""What the block model of :mod:`.memory_aware_schedule` reads of each binding (private helper).

The block model (:mod:`._model`) reads a dataflow block through
:func:`blade_relax.analysis.storage_flow`, walked with the effects this module gives the
bindings. They differ from the op table's (:func:`blade_relax.analysis.effects.binding_effect`)
where the model mirrors what the lowering will do with the block's buffers:

* a call with a tuple result gets one buffer per field (a kernel with several outputs), and
  an in-place call with a tuple result has per-field aliases, so a field read keeps one field;
* a ``call_tir`` of a reshape kernel is a view of its argument (``RewriteDataflowReshape``
  makes it one);
* a result of zero bytes is no buffer.

With the effect comes what the model needs of the lowering: whether the value is a view,
whether its buffers become ``builtin.alloc_tensor`` results (``StaticPlanBlockMemory`` pools
them), and which arguments that planner gives up on. A construct the scheduler does not
reorder (an impure call, control flow) raises :class:`UnsupportedBlock`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
from tvm import relax

from ...analysis.effects import (
    PACKED_CALL_OPS,
    Kind,
    ValueEffect,
    classify,
    inplace_indices,
    reshape_pattern,
)
from ...analysis.storage_flow import TupleFields
from ...symbolic import Ordering, ShapeGraph, SymbolicExpr, TypeSizes
from .._warn import warn_fallback

__all__ = ["FIELDS", "LEAVES", "UnsupportedBlock", "ValueRead", "ValueReader", "allocated"]

# Values that read no variable and allocate nothing the VM counts (constants live in the
# executable; prim values, strings and dtypes are constants in TVM 0.27's IR).
LEAVES = (
    tvm.ir.expr.Constant,
    tvm.ir.expr.StringImm,
    relax.ShapeExpr,
    relax.ExternFunc,
    tvm.ir.GlobalVar,
)

# The fields of tuples the block model follows: through ``match_cast``, re-bindings and tuple
# literals nested in a field (and a call's tuple result, through its effect's fields).
FIELDS = TupleFields(match_cast=True, through_aliases=True, nested_literals=True)


class UnsupportedBlock(Exception):
    """The block holds a construct the scheduler does not reorder."""


@dataclass(frozen=True)
class ValueRead:
    """What the block model reads of one bound value.

    Attributes
    ----------
    effect
        What the value does to the block's buffers, for the storage flow.
    is_view
        The value is the memory of another (a view, or a reshape kernel that will become one).
    plannable
        The buffers it creates are ``builtin.alloc_tensor`` results once lowered.
    tuple_fields
        Those buffers are the fields of a multi-output kernel.
    discards
        The arguments whose buffers ``StaticPlanBlockMemory`` gives up planning.
    """

    effect: ValueEffect
    is_view: bool = False
    plannable: bool = False
    tuple_fields: bool = False
    discards: tuple[relax.Expr, ...] = ()


def allocated(nbytes: SymbolicExpr) -> SymbolicExpr | None:
    """A buffer of ``nbytes``; none for zero bytes."""
    return None if nbytes.is_constant and nbytes.expr == 0 else nbytes


def vars_in(expr: relax.Expr) -> tuple[relax.Var, ...]:
    """The variables of a variable or a (nested) tuple of them, in order."""
    if isinstance(expr, relax.Var):
        return (expr,)
    if isinstance(expr, relax.Tuple):
        return tuple(dict.fromkeys(v for f in expr.fields for v in vars_in(f)))
    return ()


class ValueReader:
    """Reads the bindings of one function's blocks (``sizes``: its types' byte sizes)."""

    def __init__(self, graph: ShapeGraph, mod: tvm.IRModule | None, sizes: TypeSizes) -> None:
        self.graph, self.mod, self.sizes = graph, mod, sizes

    def read(self, binding: relax.Binding) -> ValueRead:
        """What the block model reads of ``binding`` (see the module docstring)."""
        var, value = binding.var, binding.value
        if isinstance(binding, relax.MatchCast) and not isinstance(
            value, (relax.Var, relax.Tuple, *LEAVES)
        ):
            raise UnsupportedBlock(f"match_cast of a {type(value).__name__} in {var.name}")
        if isinstance(value, relax.Var):
            return ValueRead(ValueEffect(aliases=(value,)))
        if isinstance(value, relax.Tuple):
            return ValueRead(ValueEffect(aliases=vars_in(value)))
        if isinstance(value, relax.TupleGetItem):
            return ValueRead(ValueEffect(aliases=vars_in(value.tuple_value)))
        if isinstance(value, LEAVES):
            return ValueRead(ValueEffect())
        if not isinstance(value, relax.Call):
            raise UnsupportedBlock(f"{type(value).__name__} in binding {var.name}")
        if relax.analysis.contains_impure_call(value):
            raise UnsupportedBlock(f"impure call in binding {var.name}")
        return self._call_read(value, var)

    def _call_read(self, call: relax.Call, var: relax.Var) -> ValueRead:
        inst = classify(call, self.mod)
        if inst.kind is Kind.VIEW:
            aliases = vars_in(inst.source) if inst.args else ()
            return ValueRead(ValueEffect(aliases=aliases), is_view=True)
        if inst.kind is Kind.CALL_TIR and inst.name == "relax.call_tir":
            src = self._reshape_source(call, var)
            if src is not None:
                return ValueRead(ValueEffect(aliases=(src,)), is_view=True)
        discards = tuple(inst.args) if self._discards(call) else ()
        if inst.kind is Kind.INPLACE:
            return ValueRead(
                self._inplace_effect(call, list(inst.args), var),
                plannable=call.op.name == "relax.call_tir_inplace",
                discards=discards,
            )
        # Operators, call_tir and call_dps_packed write into a builtin.alloc_tensor.
        plannable = isinstance(call.op, tvm.ir.Op) and call.op.name not in PACKED_CALL_OPS
        return ValueRead(
            self._result_effect(var),
            plannable=plannable,
            tuple_fields=plannable and isinstance(var.ty, relax.TupleType),
            discards=discards,
        )

    def _bytes(self, ty: tvm.ir.Type, var: relax.Var | None = None) -> SymbolicExpr:
        # Most bindings of a block share a handful of types: read each type's size once.
        return self.sizes.bytes_of(ty, var)

    def _result_effect(self, var: relax.Var) -> ValueEffect:
        """A fresh buffer for the result, one per field of a tuple (a multi-output kernel)."""
        ty = var.ty
        if isinstance(ty, relax.TupleType):
            return ValueEffect(field_allocates=tuple(allocated(self._bytes(f)) for f in ty.fields))
        return ValueEffect(allocates=allocated(self._bytes(ty, var)))

    def _inplace_effect(
        self, call: relax.Call, tensor_args: list[relax.Expr], var: relax.Var
    ) -> ValueEffect:
        """The result is the written arguments; with an output index of -1, fresh buffers
        for every field of the result type (an over-estimate: the written fields' too)."""
        indices = inplace_indices(call)
        written: list[tuple[relax.Var, ...] | None] = []
        for k in indices:
            if k >= len(tensor_args):
                raise UnsupportedBlock(f"in-place index {k} out of range in {var.name}")
            written.append(vars_in(tensor_args[k]) if k >= 0 else None)
        fresh = self._result_effect(var) if any(k < 0 for k in indices) else ValueEffect()
        aliases = tuple(dict.fromkeys(v for w in written if w is not None for v in w))
        if not isinstance(var.ty, relax.TupleType):
            return dataclasses.replace(fresh, aliases=aliases)
        return dataclasses.replace(fresh, aliases=aliases, field_aliases=tuple(written))

    def _discards(self, call: relax.Call) -> bool:
        """Whether StaticPlanBlockMemory gives up planning the arguments of ``call``: it plans
        only values passed to PrimFuncs and packed functions (and views of them)."""
        op = call.op
        if isinstance(op, tvm.ir.GlobalVar):
            callee = self.mod[op] if self.mod is not None and op in self.mod.functions else None
            return not isinstance(callee, tvm.tirx.PrimFunc)
        if isinstance(op, tvm.ir.Op):
            return op.name == "relax.call_builtin_with_ctx"
        return not isinstance(op, relax.ExternFunc)

    def _reshape_source(self, call: relax.Call, var: relax.Var) -> relax.Expr | None:
        """The argument a ``call_tir`` of a reshape kernel views (RewriteDataflowReshape)."""
        if self.mod is None or not isinstance(var, relax.DataflowVar):
            return None
        gv = call.args[0]
        if not isinstance(gv, tvm.ir.GlobalVar) or gv not in self.mod.functions:
            return None
        func = self.mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            return None
        args = call.args[1]
        fields = list(args.fields) if isinstance(args, relax.Tuple) else [args]
        if len(fields) != 1 or not isinstance(fields[0], relax.Var):
            return None
        src = fields[0]
        src_ty, dst_ty = src.ty, var.ty
        if not (isinstance(src_ty, relax.TensorType) and isinstance(dst_ty, relax.TensorType)):
            return None
        if str(src_ty.dtype) != str(dst_ty.dtype):
            return None
        if self.graph.compare(self._bytes(src_ty, src), self._bytes(dst_ty, var)) != Ordering.EQ:
            return None
        try:
            if not reshape_pattern(func):
                return None
        except (RuntimeError, ValueError) as err:  # TVM raises InternalError (a RuntimeError)
            # A kernel TVM's pattern check cannot read: modelled as computing a new tensor
            # (an over-estimate of the bytes, never an under-estimate).
            warn_fallback("MemoryAwareSchedule", "the reshape check of a kernel", gv.name_hint, err)
            return None
        return src

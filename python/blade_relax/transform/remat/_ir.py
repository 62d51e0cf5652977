"""What ``Rematerialize`` reads from a lowered Relax function: ops, aliases, uses and recipes.

The function is at the stage after ``CallTIRRewrite``: no dataflow blocks, tensors created by
``R.builtin.alloc_tensor`` and written by destination-passing calls of PrimFuncs. Each binding
is classified:

``alloc``   ``R.builtin.alloc_tensor``: a fresh tensor (a *root*).
``kernel``  a call of a PrimFunc of the module whose trailing arguments are fresh ``alloc``
            tensors (its outputs); the other arguments are its inputs.
``alias``   ``y = x`` or ``R.match_cast(x, ...)``: another name for the same tensor.
``view``    ``R.reshape``, ``R.memory.view``, ``R.memory.ensure_zero_offset`` or the packed
            ``vm.builtin.reshape``: the same memory, another shape.
``tuple`` / ``getitem``  tuples of tensors and their fields.
``inert``   constants, shapes, primitive values: no tensor memory.
``opaque``  anything else (packed calls, Relax function calls, kernels writing into an
            argument that is not a fresh allocation). Its result cannot be recomputed, and the
            tensors it takes may be mutated, so they are never recomputed nor read by a
            recomputation.

Every variable *holds* a set of roots (the tensors whose memory it keeps alive): the
parameters, the ``alloc`` tensors and the results of ``opaque`` bindings. Which roots a variable
holds is :func:`blade_relax.analysis.storage_flow`'s answer, walked with the effects of the
kinds above (:func:`_effect`: an ``opaque`` result is a root of its own that may alias every
variable it reads) and the parameters as buffers live on entry. A root's uses are the bindings
that read any variable holding it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from ...analysis.effects import InPlaceWrites, Kind, ValueEffect, classify, in_place_writes
from ...analysis.liveness import Liveness, liveness
from ...analysis.storage_flow import TupleFields, storage_flow
from ...symbolic import SymbolicExpr

__all__ = ["FunctionModel", "Op", "RecipeError", "UnsupportedFunction", "build_model"]


class UnsupportedFunction(Exception):
    """The function has a construct the pass does not handle; it is left unchanged."""


class RecipeError(Exception):
    """No regeneration recipe exists for a tensor within the limits."""


@dataclass
class Op:
    """One binding, classified (see the module docstring).

    Attributes
    ----------
    index
        Position in program order.
    var, value
        The binding.
    kind
        ``alloc``, ``kernel``, ``alias``, ``view``, ``tuple``, ``getitem``, ``inert``, ``opaque``.
    reads
        Variables the binding reads (kernel outputs excluded).
    outputs
        For a kernel: the fresh tensors it writes.
    source
        For ``alias``, ``view`` and ``getitem``: the variable it refers to.
    is_match_cast
        The binding is a ``MatchCast``.
    """

    index: int
    var: relax.Var
    value: relax.Expr
    kind: str
    reads: tuple[relax.Var, ...] = ()
    outputs: tuple[relax.Var, ...] = ()
    source: relax.Var | None = None
    is_match_cast: bool = False


@dataclass
class FunctionModel:
    """The classified bindings of one function and the facts the pass derives from them."""

    func: relax.Function
    params: list[relax.Var]
    ops: list[Op]
    outputs: list[relax.Var]
    op_of: dict[relax.Var, Op] = field(default_factory=dict)
    holds: dict[relax.Var, frozenset[relax.Var]] = field(default_factory=dict)
    members: dict[relax.Var, list[relax.Var]] = field(default_factory=dict)
    uses: dict[relax.Var, list[int]] = field(default_factory=dict)
    var_uses: dict[relax.Var, list[int]] = field(default_factory=dict)
    writer: dict[relax.Var, int] = field(default_factory=dict)
    mutable: set[relax.Var] = field(default_factory=set)
    tuple_fields: dict[relax.Var, list[relax.Expr]] = field(default_factory=dict)
    writes: InPlaceWrites | None = None

    @property
    def end(self) -> int:
        """Position of the function's result (after the last binding)."""
        return len(self.ops)

    def last_use(self, var: relax.Var) -> int:
        """Last position reading ``var`` itself (its definition when never read)."""
        positions = self.var_uses.get(var)
        if positions:
            return positions[-1]
        op = self.op_of.get(var)
        return op.index if op is not None else -1

    def root_last_use(self, root: relax.Var) -> int:
        """Last position reading any variable that holds ``root``."""
        positions = self.uses.get(root)
        return positions[-1] if positions else self.writer.get(root, -1)

    def defined_at(self, var: relax.Var) -> int:
        """Position of the binding defining ``var`` (-1 for parameters)."""
        op = self.op_of.get(var)
        return op.index if op is not None else -1


def _vars_in(expr: relax.Expr, defined: set[relax.Var]) -> tuple[relax.Var, ...]:
    """Relax variables read by ``expr``, in order of first occurrence.

    Relax and TIR variables share one class in TVM 0.27 and ``free_vars`` returns both; the
    Relax variables of a function are its parameters and bound variables (``defined``).
    """
    seen: dict[relax.Var, None] = {}
    for var in relax.analysis.free_vars(expr):
        if var in defined:
            seen.setdefault(var, None)
    return tuple(seen)


def _is_inert(value: relax.Expr) -> bool:
    return not isinstance(
        value,
        relax.Var | relax.Call | relax.Tuple | relax.TupleGetItem | relax.If | relax.Function,
    )


def _classify(
    index: int,
    binding: relax.Binding,
    mod: tvm.IRModule,
    written: set[relax.Var],
    allocs: set[relax.Var],
    defined: set[relax.Var],
    uses: tuple[relax.Var, ...],
) -> Op:
    """The op of one binding; ``uses`` are the variables it reads (as ``_vars_in`` of its
    value: the liveness has them)."""
    var, value = binding.var, binding.value
    if isinstance(binding, relax.MatchCast):
        if isinstance(value, relax.Var):
            return Op(index, var, value, "alias", (value,), source=value, is_match_cast=True)
        return Op(index, var, value, "opaque", uses, is_match_cast=True)
    if isinstance(value, relax.If):
        raise UnsupportedFunction("control flow (If)")
    if isinstance(value, relax.Var):
        return Op(index, var, value, "alias", (value,), source=value)
    if isinstance(value, relax.Tuple):
        return Op(index, var, value, "tuple", uses)
    if isinstance(value, relax.TupleGetItem):
        source = value.tuple_value
        if isinstance(source, relax.Var):
            return Op(index, var, value, "getitem", (source,), source=source)
        return Op(index, var, value, "opaque", uses)
    if isinstance(value, relax.Call):
        inst = classify(value, mod)
        if inst.kind is Kind.TENSOR_ALLOC:
            return Op(index, var, value, "alloc", uses)
        if inst.kind is Kind.VIEW and isinstance(inst.source, relax.Var):
            return Op(index, var, value, "view", uses, source=inst.source)
        if inst.kind is Kind.KERNEL and inst.name is None:
            args = list(inst.args)
            outputs: list[relax.Var] = []
            for arg in reversed(args):
                if isinstance(arg, relax.Var) and arg in allocs and arg not in written:
                    outputs.append(arg)
                else:
                    break
            outputs.reverse()
            inputs = args[: len(args) - len(outputs)]
            if outputs and not any(isinstance(a, relax.Var) and a in outputs for a in inputs):
                reads = _vars_in(relax.Tuple(inputs), defined) if inputs else ()
                return Op(index, var, value, "kernel", reads, tuple(outputs))
        return Op(index, var, value, "opaque", uses)
    if isinstance(value, relax.Function):
        raise UnsupportedFunction("a nested function")
    if _is_inert(value):
        return Op(index, var, value, "inert", ())
    return Op(index, var, value, "opaque", uses)


def build_model(func: relax.Function, mod: tvm.IRModule) -> FunctionModel:
    """Classify the bindings of ``func`` and compute holders, uses and mutability.

    Raises
    ------
    UnsupportedFunction
        For dataflow blocks (the pass runs after ``ToNonDataflow``), control flow and nested
        functions.
    """
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise UnsupportedFunction("a body that is not a SeqExpr")
    info = liveness(func, positions=False)
    defined: set[relax.Var] = set(func.params)
    defined.update(b.var for b in info.bindings)
    ops: list[Op] = []
    written: set[relax.Var] = set()
    allocs: set[relax.Var] = set()
    for block in body.blocks:
        if isinstance(block, relax.DataflowBlock):
            raise UnsupportedFunction("a dataflow block (run after ToNonDataflow)")
        for binding in block.bindings:
            uses = tuple(v for v in info.bindings[len(ops)].uses if v in defined)
            op = _classify(len(ops), binding, mod, written, allocs, defined, uses)
            ops.append(op)
            if op.kind == "alloc":
                allocs.add(op.var)
            elif op.kind == "kernel":
                written.update(op.outputs)
    if isinstance(body.body, relax.If | relax.Function):
        raise UnsupportedFunction("a result that is not a plain expression")
    outputs = list(_vars_in(body.body, defined))
    model = FunctionModel(func=func, params=list(func.params), ops=ops, outputs=outputs)
    # In-place writes into memory the kernels do not allocate (parameters updated by an
    # optimizer): a recipe may not re-read such memory after it has been overwritten.
    model.writes = in_place_writes([b for blk in body.blocks for b in blk.bindings], mod)
    model.holds = _holds(info, ops)
    for op in ops:
        model.op_of[op.var] = op
        held = model.holds[op.var]
        if op.kind == "tuple":
            model.tuple_fields[op.var] = list(op.value.fields)
        elif op.kind == "getitem":
            fields = model.tuple_fields.get(op.source)
            index = int(op.value.index)
            # A field that is itself a tuple of the function: its fields are known too.
            field_ = fields[index] if fields is not None and 0 <= index < len(fields) else None
            if isinstance(field_, relax.Var) and field_ in model.tuple_fields:
                model.tuple_fields[op.var] = model.tuple_fields[field_]
        elif op.kind == "kernel":
            for out in op.outputs:
                if out in model.writer:
                    model.mutable.add(out)
                model.writer[out] = op.index
        for root in held:
            model.members.setdefault(root, []).append(op.var)
        for v in op.reads:
            model.var_uses.setdefault(v, []).append(op.index)
            for root in model.holds.get(v, ()):
                positions = model.uses.setdefault(root, [])
                if not positions or positions[-1] != op.index:
                    positions.append(op.index)
        if op.kind == "opaque":
            # Opaque calls may write into their tensor arguments.
            for v in op.reads:
                model.mutable |= model.holds.get(v, frozenset())
    for v in outputs:
        model.var_uses.setdefault(v, []).append(model.end)
        for root in model.holds.get(v, ()):
            positions = model.uses.setdefault(root, [])
            if not positions or positions[-1] != model.end:
                positions.append(model.end)
    return model


# The flow's allocations carry a size; the roots are asked only who holds them.
_UNSIZED = SymbolicExpr.constant(0)

# The fields this model follows: a field read of a tuple of the function, and of a field that
# is itself such a tuple (the recipes rebuild through them); a ``match_cast`` is opaque here.
_FIELDS = TupleFields(match_cast=False, through_items=True)


def _effect(op: Op) -> ValueEffect:
    """What an op does to the roots (see the module docstring)."""
    if op.kind == "alloc":
        return ValueEffect(allocates=_UNSIZED)
    if op.kind in ("alias", "view", "getitem"):
        return ValueEffect(aliases=(op.source,))
    if op.kind == "tuple":
        return ValueEffect(aliases=tuple(f for f in op.value.fields if isinstance(f, relax.Var)))
    if op.kind == "opaque":
        # The result may alias any argument, and is a value of its own.
        return ValueEffect(allocates=_UNSIZED, aliases=op.reads)
    return ValueEffect()  # a kernel's result and an inert value hold no tensor


def _holds(info: Liveness, ops: list[Op]) -> dict[relax.Var, frozenset[relax.Var]]:
    """The roots each variable (parameters included) holds, from the storage flow."""
    effects = [_effect(op) for op in ops]
    flow = storage_flow(
        info,
        lambda binding: effects[binding.index],
        lambda var: _UNSIZED,
        explicit_kills=False,
        params_live=True,
        fields=_FIELDS,
        lifetimes=False,
    )
    root = [allocation.var for allocation in flow.allocations]
    return {var: frozenset(root[k] for k in ids) for var, ids in flow.refs.items()}

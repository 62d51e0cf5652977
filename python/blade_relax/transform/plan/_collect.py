"""What ``PlanMemory`` may plan in one Relax function (private helper).

Reads a function after ``CallTIRRewrite`` (kernels called in destination-passing style on
``R.builtin.alloc_tensor`` results) and records, for every allocation:

* where it is allocated, its byte size, dtype, scope and device;
* every binding that reads it, directly or through an alias (a var re-binding, a view such as
  ``R.reshape``, a ``match_cast``, a tuple and its items);
* whether it may be planned, and if not, why (``refusal``).

An allocation is refused (left to ``LowerAllocTensor``: its own storage, freed at its last use)
when it is part of the function's result, is used in another binding block, reaches a call
whose memory behaviour is not known (a packed function, a Relax function, an ``If``, an
operator), or has a size that cannot be expressed symbolically. Refusal is the safe default:
the planner may only reuse memory whose every reader it can see.

Existing ``R.memory.alloc_storage`` bindings (already planned memory) are recorded as well, so
that the live-bytes model counts them; they are never re-planned.

Which allocations each variable keeps alive is :func:`blade_relax.analysis.storage_flow`'s
answer, walked with the effects the planner trusts (:mod:`._effects`: an unknown call's result
aliases its arguments) and the fields of tuples followed through re-bindings and nested tuple
literals. What is the planner's own is read here: the allocations' shapes and refusals, the
kernel calls, and the tuples ``KillAfterLastUse`` never kills once ``CanonicalizeBindings`` has
folded their item reads (``Allocation.pinned``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from ...analysis.effects import VIEW_OPS, Instruction, Kind, classify
from ...analysis.liveness import BindingInfo, liveness
from ...analysis.storage_flow import TupleFields, storage_flow
from .._warn import warn_fallback
from ._effects import UNSIZED, Reading, planner_readings

__all__ = ["Allocation", "FunctionFacts", "KernelCall", "collect_facts"]


@dataclass
class Allocation:
    """One allocation of the function: a ``builtin.alloc_tensor`` or an existing storage.

    Attributes
    ----------
    id
        Position in :attr:`FunctionFacts.allocations`.
    var
        The bound variable.
    index
        Flattened binding index of the allocation.
    block
        Index of the binding block holding it.
    kind
        ``"tensor"`` (a ``builtin.alloc_tensor``) or ``"storage"`` (an existing storage).
    call
        The allocating call.
    shape, dtype, scope, device
        Shape (PrimExprs), dtype string, storage scope and the runtime device index argument of
        a tensor allocation (empty / None for a storage).
    size_prim
        Byte size as a PrimExpr (``None`` if not expressible).
    first_use, last_use
        First and last binding index that reads the allocation through any alias (``None``: never
        read). A result of the function is read at ``num_bindings``.
    refusal
        Why the allocation may not be planned (``None``: it may).
    """

    id: int
    var: relax.Var
    index: int
    block: int
    kind: str
    call: relax.Call
    shape: tuple = ()
    dtype: str = ""
    scope: str = "global"
    device: object = None
    size_prim: object = None
    first_use: int | None = None
    last_use: int | None = None
    refusal: str | None = None
    hazard: bool = False
    pinned: bool = False

    @property
    def plannable(self) -> bool:
        return self.kind == "tensor" and self.refusal is None

    @property
    def end(self) -> int:
        """The last binding that reads the allocation (its data is dead afterwards)."""
        return self.index if self.last_use is None else max(self.index, self.last_use)

    def mem_end(self, num_bindings: int) -> int:
        """The last binding during which the VM still holds the allocation.

        ``KillAfterLastUse`` drops a register after its last use, but never one that has no
        use left once ``CanonicalizeBindings`` has run: an allocation never read, and the items
        of a tuple read only through ``tuple[i]`` (the items are then read directly, and the
        tuple register, holding them, lives until the function returns).
        """
        return num_bindings if self.pinned or self.last_use is None else self.end

    def refuse(self, reason: str, hazard: bool = False) -> None:
        """Mark as not plannable; ``hazard``: the stock planner would share it unsafely."""
        if self.refusal is None:
            self.refusal = reason
        self.hazard = self.hazard or hazard


@dataclass
class KernelCall:
    """A destination-passing call of a PrimFunc of the module."""

    index: int
    func: tirx.PrimFunc
    args: list[relax.Expr]
    arg_allocs: list[frozenset[int]]
    # Whether each argument starts at its allocation's first byte with its row-major layout
    # (the allocation itself, a re-binding or a reshape): only then may an output be placed
    # over it element for element.
    arg_exact: list[bool] = field(default_factory=list)


@dataclass
class FunctionFacts:
    """Everything the planner needs to know about one function (see the module docstring)."""

    allocations: list[Allocation]
    kernels: dict[int, KernelCall]
    num_bindings: int
    # Binding index at which each tirx var of a shape becomes available (-1: the signature).
    var_defined_at: dict[tirx.Var, int] = field(default_factory=dict)
    # Tuples read only through item accesses, which pin their items until the function returns
    # (see ``Allocation.mem_end``): (tuple var, index of its last item access) for those in a
    # non-dataflow block, where a kill may be inserted.
    pinning_tuples: list[tuple[relax.Var, int]] = field(default_factory=list)

    def release_pins(self) -> list[tuple[relax.Var, int]]:
        """Unpin the items of the tuples that a kill after their last access will release."""
        for var, _ in self.pinning_tuples:
            for alloc_id in self._tuple_items.get(var, frozenset()):
                self.allocations[alloc_id].pinned = False
        return list(self.pinning_tuples)

    _tuple_items: dict[relax.Var, frozenset[int]] = field(default_factory=dict)
    # Tensors ``blade_relax.regenerate`` hands back: var -> (binding index, the evicted
    # allocation whose memory it stands for). The runtime holds no reference to such a tensor
    # once the call returns, so a kernel output may take its memory where it dies.
    regenerated: dict[relax.Var, tuple[int, int]] = field(default_factory=dict)

    def shape_ready_at(self, alloc: Allocation) -> int:
        """The first binding index at which every dim of ``alloc``'s size is defined."""
        ready = -1
        for value in alloc.shape:
            for var in _tir_vars(value):
                ready = max(ready, self.var_defined_at.get(var, 1 << 60))
        return ready


def collect_facts(
    func: relax.Function,
    mod: tvm.IRModule,
    trusted_packed: Iterable[str] = (),
    no_plan: Iterable[str] = (),
) -> FunctionFacts:
    """Record the allocations of ``func`` and how they are used.

    Parameters
    ----------
    func
        A normalized Relax function (after ``CallTIRRewrite``).
    mod
        The module, to tell PrimFunc callees from others.
    trusted_packed
        Packed functions known to neither retain nor alias their tensor arguments (destination-
        passing library kernels): arguments passed to them stay plannable.
    no_plan
        Names of variables whose allocation must keep its own storage (e.g. tensors that the
        runtime may evict).

    Returns
    -------
    FunctionFacts
    """
    info = liveness(func, positions=False)
    # Classified once: what a call does decides its effect, its record and its refusals.
    insts = [
        classify(b.value, mod) if isinstance(b.value, relax.Call) else None for b in info.bindings
    ]
    readings = planner_readings(info.bindings, insts, mod, frozenset(trusted_packed))
    flow = storage_flow(
        info,
        lambda binding: readings[binding.index].effect,
        lambda var: UNSIZED,
        explicit_kills=False,
        fields=_FIELDS,
        lifetimes=False,
    )
    walk = _FactWalk(mod, frozenset(no_plan), flow.refs)
    for param in func.params:
        for var in _tir_vars_in_type(param.ty):
            walk.var_defined_at.setdefault(var, -1)
    body = func.body
    blocks = list(body.blocks) if isinstance(body, relax.SeqExpr) else []
    index = 0
    for block in blocks:
        for binding in block.bindings:
            walk.visit(binding, info.bindings[index], insts[index], readings[index])
            index += 1
    return walk.finish(body.body if isinstance(body, relax.SeqExpr) else body, index)


# The fields the planner follows: through re-bindings (``y = t``) and tuple literals nested in
# a field; a ``match_cast`` keeps what its value reads, the whole tuple.
_FIELDS = TupleFields(match_cast=False, through_aliases=True, nested_literals=True)


class _FactWalk:
    """The state of one :func:`collect_facts`: allocations, refusals and tuple reads so far;
    ``aliases`` (what each variable keeps alive) is the storage flow's."""

    def __init__(
        self,
        mod: tvm.IRModule,
        excluded: frozenset[str],
        aliases: Mapping[relax.Var, frozenset[int]],
    ):
        self.mod, self.excluded, self.aliases = mod, excluded, aliases
        self.allocs: list[Allocation] = []
        self.kernels: dict[int, KernelCall] = {}
        self.var_defined_at: dict[tirx.Var, int] = {}
        # Tuple-valued vars built by a Tuple binding, and whether something other than an item
        # access reads them (item accesses are canonicalized away before kills are inserted).
        self.tuple_read: dict[relax.Var, bool] = {}
        self.tuple_last: dict[relax.Var, int] = {}
        self.tuple_killable: dict[relax.Var, bool] = {}
        # Vars that refer to memory at an offset or with another element layout (memory.view).
        self.inexact: set[relax.Var] = set()
        self.tuple_items: dict[relax.Var, list[relax.Expr]] = {}
        self.regenerated: dict[relax.Var, tuple[int, int]] = {}

    def visit(
        self,
        binding: relax.Binding,
        info: BindingInfo,
        inst: Instruction | None,
        reading: Reading,
    ) -> None:
        """Record what one binding allocates, reads and refuses (``inst``: its classified
        call, ``reading``: what the planner trusts it to do)."""
        var, value = binding.var, binding.value
        index, block_index = info.index, info.block_index
        if isinstance(binding, relax.MatchCast):
            for tvar in _tir_vars_in_type(binding.ty):
                self.var_defined_at.setdefault(tvar, index)
        self._note_tuple_reads(value, info.uses, info.is_dataflow, index)
        self._note_uses(info.uses, block_index, index)
        if inst is not None:
            self._record(inst, var, index, block_index, value)
        for used, reason, hazard in reading.refusals:
            _refuse(self.allocs, _held(used, self.aliases), reason, hazard)
        result = self.aliases.get(var, frozenset())
        if len(result) == 1 and inst is not None and inst.kind is Kind.REGENERATE:
            self.regenerated[var] = (index, next(iter(result)))
        if _is_inexact(binding, value, self.inexact, self.tuple_items):
            self.inexact.add(var)
        if isinstance(value, relax.Tuple):
            self.tuple_items[var] = list(value.fields)
            self.tuple_read[var] = False
            self.tuple_last[var] = index
            self.tuple_killable[var] = not info.is_dataflow
        if var.name in self.excluded:
            for alloc_id in result:
                self.allocs[alloc_id].refuse("marked as not plannable (may be evicted)", True)

    def _record(
        self, inst: Instruction, var: relax.Var, index: int, block_index: int, call: relax.Call
    ) -> None:
        """The allocation or kernel call a call binding makes. An allocation's id is its
        position, as in the storage flow (the planner's effects allocate at the same calls)."""
        if inst.kind is Kind.TENSOR_ALLOC:
            self.allocs.append(_tensor_allocation(len(self.allocs), var, index, block_index, call))
        elif inst.kind is Kind.STORAGE_ALLOC:
            alloc = Allocation(
                id=len(self.allocs),
                var=var,
                index=index,
                block=block_index,
                kind="storage",
                call=call,
                size_prim=_storage_size(call),
                refusal="already planned storage",
            )
            self.allocs.append(alloc)
        elif inst.kind in (Kind.KERNEL, Kind.RELAX_CALL) and inst.callee is not None:
            callee = inst.callee
            mod = self.mod
            func = (
                mod[callee]
                if isinstance(callee, relax.GlobalVar) and callee in mod.functions
                else None
            )
            if isinstance(func, tirx.PrimFunc):
                args = list(inst.args)
                self.kernels[index] = KernelCall(
                    index=index,
                    func=func,
                    args=args,
                    arg_allocs=[_used_allocs(a, self.aliases) for a in args],
                )

    def _note_tuple_reads(
        self, value: relax.Expr, used: tuple[relax.Var, ...], in_dataflow: bool, index: int
    ) -> None:
        """Whether a tuple is read other than through an item access, and its last access
        (``used``: the variables the value reads)."""
        tuple_read = self.tuple_read
        item_of = (
            value.tuple_value
            if isinstance(value, relax.TupleGetItem)
            and isinstance(value.tuple_value, relax.Var)
            and value.tuple_value in tuple_read
            else None
        )
        for used_var in used:
            if used_var in tuple_read and not used_var.same_as(item_of):
                tuple_read[used_var] = True
        if item_of is not None:
            self.tuple_last[item_of] = index
            if in_dataflow:
                self.tuple_killable[item_of] = False

    def _note_uses(self, used: tuple[relax.Var, ...], block_index: int, index: int) -> None:
        """First and last use of every allocation the variables a value reads keep alive."""
        for alloc_id in _held(used, self.aliases):
            alloc = self.allocs[alloc_id]
            if alloc.first_use is None:
                alloc.first_use = index
            alloc.last_use = index
            if alloc.block != block_index:
                alloc.refuse("used outside the binding block that allocates it")

    def finish(self, result_expr: relax.Expr, index: int) -> FunctionFacts:
        """The facts, once the function's result (read at ``index``) is known."""
        allocs = self.allocs
        for used_var in _free_vars(result_expr):
            if used_var in self.tuple_read:
                self.tuple_read[used_var] = True
        pinning, pinned_items = self._pinning_tuples()
        for alloc_id in _used_allocs(result_expr, self.aliases):
            allocs[alloc_id].last_use = index
            allocs[alloc_id].refuse("part of the function's result")
        for alloc in allocs:
            if alloc.kind == "tensor" and alloc.first_use is None:
                # Never written by a kernel: nothing to gain, keep it as it is.
                alloc.refuse("never used")
        for call in self.kernels.values():
            call.arg_exact = [
                not (isinstance(a, relax.Var) and a in self.inexact) for a in call.args
            ]
        return FunctionFacts(
            allocations=allocs,
            kernels=self.kernels,
            num_bindings=index,
            var_defined_at=self.var_defined_at,
            pinning_tuples=pinning,
            _tuple_items=pinned_items,
            regenerated=self.regenerated,
        )

    def _pinning_tuples(
        self,
    ) -> tuple[list[tuple[relax.Var, int]], dict[relax.Var, frozenset[int]]]:
        """Pin the items of tuples read only through item accesses; those a kill may release."""
        pinning: list[tuple[relax.Var, int]] = []
        pinned_items: dict[relax.Var, frozenset[int]] = {}
        for tuple_var, read in self.tuple_read.items():
            if not read:
                items = self.aliases.get(tuple_var, frozenset())
                for alloc_id in items:
                    self.allocs[alloc_id].pinned = True
                if self.tuple_killable.get(tuple_var, False) and items:
                    pinning.append((tuple_var, self.tuple_last[tuple_var]))
                    pinned_items[tuple_var] = items
        return pinning, pinned_items


def _tensor_allocation(
    alloc_id: int, var: relax.Var, index: int, block_index: int, call: relax.Call
) -> Allocation:
    alloc = Allocation(
        id=alloc_id, var=var, index=index, block=block_index, kind="tensor", call=call
    )
    ty = call.ty
    shape = getattr(ty, "shape", None) if isinstance(ty, relax.TensorType) else None
    dtype = None if not isinstance(ty, relax.TensorType) or ty.dtype is None else str(ty.dtype)
    if not isinstance(shape, relax.ShapeExpr) or not dtype or dtype == "void":
        alloc.refuse("shape or dtype not known statically")
        return alloc
    alloc.shape = tuple(shape.values)
    alloc.dtype = dtype
    if len(call.args) >= 4 and isinstance(call.args[3], tvm.ir.StringImm):
        alloc.scope = str(call.args[3].value)
    alloc.device = call.args[2] if len(call.args) >= 3 else None
    if not isinstance(alloc.device, tirx.IntImm):
        alloc.refuse("device index not a constant")
    dt = tvm.runtime.DataType(dtype)
    if dt.lanes != 1 or dt.bits % 8 != 0:
        alloc.refuse(f"dtype {dtype} is not byte-sized")
        return alloc
    size = tirx.IntImm("int64", dt.bits // 8)
    for value in alloc.shape:
        size = size * _as_int64(value)
    # A canonical form (``n * 16`` rather than ``4 * n * 4``): what the storage size reads.
    alloc.size_prim = tvm.sym.Analyzer().simplify(size)
    return alloc


def _storage_size(call: relax.Call) -> object:
    size = call.args[0] if call.args else None
    if isinstance(size, relax.ShapeExpr) and len(size.values) == 1:
        return size.values[0]
    return None


def _as_int64(value: object) -> object:
    if isinstance(value, tirx.IntImm):
        return tirx.IntImm("int64", int(value.value))
    if str(getattr(getattr(value, "ty", None), "dtype", "int64")) != "int64":
        return tirx.Cast("int64", value)
    return value


def _held(used: Iterable[relax.Var], aliases: Mapping[relax.Var, frozenset[int]]) -> frozenset[int]:
    """The allocations ``used`` keep alive."""
    out: set[int] = set()
    for var in used:
        out |= aliases.get(var, frozenset())
    return frozenset(out)


def _used_allocs(expr: relax.Expr, aliases: Mapping[relax.Var, frozenset[int]]) -> frozenset[int]:
    if isinstance(expr, relax.Var):
        return aliases.get(expr, frozenset())
    out: set[int] = set()
    for var in relax.analysis.free_vars(expr):
        out |= aliases.get(var, frozenset())
    return frozenset(out)


def _is_inexact(
    binding: relax.Binding,
    value: relax.Expr,
    inexact: set[relax.Var],
    tuple_items: dict[relax.Var, list[relax.Expr]],
) -> bool:
    """Whether the bound var may refer to memory not at offset 0 / in another layout."""
    if isinstance(binding, relax.MatchCast) or isinstance(value, relax.Var):
        return isinstance(value, relax.Var) and value in inexact
    if isinstance(value, relax.TupleGetItem):
        items = (
            tuple_items.get(value.tuple_value) if isinstance(value.tuple_value, relax.Var) else None
        )
        if items is None or not 0 <= value.index < len(items):
            return True
        item = items[value.index]
        return isinstance(item, relax.Var) and item in inexact
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        if value.op.name not in VIEW_OPS:
            return False
        if value.op.name == "relax.reshape":  # the same bytes in the same order
            arg = value.args[0]
            return isinstance(arg, relax.Var) and arg in inexact
        return True  # memory.view / ensure_zero_offset: an offset or another layout
    return False


def _free_vars(expr: relax.Expr) -> list[relax.Var]:
    if isinstance(expr, relax.Var):
        return [expr]
    return list(relax.analysis.free_vars(expr))


def _refuse(
    allocs: list[Allocation], ids: Iterable[int], reason: str, hazard: bool = False
) -> None:
    for alloc_id in ids:
        allocs[alloc_id].refuse(reason, hazard)


def _tir_vars(value: object) -> list[tirx.Var]:
    if isinstance(value, tirx.Var):
        return [value]
    if isinstance(value, (tirx.IntImm, int)):
        return []
    return list(tirx.analysis.undefined_vars(value))


def _tir_vars_in_type(ty: object) -> list[tirx.Var]:
    try:
        return list(relax.analysis.tir_vars_in_type(ty))
    except (RuntimeError, TypeError) as err:  # TVM raises InternalError (a RuntimeError)
        # A type TVM's helper does not accept: its shape vars stay unknown, so an allocation
        # whose shape reads them is refused (left to the stock planner), never misplanned.
        warn_fallback("PlanMemory", "the shape vars of a parameter type", str(ty), err)
        return []

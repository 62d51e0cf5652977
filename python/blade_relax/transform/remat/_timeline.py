"""The timeline the remat runtime decides on, read from the IR the VM will run.

``Rematerialize`` runs before memory planning, but what the VM allocates is decided by the
planner (``StaticPlanBlockMemory``, ``PlanMemory``) and ``KillAfterLastUse``. So the timeline is
computed twice, each time by :func:`write_metadata`: ``Rematerialize`` attaches an estimate
from the lowered IR (every ``R.builtin.alloc_tensor`` its own storage, registers dropped after
their last use), and :class:`RematTimeline`, run after ``KillAfterLastUse``, replaces it with
the exact one read from the planned IR (``alloc_storage`` sizes, explicit kills). The second
write is an update, not a repetition: the planned IR does not exist when ``Rematerialize``
runs, and a module ``Rematerialize`` returned must carry a timeline of its own (a user's
pipeline without ``RematTimeline`` still works, on the estimate; ``RematTimeline`` reads the
slots' names, plans and costs back from it). The metadata is a
:class:`~blade_relax.contract.RematMetadata`.

:func:`simulate` walks a function once, tracking which storages each register keeps alive:

* points: every storage allocation (the live bytes right after it), every ``regenerate``
  call (the live bytes right before it) and every kernel call with a workspace (the live bytes
  while it runs, its workspace a storage live at that point only:
  :mod:`blade_relax.analysis.workspace`);
* each storage's live interval over the points, its size as a dim expression
  (:mod:`blade_relax.contract.dimexpr`) over the function's dims;
* each slot's window: ``start`` is the first point after the VM has let go of the evicted
  tensor's storage (the ``evict`` call keeps it in the runtime's stash when the tensor is
  kept), ``site`` the point of its ``regenerate`` call.

Calls of other Relax functions are followed: the callee's storages join the timeline at the
call (its dims expressed in the caller's from the argument shapes), its registers die when it
returns, and its result also lives in the VM's return register (``return_value_`` in TVM's
``vm.cc``) until the next function returns. What cannot be followed (an ``If``, a tensor a
packed function makes, a callee whose dims the arguments do not define) makes the
simulation inexact, with a note saying why.

It also checks the alias hazard: a storage held by the stash or by a regenerated tensor must
never receive another tensor (a planner that did not see the alias would overwrite it), and
raises :class:`RematHazardError` if it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ...analysis.dimexpr import UndefinedVariable, from_prim_expr
from ...analysis.effects import Kind, classify
from ...analysis.liveness import liveness
from ...analysis.storage_flow import Holders, death_points
from ...analysis.workspace import call_reads
from ...contract import (
    REMAT_META_ATTR,
    REMAT_REGEN_ATTR,
    PlanNode,
    RematMetadata,
    RematSlot,
    metadata_key,
)
from ...util.collection import pauses_collection

__all__ = [
    "RematHazardError",
    "RematTimeline",
    "Simulation",
    "SlotSpec",
    "attach_metadata",
    "prim_to_py",
    "simulate",
    "write_metadata",
]

# The VM builtin that calls a closure (the function inserts it to call ``release``).
INVOKE_CLOSURE = "vm.builtin.invoke_closure"


class RematHazardError(RuntimeError):
    """A storage the remat runtime may still hand out was given to another tensor."""


# --------------------------------------------------------------------------- expressions
def prim_to_py(expr: Any, rename: dict[Any, str] | None = None, strict: bool = False) -> str:
    """The dim expression of a TIR ``PrimExpr`` over the function's dims (names are the vars'
    names): :func:`blade_relax.analysis.dimexpr.from_prim_expr`.

    ``rename`` replaces variables by given text (to express a kernel's sizes in its caller's
    dims); with ``strict``, a variable missing from ``rename`` is an error (a callee's var may
    share its name with an unrelated dim of the caller).

    Raises
    ------
    ValueError
        For a node without a dim expression, or a variable ``strict`` refuses (the message,
        which the timeline's notes quote, says which).
    """
    try:
        return from_prim_expr(expr, rename, strict=strict)
    except UndefinedVariable as err:
        raise ValueError(
            f"symbolic var {err.var.name} is not defined by the call's arguments"
        ) from None


def _itemsize(dtype: Any) -> int:
    dt = tvm.runtime.DataType(str(dtype))
    return (dt.bits * dt.lanes + 7) // 8


def tensor_bytes_py(ty: relax.TensorType, rename: dict[Any, str] | None = None) -> str:
    """Bytes of a tensor type as a dim expression (``rename``: see :func:`prim_to_py`)."""
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr) or ty.dtype is None:
        raise ValueError(f"tensor type without a known shape and dtype: {ty}")
    terms = [prim_to_py(v, rename, strict=rename is not None) for v in shape.values] or ["1"]
    return f"({' * '.join(terms)} * {_itemsize(ty.dtype)})"


def _dtype_of(value: Any) -> Any:
    return getattr(value, "value", value)


# --------------------------------------------------------------------------- simulation
@dataclass
class StorageInterval:
    """One storage: its size and the points ``[first, end)`` where it is live."""

    size: str
    first: int
    end: int
    name: str = ""


@dataclass
class SlotWindow:
    """Where one slot's bytes are gone when it is evicted."""

    nbytes: str = "0"
    start: int | None = None
    site: int | None = None


@dataclass
class Simulation:
    """The result of :func:`simulate`."""

    points: int = 0
    storages: list[StorageInterval] = field(default_factory=list)
    slots: dict[int, SlotWindow] = field(default_factory=dict)
    exact: bool = True
    notes: list[str] = field(default_factory=list)

    def peak_expr(self) -> str:
        """The largest live bytes at any allocation point, as a Python expression."""
        if not self.storages:
            return "0"
        terms = []
        for point in range(self.points):
            live = [s.size for s in self.storages if s.first <= point < s.end]
            if any(s.first == point for s in self.storages):
                terms.append(" + ".join(live) if live else "0")
        unique = list(dict.fromkeys(terms))
        return unique[0] if len(unique) == 1 else f"max({', '.join(unique)})"


# Deepest chain of Relax function calls the simulation follows (a deeper or recursive chain
# makes the timeline inexact).
_MAX_CALL_DEPTH = 8


class _InexactCall(Exception):
    """A called Relax function the simulation cannot follow (the reason is the message)."""


class _VMReturn:
    """The VM's return register (``return_value_`` in TVM's ``vm.cc``) as a holder of storages.

    Every ``Ret`` of a VM function stores the returned value there, where it stays until the
    next ``Ret``: a callee's result outlives the caller's kill of it until then.
    """

    name = "vm.return_value"


def simulate(func: relax.Function, mod: tvm.IRModule, stage: str) -> Simulation:
    """Walk ``func`` and record its storages, points and slot windows.

    Calls of other Relax functions of ``mod`` are followed: the callee's storages join the
    timeline at the call, its dims are expressed in the caller's from the shapes of the call's
    arguments, its registers die when it returns, and its result lives in the VM's return
    register until the next function returns. A call the simulation cannot follow (control
    flow in the callee, dims it cannot map, recursion) makes the timeline inexact, as does any
    ``If`` or any tensor made outside the VM's allocator; :attr:`Simulation.notes` says why.

    Parameters
    ----------
    func
        A normalized Relax function, non-dataflow.
    mod
        Its module (to tell PrimFunc kernels from Relax calls, and to follow calls).
    stage
        ``"lowered"`` (``R.builtin.alloc_tensor`` allocates, registers die after their last
        use) or ``"memory"`` (``alloc_storage`` allocates, explicit kills).

    Returns
    -------
    Simulation

    Raises
    ------
    RematHazardError
        A storage held by the runtime's stash or by a regenerated tensor receives another
        tensor.
    """
    walker = _Walker(mod, stage)
    walker.run(func, None, {}, ())
    sim = walker.sim
    for sid, storage in enumerate(sim.storages):
        end = walker.ends[sid]
        storage.end = sim.points if end is None else end
    return sim


class _Walker:
    """The state of one :func:`simulate`: storages, their holders, the stash."""

    def __init__(self, mod: tvm.IRModule, stage: str) -> None:
        self.mod = mod
        self.stage = stage
        self.sim = Simulation()
        self.holders = Holders()
        self.stash: dict[int, frozenset[int]] = {}
        self.stashed: dict[int, int] = {}
        self.tainted: set[int] = set()
        self.ends: dict[int, int | None] = {}
        self.ret = _VMReturn()

    # ----------------------------------------------------------------- holders
    def drop(self, var: Any) -> None:
        """``var``'s register dies: it lets go of what it holds, and its record goes."""
        sim = self.sim
        for sid in self.holders.let_go(var):
            if self.stashed.get(sid, 0) == 0:
                if self.ends[sid] is None:
                    self.ends[sid] = sim.points
            else:
                for slot, sids in self.stash.items():
                    window = sim.slots[slot]
                    if (
                        sid in sids
                        and window.start is None
                        and not any(self.holders.is_held(s) for s in sids)
                    ):
                        window.start = sim.points
        self.holders.forget(var)

    def allocate(self, var: relax.Var, size: str) -> None:
        sim = self.sim
        sid = len(sim.storages)
        sim.storages.append(StorageInterval(size=size, first=sim.points, end=-1, name=var.name))
        self.ends[sid] = None
        self.holders.add(sid)
        self.holders.hold(var, frozenset({sid}))
        sim.points += 1

    def workspace(self, call: relax.Call, var: relax.Var, rename: dict[Any, str] | None) -> None:
        """A kernel's workspace: a storage live at one point of its own, while the kernel runs
        (:mod:`blade_relax.analysis.workspace`; the runtime accounting counts the same bytes)."""
        found = call_reads(call, var, self.mod)
        if found is None or found[0].is_empty:
            return
        ws, values = found
        if any(v is None for v in values):
            self.inexact(f"workspace of {ws.kernel}: the call's types do not give its size")
            return
        sim = self.sim
        size = ws.substitute([self.py(v, rename) for v in values])
        sid = len(sim.storages)
        sim.storages.append(
            StorageInterval(size=size, first=sim.points, end=-1, name=f"workspace:{ws.kernel}")
        )
        self.ends[sid] = sim.points + 1
        self.holders.add(sid)
        sim.points += 1

    def hold(self, var: Any, sids: frozenset[int]) -> None:
        self.holders.hold(var, sids)

    def held_by(self, expr: Any) -> frozenset[int]:
        """Storages an argument or a result expression keeps alive."""
        if isinstance(expr, relax.Var):
            return self.holders.held(expr)
        if isinstance(expr, relax.Tuple):
            out: frozenset[int] = frozenset()
            for field_ in expr.fields:
                out |= self.held_by(field_)
            return out
        return frozenset()

    def inexact(self, note: str) -> None:
        self.sim.exact = False
        self.sim.notes.append(note)

    # ----------------------------------------------------------------- one function
    def run(
        self,
        func: relax.Function,
        rename: dict[Any, str] | None,
        params: dict[relax.Var, frozenset[int]],
        chain: tuple[str, ...],
    ) -> frozenset[int]:
        """Walk one function (a callee when ``rename`` is a dict); its result's storages."""
        for param in func.params:
            self.hold(param, params.get(param, frozenset()))
        deaths = death_points(liveness(func), params=True) if self.stage == "lowered" else {}
        index = 0
        for block in func.body.blocks:
            for binding in block.bindings:
                self.bind(binding, rename, chain)
                for dead in deaths.get(index, ()):
                    self.drop(dead)
                index += 1
        return self.held_by(func.body.body) if rename is not None else frozenset()

    def py(self, expr: Any, rename: dict[Any, str] | None) -> str:
        return prim_to_py(expr, rename, strict=rename is not None)

    def bind(self, binding: relax.Binding, rename: dict[Any, str] | None, chain) -> None:
        var, value = binding.var, binding.value
        sim, stage = self.sim, self.stage
        sources: list[Any] = []
        if isinstance(value, relax.Var):
            sources = [value]
        elif isinstance(value, relax.Tuple):
            sources = list(value.fields)
        elif isinstance(value, relax.TupleGetItem):
            sources = [value.tuple_value]
        elif isinstance(value, relax.Call):
            inst = classify(value, self.mod)
            kind, name, args = inst.kind, inst.name, list(inst.args)
            if kind is Kind.STORAGE_ALLOC:
                size = args[0]
                values = size.values if isinstance(size, relax.ShapeExpr) else None
                if values is None:
                    raise ValueError(f"alloc_storage with a size the timeline cannot read: {size}")
                count = " * ".join(self.py(v, rename) for v in values) or "1"
                itemsize = 1
                if name == "relax.vm.alloc_storage":
                    itemsize = _itemsize(_dtype_of(args[2]))
                self.allocate(var, f"({count} * {itemsize})" if itemsize != 1 else f"({count})")
            elif kind is Kind.TENSOR_ALLOC and stage == "lowered":
                self.allocate(var, tensor_bytes_py(var.ty, rename))
            elif kind is Kind.TENSOR_IN_STORAGE:
                sids = self.holders.held(args[0])
                if sids & (self.tainted | set(self.stashed)):
                    raise RematHazardError(
                        f"`{var.name}` is placed in a storage that holds an evictable or "
                        "regenerated tensor: the memory plan does not see that alias"
                    )
                sources = [args[0]]
            elif kind is Kind.KILL:
                if args and isinstance(args[0], relax.Var):
                    self.drop(args[0])
            elif kind is Kind.VIEW:
                sources = [a for a in args[:1] if isinstance(a, relax.Var)]
            elif kind is Kind.EVICT:
                slot = int(args[1].value)
                sids = self.holders.held(args[2])
                window = sim.slots.setdefault(slot, SlotWindow())
                window.nbytes = " + ".join(sim.storages[s].size for s in sorted(sids)) or "0"
                self.stash[slot] = sids
                for sid in sids:
                    self.stashed[sid] = self.stashed.get(sid, 0) + 1
            elif kind is Kind.REGENERATE:
                slot = int(args[1].value)
                window = sim.slots.setdefault(slot, SlotWindow())
                window.site = sim.points
                sim.points += 1
                sids = self.stash.pop(slot, frozenset())
                for sid in sids:
                    self.stashed[sid] -= 1
                self.tainted.update(sids)
                self.hold(var, sids)
            elif kind is Kind.REMAT_BEGIN:
                pass  # no memory: the frame
            elif kind is Kind.KERNEL and name is None:
                # A kernel writes into its arguments; its workspace lives while it runs.
                self.workspace(value, var, rename)
            elif kind is Kind.RELAX_CALL:
                self.call(var, inst.callee, list(value.args), rename, chain)
            elif name == INVOKE_CLOSURE and args and isinstance(args[0], relax.GlobalVar):
                self.call(var, args[0], list(args[1:]), rename, chain)
            elif (
                name is not None
                and name.startswith("relax.")
                and not name.startswith(("relax.call_", "relax.null_value"))
            ):
                pass  # operators that allocate nothing at this stage (shape ops, ...)
            else:
                if isinstance(var.ty, relax.TensorType | relax.TupleType):
                    self.inexact(f"tensor from {name}")
        elif isinstance(value, relax.If):
            self.inexact("control flow (If)")
        if isinstance(binding, relax.MatchCast) and isinstance(value, relax.Var):
            sources = [value]
        if sources:
            sids: frozenset[int] = frozenset()
            for s in sources:
                if isinstance(s, relax.Var):
                    sids |= self.holders.held(s)
            self.hold(var, sids)

    # ----------------------------------------------------------------- calls
    def call(
        self,
        var: relax.Var,
        gv: relax.GlobalVar,
        call_args: list[relax.Expr],
        rename: dict[Any, str] | None,
        chain: tuple[str, ...],
    ) -> None:
        """Follow a call of a Relax function of the module."""
        callee = self.mod[gv] if gv in self.mod.functions else None
        result: frozenset[int] | None = None
        try:
            if not isinstance(callee, relax.Function):
                raise _InexactCall(f"call of {gv.name_hint}, not a Relax function of the module")
            if gv.name_hint in chain or len(chain) >= _MAX_CALL_DEPTH:
                raise _InexactCall(f"recursive or too deep call of {gv.name_hint}")
            if callee.attrs is not None and REMAT_META_ATTR in callee.attrs:
                raise _InexactCall(f"call of {gv.name_hint}, itself rematerialized")
            inner = self.callee_dims(callee, call_args, rename)
            params = {p: self.held_by(a) for p, a in zip(callee.params, call_args)}
            result = self.run(callee, inner, params, (*chain, gv.name_hint))
        except _InexactCall as err:
            self.inexact(str(err))
        except ValueError as err:  # a size the caller's dims cannot express
            self.inexact(f"call of {gv.name_hint}: {err}")
        if result is None:
            # What the callee allocates is unknown; its result may alias its arguments.
            result = frozenset()
            for arg in call_args:
                result |= self.held_by(arg)
        self.hold(var, result)
        # The callee's Ret: its result goes to the VM's return register (the value there
        # before is released), and its frame is gone with every register.
        self.drop(self.ret)
        self.hold(self.ret, result)
        if isinstance(callee, relax.Function):
            for param in callee.params:
                self.drop(param)
            for block in callee.body.blocks:
                for binding in block.bindings:
                    self.drop(binding.var)

    def callee_dims(
        self,
        callee: relax.Function,
        args: Sequence[relax.Expr],
        rename: dict[Any, str] | None,
    ) -> dict[Any, str]:
        """The callee's symbolic vars as expressions over the caller's dims."""
        if len(callee.params) != len(args):
            raise _InexactCall("call with another number of arguments than parameters")
        inner: dict[Any, str] = {}

        def match(formal: Sequence[Any], actual: Sequence[Any] | None) -> None:
            if actual is None or len(actual) != len(formal):
                return
            for f, a in zip(formal, actual):
                if isinstance(f, tvm.tirx.Var) and f not in inner:
                    inner[f] = f"({self.py(a, rename)})"

        for param, arg in zip(callee.params, args):
            pty, aty = param.ty, getattr(arg, "ty", None)
            if isinstance(pty, relax.TensorType) and isinstance(pty.shape, relax.ShapeExpr):
                shape = getattr(aty, "shape", None)
                match(
                    pty.shape.values, shape.values if isinstance(shape, relax.ShapeExpr) else None
                )
            elif isinstance(pty, relax.ShapeType) and pty.values is not None:
                match(pty.values, arg.values if isinstance(arg, relax.ShapeExpr) else None)
            elif isinstance(pty, tvm.ir.PrimType) and getattr(pty, "value", None) is not None:
                actual = getattr(aty, "value", None)
                match([pty.value], [actual] if actual is not None else None)
        return inner


# --------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class SlotSpec:
    """What ``Rematerialize`` decides about one slot; the simulation gives the rest.

    Attributes
    ----------
    name
        The evictable tensor's variable.
    regen
        The name of its regeneration function in the module.
    cost
        Its recompute cost, a dim expression.
    plan
        The regeneration closures its ``regenerate`` call runs.
    """

    name: str
    regen: str
    cost: str
    plan: tuple[PlanNode, ...]


def slot_specs(meta: RematMetadata) -> list[SlotSpec]:
    """The slots of written metadata, as ``Rematerialize`` decided them."""
    return [SlotSpec(s.name, s.regen, meta.exprs[s.cost], s.plan) for s in meta.slots]


def build_metadata(
    function: str,
    dims: Sequence[str],
    sim: Simulation,
    slots: Sequence[SlotSpec],
    regen_peaks: Sequence[str],
    exact: bool,
) -> RematMetadata:
    """Assemble the metadata the runtime reads.

    Parameters
    ----------
    function
        Name of the rematerialized function.
    dims
        Names of the dims ``remat_begin`` receives, in order.
    sim
        The simulation of the function.
    slots
        Per slot, what ``Rematerialize`` decided.
    regen_peaks
        Per slot, the peak bytes of its regeneration function (expression).
    exact
        Whether the simulation read the planned IR.
    """
    exprs: list[str] = []
    index_of: dict[str, int] = {}

    def expr(text: str) -> int:
        if text not in index_of:
            index_of[text] = len(exprs)
            exprs.append(text)
        return index_of[text]

    storages = tuple((expr(s.size), s.first, s.end) for s in sim.storages)
    out_slots = []
    for k, spec in enumerate(slots):
        window = sim.slots.get(k, SlotWindow())
        site = window.site if window.site is not None else 0
        start = window.start if window.start is not None and window.site is not None else site + 1
        out_slots.append(
            RematSlot(
                name=spec.name,
                regen=spec.regen,
                nbytes=expr(window.nbytes),
                cost=expr(spec.cost),
                regen_peak=expr(regen_peaks[k]),
                start=start,
                site=site,
                plan=spec.plan,
            )
        )
    return RematMetadata(
        function=function,
        dims=tuple(dims),
        exact=bool(exact and sim.exact),
        notes=tuple(dict.fromkeys(sim.notes)),
        points=max(sim.points, 1),
        exprs=tuple(exprs),
        storages=storages,
        slots=tuple(out_slots),
    )


def write_metadata(
    func: relax.Function,
    mod: tvm.IRModule,
    stage: str,
    function: str,
    dims: Sequence[str],
    slots: Sequence[SlotSpec],
) -> relax.Function:
    """Simulate ``func`` and its slots' regeneration functions at ``stage``, and attach the
    metadata: the one way metadata is written.

    ``Rematerialize`` writes it at the ``"lowered"`` stage (an estimate: every
    ``R.builtin.alloc_tensor`` its own storage), :class:`RematTimeline` again at the
    ``"memory"`` stage, after planning and ``KillAfterLastUse``, where the timeline is exact
    (see the module docstring for why both).

    Parameters
    ----------
    func
        The rewritten function.
    mod
        A module holding ``func``'s callees and the regeneration functions of ``slots``.
    stage
        As for :func:`simulate`; the metadata is exact only at ``"memory"``.
    function, dims, slots
        As for :func:`build_metadata`.

    Raises
    ------
    ValueError
        When a slot's regeneration function is missing from ``mod``.
    RematHazardError
        As :func:`simulate`.
    """
    regens = regen_functions(mod)
    sim = simulate(func, mod, stage)
    peaks = []
    for slot in slots:
        regen = regens.get(slot.regen)
        if regen is None:
            raise ValueError(f"regeneration function {slot.regen} is missing from the module")
        regen_sim = simulate(regen, mod, stage)
        if not regen_sim.exact:
            sim.exact = False
            sim.notes.extend(f"{slot.regen}: {note}" for note in regen_sim.notes)
        peaks.append(regen_sim.peak_expr())
    meta = build_metadata(function, dims, sim, slots, peaks, exact=stage == "memory")
    return attach_metadata(func, meta)


def metadata_constant(text: str) -> relax.Expr:
    """The ``uint8`` tensor constant that carries the metadata JSON into the executable."""
    return relax.const(np.frombuffer(text.encode(), dtype=np.uint8).copy(), "uint8")


def attach_metadata(func: relax.Function, meta: RematMetadata) -> relax.Function:
    """Write ``meta`` into the ``remat_begin`` call of ``func`` and into its attribute."""
    text = meta.to_json()
    key = metadata_key(meta.function, text)
    body = func.body
    blocks = []
    replaced = False
    for block in body.blocks:
        bindings = []
        for binding in block.bindings:
            value = binding.value
            if not replaced and isinstance(value, relax.Call):
                inst = classify(value)
                args = list(inst.args)
                if inst.kind is Kind.REMAT_BEGIN:
                    new_args = relax.Tuple(
                        [tvm.ir.StringImm(key), metadata_constant(text), *args[2:]]
                    )
                    value = relax.Call(
                        value.op, [value.args[0], new_args], value.attrs, value.ty_args
                    )
                    binding = relax.VarBinding(binding.var, value)
                    replaced = True
            bindings.append(binding)
        blocks.append(
            relax.DataflowBlock(bindings)
            if isinstance(block, relax.DataflowBlock)
            else relax.BindingBlock(bindings)
        )
    new_func = relax.Function(
        func.params,
        relax.SeqExpr(blocks, body.body),
        func.ret_ty,
        func.is_pure,
        func.attrs,
        func.span,
    )
    return relax.BlockBuilder().normalize(new_func.with_attr(REMAT_META_ATTR, text))


def regen_functions(mod: tvm.IRModule) -> dict[str, relax.Function]:
    """The regeneration functions of ``mod`` by name."""
    out = {}
    for gv, func in mod.functions.items():
        if (
            isinstance(func, relax.Function)
            and func.attrs is not None
            and REMAT_REGEN_ATTR in func.attrs
        ):
            out[gv.name_hint] = func
    return out


def refresh_metadata(mod: tvm.IRModule, stage: str) -> tvm.IRModule:
    """Rewrite the metadata of every rematerialized function of ``mod`` at ``stage``: the
    same slots, the timeline simulated again (:func:`write_metadata`)."""
    updates = {}
    for gv, func in mod.functions.items():
        if (
            not isinstance(func, relax.Function)
            or func.attrs is None
            or REMAT_META_ATTR not in func.attrs
        ):
            continue
        old = RematMetadata.from_json(str(func.attrs[REMAT_META_ATTR]))
        updates[gv] = write_metadata(func, mod, stage, old.function, old.dims, slot_specs(old))
    if not updates:
        return mod
    mod = mod.clone() if hasattr(mod, "clone") else mod
    for gv, func in updates.items():
        mod[gv] = func
    return mod


@tvm.transform.module_pass(opt_level=0, name="RematTimeline")
class RematTimeline:
    """Replace the estimated remat timeline with the one read from the planned IR.

    Runs after ``KillAfterLastUse`` (the IR then holds ``alloc_storage`` with the planned sizes
    and the VM's kills) and before ``VMShapeLower``. The metadata ``Rematerialize`` wrote is
    written again, through the same :func:`write_metadata`: an update, since the planned IR did
    not exist when it was first written (see the module docstring). A module without
    rematerialized functions passes through unchanged.
    """

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return refresh_metadata(mod, "memory")

"""Storage flow of a Relax function: what each variable keeps alive, who holds it, when it dies.

Every memory model of the project asks the same first questions of a function before its own:
which allocations a binding creates, which allocations each variable keeps alive (directly,
through a tuple or one of its fields, a view, a tensor placed in a storage, or a runtime object
that keeps a value for a later binding), and after which binding the last holder of an
allocation lets it go. This module answers them once, in one walk over the bindings; its
readers are the symbolic timeline (:func:`blade_relax.analysis.memory_timeline`, whose
evaluations, samples and proofs read the allocations it gives) and the models of the memory
passes (the schedule's block model, the planner's facts, rematerialization's roots; the remat
storage walk keeps its holders in :class:`Holders` and its kills at :func:`death_points`).

What one binding does to memory is not decided here: the caller passes the bindings'
:class:`~.effects.ValueEffect` (the op table of :mod:`.effects`). The walk follows the effects:

* ``allocates``: a new allocation, held by the bound variable;
* ``aliases``: the bound variable keeps alive what those variables keep (a field read of a
  tuple built in the function keeps only that field's allocations);
* ``keeps`` / ``takes``: a runtime object keeps what a variable holds under a key for a later
  binding, which takes it back (``evict`` / ``regenerate``); while kept, the pair is a holder;
* ``kills``: at the memory stage (explicit kills), the killed register lets go of what it
  holds. Before it, a register dies after its last use (the liveness ``KillAfterLastUse`` will
  give the VM), and at once when it is never used.

An allocation ends at the first binding after which no holder is left; ``None`` when it
outlives the function (returned, or held by a register never killed).

The models differ in a few questions around the walk, each a parameter of
:func:`storage_flow`, never a walk of their own: which effects they give the bindings (a pass
that does not trust an unknown call says its result aliases every argument), whether the
parameters are buffers of their own (live on entry), whether the bindings are one block of a
function whose earlier values are buffers live on entry (``outside``), and how far a tuple's
fields stay known (:class:`TupleFields`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tvm import relax

from ..symbolic import SymbolicExpr
from .effects import ValueEffect, returns_nothing
from .liveness import BindingInfo, Liveness

__all__ = ["Allocation", "Holders", "StorageFlow", "TupleFields", "death_points", "storage_flow"]

_ZERO = SymbolicExpr.constant(0)


@dataclass(frozen=True)
class Allocation:
    """One allocation: created at binding ``start``, freed after binding ``end``.

    ``start`` is -1 for a buffer live on entry (a parameter's, see ``params_live`` of
    :func:`storage_flow`, or a value from outside the bindings, see ``outside``). ``end`` is
    ``None`` when the allocation outlives the function (it is returned, or a register that is
    never killed holds it). ``field`` is the field of ``var``'s tuple value the allocation is,
    for one of a call's per-field allocations (``ValueEffect.field_allocates``).
    """

    id: int
    var: relax.Var
    nbytes: SymbolicExpr
    start: int
    end: int | None
    field: int | None = None


@dataclass(frozen=True)
class StorageFlow:
    """The storage flow of one function (see the module docstring).

    Attributes
    ----------
    allocations
        Every allocation, in the order the bindings create them (``id`` is the position).
    refs
        Per variable (parameters included), the ids of the allocations it keeps alive when it
        is bound.
    refs_in_order
        The same, in the order the variable's value meets them: what it aliases in the order
        of its effect's ``aliases`` (a tuple's fields in order), then what it allocates. For a
        model that mirrors an allocator whose choices follow the order of a call's arguments.
    touched
        Per binding, the allocations it touches (its result and what its inputs keep alive)
        and the workspace its kernel holds while it runs.
    outputs
        The allocations the function's result keeps alive.
    """

    allocations: list[Allocation]
    refs: dict[relax.Var, frozenset[int]] = field(repr=False)
    touched: list[tuple[tuple[int, ...], SymbolicExpr]] = field(repr=False)
    outputs: frozenset[int] = frozenset()
    refs_in_order: dict[relax.Var, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def workspaces(self) -> list[SymbolicExpr]:
        """Per binding, the workspace its kernel holds while it runs."""
        return [workspace for _, workspace in self.touched]


def death_points(info: Liveness, *, params: bool = False) -> dict[int, list[relax.Var]]:
    """Per binding index, the variables whose register dies after it when the function has no
    explicit kills (``KillAfterLastUse``'s view): after their last use, or at once when never
    used; a variable the function returns (read at ``info.end``) never dies.

    With ``params``, parameters die after their last use too (a parameter never read is not
    dropped): what a callee's registers do when its caller's storages are passed in.
    """
    death: dict[int, list[relax.Var]] = {}
    n = len(info.bindings)
    if params:
        for param in info.params:
            last = info.last_use(param)
            if last is not None and last < n:
                death.setdefault(last, []).append(param)
    for binding in info.bindings:
        last = info.last_use(binding.var)
        if last is None:
            death.setdefault(binding.index, []).append(binding.var)
        elif last < n:
            death.setdefault(last, []).append(binding.var)
    return death


class Holders:
    """Who keeps each storage alive: the one bookkeeping of holders that every walk over
    storages uses (the symbolic flow below, and ``Rematerialize``'s walk of the VM's
    registers, callees and stash).

    A holder is anything hashable: a variable (its register), a pair a runtime object keeps a
    value under, the VM's return register. A storage is an integer id. A holder keeps a set
    of storages; a storage is live while any holder keeps it.
    """

    def __init__(self) -> None:
        self._held: dict[object, frozenset[int]] = {}
        self._holders: dict[int, set[object]] = {}

    def add(self, storage: int) -> None:
        """A new storage, held by nobody yet."""
        self._holders[storage] = set()

    def hold(self, holder: object, storages: frozenset[int]) -> None:
        """``holder`` now keeps ``storages`` (what it kept before is not let go)."""
        self._held[holder] = storages
        for storage in storages:
            self._holders[storage].add(holder)

    def held(self, holder: object) -> frozenset[int]:
        """The storages ``holder`` keeps (none for a holder never seen)."""
        return self._held.get(holder, frozenset())

    def __contains__(self, holder: object) -> bool:
        """Whether ``holder`` has a record: it was given storages (maybe none) and is not
        forgotten."""
        return holder in self._held

    def is_held(self, storage: int) -> bool:
        return bool(self._holders[storage])

    def let_go(self, holder: object, storages: frozenset[int] | None = None) -> list[int]:
        """``holder`` no longer keeps ``storages`` (by default all it keeps); the storages it
        was the last holder of, in the order given."""
        storages = self.held(holder) if storages is None else storages
        for storage in storages:
            self._holders[storage].discard(holder)
        return [storage for storage in storages if not self._holders[storage]]

    def forget(self, holder: object) -> frozenset[int]:
        """Drop ``holder``'s record (not its storages' holders); what it kept."""
        return self._held.pop(holder, frozenset())


@dataclass(frozen=True)
class TupleFields:
    """How far the flow knows the fields of a tuple the function builds.

    A field read (``t[i]``) of a tuple whose fields are known keeps only that field alive;
    otherwise it keeps the whole tuple. The fields of a ``Tuple`` binding are always known;
    the rest is the precision a model proves its decisions with, so each model keeps its own.

    Attributes
    ----------
    match_cast
        A ``match_cast`` is read as a plain binding of its value: it knows the fields the
        value has, and a field read keeps only its field (else it keeps the whole tuple).
    through_aliases
        A re-binding ``y = t`` knows ``t``'s fields.
    through_items
        A field read ``a = t[i]`` whose field is itself a tuple with known fields knows them.
    nested_literals
        A field that is a tuple literal keeps what the variables in it keep (without it,
        nothing: the op table's tuple effect reads only fields that are variables).
    """

    match_cast: bool = True
    through_aliases: bool = False
    through_items: bool = False
    nested_literals: bool = False


class _Flow:
    """The mutable state of one :func:`storage_flow`: the holders, what each variable keeps in
    order, tuple fields, the keys runtime objects keep values under, and the allocations made
    so far."""

    def __init__(
        self,
        fields: TupleFields,
        outside: Callable[[relax.Var], SymbolicExpr | None] | None = None,
        lifetimes: bool = True,
    ) -> None:
        self.holders = Holders()
        # Without lifetimes no holder lets go, so what each variable keeps is all there is.
        self.lifetimes = lifetimes
        self.fields = fields
        self.outside = outside
        # What each variable keeps, in the order its value met them (``Holders`` keeps sets).
        self.order: dict[relax.Var, tuple[int, ...]] = {}
        self.field_refs: dict[relax.Var, list[tuple[int, ...]]] = {}
        # The field expressions of tuples with known fields (only to follow ``through_items``).
        self.field_exprs: dict[relax.Var, list[relax.Expr]] = {}
        # Per runtime object, the keys it was given a value under: a pair ``(owner, key)`` is a
        # holder while the holders have its record (see :meth:`take`); the owner's keys are
        # only there to drop the pairs with it.
        self.keys: dict[relax.Var, list[object]] = {}
        self.sizes: list[SymbolicExpr] = []
        self.owners: list[relax.Var] = []
        self.starts: list[int] = []
        self.ends: list[int | None] = []
        self.field_of: list[int | None] = []

    def held(self, var: relax.Var) -> tuple[int, ...]:
        """What ``var`` keeps alive, in order; a value from outside the bindings is met here
        first (see ``outside`` of :func:`storage_flow`)."""
        own = self.order.get(var)
        if own is None:
            own = self._meet_outside(var)
        return own

    def _meet_outside(self, var: relax.Var) -> tuple[int, ...]:
        if self.outside is None:
            return ()
        nbytes = self.outside(var)
        own = () if nbytes is None else (self.allocate(var, nbytes, -1),)
        self.hold(var, own)
        return own

    def hold(self, var: relax.Var, own: tuple[int, ...]) -> None:
        self.order[var] = own
        if self.lifetimes:
            self.holders.hold(var, frozenset(own))

    def aliased(self, binding: BindingInfo, effect: ValueEffect) -> dict[int, None]:
        """What the bound value keeps alive through the variables it aliases, in order."""
        value = binding.value
        if (
            isinstance(value, relax.TupleGetItem)
            and value.tuple_value in self.field_refs
            and (self.fields.match_cast or not binding.is_match_cast)
        ):
            fields = self.field_refs[value.tuple_value]
            if 0 <= value.index < len(fields):
                # A field read keeps only that field alive, not the whole tuple.
                return dict.fromkeys(fields[value.index])
        own: dict[int, None] = {}
        for source in effect.aliases:
            own.update(dict.fromkeys(self.held(source)))
        return own

    def note_fields(self, binding: BindingInfo) -> None:
        """The fields the bound variable is known to have (see :class:`TupleFields`)."""
        var, value, rules = binding.var, binding.value, self.fields
        if binding.is_match_cast and not rules.match_cast:
            return
        if isinstance(value, relax.Tuple):
            self.field_refs[var] = [self._field(f) for f in value.fields]
            if rules.through_items:
                self.field_exprs[var] = list(value.fields)
        elif rules.through_aliases and isinstance(value, relax.Var) and value in self.field_refs:
            self.field_refs[var] = self.field_refs[value]
            if value in self.field_exprs:
                self.field_exprs[var] = self.field_exprs[value]
        elif (
            rules.through_items
            and isinstance(value, relax.TupleGetItem)
            and value.tuple_value in self.field_exprs
        ):
            field_ = self.field_exprs[value.tuple_value][value.index]
            if isinstance(field_, relax.Var) and field_ in self.field_exprs:
                self.field_refs[var] = self.field_refs[field_]
                self.field_exprs[var] = self.field_exprs[field_]

    def _field(self, expr: relax.Expr) -> tuple[int, ...]:
        if isinstance(expr, relax.Var):
            return self.held(expr)
        if isinstance(expr, relax.Tuple) and self.fields.nested_literals:
            out: dict[int, None] = {}
            for f in expr.fields:
                out.update(dict.fromkeys(self._field(f)))
            return tuple(out)
        return ()

    def call_fields(self, binding: BindingInfo, effect: ValueEffect, own: dict[int, None]) -> None:
        """Allocate a call's per-field allocations and record its result's fields (see
        ``ValueEffect.field_allocates`` and ``field_aliases``)."""
        var, index = binding.var, binding.index
        fresh: list[tuple[int, ...]] = []
        for k, nbytes in enumerate(effect.field_allocates):
            alloc_id = None if nbytes is None else self.allocate(var, nbytes, index, field=k)
            fresh.append(() if alloc_id is None else (alloc_id,))
            if alloc_id is not None:
                own[alloc_id] = None
        aliases = effect.field_aliases or (None,) * len(fresh)
        fields: list[tuple[int, ...]] = []
        for k, sources in enumerate(aliases):
            if sources is None:
                fields.append(fresh[k] if k < len(fresh) else ())
                continue
            out: dict[int, None] = {}
            for source in sources:
                out.update(dict.fromkeys(self.held(source)))
            fields.append(tuple(out))
        self.field_refs[var] = fields

    def take(self, pair: tuple[relax.Var, object]) -> frozenset[int] | None:
        """What a runtime object kept under ``pair``, handed to the binding that takes it."""
        # Relax variables hash and compare by node, so the pair finds its record.
        if pair not in self.holders:
            return None
        # The result holds them now; the runtime object no longer does.
        self.holders.let_go(pair)
        return self.holders.forget(pair)

    def keep(self, keeps: tuple[relax.Var, object, relax.Var]) -> None:
        owner, key, source = keeps
        pair = (owner, key)
        self.keys.setdefault(owner, []).append(key)
        self.holders.hold(pair, self.holders.held(pair) | frozenset(self.held(source)))

    def allocate(
        self, var: relax.Var, nbytes: SymbolicExpr, position: int, field: int | None = None
    ) -> int:
        alloc_id = len(self.sizes)
        self.sizes.append(nbytes)
        self.owners.append(var)
        self.starts.append(position)
        self.ends.append(None)
        self.field_of.append(field)
        self.holders.add(alloc_id)
        return alloc_id

    def release(self, var: relax.Var, position: int) -> None:
        """``var``'s register dies after binding ``position``."""
        self._end(self.holders.let_go(var), position)
        # Dropping a runtime object drops what it kept.
        for key in self.keys.pop(var, ()):
            pair = (var, key)
            if pair in self.holders:
                self._end(self.holders.let_go(pair), position)
                self.holders.forget(pair)

    def _end(self, freed: list[int], position: int) -> None:
        for alloc_id in freed:
            if self.ends[alloc_id] is None:
                self.ends[alloc_id] = position

    def allocations(self) -> list[Allocation]:
        return [
            Allocation(
                id=k,
                var=self.owners[k],
                nbytes=self.sizes[k],
                start=self.starts[k],
                end=end,
                field=self.field_of[k],
            )
            for k, end in enumerate(self.ends)
        ]


def storage_flow(
    info: Liveness,
    effect_of: Callable[[relax.Binding], ValueEffect],
    bytes_of: Callable[[relax.Var], SymbolicExpr],
    *,
    explicit_kills: bool,
    params_live: bool = False,
    fields: TupleFields = TupleFields(),
    lifetimes: bool = True,
    outside: Callable[[relax.Var], SymbolicExpr | None] | None = None,
) -> StorageFlow:
    """Walk the bindings of ``info`` once and record the storage flow.

    Parameters
    ----------
    info
        The liveness of the function (its bindings in program order, params and outputs).
    effect_of
        The effect of a binding (:func:`~.effects.binding_effect` or a memo of it).
    bytes_of
        The byte size of a variable's value: what a ``takes`` allocates when nothing was kept
        for it (the runtime regenerates the value).
    explicit_kills
        The function holds explicit kills (the memory stage): a register dies at its kill or
        never; otherwise after its last use (:func:`death_points`).
    params_live
        Each parameter is a buffer of its own, live on entry (an allocation at ``start`` -1
        of ``bytes_of(param)``): for a model that asks which buffers a variable keeps,
        parameters included. Without it a parameter keeps nothing the function allocates.
    fields
        How far the fields of a tuple stay known (:class:`TupleFields`).
    lifetimes
        Follow when registers die, for each allocation's ``end`` and the ``touched`` sets. A
        model that asks only what each variable keeps alive passes False: every ``end`` is
        then ``None`` and ``touched`` is empty. Its effects may keep nothing for a later
        binding (``keeps``), the only way a death changes what a variable keeps.
    outside
        The bindings are part of a function (one block of it) and may read values defined
        outside them, neither parameters nor bound here: each is a buffer live on entry (an
        allocation at ``start`` -1) of the bytes ``outside`` gives (``None``: it keeps
        nothing). It is allocated when first met: a binding meets what it aliases, then makes
        its allocations, then meets the rest of what it reads. Without it such a value keeps
        nothing.
    """
    state = _Flow(fields, outside, lifetimes)
    for param in info.params:
        own = (state.allocate(param, bytes_of(param), -1),) if params_live else ()
        state.hold(param, own)
    death = {} if explicit_kills or not lifetimes else death_points(info)
    touched_at: list[tuple[tuple[int, ...], SymbolicExpr]] = []
    for binding in info.bindings:
        effect = effect_of(binding)
        own = _bind(state, binding, effect, bytes_of)
        if not lifetimes:
            if effect.keeps is not None:
                raise ValueError("storage_flow: a value kept for a later binding needs lifetimes")
            if outside is not None:
                for used in binding.uses:
                    state.held(used)
            continue
        touched_at.append(_touched(state, binding, effect, own))
        i = binding.index
        if explicit_kills:
            if effect.kills is not None:
                state.release(effect.kills, i)
            if returns_nothing(binding.var) and not own:
                state.hold(binding.var, ())
        else:
            for dead in death.get(i, ()):
                state.release(dead, i)
    outputs: set[int] = set()
    for var in info.outputs:
        outputs.update(state.held(var))
    return StorageFlow(
        allocations=state.allocations(),
        refs={var: frozenset(own) for var, own in state.order.items()},
        touched=touched_at,
        outputs=frozenset(outputs),
        refs_in_order=state.order,
    )


def _bind(
    state: _Flow,
    binding: BindingInfo,
    effect: ValueEffect,
    bytes_of: Callable[[relax.Var], SymbolicExpr],
) -> tuple[int, ...]:
    """What the bound variable keeps alive, in order, now held by it (allocating what the
    binding allocates, taking back what a runtime object kept, keeping what it is given)."""
    var = binding.var
    own = state.aliased(binding, effect)
    state.note_fields(binding)
    allocates = effect.allocates
    if effect.takes is not None:
        taken = state.take(effect.takes)
        if taken is None:
            allocates = bytes_of(var)
        else:
            own.update(dict.fromkeys(sorted(taken)))
    if effect.keeps is not None:
        state.keep(effect.keeps)
    if allocates is not None:
        own[state.allocate(var, allocates, binding.index)] = None
    if effect.field_allocates or effect.field_aliases:
        state.call_fields(binding, effect, own)
    held = tuple(own)
    state.hold(var, held)
    return held


def _touched(
    state: _Flow, binding: BindingInfo, effect: ValueEffect, own: tuple[int, ...]
) -> tuple[tuple[int, ...], SymbolicExpr]:
    """The allocations a binding touches (its result and what its inputs keep alive) and the
    workspace its kernel holds while it runs."""
    touched = set(own)
    for used in binding.uses:
        touched.update(state.held(used))
    workspace = effect.workspace if effect.workspace is not None else _ZERO
    return tuple(sorted(touched)), workspace

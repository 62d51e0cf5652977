"""Rematerialization at run time: the ``evict`` / ``regenerate`` builtins and their decision.

How a compiled function talks to this module
--------------------------------------------
``blade_relax.transform.Rematerialize`` rewrites a function so that the VM calls, through
``R.call_builtin_with_ctx`` (the first Python argument is the VM context):

``frame = blade_relax.remat_begin(key, metadata, dims, release, fn_0, ..., fn_k)``
    Once per call, first thing. ``key`` names the metadata, ``metadata`` is a ``uint8`` tensor
    constant holding its JSON (read once per key), ``dims`` the concrete values of the
    function's symbolic dims, ``release`` a no-op closure (see below), ``fn_k`` the
    regeneration closure of slot ``k`` (passed once per call, kept by the frame). The decision
    is made here: the timeline is evaluated at ``dims`` (once per shape), the evictions are
    chosen for the memory budget of this thread (once per shape and budget), and a frame
    object carries them through the call.
``blade_relax.evict(frame, slot, tensor)``
    After the last use of ``tensor`` before a peak. A kept tensor goes into the frame's stash;
    an evicted one is dropped, and the VM frees it when it kills its register right after.
``tensor = blade_relax.regenerate(frame, slot, inputs)``
    Before the next use (a plain ``R.call_packed``: the VM context comes from the frame;
    ``inputs`` is a tuple, so that handing back a kept tensor converts three arguments
    whatever the size of the plan). Returns the stashed tensor, or recomputes it by invoking
    the compiled regeneration closures (Relax functions of the module: TVM kernels, no Python
    numerics) on the inputs, which the VM holds alive anyway at that point. Chained
    regenerations (a closure that reads another evicted tensor) materialize that tensor too
    and keep it in the stash for its own ``regenerate`` call.

The VM keeps the value a function returns until the next function returns: a regenerated
tensor would stay alive, unseen by the timeline, until then. After regenerating, the runtime
invokes ``release``, which returns an empty tuple, so that nothing but the function's
registers and the stash holds a regenerated tensor.

The metadata is the function's symbolic timeline: every storage the function allocates with
its symbolic size and live interval over the timeline's points, and per evictable tensor its
symbolic bytes, symbolic recompute cost, the peak bytes of its regeneration, its window and its
regeneration plan (:class:`blade_relax.contract.RematMetadata` describes it; see
:mod:`blade_relax.runtime.remat_policy` for the decision's model). Symbolic sizes are dim
expressions (:mod:`blade_relax.contract.dimexpr`) over the dims, compiled once per key.

The budget
----------
``set_memory_budget(nbytes)`` (per thread) bounds the bytes live in this thread during the
call, as :func:`blade_relax.runtime.memory_stats` counts them: the decision plans for the
budget minus the bytes already live when the call starts. With no budget nothing is evicted
and ``remat_begin`` neither evaluates nor decides anything. When no eviction set fits, the call
runs with the smallest peak the decision can reach and one :class:`RematBudgetWarning` names
the budget and that peak (once per shape and budget).

The eviction mode
-----------------
``set_eviction_mode`` (per thread, like the budget) says what an evicted tensor becomes. In
``"recompute"`` (the default) everything above holds as written. In ``"offload"`` every
evicted tensor is copied to host memory at ``evict`` (its device storage is freed when the VM
kills its register, as in recompute) and copied back into a fresh VM tensor at ``regenerate``;
no regeneration closure runs for it. In ``"auto"`` each slot is offloaded or recomputed,
whichever :func:`blade_relax.runtime.offload.choose_eviction` estimates faster. The decision
then runs on the timeline of that choice (``RematProgram.timeline(dims, rates)``): an
offloaded slot regenerates into its own bytes and reads nothing, so its regeneration peak is
its size and not its recomputation's, and costs are estimated nanoseconds. A recomputed slot
whose plan reads an offloaded one copies that one back at its site (a chained input, kept or
temporary as the regime says; its host copy is released once it is kept, or at its own
``regenerate``).

A function whose timeline is not exact (it calls a function the compiler could not follow, or
takes tensors from packed functions) is decided on what the timeline knows, best effort: the
decision never calls the budget reachable (``reason="inexact"``), and one
:class:`RematInexactWarning` per program says so.

Without a budget the compiled function does not come here at all: ``Rematerialize`` keeps
the function as it was (``f__plain``) next to the rewritten one (``f__remat``) and turns ``f``
into a dispatcher that asks ``blade_relax.remat_active()`` (one Python call: is a budget set in
this thread?) and calls the rewritten copy only when it says yes. Without a budget a call thus
costs one packed call more than without the pass, and peaks where the unrewritten function
peaks (the rewritten one gives evictable tensors storage of their own).

With a budget set, ``remat_begin`` first invokes ``release``: the value the VM returned from its
previous call would otherwise stay alive (and counted) until this call returns.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tvm

from ..contract import (
    EVICT,
    REGENERATE,
    REMAT_ACTIVE,
    REMAT_BEGIN,
    RematMetadata,
    RematSlot,
)
from ..contract.dimexpr import compile_expressions
from . import budget as _budget
from .accounting import current_live_bytes, record_eviction, record_regeneration
from .offload import EvictionRates, HostCopy, eviction_timeline, resolve_rates, to_device, to_host
from .remat_policy import ConcreteTimeline, Decision, SlotTimeline, decide, minimum_peak

__all__ = [
    "RematBudgetWarning",
    "RematInexactWarning",
    "RematProgram",
    "clear_last_remat_decision",
    "last_remat_decision",
    "remat_programs",
]

# Decisions kept per program before the cache is emptied (shapes x budgets).
_DECISION_CACHE_LIMIT = 1024


class RematBudgetWarning(UserWarning):
    """The memory budget cannot be met by any eviction set; the call ran with a higher peak."""


class RematInexactWarning(RematBudgetWarning):
    """The function's timeline leaves out some allocations: its budget is best effort.

    Emitted once per program (compiled function), the first time it runs under a budget.
    """


# --------------------------------------------------------------------------- programs
class RematProgram:
    """The rematerialization metadata of one compiled function, parsed and compiled.

    Parameters
    ----------
    meta
        The metadata (:class:`blade_relax.contract.RematMetadata`), or its decoded JSON.

    Raises
    ------
    blade_relax.contract.RematFormatError
        For metadata of another format version (the module was compiled by another
        blade_relax), or malformed; a ``ValueError``.
    """

    def __init__(self, meta: RematMetadata | Mapping[str, Any]) -> None:
        if not isinstance(meta, RematMetadata):
            meta = RematMetadata.from_dict(meta)
        self.metadata = meta
        self.function: str = meta.function
        self.dims: tuple[str, ...] = meta.dims
        self.exact: bool = meta.exact
        # Why the timeline is inexact (calls it could not follow, control flow, ...).
        self.notes: tuple[str, ...] = meta.notes
        self.warned_inexact = False
        self.npoints: int = meta.points
        self._evaluate = compile_expressions(self.dims, meta.exprs)
        self._storages = np.array(meta.storages, dtype=np.int64).reshape(-1, 3)
        self.slots: tuple[RematSlot, ...] = meta.slots
        self._timelines: dict[tuple[int, ...], ConcreteTimeline] = {}
        self._eviction_timelines: dict[
            tuple[tuple[int, ...], EvictionRates], tuple[ConcreteTimeline, frozenset[int]]
        ] = {}
        self._decisions: dict[
            tuple[tuple[int, ...], int, EvictionRates | None], tuple[Decision, frozenset[int]]
        ] = {}

    @classmethod
    def from_json(cls, text: str | bytes) -> RematProgram:
        """Parse the JSON metadata (:meth:`blade_relax.contract.RematMetadata.from_json`)."""
        return cls(RematMetadata.from_json(text))

    def timeline(self, dims: Sequence[int], rates: EvictionRates | None = None) -> ConcreteTimeline:
        """The timeline evaluated at concrete dims (cached per shape).

        Parameters
        ----------
        dims
            One value per name in :attr:`dims`, in that order.
        rates
            An offloading eviction mode with its rates: the timeline its decision runs on
            (:func:`blade_relax.runtime.offload.eviction_timeline`); ``None``: recompute.
        """
        if rates is not None:
            return self._with_offload(dims, rates)[0]
        key = tuple(int(d) for d in dims)
        tl = self._timelines.get(key)
        if tl is not None:
            return tl
        if len(key) != len(self.dims):
            raise ValueError(f"{self.function}: expected dims {self.dims}, got {key}")
        values = np.array(self._evaluate(*key), dtype=np.int64)
        delta = np.zeros(self.npoints + 1, dtype=np.int64)
        if len(self._storages):
            sizes = values[self._storages[:, 0]]
            np.add.at(delta, self._storages[:, 1], sizes)
            np.subtract.at(delta, self._storages[:, 2], sizes)
        base = np.cumsum(delta[:-1])
        slots = tuple(
            SlotTimeline(
                name=s.name,
                nbytes=int(values[s.nbytes]),
                cost=float(values[s.cost]),
                start=s.start,
                site=s.site,
                regen_peak=int(values[s.regen_peak]),
                plan=tuple(
                    (node.slot, tuple(i for kind, i in node.refs if kind == "s")) for node in s.plan
                ),
            )
            for s in self.slots
        )
        tl = ConcreteTimeline(base=base, slots=slots)
        if len(self._timelines) >= _DECISION_CACHE_LIMIT:
            self._timelines.clear()
        self._timelines[key] = tl
        return tl

    def _with_offload(
        self, dims: Sequence[int], rates: EvictionRates
    ) -> tuple[ConcreteTimeline, frozenset[int]]:
        """The timeline under ``rates`` and the slots offloaded when evicted (cached)."""
        key = (tuple(int(d) for d in dims), rates)
        found = self._eviction_timelines.get(key)
        if found is None:
            found = eviction_timeline(self.timeline(key[0]), rates)
            if len(self._eviction_timelines) >= _DECISION_CACHE_LIMIT:
                self._eviction_timelines.clear()
            self._eviction_timelines[key] = found
        return found

    def offloaded(self, dims: Sequence[int], rates: EvictionRates | None) -> frozenset[int]:
        """The slots offloaded when evicted at ``dims`` under ``rates`` (none in recompute)."""
        return frozenset() if rates is None else self._with_offload(dims, rates)[1]

    def decision(
        self, dims: Sequence[int], budget: int | None, rates: EvictionRates | None = None
    ) -> Decision:
        """The eviction decision at ``dims`` for ``budget`` bytes of in-call memory (cached).

        ``rates``: an offloading eviction mode (see :meth:`timeline`); ``None``: recompute.
        """
        return self._decide(dims, budget, rates)[0]

    def _decide(
        self, dims: Sequence[int], budget: int | None, rates: EvictionRates | None
    ) -> tuple[Decision, frozenset[int]]:
        """The decision and the evicted slots it offloads (cached)."""
        key = (tuple(int(d) for d in dims), -1 if budget is None else int(budget), rates)
        found = self._decisions.get(key)
        if found is not None:
            return found
        result = decide(self.timeline(key[0], rates), budget)
        if budget is not None and not self.exact:
            # The timeline misses allocations: no budget can be promised.
            result = dataclasses.replace(result, reachable=False, reason="inexact")
        found = (result, result.evicted & self.offloaded(key[0], rates))
        if len(self._decisions) >= _DECISION_CACHE_LIMIT:
            self._decisions.clear()
        self._decisions[key] = found
        return found

    def minimum_peak(self, dims: Sequence[int], rates: EvictionRates | None = None) -> Decision:
        """The smallest in-call peak the evictions can reach at ``dims``, and at what cost."""
        return minimum_peak(self.timeline(dims, rates))

    def dims_of(self, values: Sequence[int]) -> dict[str, int]:
        """Name the values of a dims tuple."""
        return dict(zip(self.dims, (int(v) for v in values)))


# --------------------------------------------------------------------------- builtins
_programs: dict[str, RematProgram] = {}
_programs_lock = threading.Lock()
_local = threading.local()
_NO_EVICTION: frozenset[int] = frozenset()
_invoke_closure = tvm.get_global_func("vm.builtin.invoke_closure")


class _Frame:
    """The state of one call of a rematerialized function (held in a VM register)."""

    __slots__ = (
        "ctx",
        "program",
        "evicted",
        "cache",
        "release",
        "fns",
        "stash",
        "offload",
        "hosts",
    )

    def __init__(
        self,
        ctx: Any,
        program: RematProgram,
        evicted: frozenset[int],
        cache: bool | frozenset[int],
        release: Any,
        fns: Any,
        offload: frozenset[int] = frozenset(),
    ) -> None:
        self.ctx = ctx
        self.program = program
        self.evicted = evicted
        self.cache = cache
        self.release = release
        self.fns = fns
        self.stash: dict[int, Any] = {}
        # Evicted slots copied to the host rather than dropped, and their host copies.
        self.offload = offload
        self.hosts: dict[int, HostCopy] = {}

    def __del__(self) -> None:
        # A call that ends early (an error) leaves host copies behind: uncount them.
        for copy in getattr(self, "hosts", {}).values():
            copy.release()


def _load_program(key: str, metadata: Any) -> RematProgram:
    raw = metadata.numpy().tobytes() if hasattr(metadata, "numpy") else str(metadata).encode()
    program = RematProgram.from_json(raw)
    with _programs_lock:
        _programs.setdefault(key, program)
        return _programs[key]


def _tensor_nbytes(tensor: Any) -> int:
    dtype = tensor.dtype
    count = 1
    for d in tensor.shape:
        count *= int(d)
    return (count * dtype.bits * dtype.lanes + 7) // 8


def _remat_begin(ctx: Any, key: Any, metadata: Any, dims: Any, release: Any, *fns: Any) -> _Frame:
    program = _programs.get(key)
    if program is None:
        program = _load_program(str(key), metadata)
    get_budget = getattr(_budget, "get_memory_budget", None)
    budget = get_budget() if get_budget is not None else None
    fraction = _budget.get_relative_budget() if budget is None else None
    if budget is None and fraction is None:
        return _Frame(ctx, program, _NO_EVICTION, True, release, fns)
    values = tuple(dims)
    if release is not None:
        # The VM still holds what its last call returned (until this call returns): drop it
        # now, so that it is not counted against the budget when nobody else holds it.
        _invoke_closure(ctx, release)
    live = current_live_bytes()
    if fraction is not None:  # a share of this call's own peak without evictions
        available = max(1, int(fraction * program.timeline(values).base_peak))
        budget = live + available
    available = int(budget) - live
    start = time.perf_counter()
    rates = resolve_rates(_budget.get_eviction_mode())
    found = program._decisions.get((values, available, rates))
    cached = found is not None
    decision, offload = found if found is not None else program._decide(values, available, rates)
    elapsed = time.perf_counter() - start
    if not program.exact:
        if not program.warned_inexact:
            program.warned_inexact = True
            why = "; ".join(program.notes) or "unknown allocations"
            warnings.warn(
                RematInexactWarning(
                    f"blade_relax remat: the memory timeline of `{program.function}` is not "
                    f"exact ({why}): the memory budget of {int(budget)} bytes is best effort, "
                    "never promised (last_remat_decision() reports reachable=False)"
                ),
                stacklevel=2,
            )
    elif not decision.reachable and not cached:
        warnings.warn(
            RematBudgetWarning(
                f"blade_relax remat: `{program.function}` at {program.dims_of(values)} cannot "
                f"stay within the memory budget of {int(budget)} bytes ({live} bytes were "
                f"already live at the call): the smallest reachable peak is "
                f"{decision.peak + live} bytes (no eviction set goes below "
                f"{program.timeline(values, rates).unevictable()[0] + live} bytes: what evictions "
                "cannot remove, or regenerations bring back); running with that peak"
            ),
            stacklevel=2,
        )
    # The report is built only when asked for (last_remat_decision): this path runs per call.
    _local.last = (program, values, int(budget), live, decision, elapsed, cached, rates, offload)
    return _Frame(ctx, program, decision.evicted, decision.cache, release, fns, offload)


def _remat_evict(_ctx: Any, frame: _Frame, slot: int, tensor: Any) -> None:
    if slot in frame.evicted:
        nbytes = _tensor_nbytes(tensor)
        if slot in frame.offload:
            frame.hosts[slot] = to_host(tensor, nbytes)
        record_eviction(nbytes)
    else:
        frame.stash[slot] = tensor


def _reload(frame: _Frame, slot: int, keep_host: bool) -> Any:
    """Copy an offloaded slot back to the device; its host copy is released unless
    ``keep_host`` (a temporary chained input: its own ``regenerate`` copies it again)."""
    copy = frame.hosts[slot] if keep_host else frame.hosts.pop(slot)
    out = to_device(frame.ctx, copy)
    if not keep_host:
        copy.release()
    return out


def _remat_regenerate(frame: _Frame, slot: int, inputs: Any = ()) -> Any:
    stash = frame.stash
    kept = stash.pop(slot, None)
    if kept is not None:
        return kept
    ctx = frame.ctx
    plan = frame.program.slots[slot].plan
    fns = frame.fns
    hosts = frame.hosts
    # Which entries of the plan this call must run: the slot itself, and every chained input
    # that is neither kept in the stash nor materialized already. An offloaded entry is copied
    # back: it reads nothing.
    needed = {slot}
    for node in reversed(plan):
        if node.slot in needed and node.slot not in hosts:
            for kind, index in node.refs:
                if kind == "s" and index not in stash:
                    needed.add(index)
    # A chained input that is not kept (temp regime, or mixed) lives only until its last
    # reader in this call.
    cache = frame.cache
    kept = (lambda _x: cache) if isinstance(cache, bool) else cache.__contains__
    last_reader: dict[int, int] = {}
    for i, node in enumerate(plan):
        if node.slot in needed and node.slot not in hosts:
            for kind, index in node.refs:
                if kind == "s" and index in needed and not kept(index):
                    last_reader[index] = i
    temps: dict[int, Any] = {}
    result = None
    ran_closure = False
    for i, node in enumerate(plan):
        if node.slot not in needed:
            continue
        if node.slot in hosts:
            own = node.slot == slot
            out = _reload(frame, node.slot, keep_host=not (own or kept(node.slot)))
            if own:
                result = out
            elif kept(node.slot):
                stash[node.slot] = out
            else:
                temps[node.slot] = out
            continue
        closure = fns[node.slot]
        try:
            values = [
                inputs[j] if kind == "a" else (temps[j] if j in temps else stash[j])
                for kind, j in node.refs
            ]
        except KeyError as err:  # a chained input neither kept nor materialized: a plan bug
            raise RuntimeError(
                f"blade_relax remat: regenerating {frame.program.slots[slot].name} in "
                f"`{frame.program.function}` needs slot {err.args[0]}, which is not available"
            ) from None
        out = _invoke_closure(ctx, closure, *values)
        ran_closure = True
        del values
        record_regeneration(_tensor_nbytes(out))
        if node.slot == slot:
            result = out
        elif kept(node.slot):
            stash[node.slot] = out
        else:
            temps[node.slot] = out
        for t in [t for t, reader in last_reader.items() if reader == i]:
            temps.pop(t, None)
    del out
    if ran_closure:
        _invoke_closure(ctx, frame.release)  # the VM drops the last value a closure returned
    return result


def _remat_active() -> bool:
    """Whether this thread has a memory budget: the dispatcher's choice of copy (see above)."""
    return _budget.get_memory_budget() is not None or _budget.get_relative_budget() is not None


tvm.register_global_func(REMAT_ACTIVE, _remat_active, override=True)
tvm.register_global_func(REMAT_BEGIN, _remat_begin, override=True)
tvm.register_global_func(EVICT, _remat_evict, override=True)
tvm.register_global_func(REGENERATE, _remat_regenerate, override=True)


# --------------------------------------------------------------------------- reports
def last_remat_decision() -> dict[str, Any] | None:
    """The last decision ``remat_begin`` made in this thread with a budget set.

    Returns
    -------
    dict or None
        ``function``, ``dims``, ``budget``, ``live_at_entry``, ``predicted_peak`` and
        ``no_remat_peak`` (bytes, the bytes live at entry included), ``reachable``,
        ``reason`` (why not reachable: ``"budget"``, below the smallest reachable peak, or
        ``"inexact"``, the timeline misses allocations; ``None`` when reachable),
        ``unevictable_peak`` (bytes, the bytes live at entry included: a floor under every
        reachable peak, what no eviction set removes at one point of the call, counting what
        regenerations bring back; see ``ConcreteTimeline.unevictable``),
        ``exact``
        (whether the function's timeline is exact), ``evicted`` (names), ``evictable`` (how
        many slots the function has), ``cache`` (the regime of chained inputs: ``True`` kept,
        ``False`` temporaries, ``"mixed"``), ``recompute_cost`` (of the evictions, in
        ``cost_unit``: ``"iterations"`` of the kernels in the recompute mode, estimated ``"ns"``
        of copies and recomputations in the others), ``eviction_mode``, ``offloaded`` (names of
        the evicted tensors copied to the host rather than recomputed), ``decision_seconds``
        (time to fetch or make the decision) and ``cached``. ``None`` before any call with a
        budget.
    """
    last = getattr(_local, "last", None)
    if last is None:
        return None
    program, values, budget, live, decision, elapsed, cached, rates, offload = last
    return {
        "function": program.function,
        "dims": program.dims_of(values),
        "budget": budget,
        "live_at_entry": live,
        "predicted_peak": decision.peak + live,
        "no_remat_peak": decision.base_peak + live,
        "reachable": decision.reachable,
        "reason": decision.reason,
        "unevictable_peak": program.timeline(values, rates).unevictable()[0] + live,
        "exact": program.exact,
        "evicted": sorted(program.slots[k].name for k in decision.evicted),
        "evictable": len(program.slots),
        "cache": decision.cache if isinstance(decision.cache, bool) else "mixed",
        "recompute_cost": decision.cost,
        "cost_unit": "iterations" if rates is None else "ns",
        "eviction_mode": "recompute" if rates is None else rates.mode,
        "offloaded": sorted(program.slots[k].name for k in offload),
        "decision_seconds": elapsed,
        "cached": cached,
    }


def clear_last_remat_decision() -> None:
    """Forget this thread's last decision: :func:`last_remat_decision` is ``None`` until the
    next call of a rematerialized function with a budget set."""
    _local.last = None


def remat_programs() -> dict[str, RematProgram]:
    """The programs of every rematerialized function called so far, by metadata key."""
    with _programs_lock:
        return dict(_programs)

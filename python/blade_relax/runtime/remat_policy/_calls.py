"""The ``regenerate`` calls of an evicted set: which slots each call materializes, in which
order, and what it adds above the live bytes at its site.

:func:`_walk` goes through an evicted set's calls in program order; each call (:class:`_Run`)
is built once per search (:func:`_run`) and looked up again by what it depends on (the
pending slots its recomputation reads, and which of them it keeps), so that a search's trial
sets, which mostly differ elsewhere, reuse it. Sets of slots are bit masks here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ._timeline import ConcreteTimeline, Regime


class _Run(NamedTuple):
    """One ``regenerate`` call, apart from the live bytes at its site (which the other
    evictions set): what :func:`evaluate` needs of it, computed once per search."""

    # The slot whose call it is, and the call's point.
    slot: int
    site: int
    # The materializations, in order.
    sequence: tuple[int, ...]
    # Their recompute cost, summed in that order.
    cost: float
    # The slots whose windows close at the call: the slot, and its kept chained inputs; as a
    # bit mask, and the call's point once per slot (the ends of their windows).
    closes: tuple[int, ...]
    closes_mask: int
    ends: tuple[int, ...]
    # Each materialization's peak above the live bytes at the site.
    offsets: tuple[int, ...]
    top: int
    # What makes the call valid for other pending sets (see _walk): the chained inputs it
    # materializes, those of them it keeps, and the slots they read that it does not
    # materialize; as bit masks.
    inputs: int
    kept: int
    frontier: int


def _run(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """The ``regenerate`` call of ``k`` when the slots of the mask ``pending`` (of ``k``'s
    plan: evicted, and not materialized and kept before) are not available.

    ``keep`` is the mask of the slots kept once materialized (``-1``: all of them). What the
    call materializes is ``k`` and, dependencies first, the pending slots its recomputation
    reads, directly or through one another.
    """
    reads = tl._plan_reads[k]
    if reads is None:
        reads = tl._plan_reads[k] = _reads(tl.slots[k].plan)
    needed = 1 << k
    if reads.by_slot is not None:
        # What the recomputation reads, directly or through one another: followed from k
        # over the pending slots only (a few of a long plan).
        by_slot = reads.by_slot
        todo = by_slot[k] & pending
        while todo:
            low = todo & -todo
            needed |= low
            todo = (todo ^ low) | (by_slot[low.bit_length() - 1] & pending & ~needed)
    else:
        for x, refs in reads.backwards:
            if needed >> x & 1:
                needed |= refs & pending
    # Many pending sets lead to the same materializations (a search's sets differ in slots
    # the recomputation does not read): the call is the same when they and what it keeps are.
    key = (k, needed, needed & keep & ~(1 << k))
    found = tl._runs_by_sequence.get(key)
    if found is None:
        found = tl._runs_by_sequence[key] = _build_run(tl, k, reads, needed, keep, key[2])
    return found


def _build_run(
    tl: ConcreteTimeline, k: int, reads: _PlanReads, needed: int, keep: int, kept: int
) -> _Run:
    """:func:`_run` of the materializations ``needed`` (a bit mask), built."""
    frontier = 0
    members = 0  # the temporaries: chained inputs not kept
    if reads.by_slot is not None:
        # Each slot once in the plan: the materializations are the set bits, in plan order.
        by_slot = reads.by_slot
        sequence = []
        todo = needed
        while todo:
            low = todo & -todo
            todo ^= low
            x = low.bit_length() - 1
            sequence.append(x)
            frontier |= by_slot[x]
        if len(sequence) > 1:
            sequence.sort(key=reads.position.__getitem__)
        members = needed & ~keep & ~(1 << k)
    else:
        for x, refs in reads.backwards:
            if needed >> x & 1:
                frontier |= refs
        sequence = [x for x, _ in tl.slots[k].plan if needed >> x & 1]
        for x in sequence[:-1]:
            if not keep >> x & 1:
                members |= 1 << x
    nbytes, regen, costs = tl._sizes
    # A temporary lives until its last reader in the run: its bytes are dropped after it.
    dropped = [0] * len(sequence)
    if members:
        masks = reads.by_slot if reads.by_slot is not None else reads.last_masks
        last_reader: dict[int, int] = {}
        for i, x in enumerate(sequence):
            read = masks[x] & members
            while read:
                low = read & -read
                read ^= low
                last_reader[low.bit_length() - 1] = i
        for t, reader in last_reader.items():
            dropped[reader] += nbytes[t]
    offsets = []
    held = 0
    for x, drop in zip(sequence, dropped):
        offsets.append(held + regen[x])
        held += nbytes[x] - drop
    closes = tuple(x for x in sequence if x == k or keep >> x & 1)
    site = tl.slots[k].site
    return _Run(
        slot=k,
        site=site,
        sequence=tuple(sequence),
        cost=sum(costs[x] for x in sequence),
        closes=closes,
        closes_mask=sum(1 << x for x in closes),
        ends=(site,) * len(closes),
        offsets=tuple(offsets),
        top=max(offsets),
        inputs=needed & ~(1 << k),
        kept=kept,
        frontier=frontier & ~needed,
    )


class _PlanReads(NamedTuple):
    """What each entry of a plan reads, as bit masks (see :func:`_reads`)."""

    # By slot, when every entry is listed once, after what it reads (what reaches the slot is
    # then all :func:`_run` follows); else ``None``.
    by_slot: dict[int, int] | None
    # Each slot's place in the plan (with ``by_slot``).
    position: dict[int, int] | None
    # The entries backwards, walked in that order as the plan's order says (without
    # ``by_slot``), and what the last entry of each slot reads.
    backwards: list[tuple[int, int]] | None
    last_masks: dict[int, int] | None


def _reads(plan: tuple[tuple[int, tuple[int, ...]], ...]) -> _PlanReads:
    """What each entry of ``plan`` reads, as bit masks."""
    entries = [(x, _bit_mask(refs)) for x, refs in plan]
    masks = dict(entries)
    listed = _bit_mask(masks)
    seen = 0
    for x, _ in plan:
        if masks[x] & listed & ~seen:
            break  # an entry reads one listed after it
        seen |= 1 << x
    else:
        if len(masks) == len(plan):
            return _PlanReads(masks, {x: i for i, (x, _) in enumerate(plan)}, None, None)
    return _PlanReads(None, None, entries[::-1], masks)


def _bit_mask(slots: Iterable[int]) -> int:
    """The bit mask of ``slots``."""
    mask = 0
    for x in slots:
        mask |= 1 << x
    return mask


def _keep_mask(cache: Regime) -> int:
    """The bit mask of the slots a regime keeps once materialized (``-1``: every slot)."""
    if isinstance(cache, bool):
        return -1 if cache else 0
    mask = 0
    for k in cache:
        mask |= 1 << k
    return mask


class _Walk(NamedTuple):
    """The regenerate calls of one evicted set, in program order, and what they add up to."""

    cost: float
    calls: list[_Run]
    # Each closed window: its slot and its end (where the slot is materialized).
    index: list[int]
    ends: list[int]


def _holds(run: _Run | None, pending: int, keep: int) -> bool:
    """Whether ``run`` is its slot's regenerate call for ``pending`` and ``keep``: the pending
    set still has every input it materialized and none it reads beyond them, and it keeps
    the same of them (its recomputation then reaches the same slots)."""
    return (
        run is not None
        and not pending & run.frontier
        and pending & run.inputs == run.inputs
        and keep & run.inputs == run.kept
    )


def _other_call(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """Slot ``k``'s regenerate call when its last one does not hold: the one before it if that
    holds (a search's trial sets often differ in one slot that comes and goes), else the
    call remembered for the same pending set, else a new one. The two are remembered."""
    run = tl._earlier_runs[k]
    if not _holds(run, pending, keep):
        key = (k, pending, pending & keep)
        run = tl._runs.get(key)
        if run is None:
            run = tl._runs[key] = _run(tl, k, pending, keep)
    tl._earlier_runs[k] = tl._last_runs[k]
    tl._last_runs[k] = run
    return run


def _walk(tl: ConcreteTimeline, chosen: frozenset[int], keep: int) -> _Walk:
    """Which regenerate calls run when ``chosen`` are evicted, and what each materializes.

    The walk runs once per evaluation (but a temp-regime set one slot away from an evaluated
    one: see :class:`_TempNeighbours`), thousands of times per search: sets of slots are bit
    masks (Python integers) here, and each call is looked up by ``(slot, pending mask, kept
    part of it)``.
    """
    plan_masks = tl._plan_masks
    last = tl._last_runs
    chosen_mask = 0
    for k in chosen:
        chosen_mask |= 1 << k
    done = 0
    index: list[int] = []
    ends: list[int] = []
    calls: list[_Run] = []
    cost = 0.0
    for k in sorted(chosen, key=tl._rank.__getitem__):
        if done >> k & 1:
            continue
        # Kept materializations are in the stash; a plan never names a slot whose own
        # regenerate call came earlier. (A plan of the slot alone leaves it pending: it is
        # evicted and not materialized.)
        pending = plan_masks[k] & chosen_mask & ~done
        # The slot's last call, when it holds (:func:`_holds`, written out: the walk runs
        # this for every evicted slot of every evaluation); a search's trial sets mostly
        # differ elsewhere.
        run = last[k]
        if (
            run is None
            or pending & run.frontier
            or pending & run.inputs != run.inputs
            or keep & run.inputs != run.kept
        ):
            run = _other_call(tl, k, pending, keep)
        done |= run.closes_mask
        index += run.closes
        ends += run.ends
        cost += run.cost
        calls.append(run)
    return _Walk(cost, calls, index, ends)


def _call(tl: ConcreteTimeline, k: int, pending: int, keep: int) -> _Run:
    """Slot ``k``'s regenerate call for ``pending`` and ``keep``, as :func:`_walk` finds it."""
    run = tl._last_runs[k]
    if _holds(run, pending, keep):
        return run  # type: ignore[return-value]
    return _other_call(tl, k, pending, keep)


def _chain_inputs(tl: ConcreteTimeline, chosen: frozenset[int]) -> set[int]:
    """Evicted slots that the regeneration of another evicted slot may materialize."""
    out: set[int] = set()
    for k in chosen:
        out.update(x for x in tl._plan_slots[k] if x != k and x in chosen)
    return out

"""Buffer sharing for ``PlanMemory``: which allocations share a storage, chosen on symbolic sizes.

Allocations are grouped (an in-place chain is one group) and each group takes a storage that
is free over its whole lifetime, the choice ranked by what it proves about the storage's size
(equal, provably no larger, a larger size that grows the storage by the least); see the
docstring of :mod:`.plan_memory` for the rules.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tvm import tirx

from ...symbolic import ShapeGraph, SymbolicExpr
from ._collect import Allocation, FunctionFacts
from ._index import EndIndex
from ._peak import Interval, LiveModel, Region

if TYPE_CHECKING:
    from .plan_memory import PlanOptions


@dataclass
class Group:
    """Tensors sharing one storage by in-place chaining; the head is allocated first."""

    members: list[Allocation]
    size: SymbolicExpr
    size_prim: object
    ready: int
    num_bindings: int

    @property
    def head(self) -> Allocation:
        return self.members[0]

    @property
    def start(self) -> int:
        return self.head.index

    @property
    def end(self) -> int:
        """The last binding that reads the group's data."""
        return max(m.end for m in self.members)

    @property
    def mem_end(self) -> int:
        """The last binding during which the VM holds the group's memory."""
        return max(m.mem_end(self.num_bindings) for m in self.members)


@dataclass
class Storage:
    groups: list[Group]
    size: SymbolicExpr
    size_prim: object
    #: Creation order: among placements ranked equal, the earlier storage is taken.
    order: int = 0
    #: The last binding that reads data held in the storage (kept up to date by ``add``: the
    #: planner asks every storage for it once per tensor placed).
    last: int = field(init=False)
    #: The last binding during which the storage is allocated.
    mem_end: int = field(init=False)

    def __post_init__(self) -> None:
        self.last = max(g.end for g in self.groups)
        self.mem_end = max(g.mem_end for g in self.groups)

    def add(self, group: Group) -> None:
        self.groups.append(group)
        self.last = max(self.last, group.end)
        self.mem_end = max(self.mem_end, group.mem_end)

    @property
    def first(self) -> int:
        return self.groups[0].start

    @property
    def head(self) -> Allocation:
        return self.groups[0].head


@dataclass
class _SharingResult:
    storages: list[Storage]
    exhaustive: bool


def share(
    facts: FunctionFacts,
    graph: ShapeGraph,
    sizes: dict[int, SymbolicExpr],
    groups: list[Group],
    group_of: dict[int, Group],
    ge_inplace: dict[int, list[int]],
    options: PlanOptions,
    pairs: list[tuple[str, str, int]],
) -> _SharingResult:
    allocs = facts.allocations
    base = [Interval(g.start, g.mem_end, g.size) for g in groups]
    moments = [g.start for g in groups]
    for alloc in allocs:
        if not alloc.plannable and alloc.id in sizes and not sizes[alloc.id].is_unknown:
            end = alloc.mem_end(facts.num_bindings)
            if alloc.kind == IN_REGENERATED:
                # The regenerated tensor's memory (counted until the call that writes this
                # tensor into it), from the call on.
                base.append(Interval(alloc.first_use + 1, end, sizes[alloc.id]))
                continue
            base.append(Interval(alloc.index, end, sizes[alloc.id]))
            moments.append(alloc.index)
    model = LiveModel(
        graph,
        moments,
        base,
        max_grid_points=options.max_grid_points,
        max_grid_cells=options.max_grid_cells,
        max_proofs=options.max_proofs,
    )
    storages: list[Storage] = []
    storage_of: dict[int, Storage] = {}  # id(group) -> storage
    free = _FreeStorages(model)
    for group in sorted(groups, key=lambda g: g.start):
        choice = None
        if options.share or ge_inplace:
            choice = _choose(
                group, storages, free, storage_of, group_of, ge_inplace, graph, model, options
            )
        if choice is None:
            storage = Storage(
                groups=[group], size=group.size, size_prim=group.size_prim, order=len(storages)
            )
            storages.append(storage)
            free.insert(storage)
            storage_of[id(group)] = storage
            continue
        storage, new_size, new_prim, regions, inplace_from = choice
        if options.peak_safe:
            model.apply(regions)
        free.remove(storage)  # its end and size class change
        storage.add(group)
        storage.size, storage.size_prim = new_size, new_prim
        free.insert(storage)
        storage_of[id(group)] = storage
        if inplace_from is not None:
            call_index = group.head.first_use
            pairs.append((allocs[inplace_from].var.name, group.head.var.name, call_index))
    return _SharingResult(storages=storages, exhaustive=model.exhaustive)


class _FreeStorages:
    """The planned storages, indexed to find those free when a group starts.

    A storage is free for a group once its last tensor's data is dead (``last < start``).
    Most free storages are also released by then (``mem_end < start``): they sit in an
    :class:`~._index.EndIndex` per storage scope and device, one class per byte size, read
    latest first. The few held past their last read (tensors pinned by a tuple) are kept
    apart and always considered.
    """

    def __init__(self, model: LiveModel) -> None:
        self.model = model
        self.by_place: dict[tuple[str, int], EndIndex[Storage]] = {}
        self.held: dict[int, Storage] = {}  # order -> storage allocated past its last read
        self._keys: dict[int, tuple[tuple[str, int], object, int]] = {}
        self._means: dict[object, float | None] = {}

    def insert(self, storage: Storage) -> None:
        place = _place(storage.head)
        if place is None:  # shares with nothing (see compatible)
            return
        cls = storage.size.expr
        self.by_place.setdefault(place, EndIndex()).insert(
            cls, storage.mem_end, storage.order, storage
        )
        self._keys[storage.order] = (place, cls, storage.mem_end)
        if storage.mem_end > storage.last:
            self.held[storage.order] = storage

    def remove(self, storage: Storage) -> None:
        key = self._keys.pop(storage.order, None)
        if key is None:
            return
        place, cls, end = key
        self.by_place[place].remove(cls, end, storage.order)
        self.held.pop(storage.order, None)

    def mean(self, size: SymbolicExpr) -> float | None:
        """``LiveModel.screen_mean`` of ``size``, kept per size."""
        key = size.expr
        if key not in self._means:
            self._means[key] = self.model.screen_mean(size)
        return self._means[key]


def _place(alloc: Allocation) -> tuple[str, int] | None:
    """Storage scope and device index: tensors share memory only with the same (None: never)."""
    if not isinstance(alloc.device, tirx.IntImm):
        return None
    return alloc.scope, int(alloc.device.value)


#: Screened placements tried by proof, best first, before a group gets a storage of its own.
_PROVEN = 4


class _Ranking:
    """The placements of one group that pass the screen, handed out in the planner's preference.

    A placement's key is ``(cost, rank, recency, order)``: the mean live bytes it adds at the
    sample points (reusing a storage that stays allocated anyway saves bytes), then the size
    class (0 in place, 1 equal, 2 larger, 3 grown), then the most recently freed storage, then
    the order in which the candidates are enumerated (in-place ones first, then storages by
    creation), so that equal keys keep that order.
    """

    def __init__(self, group: Group, model: LiveModel) -> None:
        self.group = group
        self.model = model
        self._passed: list[tuple[tuple, Placement]] = []  # a heap: keys are unique

    def consider(
        self,
        rank: int,
        recency: float,
        order: tuple[int, int],
        storage: Storage,
        new_size: SymbolicExpr,
        new_prim: object,
        inplace_from: int | None,
    ) -> None:
        """Screen the placement of the group in ``storage`` grown to ``new_size``."""
        regions = _merge_delta(storage, self.group, new_size)
        if not all(self.model.evaluable(r) for r in regions):
            return
        ok, cost = self.model.screen(regions)
        if ok:
            placement = (storage, new_size, new_prim, regions, inplace_from)
            heapq.heappush(self._passed, ((cost, rank, recency, order), placement))

    def beats(self, bound: float) -> bool:
        """Whether the best placement kept ranks before any costing at least ``bound``.

        A placement costing exactly as much might rank before it: ``bound`` must be above its
        cost by more than the rounding of the two float sums.
        """
        if not self._passed:
            return False
        cost = self._passed[0][0][0]
        return bound > cost + 1e-9 * max(1.0, abs(bound), abs(cost))

    def pop(self) -> Placement | None:
        """Take out the best placement kept (None if none)."""
        return heapq.heappop(self._passed)[1] if self._passed else None


def _choose(
    group: Group,
    storages: list[Storage],
    free: _FreeStorages,
    storage_of: dict[int, Storage],
    group_of: dict[int, Group],
    ge_inplace: dict[int, list[int]],
    graph: ShapeGraph,
    model: LiveModel,
    options: PlanOptions,
) -> Placement | None:
    """The best proven-safe placement of ``group`` in an existing storage, or None.

    The candidates are the storage of a dying input (in place, when larger than the group) and
    every storage free when the group starts. Each passing the screen is ranked by
    :class:`_Ranking`; the best ``_PROVEN`` are proven in turn, the first proven is taken.

    Only the candidates that may come first need screening. A free storage of size ``S``,
    released ``gap`` moments before the group starts, adds at least ``max(mean S, mean G) *
    (gap + span) - mean G * span`` to the cost (``G`` the group's size, ``span`` its moments,
    means over the sample points): exactly this when the storage keeps its size, more when it
    grows, since the new size is at least ``S`` and ``G`` at every sample point (they are
    admissible: a proven ``>=`` holds there). The free storages of each size class are read
    latest first, where that bound grows, all classes together in the order of their bounds,
    and only until the bound exceeds the cost of the best placement screened: every storage
    left ranks after it.
    """
    head = group.head
    # In-place into a dying input whose storage is larger.
    inplace: list[tuple[Storage, int]] = []
    for in_id in ge_inplace.get(head.id, []):
        storage = storage_of.get(id(group_of[in_id]))
        call_index = head.first_use
        if storage is None or call_index is None or storage.last != call_index:
            continue
        if not graph.compare(storage.size, group.size).holds_ge:
            continue
        inplace.append((storage, in_id))
    if not options.peak_safe:
        return _choose_greedy(group, storages, inplace, graph, options)
    ranking = _Ranking(group, model)
    for i, (storage, in_id) in enumerate(inplace):
        ranking.consider(0, 0.0, (0, i), storage, storage.size, storage.size_prim, in_id)
    place = _place(head)
    share = options.share and place is not None

    def consider(storage: Storage) -> None:
        terms = _share_terms(storage, group, graph, options)
        if terms is not None:
            rank, new_size, new_prim = terms
            order = (1, storage.order)
            ranking.consider(rank, -storage.last, order, storage, new_size, new_prim, None)

    if share:
        for storage in list(free.held.values()):
            if storage.last < group.start <= storage.mem_end and _place(storage.head) == place:
                consider(storage)
    index = free.by_place.get(place) if share else None
    # The free storages of each size class, latest first, by their bound: (bound, class
    # number, storage, the class's remaining storages, the bound's slope).
    heap: list[tuple[float, int, Storage, Iterator[tuple[int, Storage]], float | None]] = []
    mean_g = free.mean(group.size)
    span = model.moments_between(group.start, group.mem_end)

    def push(n: int, entries: Iterator[tuple[int, Storage]], slope: float | None) -> None:
        entry = next(entries, None)
        if entry is None:
            return
        end, storage = entry
        if slope is None:  # sizes not evaluable: no bound, the whole class is read
            bound = -math.inf
        else:
            gap = model.moments_between(end + 1, group.start - 1)
            bound = slope * (gap + span) - mean_g * span
        heapq.heappush(heap, (bound, n, storage, entries, slope))

    if index is not None:
        for n, cls in enumerate(index.classes()):
            mean_s = free.mean(SymbolicExpr(cls))
            slope = None if mean_g is None or mean_s is None else max(mean_s, mean_g)
            push(n, index.ended_before(cls, group.start), slope)
    for _ in range(_PROVEN):
        while heap and not ranking.beats(heap[0][0]):
            _bound, n, storage, entries, slope = heapq.heappop(heap)
            consider(storage)
            push(n, entries, slope)
        best = ranking.pop()
        if best is None:
            return None
        if model.prove(best[3]):
            return best
    return None


def _share_terms(
    storage: Storage, group: Group, graph: ShapeGraph, options: PlanOptions
) -> tuple[int, SymbolicExpr, object] | None:
    """``(rank, new size, new size as a PrimExpr)`` when ``group`` may share the free
    ``storage`` (see :class:`_Ranking` for the rank), None when their sizes forbid it."""
    relation = graph.compare(storage.size, group.size)
    if relation.holds_ge:
        return (1 if relation.name == "EQ" else 2), storage.size, storage.size_prim
    if options.grow and group.ready < storage.first:
        if graph.compare(group.size, storage.size).holds_ge:
            return 3, group.size, group.size_prim
        new_size = graph.canonical(SymbolicExpr.max(storage.size, group.size))
        return 3, new_size, tirx.max(storage.size_prim, group.size_prim)
    return None


def _choose_greedy(
    group: Group,
    storages: list[Storage],
    inplace: list[tuple[Storage, int]],
    graph: ShapeGraph,
    options: PlanOptions,
) -> Placement | None:
    """Without peak proofs: the first in-place candidate, else best fit, then recency."""
    if inplace:
        storage, in_id = inplace[0]
        regions = _merge_delta(storage, group, storage.size)
        return storage, storage.size, storage.size_prim, regions, in_id
    if not options.share:
        return None
    best: tuple[tuple[int, int], Storage, int, SymbolicExpr, object] | None = None
    for storage in storages:
        if storage.last >= group.start or not compatible(storage.head, group.head):
            continue
        terms = _share_terms(storage, group, graph, options)
        if terms is None:
            continue
        key = (terms[0], -storage.last)
        if best is None or key < best[0]:
            best = (key, storage, *terms)
    if best is None:
        return None
    _key, storage, _rank, new_size, new_prim = best
    return storage, new_size, new_prim, _merge_delta(storage, group, new_size), None


def _merge_delta(storage: Storage, group: Group, new_size: SymbolicExpr) -> list[Region]:
    """Live-bytes change when ``group`` moves into ``storage``, which becomes ``new_size``.

    Before: the storage holds ``size`` over its allocated span, the group its own allocation
    over its span. After: one allocation of ``new_size`` from the storage's first binding to
    the later of the two ends (the gap between them included).
    """
    end = max(storage.mem_end, group.mem_end)
    terms = [
        (storage.first, end, 1, new_size),
        (storage.first, storage.mem_end, -1, storage.size),
        (group.start, group.mem_end, -1, group.size),
    ]
    points = sorted({p for lo, hi, _, _ in terms for p in (lo, hi + 1)})
    regions: list[Region] = []
    for lo, nxt in zip(points, points[1:]):
        hi = nxt - 1
        parts = [(sign, size) for t_lo, t_hi, sign, size in terms if t_lo <= lo and hi <= t_hi]
        # +new_size - storage.size cancels where the storage keeps its size.
        if len(parts) == 2 and parts[0][0] != parts[1][0] and parts[0][1] == parts[1][1]:
            continue
        if parts:
            regions.append(Region(lo, hi, tuple(parts)))
    return regions


def compatible(a: Allocation, b: Allocation) -> bool:
    """Same storage scope and device: only then may two tensors share memory."""
    place = _place(a)
    return place is not None and place == _place(b)


IN_REGENERATED = "in_regenerated"  # Allocation.kind of an output written into a regenerated tensor


Placement = tuple[Storage, SymbolicExpr, object, list[Region], int | None]

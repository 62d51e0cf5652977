"""Candidate orders for :mod:`.memory_aware_schedule`: list schedulers and local search.

Every strategy takes a :class:`~._model.Block` and returns an order of its bindings
(input positions) that respects the block's dependencies. None of them decides acceptance:
the pass scores every candidate at the acceptance points and keeps one that is no worse than
the input order (see :mod:`.memory_aware_schedule`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...symbolic import Ordering
from ._cost import ByteSpace
from ._model import Block, Timeline, timeline

# ====================================================================== strategies


class Decider:
    """Orders two keys (tuples of byte vectors): proven relations first, then sample points."""

    def __init__(self, space: ByteSpace, point: int | None) -> None:
        self.space = space
        self.point = point
        self.met_unknown = False
        self._values: dict[tuple, np.ndarray] = {}

    def _at_points(self, vec: tuple) -> np.ndarray:
        cached = self._values.get(vec)
        if cached is None:
            cached = self.space.at_decision_points(np.array(vec, dtype=self.space.dtype))
            self._values[vec] = cached
        return cached

    def less(self, a: tuple, b: tuple) -> bool:
        """Whether key ``a`` should run before key ``b`` (False on a tie)."""
        for va, vb in zip(a, b):
            order = self.space.compare(va, vb)
            if order is Ordering.EQ:
                continue
            if order in (Ordering.LT, Ordering.LE):
                return True
            if order in (Ordering.GT, Ordering.GE):
                return False
            self.met_unknown = True
            xa, xb = self._at_points(va), self._at_points(vb)
            if self.point is not None and xa[self.point] != xb[self.point]:
                return bool(xa[self.point] < xb[self.point])
            smaller = int((xa < xb).sum())
            larger = int((xa > xb).sum())
            if smaller != larger:
                return smaller > larger
            if xa[-1] != xb[-1]:
                return bool(xa[-1] < xb[-1])
        return False


def greedy(block: Block, kind: str, decider: Decider) -> list[int]:
    n = block.n
    sizes, alloc, escaping = block.sizes, block.alloc, block.escaping
    indegree = [len(p) for p in block.preds]
    pending = [set(c) for c in block.consumers]
    key_of: dict[int, tuple] = {}
    buckets: dict[tuple, list[int]] = {}
    counts: dict[tuple, int] = {}

    def key(u: int) -> tuple:
        delta = alloc[u].copy()
        for b in block.touch[u]:
            if not escaping[b] and len(pending[b]) == 1:
                delta -= sizes[b]
        a = tuple(alloc[u].tolist())
        d = tuple(delta.tolist())
        return (a, d) if kind == "greedy-peak" else (d, a)

    def insert(u: int) -> None:
        k = key(u)
        key_of[u] = k
        heapq.heappush(buckets.setdefault(k, []), u)
        counts[k] = counts.get(k, 0) + 1

    def remove(u: int) -> None:
        k = key_of.pop(u)
        counts[k] -= 1
        if counts[k] == 0:
            del counts[k]
            del buckets[k]

    for u in range(n):
        if indegree[u] == 0:
            insert(u)
    order: list[int] = []
    while counts:
        best = None
        for k in counts:
            if best is None or decider.less(k, best):
                best = k
        heap = buckets[best]
        while True:
            u = heapq.heappop(heap)
            if key_of.get(u) == best:
                break
        remove(u)
        order.append(u)
        for b in block.touch[u]:
            waiting = pending[b]
            waiting.discard(u)
            if len(waiting) == 1 and not escaping[b]:
                (w,) = waiting
                if w in key_of:
                    remove(w)
                    insert(w)
        for s in block.succs[u]:
            indegree[s] -= 1
            if indegree[s] == 0:
                insert(s)
    if len(order) != n:
        raise RuntimeError("dependency cycle in a dataflow block")  # pragma: no cover
    return order


def depth_first(block: Block) -> list[int]:
    n = block.n
    visited = [False] * n
    order: list[int] = []
    roots = [i for i in range(n) if not block.succs[i]]
    for root in roots + list(range(n)):
        if visited[root]:
            continue
        visited[root] = True
        stack = [(root, iter(block.preds[root]))]
        while stack:
            node, it = stack[-1]
            for p in it:
                if not visited[p]:
                    visited[p] = True
                    stack.append((p, iter(block.preds[p])))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


_MAX_GROUP = 256


def move(order: Sequence[int], group: Sequence[int], dst: int) -> list[int]:
    """``order`` with the bindings at positions ``group`` (ascending) moved, in their order,
    to just before the binding now at position ``dst`` (``len(order)``: to the end)."""
    arr = np.asarray(order, dtype=np.int64)
    idx = np.asarray(group, dtype=np.int64)
    keep = np.ones(arr.size, dtype=bool)
    keep[idx] = False
    rest = arr[keep]
    at = dst - int((idx < dst).sum())
    return np.concatenate([rest[:at], arr[idx], rest[at:]]).tolist()


def delay_group(block: Block, pos: Sequence[int], u: int) -> list[int]:
    """``u`` and its ancestors whose results only ``u`` (or this group) reads, as positions.

    ``pos`` is the position of each binding (a list is read fastest: see
    :meth:`Timeline.positions`)."""
    group = {u}
    preds, succs = block.preds, block.succs
    heap = [-int(pos[q]) for q in preds[u]]
    heapq.heapify(heap)
    order_at = {int(pos[q]): q for q in preds[u]}
    while heap and len(group) < _MAX_GROUP:
        a = order_at[-heapq.heappop(heap)]
        if a in group:
            continue
        # Visited in decreasing position: every successor of ``a`` is already decided.
        if all(x in group for x in succs[a]):
            group.add(a)
            for q in preds[a]:
                at = int(pos[q])
                if at not in order_at:
                    order_at[at] = q
                    heapq.heappush(heap, -at)
    return sorted(int(pos[x]) for x in group)


def hoist_group(block: Block, pos: Sequence[int], v: int, k: int) -> list[int] | None:
    """``v`` and its ancestors placed after step ``k`` (positions), or None when one of them
    needs the binding at ``k`` itself. ``pos`` as for :func:`delay_group`."""
    group = {v}
    stack = [v]
    preds = block.preds
    while stack:
        x = stack.pop()
        for q in preds[x]:
            pq = pos[q]
            if pq == k:
                return None
            if pq > k and q not in group:
                if len(group) >= _MAX_GROUP:
                    return None
                group.add(q)
                stack.append(q)
    return sorted(int(pos[x]) for x in group)


def peak_moves(
    block: Block, tl: Timeline, k: int, point: int, limit: int, joint: bool = False
) -> list[tuple]:
    """Moves that may lower the live bytes at step ``k``: each ``(bytes, group, dst)``.

    For every buffer live at step ``k``, largest first: run its producer, with the ancestors
    only it needs, just before the producer's first other reader (if that is after ``k``),
    and, with ``joint``, also together with the other producers that read an input it would
    keep alive (:func:`shared_input_move`); or run its last reader, with the ancestors it
    still waits for, just before step ``k``.
    """
    order = tl.order
    n = block.n
    created = block.created_by
    live = np.nonzero(
        ((created < 0) | (tl.pos[np.maximum(created, 0)] <= k))
        & ((tl.free_step >= k) | (tl.free_step < 0) | block.escaping)
    )[0]
    if live.size == 0:
        return []
    sizes = _size_values(block)[live, point]
    pos = tl.positions()
    moves: dict[tuple, int] = {}
    for rank in np.argsort(-as_float(sizes), kind="stable")[: 2 * limit].tolist():
        b = int(live[rank])
        nbytes = int(sizes[rank])
        if nbytes <= 0:
            continue
        u = int(created[b])
        if u >= 0 and pos[u] <= k:
            group = tl.groups.get(u)
            if group is None:
                group = tl.groups[u] = delay_group(block, pos, u)
            succ = [pos[x] for x in block.succs[u]]
            target = min(succ) if succ else n
            if target > k + 1 or (target > k and pos[u] < k):
                moves.setdefault((tuple(group), target), nbytes)
                shared = shared_input_move(block, tl, pos, u, k, target, point) if joint else None
                if shared is not None:
                    moves.setdefault((tuple(shared[1]), shared[2]), nbytes + shared[0])
        free = int(tl.free_step[b])
        if not block.escaping[b] and free > k:
            v = order[free]
            key = (v, k)
            if key in tl.groups:
                group = tl.groups[key]
            else:
                group = tl.groups[key] = hoist_group(block, pos, v, k)
            if group is not None:
                moves.setdefault((tuple(group), k), nbytes)
    ranked = sorted(moves.items(), key=lambda item: -item[1])[:limit]
    return [(nbytes, group, dst) for (group, dst), nbytes in ranked]


#: The most bindings :func:`shared_input_move` moves with the one it starts from.
_MAX_PARTNERS = 4


def _first_read(block: Block, pos: Sequence[int], u: int) -> int:
    """The position of the first binding that reads ``u``'s result (``block.n``: none)."""
    succ = [pos[x] for x in block.succs[u]]
    return min(succ) if succ else block.n


def shared_input_move(
    block: Block, tl: Timeline, pos: Sequence[int], u: int, k: int, target: int, point: int
) -> tuple[int, list[int], int] | None:
    """Delay ``u`` together with the other readers of an input the delay keeps alive.

    Run just before ``target`` (its first reader), ``u`` keeps each input it reads alive until
    then. Where another binding run before step ``k`` reads that input too and its result is
    first read after ``k`` (the two halves of a layer norm's backward, each recomputing its
    normalized input from one residual stream), delaying either alone holds the input across
    ``k`` and saves one result, often no net gain, while delaying both holds the input once
    and saves two. The local search moves one group at a time and never crosses that rise, so
    this offers the joint move: ``u`` and those readers (each with the ancestors only it
    needs) just before the earliest of their first readers.

    Returns ``(bytes, group, dst)``: the partners' result bytes at ``point`` (what the move
    may save beyond the single one), the positions moved and the destination; ``None`` where
    no input has such a reader.
    """
    created = block.created_by
    partners: list[int] = []
    for c in block.touch[u]:
        last = int(tl.free_step[c])
        if created[c] == u or block.escaping[c] or not 0 <= last < target:
            continue
        for r in block.consumers[c]:
            if len(partners) >= _MAX_PARTNERS:
                break
            if r != u and r not in partners and pos[r] < k and _first_read(block, pos, r) > k + 1:
                partners.append(r)
    if not partners:
        return None
    group = set(tl.groups.get(u) or delay_group(block, pos, u))
    for r in partners:
        group.update(delay_group(block, pos, r))
    dst = min(target, *(_first_read(block, pos, r) for r in partners))
    if dst <= k or any(p >= dst for p in group):
        return None
    saved = _size_values(block)[np.isin(created, partners), point]
    return int(saved.sum()), sorted(group), dst


def _size_values(block: Block) -> np.ndarray:
    """The size of every buffer of ``block`` at the acceptance points (``B x P``)."""
    values = block.cache.get("size_values")
    if values is None:
        values = block.cache["size_values"] = block.space.at_acceptance_points(block.sizes)
    return values


def refine(
    block: Block,
    start: list[int],
    evaluations: int,
    moves_per_step: int,
    planner: str | None = None,
    trajectory: list[tuple[tuple[int, ...], int]] | None = None,
) -> list[int]:
    """Local search from ``start``: move bindings across the peak while no point gets worse.

    A move is kept when the peak is no higher at every acceptance point and, at the point being
    worked on, either lower or reached by fewer steps. Deterministic; at most ``evaluations``
    orders are scored, with the memory model of ``planner`` (the block's by default). The
    moves kept are appended to ``trajectory`` as (bindings moved, binding they now precede,
    -1 for the end).
    """
    tl = timeline(block, start, planner)
    spent = 0
    # Work on the points in decreasing order of their peaks: the largest shapes first.
    points = list(np.argsort(-as_float(tl.peaks), kind="stable"))
    while spent < evaluations:
        improved = False
        for p in points:
            column = tl.by_point[p]
            peak = column.max()
            at_peak = int((column == peak).sum())
            k = int(np.argmax(column))
            best = None
            for _, group, dst in peak_moves(block, tl, k, p, moves_per_step):
                if spent >= evaluations:
                    break
                spent += 1
                cand = timeline(block, move(tl.order, group, dst), planner)
                if (cand.peaks > tl.peaks).any():
                    continue
                new_peak = cand.peaks[p]
                new_count = int((cand.by_point[p] == new_peak).sum())
                if new_peak < peak or (new_peak == peak and new_count < at_peak):
                    key = (new_peak, new_count)
                    if best is None or key < best[0]:
                        best = (key, cand, group, dst)
            if best is not None:
                if trajectory is not None:
                    _, _, group, dst = best
                    trajectory.append(
                        (tuple(tl.order[g] for g in group), tl.order[dst] if dst < block.n else -1)
                    )
                tl = best[1]
                improved = True
                break
        if not improved:
            break
    return tl.order


def replay(
    block: Block,
    start: list[int],
    trajectory: list[tuple[tuple[int, ...], int]],
    reference: np.ndarray,
) -> list[int]:
    """Re-apply the moves of a search made with another memory model, keeping each one that
    is still valid (dependencies) and, with the block's model, leaves no point above
    ``reference`` and lowers the mean ratio to it."""
    ref = np.maximum(as_float(reference), 1.0)
    order = list(start)
    tl = timeline(block, order)
    current = float((as_float(tl.peaks) / ref).mean())
    for nodes, before in trajectory:
        pos = tl.pos
        group = sorted(int(pos[x]) for x in nodes)
        dst = int(pos[before]) if before >= 0 else block.n
        moved = move(tl.order, group, dst)
        new_pos = np.empty(block.n, dtype=np.int64)
        new_pos[np.asarray(moved, dtype=np.int64)] = np.arange(block.n, dtype=np.int64)
        if any(new_pos[q] > new_pos[x] for x in nodes for q in block.preds[x]) or any(
            new_pos[y] < new_pos[x] for x in nodes for y in block.succs[x]
        ):
            continue
        cand = timeline(block, moved)
        if (cand.peaks > reference).any():
            continue
        mean = float((as_float(cand.peaks) / ref).mean())
        if mean < current:
            tl, current = cand, mean
    return tl.order


def as_float(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float64) if values.dtype == object else values


# ====================================================================== balanced search


@dataclass
class Pool:
    """Orders met by a search, with their peaks at the acceptance points.

    ``reference`` is, per point, the lowest peak of any order scored so far (each local-search
    step contributes, not only the orders kept): the yardstick of :meth:`ratios`.
    """

    block: Block
    base: np.ndarray  # peaks of the input order (float64, for ratios)
    reference: np.ndarray = field(init=False)
    base_exact: np.ndarray = field(init=False)  # the same as integers (exact comparisons)
    orders: dict[str, list[int]] = field(default_factory=dict)
    peaks: dict[str, np.ndarray] = field(default_factory=dict)
    exact: dict[str, np.ndarray] = field(default_factory=dict)
    best_at: dict[int, list[int]] = field(default_factory=dict)
    _keys: set[tuple[int, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.base_exact = np.asarray(self.base)
        self.base = as_float(self.base).astype(np.float64)
        self.reference = self.base.copy()

    def observe(self, peaks: np.ndarray, order: list[int] | None = None) -> None:
        """Lower the reference to ``peaks``; remember ``order`` where it sets a new best."""
        peaks = as_float(peaks)
        if order is not None:
            for p in np.nonzero(peaks < self.reference)[0]:
                self.best_at[int(p)] = order
        np.minimum(self.reference, peaks, out=self.reference)

    def collect(self) -> None:
        """Add the best order met at each point (see :meth:`observe`) as ``best@p``."""
        for p, order in sorted(self.best_at.items()):
            self.add(f"best@{p}", order)

    def add(self, name: str, order: list[int], peaks: np.ndarray | None = None) -> bool:
        """Record ``order`` under ``name`` unless the same order is already there."""
        key = tuple(order)
        if key in self._keys:
            return False
        if peaks is None:
            peaks = timeline(self.block, order).peaks
        self._keys.add(key)
        self.orders[name] = list(order)
        self.peaks[name] = as_float(peaks).astype(np.float64)
        self.exact[name] = np.asarray(peaks)
        self.observe(peaks)
        return True

    def ratios(self, name: str, points: np.ndarray | None = None) -> np.ndarray:
        """Peaks of ``name`` over the reference (restricted to ``points``)."""
        ref = np.maximum(self.reference, 1.0)
        r = self.peaks[name] / ref
        return r if points is None else r[points]

    def excess(self, name: str, points: np.ndarray | None = None) -> float:
        """How far ``name`` rises above the input order (0 when nowhere)."""
        over = self.peaks[name] / np.maximum(self.base, 1.0) - 1.0
        if points is not None:
            over = over[points]
        return max(0.0, float(over.max())) if over.size else 0.0

    def rank_key(self, name: str, points: np.ndarray | None = None) -> tuple[float, float, float]:
        """Lower is better: no point above the input, then the worst ratio to the reference,
        then the mean ratio."""
        r = self.ratios(name, points)
        return (round(self.excess(name, points), 9), round(float(r.max()), 9), float(r.mean()))


def _key(
    tl: Timeline,
    reference: np.ndarray,
    base: np.ndarray | None,
    points: np.ndarray,
) -> tuple[float, float, int, float]:
    """The objective of :func:`balance`: excess over ``base``, worst ratio to ``reference``,
    steps at the peak of the worst points, sum of ratios (all over ``points``)."""
    peaks = as_float(tl.peaks)[points]
    r = peaks / reference[points]
    worst = r.max()
    excess = 0.0
    if base is not None:
        excess = max(0.0, float((peaks / base[points]).max()) - 1.0)
    at_peak = 0
    for j in np.nonzero(r >= worst - 1e-12)[0]:
        p = int(points[j])
        at_peak += int((tl.by_point[p] == tl.peaks[p]).sum())
    return (round(excess, 9), round(float(worst), 9), at_peak, float(r.sum()))


def balance(
    pool: Pool,
    start: list[int],
    evaluations: int,
    moves_per_step: int,
    points: np.ndarray | None = None,
    feasible: bool = True,
) -> tuple[list[int], int]:
    """Local search for an order that is good at all ``points`` at once.

    Minimizes, lexicographically: how far the peak rises above the input order's at any point
    (with ``feasible``), the worst ratio of the peak to the pool's reference, the number of
    steps at the peak of the worst points (to leave plateaus), the sum of ratios. The moves are
    those of :func:`peak_moves` at the worst point first, joint delays included. (``refine``
    goes without them: it also keeps moves that only shorten a plateau at the peak, and with
    joint delays offered there the MLP steps' orders changed while no peak was lowered.)
    Every order scored lowers the pool's reference. At most ``evaluations`` orders are scored.

    Returns
    -------
    tuple
        The order reached and the number of orders scored.
    """
    block = pool.block
    points = np.arange(pool.base.size) if points is None else np.asarray(points)
    base = np.maximum(pool.base, 1.0) if feasible else None
    tl = timeline(block, start)
    pool.observe(tl.peaks, tl.order)
    spent = 0
    while spent < evaluations:
        reference = np.maximum(pool.reference, 1.0)
        current = _key(tl, reference, base, points)
        peaks = as_float(tl.peaks)[points]
        if current[0] > 0 and base is not None:
            pressure = peaks / base[points]
        else:
            pressure = peaks / reference[points]
        best = None
        for j in np.argsort(-pressure, kind="stable"):
            p = int(points[j])
            k = int(np.argmax(tl.by_point[p]))
            for _, group, dst in peak_moves(block, tl, k, p, moves_per_step, joint=True):
                if spent >= evaluations:
                    break
                spent += 1
                cand = timeline(block, move(tl.order, group, dst))
                pool.observe(cand.peaks, cand.order)
                key = _key(cand, reference, base, points)
                if key < current and (best is None or key < best[0]):
                    best = (key, cand)
            if best is not None or spent >= evaluations:
                break
        if best is None:
            break
        tl = best[1]
    return tl.order, spent


def kick(block: Block, order: list[int], rng: np.random.Generator, count: int) -> list[int]:
    """``order`` with ``count`` random bindings each moved to a random position between its
    last producer and its first consumer (so the result respects the dependencies)."""
    out = list(order)
    n = block.n
    pos = np.empty(n, dtype=np.int64)
    for _ in range(count):
        pos[np.asarray(out, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        u = int(rng.integers(n))
        lo = max((int(pos[q]) for q in block.preds[u]), default=-1) + 1
        hi = min((int(pos[x]) for x in block.succs[u]), default=n)
        at = int(pos[u])
        dst = int(rng.integers(lo, hi + 1))
        if dst not in (at, at + 1):
            out = move(out, [at], dst)
    return out


def iterated_search(
    pool: Pool,
    start: list[int],
    evaluations: int,
    moves_per_step: int,
    points: np.ndarray | None = None,
    feasible: bool = True,
    seed: int = 0,
    kick_size: int = 4,
) -> list[int]:
    """Iterated local search: :func:`balance` from ``start``, then, until ``evaluations``
    orders are scored, :func:`balance` again from a :func:`kick` of the current order, which
    the result replaces when its key is no worse (so the search drifts along plateaus). The
    best order met is returned. Deterministic for a given ``seed``."""
    block = pool.block
    points = np.arange(pool.base.size) if points is None else np.asarray(points)
    base = np.maximum(pool.base, 1.0) if feasible else None
    rng = np.random.default_rng(seed)
    current, spent = balance(pool, start, evaluations, moves_per_step, points, feasible)
    best = current
    current_tl = best_tl = timeline(block, current)
    spent += 1
    while spent < evaluations:
        kicked = kick(block, current, rng, kick_size)
        order, used = balance(pool, kicked, evaluations - spent, moves_per_step, points, feasible)
        spent += used + 1
        tl = timeline(block, order)
        reference = np.maximum(pool.reference, 1.0)
        key = _key(tl, reference, base, points)
        if key <= _key(current_tl, reference, base, points):
            current, current_tl = order, tl
            if key < _key(best_tl, reference, base, points):
                best, best_tl = order, tl
    return best


def balanced_search(
    pool: Pool,
    evaluations: int,
    moves_per_step: int,
    focus_points: int = 6,
    width: int = 3,
    seed: int = 0,
) -> None:
    """Add to ``pool`` orders tuned for single points and orders balanced across all of them.

    1. For up to ``focus_points`` acceptance points spread over the range (sorted by their
       peak under the input order, the smallest and the largest always among them), an
       :func:`iterated_search` from the pool's best order at that point, for that point alone:
       it lowers the reference and gives starting points that are good somewhere.
    2. :func:`iterated_search` over all points, with the input order's peaks as a ceiling,
       from the ``width`` best orders of the pool (by :meth:`Pool.rank_key`).
    3. The best order met at each point (:meth:`Pool.collect`).

    Two thirds of ``evaluations`` go to step 1, the rest to step 2. Orders tuned for one point
    are often the best known at many others: the pool scores every one at every point.
    """
    if evaluations <= 0 or not pool.orders:
        return
    count = pool.base.size
    by_size = np.argsort(pool.base, kind="stable")
    picks = min(focus_points, count)
    chosen = sorted(
        {int(by_size[round(i * (count - 1) / max(picks - 1, 1))]) for i in range(picks)}
    )
    share = max(1, 2 * evaluations // (3 * len(chosen)))
    for i, p in enumerate(chosen):
        name = min(pool.orders, key=lambda x: pool.peaks[x][p])
        order = iterated_search(
            pool, pool.orders[name], share, moves_per_step, np.array([p]), False, seed + i
        )
        pool.add(f"point{p}", order)
    share = max(1, (evaluations - share * len(chosen)) // width)
    ranked = sorted(pool.orders, key=pool.rank_key)[:width]
    for i, name in enumerate(ranked):
        order = iterated_search(
            pool, pool.orders[name], share, moves_per_step, seed=seed + len(chosen) + i
        )
        pool.add(f"balanced-{name}", order)
    pool.collect()

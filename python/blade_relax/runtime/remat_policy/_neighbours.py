"""The temp regime's shortcut: sets one slot away from an evaluated set, evaluated from it.

In the temp regime a search's trial sets (one slot added, or one put back) change only the
``regenerate`` calls that read or materialize that slot: :class:`_TempNeighbours` builds their
walks from the set's own, and :func:`_evaluate_neighbours` their live bytes from the set's.
The numbers are :func:`~._evaluation.evaluate`'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ._calls import _call, _Walk
from ._evaluation import Evaluation, _remembered, _store, _with_peaks, evaluate
from ._timeline import ConcreteTimeline


class _TempNeighbours:
    """The walks of the sets one slot away from an evicted set in the temp regime, from the
    set's own evaluation, without walking.

    In that regime each evicted slot has its own regenerate call, and nothing it
    materializes is kept: adding a slot ``x`` adds its call and changes only the calls
    before it whose recomputation reads ``x`` (it is then pending there too); putting ``x``
    back drops its call and changes only the calls before it that materialize ``x``. The
    other calls are the set's. (The walk goes through every evicted slot.)
    """

    def __init__(self, tl: ConcreteTimeline, ev: Evaluation) -> None:
        self.tl = tl
        self.calls = calls = ev.calls
        rank = tl._rank
        self.ranks = [rank[run.slot] for run in calls]
        # Before each call: the slots whose calls came earlier (done when the walk reaches
        # it), what the earlier calls read and do not materialize (their frontiers) and what
        # they materialize, and their cost summed in order as the walk sums it.
        self.done_before = done_before = [0]
        self.read_before = read_before = [0]
        self.made_before = made_before = [0]
        self.cost_before = cost_before = [0.0]
        for run in calls:
            done_before.append(done_before[-1] | 1 << run.slot)
            read_before.append(read_before[-1] | run.frontier)
            made_before.append(made_before[-1] | run.inputs)
            cost_before.append(cost_before[-1] + run.cost)
        self.chosen_mask = done_before[-1]

    def _neighbour(self, x: int, add: bool) -> _Walk:
        """The walk of the set with ``x`` added (``add``) or put back."""
        tl = self.tl
        plan_masks = tl._plan_masks
        done_before = self.done_before
        place = bisect.bisect_left(self.ranks, tl._rank[x])
        trial_mask = self.chosen_mask | 1 << x if add else self.chosen_mask & ~(1 << x)
        new_calls = self.calls[:place]
        first = place
        # The calls before x that read it (adding) or materialize it (putting back).
        if (self.read_before if add else self.made_before)[place] >> x & 1:
            for i in range(place):
                run = new_calls[i]
                if (run.frontier if add else run.inputs) >> x & 1:
                    pending = plan_masks[run.slot] & trial_mask & ~done_before[i]
                    new_calls[i] = _call(tl, run.slot, pending, 0)
                    first = min(first, i)
        if add:
            new_calls.append(_call(tl, x, plan_masks[x] & trial_mask & ~done_before[place], 0))
            new_calls += self.calls[place:]
        else:
            new_calls += self.calls[place + 1 :]
        cost = self.cost_before[first]
        for run in new_calls[first:]:
            cost += run.cost
        return _Walk(cost, new_calls, [], [])

    def added(self, x: int) -> _Walk:
        """The walk of the set with ``x`` (not in it) evicted too."""
        return self._neighbour(x, True)

    def removed(self, x: int) -> _Walk:
        """The walk of the set with ``x`` (in it) put back."""
        return self._neighbour(x, False)


def _evaluate_neighbours(
    tl: ConcreteTimeline,
    chosen: frozenset[int],
    ev: Evaluation,
    slots: Sequence[int],
    add: bool,
) -> list[Evaluation]:
    """:func:`evaluate` in the temp regime of ``chosen`` with each slot of ``slots`` added
    (``add``) or put back, from ``ev``, the evaluation of ``chosen`` in that regime.

    The live bytes are ``ev``'s less (or plus) the slot's bytes on its window, the walk is
    :class:`_TempNeighbours`'s: the numbers are :func:`evaluate`'s. A slot that is not
    effective (no bytes, or a storage held past its copy: not one window of its bytes) or
    that the set already has (or lacks) is evaluated as any set is.
    """
    out: list[Evaluation | None] = [None] * len(slots)
    # Each slot to evaluate from ev: its trial set and where it goes in ``out``.
    todo: dict[int, tuple[frozenset[int], list[int]]] = {}
    effective = tl._effective_mask
    for i, x in enumerate(slots):
        trial = chosen | {x} if add else chosen - {x}
        found = _remembered(tl, trial, False)
        if found is not None:
            out[i] = found
        elif (x in chosen) == add or not effective[x]:
            out[i] = evaluate(tl, trial, False)
        else:
            todo.setdefault(x, (trial, []))[1].append(i)
    if not todo:
        return out  # type: ignore[return-value]
    neighbours = _TempNeighbours(tl, ev)
    step = neighbours.added if add else neighbours.removed
    walks = [step(x) for x in todo]
    window = tl.window_bytes()[list(todo)]
    live = ev.live[None, :] - window if add else ev.live[None, :] + window
    for (trial, places), result in zip(todo.values(), _with_peaks(walks, live)):
        _store(tl, trial)[(trial, False)] = result
        for i in places:
            out[i] = result
    return out  # type: ignore[return-value]

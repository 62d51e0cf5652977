"""Storages of ``PlanMemory`` indexed by where they end (private helper).

For every tensor group it places, the planner looks for storages that are free by then: those
whose memory ends before the group starts. Scanning every storage of the function for every
group costs the product of the two counts, which grows with the square of the model's depth.
:class:`EndIndex` keeps the items of each class (for the planner: storages of one byte size,
storage scope and device) ordered by their end, so that the items ended before a binding are
read latest first, and a caller that can bound what the older items are worth (the live bytes
a storage adds over its gap grow with the gap) stops reading a class early.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["EndIndex"]

T = TypeVar("T")


class EndIndex(Generic[T]):
    """Items in classes, each class ordered by ``(end, order)``.

    ``order`` tells apart items of one class that end at the same binding (for the planner:
    the storage's creation order); an item is found again by its class, end and order, so a
    caller that changes an item's end or class removes it first and inserts it again.
    """

    def __init__(self) -> None:
        self._keys: dict[Hashable, list[tuple[int, int]]] = {}
        self._items: dict[Hashable, dict[int, T]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._keys.values())

    def insert(self, cls: Hashable, end: int, order: int, item: T) -> None:
        """Add ``item`` to class ``cls``, ending at ``end``."""
        bisect.insort(self._keys.setdefault(cls, []), (end, order))
        self._items.setdefault(cls, {})[order] = item

    def remove(self, cls: Hashable, end: int, order: int) -> T:
        """Take out the item inserted as ``(cls, end, order)`` and return it.

        Raises
        ------
        KeyError
            When no such item is in the index.
        """
        entries = self._keys.get(cls)
        key = (end, order)
        i = bisect.bisect_left(entries, key) if entries else 0
        if not entries or i == len(entries) or entries[i] != key:
            raise KeyError((cls, end, order))
        del entries[i]
        item = self._items[cls].pop(order)
        if not entries:
            del self._keys[cls], self._items[cls]
        return item

    def classes(self) -> list[Hashable]:
        """The classes holding at least one item, in the order they were first filled."""
        return list(self._keys)

    def ended_before(self, cls: Hashable, start: int) -> Iterator[tuple[int, T]]:
        """``(end, item)`` for the items of ``cls`` with ``end < start``, latest end first.

        The index must not change while the iterator is read.
        """
        entries = self._keys.get(cls)
        if not entries:
            return
        items = self._items[cls]
        # (start,) sorts before every (start, order): the first entry ending at start or later.
        for i in range(bisect.bisect_left(entries, (start,)) - 1, -1, -1):
            end, order = entries[i]
            yield end, items[order]

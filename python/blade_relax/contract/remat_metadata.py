"""The remat metadata: what a rematerialized function tells the runtime about its memory.

:class:`~blade_relax.transform.Rematerialize` writes it (``transform.remat._timeline``) as JSON
into the function's attribute :data:`~blade_relax.contract.REMAT_META_ATTR` and into the
``metadata`` constant of its ``remat_begin`` call; :class:`blade_relax.runtime.remat.RematProgram`
reads it back. :class:`RematMetadata` is the one definition of its fields and of their JSON
spelling, for both sides; :data:`REMAT_FORMAT` is its version.

The model
---------
The function's execution is a sequence of *points* ``0 .. points - 1`` (allocations,
``regenerate`` calls, kernels holding a workspace). Every size is a dim expression
(:mod:`.dimexpr`) over :attr:`RematMetadata.dims`, stored once in :attr:`RematMetadata.exprs`
and referred to by its index there:

* each *storage* is live over the points ``[first, end)`` with ``exprs[size]`` bytes;
* each *slot* (a tensor that may be evicted) frees ``exprs[nbytes]`` bytes over the points
  ``[start, site)`` when evicted, costs ``exprs[cost]`` (loop iterations of its kernels) to
  recompute, peaks at ``exprs[regen_peak]`` bytes while it is recomputed, and is recomputed by
  its ``plan``: the regeneration closures to run at its site, in order, each with where its
  inputs come from.

JSON
----
One object (``json.dumps`` with ``separators=(",", ":")``), keys in this order::

    {"format": REMAT_FORMAT, "function": str, "dims": [str], "exact": bool, "notes": [str],
     "points": int, "exprs": [str], "storages": [[size, first, end]],
     "slots": [{"name": str, "regen": str, "bytes": int, "cost": int, "regen_peak": int,
                "start": int, "site": int, "plan": [[slot, [["a" | "s", int]]]]}]}

In a plan, ``["a", i]`` is the ``i``-th field of the inputs tuple the ``regenerate`` call
passes, ``["s", k]`` the tensor of slot ``k`` (kept by the runtime, or materialized first by an
earlier node of the same plan). ``exact`` and ``notes`` may be left out (inexact, no notes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REMAT_FORMAT", "PlanNode", "RematFormatError", "RematMetadata", "RematSlot"]

#: Version of the remat metadata JSON; the runtime refuses any other (the module must be
#: recompiled with the same blade_relax).
REMAT_FORMAT = "blade_relax.remat/2"


class RematFormatError(ValueError):
    """Metadata of another format version, or not of the shape :class:`RematMetadata` reads."""


@dataclass(frozen=True)
class PlanNode:
    """One regeneration closure a plan runs: the slot it recomputes and where each input is.

    Attributes
    ----------
    slot
        The slot whose regeneration closure runs.
    refs
        Per closure parameter: ``("a", i)``, field ``i`` of the ``regenerate`` call's inputs,
        or ``("s", k)``, the tensor of slot ``k``.
    """

    slot: int
    refs: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RematSlot:
    """One evictable tensor (see the module docstring; sizes are indices into the exprs).

    Attributes
    ----------
    name
        The tensor's variable in the function.
    regen
        The name of its regeneration function in the module.
    nbytes, cost, regen_peak
        Indices into :attr:`RematMetadata.exprs`: its bytes, its recompute cost, the peak of its
        regeneration.
    start, site
        Its window: the first point its bytes are gone when evicted, and the point of its
        ``regenerate`` call.
    plan
        The closures its ``regenerate`` call runs, in order.
    """

    name: str
    regen: str
    nbytes: int
    cost: int
    regen_peak: int
    start: int
    site: int
    plan: tuple[PlanNode, ...]


@dataclass(frozen=True)
class RematMetadata:
    """The remat metadata of one function (see the module docstring).

    Attributes
    ----------
    function
        The rematerialized function's name.
    dims
        The dims ``remat_begin`` receives, in order: the names the exprs read.
    exact
        Whether the timeline accounts for every allocation of the function (read from the
        planned IR, every call followed).
    notes
        Why it is not exact.
    points
        How many points the timeline has.
    exprs
        Every distinct size, as a dim expression over ``dims``.
    storages
        Per storage: ``(size, first, end)``, ``size`` an index into ``exprs``.
    slots
        The evictable tensors, by slot number.
    """

    function: str
    dims: tuple[str, ...]
    exact: bool
    notes: tuple[str, ...]
    points: int
    exprs: tuple[str, ...]
    storages: tuple[tuple[int, int, int], ...]
    slots: tuple[RematSlot, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (keys in the order of the module docstring)."""
        return {
            "format": REMAT_FORMAT,
            "function": self.function,
            "dims": list(self.dims),
            "exact": self.exact,
            "notes": list(self.notes),
            "points": self.points,
            "exprs": list(self.exprs),
            "storages": [list(s) for s in self.storages],
            "slots": [
                {
                    "name": s.name,
                    "regen": s.regen,
                    "bytes": s.nbytes,
                    "cost": s.cost,
                    "regen_peak": s.regen_peak,
                    "start": s.start,
                    "site": s.site,
                    "plan": [[n.slot, [list(r) for r in n.refs]] for n in s.plan],
                }
                for s in self.slots
            ],
        }

    def to_json(self) -> str:
        """The JSON text an executable carries."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, meta: Mapping[str, Any]) -> RematMetadata:
        """Read a decoded JSON object.

        Raises
        ------
        RematFormatError
            For another :data:`REMAT_FORMAT` (the module must be recompiled with this
            blade_relax), a missing key or a value of the wrong kind.
        """
        found = meta.get("format")
        if found != REMAT_FORMAT:
            raise RematFormatError(
                f"remat metadata of format {found!r}; this blade_relax reads "
                f"{REMAT_FORMAT!r} (recompile the module with this version of blade_relax)"
            )
        try:
            return cls(
                function=str(meta["function"]),
                dims=tuple(str(d) for d in meta["dims"]),
                exact=bool(meta.get("exact", False)),
                notes=tuple(str(n) for n in meta.get("notes", ())),
                points=int(meta["points"]),
                exprs=tuple(str(e) for e in meta["exprs"]),
                storages=tuple((int(s), int(a), int(b)) for s, a, b in meta["storages"]),
                slots=tuple(_slot(s) for s in meta["slots"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            what = f"no {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
            raise RematFormatError(f"malformed remat metadata: {what}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> RematMetadata:
        """Parse the JSON text (see :meth:`from_dict`)."""
        return cls.from_dict(json.loads(text))


def _slot(slot: Mapping[str, Any]) -> RematSlot:
    return RematSlot(
        name=str(slot["name"]),
        regen=str(slot["regen"]),
        nbytes=int(slot["bytes"]),
        cost=int(slot["cost"]),
        regen_peak=int(slot["regen_peak"]),
        start=int(slot["start"]),
        site=int(slot["site"]),
        plan=tuple(
            PlanNode(int(k), tuple((str(kind), int(i)) for kind, i in refs))
            for k, refs in slot["plan"]
        ),
    )

"""What one run of :class:`~.memory_aware_schedule.MemoryAwareSchedule` reports: per block,
per run, and as a :class:`~blade_relax.transform.result.PassResult`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tvm
from tvm import relax

from ...symbolic import SymbolicExpr
from ..dispatch import range_of
from ..result import (
    FunctionResult,
    PassResult,
    counted,
    snapshot,
    timeline_peak,
)

if TYPE_CHECKING:
    pass


@dataclass
class BlockReport:
    """What the pass did to one dataflow block.

    Attributes
    ----------
    function, block
        The function's name and the block's index in its body.
    bindings
        Number of bindings.
    strategy
        The candidate whose order was kept (``"input"`` when unchanged; ``"best@3"`` is the
        best order met at acceptance point 3, ``"point3"`` the search tuned for it,
        ``"balanced-<start>"`` the balanced search from that candidate, ``"seed<i>"`` an order
        from the search over the whole range), why the block was skipped (``"skipped: ..."``),
        or, for a range copy that did not beat the single order, ``"single order kept"``.
    proven
        Whether the kept order's peak is proven no higher than the input's (True when
        unchanged).
    points
        The acceptance points (free dims only).
    peak_before, peak_after
        Peak live bytes of the block at each acceptance point, input order and kept order.
    candidates
        Per candidate strategy: ``"proven"`` (accepted, peak proven no higher), ``"sampled"``
        (accepted from the acceptance points), ``"rejected"``, ``"no gain"``, ``"duplicate"``
        (same order as an earlier candidate or the input) or ``"not needed"`` (ranked below
        the kept order).
    peak_expr_before, peak_expr_after
        The symbolic peaks (Max over the steps that can be the peak).
    seconds
        Time spent on the block.
    version
        For a block of a range copy, its range (``"2 <= s <= 31"``); empty otherwise.
    """

    function: str
    block: int
    bindings: int
    strategy: str
    proven: bool = True
    points: list[dict[str, int]] = field(default_factory=list)
    peak_before: list[int] = field(default_factory=list)
    peak_after: list[int] = field(default_factory=list)
    candidates: dict[str, str] = field(default_factory=dict)
    peak_expr_before: SymbolicExpr | None = None
    peak_expr_after: SymbolicExpr | None = None
    seconds: float = 0.0
    version: str = ""

    @property
    def changed(self) -> bool:
        return self.strategy not in ("input",) and not self.strategy.startswith("skipped")


@dataclass
class ScheduleReport:
    """Per-block reports of one run of the pass, and the range versions it emitted
    (function name: ranges, in dispatch order)."""

    blocks: list[BlockReport] = field(default_factory=list)
    versions: dict[str, list[str]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(b.changed for b in self.blocks)


def schedule_result(mod: tvm.IRModule, out: tvm.IRModule, report: ScheduleReport) -> PassResult:
    """The :class:`PassResult` of one run: each Relax function of ``mod``, then the range
    copies the run added to ``out``."""
    out_functions = {gv.name_hint: f for gv, f in out.functions.items()}
    if out is not mod:  # the peaks are read later: from the modules as they are now
        mod, out = snapshot(mod), snapshot(out)
    taken = {gv.name_hint for gv in mod.get_global_vars()}
    results: list[FunctionResult] = []
    copies: list[FunctionResult] = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        name = gv.name_hint
        new = out_functions[name]
        blocks = [b for b in report.blocks if b.function == name]
        notes = tuple(
            f"block {b.block}: {b.strategy}"
            for b in blocks
            if not b.version
            and (b.strategy.startswith("skipped") or "after recomputation" in b.strategy)
        )
        if new.same_as(func):
            results.append(FunctionResult(name, False, notes=notes))
            continue
        before = timeline_peak(func, mod)
        if name not in report.versions:
            after = timeline_peak(new, out)
            changes = _order_changes(func, new, [b for b in blocks if not b.version])
            results.append(FunctionResult(name, True, changes, before, after, notes))
            continue
        ranges = report.versions[name]
        phrase = f"dispatches over {counted(len(ranges), 'range copy', 'range copies')}"
        notes += ("ranges: " + ", ".join(ranges),)
        results.append(FunctionResult(name, True, (phrase,), before, None, notes))
        for copy_name, copy in out_functions.items():
            info = range_of(copy)
            if copy_name in taken or info is None or info[0] != name:
                continue
            in_range = [b for b in blocks if b.version == str(info[1])]
            changes = (f"range copy for {info[1]}", *_order_changes(func, copy, in_range))
            after = timeline_peak(copy, out)
            copies.append(FunctionResult(copy_name, True, changes, before, after))
    return PassResult("MemoryAwareSchedule", (*results, *copies), detail=report)


def _order_changes(
    before: relax.Function, after: relax.Function, blocks: Sequence[BlockReport]
) -> tuple[str, ...]:
    """What a new order changed: the bindings moved and the blocks reordered (with how the
    order was accepted)."""
    out = []
    moved = _bindings_moved(before, after)
    if moved:
        out.append(f"{counted(moved, 'binding')} moved")
    changed = [b for b in blocks if b.changed and b.strategy != "single order kept"]
    if changed:
        proven = sum(1 for b in changed if b.proven)
        how = "proven" if proven == len(changed) else f"{proven} proven, rest sampled"
        out.append(f"{len(changed)} of {counted(len(blocks), 'block')} reordered ({how})")
    return tuple(out)


def _bindings_moved(before: relax.Function, after: relax.Function) -> int | None:
    """The fewest bindings that, moved, turn the blocks of ``before`` into those of ``after``
    (bindings told apart by name: ``after`` may be a copy with fresh variables); ``None``
    when the blocks do not correspond."""
    old_blocks, new_blocks = before.body.blocks, after.body.blocks
    if len(old_blocks) != len(new_blocks):
        return None
    moved = 0
    for old, new in zip(old_blocks, new_blocks):
        names = [b.var.name for b in old.bindings]
        index = {n: i for i, n in enumerate(names)}
        order = [index.get(b.var.name) for b in new.bindings]
        if len(index) != len(names) or len(order) != len(names) or None in order:
            return None
        # Those outside a longest increasing subsequence of the old positions move.
        tails: list[int] = []
        for position in order:
            at = bisect.bisect_left(tails, position)
            tails[at : at + 1] = [position]
        moved += len(order) - len(tails)
    return moved

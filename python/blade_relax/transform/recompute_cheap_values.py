"""RecomputeCheapValues: recompute elementwise results where they are read late, when their inputs
are live there anyway.

A training step keeps forward values for the backward. Many of them are cheap functions of
other values the backward keeps anyway: a normalized hidden state ``x * rsqrt(..) * w`` of the
residual stream ``x`` (which the norm's own backward reads), a gated activation ``silu(g) * u``
of the two projections (which the activation's backward reads). Keeping both the inputs and
the result from the forward until the backward holds the result's bytes across everything in
between; recomputing it just before its late readers holds them only there. This is what
``torch.compile``'s min-cut partitioner does for pointwise ops; here it is decided on the fixed
order of the block.

The rule
--------
For a binding ``v = k(a, b, ...)`` of a dataflow block, where ``k`` is an injective kernel (a
``call_tir`` of a PrimFunc whose op pattern is at most ``max_pattern``: elementwise,
broadcast, injective; not a reshape, which costs nothing to keep) with one tensor result read
only inside the block: the reads of ``v`` are split at the largest gap between consecutive
reads; if the reads after the gap all come no later than the last read of every tensor input
(``a``, ``b``, ... are then live at each of them anyway), a copy ``v' = k(a, b, ...)`` is bound
just before the first late read, and the late reads read ``v'``.

The reads of ``v`` include those of its views: a reshape kernel of ``v`` (which the VM runs as
a view, ``RewriteDataflowReshape``) is the same memory, kept alive by the view's reads. An
imported graph reshapes almost every matmul operand, so the late reads are mostly reads of a
view made early (``h`` flattened for a projection and read again by its weight gradient). The
view is copied with the value (``r' = reshape(v')``) and the late reads of the view read
``r'``; a view read after the block, or one with views of its own, keeps ``v`` as it is.

Why it never raises the peak
----------------------------
At every point of the block the new live set is a subset of the old one: ``v`` (with its
views) now dies at its last early read instead of its last late read; ``v'`` is live from just
before the first late read to the last one, where ``v`` was live before (and it has ``v``'s
size); the inputs were live at every late read already, so the recomputation extends no
lifetime. This holds for every value of the symbolic dims, so no comparison of sizes is
needed, and the bytes live in the gap drop by ``v``'s size. The memory planners that run later
only share storage where the unshared program allows it (``PlanMemory`` proves its sharing
never raises that program's peak), and the runtime's memory accounting and
``blade_relax.analysis.memory_timeline`` see the smaller lifetimes. The cost is one more run of
the kernel per recomputed value (elementwise work, next to the matmuls around it).

Chains, and values whose inputs die early, do not have that argument: a value recomputed with
the cheap kernels that made its inputs (up to ``max_chain`` kernels), or by keeping one input
alive until the copy (``extend_inputs``), is accepted only where the timeline of the block with
the copy proves the peak no higher for every admissible value of the dims and lower for one
(``_lowers``: symbolically, or value by value where a bounded dim takes few enough). Plans
are tried one at a time, each against the block with the ones accepted before it.

Attention
---------
An attention layer's probabilities ``P = softmax(q @ k^T * scale + mask)`` (a ``(b, h, s, s)``
tensor) are read by ``P @ V`` in the forward and by the softmax's and ``P @ V``'s backward,
which also read ``q``, ``k`` and ``V``. Kept, every layer's ``P`` is live from its forward
until its backward. With ``RecomputeOptions.attention`` a softmax kernel
(``vectorize_softmax.is_softmax_kernel``) read late is recomputed from the GEMM that made its
scores, as fused attention's backward does: the chain runs through views (``reshape``
kernels, at no cost in ``max_chain``), cheap kernels (the scale, the mask's ``where``) and one
GEMM, whose operands are live at the late reads. An input of the chain that would die earlier
and that no cheap kernel makes (a mask shared by the layers) is kept alive until the copy
instead. Such a plan is a chain, so it is accepted only where the timeline proves it (above).
Each recomputation reruns the same kernels on the same inputs: the backward reads the same
bits. The cost is one more scores GEMM and softmax per layer.

Where it runs
-------------
After ``MemoryAwareSchedule`` (the order of the block is the one that will run) and before
``ToNonDataflow`` (it inserts bindings into dataflow blocks): in :func:`blade_relax.get_pipeline`
right after the schedule pass. The recomputed copy is a pure binding, so the passes after it
(fusion is over, planning comes later) treat it as any other kernel call.

What it assumes
---------------
A normalized module after ``FuseTIR``: kernels are ``call_tir`` of PrimFuncs, whose op pattern
``AnnotateTIROpPattern`` computes (on a copy of the module: fused kernels carry none). Bindings
that are not such calls, values read after their block, and blocks of other kinds are left as
they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..analysis import (
    MemoryTimeline,
    SampledTimeline,
    TimelineMemo,
    lowers_peak,
    memory_timeline,
)
from ..analysis.effects import in_place_writes, reshape_pattern
from ..symbolic import Ordering
from ..util.collection import pauses_collection
from ._block_edit import (
    copy_chain,
    insert_copies,
    rewrite_dataflow_blocks,
    vars_read_after,
    with_blocks,
)
from .dispatch_gemm import gemm_layout
from .result import PassResult, counted, function_results, publish
from .vectorize_softmax import is_softmax_kernel

__all__ = ["RecomputeCheapValues", "RecomputeOptions", "RecomputeReport"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
#: A position after every binding of a block: where values read after the block die.
_AFTER_BLOCK = 1 << 62


@dataclass(frozen=True)
class RecomputeOptions:
    """Options of :class:`RecomputeCheapValues`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    max_pattern
        The largest ``op_pattern`` of a kernel that may be recomputed: 0 elementwise,
        1 broadcast, 2 injective (the default).
    min_gap
        The fewest bindings between the last early read and the first late read for a
        recomputation (a shorter gap saves too little to pay for the kernel).
    max_chain
        The most kernels recomputed for one value: its own, and those of cheap inputs that are
        not live at the late reads (``1``: only values whose inputs are all live there).
    extend_inputs
        Also recompute a value by keeping one input of its own type alive until the late reads
        (the input takes the value's place), where the timeline proves it.
    attention
        Also recompute attention probabilities: a softmax (over the last axis) of a GEMM's
        result through views and injective kernels (``softmax(q @ k^T * scale + mask)``), from
        the GEMM's operands, which the attention's backward reads anyway. Inputs of the chain
        that would die earlier (a mask shared by the layers) are kept alive until the copy.
        Accepted only where the timeline proves the peak no higher (see "Attention" above).
    """

    enabled: bool = True
    max_pattern: int = 2
    min_gap: int = 2
    max_chain: int = 3
    extend_inputs: bool = True
    attention: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.max_pattern <= 2:
            raise ValueError(f"max_pattern must be 0, 1 or 2, got {self.max_pattern}")
        if self.min_gap < 1:
            raise ValueError(f"min_gap must be at least 1, got {self.min_gap}")
        if self.max_chain < 1:
            raise ValueError(f"max_chain must be at least 1, got {self.max_chain}")


@dataclass
class RecomputeReport:
    """What one run changed: values ``recomputed`` (one copy each)."""

    recomputed: int = 0


def kernel_patterns(mod: tvm.IRModule) -> dict[str, int]:
    """The ``op_pattern`` of every PrimFunc of ``mod``, by name.

    ``FuseTIR`` emits fused kernels without the attribute; ``AnnotateTIROpPattern`` (run on a
    copy, the module is not changed) computes it for them as for any kernel.
    """
    annotated = relax.transform.AnnotateTIROpPattern()(mod)
    out = {}
    for gv, func in annotated.functions.items():
        if (
            isinstance(func, tirx.PrimFunc)
            and func.attrs is not None
            and "op_pattern" in func.attrs
        ):
            out[gv.name_hint] = int(func.attrs["op_pattern"])
    return out


def _cheap_kernel(
    mod: tvm.IRModule, patterns: dict[str, int], value: relax.Expr, max_pattern: int
) -> bool:
    """Whether ``value`` calls an injective kernel that is not a reshape."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR):
        return False
    if not isinstance(value.ty, relax.TensorType):
        return False
    callee = value.args[0]
    if not isinstance(callee, relax.GlobalVar) or patterns.get(callee.name_hint, 99) > max_pattern:
        return False
    return not reshape_pattern(mod[callee])


def _attention_kind(mod: tvm.IRModule, binding: relax.Binding) -> str | None:
    """``"softmax"``, ``"gemm"`` or ``"view"`` for a kernel call that may be a link of an
    attention chain (see "Attention" in the module docstring), else ``None``."""
    if not isinstance(binding, relax.VarBinding):
        return None
    value = binding.value
    if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR):
        return None
    callee = value.args[0]
    if not isinstance(value.ty, relax.TensorType) or not isinstance(callee, relax.GlobalVar):
        return None
    if _tensor_inputs(value) is None:
        return None
    kernel = mod[callee]
    return _attention_link(kernel) if isinstance(kernel, tirx.PrimFunc) else None


@functools.lru_cache(maxsize=4096)
def _attention_link(kernel: tirx.PrimFunc) -> str | None:
    """What ``kernel`` is in an attention chain, remembered per kernel as ``reshape_pattern``
    is: the pass reads every block's kernels once per run, and ``MemoryAwareSchedule`` runs it
    on many orders of the same kernels (recognizing a softmax walks the kernel's blocks)."""
    if reshape_pattern(kernel):
        return "view"
    if is_softmax_kernel(kernel):
        return "softmax"
    return "gemm" if gemm_layout(kernel) is not None else None


def _tensor_inputs(value: relax.Call) -> list[relax.Var] | None:
    """The variables a kernel call reads, or ``None`` if an argument is not a var/constant."""
    args = value.args[1]
    fields = args.fields if isinstance(args, relax.Tuple) else [args]
    out = []
    for arg in fields:
        if isinstance(arg, relax.Var):
            out.append(arg)
        elif not isinstance(arg, tvm.ir.expr.Constant):
            return None
    if len(value.args) > 2:  # symbolic-var arguments: only shapes of vars, nothing to keep alive
        extra = value.args[2]
        if not isinstance(extra, relax.ShapeExpr):
            return None
    return out


def _reads(bindings: Sequence[relax.Binding]) -> dict[relax.Var, list[int]]:
    """Positions of the bindings that read each variable, in order."""
    reads: dict[relax.Var, list[int]] = {}
    for position, binding in enumerate(bindings):
        for var in relax.analysis.free_vars(binding.value):
            reads.setdefault(var, []).append(position)
    return reads


@dataclass(frozen=True)
class _Plan:
    """Recompute ``chain`` (binding positions, in order, the last one the value read late)
    just before ``late[0]``; the reads at ``late`` read the last copy."""

    chain: tuple[int, ...]
    late: tuple[int, ...]
    leaves: tuple[relax.Var, ...]
    #: Whether the subset argument covers it (one copy, every input live at the late reads);
    #: other plans are accepted only where the timeline proves the peak no higher.
    proven: bool = False
    #: The input kept alive until the copy, for a plan of :meth:`_BlockFacts.extended`.
    extends: relax.Var | None = None
    #: Views of the value (reshapes) read late: copied after the chain, onto the copy.
    views: tuple[int, ...] = ()
    #: The last early read of the value's memory (through it or a view): where it now dies.
    held_until: int = -1
    #: Views of ``views`` that nothing reads before the copy: removed with the copy in place.
    unread_views: tuple[int, ...] = ()

    def dying(self, bindings: Sequence[relax.Binding]) -> set[relax.Var]:
        """The value and its views copied for the late reads: they die at the early reads."""
        return {bindings[self.chain[-1]].var, *(bindings[q].var for q in self.views)}


class _BlockFacts:
    """Reads and kernels of one dataflow block, for planning."""

    def __init__(self, mod, patterns, block, live_throughout, options) -> None:
        self.bindings = list(block.bindings)
        self.reads = _reads(self.bindings)
        self.position = {b.var: i for i, b in enumerate(self.bindings)}
        self.live_throughout = live_throughout
        self.options = options
        self.writes = in_place_writes(self.bindings, mod)
        # Per root of memory, the last position that reads it through any of its views.
        self.memory_end: dict[relax.Var, int] = {}
        for var, positions in self.reads.items():
            for root in self.writes.roots_of(var):
                self.memory_end[root] = max(self.memory_end.get(root, -1), positions[-1])
        for var in live_throughout:
            for root in self.writes.roots_of(var):
                self.memory_end[root] = _AFTER_BLOCK
        self.cheap = [
            isinstance(b, relax.VarBinding)
            and b.var not in live_throughout
            and _cheap_kernel(mod, patterns, b.value, options.max_pattern)
            and _tensor_inputs(b.value) is not None
            for b in self.bindings
        ]
        # The kernels of an attention chain (softmax <- injective <- views <- GEMM).
        kinds = [
            _attention_kind(mod, b) if options.attention and b.var not in live_throughout else None
            for b in self.bindings
        ]
        self.softmax = [kind == "softmax" for kind in kinds]
        self.gemm = [kind == "gemm" for kind in kinds]
        self.view = [kind == "view" for kind in kinds]

    def live_until(self, var: relax.Var, position: int) -> bool:
        """Whether ``var``'s memory is live at ``position`` in the block as it is: it, or a
        view of the same memory (a reshape, a tuple item), is read there or later."""
        return any(self.memory_end.get(root, -1) >= position for root in self.writes.roots_of(var))

    def read_events(self, var: relax.Var) -> list[tuple[int, relax.Var]] | None:
        """The reads of ``var``'s memory in order, as ``(position, variable read)``: reads of
        ``var`` itself and of the views bindings make of it (a reshape the VM runs as a view:
        the same memory under another shape, kept alive by the view's reads), and of views of
        those views. ``None`` where a view is read after the block."""
        events = []
        for q in self.reads.get(var, ()):
            if not self.is_view_of(q, var):
                events.append((q, var))
                continue
            view = self.bindings[q].var
            if view in self.live_throughout:
                return None
            nested = self.read_events(view)
            if nested is None:
                return None
            events += nested
        return sorted(events, key=lambda event: event[0])

    def view_path(self, view: relax.Var, var: relax.Var) -> list[int]:
        """The positions of the views from ``var`` to ``view`` (``view`` included), in order."""
        path = []
        while not view.same_as(var):
            position = self.position[view]
            path.append(position)
            view = _tensor_inputs(self.bindings[position].value)[0]
        return path[::-1]

    def is_view_of(self, position: int, var: relax.Var) -> bool:
        """Whether binding ``position``'s result is a view of ``var``'s memory (it refers to
        that memory and writes none)."""
        result = self.bindings[position].var
        return (
            position not in self.writes.writes
            and result in self.writes.roots
            and bool(self.writes.roots[result] & self.writes.roots_of(var))
        )

    def chain(
        self,
        position: int,
        until: int,
        depth: int,
        dead: frozenset = frozenset(),
        attention: bool = False,
    ) -> tuple[list[int], set] | None:
        """The cheap bindings to copy so that ``position``'s value can be recomputed with only
        inputs live at ``until`` (``dead``: values other plans let die early); ``None`` if
        there is none within ``depth`` levels.

        With ``attention`` (the chain of a softmax, see "Attention" in the module docstring)
        the chain may also run through views (which cost no level) and one GEMM, and an input
        that is not live at ``until`` and that no cheap binding makes is kept alive instead
        (a leaf: the timeline decides whether that pays)."""
        value = self.bindings[position].value
        positions, leaves = [position], set()
        for var in _tensor_inputs(value):
            if var not in dead and self.live_until(var, until):
                leaves.add(var)
                continue
            source = self.position.get(var)
            if attention and source is not None and (self.view[source] or self.gemm[source]):
                # A view costs nothing; past the GEMM only its operands (live or kept) remain.
                last = self.gemm[source]
                sub = self.chain(source, until, depth, dead, attention and not last)
                if sub is None and last:
                    sub = ([source], set(_tensor_inputs(self.bindings[source].value)))
            elif source is None or depth == 0 or not self.cheap[source]:
                if not attention or var in dead:
                    return None
                sub = ([], {var})
            else:
                sub = self.chain(source, until, depth - 1, dead, attention)
            if sub is None:
                return None
            positions += sub[0]
            leaves |= sub[1]
        return sorted(set(positions)), leaves

    def extended(self, position: int, until: int) -> tuple[list[int], set, relax.Var] | None:
        """Recompute ``position``'s value alone by keeping one input alive longer: the one input
        not live at ``until``, when it is a value of this block of the same type as the result
        (it takes the result's place in the bytes live between them). Returns the chain, the
        leaves and that input."""
        binding = self.bindings[position]
        inputs = _tensor_inputs(binding.value)
        short = [v for v in inputs if not self.live_until(v, until)]
        if len(short) != 1 or short[0] not in self.position:
            return None
        if not tvm_ffi.structural_equal(short[0].ty, binding.var.ty):
            return None
        return [position], set(inputs), short[0]


def _candidates(facts: _BlockFacts) -> list[_Plan]:
    """Every value worth recomputing, with the chain it needs (possibly just itself)."""
    out = []
    for position, binding in enumerate(facts.bindings):
        attention = facts.softmax[position]
        if not facts.cheap[position] and not attention:
            continue
        events = facts.read_events(binding.var)
        if events is None or len(events) < 2:
            continue
        # Split the reads at the largest gap, with at least one read on each side.
        reads = [q for q, _ in events]
        split = max(range(1, len(reads)), key=lambda i: reads[i] - reads[i - 1])
        if reads[split] - reads[split - 1] <= facts.options.min_gap:
            continue
        late = tuple(sorted(set(reads[split:])))
        # A view read late is copied onto the copy, with the views it is a view of.
        views = tuple(
            sorted({q for _, var in events[split:] for q in facts.view_path(var, binding.var)})
        )
        unread = tuple(
            q for q in views if all(r >= late[0] for r in facts.reads[facts.bindings[q].var])
        )
        found = facts.chain(position, late[-1], facts.options.max_chain - 1, attention=attention)
        proven = found is not None and len(found[0]) == 1 and not attention
        extends = None
        if found is None and facts.options.extend_inputs and not attention:
            extension = facts.extended(position, late[-1])
            if extension is not None:
                positions, leaves, extends = extension
                found = (positions, leaves)
        if found is not None and _overwritten(facts, found[0], late[0]):
            continue  # an input is updated in place before the copy would read it
        if found is not None:
            out.append(
                _Plan(
                    tuple(found[0]),
                    late,
                    tuple(found[1]),
                    proven,
                    extends,
                    views=views,
                    held_until=reads[split - 1],
                    unread_views=unread,
                )
            )
    return out


def _overwritten(facts: _BlockFacts, positions: Sequence[int], copy_at: int) -> bool:
    """Whether a copy of ``positions`` placed before ``copy_at`` would read memory that a
    binding in between writes in place (a parameter an optimizer updates)."""
    return any(
        facts.writes.written_between(v, q, copy_at)
        for q in positions
        for v in _tensor_inputs(facts.bindings[q].value) or ()
    )


def _compatible(plan: _Plan, accepted: list[_Plan], bindings) -> bool:
    """A plan may join the accepted ones if no copy would read a value that another plan lets
    die early, and no value it lets die early is read by another plan's copies."""
    early_deaths = set().union(*(p.dying(bindings) for p in accepted))
    read_by_copies = {v for p in accepted for v in p.leaves}
    return not (plan.dying(bindings) & read_by_copies) and not any(
        v in early_deaths for v in plan.leaves
    )


def _rewrite_block(block: relax.DataflowBlock, plans: Sequence[_Plan]) -> relax.DataflowBlock:
    bindings = list(block.bindings)
    copies_before: dict[int, list[relax.Binding]] = {}
    renames_at: dict[int, dict[relax.Var, relax.Var]] = {}
    for plan in plans:
        copies, renames = copy_chain(bindings, [*plan.chain, *plan.views], "_recompute")
        copies_before.setdefault(plan.late[0], []).extend(copies)
        for read in plan.late:
            for var in plan.dying(bindings):
                renames_at.setdefault(read, {})[var] = renames[var]
    rewritten = insert_copies(block, copies_before, renames_at)
    # A view only the late reads read is read by none now: it would hold the early value's
    # memory in a register of the VM for nothing.
    unread = {bindings[q].var for plan in plans for q in plan.unread_views}
    if not unread:
        return rewritten
    return relax.DataflowBlock([b for b in rewritten.bindings if b.var not in unread])


@tvm.transform.module_pass(opt_level=0, name="RecomputeCheapValues")
class RecomputeCheapValues:
    """Recompute injective kernel results before their late readers (see the module docstring).

    Parameters
    ----------
    options
        A :class:`RecomputeOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`RecomputeReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: most recomputations are accepted by the subset argument of the module docstring,
    without a timeline, and one per changed function would cost more than the pass; the
    argument shows the peak never rises).
    """

    def __init__(self, options: RecomputeOptions | None = None) -> None:
        if options is not None and not isinstance(options, RecomputeOptions):
            raise TypeError(
                f"RecomputeCheapValues expects RecomputeOptions, got {type(options).__name__}"
            )
        self.options = options or RecomputeOptions()
        self.report = RecomputeReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = RecomputeReport()
        if not self.options.enabled:
            publish(self, PassResult("RecomputeCheapValues", notes=("disabled by its options",)))
            return mod
        patterns = kernel_patterns(mod)
        names = {func: gv.name_hint for gv, func in mod.functions.items()}
        recomputed: dict[str, int] = {}

        def rewrite(func, index, block, blocks):
            accepted = _DECISIONS.lookup(mod, func, index, self.options)
            if accepted is None:
                # Values read after the block (its outputs) and parameters live throughout it.
                live = set(func.params) | vars_read_after(func, index)
                facts = _BlockFacts(mod, patterns, block, live, self.options)
                accepted = self._accept(mod, func, blocks, index, facts)
                _DECISIONS.store(mod, func, index, self.options, accepted)
            if not accepted:
                return None
            self.report.recomputed += len(accepted)
            recomputed[names[func]] = recomputed.get(names[func], 0) + len(accepted)
            return _rewrite_block(block, accepted)

        out = rewrite_dataflow_blocks(mod, rewrite)
        changes = {
            name: [f"{counted(count, 'value')} recomputed before late readers"]
            for name, count in recomputed.items()
        }
        functions = function_results(mod, out, changes)
        publish(self, PassResult("RecomputeCheapValues", functions, detail=self.report))
        return out

    def _accept(self, mod, func, blocks, index, facts: _BlockFacts) -> list[_Plan]:
        """Single copies of values whose inputs are live anyway are accepted by the subset
        argument; chains and copies that keep an input alive longer only where the symbolic
        timeline proves the peak is no higher for any admissible value of the dims, and lower
        for some.

        A trial is the accepted plans plus one more. Most trials change the live bytes only
        where the function's peak is not, and :class:`_Screen` rejects those from the base's
        sampled timeline alone; the others get a timeline of their own, as before.
        """
        accepted: list[_Plan] = []
        chains: list[_Plan] = []
        for plan in _candidates(facts):
            if plan.proven and _compatible(plan, accepted, facts.bindings):
                accepted.append(plan)
            else:
                chains.append(plan)
        # A value one of whose inputs now dies early is recomputed from that input's inputs.
        dead = frozenset().union(*(p.dying(facts.bindings) for p in accepted))
        rebuilt = []
        for plan in chains:
            found = facts.chain(
                plan.chain[-1],
                plan.late[-1],
                self.options.max_chain - 1,
                dead,
                facts.softmax[plan.chain[-1]],
            )
            if found is not None and len(found[0]) > 1:
                rebuilt.append(
                    dataclasses.replace(
                        plan,
                        chain=tuple(found[0]),
                        leaves=tuple(found[1]),
                        proven=False,
                        extends=None,
                    )
                )
            elif not plan.proven:
                rebuilt.append(plan)
        chains = rebuilt
        if not chains:
            return accepted
        block = blocks[index]
        # Every trial is ``func`` with this block rewritten: one graph, and the effects of the
        # bindings the trials share are derived once.
        memo = TimelineMemo.for_function(func, mod=mod)

        def peak(plans: list[_Plan]) -> MemoryTimeline:
            trial = list(blocks)
            trial[index] = _rewrite_block(block, plans) if plans else block
            return memory_timeline(with_blocks(func, trial), memo=memo)

        base = peak(accepted)
        screen = _Screen.of(base)
        for plan in chains:
            if not _compatible(plan, accepted, facts.bindings):
                continue
            if screen is not None and screen.keeps_peak(plan, facts):
                continue
            trial = peak([*accepted, plan])
            trial_screen = None if screen is None else _Screen.of(trial)
            if _lowers(trial, base, trial_screen, screen):
                accepted.append(plan)
                base, screen = trial, trial_screen
        return accepted


class _Screen:
    """The base timeline of a block's trials at the graph's sample points, which rejects most
    trials without a timeline of their own.

    A trial differs from the base by one more plan: its copies are bound just before the first
    late read, the late reads read the copy instead of the value ``v``, and ``v`` dies at its
    last early read instead of its last late read. Every other variable is read where it was
    (the copies' inputs also by the copies), so at every base step up to ``v``'s last early
    read and from its first late read on, the trial holds at least the base's allocations
    (``v``'s is the copy's from the first late read on) and the same workspace. Its peak is
    thus at least the base's peak over those steps, at every point. Where that is the base's
    peak at every point, the trial is lower nowhere, and the timelines would reject it (see
    :func:`_lowers`).

    A plan that keeps an input ``u`` alive until the copy (:meth:`_BlockFacts.extended`) has a
    narrower window. Where ``u`` owns its allocation, of ``v``'s size, the trial holds that
    allocation from ``u``'s binding to the copy, so at every step after the base frees it
    and before the first late read it holds ``u``'s bytes where the base held ``v``'s: at
    least the base's. Only steps between ``v``'s last early read and that free can be lower;
    an extension whose ``u`` the base frees before ``v``'s last early read is lower nowhere.

    The number of trials grows with the function, as does the symbolic timeline of each one,
    so trying every chain on its own timeline costs quadratic time in the function's length.
    A rejection here costs two lookups in running maxima; only trials that change the bytes
    where the peak is get a timeline.
    """

    def __init__(self, timeline: MemoryTimeline, sampled: SampledTimeline) -> None:
        self.sampled = sampled
        self.step_of = {var: index for index, var in enumerate(timeline.step_vars)}
        # Each binding allocates at most once: its allocation, by the binding's variable.
        self.allocation_of = {a.var: a for a in timeline.allocations}

    @classmethod
    def of(cls, timeline: MemoryTimeline) -> _Screen | None:
        """The screen of ``timeline``; ``None`` where a size cannot be sampled."""
        sampled = SampledTimeline.of(timeline)
        return None if sampled is None else cls(timeline, sampled)

    def keeps_peak(self, plan: _Plan, facts: _BlockFacts) -> bool:
        """Whether the base with ``plan`` added has the base's peak at every sample point."""
        value = facts.bindings[plan.chain[-1]].var
        if plan.held_until < 0:
            return False
        last_early = self.step_of.get(facts.bindings[plan.held_until].var)
        first_late = self.step_of.get(facts.bindings[plan.late[0]].var)
        if last_early is None or first_late is None:
            return False
        last = first_late - 1
        if plan.extends is not None:
            kept, replaced = self.allocation_of.get(plan.extends), self.allocation_of.get(value)
            if (
                kept is not None
                and replaced is not None
                and kept.end is not None
                and kept.nbytes.expr == replaced.nbytes.expr
            ):
                last = min(last, kept.end)
        outside = self.sampled.peak_outside(last_early + 1, last)
        return all(o >= p for o, p in zip(outside, self.sampled.peak))


def _lowers(
    trial: MemoryTimeline,
    base: MemoryTimeline,
    trial_screen: _Screen | None,
    base_screen: _Screen | None,
) -> bool:
    """Whether the symbolic timelines prove ``trial``'s peak no higher than ``base``'s for any
    admissible value of the dims, and it is lower at a sample point.

    The proof (a ``Max`` over the steps of each) is the expensive part, so the sampled peaks
    decide first where they can: a trial higher at one point cannot be proven no higher (the
    points are admissible values, the proofs sound), and one lower at no point is not taken
    either way (:func:`_lowers_somewhere` reads the same values).

    Past the screen the trial is lower at a sample point and no higher at any, and where the
    dims take few enough values to list (:meth:`ShapeGraph.admissible_grid`), the peaks at
    every one of them (:func:`lowers_peak`) decide what the proof would: a proof of no higher
    holds at each value, and the sample points are among them. The symbolic peaks, whose
    running sums and ``Max`` are most of a trial's cost, are then never built.
    """
    if trial_screen is None or base_screen is None:
        verdict = base.graph.compare(trial.peak, base.peak)
        if verdict in _NO_HIGHER:
            return _lowers_somewhere(trial, base)
        return lowers_peak(trial, base) is True
    trial_peak, base_peak = trial_screen.sampled.peak, base_screen.sampled.peak
    if any(t > b for t, b in zip(trial_peak, base_peak)):
        return False
    if all(t == b for t, b in zip(trial_peak, base_peak)):
        return False
    if base.graph.admissible_grid() is not None:
        verdict = lowers_peak(trial, base)
        if verdict is not None:
            return verdict
    if base.graph.compare(trial.peak, base.peak) in _NO_HIGHER:
        return True
    return lowers_peak(trial, base) is True


_NO_HIGHER = (Ordering.LT, Ordering.LE, Ordering.EQ)


class _DecisionMemo:
    """The plans accepted for a block, remembered for a structurally equal function.

    ``MemoryAwareSchedule`` runs this pass on the order it picks (``recompute_after``), and
    the pipeline runs it on the same function right after; the facts of a block and the
    symbolic timelines of ``_accept`` (one of the whole function, and one for each trial the
    screen leaves) are most of the pass's time, so the second run replays the first one's
    decision. Plans name bindings by position, so they apply to any
    structurally equal function; the kernels it calls must be the same objects (the pipeline
    keeps them), since the plans depend on their op patterns and in-place writes.

    ``MemoryAwareSchedule`` recomputes all its candidates before the pipeline's run reads the
    chosen one back: with ``ScheduleOptions``' defaults, up to 12 functions (8 orders of the
    pool, ``recompute_candidates``; 3 range copies, ``max_versions``; the input order). The
    memo keeps 16: with 8, on small steps the candidates compared first (the pass's choice,
    the input order) were gone by then. Raising those defaults asks for a larger memo.
    """

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._entries: OrderedDict[tuple, tuple[relax.Function, tuple, list[_Plan]]] = OrderedDict()

    @staticmethod
    def _key(func: relax.Function, index: int, options: RecomputeOptions) -> tuple:
        return (tvm_ffi.structural_hash(func), index, options)

    @staticmethod
    def _callees(mod: tvm.IRModule, func: relax.Function) -> tuple:
        return tuple(
            (gv.name_hint, mod[gv])
            for gv in relax.analysis.all_global_vars(func)
            if gv in mod.functions
        )

    def lookup(self, mod, func, index, options) -> list[_Plan] | None:
        key = self._key(func, index, options)
        entry = self._entries.get(key)
        if entry is None:
            return None
        known, callees, plans = entry
        now = self._callees(mod, func)
        same_kernels = len(now) == len(callees) and all(
            name == other and kernel.same_as(other_kernel)
            for (name, kernel), (other, other_kernel) in zip(now, callees)
        )
        if not same_kernels or not tvm_ffi.structural_equal(known, func):
            return None
        self._entries.move_to_end(key)
        return list(plans)

    def store(self, mod, func, index, options, plans: list[_Plan]) -> None:
        self._entries[self._key(func, index, options)] = (
            func,
            self._callees(mod, func),
            list(plans),
        )
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


_DECISIONS = _DecisionMemo()


def _lowers_somewhere(trial, base) -> bool:
    """Whether ``trial``'s peak is below ``base``'s at one of the dims' sample points.

    A plan the proof only shows to be harmless is not taken: it would add kernels for
    nothing, and the planners downstream see a different program.
    """
    for point in base.graph.representative_points():
        try:
            if base.graph.evaluate(trial.peak, point) < base.graph.evaluate(base.peak, point):
                return True
        except ValueError:  # an expression the point cannot evaluate proves nothing
            continue
    return False

"""PlanMemory: in-place reuse and buffer sharing proven on symbolic sizes.

Where it runs
-------------
In the finalize phase, in place of TVM's ``StaticPlanBlockMemory``: after ``CallTIRRewrite``
(kernels are called in destination-passing style on ``R.builtin.alloc_tensor`` results) and
``Rematerialize``, before ``LowerAllocTensor`` and ``KillAfterLastUse``. Its output has the form
``StaticPlanBlockMemory`` produces: ``R.memory.alloc_storage`` inserted before the first tensor
placed in a storage, each planned ``R.builtin.alloc_tensor`` replaced by
``R.memory.alloc_tensor(storage, 0, shape, dtype, device)``, no kills (``KillAfterLastUse``
adds them) and every allocation it does not plan left as ``R.builtin.alloc_tensor`` (for
``LowerAllocTensor``: its own storage, freed after its last use).

What it assumes
---------------
Functions are normalized, ``ToNonDataflow`` has run, and kernels are PrimFuncs of the module
whose bodies can be read (their access pattern decides in-place reuse). Dims are described by
``blade_relax.symbolic.ShapeGraph.from_function`` (ranges from ``tir_var_upper_bound`` /
``tir_var_lower_bound``; unbounded otherwise).

How it plans
------------
1. **Candidates** (``_collect``): an allocation may be planned when every reader is visible
   in its binding block: kernel calls, views (``reshape``), re-bindings, tuples. Refused, like in
   ``StaticPlanBlockMemory``: function outputs, allocations used in another block or inside an
   ``If``; and, unlike it, allocations passed to packed functions (they may keep or hand out an
   alias, e.g. runtime eviction, so the storage must be the tensor's own) or named in the
   function attribute ``contract.NO_PLAN_ATTR`` (a list of variable names; ``Rematerialize``
   lists evictable tensors there). Sizes are canonical ``SymbolicExpr`` byte counts.
2. **In-place** (``analysis.inplace_reuse.inplace_verdict``): when a kernel's input dies at that call, every value the
   kernel reads from it flows only into the output element at the same flat position (read
   from the TIR: elementwise blocks, reshapes, fused chains; not transposes, reductions or
   splits), and the input's storage is provably no smaller (``ShapeGraph.compare``), the output
   is placed in the input's storage. Equal sizes are taken first, unconditionally: they only
   remove bytes; larger storages go through the peak check of step 3.
3. **Sharing**: tensors (in-place chains) are visited in program order. A storage whose last
   tensor is dead may take a new tensor when its size is proven ``>=`` (best fit), or, when the
   new tensor's dims are available where the storage is allocated, by growing to the ``Max`` of
   the two (evaluated at run time from the concrete dims). A decision is accepted only if it is
   proven not to raise the peak of the unshared program at any allocation point (``_peak``):
   sharing keeps a storage allocated between its tensors and by the difference of sizes, which
   the runtime counts. Among safe choices the one adding the fewest live bytes wins.
4. **Tuples**: a tuple read only through ``t[i]`` is never killed by ``KillAfterLastUse`` (its
   item accesses are canonicalized away), so the VM would hold its items until the function
   returns; ``R.vm.kill_object(t)`` is inserted after its last item access.
5. **Rewrite** into the stock form (see above).

The planned peak is thus never above that of the program without sharing (each tensor in its
own storage, with the same in-place placements and tuple kills), for every admissible value of
the dims. Stock planning can only add to that program's live bytes, except that it may reuse
the storage of a tensor pinned by a tuple; step 4 removes those pins.

Dynamic sizes are never planned at ``tir_var_upper_bound``: a storage is sized by the symbolic
expression of its tensors, so a short sequence does not pay for the longest.

A function where nothing can be planned from its symbolic sizes (its shape graph cannot be
built, or no allocation has a symbolic size) and that passes no candidate to an opaque call is
left to ``StaticPlanBlockMemory``, as stock TVM would plan it (with ``tir_var_upper_bound``
ignored unless ``PlanOptions.plan_at_upper_bound``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx

from ...analysis.inplace_reuse import inplace_verdict
from ...contract import LOWER_BOUND_ATTR, NO_PLAN_ATTR, REGENERATE, UPPER_BOUND_ATTR
from ...symbolic import ShapeGraph, SymbolicExpr
from ...util.collection import pauses_collection
from .._warn import warn_fallback
from ..result import (
    FunctionResult,
    PassResult,
    counted,
    differs,
    publish,
    snapshot,
    timeline_peak,
)
from ._collect import FunctionFacts, collect_facts
from ._share import IN_REGENERATED, Group, Storage, compatible, share

__all__ = [
    "FunctionPlan",
    "PlanMemory",
    "PlanOptions",
    "StoragePlan",
    "plan_function",
]

_BOUND_ATTRS = (UPPER_BOUND_ATTR, LOWER_BOUND_ATTR)
_DYNAMIC_OUTPUT_ATTR = "relax.memory_plan_dynamic_func_output"


@dataclass(frozen=True)
class PlanOptions:
    """Options of :class:`PlanMemory`.

    Attributes
    ----------
    inplace
        Place kernel outputs in the storage of an input that dies at the call.
    share
        Reuse the storage of dead tensors for later ones.
    grow
        Allow a storage to grow to the ``Max`` of its tensors' sizes (otherwise a storage is
        reused only by tensors proven no larger).
    peak_safe
        Accept a sharing decision only when proven not to raise the unshared program's peak.
        Turning it off gives greedy best-fit sharing (fewer allocations, possibly more bytes).
    plan_at_upper_bound
        Keep ``tir_var_upper_bound`` for functions handed to ``StaticPlanBlockMemory`` (stock
        behaviour: storage sized for the longest sequence). PlanMemory's own plans never use it.
    trusted_packed
        Packed functions known to neither keep nor alias their tensor arguments
        (destination-passing library kernels); their arguments stay plannable.
    max_grid_points
        Largest number of admissible dim values for proofs by exhaustive evaluation.
    max_grid_cells
        Largest ``points x allocation points`` table kept for exhaustive proofs.
    max_proofs
        Budget of symbolic comparisons per function when the exhaustive grid is too large.
    release_tuples
        Insert ``R.vm.kill_object`` after the last item access of a tuple that is only read
        through ``tuple[i]``. ``KillAfterLastUse`` never kills such a tuple (its item accesses
        are canonicalized away first), so the VM would hold its items until the function
        returns.
    """

    inplace: bool = True
    share: bool = True
    grow: bool = True
    peak_safe: bool = True
    plan_at_upper_bound: bool = False
    # The remat runtime's regenerate reads its tensor arguments only during the call.
    trusted_packed: tuple[str, ...] = (REGENERATE,)
    max_grid_points: int = 4096
    max_grid_cells: int = 1 << 23
    max_proofs: int = 4000
    release_tuples: bool = True


@dataclass(frozen=True)
class StoragePlan:
    """One planned storage: the tensors placed in it (program order) and its byte size."""

    tensors: tuple[str, ...]
    size: SymbolicExpr


@dataclass(frozen=True)
class FunctionPlan:
    """What :class:`PlanMemory` decided for one function (for reports and tests).

    Attributes
    ----------
    function
        The global symbol name of the function.
    mode
        ``"planned"`` (PlanMemory's plan), ``"stock"`` (handed to ``StaticPlanBlockMemory``)
        or ``"unchanged"`` (nothing to plan).
    storages
        The planned storages.
    inplace
        ``(input, output)`` variable names of the in-place placements.
    refusals
        Allocations left alone, with the reason.
    exhaustive
        Whether the peak-safety proofs were by exhaustive evaluation over every admissible dim.
    """

    function: str
    mode: str
    storages: tuple[StoragePlan, ...] = ()
    inplace: tuple[tuple[str, str], ...] = ()
    refusals: dict[str, str] = field(default_factory=dict)
    exhaustive: bool = False

    @property
    def allocations(self) -> int:
        """Allocation sites per call: planned storages plus allocations left alone."""
        return len(self.storages) + sum(1 for r in self.refusals.values() if r != _STORAGE)


_STORAGE = "already planned storage"


@tvm.transform.module_pass(opt_level=0, name="PlanMemory")
class PlanMemory:
    """Plan the memory of every Relax function: in-place reuse and proven sharing.

    Parameters
    ----------
    options
        A :class:`PlanOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.plans`` maps each function name to its :class:`FunctionPlan`,
    and ``pass_obj.last_result`` is a :class:`~blade_relax.transform.result.PassResult` (its
    ``detail`` is ``plans``): per planned function, the storages and in-place placements, and
    the peaks of :func:`blade_relax.analysis.memory_timeline` before (``R.builtin.alloc_tensor``
    each its own storage, freed after its last use) and after planning, read once
    ``LowerAllocTensor`` and ``KillAfterLastUse`` (the passes that follow) have run on a copy
    (when a figure is first read): without its kills the planned IR holds every storage until
    the function returns.
    """

    def __init__(self, options: PlanOptions | None = None) -> None:
        if options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"PlanMemory expects PlanOptions, got {type(options).__name__}")
        self.options = options or PlanOptions()
        self.plans: dict[str, FunctionPlan] = {}
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Plan every Relax function of ``mod``; hand the unplannable ones to the stock pass."""
        planned: dict[tvm.ir.GlobalVar, relax.Function] = {}
        to_stock: list[tvm.ir.GlobalVar] = []
        self.plans = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            new_func, plan = plan_function(func, mod, self.options, name=gv.name_hint)
            self.plans[gv.name_hint] = plan
            if plan.mode == "stock":
                to_stock.append(gv)
            elif new_func is not None:
                planned[gv] = new_func
        if to_stock:
            planned.update(_stock_plan(mod, to_stock, self.options.plan_at_upper_bound))
        if not planned:
            publish(self, _plan_result(mod, mod, self.plans, set()))
            return mod
        out = mod.clone()
        for gv, func in planned.items():
            out.update_func(gv, func)
        publish(self, _plan_result(mod, out, self.plans, {gv.name_hint for gv in planned}))
        return out


def _plan_result(
    mod: tvm.IRModule, out: tvm.IRModule, plans: dict[str, FunctionPlan], planned: set[str]
) -> PassResult:
    """The :class:`PassResult` of one run; ``planned`` names the functions replaced."""
    changed = {
        gv.name_hint
        for gv, func in mod.functions_items()
        if gv.name_hint in planned and differs(func, out[gv])
    }
    if changed:  # the peaks are read later: from the modules as they are now
        mod, out = snapshot(mod), snapshot(out)
    killed = _with_kills(out)
    results = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        name = gv.name_hint
        plan = plans[name]
        notes = _refusal_notes(plan)
        if plan.mode == "stock":
            notes = ("nothing to plan on symbolic sizes: left to StaticPlanBlockMemory", *notes)
        if name not in changed:
            results.append(FunctionResult(name, False, notes=notes))
            continue
        changes = _plan_changes(plan) if plan.mode == "planned" else ("storage planned",)
        before = timeline_peak(func, mod)
        after = timeline_peak(out[gv], out, lower=killed)
        results.append(FunctionResult(name, True, changes, before, after, notes))
    return PassResult("PlanMemory", tuple(results), detail=plans)


def _with_kills(mod: tvm.IRModule) -> Callable[[], tvm.IRModule]:
    """A function giving ``mod`` after ``LowerAllocTensor`` and ``KillAfterLastUse``, the
    passes that follow this one, computed once on first call (when a figure is read), in a
    context like the current one without its instruments (they are not the pipeline's)."""
    current = tvm.transform.PassContext.current()
    opt_level, config, disabled = current.opt_level, current.config, current.disabled_pass

    @functools.cache
    def lowered() -> tvm.IRModule:
        lower = [relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse()]
        with tvm.transform.PassContext(opt_level=opt_level, config=config, disabled_pass=disabled):
            return tvm.transform.Sequential(lower)(mod)

    return lowered


def _plan_changes(plan: FunctionPlan) -> tuple[str, ...]:
    """A planned function's storages, sharing and in-place placements, in words."""
    tensors = sum(len(s.tensors) for s in plan.storages)
    shared = sum(len(s.tensors) for s in plan.storages if len(s.tensors) > 1)
    out = [f"{counted(tensors, 'tensor')} placed in {counted(len(plan.storages), 'storage')}"]
    if shared:
        out.append(f"{counted(shared, 'buffer')} share storage")
    if plan.inplace:
        out.append(f"{counted(len(plan.inplace), 'kernel output')} written in place")
    return tuple(out)


def _refusal_notes(plan: FunctionPlan) -> tuple[str, ...]:
    """The allocations left alone, counted by reason."""
    reasons: dict[str, int] = {}
    for reason in plan.refusals.values():
        if reason != _STORAGE:
            reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return ()
    total = sum(reasons.values())
    text = ", ".join(f"{reason} ({n})" for reason, n in reasons.items())
    return (f"{counted(total, 'allocation')} left alone: {text}",)


# ====================================================================== planning


def plan_function(
    func: relax.Function,
    mod: tvm.IRModule,
    options: PlanOptions | None = None,
    name: str = "main",
) -> tuple[relax.Function | None, FunctionPlan]:
    """Plan one function.

    Parameters
    ----------
    func
        A Relax function after ``CallTIRRewrite``.
    mod
        Its module (the kernels are looked up there).
    options
        Planning options.
    name
        The function's name, for the report.

    Returns
    -------
    tuple
        The rewritten function (``None`` when unchanged or handed to the stock pass) and the
        :class:`FunctionPlan`.
    """
    options = options or PlanOptions()
    if func.attrs is not None and _DYNAMIC_OUTPUT_ATTR in func.attrs:
        return None, FunctionPlan(name, "stock")
    no_plan = _no_plan_names(func)
    facts = collect_facts(func, mod, options.trusted_packed, no_plan)
    try:
        graph = ShapeGraph.from_function(func)
    except Exception as err:  # user IR: reading its shapes and bounds may fail in any way
        plan = _stock_or_unchanged(name, facts)
        note = "StaticPlanBlockMemory plans them" if plan.mode == "stock" else ""
        warn_fallback("PlanMemory", "allocations", name, err, note=note)
        return None, plan
    sizes = _sizes(facts, graph)
    refusals = {a.var.name: a.refusal for a in facts.allocations if a.refusal is not None}
    candidates = [a for a in facts.allocations if a.plannable]
    if not candidates:
        return None, _stock_or_unchanged(name, facts)

    released = facts.release_pins() if options.release_tuples else []
    groups, inplace_pairs, group_of, ge_inplace = _inplace_equal(facts, sizes, graph, options)
    into_regenerated = _inplace_regenerated(facts, sizes, graph, options, groups, group_of)
    for out_id, (source, index) in into_regenerated.items():
        ge_inplace.pop(out_id, None)
        inplace_pairs.append((source.name, facts.allocations[out_id].var.name, index))
    storages = share(facts, graph, sizes, groups, group_of, ge_inplace, options, inplace_pairs)
    model_exhaustive = storages.exhaustive
    aliases = {facts.allocations[a].index: source for a, (source, _) in into_regenerated.items()}
    new_func = _rewrite(func, facts, storages.storages, released, aliases)
    plan = FunctionPlan(
        function=name,
        mode="planned",
        storages=tuple(
            StoragePlan(tensors=tuple(m.var.name for g in s.groups for m in g.members), size=s.size)
            for s in storages.storages
        ),
        inplace=tuple((a, b) for a, b, _ in inplace_pairs),
        refusals=refusals,
        exhaustive=model_exhaustive,
    )
    return new_func, plan


def _stock_or_unchanged(name: str, facts: FunctionFacts) -> FunctionPlan:
    refusals = {a.var.name: a.refusal for a in facts.allocations if a.refusal is not None}
    # The stock planner would share tensors that reach packed calls: keep those functions.
    mode = "unchanged" if any(a.hazard for a in facts.allocations) else "stock"
    return FunctionPlan(name, mode, refusals=refusals)


def _no_plan_names(func: relax.Function) -> set[str]:
    if func.attrs is None or NO_PLAN_ATTR not in func.attrs:
        return set()
    return {str(v) for v in func.attrs[NO_PLAN_ATTR]}


def _sizes(facts: FunctionFacts, graph: ShapeGraph) -> dict[int, SymbolicExpr]:
    """Canonical byte sizes; allocations with a non-symbolic size are refused."""
    sizes: dict[int, SymbolicExpr] = {}
    for alloc in facts.allocations:
        if alloc.size_prim is None:
            alloc.refuse("size not expressible")
            continue
        size = graph.canonical(SymbolicExpr.from_prim_expr(alloc.size_prim))
        if size.is_unknown:
            alloc.refuse("size not symbolic")
        sizes[alloc.id] = size
    return sizes


def _inplace_equal(
    facts: FunctionFacts,
    sizes: dict[int, SymbolicExpr],
    graph: ShapeGraph,
    options: PlanOptions,
) -> tuple[list[Group], list[tuple[str, str, int]], dict[int, Group], dict[int, list[int]]]:
    """Build in-place chains of provably equal size; collect the ``>=`` ones for later."""
    allocs = facts.allocations
    group_of: dict[int, Group] = {}
    groups: list[Group] = []
    for alloc in allocs:
        if alloc.plannable:
            group = Group(
                members=[alloc],
                size=sizes[alloc.id],
                size_prim=alloc.size_prim,
                ready=facts.shape_ready_at(alloc),
                num_bindings=facts.num_bindings,
            )
            group_of[alloc.id] = group
            groups.append(group)
    pairs: list[tuple[str, str, int]] = []
    ge_candidates: dict[int, list[int]] = {}
    if not options.inplace:
        return groups, pairs, group_of, ge_candidates
    verdicts: dict[tuple, bool] = {}
    merged: set[int] = set()  # id() of the groups merged into another
    for index in sorted(facts.kernels):
        call = facts.kernels[index]
        outs = [
            pos
            for pos, ids in enumerate(call.arg_allocs)
            if len(ids) == 1
            and allocs[next(iter(ids))].plannable
            and allocs[next(iter(ids))].first_use == index
        ]
        dying: list[int] = []
        for pos, ids in enumerate(call.arg_allocs):
            if pos in outs:
                continue
            for alloc_id in ids:
                alloc = allocs[alloc_id]
                if alloc.plannable and alloc.last_use == index and alloc_id not in dying:
                    dying.append(alloc_id)
        taken: set[int] = set()
        for out_pos in outs:
            out = allocs[next(iter(call.arg_allocs[out_pos]))]
            for in_id in dying:
                if in_id in taken:
                    continue
                source = allocs[in_id]
                in_group = group_of[in_id]
                if in_group.members[-1].id != in_id or not compatible(source, out):
                    continue
                positions = [p for p, ids in enumerate(call.arg_allocs) if in_id in ids]
                if any(len(call.arg_allocs[p]) != 1 or not call.arg_exact[p] for p in positions):
                    continue
                relation = graph.compare(in_group.size, sizes[out.id])
                if not relation.holds_ge:
                    continue
                key = (call.func, tuple(positions), out_pos)
                if key not in verdicts:
                    verdicts[key] = bool(inplace_verdict(call.func, positions, out_pos))
                if not verdicts[key]:
                    continue
                if relation.name != "EQ":
                    ge_candidates.setdefault(out.id, []).append(in_id)
                    continue
                out_group = group_of[out.id]
                in_group.members.extend(out_group.members)
                for member in out_group.members:
                    group_of[member.id] = in_group
                merged.add(id(out_group))
                pairs.append((source.var.name, out.var.name, index))
                taken.add(in_id)
                break
    # Filtered once: removing each merged group from the list would cost the list's length.
    groups = [g for g in groups if id(g) not in merged]
    return groups, pairs, group_of, ge_candidates


def _inplace_regenerated(
    facts: FunctionFacts,
    sizes: dict[int, SymbolicExpr],
    graph: ShapeGraph,
    options: PlanOptions,
    groups: list[Group],
    group_of: dict[int, Group],
) -> dict[int, tuple[relax.Var, int]]:
    """Kernel outputs written into a tensor ``blade_relax.regenerate`` handed back.

    The runtime's ``regenerate`` (:mod:`blade_relax.runtime.remat`) returns the tensor it kept
    (popped from the frame's stash) or one its closures recomputed into storage of its own; in
    either case, once it returns, only the VM's registers refer to the tensor. Where that tensor
    dies at a kernel call that may write its output over it (the verdict of
    :func:`~blade_relax.analysis.inplace_reuse.inplace_verdict`, equal type), the output *is* the
    tensor: its allocation becomes ``out = regenerated`` and no storage is planned for it. Such
    an output dying at a later kernel passes the memory on in the same way. Outputs already
    placed in a planned input of equal size are left where they are.

    Returns ``output allocation id -> (the variable it aliases, call index)``; the outputs are
    removed from ``groups`` and marked :data:`IN_REGENERATED`.
    """
    allocs = facts.allocations
    placed: dict[int, tuple[relax.Var, int]] = {}
    if not options.inplace or not facts.regenerated:
        return placed
    # Variables whose memory is a regenerated tensor: var -> (defined at, allocation id).
    memory = dict(facts.regenerated)
    live = {id(g) for g in groups}
    for index in sorted(facts.kernels):
        call = facts.kernels[index]
        for out_pos, ids in enumerate(call.arg_allocs):
            if len(ids) != 1:
                continue
            out = allocs[next(iter(ids))]
            group = group_of.get(out.id)
            if (
                not out.plannable
                or out.first_use != index
                or group is None
                or len(group.members) != 1
                or id(group) not in live
            ):
                continue
            for arg in call.args:
                if not isinstance(arg, relax.Var) or arg not in memory:
                    continue
                defined, source_id = memory[arg]
                source = allocs[source_id]
                positions = [p for p, a in enumerate(call.args) if a.same_as(arg)]
                if (
                    defined >= out.index
                    or source.last_use != index
                    or any(not call.arg_exact[p] for p in positions)
                    or not tvm_ffi.structural_equal(arg.ty, out.var.ty)
                    or not inplace_verdict(call.func, positions, out_pos)
                ):
                    continue
                placed[out.id] = (arg, index)
                live.discard(id(group))
                del group_of[out.id]
                out.kind = IN_REGENERATED
                memory[out.var] = (out.index, out.id)
                del memory[arg]
                break
    groups[:] = [g for g in groups if id(g) in live]
    return placed


# ====================================================================== rewrite


def _rewrite(
    func: relax.Function,
    facts: FunctionFacts,
    storages: Sequence[Storage],
    released: Sequence[tuple[relax.Var, int]] = (),
    aliases: dict[int, relax.Var] | None = None,
) -> relax.Function | None:
    aliases = aliases or {}
    if not storages and not released and not aliases:
        return None
    kills: dict[int, list[relax.Var]] = {}
    for var, last in released:
        kills.setdefault(last, []).append(var)
    kill_op = tvm.ir.Op.get("relax.vm.kill_object")
    storage_by_first: dict[int, Storage] = {s.first: s for s in storages}
    placement: dict[int, Storage] = {}
    for storage in storages:
        for group in storage.groups:
            for member in group.members:
                placement[member.index] = storage
    alloc_at = {a.index: a for a in facts.allocations}
    bb = relax.BlockBuilder()
    storage_vars: dict[int, relax.Var] = {}
    new_blocks = []
    index = 0
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            storage = storage_by_first.get(index)
            if storage is not None:
                call = bb.normalize(
                    relax.op.memory.alloc_storage(
                        relax.ShapeExpr([storage.size_prim]),
                        storage.head.device,
                        storage.head.scope,
                        storage.head.dtype,
                    )
                )
                var = relax.Var("storage", call.ty)
                storage_vars[id(storage)] = var
                bindings.append(relax.VarBinding(var, call))
            target = placement.get(index)
            if target is not None:
                alloc = alloc_at[index]
                call = bb.normalize(
                    relax.op.memory.alloc_tensor(
                        storage_vars[id(target)],
                        tirx.IntImm("int64", 0),
                        relax.ShapeExpr(list(alloc.shape)),
                        alloc.dtype,
                        alloc.device,
                    )
                )
                bindings.append(relax.VarBinding(binding.var, call))
            elif index in aliases:
                bindings.append(relax.VarBinding(binding.var, aliases[index]))
            else:
                bindings.append(binding)
            for var in kills.get(index, ()):
                call = bb.normalize(relax.Call(kill_op, [var]))
                bindings.append(relax.VarBinding(relax.Var("_", call.ty), call))
            index += 1
        if isinstance(block, relax.DataflowBlock):
            new_blocks.append(relax.DataflowBlock(bindings))
        else:
            new_blocks.append(relax.BindingBlock(bindings))
    body = relax.SeqExpr(new_blocks, func.body.body)
    new_func = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    # A hand-built SeqExpr carries no type until normalized.
    return bb.normalize(new_func)


# ====================================================================== stock delegation


def _stock_plan(
    mod: tvm.IRModule, gvs: list[tvm.ir.GlobalVar], keep_bounds: bool
) -> dict[tvm.ir.GlobalVar, relax.Function]:
    """Plan the given functions with ``StaticPlanBlockMemory`` (others are not shown to it)."""
    functions = {}
    saved_attrs = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv not in gvs:
            continue
        if gv in gvs and not keep_bounds and func.attrs is not None:
            saved_attrs[gv] = func.attrs
            for key in _BOUND_ATTRS:
                if key in func.attrs:
                    func = func.without_attr(key)
        functions[gv] = func
    sub = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
    # The sub-module leaves out the Relax functions planned here, which the delegated ones may
    # call (a dispatcher calls its range copies): the caller's instruments (well-formedness
    # checks) would report those calls, so the delegated pass runs without them.
    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(
        opt_level=current.opt_level, config=current.config, disabled_pass=current.disabled_pass
    ):
        sub = relax.transform.StaticPlanBlockMemory()(sub)
    out = {}
    for gv in gvs:
        func = sub[gv]
        if gv in saved_attrs:
            func = relax.Function(
                func.params, func.body, func.ret_ty, func.is_pure, saved_attrs[gv], func.span
            )
        out[gv] = func
    return out

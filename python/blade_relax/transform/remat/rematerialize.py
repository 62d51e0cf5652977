"""Rematerialize: prepare evictions and regenerations that the runtime decides per call.

Where it runs
-------------
After ``ToNonDataflow``, ``RemovePurityChecking`` and ``CallTIRRewrite`` (the impure builtin
calls it inserts may not stand in a dataflow block, and the tensors are then explicit
``R.builtin.alloc_tensor`` written by PrimFunc kernels), and before memory planning
(``StaticPlanBlockMemory`` / ``PlanMemory``) and ``KillAfterLastUse``. The pipeline also runs
the ``RematTimeline`` pass after ``KillAfterLastUse`` to replace the estimated timeline by
the one read from the planned IR. Functions with dataflow blocks, control flow or nested
functions pass through unchanged, and so do functions called by a function the pass can
transform (a callee's own decision would run nested in its caller's, which already accounts
for the callee's allocations); the callees of a function it cannot transform (say, an ``If``
dispatching to versions of a function) are transformed, each deciding for itself.

What it does
------------
1. Candidates. From the symbolic memory timeline (``blade_relax.analysis.memory_timeline``),
   the *hot* bindings are those whose live bytes reach ``hot_fraction`` of the peak at some
   representative shape. A candidate is a kernel-computed, never-mutated, not-returned tensor
   whose uses leave a gap over hot bindings, and whose bytes are not provably below
   ``min_bytes``.
2. Recipes. Per candidate, the bindings that recompute it at its next use from values that
   cost no memory there: parameters, tensors live anyway at that point, and other candidates
   (chains: the runtime hands over its kept copy, or materializes it on demand). At most
   ``max_recipe_ops`` kernels; only PrimFunc kernels are replayed (never packed functions,
   which may be random or in-place). When there are more than ``max_candidates``, those
   that free the most bytes over the hot bindings are kept, the cheaper to recompute
   (loop iterations of the kernels) first among equals: a candidate's recompute cost is
   paid only when the runtime evicts it, and the runtime weighs it then, while the memory
   a budget can reach is bounded by what the kept candidates free.
3. Rewrite. Each recipe becomes a private Relax function (compiled TVM kernels; no Python
   numerics). The function gets:

   - ``frame = blade_relax.remat_begin(key, metadata, R.shape([dims]), release, fns...)``
     first (``R.call_builtin_with_ctx``; ``release`` is the module's no-op function, ``fns``
     the regeneration functions by slot);
   - ``blade_relax.evict(frame, k, x)`` after the last use of candidate ``x`` before its gap
     (``R.call_builtin_with_ctx``);
   - ``x' = blade_relax.regenerate(frame, k, (args...))`` before its next use
     (``R.call_packed``; the tuple holds what the regeneration plan reads), and every later
     use of ``x`` (and of its views) reads ``x'``; views of ``x`` that nothing reads any more
     are removed.

   ``call_builtin_with_ctx`` is neither a PrimFunc nor a packed call, so
   ``StaticPlanBlockMemory`` gives no planned storage to the tensor passed to ``evict`` (and
   ``PlanMemory`` reads the attribute ``blade_relax.no_plan``): an evictable tensor owns its
   storage (freeing it frees memory), and the tensor ``regenerate`` may hand back is never an
   alias the plan does not know about. The inputs of ``regenerate`` are only read during
   the call, so they may stay in planned storage (the stock planner plans the fields of a
   tuple passed to a packed call like direct arguments).

   After every call of another Relax function, ``release`` is invoked
   (``vm.builtin.invoke_closure``): the VM keeps a function's result in its return register
   until the next function returns, which would otherwise depend on the decision (a
   ``regenerate`` that recomputes returns from closures, one that hands back a kept tensor
   does not).

   With ``own_storage_fraction``, large tensors that are not evictable get an explicit
   ``R.memory.alloc_storage`` of their own, which the planners leave alone: a storage the
   planner shares between a forward and a backward tensor stays allocated, idle, through
   the backward peak that evictions are meant to lower.
4. Metadata. The function's attribute ``blade_relax.remat`` (and the ``metadata`` constant of
   ``remat_begin``) holds, as JSON, the symbolic timeline (every storage's size over the dims
   and its live interval), and per candidate its symbolic bytes, symbolic recompute cost,
   regeneration peak, window and regeneration plan. The runtime evaluates it once per shape.
   Calls of other Relax functions are simulated at the call site (the callee's dims mapped
   from the argument shapes), so the timeline stays exact; where that is impossible (an
   ``If`` in the callee, a tensor made by a packed function) the metadata says ``"exact":
   false`` with notes, and the runtime never calls a budget reachable for it.

5. Dispatch (``plain_without_budget``, the default). The rewritten function becomes the
   private ``f__remat`` and the function as it was the private ``f__plain`` (both marked
   ``blade_relax.remat_copy``); ``f`` keeps its name, parameters and attributes and asks
   ``blade_relax.remat_active()`` (is a budget set in this thread?) to call one of them. A
   call without a budget then costs one packed call and peaks where ``f`` did before the
   pass; ``version_for`` (``blade_relax.transform.dispatch``) names the copy that runs.

Assumptions: kernels are destination-passing PrimFuncs that write only their trailing fresh
outputs; the function's symbolic dims are all defined by its parameters' shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax

from ...analysis.effects import Kind, classify
from ...contract import (
    REMAT_COPY_ATTR,
    REMAT_META_ATTR,
    REMAT_REGEN_ATTR,
    REMAT_RELEASE_ATTR,
    RematMetadata,
)
from ...contract.dimexpr import compile_expressions, validate
from ...util.collection import pauses_collection
from .._warn import warn_fallback
from ..dispatch import budget_dispatch
from ..result import FunctionResult, PassResult, counted, publish, snapshot, timeline_peak
from ._ir import FunctionModel, Op, RecipeError, UnsupportedFunction, build_model
from ._rewrite import rewrite, substitute
from ._select import Candidate, Recipe, build_recipe, find_gaps
from ._timeline import SlotSpec, prim_to_py, tensor_bytes_py, write_metadata

__all__ = ["RematOptions", "Rematerialize"]


@dataclass(frozen=True)
class RematOptions:
    """Options of :class:`Rematerialize`.

    Attributes
    ----------
    max_candidates
        Most tensors made evictable per function (each costs two runtime calls per call of
        the function).
    max_recipe_ops
        Most kernels one regeneration may replay (chains through other candidates do not
        count: each candidate has its own recipe).
    min_gap
        Fewest kernel calls strictly between the eviction and the regeneration.
    min_bytes
        Tensors provably no larger than this are not worth evicting.
    min_fraction
        The smallest tensors are not worth evicting (each costs two runtime calls per call)
        while, all together, they hold less than this fraction of the peak at every
        representative shape: evicting every one of them could lower no point by more. A
        bound on the set, not on each tensor, so that a deep model (many layers, each tensor
        a small part of the peak, together most of it) keeps its activations evictable.
    hot_fraction
        A binding is hot when its live bytes reach this fraction of the peak at some
        representative shape; a candidate's gap must cover a hot binding.
    functions
        Names of the functions to transform; ``None`` for every Relax function.
    own_storage_fraction
        Tensors of a rematerialized function that reach this fraction of the peak at some
        representative shape get a storage of their own (allocated where they are, freed
        after their last use) instead of one the memory planner shares: a planned storage
        lives from its first tensor to its last, and one shared by a forward and a backward
        tensor stays allocated, idle, through the peak that evictions are meant to lower.
        ``None`` leaves them to the planner.
    plain_without_budget
        Keep the function as it was next to the rewritten one, and make the function a
        dispatcher that runs the rewritten copy only when the calling thread has a memory
        budget: without a budget a call then costs one packed call more than without the pass
        (not two runtime calls per candidate), and peaks where the unrewritten function does
        (the rewritten one gives evictable tensors storage of their own).
    """

    max_candidates: int = 256
    max_recipe_ops: int = 32
    min_gap: int = 1
    min_bytes: int = 1024
    min_fraction: float = 0.01
    hot_fraction: float = 0.25
    functions: tuple[str, ...] | None = None
    own_storage_fraction: float | None = None
    plain_without_budget: bool = True

    def __post_init__(self) -> None:
        if self.max_candidates < 0 or self.max_recipe_ops < 1 or self.min_gap < 0:
            raise ValueError(f"invalid RematOptions: {self}")
        if not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction}")
        if self.own_storage_fraction is not None and not 0.0 <= self.own_storage_fraction <= 1.0:
            raise ValueError(
                f"own_storage_fraction must be in [0, 1] or None, got {self.own_storage_fraction}"
            )


@tvm.transform.module_pass(opt_level=0, name="Rematerialize")
class Rematerialize:
    """Insert ``evict``/``regenerate`` runtime calls and regeneration functions.

    Parameters
    ----------
    options
        :class:`RematOptions`; defaults when ``None``.

    After the pass ran, ``pass_obj.last_result`` is a
    :class:`~blade_relax.transform.result.PassResult`: per rewritten function, the tensors made
    evictable (its slots), the peak of :func:`blade_relax.analysis.memory_timeline` before the
    pass and that of the rewritten function (the copy that runs under a budget) with nothing
    evicted, both built when first read; evictions under a budget lower it at run time, as far
    as the budget asks. Without a budget the dispatcher (``plain_without_budget``) runs the
    function as it was.
    """

    def __init__(self, options: RematOptions | None = None) -> None:
        if options is not None and not isinstance(options, RematOptions):
            raise TypeError(f"Rematerialize takes RematOptions, got {type(options).__name__}")
        self.options = options or RematOptions()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        changed = False
        models = _models(mod)
        called = _called_by_transformable(mod, models)
        results: list[FunctionResult | tuple[relax.Function, relax.Function]] = []
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            name = gv.name_hint
            if gv in called:
                # A callee's own remat decision would run nested in its caller's, which
                # accounts for the callee's bytes with no eviction: only the outermost
                # function the pass can transform decides.
                results.append(FunctionResult(name, False, notes=(_CALLED,)))
                continue
            if func.attrs is not None and any(
                a in func.attrs
                for a in (REMAT_META_ATTR, REMAT_REGEN_ATTR, REMAT_RELEASE_ATTR, REMAT_COPY_ATTR)
            ):
                results.append(FunctionResult(name, False))  # made by this pass
                continue
            if self.options.functions is not None and gv.name_hint not in self.options.functions:
                results.append(FunctionResult(name, False, notes=("not in options.functions",)))
                continue
            try:
                new_func = _rematerialize(
                    gv.name_hint, func, mod, self.options, builder, models[gv]
                )
            except UnsupportedFunction as err:
                results.append(FunctionResult(name, False, notes=(f"not supported: {err}",)))
                continue
            if new_func is None:
                results.append(FunctionResult(name, False, notes=("no tensor worth evicting",)))
                continue
            if self.options.plain_without_budget:
                builder.update_func(gv, budget_dispatch(builder, gv, func, new_func))
            else:
                builder.update_func(gv, new_func)
            changed = True
            results.append((func, new_func))
        out = builder.get() if changed else mod
        # The peaks are read later: from the modules as they are now.
        frozen = (snapshot(mod), snapshot(out)) if changed else (mod, out)
        functions = tuple(
            r if isinstance(r, FunctionResult) else self._rewritten(*r, *frozen) for r in results
        )
        publish(self, PassResult("Rematerialize", functions))
        return out

    def _rewritten(
        self, func: relax.Function, new_func: relax.Function, mod: tvm.IRModule, out: tvm.IRModule
    ) -> FunctionResult:
        """The result of a rewritten function, read from its metadata."""
        meta = RematMetadata.from_json(str(new_func.attrs[REMAT_META_ATTR]))
        names = [slot.name for slot in meta.slots]
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        changes = [f"{counted(len(names), 'tensor')} evictable ({shown})"]
        notes = ["peak after: the rewritten function with nothing evicted"]
        if self.options.plain_without_budget:
            changes.append("dispatches on a memory budget to the rewritten or the plain copy")
        if meta.notes:
            notes.append("estimated timeline inexact: " + "; ".join(meta.notes))
        before, after = timeline_peak(func, mod), timeline_peak(new_func, out)
        return FunctionResult(meta.function, True, tuple(changes), before, after, tuple(notes))


_CALLED = "called by a function the pass can transform (that caller decides for it)"


# --------------------------------------------------------------------------- helpers
def _models(mod: tvm.IRModule) -> dict[relax.GlobalVar, FunctionModel | UnsupportedFunction]:
    """Each Relax function's classified bindings, or why the pass cannot transform it.

    Built once per function: both the eligibility of callees and the rewrite read it.
    """
    models: dict[relax.GlobalVar, FunctionModel | UnsupportedFunction] = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            try:
                models[gv] = build_model(func, mod)
            except UnsupportedFunction as err:
                models[gv] = err
    return models


def _called_by_transformable(
    mod: tvm.IRModule, models: dict[relax.GlobalVar, FunctionModel | UnsupportedFunction]
) -> set[relax.GlobalVar]:
    """Relax functions that a function this pass can transform calls or passes as a value.

    A caller the pass leaves alone anyway (control flow, e.g. a dispatcher choosing between
    versions of a function by shape) does not make its callees ineligible.
    """
    relax_gvs = set(models)
    found: set[relax.GlobalVar] = set()
    for gv in relax_gvs:
        caller = mod[gv]
        if isinstance(models[gv], UnsupportedFunction):
            continue
        named: set[relax.GlobalVar] = set()

        def visit(node: Any, named: set[relax.GlobalVar] = named) -> None:
            if isinstance(node, relax.GlobalVar) and node in relax_gvs:
                named.add(node)

        relax.analysis.post_order_visit(caller.body, visit)
        found |= named - {gv}  # a function naming itself (recursion) stays eligible
    return found


def _signature_dims(func: relax.Function) -> list[tvm.tirx.Var]:
    dims: dict[str, tvm.tirx.Var] = {}
    for param in func.params:
        for var in relax.analysis.definable_tir_vars_in_type(param.ty):
            if var.name in dims and not dims[var.name].same_as(var):
                raise UnsupportedFunction(f"two symbolic dims named {var.name}")
            dims.setdefault(var.name, var)
    return list(dims.values())


def _walk_stores(stmt: Any, extents: list[Any], out: list[Any]) -> None:
    """Collect, for every buffer store, the product of the loop extents around it."""
    if stmt is None:
        return
    kind = type(stmt).__name__
    if kind == "BufferStore":
        total = tvm.tirx.IntImm("int64", 1)
        for e in extents:
            total = total * tvm.tirx.Cast("int64", e)
        out.append(total)
        return
    if kind == "For":
        _walk_stores(stmt.body, [*extents, stmt.extent], out)
        return
    if kind == "SeqStmt":
        for s in stmt.seq:
            _walk_stores(s, extents, out)
        return
    for attr in ("block", "init", "body", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if child is not None and isinstance(child, tvm.tirx.Stmt):
            _walk_stores(child, extents, out)


def _kernel_cost(op: Op, mod: tvm.IRModule, dims: set[str]) -> str:
    """Loop iterations of a kernel call, over the caller's dims (output bytes as fallback)."""
    fallback = " + ".join(tensor_bytes_py(o.ty) for o in op.outputs) or "1"
    try:
        prim = mod[op.value.op]
        stores: list[Any] = []
        _walk_stores(prim.body, [], stores)
        if not stores:
            return fallback
        rename: dict[Any, str] = {}
        for param, arg in zip(prim.params, op.value.args):
            # TVM 0.27: a buffer parameter is a Var of BufferType that carries its shape.
            if type(param.ty).__name__ == "BufferType":
                values = getattr(getattr(getattr(arg, "ty", None), "shape", None), "values", None)
                if values is None:
                    continue
                for dim, actual in zip(param.shape, values):
                    if isinstance(dim, tvm.tirx.Var) and dim not in rename:
                        rename[dim] = f"({prim_to_py(actual)})"
            elif isinstance(arg, tvm.ir.PrimExpr):
                rename[param] = f"({prim_to_py(arg)})"
        text = " + ".join(prim_to_py(s, rename) for s in stores)
        validate(text, dims)  # only the caller's dims may remain
        return text
    except Exception:  # any kernel the estimate cannot read (user TIR): its output bytes
        # Not warned: only the ranking estimate changes, never what the pass does. Taken today
        # for every kernel with a non-buffer parameter (`tvm.ir.PrimExpr` is gone in TVM 0.27);
        # fixing that changes the costs written in the remat metadata.
        return fallback


def _regen_function(
    owner: str, slot: int, cand: Candidate, recipe: Recipe, dims: Sequence[tvm.tirx.Var]
) -> tuple[relax.Function, bool]:
    """The regeneration function of ``cand`` and whether it takes a trailing dims shape.

    The trailing shape is the caller's: every dim of the owner's signature, in the order of
    ``dims`` (what the rewritten function passes), even where the regeneration reads fewer.
    A shape of the dims it reads alone would bind them by position in another order (with two
    dims, ``b`` would take the value of ``s``).
    """
    params = [relax.Var(v.name, v.ty) for v in recipe.inputs]
    mapping: dict[relax.Var, relax.Var] = dict(zip(recipe.inputs, params))

    def lookup(v: relax.Var) -> relax.Var:
        target = recipe.resolved.get(v, v)
        return mapping.get(target, mapping.get(v, v))

    bindings: list[relax.Binding] = []
    for op in recipe.ops:
        value = substitute(op.value, lookup)
        new_var = relax.Var(op.var.name, op.var.ty)
        if op.is_match_cast:
            bindings.append(relax.MatchCast(new_var, value, op.var.ty))
        else:
            bindings.append(relax.VarBinding(new_var, value))
        mapping[op.var] = new_var
    result = mapping[cand.root]

    def make(all_params: list[relax.Var]) -> relax.Function:
        body = relax.SeqExpr([relax.BindingBlock(bindings)], result)
        fn = relax.Function(all_params, body, cand.root.ty, True)
        return fn.with_attr("relax.force_pure", True).with_attr(REMAT_REGEN_ATTR, f"{owner}/{slot}")

    func = make(params)
    free = list(relax.analysis.free_symbolic_vars(func))
    takes_dims = bool(free)
    if takes_dims:
        outside = sorted(v.name for v in free if not any(v.same_as(d) for d in dims))
        if outside:
            raise UnsupportedFunction(
                f"regenerating {cand.root.name} reads dims {outside} that no parameter defines"
            )
        dims_param = relax.Var("remat_dims", relax.ShapeType(values=list(dims)))
        func = make([*params, dims_param])
    func = relax.BlockBuilder().normalize(func)
    func = relax.utils.copy_with_new_vars(func)
    return func, takes_dims


# --------------------------------------------------------------------------- the pass
def _hot_bindings(func: relax.Function, mod: tvm.IRModule, fraction: float):
    from ...analysis import memory_timeline

    timeline = memory_timeline(func, mod=mod)
    graph = timeline.graph
    points = graph.representative_points() or [{}]
    hot: set[int] = set()
    peaks: list[int] = []
    for point in points:
        evaluated = timeline.evaluate(point)
        threshold = fraction * evaluated.peak
        hot.update(i for i, v in enumerate(evaluated.live_during) if v >= threshold and v > 0)
        peaks.append(evaluated.peak)
    return hot, graph, points, peaks


def _negligible(
    sizes: dict[relax.Var, list[int]], limits: list[float], spans: dict[relax.Var, int]
) -> list[relax.Var]:
    """The smallest tensors that together stay below ``limits`` (one per representative shape).

    ``sizes`` gives each tensor's bytes at the same shapes, ``spans`` the length of its gap.
    Tensors are taken smallest first (by their largest share of a limit; among equals, the
    shorter gap first: it spans less of the program) while the running sum stays below the
    limit at every shape.
    """

    def order(root: relax.Var) -> tuple[float, int]:
        shares = [n / limit if limit > 0 else float("inf") for n, limit in zip(sizes[root], limits)]
        return max(shares, default=float("inf")), spans[root]

    totals = [0] * len(limits)
    dropped: list[relax.Var] = []
    for root in sorted(sizes, key=order):
        grown = [total + n for total, n in zip(totals, sizes[root])]
        if any(g >= limit for g, limit in zip(grown, limits)):
            break
        totals = grown
        dropped.append(root)
    return dropped


def _select(
    model: FunctionModel,
    gaps: dict[relax.Var, tuple[int, int]],
    options: RematOptions,
) -> dict[relax.Var, Candidate]:
    """Candidates with recipes, iterated until every remaining one has a recipe."""
    candidates = {root: Candidate(root, a, b) for root, (a, b) in gaps.items()}
    while True:
        failed = []
        for root, cand in candidates.items():
            try:
                cand.recipe = build_recipe(model, cand, candidates, options.max_recipe_ops)
            except RecipeError:
                failed.append(root)
        if not failed:
            return candidates
        for root in failed:
            del candidates[root]


def _rematerialize(
    name: str,
    func: relax.Function,
    mod: tvm.IRModule,
    options: RematOptions,
    builder: relax.BlockBuilder,
    model: FunctionModel | UnsupportedFunction,
) -> relax.Function | None:
    """The rewritten ``func`` (its regeneration functions added to ``builder``), or None when
    no tensor is worth evicting."""
    if options.max_candidates == 0:
        return None
    if isinstance(model, UnsupportedFunction):
        raise model
    dims = _signature_dims(func)
    dim_names = {d.name for d in dims}
    try:
        hot, graph, points, peaks = _hot_bindings(func, mod, options.hot_fraction)
    except Exception as err:  # user IR: the timeline may fail to read it in any way
        warn_fallback("Rematerialize", "function", name, err)
        return None
    gaps = _worth_evicting(model, graph, hot, points, peaks, dim_names, options)
    candidates = _select(model, gaps, options)
    cost_of = _CostTexts(mod, dim_names)
    if len(candidates) > options.max_candidates:
        candidates = _most_freeing(model, candidates, hot, points, cost_of, options)
    if not candidates:
        return None

    ordered = sorted(candidates.values(), key=lambda c: model.writer[c.root])
    for slot, cand in enumerate(ordered):
        cand.slot = slot
    gvs, takes_dims = _add_regen_functions(builder, name, ordered, dims)
    release = _release_function(builder)
    new_func, plans = rewrite(func, model, ordered, candidates, gvs, takes_dims, dims, release, mod)
    if options.own_storage_fraction is not None:
        large = _large_tensors(model, graph, points, peaks, options.own_storage_fraction)
        new_func = _own_storage(new_func, large - set(candidates))
    slots = [
        SlotSpec(cand.root.name, gvs[cand.slot].name_hint, cost_of(cand), plans[cand.slot])
        for cand in ordered
    ]
    # The estimate: the lowered IR, before planning (RematTimeline writes the exact one).
    new_func = builder.normalize(new_func)
    meta_dims = [d.name for d in dims]
    return builder.normalize(
        write_metadata(new_func, builder.get(), "lowered", name, meta_dims, slots)
    )


def _worth_evicting(
    model: FunctionModel,
    graph: Any,
    hot: set[int],
    points: list,
    peaks: list,
    dim_names: set[str],
    options: RematOptions,
) -> dict[relax.Var, tuple[int, int]]:
    """The gaps (:func:`find_gaps`) of the tensors worth evicting: those whose size the runtime
    can evaluate from the dims, not provably below ``min_bytes``, and not among the smallest
    that together stay under ``min_fraction`` of the peak (:func:`_negligible`)."""
    from ...symbolic import Ordering

    gaps = find_gaps(model, hot, options.min_gap)
    sizes: dict[relax.Var, list[int]] = {}
    for root in list(gaps):
        try:
            validate(tensor_bytes_py(root.ty), dim_names)
        except ValueError:
            del gaps[root]
            continue
        size = graph.bytes_of(root)
        if graph.compare(size, options.min_bytes) in (Ordering.LT, Ordering.LE, Ordering.EQ):
            del gaps[root]
            continue
        sizes[root] = [graph.evaluate(size, point) for point in points]
    spans = {root: b - a for root, (a, b) in gaps.items()}
    for root in _negligible(sizes, [options.min_fraction * peak for peak in peaks], spans):
        del gaps[root]
    return gaps


class _CostTexts:
    """Each candidate's recompute cost as a dim expression: the loop iterations of its recipe's
    kernels (:func:`_kernel_cost`), written once per tensor, and once per kernel call (the
    recipes of neighbouring tensors share most of their calls, and reading a kernel's loop
    nest costs more than the rest of a candidate's ranking)."""

    def __init__(self, mod: tvm.IRModule, dim_names: set[str]) -> None:
        self.mod = mod
        self.dim_names = dim_names
        self.texts: dict[relax.Var, str] = {}
        self.kernel_costs: dict[relax.Var, str] = {}

    def __call__(self, cand: Candidate) -> str:
        if cand.root not in self.texts:
            terms = [self._kernel_cost(op) for op in cand.recipe.ops if op.kind == "kernel"]
            self.texts[cand.root] = " + ".join(f"({t})" for t in terms) or "1"
        return self.texts[cand.root]

    def _kernel_cost(self, op: Op) -> str:
        # An op is one binding of the function: its variable names the call.
        if op.var not in self.kernel_costs:
            self.kernel_costs[op.var] = _kernel_cost(op, self.mod, self.dim_names)
        return self.kernel_costs[op.var]


def _most_freeing(
    model: FunctionModel,
    candidates: dict[relax.Var, Candidate],
    hot: set[int],
    points: list,
    cost_of: _CostTexts,
    options: RematOptions,
) -> dict[relax.Var, Candidate]:
    """The ``max_candidates`` candidates that free the most bytes over the hot bindings (summed
    over the representative shapes), the cheaper to recompute first among equals, with their
    recipes built again for that smaller set."""
    names = sorted(cost_of.dim_names)
    scores = {}
    for root, cand in candidates.items():
        evaluate = compile_expressions(names, [cost_of(cand), tensor_bytes_py(root.ty)])
        covered = sum(1 for t in hot if cand.evict_after < t < cand.regen_before)
        freed = cost = 0.0
        for point in points:
            point_cost, nbytes = evaluate(*(int(point.get(d, 1)) for d in names))
            freed += nbytes * covered
            cost += point_cost
        scores[root] = (-freed, cost)
    keep = sorted(candidates, key=lambda r: scores[r])[: options.max_candidates]
    gaps = {r: (candidates[r].evict_after, candidates[r].regen_before) for r in keep}
    return _select(model, gaps, options)


def _add_regen_functions(
    builder: relax.BlockBuilder,
    name: str,
    ordered: list[Candidate],
    dims: list[tvm.tirx.Var],
) -> tuple[dict[int, relax.GlobalVar], dict[int, bool]]:
    """Add each candidate's regeneration function to the module, named ``<name>_remat<slot>``;
    by slot, its global var and whether it takes the trailing dims shape."""
    gvs: dict[int, relax.GlobalVar] = {}
    takes_dims: dict[int, bool] = {}
    for cand in ordered:
        fn, with_dims = _regen_function(name, cand.slot, cand, cand.recipe, dims)
        gvs[cand.slot] = builder.add_func(fn, f"{name}_remat{cand.slot}")
        takes_dims[cand.slot] = with_dims
    return gvs, takes_dims


def _large_tensors(
    model: FunctionModel, graph: Any, points: list, peaks: list, fraction: float
) -> set[relax.Var]:
    """Fresh tensors reaching ``fraction`` of the peak at some representative shape."""
    out = set()
    for op in model.ops:
        if op.kind != "alloc":
            continue
        try:
            size = graph.bytes_of(op.var)
            if any(
                graph.evaluate(size, point) >= fraction * peak for point, peak in zip(points, peaks)
            ):
                out.add(op.var)
        except (ValueError, KeyError):
            continue  # a size the shape graph cannot evaluate: leave it to the planner
    return out


def _own_storage(func: relax.Function, tensors: set[relax.Var]) -> relax.Function:
    """Give each of ``tensors`` (``R.builtin.alloc_tensor`` bindings) a storage of its own.

    The explicit ``R.memory.alloc_storage`` / ``R.memory.alloc_tensor`` pair is what
    ``LowerAllocTensor`` makes of an allocation the planner leaves alone; the planners only
    plan ``R.builtin.alloc_tensor``, and ``KillAfterLastUse`` frees the storage after the
    tensor's last use.
    """
    if not tensors:
        return func
    out: list[relax.Binding] = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if (
                binding.var in tensors
                and classify(value).kind is Kind.TENSOR_ALLOC
                and isinstance(value.args[0], relax.ShapeExpr)
            ):
                shape, dtype, device, scope = value.args
                itemsize = (tvm.runtime.DataType(str(dtype.value)).bits + 7) // 8
                nbytes = tvm.tirx.IntImm("int64", itemsize)
                for dim in shape.values:
                    nbytes = nbytes * dim
                storage = relax.Var(f"{binding.var.name}_storage", relax.ObjectType())
                out.append(
                    relax.VarBinding(
                        storage,
                        relax.op.memory.alloc_storage(
                            relax.ShapeExpr([nbytes]), device, scope, "uint8"
                        ),
                    )
                )
                out.append(
                    relax.VarBinding(
                        binding.var,
                        relax.op.memory.alloc_tensor(storage, 0, shape, dtype, device),
                    )
                )
                continue
            out.append(binding)
    body = relax.SeqExpr([relax.BindingBlock(out)], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


def _release_function(builder: relax.BlockBuilder) -> relax.GlobalVar:
    """The module's no-op function the runtime calls after a regeneration (see the runtime)."""
    mod = builder.get()
    for gv, func in mod.functions.items():
        if (
            isinstance(func, relax.Function)
            and func.attrs is not None
            and REMAT_RELEASE_ATTR in func.attrs
        ):
            return gv
    body = relax.SeqExpr([], relax.Tuple([]))
    func = relax.Function([], body, relax.TupleType([]), True)
    func = func.with_attr(REMAT_RELEASE_ATTR, True)
    return builder.add_func(relax.BlockBuilder().normalize(func), "blade_relax_remat_release")

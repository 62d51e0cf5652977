"""The rewrite stage of ``Rematerialize``: the runtime calls inserted into a function.

Given the candidates (:mod:`._select`) with their slots and regeneration functions,
:func:`rewrite` emits the function's bindings in order with ``remat_begin`` first, an
``evict`` after each candidate's last use before its gap, a ``regenerate`` before its next use
(and its views rebuilt over the regenerated tensor), and a ``release`` after every call of
another Relax function; each ``regenerate`` gets its regeneration plan (the closures to run and
where their inputs come from). The metadata is written afterwards (``._timeline``).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from ...contract import EVICT, NO_PLAN_ATTR, REGENERATE, REMAT_BEGIN, PlanNode
from ._ir import FunctionModel
from ._select import Candidate, classify_at
from ._timeline import INVOKE_CLOSURE

__all__ = ["rewrite", "substitute"]


def substitute(expr: relax.Expr, lookup: Callable[[relax.Var], relax.Var]) -> relax.Expr:
    """Replace each variable ``v`` of an A-normal-form value by ``lookup(v)``."""
    if isinstance(expr, relax.Var):
        return lookup(expr)
    if isinstance(expr, relax.Call):
        op = lookup(expr.op) if isinstance(expr.op, relax.Var) else expr.op
        return relax.Call(op, [substitute(a, lookup) for a in expr.args], expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, lookup) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, lookup), expr.index)
    return expr


def _calls_relax_function(value: relax.Expr, mod: tvm.IRModule) -> bool:
    op = getattr(value, "op", None)
    return (
        isinstance(value, relax.Call)
        and isinstance(op, relax.GlobalVar)
        and op in mod.functions
        and isinstance(mod[op], relax.Function)
    )


def _builtin(name: str, args: list[relax.Expr], ty: relax.Type) -> relax.Call:
    return relax.op.call_builtin_with_ctx(relax.ExternFunc(name), relax.Tuple(args), ty_args=ty)


def _drop_unread_views(
    bindings: list[relax.Binding], result: relax.Expr, model: FunctionModel
) -> list[relax.Binding]:
    """Remove views and aliases that nothing reads any more.

    A view of an evicted tensor whose later readers now read the rebuilt view would otherwise
    keep the evicted storage alive: ``KillAfterLastUse`` never kills a variable nobody reads.
    """
    removable = {op.var for op in model.ops if op.kind in ("alias", "view", "getitem")}
    while True:
        read: set[relax.Var] = set(relax.analysis.free_vars(result))
        for b in bindings:
            read.update(relax.analysis.free_vars(b.value))
        kept = [b for b in bindings if b.var in read or b.var not in removable]
        if len(kept) == len(bindings):
            return kept
        bindings = kept


def _regen_position(model: FunctionModel, cand: Candidate) -> int:
    """Where the ``regenerate`` call of ``cand`` goes: before its site's reader, and before the
    allocations of that reader's outputs right in front of it.

    The outputs are written only by the reader, so the recomputation may run first: its
    temporaries are then gone before the outputs take memory, instead of on top of them.
    """
    site = cand.regen_before
    reader = model.ops[site]
    outputs = set(reader.outputs) if reader.kind == "kernel" else set()
    position = site
    while (
        position - 1 > cand.evict_after
        and model.ops[position - 1].kind == "alloc"
        and model.ops[position - 1].var in outputs
    ):
        position -= 1
    return position


def rewrite(
    func: relax.Function,
    model: FunctionModel,
    ordered: list[Candidate],
    candidates: dict[relax.Var, Candidate],
    gvs: dict[int, relax.GlobalVar],
    takes_dims: dict[int, bool],
    dims: list[tvm.tirx.Var],
    release: relax.GlobalVar,
    mod: tvm.IRModule,
) -> tuple[relax.Function, dict[int, tuple[PlanNode, ...]]]:
    """Insert the runtime calls and redirect later uses to the regenerated tensors.

    After every call of another Relax function it also calls ``release``: the VM keeps a
    function's result in its return register until the next function returns, so without it
    the callee's result would outlive its last reader until a decision-dependent point (a
    ``regenerate`` that recomputes runs closures, one that hands back a kept tensor does not).

    Parameters
    ----------
    func, model
        The function and its classified bindings.
    ordered
        The candidates, by slot.
    candidates
        The same by tensor (chains: a recipe's inputs that are candidates themselves).
    gvs, takes_dims
        By slot, the regeneration function and whether it takes the trailing dims shape.
    dims
        The function's dims, in the order ``remat_begin`` and the regeneration functions take
        them.
    release
        The module's no-op function.
    mod
        The module (to tell calls of Relax functions).

    Returns
    -------
    tuple
        The rewritten function, and by slot its regeneration plan.
    """
    evict_after: dict[int, list[Candidate]] = {}
    regen_before: dict[int, list[Candidate]] = {}
    for cand in ordered:
        evict_after.setdefault(cand.evict_after, []).append(cand)
        regen_before.setdefault(_regen_position(model, cand), []).append(cand)
    writer = _Rewriter(model, candidates, takes_dims, dims, release, mod)
    writer.begin([gvs[c.slot] for c in ordered])
    bindings = [b for block in func.body.blocks for b in block.bindings]
    for op, binding in zip(model.ops, bindings):
        here = regen_before.get(op.index, [])
        for cand in sorted(here, key=lambda c: (c.regen_before, model.writer[c.root])):
            writer.regenerate(cand, op.index)
        writer.copy(binding)
        for cand in evict_after.get(op.index, []):
            writer.evict(cand)
    return writer.finish(func, ordered), writer.plans


class _Rewriter:
    """The bindings of the rewritten function, emitted in program order by :func:`_rewrite`,
    and the renaming of the tensors it regenerates (and of their views)."""

    def __init__(
        self,
        model: FunctionModel,
        candidates: dict[relax.Var, Candidate],
        takes_dims: dict[int, bool],
        dims: list[tvm.tirx.Var],
        release: relax.GlobalVar,
        mod: tvm.IRModule,
    ) -> None:
        self.model = model
        self.candidates = candidates
        self.takes_dims = takes_dims
        self.release = release
        self.mod = mod
        self.frame = relax.Var("remat_frame", relax.ObjectType())
        self.dims_expr = relax.ShapeExpr(list(dims))
        self.out: list[relax.Binding] = []
        # Slot -> its regenerated tensor; variable -> the variable later uses read instead.
        self.regenerated: dict[int, relax.Var] = {}
        self.subst: dict[relax.Var, relax.Var] = {}
        self.plans: dict[int, tuple[PlanNode, ...]] = {}

    def lookup(self, v: relax.Var) -> relax.Var:
        return self.subst.get(v, v)

    def begin(self, regens: list[relax.GlobalVar]) -> None:
        """The ``remat_begin`` call, first; its key and metadata are written last
        (:func:`~._timeline.attach_metadata`). The regeneration functions, by slot, reach the
        runtime once per call (not once per ``regenerate`` call): the frame keeps them."""
        args = [
            tvm.ir.StringImm("pending"),
            relax.const(0, "uint8"),
            self.dims_expr,
            self.release,
            *regens,
        ]
        self.out.append(
            relax.VarBinding(self.frame, _builtin(REMAT_BEGIN, args, relax.ObjectType()))
        )

    def copy(self, binding: relax.Binding) -> None:
        """An original binding, reading the regenerated tensors; ``release`` after a call of a
        Relax function (see :func:`_rewrite`)."""
        value = substitute(binding.value, self.lookup)
        if isinstance(binding, relax.MatchCast):
            self.out.append(relax.MatchCast(binding.var, value, binding.ty))
        else:
            self.out.append(relax.VarBinding(binding.var, value))
        if _calls_relax_function(binding.value, self.mod):
            # Through the builtin: a VM function call whose result nobody reads is not
            # supported by the VM's code generator (it writes to the void register).
            call = _builtin(INVOKE_CLOSURE, [self.release], relax.ObjectType())
            self.out.append(relax.VarBinding(relax.Var("_", relax.ObjectType()), call))

    def evict(self, cand: Candidate) -> None:
        """The ``evict`` call of ``cand``, after the last use before its gap."""
        args = [self.frame, relax.prim_value(cand.slot), cand.root]
        call = _builtin(EVICT, args, relax.ObjectType())
        self.out.append(relax.VarBinding(relax.Var("_", relax.ObjectType()), call))

    def regenerate(self, cand: Candidate, position: int) -> None:
        """The ``regenerate`` call of ``cand`` before the binding at ``position``; later uses
        of ``cand`` and of its views read the regenerated tensor."""
        nodes, args = self.plan(cand)
        self.plans[cand.slot] = nodes
        new = relax.Var(f"{cand.root.name}_remat", cand.root.ty)
        # The inputs of the regeneration travel in one tuple (built by the VM in C++): the
        # runtime converts its fields only when it recomputes, so keeping a tensor costs
        # three arguments whatever the plan's size. The tuple is read only during the call.
        inputs = relax.Var(f"{cand.root.name}_inputs", relax.TupleType([a.ty for a in args]))
        self.out.append(relax.VarBinding(inputs, relax.Tuple(args)))
        # A plain packed call: the planner may keep the inputs in planned storage (the
        # runtime reads them only during the call), and the result is never planned.
        call = relax.Call(
            relax.ExternFunc(REGENERATE),
            [self.frame, relax.prim_value(cand.slot), inputs],
            ty_args=[cand.root.ty],
        )
        self.out.append(relax.VarBinding(new, call))
        self.regenerated[cand.slot] = new
        self.subst[cand.root] = new
        self.redirect_members(cand, new, position)

    def redirect_members(self, cand: Candidate, new: relax.Var, position: int) -> None:
        """Views and aliases of ``cand`` defined before ``position`` and read from it on: an
        alias or a tuple field becomes ``new``, a view is built again over ``new``."""
        model = self.model
        earlier = [
            m
            for m in model.members.get(cand.root, [])
            if m is not cand.root and model.defined_at(m) < position
        ]
        # Every alias is renamed first: a rebuilt view may read one that is itself not read
        # later.
        for member in earlier:
            mop = model.op_of[member]
            if mop.kind in ("alias", "getitem") and not mop.is_match_cast:
                self.subst[member] = new
        # Rebuild the views read later, and the views those are built from.
        needed: set[relax.Var] = set()
        for member in reversed(earlier):
            if member in needed or any(p >= position for p in model.var_uses.get(member, ())):
                needed.add(member)
                source = model.op_of[member].source
                if source is not None:
                    needed.add(source)
        for member in earlier:
            if member not in needed:
                continue
            mop = model.op_of[member]
            if mop.kind == "view" or mop.is_match_cast:
                fresh = relax.Var(f"{member.name}_remat", member.ty)
                value = substitute(mop.value, self.lookup)
                if mop.is_match_cast:
                    self.out.append(relax.MatchCast(fresh, value, member.ty))
                else:
                    self.out.append(relax.VarBinding(fresh, value))
                self.subst[member] = fresh
            else:  # an alias or a tuple field: the same tensor
                self.subst[member] = new

    def plan(self, cand: Candidate) -> tuple[tuple[PlanNode, ...], list[relax.Expr]]:
        """The regeneration plan of ``cand`` at its site, and the values its call passes.

        Per closure to run (chained candidates first), where each input comes from: a value
        the call passes (``"a"``: a tensor live at the site, the regenerated copy of a
        candidate, or the dims), or another slot (``"s"``: a candidate inside its window,
        materialized by an earlier node of the plan or kept by the runtime).
        """
        site = cand.regen_before
        nodes: list[PlanNode] = []
        args: list[relax.Expr] = []
        visited: set[int] = set()

        def arg(expr: relax.Expr) -> tuple[str, int]:
            for i, existing in enumerate(args):
                if existing.same_as(expr):
                    return ("a", i)
            args.append(expr)
            return ("a", len(args) - 1)

        def visit(c: Candidate) -> None:
            if c.slot in visited:
                return
            visited.add(c.slot)
            refs: list[tuple[str, int]] = []
            for inp in c.recipe.inputs:
                other = self.candidates.get(inp)
                where = "orig" if other is None else classify_at(other, site, self.model)
                if where == "orig":
                    refs.append(arg(inp))
                elif where == "regen":
                    if other.slot not in self.regenerated:
                        raise AssertionError(f"{other.root.name} is not regenerated before {site}")
                    refs.append(arg(self.regenerated[other.slot]))
                elif where == "slot":
                    visit(other)
                    refs.append(("s", other.slot))
                else:
                    raise AssertionError(f"{other.root.name} is dead at {site}")
            if self.takes_dims[c.slot]:
                refs.append(arg(self.dims_expr))
            nodes.append(PlanNode(c.slot, tuple(refs)))

        visit(cand)
        return tuple(nodes), args

    def finish(self, func: relax.Function, ordered: list[Candidate]) -> relax.Function:
        """The rewritten function: the bindings emitted, the views nothing reads dropped."""
        result = substitute(func.body.body, self.lookup)
        out = _drop_unread_views(self.out, result, self.model)
        body = relax.SeqExpr([relax.BindingBlock(out)], result)
        new_func = relax.Function(
            func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span
        )
        # Evictable tensors keep their own storage under PlanMemory too.
        return new_func.with_attr(NO_PLAN_ATTR, [c.root.name for c in ordered])

"""Dispatchers: a function that calls one of several private copies of itself.

Two passes may replace a function by a dispatcher, and both build it here:

* :class:`~blade_relax.transform.MemoryAwareSchedule`, when no single order suits every length,
  emits one copy per range of a dim (attribute :data:`~blade_relax.contract.SCHEDULE_VERSION_ATTR`)
  and tests ``R.prim_value(s <= k)`` in order::

      def main(x):                       # original name, params and attributes
          if R.prim_value(s <= 64):
              r = main__s2_64(x)
          else:
              r = main__s65_inf(x)
          return r

* :class:`~blade_relax.transform.Rematerialize` keeps the unrewritten function next to the
  rewritten one (attribute :data:`~blade_relax.contract.REMAT_COPY_ATTR`) and asks the runtime
  whether this thread has a memory budget (:data:`~blade_relax.contract.REMAT_ACTIVE`).

Copies are separate functions, never two branches of one body: the storage planners plan each
function on its own, while ``StaticPlanBlockMemory`` shares storage tokens across the branches of
an ``If`` and can leave a branch using a storage only the other branch allocates
(apache/tvm#20191). A copy is private (fresh variables, no ``global_symbol``).

:func:`version_for` follows both kinds of dispatcher to the function that runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from ..contract import LOWER_BOUND_ATTR, REMAT_ACTIVE, REMAT_COPY_ATTR, SCHEDULE_VERSION_ATTR

__all__ = [
    "DimRange",
    "budget_copy_of",
    "budget_dispatch",
    "build_dispatcher",
    "private_copy",
    "range_copy",
    "range_dispatch",
    "range_of",
    "unique_name",
    "version_for",
]


def private_copy(func: relax.Function) -> relax.Function:
    """A copy of ``func`` with fresh variables and no ``global_symbol`` (not externally visible)."""
    copy = relax.utils.copy_with_new_vars(func)
    if copy.attrs is not None and "global_symbol" in copy.attrs:
        copy = copy.without_attr("global_symbol")
    return copy


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, with ``_`` appended until no function of ``taken`` has it; added to ``taken``."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def build_dispatcher(
    func: relax.Function,
    cases: Sequence[tuple[relax.Expr | None, tvm.ir.GlobalVar]],
    prelude: Iterable[relax.Binding] = (),
) -> relax.Function:
    """The function that replaces ``func``: it calls the first case whose condition holds.

    Parameters
    ----------
    func
        The function replaced: the dispatcher keeps its parameters, return type, purity and
        attributes, and passes the parameters on unchanged.
    cases
        ``(condition, callee)`` in order; the last one's condition is ignored (the ``else``).
    prelude
        Bindings evaluated before the test (the runtime query a condition reads).
    """
    params = list(func.params)
    body: relax.Expr = relax.Call(cases[-1][1], params)
    for condition, callee in reversed(cases[:-1]):
        assert condition is not None, "only the last case may be unconditional"
        body = relax.If(
            condition, relax.SeqExpr([], relax.Call(callee, params)), relax.SeqExpr([], body)
        )
    prelude = list(prelude)
    blocks = [relax.BindingBlock(prelude)] if prelude else []
    return relax.Function(
        params, relax.SeqExpr(blocks, body), func.ret_ty, func.is_pure, func.attrs, func.span
    )


@dataclass(frozen=True)
class DimRange:
    """``lower <= dim <= upper`` (``upper`` None: unbounded)."""

    dim: str
    lower: int
    upper: int | None

    def __str__(self) -> str:
        if self.upper is None:
            return f"{self.dim} >= {self.lower}"
        return f"{self.lower} <= {self.dim} <= {self.upper}"

    def suffix(self) -> str:
        """A name suffix, e.g. ``s2_64`` or ``s65_inf``."""
        return f"{self.dim}{self.lower}_{'inf' if self.upper is None else self.upper}"

    def holds(self, dims: Mapping[str, int]) -> bool:
        """Whether ``dims`` gives the dim a value in the range (``False`` when it gives none)."""
        if self.dim not in dims:
            return False
        value = int(dims[self.dim])
        return self.lower <= value and (self.upper is None or value <= self.upper)


def int_map(values: dict[str, int]) -> dict[str, tvm.tirx.IntImm]:
    return {k: tvm.tirx.IntImm("int64", v) for k, v in values.items()}


def range_copy(func: relax.Function, rng: DimRange, source: str) -> relax.Function:
    """A private copy of ``func`` (fresh variables) for ``rng``."""
    copy = private_copy(func)
    lower = {}
    if copy.attrs is not None and LOWER_BOUND_ATTR in copy.attrs:
        lower = {str(k): int(v) for k, v in copy.attrs[LOWER_BOUND_ATTR].items()}
    if rng.lower > lower.get(rng.dim, 0):
        lower[rng.dim] = rng.lower
        copy = copy.with_attr(LOWER_BOUND_ATTR, int_map(lower))
    info: dict[str, object] = {
        "of": source,
        "dim": rng.dim,
        "lower": tvm.tirx.IntImm("int64", rng.lower),
    }
    if rng.upper is not None:
        info["upper"] = tvm.tirx.IntImm("int64", rng.upper)
    return copy.with_attr(SCHEDULE_VERSION_ATTR, info)


def range_dispatch(
    mod: tvm.IRModule,
    gv: tvm.ir.GlobalVar,
    func: relax.Function,
    dim_var: tvm.tirx.Var,
    versions: Sequence[tuple[DimRange, relax.Function]],
) -> tuple[relax.Function, list[tuple[tvm.ir.GlobalVar, relax.Function]]]:
    """The dispatcher that replaces ``func`` and the range copies it calls.

    ``versions`` are contiguous ranges in increasing order, each with its scheduled function
    (parameters as ``func``'s). The dispatcher keeps ``func``'s parameters, return type and
    attributes; it tests ``dim <= upper`` of every range but the last, in order.
    """
    taken = {g.name_hint for g in mod.get_global_vars()}
    builder = relax.BlockBuilder()
    copies: list[tuple[tvm.ir.GlobalVar, relax.Function]] = []
    for rng, version in versions:
        name = unique_name(f"{gv.name_hint}__{rng.suffix()}", taken)
        copy = range_copy(version, rng, gv.name_hint)
        copies.append((builder.add_func(copy, name), copy))
    cases = []
    for (rng, _), (copy_gv, _) in zip(versions, copies):
        condition = None
        if rng.upper is not None:
            condition = relax.prim_value(dim_var <= tvm.tirx.IntImm("int64", rng.upper))
        cases.append((condition, copy_gv))
    assert all(c is not None for c, _ in cases[:-1]), "only the last range may be unbounded"
    return builder.normalize(build_dispatcher(func, cases)), copies


def budget_dispatch(
    builder: relax.BlockBuilder,
    gv: relax.GlobalVar,
    original: relax.Function,
    rewritten: relax.Function,
) -> relax.Function:
    """The dispatcher that replaces ``original``: the rewritten copy under a budget, else the
    original one.

    Both copies are private functions (fresh variables, no ``global_symbol``) carrying
    :data:`REMAT_COPY_ATTR`; the dispatcher keeps the name, parameters and attributes of
    ``original``::

        def f(x):
            active = R.call_packed(REMAT_ACTIVE, ty_args=R.Prim("bool"))
            if active:
                r = f__remat(x)
            else:
                r = f__plain(x)
            return r

    Separate functions, not two branches of one body: the planners plan each function on its
    own, and the rewritten copy's evictable tensors must own their storage while the plain
    copy's share it as the planner sees fit.
    """
    taken = {g.name_hint for g in builder.get().get_global_vars()}

    def add_copy(func: relax.Function, suffix: str, budget: bool) -> relax.GlobalVar:
        info = {"of": gv.name_hint, "budget": tvm.tirx.IntImm("int64", int(budget))}
        name = unique_name(f"{gv.name_hint}__{suffix}", taken)
        return builder.add_func(private_copy(func).with_attr(REMAT_COPY_ATTR, info), name)

    remat_gv = add_copy(rewritten, "remat", True)
    plain_gv = add_copy(original, "plain", False)
    active = relax.Var("remat_active", tvm.ir.PrimType("bool"))
    ask = relax.Call(relax.ExternFunc(REMAT_ACTIVE), [], ty_args=[tvm.ir.PrimType("bool")])
    dispatcher = build_dispatcher(
        original, [(active, remat_gv), (None, plain_gv)], [relax.VarBinding(active, ask)]
    )
    return builder.normalize(dispatcher)


def range_of(func: object) -> tuple[str, DimRange] | None:
    """``(of, range)`` of a range copy (what :func:`range_copy` wrote); ``None`` for any other
    function, including a budget copy of a range copy (which inherits the copy's attributes)."""
    attrs = getattr(func, "attrs", None)
    if (
        not isinstance(func, relax.Function)
        or attrs is None
        or SCHEDULE_VERSION_ATTR not in attrs
        or REMAT_COPY_ATTR in attrs
    ):
        return None
    info = attrs[SCHEDULE_VERSION_ATTR]
    upper = int(info["upper"]) if "upper" in info else None
    return str(info["of"]), DimRange(str(info["dim"]), int(info["lower"]), upper)


def budget_copy_of(func: object) -> tuple[str, bool] | None:
    """``(of, budget)`` of a copy :func:`budget_dispatch` made (``budget``: the rewritten copy,
    run under a memory budget); ``None`` for any other function."""
    attrs = getattr(func, "attrs", None)
    if not isinstance(func, relax.Function) or attrs is None or REMAT_COPY_ATTR not in attrs:
        return None
    info = attrs[REMAT_COPY_ATTR]
    return str(info["of"]), bool(int(info["budget"]))


def version_for(
    mod: tvm.IRModule, name: str, dims: Mapping[str, int], *, budget: bool = False
) -> str:
    """The name of the function that runs when ``name`` is called at ``dims``.

    Follows the dispatchers the memory passes make: the range copy whose range holds ``dims``
    when ``MemoryAwareSchedule`` versioned ``name``, then, when ``Rematerialize`` kept a plain
    copy next to its rewritten one, the rewritten copy if ``budget`` (the calling thread has
    a memory budget) else the plain one. ``name`` itself when neither applies.

    Useful to read the memory timeline of a dispatched function (a dispatcher allocates
    nothing).
    """

    def in_range(func: object) -> bool:
        copy = range_of(func)
        return copy is not None and copy[0] == name and copy[1].holds(dims)

    current = _first(mod, in_range) or name
    return _first(mod, lambda func: budget_copy_of(func) == (current, budget)) or current


def _first(mod: tvm.IRModule, accept: Callable[[object], bool]) -> str | None:
    """The name of the first function of ``mod`` that ``accept``s."""
    for gv, func in mod.functions.items():
        if accept(func):
            return gv.name_hint
    return None

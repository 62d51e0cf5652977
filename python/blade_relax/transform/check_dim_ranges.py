"""CheckDimRanges: make a function refuse dims outside their declared ranges before any kernel.

A Relax function declares the range of a symbolic dim with the function attributes
``tir_var_lower_bound`` / ``tir_var_upper_bound`` (dicts from the dim's name to an integer;
``relax.frontend``'s importers and ``blade_relax.frontend`` write them from ``Dim(name, min,
max)``). The memory passes and ``StaticPlanBlockMemory`` trust these ranges: a storage may be
sized for the upper bound, a proof may hold only inside the range. Without a check, a call with
a dim above its upper bound fails deep inside the VM ("storage allocation failure") or writes
past a planned buffer, and a call below the lower bound runs silently on a plan made for other
sizes. This pass inserts, for every bounded dim ``s``, what ``LegalizeOps`` makes of
``R.assert_op(R.prim_value(T.And(s >= lo, s <= hi)), [R.prim_value(s)], format=...)``::

    R.call_packed("relax.run.assert_op", R.prim_value(T.And(s >= lo, s <= hi)),
                  R.str("dim s = {} is outside its declared range [lo, hi]"), R.prim_value(s),
                  ty_args=R.Tuple())

so that the call fails with a message naming the dim, its value and its range, e.g.
``dim s = 17 is outside its declared range [2, 16]`` (an undeclared end reads ``(-inf`` or
``inf)``). The legalized form is emitted because the pass runs after ``LegalizeOps``, and the
VM cannot run ``R.assert_op`` itself.

Where it runs
-------------
After ``ToNonDataflow`` and ``RemovePurityChecking`` (the assertion is impure: it may not stand
in a dataflow block, nor in a function still checked for purity), and before memory planning
(``StaticPlanBlockMemory`` / ``PlanMemory``): the assertions are then the first bindings of the
body, ahead of every allocation the planners insert (each ``alloc_storage`` goes just before
the first tensor placed in it, also when its size is a constant upper bound) and of every
kernel. In :func:`blade_relax.get_pipeline` it runs after ``Rematerialize``, so that the
runtime's remat decision is never asked for a shape the function refuses. Nothing later
removes it: its result is unused, but the call is impure, and the finalize passes
(``KillAfterLastUse``, ``VMShapeLower``, ...) remove no impure binding. At run time the
shape-matching prologue of ``VMShapeLower`` binds the dims from the arguments first, then the
assertions run; ``ComputePrimValue`` turns each condition into a tiny host function (a host
function on CUDA too). The memory timeline (``blade_relax.analysis.memory_timeline``) counts
both bindings as no memory, as the runtime accounting measures them.

What it assumes
---------------
The module is normalized. A dim is checked where it is defined: dims of the parameters'
types at the start of the body; a dim first defined by a ``match_cast`` of a top-level,
non-dataflow binding block just after that binding. Dims defined only inside
an ``If`` branch, or not defined at all, are not checked.

What it checks
--------------
A dim gets an assertion when it has a declared upper bound or a declared lower bound above 1
(a lone lower bound of 0 or 1 says nothing a shape dim does not already satisfy). The condition
tests every end that is declared. Functions without the attributes, and functions that
still check purity (pure and without ``relax.force_pure``: the pass runs too early there; a
warning says so), pass through unchanged; so does a function already checked by this pass.

Cost: one ``ComputePrimValue`` host call and one ``relax.run.assert_op`` packed call per
checked dim and call of the function; no allocation.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ..contract import CHECKED_DIMS_ATTR, LOWER_BOUND_ATTR, UPPER_BOUND_ATTR
from ..util.collection import pauses_collection
from .result import FunctionResult, PassResult, counted, publish

__all__ = ["CheckDimRanges", "DimCheck", "DimRangeOptions", "declared_dim_checks"]

#: The packed function ``R.assert_op`` is legalized to (registered by ``tvm.relax.op.base``).
ASSERT_FUNC = "relax.run.assert_op"


@dataclass(frozen=True)
class DimRangeOptions:
    """Options of :class:`CheckDimRanges`.

    Attributes
    ----------
    enabled
        Insert the checks; when ``False`` the pass returns its input unchanged.
    functions
        Names of the Relax functions to check; ``None`` for every function that declares
        ranges.
    """

    enabled: bool = True
    functions: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.functions is not None and (
            isinstance(self.functions, str) or not all(isinstance(f, str) for f in self.functions)
        ):
            raise TypeError(f"functions must be a tuple of names, got {self.functions!r}")


@dataclass(frozen=True)
class DimCheck:
    """The declared range of one dim (``None``: that end is not declared)."""

    name: str
    lower: int | None
    upper: int | None

    @property
    def range_text(self) -> str:
        """The range as the error message writes it: ``[2, 16]``, ``[2, inf)``, ``(-inf, 16]``."""
        low = "(-inf" if self.lower is None else f"[{self.lower}"
        high = "inf)" if self.upper is None else f"{self.upper}]"
        return f"{low}, {high}"

    @property
    def message(self) -> str:
        """The assertion's format string (``{}`` receives the dim's value)."""
        return f"dim {self.name} = {{}} is outside its declared range {self.range_text}"

    def condition(self, var: tirx.Var) -> tvm.tirx.PrimExpr:
        """The boolean ``var`` must satisfy."""
        terms = []
        if self.lower is not None:
            terms.append(var >= self.lower)
        if self.upper is not None:
            terms.append(var <= self.upper)
        cond = terms[0]
        for term in terms[1:]:
            cond = tirx.And(cond, term)
        return cond


def _int_dict(attrs: tvm.ir.DictAttrs, key: str, func_name: str) -> dict[str, int]:
    if attrs is None or key not in attrs:
        return {}
    value = attrs[key]
    try:
        return {str(k): int(v) for k, v in value.items()}
    except (AttributeError, TypeError, ValueError) as err:
        raise ValueError(
            f"function {func_name}: attribute {key} must map dim names to integers, got {value}"
        ) from err


def declared_dim_checks(func: relax.Function, name: str = "function") -> list[DimCheck]:
    """The dims of ``func`` that :class:`CheckDimRanges` asserts on, sorted by name.

    Parameters
    ----------
    func
        A Relax function.
    name
        Its name, for error messages.

    Returns
    -------
    list[DimCheck]
        One entry per dim with a declared upper bound or a declared lower bound above 1.

    Raises
    ------
    ValueError
        When an attribute is not a map from names to integers, or a range is empty.
    """
    lower = _int_dict(func.attrs, LOWER_BOUND_ATTR, name)
    upper = _int_dict(func.attrs, UPPER_BOUND_ATTR, name)
    checks = []
    for dim in sorted(set(lower) | set(upper)):
        lo, hi = lower.get(dim), upper.get(dim)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"function {name}: dim {dim} has an empty declared range [{lo}, {hi}]")
        if hi is None and (lo is None or lo <= 1):
            continue
        checks.append(DimCheck(dim, lo, hi))
    return checks


def _definable(ty: relax.Type) -> list[tirx.Var]:
    return list(relax.analysis.definable_tir_vars_in_type(ty))


def _checks_pure(func: relax.Function) -> bool:
    """Whether the function is still checked for purity (an impure call would be ill formed)."""
    forced = func.attrs is not None and "relax.force_pure" in func.attrs
    return bool(func.is_pure) and not (forced and bool(func.attrs["relax.force_pure"]))


def _assert_binding(check: DimCheck, var: tirx.Var) -> relax.VarBinding:
    # The form LegalizeOps gives ``R.assert_op``: the pass runs after legalization, and the VM
    # runs this packed call as is (condition, format string, then the format arguments).
    call = relax.Call(
        relax.ExternFunc(ASSERT_FUNC),
        [
            relax.prim_value(check.condition(var)),
            tvm.ir.StringImm(check.message),
            relax.prim_value(var),
        ],
        ty_args=[relax.TupleType([])],
    )
    # A hand-built call has no type until normalized; well-formedness needs one.
    call = relax.BlockBuilder().normalize(call)
    return relax.VarBinding(relax.Var(f"check_{check.name}", call.ty), call)


def _with_checks(
    func: relax.Function, checks: Sequence[DimCheck]
) -> tuple[relax.Function, list[str]] | None:
    """``func`` with its assertions inserted, and the names checked; ``None`` when none."""
    wanted: dict[str, DimCheck] = {c.name: c for c in checks}
    placed: list[str] = []

    entry: list[relax.Binding] = []
    for param in func.params:
        for var in _definable(param.ty):
            check = wanted.pop(var.name, None)
            if check is not None:
                entry.append(_assert_binding(check, var))
                placed.append(check.name)

    body = func.body
    blocks: list[relax.BindingBlock] = []
    for block in body.blocks:
        if not wanted or isinstance(block, relax.DataflowBlock):
            # Dims matched in a dataflow block cannot be asserted there (an impure call).
            blocks.append(block)
            continue
        bindings: list[relax.Binding] = []
        for binding in block.bindings:
            bindings.append(binding)
            if not isinstance(binding, relax.MatchCast):
                continue
            for var in _definable(binding.ty):
                check = wanted.pop(var.name, None)
                if check is not None:
                    bindings.append(_assert_binding(check, var))
                    placed.append(check.name)
        blocks.append(relax.BindingBlock(bindings))
    if not placed:
        return None
    if entry:
        blocks.insert(0, relax.BindingBlock(entry))
    new_body = relax.SeqExpr(blocks, body.body)
    new_func = relax.Function(
        func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span
    )
    # A hand-built body has no type until normalized.
    return relax.BlockBuilder().normalize(new_func), placed


@tvm.transform.module_pass(opt_level=0, name="CheckDimRanges")
class CheckDimRanges:
    """Assert, before any kernel runs, that every bounded symbolic dim is inside its range.

    Parameters
    ----------
    options
        A :class:`DimRangeOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.checked`` maps each transformed function's name to the
    names of the dims it checks, and ``pass_obj.last_result`` is a
    :class:`~blade_relax.transform.result.PassResult` (no byte figures: the checks allocate
    nothing, so the peak is unchanged).
    """

    def __init__(self, options: DimRangeOptions | None = None) -> None:
        if options is not None and not isinstance(options, DimRangeOptions):
            raise TypeError(f"CheckDimRanges expects DimRangeOptions, got {type(options).__name__}")
        self.options = options or DimRangeOptions()
        self.checked: dict[str, tuple[str, ...]] = {}
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.options.enabled:
            publish(self, PassResult("CheckDimRanges", notes=("disabled by its options",)))
            return mod
        builder: relax.BlockBuilder | None = None
        results: list[FunctionResult] = []
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            name = gv.name_hint
            left_alone = FunctionResult(name, False)  # declares no range
            if func.attrs is None:
                results.append(left_alone)
                continue
            if self.options.functions is not None and name not in self.options.functions:
                results.append(FunctionResult(name, False, notes=("not in options.functions",)))
                continue
            if CHECKED_DIMS_ATTR in func.attrs:
                results.append(FunctionResult(name, False, notes=("already checked",)))
                continue
            checks = declared_dim_checks(func, name)
            if not checks:
                results.append(left_alone)
                continue
            if _checks_pure(func):
                warnings.warn(
                    f"CheckDimRanges: function {name} is still checked for purity; the pass "
                    "must run after RemovePurityChecking. Its dims are not checked.",
                    stacklevel=2,
                )
                results.append(
                    FunctionResult(name, False, notes=("still checked for purity: too early",))
                )
                continue
            result = _with_checks(func, checks)
            if result is None:
                results.append(
                    FunctionResult(
                        name, False, notes=("no bounded dim is defined where it can be checked",)
                    )
                )
                continue
            new_func, placed = result
            builder = builder or relax.BlockBuilder(mod)
            builder.update_func(gv, new_func.with_attr(CHECKED_DIMS_ATTR, placed))
            self.checked[name] = tuple(placed)
            phrase = f"{counted(len(placed), 'dim')} checked ({', '.join(placed)})"
            results.append(FunctionResult(name, True, (phrase,)))
        publish(self, PassResult("CheckDimRanges", tuple(results)))
        return mod if builder is None else builder.get()

"""``SpecializeBuckets``: one static copy of a function per length bucket.

Why static copies
-----------------
TVM's ``RewriteCUDAGraph`` captures only regions whose tensors live in storages of constant
size (``IsStaticAllocStorage``); a function planned for a symbolic length ``s`` -- by our
``PlanMemory``, which sizes each storage by the symbolic bytes it holds -- has none, so nothing
of it would be captured. Stock TVM can capture a symbolic ``s`` only with every storage planned
at the upper bound (``tir_var_upper_bound`` with ``StaticPlanBlockMemory``) and the hint
``relax.rewrite_cuda_graph.capture_symbolic_vars``: every length then pays the upper bound's
memory and runs kernels compiled for a symbolic length. Here instead each bucket length ``L``
gets a copy of the function with ``s`` bound to ``L`` (named
:func:`~blade_relax.contract.bucket_function_name`, e.g. ``main_s64``), planned by our planner
like any static function, with kernels specialized to ``L``. All copies live in one module, so
``RewriteCUDAGraph`` merges their static storages into one pool (see
:mod:`blade_relax.analysis.cuda_graph_pool`): sized by the largest bucket, shared by all.

:func:`blade_relax.gpuprog.buckets.compile_buckets` builds such a module in one ``tvm.compile``
with a whole pipeline and reports the pool; this pass only makes the copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax

from ..contract import LENGTH_BUCKET_ATTR, LOWER_BOUND_ATTR, UPPER_BOUND_ATTR, bucket_function_name
from .result import FunctionResult, PassResult, publish

__all__ = ["SpecializeBuckets", "length_axes"]


def _bound(func: relax.Function, key: str, dim: str) -> int | None:
    attrs = func.attrs
    if attrs is None or key not in attrs:
        return None
    bounds = {str(k): int(v) for k, v in attrs[key].items()}
    return bounds.get(dim)


def _has_dim(func: relax.Function, dim: str) -> bool:
    return any(v.name == dim for v in relax.analysis.defined_symbolic_vars(func))


def _static_copy(func: relax.Function, name: str, function: str, dim: str, length: int):
    """``func`` with ``dim`` bound to ``length``, fresh variables, no dim bounds, named
    ``name``."""
    bound = func.bind_symbolic_vars({dim: tvm.tirx.IntImm("int64", length)})
    for key in (UPPER_BOUND_ATTR, LOWER_BOUND_ATTR):
        if bound.attrs is not None and key in bound.attrs:
            bound = bound.without_attr(key)
    copy = relax.utils.copy_with_new_vars(bound)
    copy = copy.with_attr("global_symbol", name)
    return copy.with_attr(LENGTH_BUCKET_ATTR, {"of": function, dim: length})


@tvm.transform.module_pass(opt_level=0, name="SpecializeBuckets")
class SpecializeBuckets:
    """Replace ``function`` by one static copy per bucket length of its symbolic ``dim``.

    Parameters
    ----------
    dim
        The symbolic dim (``"s"``).
    lengths
        The bucket lengths, each within the function's declared range of ``dim``.
    function
        The function to specialize.
    keep_original
        Keep ``function`` itself too (its storages then join a CUDA-graph pool when static).

    ``pass_obj.last_result`` is a :class:`~blade_relax.transform.result.PassResult` with the
    function's result (its copies' names in ``changes``; no byte figures: each copy's peak is
    the function's at that length, which only memory planning, later, decides).

    Raises
    ------
    ValueError
        When the module has no such function or dim, or a length is outside the declared range.
    """

    def __init__(
        self, dim: str, lengths: Sequence[int], function: str = "main", keep_original: bool = False
    ) -> None:
        if not lengths:
            raise ValueError("SpecializeBuckets needs at least one bucket length")
        self.dim = dim
        self.lengths = tuple(sorted({int(n) for n in lengths}))
        self.function = function
        self.keep_original = keep_original
        self.last_result: PassResult | None = None

    def _check(self, func: relax.Function) -> None:
        if not _has_dim(func, self.dim):
            raise ValueError(f"function {self.function} has no symbolic dim {self.dim!r}")
        lower = _bound(func, LOWER_BOUND_ATTR, self.dim) or 1
        upper = _bound(func, UPPER_BOUND_ATTR, self.dim)
        for length in self.lengths:
            if length < lower or (upper is not None and length > upper):
                raise ValueError(
                    f"bucket {self.dim}={length} is outside the range {self.function} declares "
                    f"for {self.dim}: [{lower}, {upper if upper is not None else 'unbounded'}]"
                )

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = {gv.name_hint: gv for gv in mod.get_global_vars()}
        if self.function not in names:
            raise ValueError(f"the module has no function {self.function!r}")
        func = mod[names[self.function]]
        self._check(func)
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        if not self.keep_original:
            del out[names[self.function]]
        copies = []
        for length in self.lengths:
            name = bucket_function_name(self.function, self.dim, length)
            out[name] = _static_copy(func, name, self.function, self.dim, length)
            copies.append(name)
        result = FunctionResult(self.function, True, changes=tuple(copies))
        publish(self, PassResult("SpecializeBuckets", (result,)))
        return out


def length_axes(ty: relax.Type, dim: str) -> list[int | None]:
    """For each tensor of a (possibly nested tuple) type, the axis sized by ``dim``
    (``None``: no axis is)."""
    if isinstance(ty, relax.TupleType):
        return [axis for field in ty.fields for axis in length_axes(field, dim)]
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None) or []
    for axis, value in enumerate(values):
        if isinstance(value, tvm.tirx.Var) and value.name == dim:
            return [axis]
    return [None]

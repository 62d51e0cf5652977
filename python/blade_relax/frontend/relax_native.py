"""Training steps for Relax-native models, through Relax's own ``relax.transform.Gradient``.

Where it works: a forward function whose body is one dataflow block returning a scalar loss,
built from operators that have registered gradients (``matmul``, ``add``, ``relu``, ``tanh``,
``log_softmax``, ``sum``, ...), with a symbolic batch or token count. Where it does not (TVM 0.27):
``mean`` over a symbolic axis, imported Hugging Face graphs whose ``reshape``/``broadcast_to``
take symbolic shape expressions, and operators without gradients (``rsqrt``,
``strided_slice``, ...); use :func:`blade_relax.frontend.import_training_step` for those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
from tvm import relax

from .imported import DimRange, ImportedGraph, set_dim_bounds

__all__ = ["relax_training_step"]


def _flatten_result(func: relax.Function) -> relax.Function:
    """Rewrite a ``(loss, (g0, g1, ...))`` result into ``(loss, g0, g1, ...)``."""
    body = func.body
    ret = body.body
    bindings: list[relax.Binding] = []
    leaves: list[relax.Var] = []

    def visit(expr: relax.Expr, ty: relax.Type, path: str) -> None:
        if isinstance(ty, relax.TupleType):
            for i, field_ty in enumerate(ty.fields):
                var = relax.Var(f"out{path}_{i}", field_ty)
                bindings.append(relax.VarBinding(var, relax.TupleGetItem(expr, i)))
                visit(var, field_ty, f"{path}_{i}")
        else:
            leaves.append(expr)

    visit(ret, ret.ty, "")
    out = relax.Var("outputs", relax.TupleType([leaf.ty for leaf in leaves]))
    bindings.append(relax.VarBinding(out, relax.Tuple(leaves)))
    new_body = relax.SeqExpr([*body.blocks, relax.BindingBlock(bindings)], out)
    new_func = relax.Function(func.params, new_body, out.ty, func.is_pure, func.attrs)
    return relax.BlockBuilder().normalize(new_func)


def _dim_range(name: str, value: DimRange | tuple[int, int | None]) -> DimRange:
    if isinstance(value, DimRange):
        return value
    lower, upper = value
    return DimRange(name, int(lower), None if upper is None else int(upper))


def relax_training_step(
    mod: tvm.IRModule,
    *,
    params: Sequence[np.ndarray],
    num_input: int,
    dims: Mapping[str, DimRange | tuple[int, int | None]],
    func_name: str = "main",
    input_names: Sequence[str] | None = None,
    param_names: Sequence[str] | None = None,
    keep_upper_bound: bool = True,
    reference: Callable[[Sequence[np.ndarray]], list[np.ndarray]] | None = None,
    int_input_high: int | None = None,
    deduplicate: bool = True,
) -> ImportedGraph:
    """Differentiate a Relax forward function that returns a scalar loss.

    Parameters
    ----------
    mod
        A module whose ``func_name`` takes ``num_input`` inputs, then the parameters, and
        returns a scalar loss.
    params
        Arrays of the parameters, in order.
    num_input
        How many leading parameters of the function are inputs (no gradient).
    dims
        Range of each symbolic dim, e.g. ``{"s": (1, 2048)}``; the upper bounds become
        ``tir_var_upper_bound`` when ``keep_upper_bound``.
    input_names, param_names
        Defaults to the Relax parameter names.
    reference
        Computes ``[loss, *gradients]`` from the numpy inputs (e.g. the same model in torch).
    int_input_high
        Exclusive bound for generated integer inputs.
    deduplicate
        Compute the forward pass once. ``Gradient`` (TVM 0.27) re-emits every forward binding
        that no ``start_checkpoint`` / ``end_checkpoint`` marks as kept, as a ``_cp`` copy the
        backward reads, so without checkpoint marks the adjoint computes the whole forward pass
        twice (the first time for the loss alone). TVM's ``EliminateCommonSubexpr`` and
        ``DeadCodeElimination`` merge each copy with its original; what to keep and what to
        recompute is then the memory passes' decision (``Rematerialize`` under a budget), not
        an accident of differentiation. Off: the adjoint as ``Gradient`` wrote it.

    Returns
    -------
    ImportedGraph
        ``main(*inputs, *params) -> (loss, grad_0, ..., grad_{n-1})``.
    """
    func = mod[func_name]
    weights = list(func.params[num_input:])
    if len(weights) != len(params):
        raise ValueError(f"{func_name} has {len(weights)} parameters, got {len(params)} arrays")
    grads = relax.transform.Gradient(func_name, require_grads=weights)(mod)
    adjoint = grads[f"{func_name}_adjoint"].with_attr("global_symbol", "main")
    adjoint = _flatten_result(adjoint).with_attr("num_input", num_input)
    out = tvm.IRModule({"main": adjoint})
    if deduplicate:
        out = relax.transform.EliminateCommonSubexpr()(out)
        out = relax.transform.DeadCodeElimination(["main"])(out)
    ranges = {name: _dim_range(name, value) for name, value in dims.items()}
    uppers = {n: d.upper for n, d in ranges.items() if d.upper is not None}
    lowers = {n: d.lower for n, d in ranges.items()}
    out = set_dim_bounds(out, upper=uppers if keep_upper_bound else {}, lower=lowers)
    inputs = list(func.params[:num_input])
    names = list(param_names) if param_names is not None else [p.name for p in weights]
    shapes = [
        tuple(v.name if isinstance(v, tvm.tirx.Var) else int(v) for v in p.ty.shape.values)
        for p in inputs
    ]
    return ImportedGraph(
        mod=out,
        params=[np.asarray(p) for p in params],
        input_names=list(input_names) if input_names is not None else [p.name for p in inputs],
        param_names=names,
        output_names=["loss"] + [f"grad:{n}" for n in names],
        input_shapes=shapes,
        input_dtypes=[str(p.ty.dtype) for p in inputs],
        dims=ranges,
        kind="training",
        reference=reference,
        int_input_high=int_input_high,
    )

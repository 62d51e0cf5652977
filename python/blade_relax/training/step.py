"""The whole training step as one Relax function: forward, backward and the optimizer update.

:func:`build_training_step` turns a training graph, ``main(*inputs, *params) -> (loss, *grads)``
(from :func:`blade_relax.frontend.import_training_step` or
:func:`blade_relax.frontend.relax_training_step`), into

``main(*inputs, *params, *frozen, *states, scalars) -> (loss, *params, *states)``

where each trainable parameter and its optimizer state are updated in place (``call_tir_inplace`` of the
optimizer's kernel: the returned tensors *are* the caller's buffers) and ``scalars`` carries the
per-step hyperparameters (:meth:`InPlaceOptimizer.scalars`). The updates are appended to the
dataflow block that computes the gradients, so ``MemoryAwareSchedule`` can move each one next to
the kernel that produces its gradient, after the last reader of the parameter: the gradient dies
as soon as it is applied, and the step's peak is the forward/backward peak plus about one
gradient, not plus all of them. Frozen parameters (``ImportedGraph.num_frozen``: a LoRA model's
base weights) are read where they are, never copied, and have no state and no update.

Where it works: the gradients are computed in dataflow blocks (and pure binding blocks, merged
into one dataflow block). A graph with anything else (control flow, impure calls) gets its
updates in a block of their own after the graph, which is correct but keeps every gradient
alive until the updates run (a :class:`~blade_relax.transform.PassFallbackWarning` says so).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..frontend.imported import ImportedGraph
from ..transform import warn_fallback
from .optimizers import InPlaceOptimizer

__all__ = ["TrainingStep", "build_training_step"]


@dataclass
class TrainingStep:
    """A compiled-once training step's IR and how to call it.

    Attributes
    ----------
    mod
        ``main(*inputs, *params, *frozen, *states, scalars) -> (loss, *params, *states)``:
        ``params`` the trainable parameters, ``frozen`` the frozen ones.
    graph
        The training graph it was built from (inputs, parameter names, dims, reference).
    optimizer
        The optimizer whose updates it contains.
    state_names
        ``"<state>:<parameter>"`` for every state tensor, in argument order.
    fused
        Whether the updates share the gradients' dataflow block (each gradient can die as soon
        as it is applied); ``False`` when the graph's blocks could not be merged.
    """

    mod: tvm.IRModule
    graph: ImportedGraph
    optimizer: InPlaceOptimizer
    state_names: list[str]
    fused: bool

    @property
    def num_inputs(self) -> int:
        return len(self.graph.input_names)

    @property
    def num_params(self) -> int:
        """All parameters the step takes, trainable and frozen."""
        return len(self.graph.param_names)

    def initial_state(self) -> list[np.ndarray]:
        """The zero optimizer state for :attr:`graph`'s trainable parameters."""
        return self.optimizer.initial_state(self.graph.params[: self.graph.num_trainable])


def _identifier(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _result_fields(func: relax.Function) -> list[relax.Expr]:
    """The fields of the function's result tuple, looking through a bound ``Tuple``."""
    ret = func.body.body
    if isinstance(ret, relax.Tuple):
        return list(ret.fields)
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var.same_as(ret) and isinstance(binding.value, relax.Tuple):
                return list(binding.value.fields)
    ty = ret.ty
    if not isinstance(ty, relax.TupleType):
        raise ValueError("a training graph returns a tuple (loss, *gradients)")
    return [relax.TupleGetItem(ret, i) for i in range(len(ty.fields))]


def _mergeable(func: relax.Function) -> str | None:
    """Why the blocks of ``func`` cannot become one dataflow block (``None`` when they can)."""
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            continue
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, (relax.If, relax.Function)):
                return f"{type(value).__name__} in binding {binding.var.name}"
            if isinstance(value, relax.Call) and relax.analysis.contains_impure_call(value):
                return f"impure call in binding {binding.var.name}"
    return None


def build_training_step(graph: ImportedGraph, optimizer: InPlaceOptimizer) -> TrainingStep:
    """Append ``optimizer``'s in-place updates to a training graph.

    Parameters
    ----------
    graph
        A training graph: ``main(*inputs, *params) -> (loss, grad_0, ..., grad_{n-1})``.
    optimizer
        :class:`~blade_relax.training.SGD` or :class:`~blade_relax.training.AdamW`.

    Returns
    -------
    TrainingStep

    Raises
    ------
    ValueError
        When ``graph`` is not a training graph, or a gradient's type differs from its
        parameter's.
    """
    if not isinstance(optimizer, InPlaceOptimizer):
        raise TypeError(
            f"optimizer must be an in-place optimizer (SGD, AdamW), not {type(optimizer).__name__}"
        )
    if graph.kind != "training":
        raise ValueError(f"a training step needs a training graph, not a {graph.kind!r} graph")
    func = graph.main
    n_in, n_param = len(graph.input_names), len(graph.param_names)
    n_train = graph.num_trainable
    if len(func.params) != n_in + n_param:
        raise ValueError(
            f"main takes {len(func.params)} arguments; the graph names {n_in} inputs and "
            f"{n_param} parameters"
        )
    fields = _result_fields(func)
    if len(fields) != 1 + n_train:
        raise ValueError(
            f"main returns {len(fields)} values; a training graph returns the loss and "
            f"{n_train} gradients"
        )
    inputs = list(func.params[:n_in])
    params = list(func.params[n_in : n_in + n_train])
    frozen = list(func.params[n_in + n_train :])
    for name, param, grad in zip(graph.trainable_names, params, fields[1:]):
        if not tvm_ffi.structural_equal(param.ty, grad.ty):
            raise ValueError(f"the gradient of {name} has type {grad.ty}, its parameter {param.ty}")

    state_names = [f"{s}:{p}" for p in graph.trainable_names for s in optimizer.state_names]
    state_vars = [
        relax.Var(_identifier(f"{p.name}_{s}"), p.ty) for p in params for s in optimizer.state_names
    ]
    scalars = relax.Var("optimizer_scalars", relax.TensorType((optimizer.num_scalars,), "float32"))
    why = _mergeable(func)
    bb = relax.BlockBuilder()
    signature = [*inputs, *params, *frozen, *state_vars, scalars]
    with bb.function("main", signature, pure=func.is_pure):
        if why is not None:
            warn_fallback(
                "build_training_step",
                "merging the gradients' blocks with the updates",
                "main",
                ValueError(why),
            )
            fields = _emit_blocks(bb, func, fields)
        with bb.dataflow():
            if why is None:  # one block: each update can move next to its gradient
                for block in func.body.blocks:
                    for binding in block.bindings:
                        bb.emit_normalized(binding)
            loss, new_params, new_states = _emit_updates(
                bb, optimizer, fields, params, state_vars, scalars
            )
            out = bb.emit_output(relax.Tuple([loss, *new_params, *new_states]))
        bb.emit_func_output(out)
    mod = bb.get()
    step = mod["main"]
    for key, value in {**(func.attrs or {}), "num_input": n_in}.items():
        step = step.with_attr(key, value)
    mod["main"] = step  # with the graph's attributes: dim ranges, num_input
    return TrainingStep(mod, graph, optimizer, state_names, fused=why is None)


def _emit_blocks(
    bb: relax.BlockBuilder, func: relax.Function, fields: Sequence[relax.Expr]
) -> list[relax.Expr]:
    """Emit ``func``'s blocks as they are; the result fields, readable after the blocks
    (DataflowVars cannot leave their block: those the updates read are exported)."""
    fields = list(fields)
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            for binding in block.bindings:
                bb.emit_normalized(binding)
            continue
        with bb.dataflow():
            for binding in block.bindings:
                bb.emit_normalized(binding)
            defined = {b.var for b in block.bindings}
            exported: dict[relax.Expr, relax.Expr] = {}
            for f in fields:
                if isinstance(f, relax.DataflowVar) and f in defined and f not in exported:
                    exported[f] = bb.emit_output(f)
        fields = [exported.get(f, f) for f in fields]
    return fields


def _emit_updates(
    bb: relax.BlockBuilder,
    optimizer: InPlaceOptimizer,
    fields: Sequence[relax.Expr],
    params: Sequence[relax.Var],
    state_vars: Sequence[relax.Var],
    scalars: relax.Var,
) -> tuple[relax.Expr, list[relax.Var], list[relax.Var]]:
    n_state = len(optimizer.state_names)
    new_params: list[relax.Var] = []
    new_states: list[relax.Var] = []
    for i, (param, grad) in enumerate(zip(params, fields[1:])):
        states = list(state_vars[i * n_state : (i + 1) * n_state])
        new_p, new_s = optimizer.emit_update(
            bb, param, grad, states, scalars, _identifier(param.name)
        )
        new_params.append(new_p)
        new_states.extend(new_s)
    return fields[0], new_params, new_states

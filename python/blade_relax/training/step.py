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

from ..contract import GATHER_PARAMETER, REDUCE_GRADIENT
from ..frontend.imported import ImportedGraph
from ..transform import warn_fallback
from .optimizers import InPlaceOptimizer
from .sharding import ZeroSharding

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
    sharding
        With data parallelism, how the optimizer state is sharded: the step then takes two
        more inputs after ``scalars``, ``grad_weight`` (a float, this rank's share of the
        loss) and ``shard_rank`` (``int64``, shape ``(1,)``), and each state tensor is this
        rank's block of rows (:mod:`.sharding`).
    """

    mod: tvm.IRModule
    graph: ImportedGraph
    optimizer: InPlaceOptimizer
    state_names: list[str]
    fused: bool
    sharding: ZeroSharding | None = None

    @property
    def num_inputs(self) -> int:
        return len(self.graph.input_names)

    @property
    def num_params(self) -> int:
        """All parameters the step takes, trainable and frozen."""
        return len(self.graph.param_names)

    def initial_state(self) -> list[np.ndarray]:
        """The zero optimizer state for :attr:`graph`'s trainable parameters (one rank's
        blocks with :attr:`sharding`: zeros too, the same on every rank)."""
        params = self.graph.params[: self.graph.num_trainable]
        if self.sharding is not None:
            params = [np.zeros(self.sharding.state_shape(p.shape), p.dtype) for p in params]
        return self.optimizer.initial_state(params)


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


def build_training_step(
    graph: ImportedGraph, optimizer: InPlaceOptimizer, sharding: ZeroSharding | None = None
) -> TrainingStep:
    """Append ``optimizer``'s in-place updates to a training graph.

    Parameters
    ----------
    graph
        A training graph: ``main(*inputs, *params) -> (loss, grad_0, ..., grad_{n-1})``.
    optimizer
        :class:`~blade_relax.training.SGD` or :class:`~blade_relax.training.AdamW`.
    sharding
        Data parallelism with sharded optimizer state (:mod:`.sharding`): each gradient is
        reduce-scattered before its update and each parameter all-gathered after it.

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
        relax.Var(_identifier(f"{p.name}_{s}"), _state_type(p, sharding))
        for p in params
        for s in optimizer.state_names
    ]
    scalars = relax.Var("optimizer_scalars", relax.TensorType((optimizer.num_scalars,), "float32"))
    shard_args = _shard_inputs() if sharding is not None else []
    why = _mergeable(func)
    bb = relax.BlockBuilder()
    signature = [*inputs, *params, *frozen, *state_vars, scalars, *shard_args]
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
                bb, optimizer, fields, params, state_vars, scalars, shard_args
            )
            out = bb.emit_output(relax.Tuple([loss, *new_params, *new_states]))
        bb.emit_func_output(out)
    mod = bb.get()
    step = mod["main"]
    for key, value in {**(func.attrs or {}), "num_input": n_in}.items():
        step = step.with_attr(key, value)
    mod["main"] = step  # with the graph's attributes: dim ranges, num_input
    return TrainingStep(mod, graph, optimizer, state_names, fused=why is None, sharding=sharding)


def _state_type(param: relax.Var, sharding: ZeroSharding | None) -> relax.TensorType:
    """The type of one state tensor of ``param``: the parameter's, or one rank's block."""
    if sharding is None:
        return param.ty
    shape = [int(d) for d in param.ty.shape.values]
    return relax.TensorType(sharding.state_shape(shape), param.ty.dtype)


def _shard_inputs() -> list[relax.Var]:
    """The inputs a sharded step takes after the scalars: this rank's share of the loss and
    its rank (a tensor, so that every rank runs the same program)."""
    weight = relax.Var("grad_weight", tvm.ir.PrimType("float32"))
    rank = relax.Var("shard_rank", relax.TensorType((1,), "int64"))
    return [weight, rank]


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
    shard_args: Sequence[relax.Var] = (),
) -> tuple[relax.Expr, list[relax.Var], list[relax.Var]]:
    n_state = len(optimizer.state_names)
    new_params: list[relax.Var] = []
    new_states: list[relax.Var] = []
    for i, (param, grad) in enumerate(zip(params, fields[1:])):
        states = list(state_vars[i * n_state : (i + 1) * n_state])
        name = _identifier(param.name)
        if shard_args:
            new_p, new_s = _emit_sharded_update(
                bb, optimizer, param, grad, states, scalars, shard_args, name
            )
        else:
            new_p, new_s = optimizer.emit_update(bb, param, grad, states, scalars, name)
        new_params.append(new_p)
        new_states.extend(new_s)
    return fields[0], new_params, new_states


def _emit_sharded_update(
    bb: relax.BlockBuilder,
    optimizer: InPlaceOptimizer,
    param: relax.Var,
    grad: relax.Expr,
    states: Sequence[relax.Var],
    scalars: relax.Var,
    shard_args: Sequence[relax.Var],
    name: str,
) -> tuple[relax.Var, list[relax.Var]]:
    """Reduce-scatter ``grad``, update this rank's rows of ``param``, all-gather ``param``
    (each in place: the gradient's own rows receive the reduction)."""
    weight, rank = shard_args
    reduced = bb.emit(
        relax.op.call_inplace_packed(
            REDUCE_GRADIENT, grad, weight, inplace_indices=[0], ty_args=[grad.ty]
        ),
        name_hint=f"{name}_grad_reduced",
    )
    updated, new_states = optimizer.emit_update(
        bb, param, reduced, states, scalars, name, shard_rank=rank
    )
    gathered = bb.emit(
        relax.op.call_inplace_packed(
            GATHER_PARAMETER, updated, inplace_indices=[0], ty_args=[param.ty]
        ),
        name_hint=f"{name}_gathered",
    )
    return gathered, new_states

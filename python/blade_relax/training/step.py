"""The whole training step as one Relax function: forward, backward and the optimizer update.

:func:`build_training_step` turns a training graph, ``main(*inputs, *params) -> (loss, *grads)``
(from :func:`blade_relax.frontend.import_training_step` or
:func:`blade_relax.frontend.relax_training_step`), into

``main(*inputs, *params, *frozen, *states, scalars) -> (loss, *params, *states)``

where each trainable parameter and its optimizer state are updated in place (``call_tir_inplace`` of the
optimizer's kernel: the returned tensors *are* the caller's buffers) and ``scalars`` carries the
per-step hyperparameters (:meth:`InPlaceOptimizer.scalars`). The updates join the dataflow
block that computes the gradients, at its end (``updates="end"``, where ``MemoryAwareSchedule``
may move them: in the steps measured it never did, so every gradient lives until the end of the
backward pass) or each where it may first run (``updates="early"``, :func:`update_points`:
after the binding that produces its gradient and after the last reader of its parameter), so
that the gradient dies as soon as it is applied. Frozen parameters (``ImportedGraph.num_frozen``: a LoRA model's
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

__all__ = ["TrainingStep", "build_training_step", "update_points"]


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
    updates
        Where the updates stand (:data:`UPDATE_PLACEMENTS`).
    """

    mod: tvm.IRModule
    graph: ImportedGraph
    optimizer: InPlaceOptimizer
    state_names: list[str]
    fused: bool
    sharding: ZeroSharding | None = None
    updates: str = "end"

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


def _sources(func: relax.Function, fields: Sequence[relax.Expr]) -> list[relax.Expr]:
    """``fields`` with aliases and items of the tuples ``func`` builds followed to the values
    they name (a graph often returns its gradients as items of a tuple built at the very end;
    the updates read the gradients where they are computed)."""
    values = {
        b.var: b.value
        for block in func.body.blocks
        for b in block.bindings
        if not isinstance(b, relax.MatchCast)
    }

    def source(expr: relax.Expr) -> relax.Expr:
        while True:
            if isinstance(expr, relax.TupleGetItem):
                tup = source(expr.tuple_value)
                if not isinstance(tup, relax.Tuple):
                    return expr
                expr = tup.fields[expr.index]
            elif isinstance(expr, relax.Var) and isinstance(
                values.get(expr), relax.Var | relax.TupleGetItem | relax.Tuple
            ):
                expr = values[expr]
            else:
                return expr

    resolved = [source(f) for f in fields]
    return [r if not isinstance(r, relax.Tuple) else f for r, f in zip(resolved, fields)]


def _needed_bindings(func: relax.Function, fields: Sequence[relax.Expr]) -> list[relax.Binding]:
    """The bindings of ``func``'s blocks that ``fields`` depend on, in order (the graph's own
    result tuple and the plumbing that built it from the gradients are not: the step returns
    a tuple of its own). All are pure: the blocks are dataflow blocks, or mergeable into one."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    needed = {v for f in fields for v in relax.analysis.free_vars(f)}
    needed |= {f for f in fields if isinstance(f, relax.Var)}
    kept = []
    for binding in reversed(bindings):
        # A match_cast may define symbolic variables later types use: always kept.
        if binding.var in needed or isinstance(binding, relax.MatchCast):
            kept.append(binding)
            needed.update(relax.analysis.free_vars(binding.value))
    return kept[::-1]


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


#: Where :func:`build_training_step` places the updates: ``"end"``, after the backward pass;
#: ``"early"``, each where it may first run (:func:`update_points`).
UPDATE_PLACEMENTS = ("end", "early")


def build_training_step(
    graph: ImportedGraph,
    optimizer: InPlaceOptimizer,
    sharding: ZeroSharding | None = None,
    *,
    updates: str = "end",
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
    updates
        ``"end"`` (default): the updates follow the backward pass, and ``MemoryAwareSchedule``
        may move them. ``"early"``: each update stands where it may first run
        (:func:`update_points`), so each gradient dies as soon as it is applied; far lower
        peaks where the gradients dominate (large models, short sequences: at Llama-2 7B's
        shape each layer's gradients are 0.81 GB), but at long sequences the writes between
        the forward and backward readers of a value can stop ``RecomputeCheapValues`` from
        recomputing it, and the peak can rise (docs/distributed.md has both, measured).

    Returns
    -------
    TrainingStep

    Raises
    ------
    ValueError
        When ``graph`` is not a training graph, or a gradient's type differs from its
        parameter's.
    """
    fields = _checked_fields(graph, optimizer, updates)
    func = graph.main
    n_in, n_train = len(graph.input_names), graph.num_trainable
    inputs = list(func.params[:n_in])
    params = list(func.params[n_in : n_in + n_train])
    frozen = list(func.params[n_in + n_train :])
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
            if why is None:  # one block: each update runs as soon as it may
                fields = _sources(func, fields)
                bindings = _needed_bindings(func, fields)
                if updates == "early":
                    points = update_points(bindings, params, fields[1:], graph.mod)
                else:
                    points = [len(bindings) - 1] * len(params)
            else:  # after the blocks, all of them
                bindings, points = [], [-1] * len(params)
            after: dict[int, list[int]] = {}
            for k, point in enumerate(points):
                after.setdefault(point, []).append(k)
            emitter = _UpdateEmitter(bb, optimizer, fields, params, state_vars, scalars, shard_args)
            emitter.emit(after.get(-1, []))
            for j, binding in enumerate(bindings):
                bb.emit_normalized(binding)
                emitter.emit(after.get(j, []))
            loss, new_params, new_states = emitter.results()
            out = bb.emit_output(relax.Tuple([loss, *new_params, *new_states]))
        bb.emit_func_output(out)
    mod = _with_graph_parts(bb.get(), graph)
    return TrainingStep(
        mod, graph, optimizer, state_names, fused=why is None, sharding=sharding, updates=updates
    )


def _checked_fields(
    graph: ImportedGraph, optimizer: InPlaceOptimizer, updates: str
) -> list[relax.Expr]:
    """The fields of ``graph``'s result (loss, gradients), once the arguments of
    :func:`build_training_step` are checked (its errors)."""
    if not isinstance(optimizer, InPlaceOptimizer):
        raise TypeError(
            f"optimizer must be an in-place optimizer (SGD, AdamW), not {type(optimizer).__name__}"
        )
    if updates not in UPDATE_PLACEMENTS:
        raise ValueError(f"updates must be one of {UPDATE_PLACEMENTS}, not {updates!r}")
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
    params = func.params[n_in : n_in + n_train]
    for name, param, grad in zip(graph.trainable_names, params, fields[1:]):
        if not tvm_ffi.structural_equal(param.ty, grad.ty):
            raise ValueError(f"the gradient of {name} has type {grad.ty}, its parameter {param.ty}")
    return fields


def _with_graph_parts(mod: tvm.IRModule, graph: ImportedGraph) -> tvm.IRModule:
    """The step's module with the graph's own functions (kernels it calls, such as a
    mixture-of-experts layer's grouped GEMM, under the GlobalVars its bindings name) and its
    ``main``'s attributes (dim ranges) and ``num_input``."""
    names = {gv.name_hint for gv in mod.functions}
    for gv, f in graph.mod.functions.items():
        if gv.name_hint != "main" and gv.name_hint not in names:
            mod[gv] = f
    step = mod["main"]
    for key, value in {**(graph.main.attrs or {}), "num_input": len(graph.input_names)}.items():
        step = step.with_attr(key, value)
    mod["main"] = step
    return mod


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


def update_points(
    bindings: Sequence[relax.Binding],
    params: Sequence[relax.Var],
    grads: Sequence[relax.Expr],
    mod: tvm.IRModule | None = None,
) -> list[int]:
    """Per trainable parameter, the index of the binding after which its update may run first
    (``-1``: before the first binding).

    That is after the binding that computes its gradient and after the last reader of any value
    whose memory is the parameter's or the gradient's (the roots of
    :func:`blade_relax.analysis.effects.in_place_writes`: aliases, views, tuples and their
    items, reshape kernels that become views): the update writes the parameter in place, and a
    sharded step's reduction writes the gradient. Placed there, a gradient dies as soon as it
    is applied, as with PyTorch's optimizer-in-backward hooks, instead of every gradient living
    until the end of the backward pass. ``MemoryAwareSchedule`` may still move an update later
    (it keeps every in-place write after the earlier reads of the memory); nothing moves it
    earlier. ``mod`` holds the kernels the bindings call, if any.
    """
    from ..analysis.effects import in_place_writes

    memory = in_place_writes(bindings, mod)
    # Root -> the parameters whose memory (or whose gradient's) it is.
    owners: dict[relax.Var, list[int]] = {}
    # Variable -> the parameters whose gradient needs it defined: the gradient itself, or the
    # variables of one that is not a variable (an item of the graph's result).
    waiting: dict[relax.Var, list[int]] = {}
    for k, (p, g) in enumerate(zip(params, grads)):
        grad_roots = memory.roots_of(g) if isinstance(g, relax.Var) else frozenset()
        for root in memory.roots_of(p) | grad_roots:
            owners.setdefault(root, []).append(k)
        for v in [g] if isinstance(g, relax.Var) else relax.analysis.free_vars(g):
            waiting.setdefault(v, []).append(k)
    points = [-1] * len(params)
    for j, binding in enumerate(bindings):
        read = frozenset().union(
            *(memory.roots_of(v) for v in relax.analysis.free_vars(binding.value))
        )
        for k in [
            *(k for root in read for k in owners.get(root, ())),
            *waiting.get(binding.var, ()),
        ]:
            points[k] = j
    return points


class _UpdateEmitter:
    """Emits the update of each trainable parameter when asked, and gathers the results."""

    def __init__(
        self,
        bb: relax.BlockBuilder,
        optimizer: InPlaceOptimizer,
        fields: Sequence[relax.Expr],
        params: Sequence[relax.Var],
        state_vars: Sequence[relax.Var],
        scalars: relax.Var,
        shard_args: Sequence[relax.Var] = (),
    ) -> None:
        self.bb, self.optimizer, self.fields = bb, optimizer, list(fields)
        self.params, self.state_vars, self.scalars = list(params), list(state_vars), scalars
        self.shard_args = list(shard_args)
        self.new_params: dict[int, relax.Var] = {}
        self.new_states: dict[int, list[relax.Var]] = {}

    def emit(self, indices: Sequence[int]) -> None:
        """Emit the updates of the trainable parameters ``indices``, in that order."""
        n_state = len(self.optimizer.state_names)
        for k in indices:
            param, grad = self.params[k], self.fields[1 + k]
            states = self.state_vars[k * n_state : (k + 1) * n_state]
            name = _identifier(param.name)
            if self.shard_args:
                new_p, new_s = _emit_sharded_update(
                    self.bb,
                    self.optimizer,
                    param,
                    grad,
                    states,
                    self.scalars,
                    self.shard_args,
                    name,
                )
            else:
                new_p, new_s = self.optimizer.emit_update(
                    self.bb, param, grad, states, self.scalars, name
                )
            self.new_params[k], self.new_states[k] = new_p, list(new_s)

    def results(self) -> tuple[relax.Expr, list[relax.Var], list[relax.Var]]:
        """The loss, the updated parameters and the updated states, in argument order (the
        updates not emitted yet are emitted now)."""
        self.emit([k for k in range(len(self.params)) if k not in self.new_params])
        order = range(len(self.params))
        states = [s for k in order for s in self.new_states[k]]
        return self.fields[0], [self.new_params[k] for k in order], states


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

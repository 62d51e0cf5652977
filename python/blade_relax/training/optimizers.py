"""Optimizers whose update runs in place, one parameter at a time, inside the training step.

Each optimizer is a :class:`tvm.relax.training.optimizer.Optimizer` (``init`` then
``standalone_module`` give the standalone ``(params, grads, states, scalars) -> (params,
states)`` function, the counterpart of TVM's ``get_function``) and, for :func:`blade_relax.training.build_training_step`, emits the
update of one parameter as a single ``call_tir_inplace`` of an elementwise kernel that reads the
gradient and writes the parameter and its state in place.

What TVM's ``relax.training.optimizer`` (SGD, MomentumSGD, Adam) lacks, and why these exist:

* no decoupled weight decay (AdamW; TVM's Adam adds an L2 term to the gradient);
* the updates are out of place and return new tuples, so the parameters and the state exist
  twice while the function runs, and every gradient is an input, alive until the function
  returns: a step's peak would be the forward/backward peak plus all gradients plus a second
  copy of parameters and state;
* hyperparameters are compile-time constants and the bias corrections are accumulated in the
  parameter dtype (``beta ** t`` as a running float32 product); here the learning rate, the bias
  corrections and the momentum of the first step are per-step scalars computed on the host in
  float64, as ``torch.optim`` computes them, so a learning-rate schedule needs no recompilation
  and the update equals torch's to rounding;
* MomentumSGD's first step scales the gradient by ``1 - dampening``; torch's (and ours) starts
  the buffer at the gradient itself.

TVM's SGD and MomentumSGD (``dampening=0``) compute the same updates as ours; the tests use them
as a reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.training.optimizer import Optimizer

from ..contract import ELEMENTWISE_KERNEL_ATTR

__all__ = ["SGD", "AdamW", "InPlaceOptimizer", "update_kernel"]

_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def _check_positive(name: str, value: float, *, allow_zero: bool = True) -> None:
    if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class _Rule:
    """One optimizer's elementwise update, as TVMScript statements over ``p``, ``g``, the
    state buffers and the scalar buffer ``h`` (accumulation in ``acc``)."""

    name: str
    states: tuple[str, ...]
    num_scalars: int
    body: Callable[[Callable[[str], str], Callable[[str], str]], list[str]]


class InPlaceOptimizer(Optimizer):
    """Base of the in-place optimizers: the state layout, the kernels and the host scalars.

    Subclasses define :attr:`state_names` (one tensor of the parameter's shape and dtype per
    name, per parameter), :meth:`scalars` and :meth:`_rule`.
    """

    state_names: tuple[str, ...] = ()

    # ------------------------------------------------------------------ host side
    def scalars(self, step: int) -> np.ndarray:
        """The kernel's per-step scalars for step ``step`` (1-based), as float32."""
        raise NotImplementedError

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (``lr``, or ``lr_schedule(step)``)."""
        schedule = getattr(self, "lr_schedule", None)
        lr = float(schedule(step)) if schedule is not None else self.lr
        _check_positive("the learning rate", lr)
        return lr

    def initial_state(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Zero state, ``state_names`` for every parameter (parameter-major order)."""
        return [np.zeros_like(p) for p in params for _ in self.state_names]

    # ------------------------------------------------------------------ IR side
    def _rule(self) -> _Rule:
        raise NotImplementedError

    @property
    def num_scalars(self) -> int:
        return self._rule().num_scalars

    def kernel(self, ty: relax.TensorType, *, sharded: bool = False) -> tvm.tirx.PrimFunc:
        """The in-place update kernel for parameters of type ``ty`` (rank and dtype); with
        ``sharded``, the kernel that updates the rows one rank owns (:func:`update_kernel`)."""
        if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
            raise ValueError(f"an optimizer updates tensors of known rank, not {ty}")
        dtype = str(ty.dtype)
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"an optimizer updates floating-point parameters, not {dtype}")
        cache = self.__dict__.setdefault("_kernels", {})
        key = (ty.ndim, dtype, sharded)
        if key not in cache:
            cache[key] = update_kernel(self._rule(), ty.ndim, dtype, sharded=sharded)
        return cache[key]

    def emit_update(
        self,
        bb: relax.BlockBuilder,
        param: relax.Expr,
        grad: relax.Expr,
        states: Sequence[relax.Expr],
        scalars: relax.Expr,
        name: str,
        shard_rank: relax.Expr | None = None,
    ) -> tuple[relax.Var, list[relax.Var]]:
        """Emit the in-place update of one parameter; the new parameter and state variables
        (aliases of ``param`` and ``states``). The kernel is added to ``bb``'s module once per
        rank and dtype (``BlockBuilder.add_func`` returns the existing one).

        With ``shard_rank`` (an ``int64`` tensor of shape ``(1,)`` holding this process's rank),
        ``states`` are the blocks of rows this rank owns
        (:func:`blade_relax.contract.owned_rows`) and only those rows of ``param`` are updated,
        from the same rows of ``grad``.
        """
        ty = param.ty
        sharded = shard_rank is not None
        suffix = "_shard_update" if sharded else "_update"
        kernel = bb.add_func(self.kernel(ty, sharded=sharded), f"{self._rule().name}{suffix}")
        args = [param, grad, *states, scalars, *([shard_rank] if sharded else [])]
        written = [0, *range(2, 2 + len(states))]
        out_types = [ty, *(s.ty for s in states)]
        call = relax.call_tir_inplace(kernel, args, written, out_types)
        out = bb.emit(call, name_hint=f"{name}_updated")
        if not states:
            return out, []
        new_param = bb.emit(relax.TupleGetItem(out, 0), name_hint=f"{name}_new")
        new_states = [
            bb.emit(relax.TupleGetItem(out, 1 + k), name_hint=f"{name}_{s}_new")
            for k, s in enumerate(self.state_names)
        ]
        return new_param, new_states

    # ------------------------------------------------ relax.training.optimizer API
    def init(self, params: relax.Var | list[relax.Var]) -> InPlaceOptimizer:
        """Set the parameters (Relax vars) and the zero state, as TVM's optimizers do.

        The state is ``(*state of parameter 0, *state of parameter 1, ...)``, what
        :meth:`standalone_module` takes; the step counter stays on the host (the caller passes
        ``scalars(step)``).
        """
        if not isinstance(params, list):
            params = [params]
        self._set_params_and_dtype(params)
        shapes = []
        for p in params:
            values = p.ty.shape.values if hasattr(p.ty.shape, "values") else None
            if values is None or not all(isinstance(v, tvm.tirx.IntImm) for v in values):
                raise ValueError(f"parameter {p.name} needs a static shape, not {p.ty}")
            shapes.append(np.zeros([int(v) for v in values], str(p.ty.dtype)))
        self.state = tuple(tvm.runtime.tensor(s) for s in self.initial_state(shapes))
        return self

    def get_function(self) -> relax.Function:
        """Not available: the update kernels are PrimFuncs that a lone Relax function cannot
        carry, and the per-step scalars are an input. Use :meth:`standalone_module`."""
        raise NotImplementedError(
            f"{type(self).__name__} updates in place through its own kernels: use "
            "standalone_module(), whose main takes the scalars of scalars(step) as a fourth input"
        )

    def standalone_module(self) -> tvm.IRModule:
        """A module whose ``main(params, gradients, states, scalars) -> (params, states)``
        updates every parameter in place (``scalars`` from :meth:`scalars`); what
        ``get_function`` gives for TVM's optimizers, with the scalars as an input."""
        self._check_init()
        plist = self.param_list
        n_state = len(self.state_names)
        param_var = relax.Var("params", relax.TupleType([p.ty for p in plist]))
        grad_var = relax.Var("gradients", relax.TupleType([p.ty for p in plist]))
        state_tys = [p.ty for p in plist for _ in range(n_state)]
        state_var = relax.Var("optim_states", relax.TupleType(state_tys))
        scalars = relax.Var("scalars", relax.TensorType((self.num_scalars,), "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [param_var, grad_var, state_var, scalars]):
            with bb.dataflow():
                new_params, new_states = [], []
                for i, p in enumerate(plist):
                    param = bb.emit(relax.TupleGetItem(param_var, i))
                    grad = bb.emit(relax.TupleGetItem(grad_var, i))
                    states = [
                        bb.emit(relax.TupleGetItem(state_var, i * n_state + k))
                        for k in range(n_state)
                    ]
                    new_p, new_s = self.emit_update(bb, param, grad, states, scalars, p.name)
                    new_params.append(new_p)
                    new_states.extend(new_s)
                out = bb.emit_output(
                    relax.Tuple([relax.Tuple(new_params), relax.Tuple(new_states)])
                )
            bb.emit_func_output(out)
        return bb.get()


class SGD(InPlaceOptimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and L2 weight
    decay, as ``torch.optim.SGD`` computes it (the momentum buffer starts as the first
    gradient).

    Parameters
    ----------
    lr
        Learning rate.
    momentum, dampening, weight_decay, nesterov
        As for ``torch.optim.SGD``.
    lr_schedule
        Optional ``step -> learning rate`` (1-based steps); replaces ``lr``.
    """

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        lr_schedule: Callable[[int], float] | None = None,
    ) -> None:
        super().__init__("SGD")
        _check_positive("lr", float(lr))
        _check_positive("momentum", float(momentum))
        _check_positive("weight_decay", float(weight_decay))
        if not 0 <= float(dampening) <= 1:
            raise ValueError(f"dampening must lie in [0, 1], got {dampening!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.lr_schedule = lr_schedule
        self.state_names = ("momentum",) if self.momentum else ()

    def scalars(self, step: int) -> np.ndarray:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        lr = self.lr_at(step)
        # torch: the buffer is the gradient itself on the first step, then
        # buf = momentum * buf + (1 - dampening) * d_p.
        momentum, keep = (0.0, 1.0) if step == 1 else (self.momentum, 1.0 - self.dampening)
        return np.array([self.weight_decay, momentum, keep, -lr, self.momentum], np.float32)

    def _rule(self) -> _Rule:
        nesterov = self.nesterov
        has_momentum = bool(self.momentum)

        def body(at: Callable[[str], str], cast: Callable[[str], str]) -> list[str]:
            d = f"({at('g')} + h[0] * {at('p')})"
            if not has_momentum:
                return [f"{cast('p')} = {at('p')} + h[3] * {d}"]
            buf = f"(h[1] * {at('momentum')} + h[2] * {d})"
            lines = [f"{cast('momentum')} = {buf}"]
            step = f"({d} + h[4] * {at('momentum')})" if nesterov else at("momentum")
            lines.append(f"{cast('p')} = {at('p')} + h[3] * {step}")
            return lines

        name = "sgd_momentum" if has_momentum else "sgd"
        if nesterov:
            name = "sgd_nesterov"
        return _Rule(name, self.state_names, 5, body)


class AdamW(InPlaceOptimizer):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW`` computes it.

    Per step ``t`` (1-based): ``p *= 1 - lr * wd``; ``m += (1 - b1) * (g - m)``;
    ``v = b2 * v + (1 - b2) * g * g``; ``p -= lr / (1 - b1^t) * m / (sqrt(v) /
    sqrt(1 - b2^t) + eps)``. The bias corrections are computed on the host in float64.

    Parameters
    ----------
    lr, betas, eps, weight_decay
        As for ``torch.optim.AdamW`` (whose ``weight_decay`` defaults to 0.01).
    lr_schedule
        Optional ``step -> learning rate`` (1-based steps); replaces ``lr``.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        lr_schedule: Callable[[int], float] | None = None,
    ) -> None:
        super().__init__("AdamW")
        _check_positive("lr", float(lr))
        _check_positive("eps", float(eps))
        _check_positive("weight_decay", float(weight_decay))
        if len(betas) != 2 or not all(0 <= float(b) < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.lr = float(lr)
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.lr_schedule = lr_schedule

    def scalars(self, step: int) -> np.ndarray:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        lr = self.lr_at(step)
        correction1 = 1.0 - self.beta1**step
        correction2 = 1.0 - self.beta2**step
        return np.array(
            [
                1.0 - lr * self.weight_decay,
                1.0 - self.beta1,
                self.beta2,
                1.0 - self.beta2,
                -lr / correction1,
                math.sqrt(correction2),
                self.eps,
            ],
            np.float32,
        )

    def _rule(self) -> _Rule:
        # torch's lerp computes self + w * (end - self) for w < 0.5 and
        # end - (end - self) * (1 - w) otherwise.
        small_weight = 1.0 - self.beta1 < 0.5

        def body(at: Callable[[str], str], cast: Callable[[str], str]) -> list[str]:
            g, m, v = at("g"), at("exp_avg"), at("exp_avg_sq")
            if small_weight:
                m_new = f"{m} + h[1] * ({g} - {m})"
            else:
                m_new = f"{g} - ({g} - {m}) * (T.float32(1) - h[1])"
            return [
                f"{cast('exp_avg')} = {m_new}",
                f"{cast('exp_avg_sq')} = {v} * h[2] + h[3] * ({g} * {g})",
                f"{cast('p')} = {at('p')} * h[0] + h[4] * ({at('exp_avg')} / "
                f"(T.sqrt({at('exp_avg_sq')}) / h[5] + h[6]))",
            ]

        return _Rule("adamw", self.state_names, 7, body)


def update_kernel(
    rule: _Rule, ndim: int, dtype: str, *, sharded: bool = False
) -> tvm.tirx.PrimFunc:
    """The elementwise in-place kernel of ``rule`` for tensors of rank ``ndim`` and ``dtype``
    (symbolic extents): arguments ``p, g, *states, h``, writes ``p`` and the states.

    With ``sharded``, a last argument ``r`` (``int64``, shape ``(1,)``) holds the rank, the
    states have ``k`` rows (the rank's block of the leading axis, a tensor of rank 0 being one
    row) and the kernel updates rows ``r * k + i`` of ``p`` from the same rows of ``g`` and
    row ``i`` of the states, for the ``i < k`` inside ``p``. The rank is an argument, not a
    constant, so that every rank runs the same compiled program, collectives in the same
    order.

    Written as TVMScript text because the rank varies: one loop nest per rank.
    """
    from tvm.script import from_source

    dims = [f"d{k}" for k in range(ndim)]
    shape = "(" + "".join(f"{d}, " for d in dims) + ")"
    idx = ", ".join(f"v{k}" for k in range(ndim)) if ndim else ""
    state_shape, state_idx, param_idx = shape, idx, idx
    loop_dims = list(dims)
    if sharded:
        state_shape = "(" + "".join(f"{d}, " for d in ["k", *dims[1:]]) + ")"
        state_idx = ", ".join(f"v{k}" for k in range(max(ndim, 1)))
        row = "r[0] * k + v0"
        param_idx = ", ".join([row, *(f"v{k}" for k in range(1, ndim))]) if ndim else ""
        loop_dims = ["k", *dims[1:]]
    buffers = ["p", "g", *rule.states]
    acc = "float32"  # half-precision parameters are updated in float32, then rounded

    def ref(name: str) -> str:
        index = param_idx if name in ("p", "g") else state_idx
        return f"{name}[{index}]" if index else f"{name}[()]"

    def at(name: str) -> str:
        return ref(name) if dtype == acc else f"T.Cast({acc!r}, {ref(name)})"

    body = rule.body(at, ref)
    if dtype != acc:  # the value stored is computed in acc: cast it back
        body = [
            f"{lhs} = T.Cast({dtype!r}, {rhs})"
            for lhs, rhs in (line.split(" = ", 1) for line in body)
        ]
    handles = ", ".join(f"{b}_h: T.handle" for b in [*buffers, "h", *(["r"] if sharded else [])])
    lines = [
        "# from tvm.script import tirx as T",
        "@T.prim_func(private=True, s_tir=True)",
        f"def {rule.name}_{'shard_' if sharded else ''}update({handles}):",
        f'    T.func_attr({{"tir.noalias": True, "op_pattern": 8, "{ELEMENTWISE_KERNEL_ATTR}": True}})',
    ]
    lines += [f"    {d} = T.int64()" for d in [*dims, *(["k"] if sharded else [])]]
    for b in buffers:
        b_shape = state_shape if sharded and b not in ("p", "g") else shape
        lines.append(f'    {b} = T.match_buffer({b}_h, {b_shape}, "{dtype}")')
    lines.append(f'    h = T.match_buffer(h_h, (T.int64({rule.num_scalars}),), "float32")')
    if sharded:
        lines.append('    r = T.match_buffer(r_h, (T.int64(1),), "int64")')
    indent = "    "
    if loop_dims:
        loops = ", ".join(f"i{k}" for k in range(len(loop_dims)))
        lines.append(f"    for {loops} in T.grid({', '.join(loop_dims)}):")
        indent = "        "
    lines.append(f'{indent}with T.sblock("update"):')
    inner = indent + "    "
    if loop_dims:
        n = len(loop_dims)
        lines.append(
            f'{inner}{", ".join(f"v{k}" for k in range(n))} = T.axis.remap("{"S" * n}", '
            f"[{', '.join(f'i{k}' for k in range(n))}])"
        )
    if sharded:  # the rank's last block may be short: rows past the parameter's end are padding
        lines.append(f"{inner}if {'r[0] * k + v0 < d0' if ndim else 'r[0] * k + v0 < 1'}:")
        inner += "    "
    lines += [f"{inner}{line}" for line in body]
    return from_source("\n".join(lines))

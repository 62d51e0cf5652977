"""The in-place optimizers (``blade_relax.training.SGD``, ``AdamW``) on their own.

Their standalone module (``main(params, grads, states, scalars) -> (params, states)``) runs a few
steps on random tensors of several ranks and is compared with ``torch.optim`` doing the same
steps (parameters and optimizer state), and with TVM's own ``MomentumSGD``. The updates must
happen in place (the caller's tensors change and the returned tensors hold the same data), the
half-precision kernels must build and run, and bad hyperparameters must be refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from blade_relax.training import SGD, AdamW

SHAPES = [(5,), (3, 4), (2, 3, 4)]
STEPS = 3

# name -> (blade_relax optimizer, torch.optim optimizer with the same hyperparameters,
#          torch state keys in the order of the optimizer's state_names)
CASES: dict[str, tuple[Callable[[], object], Callable[[list], object], list[str]]] = {
    "sgd": (
        lambda: SGD(lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
        [],
    ),
    "sgd-momentum": (
        lambda: SGD(lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
        ["momentum_buffer"],
    ),
    "sgd-dampening": (
        lambda: SGD(lr=0.1, momentum=0.9, dampening=0.3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, foreach=False),
        ["momentum_buffer"],
    ),
    "sgd-nesterov": (
        lambda: SGD(lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
        ["momentum_buffer"],
    ),
    "sgd-weight-decay": (
        lambda: SGD(lr=0.1, weight_decay=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05, foreach=False),
        [],
    ),
    "sgd-momentum-weight-decay": (
        lambda: SGD(lr=0.1, momentum=0.8, weight_decay=0.05, nesterov=True),
        lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.8, weight_decay=0.05, nesterov=True, foreach=False
        ),
        ["momentum_buffer"],
    ),
    "adamw": (
        lambda: AdamW(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(
            ps, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, foreach=False
        ),
        ["exp_avg", "exp_avg_sq"],
    ),
    # 1 - beta1 >= 0.5: the other branch of torch's lerp.
    "adamw-low-beta1": (
        lambda: AdamW(lr=0.05, betas=(0.3, 0.999), weight_decay=0.0),
        lambda ps: torch.optim.AdamW(
            ps, lr=0.05, betas=(0.3, 0.999), weight_decay=0.0, foreach=False
        ),
        ["exp_avg", "exp_avg_sq"],
    ),
}


def _random(shapes, seed: int, dtype: str = "float32") -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _half_safe(shapes, seed: int, dtype: str) -> list[np.ndarray]:
    """Values of magnitude in [0.25, 2]: ``(1 - beta2) * g * g`` stays a normal float16 (a
    smaller gradient's second moment underflows to zero in a half-precision state, in torch
    as here, and the update then divides by ``eps`` alone)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.choice([-1.0, 1.0], size=s) * rng.uniform(0.25, 2.0, size=s)).astype(dtype)
        for s in shapes
    ]


def _relax_params(shapes, dtype: str = "float32") -> list[relax.Var]:
    return [relax.Var(f"p{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]


def _standalone(opt, shapes, dtype: str = "float32"):
    opt.init(_relax_params(shapes, dtype))
    return relax.VirtualMachine(tvm.compile(opt.standalone_module(), "llvm"), tvm.cpu())


def _run(opt, vm, params, grads_per_step):
    """Run ``len(grads_per_step)`` steps; the caller's tensors, and the last call's outputs."""
    p_tvm = [tvm.runtime.tensor(p) for p in params]
    s_tvm = [tvm.runtime.tensor(s) for s in opt.initial_state(params)]
    out = None
    for step, grads in enumerate(grads_per_step, start=1):
        g_tvm = [tvm.runtime.tensor(g) for g in grads]
        scalars = tvm.runtime.tensor(opt.scalars(step))
        out = vm["main"](p_tvm, g_tvm, s_tvm, scalars)
    return p_tvm, s_tvm, out


def _torch_run(make, params, grads_per_step, state_keys):
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = make(tparams)
    for grads in grads_per_step:
        for p, g in zip(tparams, grads):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    states = [opt.state[p][k].numpy() for p in tparams for k in state_keys]
    return [p.detach().numpy() for p in tparams], states


@pytest.mark.parametrize("case", list(CASES))
def test_standalone_matches_torch_and_updates_in_place(case):
    make_ours, make_torch, state_keys = CASES[case]
    opt = make_ours()
    assert len(opt.state_names) == len(state_keys)
    vm = _standalone(opt, SHAPES)
    params = _random(SHAPES, seed=1)
    grads = [_random(SHAPES, seed=10 + k) for k in range(STEPS)]
    p_tvm, s_tvm, out = _run(opt, vm, params, grads)
    expected_params, expected_states = _torch_run(make_torch, params, grads, state_keys)

    got_params = [p.numpy() for p in p_tvm]
    got_states = [s.numpy() for s in s_tvm]
    for got, want in zip(got_params + got_states, expected_params + expected_states):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # In place: the caller's tensors changed, and the outputs hold the very same values.
    for before, after in zip(params, got_params):
        assert not np.array_equal(before, after)
    assert len(out[0]) == len(SHAPES) and len(out[1]) == len(got_states)
    for returned, held in zip(list(out[0]) + list(out[1]), got_params + got_states):
        np.testing.assert_array_equal(returned.numpy(), held)


def test_standalone_uses_one_inplace_call_per_parameter():
    opt = AdamW()
    opt.init(_relax_params(SHAPES))
    mod = opt.standalone_module()
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(
            tvm.ir.Op.get("relax.call_tir_inplace")
        ):
            calls.append(expr)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    assert len(calls) == len(SHAPES)
    for call in calls:
        assert [int(i) for i in call.attrs.inplace_indices] == [0, 2, 3]
    # One kernel per rank (and dtype), each elementwise and in place.
    kernels = [gv for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == len({len(s) for s in SHAPES})


def test_matches_tvm_momentum_sgd():
    """TVM's MomentumSGD with dampening 0 starts its velocity at zero, so ``v = g`` on the
    first step as in torch and ours: both steps give the same parameters and velocities."""
    lr, momentum, weight_decay = 0.1, 0.9, 0.01
    params = _random(SHAPES, seed=2)
    grads = [_random(SHAPES, seed=20 + k) for k in range(2)]

    ours = SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)
    p_ours, s_ours, _ = _run(ours, _standalone(ours, SHAPES), params, grads)

    theirs = relax.training.optimizer.MomentumSGD(lr, momentum, weight_decay=weight_decay)
    theirs.init(_relax_params(SHAPES))
    mod = tvm.IRModule({"MomentumSGD": theirs.get_function()})
    mod = relax.transform.LegalizeOps()(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    p_tvm = [tvm.runtime.tensor(p) for p in params]
    state = list(theirs.state)
    for step_grads in grads:
        new_params, state = vm["MomentumSGD"](
            p_tvm, [tvm.runtime.tensor(g) for g in step_grads], state
        )
        p_tvm = list(new_params)
        state = list(state)
    assert int(state[0].numpy()) == 2
    for mine, reference in zip(p_ours, p_tvm):
        np.testing.assert_allclose(mine.numpy(), reference.numpy(), rtol=1e-6, atol=1e-7)
    for mine, reference in zip(s_ours, state[1:]):
        np.testing.assert_allclose(mine.numpy(), reference.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: SGD(lr=0.1, momentum=0.9), lambda: AdamW(lr=0.05)])
def test_float16_kernel_matches_float32(make):
    """Half-precision parameters are updated in float32 and rounded: after one step they
    match the float32 update of the same (half-representable) values to half precision."""
    params16 = _random(SHAPES, seed=3, dtype="float16")
    grads16 = [_half_safe(SHAPES, seed=30, dtype="float16")]
    opt16 = make()
    p16, s16, _ = _run(opt16, _standalone(opt16, SHAPES, "float16"), params16, grads16)
    assert all(p.dtype == "float16" for p in p16)

    params32 = [p.astype("float32") for p in params16]
    grads32 = [[g.astype("float32") for g in grads16[0]]]
    opt32 = make()
    p32, s32, _ = _run(opt32, _standalone(opt32, SHAPES), params32, grads32)
    for half, full, before in zip(p16, p32, params16):
        assert not np.array_equal(half.numpy(), before)
        np.testing.assert_allclose(
            half.numpy().astype("float32"), full.numpy(), rtol=1e-3, atol=1e-3
        )
    for half, full in zip(s16, s32):
        np.testing.assert_allclose(
            half.numpy().astype("float32"), full.numpy(), rtol=1e-3, atol=1e-3
        )


def test_bfloat16_kernel_builds_and_runs():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    opt = AdamW(lr=0.05)
    vm = _standalone(opt, SHAPES, "bfloat16")
    params32 = _random(SHAPES, seed=4)
    grads32 = _half_safe(SHAPES, seed=40, dtype="float32")
    params = [p.astype(ml_dtypes.bfloat16) for p in params32]
    grads = [g.astype(ml_dtypes.bfloat16) for g in grads32]
    p_bf16, _, _ = _run(opt, vm, params, [grads])

    ref = AdamW(lr=0.05)
    p32, _, _ = _run(
        ref,
        _standalone(ref, SHAPES),
        [p.astype("float32") for p in params],
        [[g.astype("float32") for g in grads]],
    )
    for got, want, before in zip(p_bf16, p32, params):
        got = np.asarray(got.numpy()).astype("float32")
        assert not np.array_equal(got, before.astype("float32"))
        # bfloat16 keeps 8 bits of mantissa: one rounding of the float32 result.
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-2, atol=1e-2)


def test_kernel_refuses_non_float_and_unknown_rank():
    opt = SGD(lr=0.1)
    with pytest.raises(ValueError, match="floating-point"):
        opt.kernel(relax.TensorType((3,), "int32"))
    with pytest.raises(ValueError, match="known rank"):
        opt.kernel(relax.TensorType(None, "float32", ndim=-1))


def test_scalars_follow_the_schedule_and_count_from_one():
    opt = AdamW(lr=0.1, lr_schedule=lambda step: 0.1 / step)
    assert opt.lr_at(1) == pytest.approx(0.1) and opt.lr_at(4) == pytest.approx(0.025)
    one, four = opt.scalars(1), opt.scalars(4)
    assert one.dtype == np.float32 and one.shape == (opt.num_scalars,)
    # The step size -lr / (1 - beta1 ** t) with the scheduled lr.
    assert four[4] == pytest.approx(-0.025 / (1 - 0.9**4), rel=1e-6)
    assert one[4] == pytest.approx(-0.1 / (1 - 0.9), rel=1e-6)
    with pytest.raises(ValueError, match="from 1"):
        opt.scalars(0)
    with pytest.raises(ValueError, match="from 1"):
        SGD(lr=0.1).scalars(0)
    negative = SGD(lr=0.1, lr_schedule=lambda step: -1.0)
    with pytest.raises(ValueError, match="learning rate"):
        negative.scalars(1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SGD(lr=-0.1), "lr"),
        (lambda: SGD(lr=float("nan")), "lr"),
        (lambda: SGD(lr=0.1, momentum=-0.5), "momentum"),
        (lambda: SGD(lr=0.1, weight_decay=-1e-3), "weight_decay"),
        (lambda: SGD(lr=0.1, momentum=0.9, dampening=1.5), "dampening"),
        (lambda: SGD(lr=0.1, nesterov=True), "Nesterov"),
        (lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
        (lambda: AdamW(lr=-1e-3), "lr"),
        (lambda: AdamW(betas=(1.0, 0.999)), "betas"),
        (lambda: AdamW(betas=(0.9, -0.1)), "betas"),
        (lambda: AdamW(betas=(0.9,)), "betas"),
        (lambda: AdamW(eps=-1e-8), "eps"),
        (lambda: AdamW(weight_decay=float("inf")), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", [lambda: SGD(lr=0.1, momentum=0.9), lambda: AdamW()])
def test_get_function_points_to_standalone_module(make):
    opt = make()
    opt.init(_relax_params(SHAPES))
    with pytest.raises(NotImplementedError, match="standalone_module"):
        opt.get_function()


def test_standalone_module_needs_init_and_static_shapes():
    with pytest.raises(Exception, match="init"):
        AdamW().standalone_module()
    s = tvm.tirx.Var("s", "int64")
    with pytest.raises(ValueError, match="static shape"):
        AdamW().init([relax.Var("w", relax.TensorType((s, 4), "float32"))])


def test_initial_state_is_zero_per_state_name():
    params = _random(SHAPES, seed=5)
    for opt in (SGD(lr=0.1), SGD(lr=0.1, momentum=0.5), AdamW()):
        state = opt.initial_state(params)
        assert len(state) == len(params) * len(opt.state_names)
        expected_shapes = [p.shape for p in params for _ in opt.state_names]
        assert [s.shape for s in state] == expected_shapes
        assert all(not s.any() and s.dtype == np.float32 for s in state)


def test_init_state_fits_the_standalone_module():
    opt = AdamW()
    opt.init(_relax_params(SHAPES))
    expected = opt.standalone_module()["main"].params[2].ty.fields
    assert [tuple(s.shape) for s in opt.state] == [
        tuple(int(v) for v in t.shape.values) for t in expected
    ]

"""``build_training_step``: a training graph plus an in-place optimizer, as one Relax function.

On a tiny Relax-native MLP (``relax.transform.Gradient``, no torch export): the step's
signature, its one ``call_tir_inplace`` per parameter, the attributes it keeps, what it refuses;
numerically, one step equals the graph's plain gradients followed by the ``torch.optim`` update,
and the full blade_relax pipeline (scheduling, rematerialization, planning) computes the same
parameters as TVM's stock pipeline over two steps, at two lengths: the memory passes never move
a parameter's in-place update before a read of that parameter. The fallback for graphs whose
blocks cannot be merged (an impure call) is checked too.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax import get_pipeline
from blade_relax.bench.workloads import ModelSizes, build_workload
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline
from blade_relax.training import SGD, AdamW, TrainingStep, build_training_step
from blade_relax.transform import PassFallbackWarning

SIZES = ModelSizes(layers=2, hidden=8, intermediate=16, vocab=6, max_seq_len=16)
LENGTHS = (3, 11)
CALL_TIR_INPLACE = tvm.ir.Op.get("relax.call_tir_inplace")


def _adamw() -> AdamW:
    return AdamW(lr=0.01, betas=(0.9, 0.99), weight_decay=0.05)


def _sgd() -> SGD:
    return SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def _torch_twin(opt, params):
    if isinstance(opt, AdamW):
        return torch.optim.AdamW(
            params,
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            foreach=False,
        )
    return torch.optim.SGD(
        params,
        lr=opt.lr,
        momentum=opt.momentum,
        dampening=opt.dampening,
        weight_decay=opt.weight_decay,
        nesterov=opt.nesterov,
        foreach=False,
    )


@pytest.fixture(scope="module")
def graph():
    """The MLP training graph: ``main(x, onehot, w0, b0, ..., b2) -> (loss, *grads)``."""
    return build_workload("mlp-train", SIZES).graph


@pytest.fixture(scope="module")
def graph_vm(graph):
    """The bare training graph, compiled by the stock pipeline: the plain gradients."""
    ex = tvm.compile(graph.mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    return relax.VirtualMachine(ex, tvm.cpu())


@pytest.fixture(scope="module", params=["adamw", "sgd"])
def compiled(request, graph):
    """A step, compiled by the full pipeline and by the stock one."""
    step = build_training_step(graph, _adamw() if request.param == "adamw" else _sgd())
    full = tvm.compile(step.mod, "llvm", relax_pipeline=get_pipeline("llvm"))
    stock = tvm.compile(step.mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    return step, full, stock


def _inplace_calls(func: relax.Function) -> list[relax.Call]:
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(CALL_TIR_INPLACE):
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def _run_steps(ex, step: TrainingStep, batches):
    """Run one step per batch from the graph's parameters; (losses, parameters, states)."""
    vm = relax.VirtualMachine(ex, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in step.graph.params]
    states = [tvm.runtime.tensor(s) for s in step.initial_state()]
    losses = []
    for k, batch in enumerate(batches, start=1):
        scalars = tvm.runtime.tensor(step.optimizer.scalars(k))
        inputs = [tvm.runtime.tensor(a) for a in batch]
        out = vm["main"](*inputs, *params, *states, scalars)
        assert len(out) == 1 + len(params) + len(states)
        losses.append(float(out[0].numpy()))
    return losses, [p.numpy() for p in params], [s.numpy() for s in states]


# ---------------------------------------------------------------------------------- structure


@pytest.mark.parametrize(
    ("make", "indices"),
    [
        (_adamw, [0, 2, 3]),
        (lambda: SGD(lr=0.1, momentum=0.9), [0, 2]),
        (lambda: SGD(lr=0.1), [0]),
    ],
)
def test_step_signature_and_inplace_updates(graph, make, indices):
    opt = make()
    step = build_training_step(graph, opt)
    n_in, n_param = len(graph.input_names), len(graph.param_names)
    n_state = n_param * len(opt.state_names)
    main = step.mod["main"]
    relax.analysis.well_formed(step.mod)

    assert step.fused
    assert (step.num_inputs, step.num_params) == (n_in, n_param)
    assert len(main.params) == n_in + n_param + n_state + 1
    # Inputs and parameters are the graph's own variables, in order; then states, scalars.
    graph_params = list(graph.main.params)
    assert all(a.same_as(b) for a, b in zip(main.params, graph_params))
    scalars = main.params[-1]
    assert [int(v) for v in scalars.ty.shape.values] == [opt.num_scalars]
    assert str(scalars.ty.dtype) == "float32"

    ret = main.body.body.ty
    assert isinstance(ret, relax.TupleType) and len(ret.fields) == 1 + n_param + n_state
    assert step.state_names == [f"{s}:{p}" for p in graph.param_names for s in opt.state_names]
    # Each state has its parameter's type, and so do the returned parameters and states.
    expected = [p.ty for p in graph_params[n_in:]]
    expected_states = [t for t in expected for _ in opt.state_names]
    for got, want in zip(list(ret.fields[1:]), expected + expected_states):
        assert tvm_ffi.structural_equal(got, want)
    for got, want in zip(main.params[n_in + n_param : -1], expected_states):
        assert tvm_ffi.structural_equal(got.ty, want)

    calls = _inplace_calls(main)
    assert len(calls) == n_param
    for call in calls:
        assert [int(i) for i in call.attrs.inplace_indices] == indices
        assert call.args[1][-1].same_as(scalars)
    # One kernel per distinct (rank, dtype) of the parameters (matrices and biases here).
    kernels = [f for f in step.mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == len({p.ty.ndim for p in graph_params[n_in:]})


def test_step_keeps_the_graph_attributes(graph):
    step = build_training_step(graph, _adamw())
    attrs = step.mod["main"].attrs
    for key in ("tir_var_upper_bound", "tir_var_lower_bound"):
        assert tvm_ffi.structural_equal(attrs[key], graph.main.attrs[key])
    assert int(attrs["tir_var_upper_bound"]["s"]) == SIZES.max_seq_len
    assert int(attrs["num_input"]) == len(graph.input_names)
    assert str(attrs["global_symbol"]) == "main"


def test_initial_state_matches_the_state_arguments(graph):
    step = build_training_step(graph, _adamw())
    state = step.initial_state()
    n_in, n_param = step.num_inputs, step.num_params
    args = step.mod["main"].params[n_in + n_param : -1]
    assert len(state) == len(args) == len(step.state_names)
    for array, arg in zip(state, args):
        assert array.shape == tuple(int(v) for v in arg.ty.shape.values)
        assert not array.any()


def test_refuses_inference_graphs_and_other_optimizers(graph):
    inference = dataclasses.replace(graph, kind="inference")
    with pytest.raises(ValueError, match="training graph"):
        build_training_step(inference, _adamw())
    with pytest.raises(TypeError, match="in-place optimizer"):
        build_training_step(graph, relax.training.optimizer.SGD(0.1))
    with pytest.raises(TypeError, match="in-place optimizer"):
        build_training_step(graph, "adamw")
    # A graph whose names disagree with its main's arity.
    with pytest.raises(ValueError, match="arguments"):
        build_training_step(
            dataclasses.replace(graph, param_names=graph.param_names[:-1]), _adamw()
        )


# ---------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("length", LENGTHS)
def test_one_step_equals_plain_gradients_then_torch_update(compiled, graph, graph_vm, length):
    step, full, _ = compiled
    batch = graph.random_inputs({"s": length}, seed=length)
    out = graph_vm["main"](
        *[tvm.runtime.tensor(a) for a in batch], *[tvm.runtime.tensor(p) for p in graph.params]
    )
    loss, grads = float(out[0].numpy()), [g.numpy() for g in list(out)[1:]]
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in graph.params]
    opt = _torch_twin(step.optimizer, tparams)
    for p, g in zip(tparams, grads):
        p.grad = torch.from_numpy(g)
    opt.step()

    losses, params, _ = _run_steps(full, step, [batch])
    assert losses[0] == pytest.approx(loss, rel=1e-6)
    for got, param, before in zip(params, tparams, graph.params):
        assert not np.array_equal(got, before)
        # ATen's GEMMs sum in another order than the graph's kernels: gradients near zero
        # differ by about 1e-8 absolute.
        np.testing.assert_allclose(got, param.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("length", LENGTHS)
def test_full_pipeline_matches_stock_over_two_steps(compiled, graph, length):
    """Were an update moved before a read of its parameter (by the scheduler, or a plan
    sharing the parameter's buffer), the second step would see a different parameter."""
    step, full, stock = compiled
    batches = [graph.random_inputs({"s": length}, seed=100 * length + k) for k in range(2)]
    losses_full, params_full, states_full = _run_steps(full, step, batches)
    losses_stock, params_stock, states_stock = _run_steps(stock, step, batches)
    np.testing.assert_allclose(losses_full, losses_stock, rtol=1e-5)
    for got, want in zip(params_full + states_full, params_stock + states_stock):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # The step did train: the second loss is not the first one again.
    assert losses_full[0] != losses_full[1]


# ---------------------------------------------------------------------------------- fallback


def _with_impure_binding(graph):
    """The graph with a ``print`` (impure) between its blocks: they cannot be merged."""
    func = graph.main
    printed = relax.BlockBuilder().normalize(relax.op.print(relax.const(1.0), format=""))
    var = relax.Var("printed", printed.ty)
    blocks = list(func.body.blocks)
    blocks.insert(1, relax.BindingBlock([relax.VarBinding(var, printed)]))
    body = relax.SeqExpr(blocks, func.body.body)
    impure = relax.Function(func.params, body, func.body.body.ty, False, func.attrs)
    impure = relax.BlockBuilder().normalize(impure)
    mod = tvm.IRModule({"main": impure})
    relax.analysis.well_formed(mod)
    return dataclasses.replace(graph, mod=mod)


def test_unmergeable_graph_falls_back_and_still_trains(graph):
    impure = _with_impure_binding(graph)
    with pytest.warns(PassFallbackWarning, match="impure call"):
        fallback = build_training_step(impure, _adamw())
    assert not fallback.fused
    assert len(_inplace_calls(fallback.mod["main"])) == len(graph.param_names)
    fused = build_training_step(graph, _adamw())
    batches = [graph.random_inputs({"s": n}, seed=n) for n in LENGTHS]
    pipeline = stock_pipeline("llvm")
    got = _run_steps(tvm.compile(fallback.mod, "llvm", relax_pipeline=pipeline), fallback, batches)
    want = _run_steps(tvm.compile(fused.mod, "llvm", relax_pipeline=pipeline), fused, batches)
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        np.testing.assert_array_equal(a, b)


def test_unmergeable_graph_gives_a_well_formed_step(graph):
    impure = _with_impure_binding(graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PassFallbackWarning)
        fallback = build_training_step(impure, _adamw())
    assert relax.analysis.check_well_formed(fallback.mod)


# ------------------------------------------------------------------- where the updates stand


def _update_positions(func: relax.Function) -> dict[str, int]:
    """Parameter name -> position of its in-place update among the step's bindings."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    return {
        b.value.args[1].fields[0].name: i
        for i, b in enumerate(bindings)
        if isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR_INPLACE)
    }


def test_each_update_follows_its_gradient_and_its_parameters_last_reader(graph):
    """Each update stands right after the later of its gradient's binding and the last binding
    that reads its parameter (directly or through a value sharing its memory), not at the end:
    each gradient dies as soon as it is applied."""

    step = build_training_step(graph, _adamw(), updates="early")
    assert step.updates == "early"
    func = step.mod["main"]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    position = {b.var: i for i, b in enumerate(bindings)}
    updates = _update_positions(func)
    assert len(updates) == graph.num_trainable
    n_in = len(graph.input_names)
    params = list(graph.main.params[n_in : n_in + graph.num_trainable])
    for param in params:
        at = updates[param.name]
        readers = [
            i
            for i, b in enumerate(bindings)
            if i != at and param in relax.analysis.free_vars(b.value)
        ]
        grad = bindings[at].value.args[1].fields[1]
        # The update reads the gradient after its binding and writes the parameter after every
        # other reader: nothing reads the parameter later.
        assert position[grad] < at and all(i < at for i in readers), param.name
        # Immediately after the later of the two (the other updates placed there aside).
        latest = max([position[grad], *readers])
        between = bindings[latest + 1 : at]
        assert all(isinstance(b.value, relax.Call) for b in between)
        assert all(b.value.op.same_as(CALL_TIR_INPLACE) for b in between), param.name
    # Not all at the end: the first update runs before the last gradient exists.
    last_grad = max(position[bindings[at].value.args[1].fields[1]] for at in updates.values())
    assert min(updates.values()) < last_grad
    # By default the updates follow the backward pass, all of them.
    end = build_training_step(graph, _adamw())
    assert end.updates == "end"
    end_bindings = [b for block in end.mod["main"].body.blocks for b in block.bindings]
    at_end = sorted(_update_positions(end.mod["main"]).values())
    last_grad = max(
        i
        for i, b in enumerate(end_bindings)
        if not (isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR_INPLACE))
        and not isinstance(b.value, relax.TupleGetItem)
        and "adjoint" in b.var.name
    )
    assert at_end[0] > last_grad
    with pytest.raises(ValueError, match="updates must be one of"):
        build_training_step(graph, _adamw(), updates="soon")


@pytest.mark.parametrize("updates", ["end", "early"])
def test_both_placements_train_alike(graph, updates):
    """Early updates compute what updates at the end compute, through the full pipeline."""
    base = build_training_step(graph, _adamw())
    step = build_training_step(graph, _adamw(), updates=updates)
    batches = [graph.random_inputs({"s": s}, seed=s) for s in LENGTHS]
    got = _run_steps(
        tvm.compile(step.mod, "llvm", relax_pipeline=get_pipeline("llvm")), step, batches
    )
    want = _run_steps(
        tvm.compile(base.mod, "llvm", relax_pipeline=stock_pipeline("llvm")), base, batches
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _reads_after_updates(lowered: tvm.IRModule) -> list[str]:
    """Bindings of the lowered functions that read a parameter's memory (or its optimizer
    state's) after the binding that updates it in place, the result tuple aside."""
    from blade_relax.analysis.effects import in_place_writes

    late = []
    for gv, func in lowered.functions.items():
        if not isinstance(func, relax.Function):
            continue
        bindings = [b for block in func.body.blocks for b in block.bindings]
        memory = in_place_writes(bindings, lowered)
        params = set(func.params)
        updated: set[relax.Var] = set()
        for i, binding in enumerate(bindings):
            written = memory.writes.get(i, frozenset())
            if not isinstance(binding.value, relax.Tuple):
                for var in relax.analysis.free_vars(binding.value):
                    for root in (memory.roots_of(var) & updated) - written:
                        late.append(f"{gv.name_hint}: {binding.var.name} reads {root.name}")
            updated |= written & params
    return late


@pytest.mark.parametrize("workload", ["mlp-train", "llama-train"])
def test_no_lowered_binding_reads_a_parameter_after_its_early_update(workload):
    """Fusion and scheduling keep every read of a parameter before its early update: a fused
    kernel that read the parameter past its update would compute with the new weights."""
    graph = build_workload(workload, SIZES).graph
    step = build_training_step(graph, _adamw(), updates="early")
    lowered = lower_to_memory_stage(step.mod, "llvm")
    assert _reads_after_updates(lowered) == []


@I.ir_module
class _ReadAfterUpdate:
    @T.prim_func(s_tir=True)
    def sub(w: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("sub"):
                vi = T.axis.spatial(4, i)
                w[vi] = w[vi] - g[vi]

    @R.function
    def main(w: R.Tensor((4,), "float32"), g: R.Tensor((4,), "float32")):
        cls = _ReadAfterUpdate
        with R.dataflow():
            y = R.exp(w)
            u = R.call_tir_inplace(
                cls.sub, (w, g), inplace_indices=[0], out_ty=R.Tensor((4,), "float32")
            )
            z = R.exp(w)
            R.output(y, u, z)
        return (y, u, z)


def test_the_read_after_update_check_sees_a_late_read():
    assert _reads_after_updates(_ReadAfterUpdate) == ["main: z reads w"]


def test_a_view_of_a_parameter_read_late_holds_its_update_back():
    """``v = reshape(w)`` read after ``w``'s gradient exists: the update (which writes ``w``'s
    memory, which ``v`` shares) waits for that last read."""
    from blade_relax.training.step import update_points

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    w = relax.Var("w", relax.TensorType((4,), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            v = bb.emit(relax.op.reshape(w, (2, 2)))  # 0: a view of w
            g = bb.emit(relax.op.multiply(x, x))  # 1: the gradient
            t = bb.emit(relax.Tuple([v, x]))  # 2: a tuple holding the view
            item = bb.emit(relax.TupleGetItem(t, 0))  # 3: an item of it
            late = bb.emit(relax.op.sum(item))  # 4: the last read of w's memory
            out = bb.emit_output(relax.Tuple([late, g]))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    bindings = [b for block in func.body.blocks for b in block.bindings][:-1]
    assert update_points(bindings, [w], [g]) == [4]
    # Without the late read, right after the gradient.
    assert update_points(bindings[:2], [w], [g]) == [1]

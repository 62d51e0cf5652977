"""Relax-native training steps through relax.transform.Gradient."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from blade_relax.frontend import DimOutOfRangeError, flatten_outputs, relax_training_step


@I.ir_module
class Linear:
    @R.function
    def main(
        x: R.Tensor(("s", 4), "float32"),
        w: R.Tensor((4, 3), "float32"),
        b: R.Tensor((3,), "float32"),
    ) -> R.Tensor((), "float32"):
        with R.dataflow():
            y = R.add(R.matmul(x, w), b)
            loss = R.sum(R.multiply(y, y))
            R.output(loss)
        return loss


def numpy_step(x, w, b):
    y = x @ w + b
    return [np.sum(y * y), 2 * x.T @ y, 2 * y.sum(0)]


def make(keep_upper_bound=True):
    rng = np.random.default_rng(0)
    params = [
        rng.standard_normal((4, 3)).astype("float32"),
        rng.standard_normal(3).astype("float32"),
    ]
    return relax_training_step(
        Linear,
        params=params,
        num_input=1,
        dims={"s": (1, 50)},
        keep_upper_bound=keep_upper_bound,
        reference=lambda inputs: numpy_step(inputs[0], *params),
    )


def test_flat_outputs_and_names():
    graph = make()
    assert graph.input_names == ["x"]
    assert graph.param_names == ["w", "b"]
    assert graph.output_names == ["loss", "grad:w", "grad:b"]
    ret = graph.main.ret_ty
    assert isinstance(ret, relax.TupleType) and len(ret.fields) == 3
    assert graph.upper_bounds == {"s": 50}
    assert make(keep_upper_bound=False).upper_bounds == {}
    assert list(graph.mod.get_global_vars())[0].name_hint == "main"


def test_gradients_match_numpy_at_two_lengths():
    graph = make(keep_upper_bound=False)
    exe = tvm.compile(graph.mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for length in (3, 17):
        inputs = graph.random_inputs({"s": length}, seed=length)
        out = flatten_outputs(
            vm["main"](*map(tvm.runtime.tensor, inputs), *map(tvm.runtime.tensor, graph.params))
        )
        for got, want in zip(out, graph.reference(inputs)):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_declared_range_is_enforced():
    graph = make()
    with pytest.raises(DimOutOfRangeError, match="s <= 50"):
        graph.bind_dims([np.zeros((51, 4), "float32")])


def test_wrong_number_of_params_is_a_clear_error():
    with pytest.raises(ValueError, match="2 parameters, got 1"):
        relax_training_step(Linear, params=[np.zeros((4, 3), "float32")], num_input=1, dims={})


def _forward_matmuls(graph) -> int:
    return graph.main.script().count("R.matmul(x, w")


@pytest.mark.parametrize("deduplicate", [True, False])
def test_the_forward_pass_is_computed_once(deduplicate):
    """``Gradient`` re-emits the unmarked forward bindings as ``_cp`` copies; merged by default."""
    rng = np.random.default_rng(0)
    params = [
        rng.standard_normal((4, 3)).astype("float32"),
        rng.standard_normal(3).astype("float32"),
    ]
    graph = relax_training_step(
        Linear, params=params, num_input=1, dims={"s": (1, 50)}, deduplicate=deduplicate
    )
    assert _forward_matmuls(graph) == (1 if deduplicate else 2)
    assert ("_cp" in graph.main.script()) is not deduplicate
    exe = tvm.compile(graph.mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for s in (1, 5, 50):
        x = rng.standard_normal((s, 4)).astype("float32")
        out = flatten_outputs(vm["main"](*(tvm.runtime.tensor(a) for a in [x, *params])))
        for got, want in zip(out, numpy_step(x, *params)):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)

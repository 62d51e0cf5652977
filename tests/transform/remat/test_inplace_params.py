"""Rematerialize never regenerates a tensor from memory that is overwritten in place between its
computation and the regeneration site (a parameter an optimizer updates): the recipe would
read the new contents. Unit cases on a lowered function, and a training step end to end."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax
from blade_relax.bench.workloads import ModelSizes, mlp_forward_module
from blade_relax.contract import REMAT_META_ATTR
from blade_relax.frontend import relax_training_step
from blade_relax.runtime import RematBudgetWarning, measure_call, set_memory_budget
from blade_relax.training import AdamW, build_training_step
from blade_relax.transform import Rematerialize, RematOptions
from blade_relax.transform.remat import _ir
from blade_relax.transform.remat._ir import RecipeError, build_model
from blade_relax.transform.remat._select import Candidate, build_recipe

# Every tensor may be a candidate; a gap needs two computations (so that only ``a`` has one).
OPTIONS = RematOptions(min_bytes=0, min_fraction=0.0, plain_without_budget=False, min_gap=2)


# fmt: off
@I.ir_module
class UpdateBeforeSite:
    """``a = x + w`` is read by ``b`` and again by ``d``; between them ``w`` is updated in place
    (``sgd`` is the lowered ``call_tir_inplace``). Regenerating ``a`` at ``d`` would read the
    new ``w``."""

    @T.prim_func(private=True, s_tir=True)
    def add_one(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        z = T.match_buffer(var_z, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("z"):
                vi, vj = T.axis.remap("SS", [i, j])
                z[vi, vj] = x[vi, vj] + y[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        n = T.int64()
        w = T.match_buffer(var_w, (n, 4))
        g = T.match_buffer(var_g, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("w"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - g[vi, vj]

    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor(("n", 4), "float32"), g: R.Tensor(("n", 4), "float32")) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("n", 4), "float32")):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = UpdateBeforeSite
        a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add(x, w, a)
        b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add_one(a, b)
        cls.sgd(w, g)
        w2 = w
        c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add_one(b, c)
        d = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add(c, a, d)
        return (d, w2)


@I.ir_module
class UpdateOfAnotherParam:
    """The same, where the in-place update writes ``g``, which ``a``'s recipe does not read."""

    @T.prim_func(private=True, s_tir=True)
    def add_one(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def add(var_x: T.handle, var_y: T.handle, var_z: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 4))
        y = T.match_buffer(var_y, (n, 4))
        z = T.match_buffer(var_z, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("z"):
                vi, vj = T.axis.remap("SS", [i, j])
                z[vi, vj] = x[vi, vj] + y[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        n = T.int64()
        w = T.match_buffer(var_w, (n, 4))
        g = T.match_buffer(var_g, (n, 4))
        for i, j in T.grid(n, 4):
            with T.sblock("w"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - g[vi, vj]

    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor(("n", 4), "float32"), g: R.Tensor(("n", 4), "float32")) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("n", 4), "float32")):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = UpdateOfAnotherParam
        a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add(x, w, a)
        b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add_one(a, b)
        cls.sgd(g, w)
        g2 = g
        c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add_one(b, c)
        d = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.add(c, a, d)
        return (d, g2)
# fmt: on


def _slots(mod: tvm.IRModule) -> list[dict]:
    return json.loads(str(mod["main"].attrs[REMAT_META_ATTR]))["slots"]


def _candidate(mod: tvm.IRModule, site: int):
    """The model of ``main`` and ``a`` as a candidate evicted after ``b`` (binding 3)."""
    model = build_model(mod["main"], mod)
    (a,) = [op.var for op in model.ops if op.var.name == "a"]
    cand = Candidate(a, evict_after=3, regen_before=site)
    return model, cand


# --------------------------------------------------------------------------- the pass
def test_tensor_read_again_after_its_input_is_updated_is_not_evictable():
    after = Rematerialize(OPTIONS)(UpdateBeforeSite)
    tvm.ir.assert_structural_equal(after, UpdateBeforeSite)


def test_tensor_whose_inputs_are_not_updated_is_evictable():
    """The control: ``a`` becomes evictable, regenerated from ``x`` and ``w`` at ``d``."""
    after = Rematerialize(OPTIONS)(UpdateOfAnotherParam)
    (slot,) = _slots(after)
    assert slot["name"] == "a"
    regen = after[slot["regen"]]
    assert [p.name for p in regen.params] == ["x", "w"]


def test_without_the_check_the_hazardous_recipe_is_built(monkeypatch):
    """The case is one the pass would take: with no in-place writes known, ``a`` is evicted
    and regenerated from the updated ``w``."""
    monkeypatch.setattr(_ir, "in_place_writes", lambda bindings, mod: _ir.InPlaceWrites({}, {}))
    after = Rematerialize(OPTIONS)(UpdateBeforeSite)
    assert [s["name"] for s in _slots(after)] == ["a"]


# --------------------------------------------------------------------------- recipes
def test_recipe_refused_when_an_input_is_overwritten_before_the_site():
    # Bindings: 0 a, 1 add(x, w, a), 2 b, 3 add_one(a, b), 4 sgd(w, g), 5 w2, 6 c,
    # 7 add_one(b, c), 8 d, 9 add(c, a, d).
    model, cand = _candidate(UpdateBeforeSite, site=9)
    assert model.writes is not None and model.writes.writes.keys() == {4}
    with pytest.raises(RecipeError, match="w is overwritten in place before a's site"):
        build_recipe(model, cand, {cand.root: cand}, max_ops=4)


def test_recipe_built_when_the_site_comes_before_the_update():
    # Regenerated at binding 4 (the update itself): w is still as it was.
    model, cand = _candidate(UpdateBeforeSite, site=4)
    recipe = build_recipe(model, cand, {cand.root: cand}, max_ops=4)
    assert [v.name for v in recipe.inputs] == ["x", "w"]
    assert recipe.kernels == 1


def test_recipe_built_when_another_parameter_is_updated():
    model, cand = _candidate(UpdateOfAnotherParam, site=9)
    recipe = build_recipe(model, cand, {cand.root: cand}, max_ops=4)
    assert [v.name for v in recipe.inputs] == ["x", "w"]


# --------------------------------------------------------------------------- end to end
SIZES = ModelSizes(layers=2, hidden=8, intermediate=64, vocab=128, max_seq_len=256, min_seq_len=1)
# Lengths where the default pipeline evicts under a one-byte budget: with the in-place check
# (some activation that no update touches), and without it (one whose regeneration reads a
# parameter the step has already updated).
LENGTH_CHECKED = 160
LENGTH_UNCHECKED = 80


def _training_step(length: int):
    """An AdamW step of a Relax-native MLP: the updates write parameters and state in place,
    and MemoryAwareSchedule moves each one next to its gradient, ahead of later readers."""
    forward = mlp_forward_module(SIZES)
    rng = np.random.default_rng(0)
    params = []
    for param in forward["main"].params[2:]:
        shape = [int(v) for v in param.ty.shape.values]
        params.append((rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32"))
    graph = relax_training_step(
        forward,
        params=params,
        num_input=2,
        dims={"s": (SIZES.min_seq_len, SIZES.max_seq_len)},
        param_names=[p.name for p in forward["main"].params[2:]],
    )
    step = build_training_step(graph, AdamW(1e-2))
    x = rng.standard_normal((length, SIZES.hidden)).astype("float32")
    onehot = np.eye(SIZES.vocab, dtype="float32")[rng.integers(0, SIZES.vocab, length)]
    state = step.initial_state()
    scalars = step.optimizer.scalars(1)

    def args() -> list[np.ndarray]:
        # Fresh copies: the step updates the parameters and the state in place.
        return [x, onehot, *(p.copy() for p in params), *(s.copy() for s in state), scalars]

    return step, args


def _budgeted_and_plain(executable, args):
    plain = measure_call(executable, args())
    with warnings.catch_warnings():
        # Nothing fits in one byte: the runtime evicts what it can and says so.
        warnings.simplefilter("ignore", RematBudgetWarning)
        with set_memory_budget(1):
            budgeted = measure_call(executable, args())
    return budgeted, plain


def test_training_step_under_a_tiny_budget_equals_the_unbudgeted_step():
    step, args = _training_step(LENGTH_CHECKED)
    executable = tvm.compile(step.mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm"))
    budgeted, plain = _budgeted_and_plain(executable, args)
    assert budgeted.evictions >= 1 and budgeted.regenerations >= 1
    assert plain.evictions == 0
    # loss, the updated parameters, the updated state: bitwise equal.
    assert len(plain.outputs) == 1 + len(step.graph.param_names) * 3
    for got, expected in zip(budgeted.outputs, plain.outputs):
        np.testing.assert_array_equal(got, expected)


def test_training_step_without_the_check_differs_under_a_budget(monkeypatch):
    """The end-to-end case catches the hazard: without the check, a tensor is regenerated
    from a parameter already updated, and the budgeted step computes other values."""
    step, args = _training_step(LENGTH_UNCHECKED)
    monkeypatch.setattr(_ir, "in_place_writes", lambda bindings, mod: _ir.InPlaceWrites({}, {}))
    executable = tvm.compile(step.mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm"))
    budgeted, plain = _budgeted_and_plain(executable, args)
    assert not all(np.array_equal(a, b) for a, b in zip(budgeted.outputs, plain.outputs))

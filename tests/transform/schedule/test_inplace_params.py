"""MemoryAwareSchedule keeps an in-place update of a function parameter after every read of
that parameter (directly, or through an alias or a view), even where running the update early
would lower the peak: the update owns no buffer in the block model, so only these edges hold
it in place."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline
from blade_relax.transform import MemoryAwareSchedule, ScheduleOptions
from blade_relax.transform.schedule import _model

STRATEGIES = ["refine", "greedy-delta", "greedy-peak", "depth-first"]
LR = 0.5


# fmt: off
# ``g`` (256 x 256, the gradient-like value) must exist before the long stretch that computes
# ``h`` (its sum ``r`` feeds it), and ``y = h @ w`` reads the parameter at the end of that
# stretch. Running the update right after ``r`` frees ``g`` before the (s x 2048) temporaries:
# the peak drops from 16384 s + 262144 to Max(16384 s, 1024 s + 262144) bytes; but ``y`` would
# then read the updated weight.
@I.ir_module
class ParamUpdate:
    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        w = T.match_buffer(var_w, (256, 256))
        g = T.match_buffer(var_g, (256, 256))
        for i, j in T.grid(256, 256):
            with T.sblock("sgd"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - T.float32(LR) * g[vi, vj]

    @R.function
    def main(
        x: R.Tensor(("s", 256), "float32"),
        xw: R.Tensor(("s", 2048), "float32"),
        w: R.Tensor((256, 256), "float32"),
    ) -> R.Tuple(R.Tensor(("s", 256), "float32"), R.Tensor((256, 256), "float32")):
        s = T.int64()
        cls = ParamUpdate
        with R.dataflow():
            xt = R.permute_dims(x)
            g = R.matmul(xt, x)
            r = R.sum(g)
            t1 = R.add(xw, r)
            t2 = R.exp(t1)
            t3 = R.reshape(t2, R.shape([s, 8, 256]))
            h = R.sum(t3, axis=[1])
            y = R.matmul(h, w)
            w2 = R.call_tir_inplace(cls.sgd, (w, g), inplace_indices=[0], out_ty=R.Tensor((256, 256), "float32"))
            out = (y, w2)
            R.output(out)
        return out


# The same, where ``y`` reads ``w`` through a reshape view ``wv`` (512 x 128).
@I.ir_module
class ViewUpdate:
    @T.prim_func(private=True, s_tir=True)
    def sgd(var_w: T.handle, var_g: T.handle):
        w = T.match_buffer(var_w, (256, 256))
        g = T.match_buffer(var_g, (256, 256))
        for i, j in T.grid(256, 256):
            with T.sblock("sgd"):
                vi, vj = T.axis.remap("SS", [i, j])
                w[vi, vj] = w[vi, vj] - T.float32(LR) * g[vi, vj]

    @R.function
    def main(
        x: R.Tensor(("s", 256), "float32"),
        xw: R.Tensor(("s", 2048), "float32"),
        w: R.Tensor((256, 256), "float32"),
    ) -> R.Tuple(R.Tensor(("s", 128), "float32"), R.Tensor((256, 256), "float32")):
        s = T.int64()
        cls = ViewUpdate
        with R.dataflow():
            xt = R.permute_dims(x)
            g = R.matmul(xt, x)
            r = R.sum(g)
            t1 = R.add(xw, r)
            t2 = R.exp(t1)
            t3 = R.reshape(t2, R.shape([s, 4, 512]))
            h = R.sum(t3, axis=[1])
            wv = R.reshape(w, R.shape([512, 128]))
            y = R.matmul(h, wv)
            w2 = R.call_tir_inplace(cls.sgd, (w, g), inplace_indices=[0], out_ty=R.Tensor((256, 256), "float32"))
            out = (y, w2)
            R.output(out)
        return out
# fmt: on


def _order(mod: tvm.IRModule) -> list[str]:
    return [b.var.name for b in mod["main"].body.blocks[0].bindings]


def _readers_of(mod: tvm.IRModule, roots: set[str]) -> list[str]:
    """Bindings (other than the update) that read ``roots`` or a view of them, by name."""
    readers, views = [], set(roots)
    for b in mod["main"].body.blocks[0].bindings:
        used = {v.name for v in relax.analysis.free_vars(b.value)}
        if b.var.name == "w2" or not used & views:
            continue
        readers.append(b.var.name)
        value = b.value
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
            continue
        if value.op.name == "relax.reshape":
            views.add(b.var.name)
        elif value.op.name == "relax.call_tir" and relax.analysis.has_reshape_pattern(
            mod[value.args[0]]
        ):  # a reshape kernel: RewriteDataflowReshape makes it a view
            views.add(b.var.name)
    return readers


def _assert_update_after_reads(mod: tvm.IRModule) -> None:
    order = _order(mod)
    readers = _readers_of(mod, {"w"})
    assert "y" in readers
    assert all(order.index(r) < order.index("w2") for r in readers), (readers, order)


def _inputs(s: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + s)
    x = rng.standard_normal((s, 256)) * 0.2
    # Rows of zero sum: sum(g) = sum_k (sum_i x[k, i])^2 is then ~0 and exp(xw + sum(g)) tame.
    x = (x - x.mean(axis=1, keepdims=True)).astype("float32")
    xw = rng.standard_normal((s, 2048)).astype("float32")
    w = rng.standard_normal((256, 256)).astype("float32")
    return x, xw, w


def _reference(x: np.ndarray, xw: np.ndarray, w: np.ndarray, view: bool):
    """``y`` from the weight as it was on entry, and the updated weight (float64)."""
    s = x.shape[0]
    x64, w64 = x.astype("float64"), w.astype("float64")
    g = x64.T @ x64
    t2 = np.exp(xw.astype("float64") + g.sum())
    if view:
        y = t2.reshape(s, 4, 512).sum(1) @ w64.reshape(512, 128)
    else:
        y = t2.reshape(s, 8, 256).sum(1) @ w64
    return y, w64 - LR * g


def _run(executable, x, xw, w):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    # The update writes into the weight passed in: every run gets its own copy.
    y, w2 = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(xw), tvm.runtime.tensor(w.copy()))
    return y.numpy(), w2.numpy()


def _check_pipelines(mod: tvm.IRModule, view: bool) -> None:
    # TVM's GEMM kernels in both: what differs is only the order the schedule chose.
    ours = tvm.compile(
        mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm", dispatch_gemm=False)
    )
    stock = tvm.compile(mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    for s in (3, 17):
        x, xw, w = _inputs(s)
        y_ref, w_ref = _reference(x, xw, w, view)
        y_ours, w_ours = _run(ours, x, xw, w)
        y_stock, w_stock = _run(stock, x, xw, w)
        # y sums positive and negative terms: tolerances relative to its largest entry.
        scale = float(np.abs(y_ref).max())
        np.testing.assert_allclose(y_stock, y_ref, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(y_ours, y_stock, rtol=1e-6, atol=1e-6 * scale)
        np.testing.assert_allclose(w_stock, w_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(w_ours, w_stock)


# --------------------------------------------------------------------------- the order
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_of_a_parameter_stays_after_its_reader(strategy):
    after = MemoryAwareSchedule(ScheduleOptions(strategies=(strategy,)))(ParamUpdate)
    _assert_update_after_reads(after)
    # The only order that lowers the peak moves the update: the block is left as it was.
    tvm.ir.assert_structural_equal(after, ParamUpdate)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_stays_after_a_read_through_a_reshape_view(strategy):
    after = MemoryAwareSchedule(ScheduleOptions(strategies=(strategy,)))(ViewUpdate)
    order = _order(after)
    assert order.index("wv") < order.index("y") < order.index("w2")
    tvm.ir.assert_structural_equal(after, ViewUpdate)


@pytest.mark.parametrize("mod", [ParamUpdate, ViewUpdate], ids=["direct", "view"])
def test_without_the_write_edges_the_update_would_run_first(mod, monkeypatch):
    """The blocks are built so that a peak-minimizing order runs the update early: with the
    edges of ``_write_edges`` left out, the pass moves it before ``y`` (the wrong
    program these tests guard against)."""
    monkeypatch.setattr(_model.BlockReader, "_write_edges", lambda *args: None)
    pass_ = MemoryAwareSchedule()
    order = _order(pass_(mod))
    assert order.index("w2") < order.index("y")
    assert pass_.last_result["main"].changed


def test_pass_result_reports_no_change():
    pass_ = MemoryAwareSchedule()
    pass_(ParamUpdate)
    assert not pass_.last_result["main"].changed


# --------------------------------------------------------------------------- numerics
def test_compiled_update_reads_the_weight_before_its_update():
    """The full pipeline (MemoryAwareSchedule on the fused graph) and the stock pipeline give
    the same ``y`` and updated weight, both equal to the reference that reads ``w`` first."""
    _check_pipelines(ParamUpdate, view=False)


def test_compiled_program_differs_without_the_write_edges(monkeypatch):
    """The numeric check above fails when the schedule may move the update first."""
    monkeypatch.setattr(_model.BlockReader, "_write_edges", lambda *args: None)
    with pytest.raises(AssertionError):
        _check_pipelines(ParamUpdate, view=False)


# After legalization the reshape of ``w`` is a ``call_tir`` of a reshape kernel, which the block
# model treats as a view (RewriteDataflowReshape makes it one) but ``in_place_writes`` takes for
# a fresh tensor: its reader is not ordered before the update of ``w``.
def test_fused_update_stays_after_a_read_through_a_reshape_kernel():
    fused = lower_to_memory_stage(ViewUpdate, "llvm", stop_before="fused")
    after = MemoryAwareSchedule()(fused)
    _assert_update_after_reads(after)


def test_compiled_update_reads_the_weight_before_its_update_through_a_view():
    _check_pipelines(ViewUpdate, view=True)

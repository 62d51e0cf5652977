# ruff: noqa: E501, F841
"""DispatchGemm: calls of GEMM kernels become calls of ATen's GEMMs after memory planning;
every other kernel, and every allocation, stays as it was."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.contract import GEMM_FUNCS
from blade_relax.frontend import flatten_outputs
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.pipeline import get_pipeline, lower_to_memory_stage
from blade_relax.runtime import gemm as runtime_gemm
from blade_relax.transform import DispatchGemm, GemmOptions, collect_results
from blade_relax.transform import dispatch_gemm as dispatch_module
from blade_relax.transform.dispatch_gemm import gemm_layout


# fmt: off
@I.ir_module
class Before:
    """The memory stage of ``y = x @ w^T; z = x @ v; o = y + z``: two GEMM kernels and an
    elementwise one, called destination-passing style."""

    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(16), T.int64(8)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j, k in T.grid(T.int64(4), T.int64(16), T.int64(8)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    out[vi, vj] = T.float32(0.0)
                out[vi, vj] = out[vi, vj] + x[vi, vk] * w[vj, vk]

    @T.prim_func(private=True, s_tir=True)
    def matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), v: T.Buffer((T.int64(8), T.int64(16)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j, k in T.grid(T.int64(4), T.int64(16), T.int64(8)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    out[vi, vj] = T.float32(0.0)
                out[vi, vj] = out[vi, vj] + x[vi, vk] * v[vk, vj]

    @T.prim_func(private=True, s_tir=True)
    def add(y: T.Buffer((T.int64(4), T.int64(16)), "float32"), z: T.Buffer((T.int64(4), T.int64(16)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(T.int64(4), T.int64(16)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = y[vi, vj] + z[vi, vj]

    @R.function(pure=False)
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((16, 8), "float32"), v: R.Tensor((8, 16), "float32")) -> R.Tensor((4, 16), "float32"):
        cls = Before
        y = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _1 = cls.NT_matmul(x, w, y)
        z = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _2 = cls.matmul(x, v, z)
        o = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _3 = cls.add(y, z, o)
        return o


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def add(y: T.Buffer((T.int64(4), T.int64(16)), "float32"), z: T.Buffer((T.int64(4), T.int64(16)), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(T.int64(4), T.int64(16)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = y[vi, vj] + z[vi, vj]

    @R.function(pure=False)
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((16, 8), "float32"), v: R.Tensor((8, 16), "float32")) -> R.Tensor((4, 16), "float32"):
        cls = Expected
        y = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _1 = R.call_packed("blade_relax.gemm_NT", x, w, y, ty_args=R.Tuple())
        z = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _2 = R.call_packed("blade_relax.gemm_NN", x, v, z, ty_args=R.Tuple())
        o = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _3 = cls.add(y, z, o)
        return o
# fmt: on


def test_gemm_kernels_become_packed_calls_and_nothing_else_changes():
    pass_obj = DispatchGemm()
    after = pass_obj(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert pass_obj.report.dispatched == {"NT": 1, "NN": 1}
    assert pass_obj.report.kept == 0
    assert pass_obj.last_result.changed


def test_a_module_without_gemm_kernels_passes_unchanged():
    mod = tvm.IRModule({"add": Before["add"], "main": Before["main"]})
    # `main` still calls the GEMM kernels by name, but the module has no such PrimFunc.
    mod = tvm.IRModule({"add": Before["add"]})
    pass_obj = DispatchGemm()
    assert pass_obj(mod).same_as(mod)
    assert pass_obj.report.total == 0 and not pass_obj.last_result.changed
    # Before legalization (a relax.matmul, no kernel) nothing is recognized either.
    high = BUILTIN_MODELS["mlp"]()
    after = DispatchGemm()(high)
    tvm.ir.assert_structural_equal(after, high)


# ----------------------------------------------------------------------- recognizing GEMMs
def _kernel(a_shape, b_shape, out_shape, index, dtype="float32", out_dtype=None, extra=None):
    """A one-block TE kernel ``out[idx] = sum_k op(A, B)``; ``index(idx, k)`` gives the A and
    B indices, ``extra`` an elementwise tail (a second block)."""
    a = te.placeholder(a_shape, dtype, name="A")
    b = te.placeholder(b_shape, dtype, name="B")
    k_extent = index.k_extent

    def element(*idx):
        k = te.reduce_axis((0, k_extent), name="k")
        ia, ib = index(idx, k)
        lhs, rhs = a(*ia), b(*ib)
        if out_dtype:
            lhs, rhs = lhs.astype(out_dtype), rhs.astype(out_dtype)
        return te.sum(lhs * rhs, axis=k)

    c = te.compute(out_shape, element, name="C")
    if extra is not None:
        c = te.compute(out_shape, lambda *i: extra(c(*i)), name="D")
    return te.create_prim_func([a, b, c])


def _idx(fn, k_extent):
    fn.k_extent = k_extent
    return fn


NN = _idx(lambda idx, k: ((*idx[:-2], idx[-2], k), (*idx[:-2], k, idx[-1])), 8)
NT = _idx(lambda idx, k: ((*idx[:-2], idx[-2], k), (*idx[:-2], idx[-1], k)), 8)
TN = _idx(lambda idx, k: ((*idx[:-2], k, idx[-2]), (*idx[:-2], k, idx[-1])), 8)
TT = _idx(lambda idx, k: ((*idx[:-2], k, idx[-2]), (*idx[:-2], idx[-1], k)), 8)
WEIGHT_NN = _idx(lambda idx, k: ((*idx[:-2], idx[-2], k), (k, idx[-1])), 8)


@pytest.mark.parametrize(
    ("a", "b", "out", "index", "layout"),
    [
        ((4, 8), (8, 6), (4, 6), NN, "NN"),
        ((4, 8), (6, 8), (4, 6), NT, "NT"),
        ((8, 4), (8, 6), (4, 6), TN, "TN"),
        ((8, 4), (6, 8), (4, 6), TT, "TT"),
        ((2, 4, 8), (2, 8, 6), (2, 4, 6), NN, "NN"),
        ((2, 3, 8, 4), (2, 3, 6, 8), (2, 3, 4, 6), TT, "TT"),
        ((2, 4, 8), (8, 6), (2, 4, 6), WEIGHT_NN, "NN"),
    ],
)
def test_gemm_kernels_are_recognized_with_their_layout(a, b, out, index, layout):
    kernel = gemm_layout(_kernel(a, b, out, index))
    assert kernel is not None and kernel.layout == layout
    assert kernel.ranks == (len(a), len(b), len(out))


BROADCAST = _idx(lambda idx, k: ((idx[0], idx[1], k), (0, k, idx[2])), 8)
SWAPPED_BATCH = _idx(lambda idx, k: ((idx[1], idx[0], idx[2], k), (idx[0], idx[1], k, idx[3])), 8)


@pytest.mark.parametrize(
    "kernel",
    [
        _kernel((2, 4, 8), (1, 8, 6), (2, 4, 6), BROADCAST),  # a broadcast batch axis
        _kernel((3, 2, 4, 8), (2, 3, 8, 6), (2, 3, 4, 6), SWAPPED_BATCH),  # batch axes permuted
        _kernel((4, 8), (8, 6), (4, 6), NN, "float16", out_dtype="float32"),  # mixed precision
        _kernel((4, 8), (8, 6), (4, 6), NN, extra=lambda x: x + 1.0),  # fused with a tail
    ],
    ids=["broadcast", "permuted-batch", "mixed-precision", "fused-tail"],
)
def test_kernels_that_are_more_or_other_than_a_gemm_are_not_recognized(kernel):
    assert gemm_layout(kernel) is None


def test_a_kernel_with_operands_swapped_is_not_a_gemm_of_its_arguments_in_order():
    a = te.placeholder((4, 8), "float32", name="A")
    b = te.placeholder((8, 6), "float32", name="B")
    k = te.reduce_axis((0, 8), name="k")
    c = te.compute((4, 6), lambda i, j: te.sum(b[k, j] * a[i, k], axis=k), name="C")
    assert gemm_layout(te.create_prim_func([a, b, c])) is None


# ------------------------------------------------------------------------------- options
def _module_with(kernels):
    """A lowered-like module calling each kernel once on fresh tensors."""
    bb = relax.BlockBuilder()
    params, calls = [], []
    gvs = {}
    for name, func in kernels.items():
        gvs[name] = bb.add_func(func.with_attr("global_symbol", name), name)
    with bb.function("main", pure=False):
        for name, func in kernels.items():
            shapes = [[int(d) for d in p.ty.shape] for p in func.params]
            args = [
                relax.Var(f"{name}_{i}", relax.TensorType(s, "float32"))
                for i, s in enumerate(shapes[:2])
            ]
            params += args
            out = bb.emit(relax.op.builtin.alloc_tensor(relax.ShapeExpr(shapes[2]), "float32", 0))
            bb.emit(relax.Call(gvs[name], [*args, out]))
            calls.append(out)
        bb.emit_func_output(relax.Tuple(calls), params)
    return bb.get()


@pytest.mark.parametrize(
    ("options", "dispatched", "kept"),
    [
        (GemmOptions(), {"NN": 2, "NT": 1}, 0),
        (GemmOptions(transposed=False), {"NN": 2}, 1),
        (GemmOptions(batched=False), {"NN": 1, "NT": 1}, 1),
        (GemmOptions(dtypes=("float64",)), {}, 3),
    ],
)
def test_options_narrow_what_is_dispatched(options, dispatched, kept):
    mod = _module_with(
        {
            "mm": _kernel((4, 8), (8, 6), (4, 6), NN),
            "nt": _kernel((4, 8), (6, 8), (4, 6), NT),
            "bmm": _kernel((2, 4, 8), (2, 8, 6), (2, 4, 6), NN),
        }
    )
    pass_obj = DispatchGemm(options)
    after = pass_obj(mod)
    assert pass_obj.report.dispatched == dispatched
    assert pass_obj.report.kept == kept
    assert sum(isinstance(f, tvm.tirx.PrimFunc) for f in after.functions.values()) == kept


def test_a_transposed_input_against_a_weight_stays_with_tvm():
    mod = _module_with(
        {
            "tn": _kernel(
                (2, 8, 4),
                (8, 6),
                (2, 4, 6),
                _idx(lambda idx, k: ((idx[0], k, idx[1]), (k, idx[2])), 8),
            )
        }
    )
    pass_obj = DispatchGemm()
    assert pass_obj(mod).same_as(mod)
    assert pass_obj.report.kept == 1


def test_options_are_type_checked():
    with pytest.raises(TypeError, match="GemmOptions"):
        DispatchGemm({"batched": False})  # type: ignore[arg-type]


# ------------------------------------------------------------------- memory and numerics
@pytest.mark.parametrize("model", ["attention", "mlp-train"])
def test_peak_is_at_most_the_undispatched_programs(model):
    """The swap follows memory planning: tensors live where they lived; a split GEMM with an
    epilogue may only drop the workspace of the fused kernel's intermediate."""
    mod = BUILTIN_MODELS[model]()
    flags = {"schedule": True, "plan": True, "simplify": True}
    plain = lower_to_memory_stage(mod, "llvm", **flags)
    dispatched = lower_to_memory_stage(mod, "llvm", dispatch_gemm=True, **flags)
    assert "blade_relax.gemm_" in dispatched.script()
    before, after = (
        memory_timeline(plain["main"], mod=plain),
        memory_timeline(dispatched["main"], mod=dispatched),
    )
    names = {v.name for p in mod["main"].params for v in relax.analysis.tir_vars_in_type(p.ty)}
    assert names
    for s in (1, 9, 100):
        dims = dict.fromkeys(names, s)
        b, a = before.evaluate(dims), after.evaluate(dims)
        assert a.peak <= b.peak and a.peak_workspace <= b.peak_workspace
        assert _tensor_bytes(a) == _tensor_bytes(b)


def _tensor_bytes(timeline):
    """Live bytes without kernel workspace, at each binding that changes them."""
    live = [x - w for x, w in zip(timeline.live_during, timeline.workspace)]
    return [x for i, x in enumerate(live) if i == 0 or x != live[i - 1]]


def _run(mod, flag, s):
    exe = tvm.compile(
        mod, "llvm", relax_pipeline=get_pipeline("llvm", simplify=True, dispatch_gemm=flag)
    )
    vm = relax.VirtualMachine(exe, tvm.cpu())
    rng = np.random.default_rng(s)
    args = [
        rng.standard_normal(
            [s if isinstance(d, tvm.tirx.Var) else int(d) for d in p.ty.shape.values]
        ).astype("float32")
        for p in mod["main"].params
    ]
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in flatten_outputs(out)], args


# fmt: off
@I.ir_module
class Layouts:
    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((16, 8), "float32"), q: R.Tensor((2, "s", 8), "float32")):
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w))                       # NT
            g = R.matmul(R.permute_dims(y), x)                       # TN
            scores = R.matmul(q, R.permute_dims(q, axes=[0, 2, 1]))  # batched NT
            context = R.matmul(scores, q)                            # batched NN
            projected = R.matmul(context, R.permute_dims(w))         # weight, folded rows
            R.output(y, g, context, projected)
        return (y, g, context, projected)
# fmt: on


def test_dispatched_layouts_compute_what_numpy_computes():
    for s in (1, 5, 33):
        (y, g, context, projected), (x, w, q) = _run(Layouts, True, s)
        want_y = x @ w.T
        want_context = (q @ q.transpose(0, 2, 1)) @ q
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, want_y.T @ x, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(context, want_context, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(projected, want_context @ w.T, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------- no PyTorch
@pytest.fixture
def without_torch(monkeypatch):
    """The process as it is without PyTorch: the GEMM functions unregistered, the notice not
    yet given."""
    monkeypatch.setattr(runtime_gemm, "torch_found", lambda: False)
    monkeypatch.setattr(dispatch_module, "_TOLD", False)
    assert not runtime_gemm.register_gemm_functions()
    yield
    monkeypatch.undo()
    assert runtime_gemm.register_gemm_functions()


def test_without_torch_the_pipeline_keeps_tvm_kernels_and_says_so_once(without_torch, caplog):
    assert tvm.get_global_func(GEMM_FUNCS["NN"], allow_missing=True) is None
    with caplog.at_level(logging.WARNING, logger="blade_relax"):
        after = DispatchGemm()(Before)
        outputs, (x, w, q) = _run(Layouts, True, 4)
    assert after.same_as(Before)
    told = [r.getMessage() for r in caplog.records if "not dispatched" in r.getMessage()]
    assert told == [dispatch_module.NOT_DISPATCHED]
    np.testing.assert_allclose(outputs[0], x @ w.T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- symbolic size parameters
# fmt: off
@I.ir_module
class BeforeSized:
    """A GEMM kernel that takes its symbolic size as a scalar parameter, as TVM writes it when
    a buffer's shape is an expression (``b * s`` rows)."""

    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(x_handle: T.handle, w: T.Buffer((T.int64(16), T.int64(8)), "float32"), n: T.int64, out_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_handle, (n, T.int64(8)), "float32")
        out = T.match_buffer(out_handle, (n, T.int64(16)), "float32")
        for i, j, k in T.grid(n, T.int64(16), T.int64(8)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    out[vi, vj] = T.float32(0.0)
                out[vi, vj] = out[vi, vj] + x[vi, vk] * w[vj, vk]

    @R.function(pure=False)
    def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((16, 8), "float32")) -> R.Tensor(("n", 16), "float32"):
        n = T.int64()
        cls = BeforeSized
        y = R.builtin.alloc_tensor(R.shape([n, 16]), R.dtype("float32"), R.prim_value(0))
        _1 = cls.NT_matmul(x, w, R.prim_value(n), y)
        return y


@I.ir_module
class ExpectedSized:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((16, 8), "float32")) -> R.Tensor(("n", 16), "float32"):
        n = T.int64()
        y = R.builtin.alloc_tensor(R.shape([n, 16]), R.dtype("float32"), R.prim_value(0))
        _1 = R.call_packed("blade_relax.gemm_NT", x, w, y, ty_args=R.Tuple())
        return y
# fmt: on


def test_a_kernel_with_size_parameters_is_dispatched_with_its_tensors_alone():
    assert gemm_layout(BeforeSized["NT_matmul"]).buffers == (0, 1, 3)
    pass_obj = DispatchGemm()
    tvm.ir.assert_structural_equal(pass_obj(BeforeSized), ExpectedSized)
    assert pass_obj.report.dispatched == {"NT": 1}


# fmt: off
@I.ir_module
class RowsOfTwoDims:
    @R.function
    def main(x: R.Tensor(("b", "s", 8), "float32"), w: R.Tensor((16, 8), "float32")):
        b, s = T.int64(), T.int64()
        with R.dataflow():
            rows = R.reshape(x, R.shape([b * s, 8]))
            y = R.matmul(rows, R.permute_dims(w))   # a (b * s, 16) GEMM: b and s passed as sizes
            g = R.matmul(R.permute_dims(y), rows)   # TN over the b * s rows
            R.output(y, g)
        return (y, g)
# fmt: on


def test_gemms_over_rows_of_two_symbolic_dims_are_dispatched_and_compute_what_numpy_does():
    lowered = lower_to_memory_stage(RowsOfTwoDims, "llvm", simplify=True, dispatch_gemm=True)
    assert "blade_relax.gemm_NT" in lowered.script() and "blade_relax.gemm_TN" in lowered.script()
    exe = tvm.compile(
        RowsOfTwoDims,
        "llvm",
        relax_pipeline=get_pipeline("llvm", simplify=True, dispatch_gemm=True),
    )
    vm = relax.VirtualMachine(exe, tvm.cpu())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype("float32")
    for b, s in ((1, 3), (2, 5), (4, 17)):
        x = rng.standard_normal((b, s, 8)).astype("float32")
        y, g = (o.numpy() for o in vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)))
        rows = x.reshape(b * s, 8)
        np.testing.assert_allclose(y, rows @ w.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, (rows @ w.T).T @ rows, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------- GEMMs with an epilogue
# fmt: off
@I.ir_module
class WithEpilogue:
    """``out = x @ w + b``, fused as ``FuseOps`` and ``InlineKernelIntermediates`` leave it: the
    GEMM's result is an intermediate, the add reads it element by element."""

    @T.prim_func(private=True, s_tir=True)
    def matmul_add(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(8), T.int64(16)), "float32"), b: T.Buffer((T.int64(16),), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        mm = T.sblock_alloc_buffer((T.int64(4), T.int64(16)))
        for i, j in T.grid(T.int64(4), T.int64(16)):
            for k in range(T.int64(8)):
                with T.sblock("matmul"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        mm[vi, vj] = T.float32(0.0)
                    mm[vi, vj] = mm[vi, vj] + x[vi, vk] * w[vk, vj]
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = mm[vi, vj] + b[vj]

    @R.function(pure=False)
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32"), b: R.Tensor((16,), "float32")) -> R.Tensor((4, 16), "float32"):
        cls = WithEpilogue
        y = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _1 = cls.matmul_add(x, w, b, y)
        return y


@I.ir_module
class WithEpilogueExpected:
    @T.prim_func(private=True, s_tir=True)
    def matmul_add_epilogue(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(8), T.int64(16)), "float32"), b: T.Buffer((T.int64(16),), "float32"), out: T.Buffer((T.int64(4), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(T.int64(4), T.int64(16)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = out[vi, vj] + b[vj]

    @R.function(pure=False)
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32"), b: R.Tensor((16,), "float32")) -> R.Tensor((4, 16), "float32"):
        cls = WithEpilogueExpected
        y = R.builtin.alloc_tensor(R.shape([4, 16]), R.dtype("float32"), R.prim_value(0))
        _0 = R.call_packed("blade_relax.gemm_NN", x, w, y, ty_args=R.Tuple())
        _1 = cls.matmul_add_epilogue(x, w, b, y)
        return y
# fmt: on


def test_a_gemm_with_an_epilogue_becomes_the_packed_gemm_then_the_tail_in_place():
    pass_obj = DispatchGemm()
    after = pass_obj(WithEpilogue)
    tvm.ir.assert_structural_equal(after, WithEpilogueExpected)
    assert pass_obj.report.epilogues == {"NN": 1} and pass_obj.report.dispatched == {}
    # Off, the fused kernel stays TVM's.
    off = DispatchGemm(GemmOptions(epilogues=False))
    tvm.ir.assert_structural_equal(off(WithEpilogue), WithEpilogue)


def _with_tail(tail_index: str, tail_iters: str = "SS") -> tvm.tirx.PrimFunc:
    """``matmul_add`` whose tail reads the GEMM's result at ``tail_index``."""
    source = f'''
@T.prim_func(private=True, s_tir=True)
def kernel(x: T.Buffer((T.int64(4), T.int64(4)), "float32"), w: T.Buffer((T.int64(4), T.int64(4)), "float32"), b: T.Buffer((T.int64(4),), "float32"), out: T.Buffer((T.int64(4), T.int64(4)), "float32")):
    mm = T.sblock_alloc_buffer((T.int64(4), T.int64(4)))
    for i, j, k in T.grid(T.int64(4), T.int64(4), T.int64(4)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                mm[vi, vj] = T.float32(0.0)
            mm[vi, vj] = mm[vi, vj] + x[vi, vk] * w[vk, vj]
    for i, j in T.grid(T.int64(4), T.int64(4)):
        with T.sblock("tail"):
            vi, vj = T.axis.remap("{tail_iters}", [i, j])
            out[vi, vj] = mm[{tail_index}] + b[vj]
'''
    return tvm.script.from_source(source)


def test_only_elementwise_tails_at_the_gemms_element_are_split():
    split = dispatch_module.epilogue_kernel(_with_tail("vi, vj"))
    assert split is not None and split.gemm.layout == "NN" and split.reads == (2,)
    assert gemm_layout(_with_tail("vi, vj")) is None
    # A transposed read (the tail needs other elements than the one it writes) is not a tail.
    assert dispatch_module.epilogue_kernel(_with_tail("vj, vi")) is None
    assert dispatch_module.epilogue_kernel(_with_tail("vi, T.int64(0)")) is None


# fmt: off
@I.ir_module
class InPlace:
    """``r = where(t < 1, 0, x @ w)``: PlanMemory writes ``r`` over ``t``, which dies there;
    ``big`` afterwards is the peak, and leaves room for the GEMM's result."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((8, 8), "float32"), y: R.Tensor(("s", 8), "float32"), wide: R.Tensor((8, 1024), "float32")):
        with R.dataflow():
            t = R.exp(y)
            u = R.sum(t, axis=[1])
            g = R.matmul(x, w)
            r = R.where(R.less(t, R.const(1.0, "float32")), R.const(0.0, "float32"), g)
            big = R.matmul(r, wide)
            R.output(big, u)
        return (big, u)


@I.ir_module
class InPlaceAtPeak:
    """The same without ``big``: the call writing ``r`` over ``t`` is at the peak."""

    @R.function
    def main(x: R.Tensor(("s", 8), "float32"), w: R.Tensor((8, 8), "float32"), y: R.Tensor(("s", 8), "float32")):
        with R.dataflow():
            t = R.exp(y)
            u = R.sum(t, axis=[1])
            g = R.matmul(x, w)
            r = R.where(R.less(t, R.const(1.0, "float32")), R.const(0.0, "float32"), g)
            v = R.sum(r, axis=[1])
            R.output(v, u)
        return (v, u)
# fmt: on


@pytest.mark.parametrize(
    "mod, temporaries, kept_in_place", [(InPlace, 1, 0), (InPlaceAtPeak, 0, 1)]
)
def test_an_output_written_over_a_tail_input_gets_a_tensor_of_its_own_only_below_the_peak(
    mod, temporaries, kept_in_place
):
    """A GEMM written first into an output that lies over a tensor the tail reads would
    overwrite it: the GEMM's result gets a tensor of its own where the timeline proves the
    peak unchanged, else the fused kernel stays TVM's. Both compute what TVM's kernels do."""
    with collect_results() as results:
        exe = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=True))
    (report,) = [r.detail for r in results if r.pass_name == "DispatchGemm"]
    assert (report.temporaries, report.kept_in_place) == (temporaries, kept_in_place)
    reference = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", dispatch_gemm=False))
    vms = [relax.VirtualMachine(e, tvm.cpu()) for e in (exe, reference)]
    for s in (1, 7, 40):
        args = random_arguments(mod["main"], {"s": s}, seed=s)
        got, want = (
            [o.numpy() for o in flatten_outputs(vm["main"](*[tvm.runtime.tensor(a) for a in args]))]
            for vm in vms
        )
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@I.ir_module
class CapturedGemms:
    """Softmax between GEMMs over weights given as parameters (``num_input``): with CUDA graphs
    on, ``RewriteCUDAGraph`` captures the middle GEMM with the softmax kernels around it."""

    @R.function
    def main(
        x: R.Tensor((16, 64), "float32"),
        w1: R.Tensor((64, 256), "float32"),
        w2: R.Tensor((256, 64), "float32"),
    ) -> R.Tensor((16, 256), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.matmul(x, w1)
            a = R.nn.softmax(h)
            y = R.matmul(a, w2)
            b = R.nn.softmax(y)
            z = R.matmul(b, w1)
            R.output(z)
        return z


def test_gemms_a_cuda_graph_captures_stay_tvm_kernels():
    """ATen would launch on PyTorch's stream, outside the capture: the replayed graph would
    run without the GEMM. The GEMMs outside the captured regions are dispatched."""
    from blade_relax.analysis.cuda_graph_pool import captured_functions
    from blade_relax.contract import CUDA_GRAPH_OPTION

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    lowered, reports = {}, {}
    for graphs in (True, False):
        with collect_results() as results:
            with tvm.transform.PassContext(config={CUDA_GRAPH_OPTION: graphs}):
                lowered[graphs] = lower_to_memory_stage(CapturedGemms, target, dispatch_gemm=True)
        (reports[graphs],) = [r.detail for r in results if r.pass_name == "DispatchGemm"]
    assert captured_functions(lowered[True]) == {"main_cuda_graph_capture"}
    assert reports[True].kept_captured == 1 and reports[True].dispatched == {"NN": 2}
    captured = lowered[True]["main_cuda_graph_capture"].script()
    assert "blade_relax.gemm" not in captured and "matmul" in captured
    assert lowered[True]["main"].script().count(GEMM_FUNCS["NN"]) == 2
    # Without CUDA graphs nothing is captured, and every GEMM is dispatched.
    assert captured_functions(lowered[False]) == set()
    assert reports[False].kept_captured == 0 and reports[False].dispatched == {"NN": 3}


@pytest.mark.parametrize(
    "options",
    [
        GemmOptions(),
        GemmOptions(transposed=False),
        GemmOptions(batched=False),
        GemmOptions(epilogues=False),
        GemmOptions(dtypes=("float64",)),
    ],
)
def test_gemms_kept_for_a_capture_are_counted_as_the_swap_would_dispatch_them(options):
    """``GemmReport.kept_captured`` counts the calls the swap would have dispatched under the
    same options, with an epilogue or not, nothing it would have kept."""
    from blade_relax.transform.dispatch_gemm import _dispatchable_calls

    plain = _module_with(
        {
            "mm": _kernel((4, 8), (8, 6), (4, 6), NN),
            "nt": _kernel((4, 8), (6, 8), (4, 6), NT),
            "bmm": _kernel((2, 4, 8), (2, 8, 6), (2, 4, 6), NN),
        }
    )
    for mod in (plain, WithEpilogue):
        pass_obj = DispatchGemm(options)
        pass_obj(mod)
        report = pass_obj.report
        swapped = sum(report.dispatched.values()) + sum(report.epilogues.values())
        assert _dispatchable_calls(mod, mod["main"], options) == swapped + report.kept_in_place

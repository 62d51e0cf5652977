"""ExpandMathIntrinsics: structure (Before / Expected), accuracy against float64, and end to end
against the unexpanded program at several lengths."""

import functools

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.pipeline import get_pipeline, host_target, pipeline_phases
from blade_relax.transform import ExpandMathIntrinsics, MathOptions
from blade_relax.transform.expand_math import expand_prim_func

HOST = host_target()
GENERIC = tvm.target.Target("llvm")


def _run_pass(mod, target=HOST, options=None):
    pass_ = ExpandMathIntrinsics(options)
    with target:
        return pass_(mod), pass_


# ------------------------------------------------------------------------------- structure
@I.ir_module
class Cube:
    @T.prim_func(s_tir=True)
    def cube(x: T.Buffer((T.int64(8),), "float32"), y: T.Buffer((T.int64(8),), "float32")):
        for i in range(T.int64(8)):
            with T.sblock("y"):
                v = T.axis.remap("S", [i])
                y[v] = T.pow(x[v], T.float32(3.0)) + T.pow(x[v], T.float32(2.5))


@I.ir_module
class CubeExpected:
    @T.prim_func(s_tir=True)
    def cube(x: T.Buffer((T.int64(8),), "float32"), y: T.Buffer((T.int64(8),), "float32")):
        for i in range(T.int64(8)):
            with T.sblock("y"):
                v = T.axis.remap("S", [i])
                # pow(x, 2.5) has no product form: it stays libm's.
                y[v] = x[v] * x[v] * x[v] + T.pow(x[v], T.float32(2.5))


def test_integral_powers_become_products_and_others_stay():
    out, pass_ = _run_pass(Cube)
    tvm.ir.assert_structural_equal(out, CubeExpected)
    assert pass_.report.expanded == {"pow": 1}
    assert pass_.report.kernels == 1
    assert pass_.last_result["cube"].changed


@I.ir_module
class Mixed:
    @T.prim_func(s_tir=True)
    def mixed(
        x: T.Buffer((T.int64(8),), "float32"),
        d: T.Buffer((T.int64(8),), "float64"),
        y: T.Buffer((T.int64(8),), "float32"),
        z: T.Buffer((T.int64(8),), "float64"),
    ):
        for i in range(T.int64(8)):
            with T.sblock("y"):
                v = T.axis.remap("S", [i])
                y[v] = T.tanh(T.exp(x[v]))
                z[v] = T.exp(d[v])


def test_exp_inside_tanh_is_expanded_and_float64_is_left_alone():
    out, pass_ = _run_pass(Mixed)
    assert pass_.report.expanded == {"exp": 1, "tanh": 1}
    text = out["mixed"].script()
    assert "T.tanh" not in text
    # The float64 exp is TVM's: one call left.
    assert text.count("T.exp(") == 1 and "T.exp(d[" in text


def test_expand_prim_func_leaves_a_function_without_calls_identical():
    func = CubeExpected["cube"]
    out, counts = expand_prim_func(func, ("exp", "tanh"))
    assert out.same_as(func) and not counts


# -------------------------------------------------------------------------- when it skips
@pytest.mark.parametrize(
    "target, reason",
    [
        (GENERIC, "names no CPU"),
        (tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), "not an llvm target"),
    ],
)
def test_nothing_changes_where_the_expansion_would_not_vectorize(target, reason):
    out, pass_ = _run_pass(Cube, target)
    assert out.same_as(Cube)
    assert reason in pass_.report.skipped
    assert not pass_.last_result.changed
    assert any(reason in note for note in pass_.last_result.notes)


def test_require_mcpu_off_expands_for_a_generic_target():
    out, pass_ = _run_pass(Cube, GENERIC, MathOptions(require_mcpu=False))
    tvm.ir.assert_structural_equal(out, CubeExpected)
    assert pass_.report.skipped is None


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="erf"):
        MathOptions(functions=("exp", "erf"))
    with pytest.raises(TypeError, match="MathOptions"):
        ExpandMathIntrinsics({"functions": ("exp",)})


# ------------------------------------------------------------------------------ accuracy
N = 1 << 16


@I.ir_module
class Unary:
    @T.prim_func(s_tir=True)
    def unary(
        x: T.Buffer((T.int64(N),), "float32"),
        e: T.Buffer((T.int64(N),), "float32"),
        t: T.Buffer((T.int64(N),), "float32"),
        g: T.Buffer((T.int64(N),), "float32"),
    ):
        T.func_attr({"global_symbol": "unary", "tirx.noalias": True})
        for i in range(T.int64(N)):
            with T.sblock("e"):
                v = T.axis.remap("S", [i])
                e[v] = T.exp(x[v])
                t[v] = T.tanh(x[v])
                g[v] = T.sigmoid(x[v])


def _evaluate(mod, x):
    lib = tvm.compile(mod, HOST)
    args = [tvm.runtime.tensor(x)] + [tvm.runtime.tensor(np.zeros_like(x)) for _ in range(3)]
    lib["unary"](*args)
    return [a.numpy() for a in args[1:]]


@pytest.fixture(scope="module")
def sweep():
    """Every float32 region exp meets: a dense sweep of [-110, 95] (both ends beyond its range,
    the subnormal results included), random normals, and the special values."""
    rng = np.random.default_rng(0)
    dense = np.linspace(-110.0, 95.0, N - 4096, dtype=np.float32)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.73, -103.9], np.float32)
    normal = rng.standard_normal(4096 - len(special)).astype(np.float32) * 4
    x = np.concatenate([dense, normal, special])
    expanded, _ = _run_pass(Unary)
    return x, _evaluate(expanded, x), _evaluate(Unary, x)


def _ulps(out, ref64):
    """|out - ref| in units of the float32 spacing at the reference."""
    spacing = np.spacing(np.abs(ref64).astype(np.float32)).astype(np.float64)
    return np.abs(out.astype(np.float64) - ref64) / spacing


def test_exp_is_within_one_unit_in_the_last_place(sweep):
    x, (exp, _, _), _ = sweep
    with np.errstate(over="ignore"):
        ref = np.exp(x.astype(np.float64))
    normal = np.isfinite(ref) & (ref >= np.finfo(np.float32).tiny) & (ref <= 3.4e38)
    assert normal.sum() > N // 2
    assert _ulps(exp[normal], ref[normal]).max() <= 1.0
    # Subnormal results: within one spacing of the smallest subnormal.
    tiny = np.isfinite(ref) & (ref < np.finfo(np.float32).tiny)
    assert np.abs(exp[tiny] - ref[tiny]).max() <= np.finfo(np.float32).smallest_subnormal
    # Overflow, the special values.
    assert np.all(np.isinf(exp[ref > 3.5e38]))
    assert np.isnan(exp[np.isnan(x)]).all()
    assert exp[x == np.inf].tolist() == [np.inf] and exp[x == -np.inf].tolist() == [0.0]
    assert np.all(exp[x == 0] == 1.0)


def test_tanh_and_sigmoid_are_as_accurate_as_tvms_own(sweep):
    x, (_, tanh, sigmoid), (_, tvm_tanh, tvm_sigmoid) = sweep
    finite = np.isfinite(x)
    x64 = x[finite].astype(np.float64)
    with np.errstate(over="ignore"):
        sig_ref = 1.0 / (1.0 + np.exp(-x64))
    tanh_error = np.abs(tanh[finite] - np.tanh(x64)).max()
    sigmoid_error = np.abs(sigmoid[finite] - sig_ref).max()
    # TVM's llvm lowering uses the same formulas on libm's exp: the same error class.
    assert tanh_error <= max(2.0 * np.abs(tvm_tanh[finite] - np.tanh(x64)).max(), 1.2e-7)
    assert sigmoid_error <= max(2.0 * np.abs(tvm_sigmoid[finite] - sig_ref).max(), 1.2e-7)
    assert np.isnan(tanh[np.isnan(x)]).all() and np.isnan(sigmoid[np.isnan(x)]).all()
    assert tanh[x == np.inf].tolist() == [1.0] and tanh[x == -np.inf].tolist() == [-1.0]
    assert sigmoid[x == np.inf].tolist() == [1.0] and sigmoid[x == -np.inf].tolist() == [0.0]


# ---------------------------------------------------------------------------- end to end
@I.ir_module
class Layer:
    @R.function
    def main(x: R.Tensor(("s", 64), "float32"), w: R.Tensor((64, 64), "float32")):
        s = T.int64()
        with R.dataflow():
            h = R.matmul(x, w)
            cube = R.multiply(R.power(h, R.const(3.0, "float32")), R.const(0.044715, "float32"))
            g = R.multiply(h, R.tanh(R.add(h, cube)))
            a = R.nn.softmax(g, axis=-1)
            b = R.multiply(a, R.sigmoid(h))
            out = R.sum(R.exp(R.multiply(b, R.const(-1.0, "float32"))), axis=[1])
            R.output(out)
        return out


@functools.cache
def _layer_executable(expand: bool):
    """The layer compiled with and without the pass, once for every length."""
    return tvm.compile(Layer, HOST, relax_pipeline=get_pipeline(HOST, expand_math=expand))


@pytest.mark.parametrize("length", [1, 7, 64, 130])
def test_the_pipeline_with_expand_math_agrees_with_the_unexpanded_one(length):
    rng = np.random.default_rng(length)
    x = rng.standard_normal((length, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 64)) * 0.2).astype(np.float32)
    outs = []
    for expand in (False, True):
        vm = relax.VirtualMachine(_layer_executable(expand), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-6, atol=0)
    assert not np.array_equal(outs[1], np.zeros_like(outs[1]))


def test_the_pass_leaves_relax_functions_alone_and_expands_every_kind():
    lowered = {}
    for expand in (False, True):
        with HOST:
            lowered[expand] = get_pipeline(HOST, expand_math=expand)(Layer)
    # (The kernels' GlobalVars differ between the two modules: compare the printed functions.)
    assert lowered[True]["main"].script() == lowered[False]["main"].script()
    kernels = [
        f.script() for f in lowered[True].functions.values() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    text = "\n".join(kernels)
    for call in ("T.exp(", "T.tanh(", "T.sigmoid(", "T.pow("):
        assert call not in text, call
    assert any(
        call in f.script() for f in lowered[False].functions.values() for call in ("T.exp(",)
    )


def test_the_pass_runs_after_dispatch_gemm_on_cpu_targets_only():
    finalize = [p.info.name for p in pipeline_phases("host")["finalize"]]
    assert finalize.index("ExpandMathIntrinsics") == finalize.index("DispatchGemm") + 1
    off = pipeline_phases("host", expand_math=False)["finalize"]
    assert "ExpandMathIntrinsics" not in [p.info.name for p in off]
    cuda = pipeline_phases({"kind": "cuda", "arch": "sm_90"}, expand_math=True)
    assert "ExpandMathIntrinsics" not in [p.info.name for ph in cuda.values() for p in ph]

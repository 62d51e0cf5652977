# ruff: noqa: E501
"""FuseAttention: an attention chain becomes one kernel that never holds its score matrix."""

from __future__ import annotations

import functools
import re
from typing import TypeVar

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis.workspace import kernel_workspace
from blade_relax.frontend.builtin import attention_block
from blade_relax.pipeline import PipelineFlags, get_pipeline
from blade_relax.testing.differential import ALL_VARIANTS, Variant, compile_checked, measure_call
from blade_relax.transform import (
    AttentionOptions,
    FuseAttention,
    InlineKernelIntermediates,
    _attention_kernel,
)

from .test_inline_kernel_intermediates import _lowered_scratch


# fmt: off
@I.ir_module
class Attention:
    """Two heads cut out of a fused ``qkv`` projection, scaled, masked, and merged back."""

    @R.function
    def main(qkv: R.Tensor(("s", 12), "float32"), mask: R.Tensor((1, "s", "s"), "float32")):
        s = T.int64()
        with R.dataflow():
            parts = R.split(qkv, indices_or_sections=[4, 8], axis=1)
            q = parts[0]
            k = parts[1]
            v = parts[2]
            qh = R.permute_dims(R.reshape(q, R.shape([s, 2, 2])), axes=[1, 0, 2])
            kh = R.permute_dims(R.reshape(k, R.shape([s, 2, 2])), axes=[1, 2, 0])
            vh = R.permute_dims(R.reshape(v, R.shape([s, 2, 2])), axes=[1, 0, 2])
            scores = R.matmul(qh, kh)
            scaled = R.multiply(scores, R.const(0.5, "float32"))
            masked = R.add(scaled, mask)
            probs = R.nn.softmax(masked, axis=-1)
            ctx = R.matmul(probs, vh)
            merged = R.permute_dims(ctx, axes=[1, 0, 2])
            out = R.reshape(merged, R.shape([s, 4]))
            R.output(out)
        return out


# The kernel's shapes share one symbolic dim, as TVM's printer writes it.
s = TypeVar("s")


@I.ir_module
class AttentionExpected:
    @T.prim_func(private=True, s_tir=True)
    def fused_attention(qkv: T.Buffer((s, T.int64(12)), "float32"), mask: T.Buffer((T.int64(1), s, s), "float32"), attention: T.Buffer((s, T.int64(4)), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        matmul = T.sblock_alloc_buffer((T.int64(2), s, s))
        scores = T.sblock_alloc_buffer((T.int64(2), s, s))
        T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(2), s))
        T_softmax_exp = T.sblock_alloc_buffer((T.int64(2), s, s))
        T_softmax_expsum = T.sblock_alloc_buffer((T.int64(2), s))
        T_softmax_norm = T.sblock_alloc_buffer((T.int64(2), s, s))
        matmul_1 = T.sblock_alloc_buffer((T.int64(2), s, T.int64(2)))
        for i0, i1, i2, k in T.grid(T.int64(2), s, s, T.int64(2)):
            with T.sblock("matmul"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_i2 = T.axis.spatial(s, i2)
                v_k = T.axis.reduce(T.int64(2), k)
                T.reads(qkv[T.min(v_i1, v_i2):T.min(v_i1, v_i2) + (T.max(v_i1, v_i2) + T.int64(1) - T.min(v_i1, v_i2)), v_i0 * T.int64(2) + v_k:v_i0 * T.int64(2) + v_k + T.int64(5)])
                T.writes(matmul[v_i0, v_i1, v_i2])
                with T.init():
                    matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                matmul[v_i0, v_i1, v_i2] = matmul[v_i0, v_i1, v_i2] + qkv[v_i1, v_i0 * T.int64(2) + v_k] * qkv[v_i2, v_i0 * T.int64(2) + v_k + T.int64(4)]
        for i0, i1, i2 in T.grid(T.int64(2), s, s):
            with T.sblock("scores"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_i2 = T.axis.spatial(s, i2)
                T.reads(matmul[v_i0, v_i1, v_i2], mask[T.int64(0), v_i1, v_i2])
                T.writes(scores[v_i0, v_i1, v_i2])
                scores[v_i0, v_i1, v_i2] = matmul[v_i0, v_i1, v_i2] * T.float32(0.5) + mask[T.int64(0), v_i1, v_i2]
        for i0, i1, k in T.grid(T.int64(2), s, s):
            with T.sblock("T_softmax_maxelem"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_k = T.axis.reduce(s, k)
                T.reads(scores[v_i0, v_i1, v_k])
                T.writes(T_softmax_maxelem[v_i0, v_i1])
                with T.init():
                    T_softmax_maxelem[v_i0, v_i1] = T.float32(-340282346638528859811704183484516925440.0)
                T_softmax_maxelem[v_i0, v_i1] = T.max(T_softmax_maxelem[v_i0, v_i1], scores[v_i0, v_i1, v_k])
        for i0, i1, i2 in T.grid(T.int64(2), s, s):
            with T.sblock("T_softmax_exp"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_i2 = T.axis.spatial(s, i2)
                T.reads(scores[v_i0, v_i1, v_i2], T_softmax_maxelem[v_i0, v_i1])
                T.writes(T_softmax_exp[v_i0, v_i1, v_i2])
                T_softmax_exp[v_i0, v_i1, v_i2] = T.exp(scores[v_i0, v_i1, v_i2] - T_softmax_maxelem[v_i0, v_i1])
        for i0, i1, k in T.grid(T.int64(2), s, s):
            with T.sblock("T_softmax_expsum"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_k = T.axis.reduce(s, k)
                T.reads(T_softmax_exp[v_i0, v_i1, v_k])
                T.writes(T_softmax_expsum[v_i0, v_i1])
                with T.init():
                    T_softmax_expsum[v_i0, v_i1] = T.float32(0.0)
                T_softmax_expsum[v_i0, v_i1] = T_softmax_expsum[v_i0, v_i1] + T_softmax_exp[v_i0, v_i1, v_k]
        for i0, i1, i2 in T.grid(T.int64(2), s, s):
            with T.sblock("T_softmax_norm"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_i2 = T.axis.spatial(s, i2)
                T.reads(T_softmax_exp[v_i0, v_i1, v_i2], T_softmax_expsum[v_i0, v_i1])
                T.writes(T_softmax_norm[v_i0, v_i1, v_i2])
                T.sblock_attr({"axis": 2})
                T_softmax_norm[v_i0, v_i1, v_i2] = T_softmax_exp[v_i0, v_i1, v_i2] / T_softmax_expsum[v_i0, v_i1]
        for i0, i1, i2, k in T.grid(T.int64(2), s, T.int64(2), s):
            with T.sblock("matmul_1"):
                v_i0 = T.axis.spatial(T.int64(2), i0)
                v_i1 = T.axis.spatial(s, i1)
                v_i2 = T.axis.spatial(T.int64(2), i2)
                v_k = T.axis.reduce(s, k)
                T.reads(T_softmax_norm[v_i0, v_i1, v_k], qkv[v_k, v_i0 * T.int64(2) + v_i2 + T.int64(8)])
                T.writes(matmul_1[v_i0, v_i1, v_i2])
                with T.init():
                    matmul_1[v_i0, v_i1, v_i2] = T.float32(0.0)
                matmul_1[v_i0, v_i1, v_i2] = matmul_1[v_i0, v_i1, v_i2] + T_softmax_norm[v_i0, v_i1, v_k] * qkv[v_k, v_i0 * T.int64(2) + v_i2 + T.int64(8)]
        for i0, i1 in T.grid(s, T.int64(4)):
            with T.sblock("attention"):
                v_i0 = T.axis.spatial(s, i0)
                v_i1 = T.axis.spatial(T.int64(4), i1)
                T.reads(matmul_1[v_i1 // T.int64(2), v_i0, v_i1 % T.int64(2)])
                T.writes(attention[v_i0, v_i1])
                attention[v_i0, v_i1] = matmul_1[v_i1 // T.int64(2), v_i0, v_i1 % T.int64(2)]

    @R.function
    def main(qkv: R.Tensor((s, 12), dtype="float32"), mask: R.Tensor((1, s, s), dtype="float32")) -> R.Tensor((s, 4), dtype="float32"):
        cls = AttentionExpected
        with R.dataflow():
            out = R.call_tir(cls.fused_attention, (qkv, mask), out_ty=R.Tensor((s, 4), dtype="float32"))
            R.output(out)
        return out


@I.ir_module
class ProbsEscape:
    """A training graph: the backward reads the softmax output, so it must exist."""

    @R.function
    def main(q: R.Tensor((2, "s", 4), "float32"), k: R.Tensor((2, 4, "s"), "float32"), v: R.Tensor((2, "s", 4), "float32")):
        with R.dataflow():
            scores = R.matmul(q, k)
            probs = R.nn.softmax(scores, axis=-1)
            ctx = R.matmul(probs, v)
            both = R.add(R.sum(ctx), R.sum(probs))
            R.output(both)
        return both


@I.ir_module
class SoftmaxOverRows:
    """A softmax over another axis than the last is not an attention."""

    @R.function
    def main(q: R.Tensor((2, "s", 4), "float32"), k: R.Tensor((2, 4, "s"), "float32"), v: R.Tensor((2, "s", 4), "float32")):
        with R.dataflow():
            scores = R.matmul(q, k)
            probs = R.nn.softmax(scores, axis=1)
            ctx = R.matmul(probs, v)
            R.output(ctx)
        return ctx


@I.ir_module
class SymbolicReshape:
    """A reshape that moves the symbolic dim across constant ones has no affine index map."""

    @R.function
    def main(q: R.Tensor(("s", 8), "float32"), k: R.Tensor((2, 4, "s"), "float32"), v: R.Tensor((2, "s", 4), "float32")):
        s = T.int64()
        with R.dataflow():
            qh = R.reshape(q, R.shape([2, s, 4]))
            scores = R.matmul(qh, k)
            probs = R.nn.softmax(scores, axis=-1)
            ctx = R.matmul(probs, v)
            R.output(ctx)
        return ctx
@I.ir_module
class SingleHead:
    """No head axis: the keys are transposed once, outside the row loop."""

    @R.function
    def main(q: R.Tensor(("s", 8), "float32"), k: R.Tensor((8, "s"), "float32"), v: R.Tensor(("s", 8), "float32")):
        with R.dataflow():
            scores = R.matmul(q, k)
            probs = R.nn.softmax(scores, axis=-1)
            ctx = R.matmul(probs, v)
            R.output(ctx)
        return ctx


@I.ir_module
class SharedKeys:
    """A batch and a head axis; the keys and values broadcast over the heads."""

    @R.function
    def main(q: R.Tensor((2, 3, "s", 4), "float32"), k: R.Tensor((2, 1, 4, "s"), "float32"), v: R.Tensor((2, 1, "s", 4), "float32")):
        with R.dataflow():
            scores = R.matmul(q, k)
            scaled = R.multiply(scores, R.const(0.5, "float32"))
            probs = R.nn.softmax(scaled, axis=-1)
            ctx = R.matmul(probs, v)
            R.output(ctx)
        return ctx


# The attention of two layers sharing the mask a Hugging Face model builds: an ``arange``
# compared with another (causal), a padding mask indexed, a ``where`` of 0 and the lowest
# float32; two heads of 4. ``{padding}`` is the (1, s) padding mask, ``{result}`` what ``both``
# is.
_CAUSAL_TEMPLATE = """
@I.ir_module
class Module:
    @R.function
    def main(qkv1: R.Tensor((1, "s", 24), "float32"), qkv2: R.Tensor((1, "s", 24), "float32"), pad: R.Tensor((1, "s"), "bool")):
        s = T.int64()
        with R.dataflow():
            batch = R.arange(0, 1, 1, dtype="int64")
            keys_at = R.arange(0, s, 1, dtype="int64")
            rows_at = R.add(R.arange(0, s, 1, dtype="int64"), R.const(0, "int64"))
            b4 = R.expand_dims(batch, axis=[1, 2, 3])
            rows = R.expand_dims(rows_at, axis=[0, 1, 3])
            cols = R.expand_dims(keys_at, axis=[0, 1, 2])
            causal = R.less_equal(cols, rows)
            padded = R.index_tensor({padding}, (b4, cols))
            allowed = R.bitwise_and(causal, padded)
            mask = R.where(allowed, R.full(R.shape([]), R.const(0.0, "float32"), dtype="float32"), R.const(-3.4028234663852886e38, "float32"))
{layers}            both = {result}
            R.output(both)
        return both
"""
_CAUSAL_LAYER = """            parts{n} = R.split(qkv{n}, indices_or_sections=[8, 16], axis=2)
            qh{n} = R.permute_dims(R.reshape(parts{n}[0], R.shape([1, s, 2, 4])), axes=[0, 2, 1, 3])
            kh{n} = R.permute_dims(R.reshape(parts{n}[1], R.shape([1, s, 2, 4])), axes=[0, 2, 3, 1])
            vh{n} = R.permute_dims(R.reshape(parts{n}[2], R.shape([1, s, 2, 4])), axes=[0, 2, 1, 3])
            scores{n} = R.multiply(R.matmul(qh{n}, kh{n}), R.const(0.5, "float32"))
            probs{n} = R.nn.softmax(R.add(scores{n}, mask), axis=-1)
            ctx{n} = R.permute_dims(R.matmul(probs{n}, vh{n}), axes=[0, 2, 1, 3])
            out{n} = R.reshape(ctx{n}, R.shape([1, s, 8]))
"""


def _causal_module(padding: str, result: str) -> tvm.IRModule:
    layers = "".join(_CAUSAL_LAYER.format(n=n) for n in (1, 2))
    text = _CAUSAL_TEMPLATE.format(padding=padding, layers=layers, result=result)
    return tvm.script.from_source(text)


#: The padding mask is an input.
CausalAttention = _causal_module("pad", "R.add(out1, out2)")
#: The padding mask is ones (``full_like``, as a model without ``attention_mask`` builds it):
#: the mask is causal, and the rows stop at the diagonal.
CausalOnly = _causal_module(
    'R.astype(R.full_like(pad, R.const(1, "int64"), dtype="int64"), dtype="bool")',
    "R.add(out1, out2)",
)
#: The mask is also read outside the attentions: it stays a tensor.
CausalMaskAlsoRead = _causal_module("pad", "R.add(R.add(out1, out2), R.sum(mask))")
#: The mask compares values read from a tensor (Llama 4's chunks compare positions divided by
#: the chunk's length).
CausalWithinChunks = _causal_module(
    'R.equal(R.astype(pad, dtype="int64"), R.floor_divide(R.astype(pad, dtype="int64"), '
    'R.const(16, "int64")))',
    "R.add(out1, out2)",
)
# fmt: on


def _fail_schedule(monkeypatch):
    """Make every schedule of the kernel fail, as one the scheduler cannot apply would."""
    monkeypatch.setattr(_attention_kernel, "_schedule", lambda kernel, *args: None)


def _loops(func: tvm.tirx.PrimFunc) -> dict[str, list[str]]:
    """The extents of the loops around each block of ``func``, outermost first, as printed."""
    sch = tvm.s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    return {
        sch.get(b).name_hint: [
            re.sub(r"T\.int64\((\d+)\)", r"\1", str(sch.get(loop).extent))
            for loop in sch.get_loops(b)
        ]
        for b in blocks
    }


def test_attention_chain_becomes_one_kernel(monkeypatch):
    pass_ = FuseAttention()
    after = pass_(Attention)
    assert list(after["main"].params) and "fused_attention" in [
        g.name_hint for g in after.functions
    ]
    # Where its schedule fails, the kernel is the plain one, stage by stage.
    _fail_schedule(monkeypatch)
    tvm.ir.assert_structural_equal(pass_(Attention), AttentionExpected)
    # Core: matmul, multiply, add, softmax, matmul; absorbed: split, its items, reshapes,
    # transposes on the way in, the transpose and reshape on the way out.
    assert (pass_.report.fused, pass_.report.absorbed) == (1, 12)


@pytest.mark.parametrize("module", [ProbsEscape, SoftmaxOverRows, SymbolicReshape])
def test_other_chains_pass_through(module):
    pass_ = FuseAttention()
    assert pass_(module).same_as(module)
    assert pass_.report.fused == 0


def test_last_result_says_what_changed_per_function():
    pass_ = FuseAttention()
    pass_(Attention)
    main = pass_.last_result["main"]
    assert main.changed and main.changes == (
        "1 attention chain fused",
        "12 layout bindings absorbed",
    )
    assert pass_.last_result.changed_functions == (main,)
    pass_(ProbsEscape)
    assert not pass_.last_result.changed and not pass_.last_result["main"].changed


def test_core_only_and_options():
    core = FuseAttention(AttentionOptions(absorb_inputs=False))
    after = core(Attention)
    assert (core.report.fused, core.report.absorbed) == (1, 0)
    # The layout operators stay bindings of main; the kernel reads the heads they produce.
    assert (
        "R.split" in after["main"].script() and "R.split" not in after.script().split("def main")[0]
    )
    assert FuseAttention(AttentionOptions(enabled=False))(Attention).same_as(Attention)
    with pytest.raises(ValueError, match="max_group"):
        AttentionOptions(max_group=3)
    with pytest.raises(TypeError, match="AttentionOptions"):
        FuseAttention(3)


def _axes(line: str) -> list[str]:
    """The extents of a printed ``alloc_buffer((...))``, one string each."""
    shape = line.split("alloc_buffer((", 1)[1]
    axes, depth, start = [], 0, 0
    for i, char in enumerate(shape):
        if char == "(":
            depth += 1
        elif char == ")" and depth == 0:
            return [*axes, shape[start:i].strip()]
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            axes.append(shape[start:i].strip())
            start = i + 1
    raise ValueError(line)


def _row_scratch(mod: tvm.IRModule) -> list[str]:
    """The scratch buffers of the fused kernel after TVM's own compaction, as printed."""
    return _lowered_scratch(mod["fused_attention"])


@pytest.mark.parametrize("copy_keys", [False, True])
def test_kernel_computes_one_row_at_a_time(copy_keys):
    """The kernel computes the scores, their softmax and ``P @ V`` one row at a time: no
    scratch buffer has two ``s`` axes; the rows of ``s`` are the scores (then their ``exp``,
    in place) and, with ``copy_keys``, the keys of one head (``(1, 2, s)``, contiguous along
    a row of scores)."""
    fused = FuseAttention(AttentionOptions(copy_keys=copy_keys))(Attention)
    scratch = _row_scratch(fused)
    with_s = {line.split(" =")[0]: [a for a in _axes(line) if "s" in a] for line in scratch}
    expected = {"matmul": 1, "row_exp": 1}
    assert {name: len(axes) for name, axes in with_s.items() if axes} == (
        {**expected, "keys": 1} if copy_keys else expected
    ), scratch
    keys = "keys = T.sblock_alloc_buffer((T.int64(1), T.int64(2), s))"
    assert any(keys in x for x in scratch) is copy_keys
    # InlineKernelIntermediates finds nothing left to do in it.
    inline = InlineKernelIntermediates()
    assert _row_scratch(inline(fused)) == scratch
    assert inline.report.kernels == 0


@pytest.mark.parametrize("copy_keys", [False, True])
def test_kernel_loop_order(copy_keys):
    """The inner loops run along contiguous elements: ``S[j] += Q[k] * K[j, k]`` with ``k``
    inner (with ``copy_keys``: ``S[j] += Q[k] * K^T[k, j]`` with ``j`` inner),
    ``O[d] += P[k] * V[k, d]`` with ``d`` inner, the maximum over 16 lanes, the sum in
    ascending order; ``exp`` is computed once per score."""
    kernel = FuseAttention(AttentionOptions(copy_keys=copy_keys))(Attention)["fused_attention"]
    loops = _loops(kernel)
    if copy_keys:
        assert loops["keys"][0] == "2"  # one head at a time
        assert loops["matmul_update"][-2:] == ["2", "s"]  # k, then j
    else:
        assert "keys" not in loops
        assert loops["matmul_update"][-2:] == ["s", "2"]  # j, then k
    assert loops["matmul_1_update"][-2:] == ["s", "2"]  # k, then d
    assert loops["row_max_lanes_update"][-2:] == ["s // 16", "16"]
    # The tails' inits are outside their loops, which run no iteration where 16 divides s.
    assert loops["row_max_tail_update"][-1] == "s % 16"
    assert "s % 16" not in loops["row_max_tail_init"]
    assert loops["row_sum"][-1] == "s" and "row_sum_lanes_update" not in loops
    # Every stage but the keys is under the head and row loops.
    assert all(nest[:2] == ["2", "s"] for name, nest in loops.items() if name != "keys")
    assert kernel.script().count("T.exp(") == 1


def test_fallback_kernel_computes_one_row_at_a_time(monkeypatch):
    """Where the schedule fails, InlineKernelIntermediates computes the plain kernel row by
    row."""
    _fail_schedule(monkeypatch)
    fused = FuseAttention()(Attention)
    before = _row_scratch(fused)
    assert any("(T.int64(2), s, s)" in line for line in before), before
    inline = InlineKernelIntermediates()
    after = _row_scratch(inline(fused))
    assert inline.report.rows >= 4
    assert after and not any("s, s" in line for line in after), after


ATTENTION = Variant("attention", fuse_attention=True, inline_kernels=True)
KEYS = Variant(
    "attention",  # the same outputs are expected of it
    pipeline=lambda target: get_pipeline(
        target,
        **{**dict.fromkeys(PipelineFlags.switches(), False), **ATTENTION.flags},
        attention_options=AttentionOptions(copy_keys=True),
    ),
)
STOCK = Variant("none")


@functools.cache
def _compiled(module: tvm.IRModule, variant: Variant):
    """``compile_checked`` once per module and variant: the tests below run each build at
    several lengths (a VM per test)."""
    return compile_checked(module, variant)


@pytest.mark.parametrize("s", [1, 7, 33])
def test_results_and_bytes_against_the_unfused_graph(s):
    rng = np.random.default_rng(s)
    qkv = rng.standard_normal((s, 12)).astype("float32")
    mask = np.triu(np.full((s, s), -1e9, "float32"), 1)[None]
    runs = {}
    for variant in (STOCK, ATTENTION):
        compiled = _compiled(Attention, variant)
        runs[variant.name] = measure_call(compiled.vm(), [qkv, mask])
    # Bit for bit: the matmuls and the sum keep their order, the maximum takes none.
    _assert_equal(runs["attention"].outputs, runs["none"].outputs)
    # The unfused graph holds the scores and probabilities, (2, s, s) each; the kernel holds a
    # row of each, and no split copies.
    assert runs["attention"].peak < runs["none"].peak


def _assert_equal(actual, desired) -> None:
    """Bit for bit (the generic llvm target the harness compiles for has no fused
    multiply-add, so LLVM contracts neither kernel's products and sums)."""
    assert len(actual) == len(desired)
    for a, d in zip(actual, desired):
        np.testing.assert_array_equal(a, d)


@pytest.mark.parametrize("s", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("module", [SingleHead, SharedKeys])
@pytest.mark.parametrize("attention", [ATTENTION, KEYS], ids=["in-place", "copy-keys"])
def test_other_ranks_against_the_unfused_graph(module, s, attention):
    """Shapes around the 16 lanes of the maximum, no head axis, a batch axis and keys shared
    by the heads."""
    assert FuseAttention()(module)["main"].script().count("R.call_tir") == 1
    rng = np.random.default_rng(s)
    args = [
        rng.standard_normal(
            [s if isinstance(d, tvm.tirx.Var) else int(d) for d in p.ty.shape]
        ).astype("float32")
        * 2
        for p in module["main"].params
    ]
    outs = {}
    for variant in (STOCK, attention):
        outs[variant.name] = measure_call(_compiled(module, variant).vm(), args).outputs
    _assert_equal(outs["attention"], outs["none"])


def test_fallback_kernel_against_the_unfused_graph(monkeypatch):
    _fail_schedule(monkeypatch)
    test_results_and_bytes_against_the_unfused_graph(7)


@pytest.mark.parametrize("s", [1, 16, 17, 57])
@pytest.mark.parametrize("attention", [ATTENTION, KEYS], ids=["in-place", "copy-keys"])
def test_gpt2_sized_heads_against_the_unfused_graph(s, attention):
    """Two heads of 32 (a row of ``V`` is two AVX-512 vectors, a row of keys two cache lines)
    in the builtin attention block, against the unfused graph."""
    mod = attention_block(hidden=64, heads=2)
    rng = np.random.default_rng(s)
    args = [rng.standard_normal((s, 64)).astype("float32")]
    args += [rng.standard_normal((64, 64)).astype("float32") * 0.3 for _ in range(4)]
    outs = {}
    for variant in (STOCK, attention):
        outs[variant.name] = measure_call(compile_checked(mod, variant).vm(), args).outputs
    _assert_equal(outs["attention"], outs["none"])


def test_attention_block_in_the_default_pipeline():
    """The builtin attention block (separate q/k/v projections) is fused in the default CPU
    pipeline, which then computes the same result in fewer bytes."""
    mod = attention_block(hidden=16, heads=2)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((40, 16)).astype("float32")]
    args += [rng.standard_normal((16, 16)).astype("float32") * 0.3 for _ in range(4)]
    default = next(v for v in ALL_VARIANTS if v.name == "all").flags  # the default pipeline
    runs = {}
    for fused in (True, False):
        variant = Variant(f"default-{fused}", **{**default, "fuse_attention": fused})
        runs[fused] = measure_call(compile_checked(mod, variant).vm(), args)
    np.testing.assert_allclose(runs[True].outputs, runs[False].outputs, rtol=1e-5, atol=1e-6)
    assert runs[True].peak < runs[False].peak
    fuse = FuseAttention()
    fuse(mod)
    assert fuse.report.fused == 1


CAUSAL_LENGTHS = [1, 3, 4, 9, 17, 33]
NO_MASKS = Variant(
    "attention",
    pipeline=lambda target: get_pipeline(
        target,
        **{**dict.fromkeys(PipelineFlags.switches(), False), **ATTENTION.flags},
        attention_options=AttentionOptions(absorb_masks=False),
    ),
)


def _causal_args(module: tvm.IRModule, s: int) -> list[np.ndarray]:
    rng = np.random.default_rng(s)
    pad = np.ones((1, s), bool)
    pad[0, s // 2] = False  # a padded position inside the sequence
    return [rng.standard_normal((1, s, 24)).astype("float32") for _ in range(2)] + [pad]


def test_mask_is_computed_in_the_kernel():
    """The mask's bindings are copied into both kernels, which read the padding mask and the
    heads: no ``(1, 1, s, s)`` tensor is left in ``main``. Where the mask is gone, the keys of
    a head are copied where they fit in what it held (4 s^2 bytes >= 16 s: s >= 4)."""
    pass_ = FuseAttention()
    after = pass_(CausalAttention)
    assert (pass_.report.fused, pass_.report.masks) == (2, 24)
    main = after["main"]
    calls = [b.value for b in main.body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.call_tir", "relax.call_tir", "relax.add"]
    assert [[a.name for a in c.args[1].fields] for c in calls[:2]] == [
        ["pad", "qkv1"],
        ["pad", "qkv2"],
    ]
    assert pass_.last_result["main"].changes[-1] == "24 mask bindings computed in the kernels"
    kernel = after["fused_attention"]
    assert "keys = T.sblock_alloc_buffer" in kernel.script()
    # The workspace (a row of scores, the keys where they fit) is described exactly, from
    # the lowered kernel, whose sizes divide by powers of two as shifts.
    ws = kernel_workspace(kernel, "fused_attention")
    assert ws.exact, ws.notes
    for length in CAUSAL_LENGTHS:
        keys = 16 * length if length >= 4 else 0
        assert ws.evaluate([length]) == 4 * length + keys, length


def test_mask_read_elsewhere_stays_and_keys_are_read_in_place():
    pass_ = FuseAttention()
    after = pass_(CausalMaskAlsoRead)
    assert pass_.report.masks == 24
    assert "R.where" in after["main"].script()  # for R.sum
    assert "keys" not in after["fused_attention"].script()
    off = FuseAttention(AttentionOptions(copy_keys_within_mask=False))(CausalAttention)
    assert "keys" not in off["fused_attention"].script()
    kept = FuseAttention(AttentionOptions(absorb_masks=False))
    assert "R.where" in kept(CausalAttention)["main"].script() and kept.report.masks == 0


@pytest.mark.parametrize("s", CAUSAL_LENGTHS)
@pytest.mark.parametrize("module", [CausalAttention, CausalMaskAlsoRead])
def test_causal_mask_against_the_unfused_graph(module, s):
    """Bit for bit against the unfused graph (the mask is computed as TVM's kernels compute
    it), at lengths on both sides of the keys copy; the peak is below the kernel's that reads
    the mask as a tensor, keys copy included (where the mask stays, no keys are copied)."""
    args = _causal_args(module, s)
    runs = {}
    for name, variant in (("none", STOCK), ("fused", ATTENTION), ("tensor", NO_MASKS)):
        runs[name] = measure_call(_compiled(module, variant).vm(), args)
    _assert_equal(runs["fused"].outputs, runs["none"].outputs)
    _assert_equal(runs["tensor"].outputs, runs["none"].outputs)
    if module is CausalAttention:
        # At s = 4 the keys of a head take exactly what the mask held.
        saved = runs["tensor"].peak - runs["fused"].peak
        assert saved == 0 if s == 4 else saved > 0
    else:  # no keys copied; the mask is made where its other reader needs it
        assert runs["fused"].peak <= runs["tensor"].peak


def test_causal_rows_stop_at_the_diagonal():
    """With a causal mask and no padding, the kernel proves the mask is the lowest float above
    the diagonal and 0 on it: row ``i`` computes ``i + 1`` scores (its maximum, sum and
    ``P @ V`` loops run to ``i + 1``); with a padding mask it cannot, and rows run to ``s``."""
    kernel = FuseAttention()(CausalOnly)["fused_attention"]
    assert [p.name for p in kernel.params][-1] == "attention"  # the row length is no parameter
    loops = _loops(kernel)
    length = loops["row_sum"][-1]
    assert re.fullmatch(r"i\d \+ 1", length), loops["row_sum"]
    assert loops["matmul_1_update"][-2] == length
    assert loops["row_max_lanes_update"][-2] == f"({length}) // 16"
    # The keys of a head: all of them (an extent of s written with max and min; no row).
    assert "s" in loops["keys"][-1] and not re.search(r"\bi\d", loops["keys"][-1])
    padded = _loops(FuseAttention()(CausalAttention)["fused_attention"])
    assert padded["row_sum"][-1] == "s"
    off = _loops(FuseAttention(AttentionOptions(stop_rows=False))(CausalOnly)["fused_attention"])
    assert off["row_sum"][-1] == "s"


def test_a_mask_comparing_tensor_values_is_not_proven_causal():
    """TVM's simplifier cannot hash a tensor read inside a comparison (it raises a
    ``TypeError``): such a mask is not proven causal, and the attention is fused with every
    row running to ``s``."""
    pass_ = FuseAttention()
    kernel = pass_(CausalWithinChunks)["fused_attention"]
    assert pass_.report.fused == 2
    assert _loops(kernel)["row_sum"][-1] == "s"
    args = _causal_args(CausalWithinChunks, 17)
    outs = [
        measure_call(_compiled(CausalWithinChunks, v).vm(), args).outputs
        for v in (STOCK, ATTENTION)
    ]
    _assert_equal(outs[1], outs[0])


@pytest.mark.parametrize("s", CAUSAL_LENGTHS + [40])
def test_causal_rows_against_the_unfused_graph(s):
    """Bit for bit: the scores above the diagonal add exact zeros to the sum and to ``P @ V``."""
    args = _causal_args(CausalOnly, s)
    args[0] *= 4  # larger scores, so that probabilities differ widely
    outs = {}
    for name, variant in (("none", STOCK), ("fused", ATTENTION)):
        outs[name] = measure_call(_compiled(CausalOnly, variant).vm(), args).outputs
    _assert_equal(outs["fused"], outs["none"])

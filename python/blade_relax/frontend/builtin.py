"""Small built-in Relax models with a symbolic dimension, for the demo, tests and tutorials.

Each builder returns an ``IRModule`` whose ``main`` takes the activations first and the weights
after, with the dynamic dims named ``s`` (sequence length) or ``b`` (batch).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

__all__ = [
    "BUILTIN_MODELS",
    "attention_block",
    "concat_split",
    "layer_norm_block",
    "mlp",
    "mlp_training_step",
    "random_arguments",
]


def _tensor(shape, dtype: str = "float32") -> relax.TensorType:
    return relax.TensorType(shape, dtype)


def mlp(hidden: int = 64, intermediate: int = 256) -> tvm.IRModule:
    """``relu(x @ w1) @ w2 + x`` with ``x: (s, hidden)``."""
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((s, hidden)))
    w1 = relax.Var("w1", _tensor((hidden, intermediate)))
    w2 = relax.Var("w2", _tensor((intermediate, hidden)))
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w1))
            a = bb.emit(relax.op.nn.relu(h))
            o = bb.emit(relax.op.matmul(a, w2))
            out = bb.emit_output(relax.op.add(o, x))
        bb.emit_func_output(out)
    return bb.get()


def attention_block(hidden: int = 64, heads: int = 4) -> tvm.IRModule:
    """Single-head-group self-attention with an output projection, ``x: (s, hidden)``."""
    head_dim = hidden // heads
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((s, hidden)))
    wq = relax.Var("wq", _tensor((hidden, hidden)))
    wk = relax.Var("wk", _tensor((hidden, hidden)))
    wv = relax.Var("wv", _tensor((hidden, hidden)))
    wo = relax.Var("wo", _tensor((hidden, hidden)))
    op = relax.op
    with bb.function("main", [x, wq, wk, wv, wo]):
        with bb.dataflow():
            heads_of = []
            for w in (wq, wk, wv):
                proj = bb.emit(op.matmul(x, w))
                split = bb.emit(op.reshape(proj, (s, heads, head_dim)))
                heads_of.append(bb.emit(op.permute_dims(split, [1, 0, 2])))
            q, k, v = heads_of
            kt = bb.emit(op.permute_dims(k, [0, 2, 1]))
            scores = bb.emit(op.matmul(q, kt))
            scaled = bb.emit(op.multiply(scores, relax.const(1.0 / head_dim**0.5, "float32")))
            probs = bb.emit(op.nn.softmax(scaled, axis=-1))
            ctx = bb.emit(op.matmul(probs, v))
            merged = bb.emit(op.permute_dims(ctx, [1, 0, 2]))
            flat = bb.emit(op.reshape(merged, (s, hidden)))
            out = bb.emit_output(op.matmul(flat, wo))
        bb.emit_func_output(out)
    return bb.get()


def layer_norm_block(hidden: int = 64) -> tvm.IRModule:
    """``layer_norm(x) * 2 + x`` followed by a projection, ``x: (b, s, hidden)``."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((b, s, hidden)))
    gamma = relax.Var("gamma", _tensor((hidden,)))
    beta = relax.Var("beta", _tensor((hidden,)))
    w = relax.Var("w", _tensor((hidden, hidden)))
    op = relax.op
    with bb.function("main", [x, gamma, beta, w]):
        with bb.dataflow():
            norm = bb.emit(op.nn.layer_norm(x, gamma, beta, axes=[-1]))
            doubled = bb.emit(op.multiply(norm, relax.const(2.0, "float32")))
            resid = bb.emit(op.add(doubled, x))
            out = bb.emit_output(op.matmul(resid, w))
        bb.emit_func_output(out)
    return bb.get()


def concat_split(hidden: int = 32) -> tvm.IRModule:
    """Concatenation along the dynamic axis, a split, and a tuple output, ``x: (s, hidden)``."""
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((s, hidden)))
    y = relax.Var("y", _tensor((s, hidden)))
    op = relax.op
    with bb.function("main", [x, y]):
        with bb.dataflow():
            e = bb.emit(op.exp(x))
            cat = bb.emit(op.concat([e, y], axis=0))
            t = bb.emit(op.tanh(cat))
            parts = bb.emit(op.split(t, 2, axis=0))
            first = bb.emit(relax.TupleGetItem(parts, 0))
            second = bb.emit(relax.TupleGetItem(parts, 1))
            total = bb.emit(op.add(first, second))
            out = bb.emit_output(relax.Tuple([total, e]))
        bb.emit_func_output(out)
    return bb.get()


def mlp_training_step(hidden: int = 32, intermediate: int = 64) -> tvm.IRModule:
    """Loss ``sum(mlp(x) ** 2)`` and its gradients w.r.t. the weights, with a dynamic batch.

    Built by ``relax.transform.Gradient``; ``main`` returns ``(loss, (grad_w1, grad_w2))``.
    """
    b = tvm.tirx.Var("b", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((b, hidden)))
    w1 = relax.Var("w1", _tensor((hidden, intermediate)))
    w2 = relax.Var("w2", _tensor((intermediate, hidden)))
    op = relax.op
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(op.matmul(x, w1))
            a = bb.emit(op.tanh(h))
            o = bb.emit(op.matmul(a, w2))
            r = bb.emit(op.add(o, x))
            sq = bb.emit(op.multiply(r, r))
            loss = bb.emit_output(op.sum(sq))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=[w1, w2])(bb.get())
    main = mod["main_adjoint"].with_attr("global_symbol", "main")
    return tvm.IRModule({"main": main})


BUILTIN_MODELS: dict[str, Callable[[], tvm.IRModule]] = {
    "mlp": mlp,
    "attention": attention_block,
    "layer-norm": layer_norm_block,
    "concat-split": concat_split,
    "mlp-train": mlp_training_step,
}


def random_arguments(func: relax.Function, dims: dict[str, int], seed: int = 0) -> list[np.ndarray]:
    """Random float arrays for the parameters of ``func`` at the concrete ``dims``."""
    rng = np.random.default_rng(seed)
    arrays = []
    for param in func.params:
        ty = param.ty
        shape = [_eval(value, dims) for value in ty.shape.values]
        arrays.append((rng.standard_normal(shape) * 0.5).astype(str(ty.dtype)))
    return arrays


def _eval(value: tvm.tirx.PrimExpr, dims: dict[str, int]) -> int:
    from ..symbolic import SymbolicExpr

    return SymbolicExpr.from_prim_expr(value).evaluate(dims)

"""Complex tensors of an exported graph as pairs of real ones, before the import.

Some models rotate queries and keys with complex numbers: Llama 4 and DeepSeek-V2 view each
pair of channels as one complex number (``view_as_complex``), multiply it by ``polar(1,
angle)`` and view the product as real again (``view_as_real``); their backward multiplies by
the conjugate (``_conj``). Relax has no complex dtype, and TVM's importer has no converter for
those operators, so such a model used to be refused by name.

:func:`as_real_pairs` rewrites the ``torch.fx`` graph of an ``ExportedProgram`` in place, before
it is imported: every complex tensor ``z`` of shape ``S`` becomes the real tensor of shape ``S +
(2,)`` that ``view_as_real(z)`` would give (real part, imaginary part), and every operator on
complex tensors becomes ATen operators on those pairs, which the importer converts as any others:

``view_as_complex(x)``, ``view_as_real(z)``
    Nothing: ``x`` is already the pair, the pair is the result.
``polar(r, a)``
    ``stack([r * cos(a), r * sin(a)], -1)``.
``mul(z, w)``
    Both complex: ``(zr wr - zi wi, zr wi + zi wr)``; ``w`` real (a tensor, broadcast over the
    pair, or a real number): the pair times ``w``.
``add(z, w)``, ``sub(z, w)``
    Both complex, without ``alpha``: on the pairs.
``_conj(z)``, ``conj_physical(z)``, ``_conj_physical(z)``
    ``(zr, -zi)``.
``unsqueeze``, ``squeeze``, ``sum``, ``permute``
    The same operator on the pair, its axes counted from the start (an axis counted from the
    end would name another one once the pair's axis is last; where ``sum`` or ``squeeze`` names
    none, every axis of the complex tensor).
``view``, ``reshape``, ``expand``
    The same operator to the complex shape followed by the pair's 2.
``neg``, ``clone``, ``alias``, ``detach``
    The same operator on the pair.
``to`` and ``_to_copy`` to a complex dtype
    The pair in the matching real dtype (``complex64`` is ``float32`` pairs, ``complex128``
    ``float64``); a real tensor made complex gets an imaginary part of zeros.
``_assert_tensor_metadata(z, dtype=complex)``
    Removed: it checks the dtype of a tensor that is no longer complex.

Each new node gets its ``val`` from torch's fake tensors, as the export's own nodes have, so
the graph can still be decomposed or run (``ExportedProgram.module()``) and computes what it
computed before: a complex product is those four real products in torch too (not bit for bit:
torch's kernel may order the sums differently).

The rewrite is all or nothing: a graph with a complex tensor that one of the operators above
does not account for (a complex input or output, a complex constant, ``exp`` of a complex
tensor, ...) is left as it is, and the import then names the operators it has no converter for.

Neither library has this: torch's decompositions keep complex dtypes (Inductor computes them
with its own kernels), and Relax has none to convert to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["as_real_pairs"]


def as_real_pairs(program: Any) -> int:
    """Rewrite the complex tensors of ``program`` (an ``ExportedProgram``) as real pairs, in
    place.

    Returns
    -------
    int
        The complex operator nodes rewritten; 0 when there were none, or when one of them is
        not an operator rewritten here (the graph is then unchanged).
    """
    import torch

    graph = program.graph_module.graph
    complex_nodes = [node for node in graph.nodes if _touches_complex(node)]
    if not complex_nodes or not all(_rewritable(node) for node in complex_nodes):
        return 0
    fake_mode = torch._guards.detect_fake_mode(
        [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    )
    rules, _ = _rules()
    pairs: dict[Any, Any] = {}
    for node in complex_nodes:
        emit = _Emitter(graph, node, fake_mode)
        with graph.inserting_before(node):
            result = rules[node.target](emit, node, pairs)
        if _is_complex(node):
            pairs[node] = result
        elif result is not None:
            node.replace_all_uses_with(result)
    for node in reversed(complex_nodes):
        graph.erase_node(node)
    program.graph_module.recompile()
    return len(complex_nodes)


class _Emitter:
    """Adds ATen calls before one node, each with the fake-tensor ``val`` torch would give it."""

    def __init__(self, graph: Any, node: Any, fake_mode: Any) -> None:
        self.graph, self.node, self.fake_mode = graph, node, fake_mode

    def __call__(self, op: Callable, *args: Any, **kwargs: Any) -> Any:
        import torch

        new = self.graph.call_function(op, args, kwargs)
        values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            new.meta["val"] = op(*values[0], **values[1])
        if "stack_trace" in self.node.meta:
            new.meta["stack_trace"] = self.node.meta["stack_trace"]
        return new

    def parts(self, pair: Any) -> tuple[Any, Any]:
        """The real and imaginary parts of a pair."""
        import torch

        select = torch.ops.aten.select.int
        return self(select, pair, -1, 0), self(select, pair, -1, 1)

    def pair(self, real: Any, imaginary: Any) -> Any:
        import torch

        return self(torch.ops.aten.stack.default, [real, imaginary], -1)


def _is_complex(value: Any) -> bool:
    import torch

    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_complex()


def _touches_complex(node: Any) -> bool:
    return _is_complex(node) or any(_is_complex(arg) for arg in node.all_input_nodes)


def _rewritable(node: Any) -> bool:
    """Whether ``node`` is an operator :func:`_rules` rewrites, with operands it handles."""
    import torch

    rules, pairwise = _rules()
    if node.op != "call_function" or node.target not in rules:
        return False
    if any(isinstance(a, complex) for a in node.args) or "alpha" in node.kwargs:
        return False  # a complex constant, or a scaled sum: not rewritten
    if node.target in pairwise:
        return all(_is_complex(a) for a in node.args[:2])
    # Only these leave the complex numbers; a conversion to a real dtype (which drops the
    # imaginary part) is not rewritten.
    leaves = (torch.ops.aten.view_as_real.default, torch.ops.aten._assert_tensor_metadata.default)
    return _is_complex(node) or node.target in leaves


def _real_dtype(dtype: Any) -> Any:
    import torch

    pairs = {torch.complex32: torch.float16, torch.complex64: torch.float32}
    return pairs.get(dtype, torch.float64 if dtype == torch.complex128 else dtype)


def _view_as_complex(emit: _Emitter, node: Any, pairs: dict) -> Any:
    return node.args[0]


def _view_as_real(emit: _Emitter, node: Any, pairs: dict) -> Any:
    return pairs[node.args[0]]


def _drop(emit: _Emitter, node: Any, pairs: dict) -> None:
    return None


def _polar(emit: _Emitter, node: Any, pairs: dict) -> Any:
    import torch

    aten = torch.ops.aten
    magnitude, angle = node.args
    return emit.pair(
        emit(aten.mul.Tensor, magnitude, emit(aten.cos.default, angle)),
        emit(aten.mul.Tensor, magnitude, emit(aten.sin.default, angle)),
    )


def _mul(emit: _Emitter, node: Any, pairs: dict) -> Any:
    import torch

    aten = torch.ops.aten
    left, right = node.args
    if not _is_complex(left):
        left, right = right, left
    if _is_complex(right):
        (lr, li), (rr, ri) = emit.parts(pairs[left]), emit.parts(pairs[right])
        real = emit(aten.sub.Tensor, emit(aten.mul.Tensor, lr, rr), emit(aten.mul.Tensor, li, ri))
        imag = emit(aten.add.Tensor, emit(aten.mul.Tensor, lr, ri), emit(aten.mul.Tensor, li, rr))
        return emit.pair(real, imag)
    if isinstance(right, torch.fx.Node):
        right = emit(aten.unsqueeze.default, right, -1)  # one factor for both parts
    return emit(aten.mul.Tensor, pairs[left], right)


def _pairwise(emit: _Emitter, node: Any, pairs: dict) -> Any:
    left, right = node.args[:2]
    return emit(node.target, pairs[left], pairs[right])


def _conj(emit: _Emitter, node: Any, pairs: dict) -> Any:
    import torch

    real, imag = emit.parts(pairs[node.args[0]])
    return emit.pair(real, emit(torch.ops.aten.neg.default, imag))


def _axis(axis: int, ndim: int) -> int:
    """An axis of a complex tensor of ``ndim`` axes, counted from the start (the pair's axis
    comes after them all, so an axis counted from the end would name another one)."""
    return axis + ndim if axis < 0 else axis


def _unsqueeze(emit: _Emitter, node: Any, pairs: dict) -> Any:
    source, axis = node.args
    return emit(node.target, pairs[source], _axis(axis, node.meta["val"].dim()))


def _reduce_axes(emit: _Emitter, node: Any, pairs: dict) -> Any:
    """``squeeze`` and ``sum`` over axes of the complex tensor (all of them where none given)."""
    source, axes, *rest = node.args
    ndim = source.meta["val"].dim()
    if axes is None or axes == []:
        axes = list(range(ndim))
    elif isinstance(axes, int):
        axes = _axis(axes, ndim)
    else:
        axes = [_axis(a, ndim) for a in axes]
    kwargs = dict(node.kwargs)
    if kwargs.get("dtype") is not None:  # a sum's dtype: the complex one's real counterpart
        kwargs["dtype"] = _real_dtype(kwargs["dtype"])
    return emit(node.target, pairs[source], axes, *rest, **kwargs)


def _resize(emit: _Emitter, node: Any, pairs: dict) -> Any:
    """``view``, ``reshape`` and ``expand`` to a complex shape: the same shape, then the pair."""
    source, shape, *rest = node.args
    return emit(node.target, pairs[source], [*shape, 2], *rest, **node.kwargs)


def _permute(emit: _Emitter, node: Any, pairs: dict) -> Any:
    source, axes = node.args
    ndim = len(axes)
    return emit(node.target, pairs[source], [*(_axis(a, ndim) for a in axes), ndim])


def _same_op(emit: _Emitter, node: Any, pairs: dict) -> Any:
    return emit(node.target, pairs[node.args[0]], *node.args[1:], **node.kwargs)


def _convert(emit: _Emitter, node: Any, pairs: dict) -> Any:
    """``to`` / ``_to_copy`` between complex dtypes: the pair in the matching real dtype."""
    import torch

    source = node.args[0]
    dtype = _real_dtype(node.meta["val"].dtype)
    if not _is_complex(source):  # a real tensor made complex: imaginary part zero
        real = emit(torch.ops.aten._to_copy.default, source, dtype=dtype)
        return emit.pair(real, emit(torch.ops.aten.zeros_like.default, real))
    if pairs[source].meta["val"].dtype == dtype:
        return pairs[source]
    return emit(torch.ops.aten._to_copy.default, pairs[source], dtype=dtype)


@functools.cache
def _rules() -> tuple[dict[Any, Callable], tuple[Any, ...]]:
    """The rewrite of each operator, and those applied to both pairs as they are."""
    import torch

    aten = torch.ops.aten
    pairwise = (aten.add.Tensor, aten.sub.Tensor)
    conversions = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)
    rules = {
        aten.view_as_complex.default: _view_as_complex,
        aten.view_as_real.default: _view_as_real,
        aten._assert_tensor_metadata.default: _drop,
        aten.polar.default: _polar,
        aten.mul.Tensor: _mul,
        aten._conj.default: _conj,
        aten.conj_physical.default: _conj,
        aten._conj_physical.default: _conj,
        aten.unsqueeze.default: _unsqueeze,
        aten.squeeze.dim: _reduce_axes,
        aten.squeeze.dims: _reduce_axes,
        aten.sum.dim_IntList: _reduce_axes,
        aten.view.default: _resize,
        aten.reshape.default: _resize,
        aten.expand.default: _resize,
        aten.permute.default: _permute,
        aten.neg.default: _same_op,
        aten.clone.default: _same_op,
        aten.alias.default: _same_op,
        aten.detach.default: _same_op,
        **dict.fromkeys(pairwise, _pairwise),
        **dict.fromkeys(conversions, _convert),
    }
    return rules, pairwise

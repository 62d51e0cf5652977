"""The replacement ATen converters, each on the smallest graph that needs it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from blade_relax.frontend import flatten_outputs
from blade_relax.frontend.converters import custom_convert_map

torch = pytest.importorskip("torch")


def compile_and_run(mod, *arrays):
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return [t.numpy() for t in flatten_outputs(vm["main"](*map(tvm.runtime.tensor, arrays)))]


def test_native_layer_norm_returns_out_mean_and_rstd():
    class LayerNormStats(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
            self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 8))

        def forward(self, x):
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], self.weight, self.bias, 1e-5)
            return out, mean, rstd

    module = LayerNormStats()
    x = torch.randn(3, 5, 8)
    ep = torch.export.export(module, (x,))
    mod = from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )
    got = compile_and_run(mod, x.numpy())
    want = [t.detach().numpy() for t in module(x)]
    assert [g.shape for g in got] == [w.shape for w in want] == [(3, 5, 8), (3, 5, 1), (3, 5, 1)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # The statistics differ from the output: the built-in converter's failure mode.
    assert not np.allclose(got[1], got[0][..., :1])


def test_index_put_with_one_index_accumulates_repeated_rows():
    class EmbeddingBackward(torch.nn.Module):
        def forward(self, ids, grad):
            zeros = torch.zeros(10, 4)
            return torch.ops.aten.index_put(zeros, [ids], grad, True)

    ids = torch.tensor([[1, 3, 1, 9, 3, 1]])
    grad = torch.randn(1, 6, 4)
    seq = torch.export.Dim("s", min=2, max=64)
    ep = torch.export.export(
        EmbeddingBackward(), (ids, grad), dynamic_shapes={"ids": {1: seq}, "grad": {1: seq}}
    )
    mod = from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )
    (got,) = compile_and_run(mod, ids.numpy(), grad.numpy())
    want = EmbeddingBackward()(ids, grad).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.allclose(got[1], grad[0, [0, 2, 5]].sum(0).numpy(), atol=1e-6)


def test_open_ended_slice_on_a_symbolic_axis_keeps_a_plain_shape():
    class Shift(torch.nn.Module):
        def forward(self, labels):
            return labels[:, 1:] * 2

    labels = torch.arange(12).reshape(1, 12)
    ep = torch.export.export(
        Shift(), (labels,), dynamic_shapes={"labels": {1: torch.export.Dim("s", min=3, max=99)}}
    )
    mod = from_exported_program(ep, custom_convert_map=custom_convert_map())
    main = mod["main"]
    seq = main.params[0].ty.shape.values[1]
    result_len = main.ret_ty.fields[0].shape.values[1]
    # s - 1, not min(2**63 - 2, s) - 1, whose byte size overflows int64 when lowered.
    assert tvm.sym.Analyzer().can_prove_equal(result_len, seq - 1)
    (got,) = compile_and_run(mod, labels.numpy())
    np.testing.assert_array_equal(got, Shift()(labels).numpy())


def _matmul_dtypes(mod):
    """(input dtypes, out_dtype) of every matmul in ``main``."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.matmul":
            found.append((tuple(str(a.ty.dtype) for a in expr.args), str(expr.attrs.out_dtype)))

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_products_keep_the_dtype_torch_gives_them(dtype):
    class Products(torch.nn.Module):
        def forward(self, a, b, c):
            return a @ b, torch.mm(a, b), torch.bmm(c, c.transpose(1, 2))

    kind = getattr(torch, dtype)
    a, b = torch.randn(4, 8, dtype=kind), torch.randn(8, 3, dtype=kind)
    c = torch.randn(2, 4, 8, dtype=kind)
    ep = torch.export.export(Products(), (a, b, c))
    mod = from_exported_program(ep, custom_convert_map=custom_convert_map())
    products = _matmul_dtypes(mod)
    # The built-in converters computed every product in float32, whatever the inputs.
    assert len(products) == 3
    assert all(out == dtype and set(ins) == {dtype} for ins, out in products)
    assert all(str(r.dtype) == dtype for r in mod["main"].ret_ty.fields)
    if dtype == "float32":
        from blade_relax.frontend import torch_to_numpy

        got = compile_and_run(mod, *(torch_to_numpy(t) for t in (a, b, c)))
        for g, w in zip(got, Products()(a, b, c)):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)


def test_a_bfloat16_tensor_comes_back_bit_for_bit():
    import ml_dtypes

    from blade_relax.frontend import torch_to_numpy

    x = torch.randn(5, 3).to(torch.bfloat16)
    got = torch_to_numpy(x)
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (5, 3)
    assert np.array_equal(got.view(np.int16), x.view(torch.int16).numpy())
    assert tvm.runtime.tensor(got).dtype == "bfloat16"
    assert torch_to_numpy(torch.ones(2)).dtype == np.float32


def _import(module, args, dynamic_shapes=None):
    ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    return from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )


def test_a_list_index_from_the_end_reads_the_right_rows():
    """``x[:, :, [-2]]`` (Falcon's keys): TVM's own converter takes index -2 out of bounds."""

    class FromTheEnd(torch.nn.Module):
        def forward(self, x):
            return x[:, :, [-2]], x[:, :, [-1, 0]]

    x = torch.randn(2, 5, 4, 3)
    seq = torch.export.Dim("s", min=2, max=64)
    mod = _import(FromTheEnd(), (x,), {"x": {1: seq}})
    for length in (3, 5, 9):
        x = torch.randn(2, length, 4, 3)
        got = compile_and_run(mod, x.numpy())
        want = [t.numpy() for t in FromTheEnd()(x)]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_index_put_along_an_inner_axis():
    """The backward of ``x[:, :, idx]``: a scatter-add along axis 2, other axes whole."""

    class InnerAxis(torch.nn.Module):
        def forward(self, grad):
            zeros = torch.zeros(grad.shape[0], grad.shape[1], 4, 3)
            index = torch.tensor([2, -1, 2])
            return torch.ops.aten.index_put(zeros, [None, None, index], grad, True)

    grad = torch.randn(2, 5, 3, 3)
    seq = torch.export.Dim("s", min=2, max=64)
    mod = _import(InnerAxis(), (grad,), {"grad": {1: seq}})
    for length in (2, 7):
        grad = torch.randn(2, length, 3, 3)
        (got,) = compile_and_run(mod, grad.numpy())
        np.testing.assert_allclose(got, InnerAxis()(grad).numpy(), rtol=1e-6, atol=1e-6)


def test_new_empty_strided_and_a_power_of_a_size():
    """A contiguous ``new_empty_strided`` whose stride is ``s ** 2`` (Falcon's backward)
    becomes zeros of its size; a strided one is refused, naming its strides."""

    class Strided(torch.nn.Module):
        def __init__(self, contiguous: bool):
            super().__init__()
            self.contiguous = contiguous

        def forward(self, x):
            s = x.shape[1]
            stride = [s**2, s, 1] if self.contiguous else [1, s, s**2]
            empty = torch.ops.aten.new_empty_strided(x, [4, s, s], stride)
            return empty.fill_(0.0) + x.sum()

    x = torch.randn(1, 6)
    seq = torch.export.Dim("s", min=2, max=64)
    mod = _import(Strided(True), (x,), {"x": {1: seq}})
    (got,) = compile_and_run(mod, x.numpy())
    np.testing.assert_allclose(got, np.full((4, 6, 6), x.sum().item()), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="only the contiguous strides"):
        _import(Strided(False), (x,), {"x": {1: seq}})


def test_a_reshape_compares_symbolic_shapes_without_failing():
    """GPT-BigCode's ``view`` of a ``(1, 1, s, 32)`` tensor as ``(1, s, -1, 8)``: TVM's
    converter compares the shapes as Python lists (``1 == s`` asks a symbolic comparison for a
    truth value) and fails; a view to the input's own shape stays the input."""

    class Views(torch.nn.Module):
        def forward(self, x):
            heads = x.view(1, x.shape[2], -1, 8)
            same = x.view(1, 1, x.shape[2], 32)
            return heads * 2.0, same + 1.0

    x = torch.randn(1, 1, 5, 32)
    seq = torch.export.Dim("s", min=2, max=64)
    mod = _import(Views(), (x,), {"x": {2: seq}})
    for length in (3, 11):
        x = torch.randn(1, 1, length, 32)
        got = compile_and_run(mod, x.numpy())
        for g, w in zip(got, Views()(x)):
            np.testing.assert_array_equal(g, w.numpy())


def _ops(mod) -> set[str]:
    names: set[str] = set()
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: (
            names.add(e.op.name) if isinstance(e, relax.Call) and hasattr(e.op, "name") else None
        ),
    )
    return names


@pytest.mark.parametrize("exponent", [0, 1, 2, 3, -1, -2, 1.0, 2.0, 3.0])
def test_small_integer_powers_are_products_as_torch_computes_them(exponent):
    """``x ** 0`` to ``x ** 3``, ``x ** -1``, ``x ** -2`` become ones, ``x``, products and a
    reciprocal, as torch's kernels compute them: no ``power`` is left (TVM compiles CUDA with
    fast math, whose ``powf`` is NaN for a negative base), and negative bases give torch's
    values bit for bit."""

    class Power(torch.nn.Module):
        def forward(self, x):
            return torch.pow(x, exponent)

    x = torch.linspace(-3.0, 2.9, 24).reshape(4, 6)
    mod = _import(Power(), (x,))
    assert "relax.power" not in _ops(mod)
    (got,) = compile_and_run(mod, x.numpy())
    np.testing.assert_array_equal(got, Power()(x).numpy())


def test_other_powers_stay_power():
    class Root(torch.nn.Module):
        def forward(self, x):
            return torch.pow(x, 0.5)

    x = torch.linspace(0.1, 4.0, 12).reshape(3, 4)
    mod = _import(Root(), (x,))
    assert "relax.power" in _ops(mod)
    (got,) = compile_and_run(mod, x.numpy())
    np.testing.assert_allclose(got, Root()(x).numpy(), rtol=1e-6)


def test_integer_division_truncates_towards_zero():
    """``div(rounding_mode="trunc")`` on integers (JetMoE's router): the floor quotient, plus
    one where the division is inexact and the operands have opposite signs."""

    class Trunc(torch.nn.Module):
        def forward(self, a, b):
            return (
                a.div(b, rounding_mode="trunc"),
                a.div(-3, rounding_mode="trunc"),
                a.div(4, rounding_mode="trunc"),
            )

    seq = torch.export.Dim("s", min=2, max=64)
    a = torch.tensor([[-7, 7, -6, 6, 0]])
    mod = _import(Trunc(), (a, a + 10), {"a": {1: seq}, "b": {1: seq}})
    assert "relax.trunc" not in _ops(mod)
    for length in (3, 8, 13):
        a = torch.arange(length).reshape(1, length) * 5 - 3 * length
        b = torch.tensor([3, -3, 2, -4, 5, -1, 7]).repeat(2)[:length].reshape(1, length)
        got = compile_and_run(mod, a.numpy(), b.numpy())
        for g, w in zip(got, Trunc()(a, b)):
            np.testing.assert_array_equal(g, w.numpy())


def test_slice_scatter_with_symbolic_bounds():
    """The backward of ``scores[..., :-1]`` (GPT-OSS's attention sinks) scatters into the
    first ``s`` of ``s + 1`` columns: TVM legalizes ``slice_scatter`` only for constant bounds;
    here it is a concatenation of slices of the input around the source."""

    class Scatter(torch.nn.Module):
        def forward(self, src, x):
            s = src.shape[2]
            wide = src.new_zeros(2, s, s + 1)
            first = torch.ops.aten.slice_scatter(wide, src, 2, 0, s)
            last = torch.ops.aten.slice_scatter(x, src[:, :, 2:] * 2, 2, 2)
            middle = torch.ops.aten.slice_scatter(x, src[:, :, 1:-1] - 1, 2, 1, s - 1)
            from_end = torch.ops.aten.slice_scatter(x, src[:, :, 1:-1] + 3, 2, 1, -1)
            return first, last, middle, from_end

    src, x = torch.randn(2, 4, 4), torch.randn(2, 4, 4)
    seq = torch.export.Dim("s", min=4, max=64)
    mod = _import(Scatter(), (src, x), {"src": {1: seq, 2: seq}, "x": {1: seq, 2: seq}})
    assert "relax.slice_scatter" not in _ops(mod)
    for length in (4, 6, 11):
        src, x = torch.randn(2, length, length), torch.randn(2, length, length)
        got = compile_and_run(mod, src.numpy(), x.numpy())
        for g, w in zip(got, Scatter()(src, x)):
            np.testing.assert_array_equal(g, w.numpy())


def test_sym_max_and_sym_min_of_sizes():
    """MPT's ALiBi window ``bias[:, max(0, 16 - s):]``: ``sym_max`` is the operand torch proves
    the larger, so the slice is ``s`` long and adds to an ``s``-long tensor; a choice torch
    cannot make (``min(s, 8)``) is TIR's ``min``."""

    class Window(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.arange(16.0).reshape(1, 16))

        def forward(self, x):
            s = x.shape[1]
            first = torch.sym_max(0, self.bias.shape[1] - s)
            last = torch.sym_min(self.bias.shape[1], first + s)
            return self.bias[:, first:last] + x, x.new_ones(torch.sym_min(s, 8))

    x = torch.randn(1, 5)
    mod = _import(Window(), (x,), {"x": {1: torch.export.Dim("s", min=2, max=16)}})
    window, prefix = mod["main"].ret_ty.fields
    seq = mod["main"].params[0].ty.shape.values[1]
    analyzer = tvm.sym.Analyzer()
    assert analyzer.can_prove_equal(window.shape.values[1], seq)
    assert analyzer.can_prove_equal(prefix.shape.values[0], tvm.tirx.min(seq, 8))
    for length in (3, 11, 16):
        x = torch.randn(1, length)
        got = compile_and_run(mod, x.numpy())
        for g, w in zip(got, Window()(x)):
            np.testing.assert_array_equal(g, w.numpy())


def test_empty_with_a_symbolic_size():
    """``torch.empty`` sized by the length (DeepSeek-V3's latent attention builds its queries
    in one): TVM's converter hands the FX node of the size to ``zeros`` unconverted."""

    class Filled(torch.nn.Module):
        def forward(self, x):
            out = torch.empty(x.shape[0], 4)
            out.copy_(x * 2)
            return out

    mod = _import(Filled(), (torch.randn(3, 4),), {"x": {0: torch.export.Dim("s", min=2, max=64)}})
    out = mod["main"].ret_ty
    out = out.fields[0] if isinstance(out, relax.TupleType) else out
    seq = mod["main"].params[0].ty.shape.values[0]
    assert tvm.sym.Analyzer().can_prove_equal(out.shape.values[0], seq)
    for length in (2, 5, 17):
        x = torch.randn(length, 4)
        (got,) = compile_and_run(mod, x.numpy())
        np.testing.assert_array_equal(got, Filled()(x).numpy())


def test_a_slice_with_a_symbolic_start_and_a_bound_from_the_end():
    """``x[:, s - 4 : -1]``: the end counts from the axis's end, the start is symbolic; past the
    axis (``x[:, s - 4 : s + 3]``, which torch clamps) the built-in converter takes it."""

    class Tail(torch.nn.Module):
        def forward(self, x):
            s = x.shape[1]
            return x[:, s - 4 : -1] * 2, x[:, s - 4 : s + 3] + 1

    mod = _import(Tail(), (torch.randn(2, 9),), {"x": {1: torch.export.Dim("s", min=5, max=64)}})
    for length in (5, 7, 16):
        x = torch.randn(2, length)
        got = compile_and_run(mod, x.numpy())
        for g, w in zip(got, Tail()(x)):
            np.testing.assert_array_equal(g, w.numpy())


def test_a_symbolic_negative_start_counts_from_the_end():
    """``mask[:, -s:]`` (LFM2's mask of the last ``s`` positions) and a ``slice_scatter`` into
    the last ``s`` of ``s + 3`` columns: a start torch proves negative counts from the axis's
    end, so the slices keep the plain shape ``s`` (the built-in converter's clamped shape has no
    size the later operators can lower)."""

    class Last(torch.nn.Module):
        def forward(self, wide, x):
            s = x.shape[1]
            tail = wide[:, -s:]
            return tail * x, torch.ops.aten.slice_scatter(wide, x, 1, -s)

    seq = torch.export.Dim("s", min=2, max=64)
    wide, x = torch.randn(2, 9), torch.randn(2, 6)
    mod = _import(Last(), (wide, x), {"wide": {1: seq + 3}, "x": {1: seq}})
    main_text = mod["main"].script()
    assert "T.min(" not in main_text and "T.max(" not in main_text, main_text
    for length in (2, 7, 30):
        wide, x = torch.randn(2, length + 3), torch.randn(2, length)
        got = compile_and_run(mod, wide.numpy(), x.numpy())
        for g, w in zip(got, Last()(wide, x)):
            np.testing.assert_array_equal(g, w.numpy())


def test_integer_tensors_divide_as_floats():
    """``/`` on int64 tensors gives floats, as in torch (Ministral 3's query scaling reads
    ``log(1 + floor(positions / n))``); a Python float divisor is not rounded to an integer;
    ``rounding_mode=None`` is the same division."""

    class TrueDivide(torch.nn.Module):
        def forward(self, positions, counts):
            return (
                torch.log(1 + torch.floor(positions / 4)),
                positions / counts,
                positions / 2.5,
                positions.div(counts, rounding_mode=None),
            )

    seq = torch.export.Dim("s", min=2, max=64)
    positions = torch.arange(6).reshape(1, 6)
    mod = _import(
        TrueDivide(), (positions, positions + 1), {"positions": {1: seq}, "counts": {1: seq}}
    )
    for length in (3, 8, 13):
        positions = torch.arange(length).reshape(1, length) * 3 - 7
        counts = torch.tensor([3, -2, 5, 4]).repeat(4)[:length].reshape(1, length)
        got = compile_and_run(mod, positions.numpy(), counts.numpy())
        want = TrueDivide()(positions, counts)
        assert [g.dtype for g in got] == [np.float32] * 4
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-6)


def test_amax_and_amin_over_axes_and_over_everything():
    """``amax``/``amin`` along one axis (kept), several axes, and every axis (``dim=[]``)."""

    class Extremes(torch.nn.Module):
        def forward(self, x):
            return (
                x.amax(-1, keepdim=True),
                x.amin((0, 2)),
                torch.ops.aten.amax.default(x, []),
                torch.ops.aten.amin.default(x),
            )

    seq = torch.export.Dim("s", min=2, max=64)
    mod = _import(Extremes(), (torch.randn(2, 5, 3),), {"x": {1: seq}})
    for length in (2, 7, 19):
        x = torch.randn(2, length, 3)
        got = compile_and_run(mod, x.numpy())
        want = Extremes()(x)
        assert [g.shape for g in got] == [tuple(w.shape) for w in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w.numpy())


def test_cumsum_of_a_bool_mask_counts_in_int64():
    class CountValid(torch.nn.Module):
        def forward(self, mask):
            return mask.bool().cumsum(-1)

    mask = torch.tensor([[1, 0, 1, 1, 0, 1]])
    ep = torch.export.export(
        CountValid(), (mask,), dynamic_shapes={"mask": {1: torch.export.Dim("s", max=64)}}
    )
    mod = from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )
    assert mod["main"].ret_ty.fields[0].dtype == "int64"
    (got,) = compile_and_run(mod, mask.numpy())
    np.testing.assert_array_equal(got, [[1, 1, 2, 3, 3, 4]])


@pytest.mark.parametrize("like", [False, True])
def test_full_of_minus_infinity_is_a_broadcast_constant(like):
    class Mask(torch.nn.Module):
        def forward(self, scores):
            if like:
                masked = torch.full_like(scores, float("-inf"))
            else:
                masked = torch.full(scores.shape, float("-inf"))
            return torch.where(scores > 0, scores, masked)

    scores = torch.tensor([[0.5, -1.0, 2.0], [-0.5, 1.0, -3.0]])
    ep = torch.export.export(
        Mask(), (scores,), dynamic_shapes={"scores": {1: torch.export.Dim("s", max=64)}}
    )
    mod = from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )
    (got,) = compile_and_run(mod, scores.numpy())
    np.testing.assert_array_equal(got, Mask()(scores).numpy())
    # TVM's own converter gives a full that its legalization rejects.
    builtin = from_exported_program(ep, run_ep_decomposition=False)
    with pytest.raises(TypeError, match="PrimType"):
        tvm.compile(builtin, "llvm")

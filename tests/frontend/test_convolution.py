"""The backward of a 1-D convolution, imported from torch's joint export and checked against
torch's autograd at several lengths."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from blade_relax.frontend import flatten_outputs
from blade_relax.frontend.converters import custom_convert_map

torch = pytest.importorskip("torch")


class ConvGradients(torch.nn.Module):
    """``(grad_input, grad_weight, grad_bias)`` of ``conv1d`` for an upstream gradient."""

    def __init__(self, **settings):
        super().__init__()
        self.settings = settings

    def forward(self, x, weight, bias, upstream):
        return torch.ops.aten.convolution_backward.default(
            upstream,
            x,
            weight,
            [weight.shape[0]],
            [self.settings.get("stride", 1)],
            [self.settings.get("padding", 0)],
            [self.settings.get("dilation", 1)],
            False,
            [0],
            self.settings.get("groups", 1),
            [True, True, True],
        )


def _case(settings, channels, out_channels, kernel, length, batch=2):
    """Inputs and torch's gradients for one length."""
    torch.manual_seed(length)
    groups = settings.get("groups", 1)
    x = torch.randn(batch, channels, length, requires_grad=True)
    weight = torch.randn(out_channels, channels // groups, kernel, requires_grad=True)
    bias = torch.randn(out_channels, requires_grad=True)
    out = torch.nn.functional.conv1d(x, weight, bias, **settings)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    inputs = [t.detach() for t in (x, weight, bias, upstream)]
    return inputs, [x.grad, weight.grad, bias.grad]


def _run(mod, inputs):
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    result = vm["main"](*(tvm.runtime.tensor(t.numpy()) for t in inputs))
    return [t.numpy() for t in flatten_outputs(result)]


def _import_over_lengths(settings, channels, out_channels, kernel):
    """The gradients' graph exported for lengths 8 to 64."""
    inputs, _ = _case(settings, channels, out_channels, kernel, 12)
    seq = torch.export.Dim("s", min=8, max=64)
    grown = 2 * settings.get("padding", 0) - settings.get("dilation", 1) * (kernel - 1)
    dynamic = {"x": {2: seq}, "weight": None, "bias": None, "upstream": {2: seq + grown}}
    ep = torch.export.export(ConvGradients(**settings), tuple(inputs), dynamic_shapes=dynamic)
    return from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(padding=2, groups=8),  # LFM2's short convolution: depthwise, cut back afterwards
        dict(padding=2),
        dict(padding=5, dilation=2, groups=8),
    ],
    ids=["depthwise", "dense", "dilated-depthwise"],
)
def test_gradients_match_autograd_at_every_length(settings):
    channels, kernel = 8, 3
    out_channels = 8 if settings.get("groups", 1) != 1 else 4
    mod = _import_over_lengths(settings, channels, out_channels, kernel)
    for length in (8, 19, 40):
        inputs, want = _case(settings, channels, out_channels, kernel, length)
        got = _run(mod, inputs)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "settings, channels, out_channels, kernel",
    [
        (dict(stride=2, padding=1), 4, 6, 4),  # an output padding of one at length 11
        (dict(padding=1, dilation=2, groups=2), 8, 4, 3),  # slices of the padded input
    ],
    ids=["strided", "grouped"],
)
def test_other_settings_over_a_fixed_length(settings, channels, out_channels, kernel):
    inputs, want = _case(settings, channels, out_channels, kernel, 11)
    ep = torch.export.export(ConvGradients(**settings), tuple(inputs))
    mod = from_exported_program(
        ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
    )
    for g, w in zip(_run(mod, inputs), want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)


def test_a_symbolic_length_the_weight_gradient_would_slice_is_refused():
    """Padding 1 for a kernel of 3 (not causal): tap 0 would slice the symbolic length."""
    with pytest.raises(NotImplementedError, match="only a stride of one, a padding of at least"):
        _import_over_lengths(dict(padding=1), 8, 4, 3)


def test_a_two_dimensional_convolution_is_refused_by_name():
    class Conv2dGradients(torch.nn.Module):
        def forward(self, x, weight, upstream):
            return torch.ops.aten.convolution_backward.default(
                upstream, x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                [True, True, False],
            )  # fmt: skip

    x, weight = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 2, 2)
    upstream = torch.randn(1, 3, 4, 4)
    ep = torch.export.export(Conv2dGradients(), (x, weight, upstream))
    with pytest.raises(NotImplementedError, match="2-d convolution: only 1-d"):
        from_exported_program(
            ep, run_ep_decomposition=False, custom_convert_map=custom_convert_map()
        )

"""Complex tensors as real pairs: the rewritten graph computes what torch's did, forward and
backward, and Relax imports it; a graph with a complex operator not rewritten is left as it is
and refused by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.frontend import UnsupportedOperatorError, flatten_outputs
from blade_relax.frontend.complex_pairs import as_real_pairs
from blade_relax.frontend.hf import _import

torch = pytest.importorskip("torch")
pytest.importorskip("torch.export.experimental")
from torch.export.experimental import _export_forward_backward  # noqa: E402

LENGTHS = (2, 5, 17)


class Rotary(torch.nn.Module):
    """Llama 4's rotation: channel pairs as complex numbers, times ``polar(1, angle)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.5, 0.25, 0.125]))

    def rotate(self, x):
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), self.inv_freq)
        h = self.proj(x)
        z = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2))
        return z * torch.polar(torch.ones_like(angles), angles)

    def forward(self, x):
        return (torch.view_as_real(self.rotate(x)).flatten(2).square().sum(),)


class EveryRule(Rotary):
    """Each rewritten operator at least once: real and complex factors, sums, the conjugate,
    axes counted from the end, shapes, conversions between complex dtypes and from a real
    tensor."""

    def forward(self, x):
        z = self.rotate(x)
        w = z.unsqueeze(-2) * x[..., :4].unsqueeze(-2) * 0.5  # a real tensor, a number
        w = (w - z.unsqueeze(-2).conj_physical()) + torch._conj(z).unsqueeze(2).clone()
        wide = w.to(torch.complex128) * x[..., :4].to(torch.complex64).unsqueeze(-2)
        moved = wide.permute(0, 2, 1, 3).sum(-3)  # (1, s, 4)
        both = moved + wide.reshape(1, x.shape[1], 4).expand(2, -1, -1)
        return (torch.view_as_real(both).flatten(2).square().sum(),)


def export(module, joint):
    x = torch.randn(1, 6, 8)
    dynamic = {"x": {1: torch.export.Dim("s", min=2, max=32)}}
    program = torch.export.export(module, (x,), dynamic_shapes=dynamic)
    return _export_forward_backward(program, joint_loss_index=0) if joint else program


def run(program, x):
    """The program's graph on ``x``, its parameters and buffers from the program."""
    args, user = [], iter([x])
    for spec in program.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            args.append(next(user))
        else:
            args.append(program.state_dict.get(spec.target, program.constants.get(spec.target)))
    return [t.detach() for t in program.graph_module(*args)]


def complex_values(program):
    return [
        n.name
        for n in program.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()
    ]


@pytest.mark.parametrize("module", [Rotary, EveryRule])
@pytest.mark.parametrize("joint", [False, True], ids=["forward", "forward+backward"])
def test_pairs_compute_what_complex_numbers_did(module, joint):
    torch.manual_seed(0)
    program = export(module(), joint)
    before = copy.deepcopy(program)
    assert complex_values(before)
    assert as_real_pairs(program) > 0
    assert complex_values(program) == []
    for n in LENGTHS:
        x = torch.randn(1, n, 8)
        want, got = run(before, x), run(program, x)
        assert len(got) == (3 if joint else 1)  # the loss, the weight's and bias's gradients
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if joint:  # the backward multiplies by the conjugate
        assert "_conj" in str(before.graph) and "_conj" not in str(program.graph)


@pytest.mark.parametrize("module", [Rotary, EveryRule])
def test_the_imported_step_matches_torch_at_every_length(module):
    torch.manual_seed(0)
    module = module()
    program = export(module, joint=True)
    mod = _import(program, None, decompose=False)
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for n in LENGTHS:
        x = torch.randn(1, n, 8)
        inputs = (x, module.proj.weight, module.proj.bias)  # the buffer is a constant
        arrays = [tvm.runtime.tensor(t.detach().numpy()) for t in inputs]
        got = [t.numpy() for t in flatten_outputs(vm["main"](*arrays))]
        loss = module(x)[0]
        want = [loss, *torch.autograd.grad(loss, [module.proj.weight, module.proj.bias])]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-5, atol=1e-5)


class Exponential(torch.nn.Module):
    """``exp`` of a complex tensor: no rewrite for it."""

    def forward(self, x):
        return torch.view_as_real(torch.view_as_complex(x).exp()).sum()


def test_a_complex_operator_without_a_rewrite_leaves_the_graph_to_be_refused_by_name():
    program = torch.export.export(Exponential(), (torch.randn(3, 2),))
    before = str(program.graph)
    assert as_real_pairs(program) == 0
    assert str(program.graph) == before
    with pytest.raises(UnsupportedOperatorError) as caught:
        _import(program, None, decompose=False, architecture="toy")
    assert "view_as_complex.default" in caught.value.operators

"""Guards torch cannot prove over the declared sizes: deferred, checked at every size, dropped
where they hold and refused where one fails."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.frontend import GuardError
from blade_relax.frontend.guards import decompose_checked, drop_proven_asserts, export
from blade_relax.frontend.hf import _import

torch = pytest.importorskip("torch")


class Window(torch.nn.Module):
    """``x[:, :min(window, s)]`` (MiniMax's clamped window): torch needs ``min(window, s) <= s``
    and cannot prove it."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def forward(self, x):
        return x[:, : min(self.window, x.shape[1])] * 2


class Clamped(torch.nn.Module):
    """A window added to the whole row: right only while ``s <= 10`` (``Eq(Min(10, s), s)``)."""

    def forward(self, x):
        return x[:, : min(10, x.shape[1])] + x


def _dims(**range_):
    return ({1: torch.export.Dim("s", **range_)},)


def test_a_guard_that_holds_is_dropped_and_the_graph_imports():
    program, deferred = export(Window(256), (torch.randn(1, 8),), _dims(min=2, max=64))
    assert deferred
    assert drop_proven_asserts(program) == 1
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "aten._assert_scalar.default" not in targets
    assert not any(t.endswith(" le>") for t in targets)  # the condition only it read
    mod = _import(program, None, decompose=True)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    for length in (2, 9, 64):
        x = torch.randn(1, length)
        got = vm["main"](tvm.runtime.tensor(x.numpy()))
        got = got[0] if not hasattr(got, "numpy") else got
        np.testing.assert_array_equal(got.numpy(), Window(256)(x).numpy())


def _asserts(program) -> int:
    return sum(n.target is torch.ops.aten._assert_scalar.default for n in program.graph.nodes)


def test_decompositions_put_the_guards_back_and_they_are_checked_after_them():
    """torch's decompositions trace the graph again and put the deferred guard back (what
    ``import_inference`` decomposes); checked after them, it is dropped where it holds and
    refuses where it fails."""
    program, _ = export(Window(256), (torch.randn(1, 8),), _dims(min=2, max=64))
    drop_proven_asserts(program)
    assert _asserts(program) == 0 and _asserts(program.run_decompositions()) == 1
    decomposed = decompose_checked(program)
    assert _asserts(decomposed) == 0
    vm = relax.VirtualMachine(tvm.compile(_import(decomposed, None, False), "llvm"), tvm.cpu())
    for length in (2, 64):
        x = torch.randn(1, length)
        got = vm["main"](tvm.runtime.tensor(x.numpy()))
        got = got[0] if not hasattr(got, "numpy") else got
        np.testing.assert_array_equal(got.numpy(), Window(256)(x).numpy())
    failing, _ = export(Clamped(), (torch.randn(1, 8),), _dims(min=2, max=64))
    with pytest.raises(GuardError, match=r"fails at s\d* = 11"):
        decompose_checked(failing)


def test_a_model_torch_can_prove_is_exported_as_before():
    """No guard left unproven: the plain export, no assertion in the graph."""
    program, deferred = export(Window(4), (torch.randn(1, 8),), _dims(min=4, max=64))
    assert not deferred
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "aten._assert_scalar.default" not in targets


def test_a_guard_that_fails_at_a_declared_size_is_refused_naming_it():
    program, deferred = export(Clamped(), (torch.randn(1, 8),), _dims(min=2, max=64))
    assert deferred
    with pytest.raises(GuardError, match=r"Eq\(Min\(10, s\d*\), s\d*\), which fails at s\d* = 11"):
        drop_proven_asserts(program)


def test_a_guard_over_an_unbounded_size_cannot_be_checked():
    program, deferred = export(Window(256), (torch.randn(1, 8),), _dims(min=2))
    assert deferred
    with pytest.raises(GuardError, match="no finite declared range"):
        drop_proven_asserts(program)

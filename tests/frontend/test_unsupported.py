"""A model with an operator no converter handles is refused at import, in one line naming it."""

from __future__ import annotations

import pytest

from blade_relax.frontend import UnsupportedOperatorError
from blade_relax.frontend.hf import _import, unsupported_reason

torch = pytest.importorskip("torch")


class _Router(torch.nn.Module):
    """Counts tokens per bin, as a mixture-of-experts router does."""

    def forward(self, x):
        return torch.histc(x, bins=4, min=0, max=4) + x.sum()


def test_unknown_operator_is_refused_naming_it():
    ep = torch.export.export(_Router(), (torch.rand(8),))
    with pytest.raises(UnsupportedOperatorError) as caught:
        _import(ep, None, decompose=True, architecture="toy")
    err = caught.value
    assert err.architecture == "toy" and err.operators == ("histc.default",)
    message = str(err)
    assert message == (
        "toy is not supported: no converter for histc.default (a mixture-of-experts router's "
        "count of tokens per expert, known only at run time)"
    )
    assert "\n" not in message


def test_reason_of_an_operator_without_one():
    assert unsupported_reason("frobnicate.default") == "one can be passed as custom_converters"
    assert "grouped GEMM" in unsupported_reason("grouped_mm_fallback.default")

"""A model with an operator no converter handles is refused at import, in one line naming it."""

from __future__ import annotations

import pytest

from blade_relax.frontend import UnsupportedOperatorError
from blade_relax.frontend.hf import _import, unsupported_reason

torch = pytest.importorskip("torch")


class _Median(torch.nn.Module):
    """A median that skips NaN: no converter handles ``nanmedian``."""

    def forward(self, x):
        return x.nanmedian() + x.sum()


def test_unknown_operator_is_refused_naming_it():
    ep = torch.export.export(_Median(), (torch.rand(8),))
    with pytest.raises(UnsupportedOperatorError) as caught:
        _import(ep, None, decompose=True, architecture="toy")
    err = caught.value
    assert err.architecture == "toy" and err.operators == ("nanmedian.default",)
    message = str(err)
    assert message == (
        "toy is not supported: no converter for nanmedian.default (one can be passed as "
        "custom_converters)"
    )
    assert "\n" not in message


def test_reason_of_an_operator_without_one():
    assert unsupported_reason("frobnicate.default") == "one can be passed as custom_converters"
    assert "grouped GEMM" in unsupported_reason("_grouped_mm.default")

"""torch's step as the yardstick: the float32 reference and the float64 one.

The float64 reference runs a float64 copy of the model, made at each call, with float64 as
torch's default dtype and without autocast; the user's model is left as it was. It is what
a gradient that is zero in exact arithmetic (OPT's key bias) is checked against.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from blade_relax.bench.runner import relative_error  # noqa: E402
from blade_relax.bench.zoo import ARCHITECTURES, _model  # noqa: E402
from blade_relax.frontend.hf import step_wrappers  # noqa: E402
from blade_relax.frontend.references import inference_reference, training_reference  # noqa: E402

INFERENCE, PLAIN, _ = step_wrappers()


def _tiny(architecture):
    return _model(ARCHITECTURES[architecture]())


def _inputs(length):
    ids = np.random.default_rng(length).integers(0, 96, size=(1, length), dtype=np.int64)
    return [ids, ids.copy()]


@pytest.mark.parametrize("architecture", ["opt", "xglm"])
def test_float64_step_is_torch_step_in_float64(architecture):
    model = _tiny(architecture)
    trainable = [name for name, _ in model.named_parameters()]
    wrapper = PLAIN(model)
    float32 = training_reference(model, wrapper, trainable)
    float64 = training_reference(model, wrapper, trainable, float64=True)
    for length in (5, 17):
        want, got = float32(_inputs(length)), float64(_inputs(length))
        # transformers' loss casts the logits to float32 (``logits.float()``): the loss only.
        assert got[0].dtype == np.float32 and all(a.dtype == np.float64 for a in got[1:])
        assert relative_error(want[0], got[0]) < 1e-6  # the loss
        named = dict(zip(["loss", *trainable], zip(want, got)))
        for name, (low, high) in named.items():
            if name.endswith("self_attn.k_proj.bias"):
                # Zero in exact arithmetic: float32 noise beside float64 noise far smaller.
                assert np.linalg.norm(high) < 1e-6 * np.linalg.norm(low) + 1e-15, name
            elif name != "loss":
                assert relative_error(low, high) < 1e-3, name
    # The user's model is untouched; torch's default dtype is restored.
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32


def test_float64_step_drops_autocast_and_follows_the_weights():
    model = _tiny("llama")
    trainable = [name for name, _ in model.named_parameters()]
    mixed = training_reference(model, PLAIN(model, autocast=torch.bfloat16), trainable, True)
    exact = training_reference(model, PLAIN(model), trainable, float64=True)
    inputs = _inputs(9)
    for a, b in zip(mixed(inputs), exact(inputs)):
        np.testing.assert_array_equal(a, b)
    logits = inference_reference(model, INFERENCE(model), float64=True)
    first = logits(inputs[:1])[0]
    want = inference_reference(model, INFERENCE(model))(inputs[:1])[0]
    assert first.dtype == np.float64 and relative_error(want, first) < 1e-5
    with torch.no_grad():  # the weights change (a training step): the next copy has them
        model.lm_head.weight.mul_(2.0)
    np.testing.assert_allclose(logits(inputs[:1])[0], 2.0 * first, rtol=1e-12)

"""traceable_experts: JetMoE's routers and experts and DBRX's experts, switched for the export,
compute what the model's own code computes, and are switched back."""

from __future__ import annotations

import pytest

from blade_relax.bench.zoo import ARCHITECTURES, _first_layers, _model
from blade_relax.frontend.traceable_experts import traceable_experts

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _one_layer(architecture):
    return _model(_first_layers(ARCHITECTURES[architecture](), 1))


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


#: Modules switched per layer: JetMoE's router and two experts for the MLP and for the attention,
#: DBRX's experts.
SWITCHED = {"jetmoe": 6, "dbrx": 1}


@pytest.mark.parametrize("architecture", sorted(SWITCHED))
@pytest.mark.parametrize("length", [2, 7, 19])
def test_switched_layers_give_the_models_loss_and_gradients(architecture, length):
    model = _one_layer(architecture)
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
    want_loss, want = _loss_and_grads(model, ids)
    with traceable_experts(model) as switched:
        assert switched == SWITCHED[architecture]
        got_loss, got = _loss_and_grads(model, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_models_own_methods_are_back_on_exit():
    model = _one_layer("jetmoe")
    with pytest.raises(RuntimeError, match="inside"):
        with traceable_experts(model):
            assert any("forward" in vars(m) for m in model.modules())
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())


def test_other_models_are_left_as_they_are():
    model = _one_layer("mixtral")
    with traceable_experts(model) as switched:
        assert switched == 0
        assert not any("forward" in vars(m) for m in model.modules())

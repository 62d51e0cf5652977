"""Causal LMs beyond Llama and GPT-2 (a zoo of transformers' architectures, tiny configs with
random weights): each imported as a training step, compiled with the default pipeline, checked
against torch (loss and every gradient) at three lengths and measured against torch eager's
peak, through the benchmark's runner (one ruler for both).

Left out: OPT, whose key-projection bias gets a gradient that is zero in exact arithmetic (a
constant added to every key of a row leaves its softmax unchanged), so the relative error of
two rounding noises says nothing; mixture-of-experts models (Mixtral, Qwen3-MoE), which TVM's
importer refuses (``grouped_mm_fallback``, ``histc``).
"""

from __future__ import annotations

import pytest

from blade_relax.bench.runner import run_benchmark
from blade_relax.bench.workloads import ModelSizes, Workload
from blade_relax.frontend import import_training_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_LEN = 64
LENGTHS = (5, 17, 40)


#: The sizes every tiny config shares (names as most configs spell them; the rest map them).
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=MAX_LEN,
)
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def _tiny(model_type: str, **overrides):
    """A tiny config of ``model_type``, dropout off as in every benchmark model (the step is
    exported in eval mode, and torch eager runs the module as it is)."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    for name in _DROPOUTS:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config


def _falcon():
    """Falcon's new decoder architecture (grouped keys and values, parallel attention): keys
    indexed from the end (``[-2]``), a backward with ``new_empty_strided``, Python's ``pow``
    on sizes and an ``index_put`` along an inner axis; its attention is chosen through the
    config."""
    sizes = {k: v for k, v in TINY.items() if k != "head_dim"}  # a property of its config
    config = transformers.FalconConfig(**sizes, new_decoder_architecture=True, num_kv_heads=2)
    config.attention_dropout = config.hidden_dropout = 0.0
    return config


def _gpt_bigcode():
    """GPT-BigCode with multi-query attention: views compared as symbolic shapes."""
    return _tiny("gpt_bigcode", multi_query=True)


ARCHITECTURES = {
    "bloom": lambda: _tiny("bloom"),
    "cohere": lambda: _tiny("cohere"),
    "falcon": _falcon,
    "gemma": lambda: _tiny("gemma"),
    "gemma2": lambda: _tiny("gemma2"),
    "gpt_bigcode": _gpt_bigcode,
    "gpt_neox": lambda: _tiny("gpt_neox"),
    "gptj": lambda: _tiny("gptj", rotary_dim=4),
    "granite": lambda: _tiny("granite"),
    "mistral": lambda: _tiny("mistral"),
    "olmo": lambda: _tiny("olmo"),
    "olmo2": lambda: _tiny("olmo2"),
    "phi": lambda: _tiny("phi"),
    "phi3": lambda: _tiny("phi3", pad_token_id=0),
    "qwen2": lambda: _tiny("qwen2"),
    "qwen3": lambda: _tiny("qwen3"),
    "stablelm": lambda: _tiny("stablelm"),
    "starcoder2": lambda: _tiny("starcoder2"),
}
#: Architectures whose step is correct but peaks above torch eager's at some tested length, and
#: what was measured. The test fails when one of them no longer does (then drop it from here).
PEAK_ABOVE_EAGER = {
    "bloom": "its ALiBi bias, an (h, s, s) tensor built once and read by every layer",
    "cohere": "about 1.5 % above at s = 40 when measured",
    "gpt_bigcode": "about 1 % above at s = 40 when measured",
    "gpt_neox": "about 1-2 % above at s = 17 and 40 when measured",
    "starcoder2": "about 7 % above at s = 40 when measured",
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_training_step_matches_torch_within_its_peak(architecture):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[architecture]())
    graph = import_training_step(model, max_seq_len=MAX_LEN)
    assert graph.output_names[0] == "loss" and len(graph.output_names) == 1 + len(graph.params)
    workload = Workload(architecture, ModelSizes(max_seq_len=MAX_LEN), graph)
    result = run_benchmark(workload, ["blade-relax", "torch-eager"], LENGTHS, repeat=1)
    assert result.all_correct, [(r.config, r.seq_len, r.max_rel_error) for r in result.measurements]
    peaks = {(r.config, r.seq_len): r.peak_bytes for r in result.measurements}
    above = [
        f"s={n}: {peaks['blade-relax', n]} B > torch eager's {peaks['torch-eager', n]} B"
        for n in LENGTHS
        if peaks["blade-relax", n] > peaks["torch-eager", n]
    ]
    if architecture in PEAK_ABOVE_EAGER:
        assert above, f"{architecture} now peaks at or below torch eager: drop it from the list"
        known = PEAK_ABOVE_EAGER[architecture]
        pytest.xfail(f"{architecture} peaks above torch eager ({'; '.join(above)}): {known}")
    assert not above, f"{architecture}: {'; '.join(above)}"

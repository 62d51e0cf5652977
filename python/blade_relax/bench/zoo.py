"""The architecture zoo: causal LMs of transformers' mapping, tiny configs with random weights,
each imported as a training step, compiled with the default pipeline, checked against torch
(loss and every gradient) and measured against torch eager's peak at a few lengths; then
imported for inference (``input_ids -> logits``), checked and measured the same way.

``python -m blade_relax.bench.zoo --out docs/results/architectures.json`` runs every entry of
:data:`ARCHITECTURES` and :data:`REFUSED` and prints a table; ``python -m blade_relax.bench.docs``
turns the JSON into the README's architecture table. The tests run the same
:func:`check_architecture` (``tests/frontend/test_hf_architectures.py``).

OPT, XGLM, BioGPT and CTRL add a bias to every key of an attention row, which its softmax
ignores: that bias's gradient is zero in exact arithmetic, and torch's float32 value of it is
rounding noise (norms about 1e-11), as is ours. Their relative difference says nothing, so
those outputs are checked against torch's step in float64 instead, and pass where they are
within ten times torch's own float32 distance from it (:func:`~.runner.within_float64_rounding`;
``float64_checked`` names them, and the table marks the architecture). DiffLlama's lambda
gradients (norms about 1e-5) are checked the same way where their float32 error exceeds the
tolerance (stock TVM's does too).

Left out: PhiMoE, whose router draws experts at random in training mode, so that torch eager's
step differs from run to run. JetMoE, whose experts split the tokens by sizes read from a
tensor's values (``tolist()``), and DBRX, whose loop runs the experts a token chose
(``nonzero``), are exported with the routing kept in tensors
(:mod:`blade_relax.frontend.traceable_experts`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..util.cliargs import CliError, OneLineParser, check_output_path

__all__ = [
    "ARCHITECTURES",
    "LENGTHS",
    "MAX_LEN",
    "REFUSED",
    "ArchitectureResult",
    "check_all",
    "check_architecture",
    "check_model",
    "main",
    "tiny_config",
]

DEFAULT_PROG = "python -m blade_relax.bench.zoo"
#: The longest sequence each step is exported for, and the lengths it is measured at.
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
#: A sliding attention window shorter than the longest tested length, so that it masks.
_WINDOW = 16
#: How a dropout probability's name ends in transformers' configs.
_DROPOUT_SUFFIXES = ("dropout", "pdrop", "dropout_prob", "dropout_rate")


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (:data:`TINY`, then ``overrides``), dropout off as in
    every benchmark model (the step is exported in eval mode, and torch eager runs the module
    as it is)."""
    import transformers

    return _without_dropout(transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides}))


def _without_dropout(config: Any) -> Any:
    """``config`` with every dropout probability 0 (``attention_dropout``, ``resid_pdrop``,
    SeedOss's ``residual_dropout``...): torch eager would otherwise drop what the exported
    step does not."""
    for name, value in config.to_dict().items():
        if name.endswith(_DROPOUT_SUFFIXES) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def _falcon() -> Any:
    """Falcon's new decoder architecture (grouped keys and values, parallel attention): keys
    indexed from the end (``[-2]``), a backward with ``new_empty_strided``, Python's ``pow``
    on sizes and an ``index_put`` along an inner axis; its attention is chosen through the
    config."""
    import transformers

    sizes = {k: v for k, v in TINY.items() if k != "head_dim"}  # a property of its config
    config = transformers.FalconConfig(**sizes, new_decoder_architecture=True, num_kv_heads=2)
    return _without_dropout(config)


def _dbrx() -> Any:
    """DBRX: its sizes in sub-configs of their own (attention and experts), keys and values
    clipped, and a loop over the experts a token chose (exported as grouped GEMMs,
    :mod:`blade_relax.frontend.traceable_experts`)."""
    import transformers

    config = transformers.DbrxConfig(
        d_model=TINY["hidden_size"],
        n_heads=TINY["num_attention_heads"],
        n_layers=TINY["num_hidden_layers"],
        max_seq_len=MAX_LEN,
        vocab_size=TINY["vocab_size"],
        attn_config={
            "kv_n_heads": TINY["num_key_value_heads"],
            "clip_qkv": 8.0,
            # transformers reads it from the attention config, which does not default it.
            "rope_theta": 10000.0,
        },
        ffn_config={
            "ffn_hidden_size": TINY["intermediate_size"],
            "moe_num_experts": _MOE["num_local_experts"],
            "moe_top_k": _MOE["num_experts_per_tok"],
        },
    )
    return _without_dropout(config)


def _gpt_neo() -> Any:
    """GPT-Neo with a global and a local (windowed) attention layer and, as OpenAI GPT, a
    positions table longer than the exported lengths."""
    return tiny_config(
        "gpt_neo",
        attention_types=[[["global", "local"], 1]],
        window_size=_WINDOW,
        max_position_embeddings=2 * MAX_LEN,
    )


def _tiny(model_type: str, **overrides: Any) -> Callable[[], Any]:
    return lambda: tiny_config(model_type, **overrides)


def _mla(model_type: str, **overrides: Any) -> Callable[[], Any]:
    """A tiny config with multi-head latent attention (DeepSeek's): queries and keys and
    values through low-rank projections, rotary embeddings on 4 of each head's 8 dims, as many
    key heads as query heads."""
    latent = dict(
        num_key_value_heads=TINY["num_attention_heads"],
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        head_dim=4,  # the rotary part's, which its rotary embedding reads
        v_head_dim=8,
    )
    return _tiny(model_type, **{**latent, **overrides})


#: The experts of the tiny mixture-of-experts configs (as Mixtral and GraniteMoE name them).
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
#: The same for configs that name them as DeepSeek's do.
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
#: Those routed experts beside one shared expert, in every layer (no dense first layers).
_ROUTED_AND_SHARED = dict(**_ROUTED, n_shared_experts=1, first_k_dense_replace=0)
#: The same as Qwen2-MoE names them, and beside a shared expert.
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_SHARED = dict(**_EXPERTS, shared_expert_intermediate_size=32)
#: Architectures imported and checked, by ``model_type``: a function making the tiny config.
ARCHITECTURES: dict[str, Callable[[], Any]] = {
    # Sigmoid-scored routed experts beside dense layers; its router drawn again (_DRAWN_AGAIN).
    "afmoe": _tiny("afmoe", **_EXPERTS),
    # xIELU activation (expm1, log1p, a learned piecewise form).
    "apertus": _tiny("apertus"),
    "apertus1p5_text": _tiny("apertus1p5_text"),
    "arcee": _tiny("arcee"),
    "aria_text": _tiny("aria_text", moe_num_experts=4),
    "axk1": _mla("axk1", **_ROUTED, n_group=1, topk_group=1),
    "biogpt": _tiny("biogpt"),
    "bitnet": _tiny("bitnet"),
    "bloom": _tiny("bloom"),
    # Rotary embeddings on part of each head, interleaved (GPT-J's), and a fused QKV.
    "codegen": _tiny("codegen", rotary_dim=4, n_ctx=MAX_LEN),
    "cohere": _tiny("cohere"),
    # Sliding-window layers (a window of 16 < 40 tokens).
    "cohere2": _tiny("cohere2", sliding_window=_WINDOW),
    "cohere2_moe": _tiny("cohere2_moe", num_experts=4, sliding_window=_WINDOW),
    # Keys with a bias, whose gradient is zero in exact arithmetic (see the module docstring).
    "ctrl": _tiny("ctrl", dff=64),
    "cwm": _tiny("cwm", sliding_window=_WINDOW),
    # Multi-head latent attention, routed experts and a shared one; DeepSeek-V2 rotates queries
    # and keys as complex numbers, as Llama 4 does.
    "dbrx": _dbrx,
    "deepseek_v2": _mla("deepseek_v2", **_ROUTED_AND_SHARED, n_group=1),
    "deepseek_v3": _mla("deepseek_v3", **_ROUTED_AND_SHARED, n_group=1, topk_group=1),
    # Differential attention: two softmax maps, the second scaled by a learned lambda.
    "diffllama": _tiny("diffllama"),
    # Dynamic mask attention (a bias per key, exp(A * softplus(.)) of the values). A starts at 0,
    # where every bias is 1 and the softmax ignores it: A's gradient sums cancelling terms
    # (norm 4e-6, torch's own float32 error 9e-5 of it at s = 17), checked against float64.
    "doge": _tiny("doge"),
    "dory": _tiny("dory", sliding_window=_WINDOW),
    "dots1": _tiny("dots1", **_ROUTED_AND_SHARED),
    "ernie4_5": _tiny("ernie4_5"),
    "ernie4_5_moe": _tiny("ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "exaone": _tiny("exaone"),
    "exaone4": _tiny("exaone4", sliding_window=_WINDOW),
    "exaone_moe": _tiny(
        "exaone_moe",
        **_EXPERTS,
        first_k_dense_replace=0,
        sliding_window=_WINDOW,
    ),
    "falcon": _falcon,
    "flex_olmo": _tiny("flex_olmo", num_experts=4, num_experts_per_tok=2, pad_token_id=0),
    "flint": _tiny("flint", **_SHARED, sliding_window=_WINDOW),
    "gemma": _tiny("gemma"),
    "gemma2": _tiny("gemma2"),
    "gemma3_text": _tiny("gemma3_text"),
    "gemma4_text": _tiny("gemma4_text", sliding_window=_WINDOW),
    "glm": _tiny("glm", pad_token_id=0),
    "glm4": _tiny("glm4", pad_token_id=0),
    # Routed and grouped experts (2 groups, 1 chosen: an unsorted top-k).
    "glm4_moe": _tiny("glm4_moe", **_ROUTED, first_k_dense_replace=0, n_group=2, topk_group=1),
    "glm4_moe_lite": _mla("glm4_moe_lite", **_ROUTED),
    "gpt-sw3": _tiny("gpt-sw3"),
    "gpt2": _tiny("gpt2"),
    # Multi-query attention: views compared as symbolic shapes.
    "gpt_bigcode": _tiny("gpt_bigcode", multi_query=True),
    "gpt_neo": _gpt_neo,
    "gpt_neox": _tiny("gpt_neox"),
    "gpt_neox_japanese": _tiny("gpt_neox_japanese"),
    # Attention sinks (a learned logit beside each row's scores), routed experts, and sliding
    # and full attention layers.
    "gpt_oss": _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=_WINDOW),
    "gptj": _tiny("gptj", rotary_dim=4),
    "granite": _tiny("granite"),
    # Attention sinks through logsumexp (amax), sliding-window layers.
    "granite_swa": _tiny("granite_swa", sliding_window=_WINDOW),
    "granitemoe": _tiny("granitemoe", **_MOE),
    "granitemoe_swa": _tiny("granitemoe_swa", num_local_experts=4, sliding_window=_WINDOW),
    "granitemoeshared": _tiny("granitemoeshared", **_MOE),
    "helium": _tiny("helium"),
    "hrm_text": _tiny("hrm_text"),
    "hunyuan_v1_dense": _tiny("hunyuan_v1_dense"),
    "hunyuan_v1_moe": _tiny("hunyuan_v1_moe", num_experts=4, moe_topk=2),
    "hy_v3": _tiny("hy_v3", **_EXPERTS),
    "hyperclovax": _tiny("hyperclovax"),
    # Convolutions (conv1d and its backward, frontend.convolution) in mixture-of-experts layers.
    "inkling_text": _tiny("inkling_text", **_ROUTED, n_shared_experts=1),
    "inkling2_text": _tiny("inkling2_text", **_ROUTED),
    "internlm3": _tiny("internlm3"),
    "iquestcoder": _tiny("iquestcoder"),
    "jais2": _tiny("jais2"),
    # Mixtures of experts for the MLP and for the attention's query and output projections,
    # each expert's rows split by counts read from a tensor.
    "jetmoe": _tiny("jetmoe", **_MOE, kv_channels=8),
    "kolibri1": _tiny(
        "kolibri1",
        **_MOE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=_WINDOW,
    ),
    "laguna": _tiny("laguna", **_SHARED, sliding_window=_WINDOW),
    # Short causal convolutions (conv1d and its backward) beside attention layers.
    "lfm2": _tiny("lfm2", layer_types=["conv", "full_attention"]),
    "lfm2_moe": _tiny(
        "lfm2_moe", **_EXPERTS, num_dense_layers=0, layer_types=["conv", "full_attention"]
    ),
    "lfm3": _tiny(
        "lfm3", pad_token_id=0, layer_types=["conv", "sliding_attention"], sliding_window=_WINDOW
    ),
    "llama": _tiny("llama"),
    # Chunked attention, top-1 experts, rotary embeddings as complex numbers.
    "llama4_text": _tiny(
        "llama4_text",
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
        attention_chunk_size=_WINDOW,
    ),
    "mellum": _tiny("mellum", **_MOE, moe_intermediate_size=32, sliding_window=_WINDOW),
    "mimo_v2_flash": _tiny("mimo_v2_flash", **_ROUTED, v_head_dim=8, sliding_window=_WINDOW),
    # Multi-head latent attention in a dense model.
    "minicpm3": _mla("minicpm3"),
    # Lightning (linear) attention beside full attention, in blocks of min(256, s) rows: a guard
    # torch cannot prove, deferred and checked at every length (frontend.guards).
    "minimax": _tiny("minimax", **_MOE),
    "minimax_m2": _tiny("minimax_m2", **_MOE),
    "ministral": _tiny("ministral", sliding_window=_WINDOW),
    # Queries scaled by 1 + 0.1 log(1 + floor(position / 16)) (integer positions divided as
    # floats) with YaRN rotary embeddings; 16 original positions, so that the scale varies.
    "ministral3": _tiny(
        "ministral3",
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=MAX_LEN / 16,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            llama_4_scaling_beta=0.1,
        ),
    ),
    "mistral": _tiny("mistral"),
    # Mixture-of-experts: 4 experts, 2 per token, one grouped GEMM (frontend.moe).
    "mixtral": _tiny("mixtral", **_MOE),
    "modernbert-decoder": _tiny("modernbert-decoder", pad_token_id=0, sliding_window=_WINDOW),
    # ALiBi position biases (a slice that depends on the length).
    "mpt": _tiny("mpt"),
    "nanochat": _tiny("nanochat"),
    # Squared ReLU and a LayerNorm whose weight is offset by 1.
    "nemotron": _tiny("nemotron"),
    "olmo": _tiny("olmo"),
    "olmo2": _tiny("olmo2"),
    "olmo3": _tiny("olmo3", sliding_window=_WINDOW),
    "olmoe": _tiny("olmoe", num_experts=4, num_experts_per_tok=2),
    # Learned positions; at MAX_LEN of them, the export asks the length to differ from it.
    "openai-gpt": _tiny("openai-gpt", max_position_embeddings=2 * MAX_LEN),
    # Embeddings narrower than the model (projected in and out, as OPT-350m's).
    "opt": _tiny("opt", ffn_dim=64, word_embed_proj_dim=16),
    "persimmon": _tiny("persimmon"),
    "phi": _tiny("phi"),
    "phi3": _tiny("phi3", pad_token_id=0),
    "qwen2": _tiny("qwen2"),
    # Routed experts beside a gated shared expert.
    "qwen2_moe": _tiny("qwen2_moe", **_SHARED),
    "qwen3": _tiny("qwen3"),
    "qwen3_moe": _tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2),
    "sarvam_mla": _mla("sarvam_mla", **_ROUTED, first_k_dense_replace=0),
    "sarvam_moe": _tiny("sarvam_moe", **_ROUTED, first_k_dense_replace=0),
    "seed_oss": _tiny("seed_oss"),
    "smollm3": _tiny("smollm3", pad_token_id=0),
    "solar_open": _tiny("solar_open", **_ROUTED),
    "stablelm": _tiny("stablelm"),
    "starcoder2": _tiny("starcoder2"),
    "vaultgemma": _tiny("vaultgemma", sliding_window=_WINDOW),
    # Sinusoidal positions, scaled embeddings.
    "xglm": _tiny("xglm", ffn_dim=64),
    "youtu": _mla("youtu"),
}
#: Architectures refused at import, each with the operators that refuse it. None today: the
#: mixture-of-experts models once here import since :mod:`blade_relax.frontend.moe`, Llama 4's
#: export since :mod:`blade_relax.frontend.guards`, and DeepSeek-V2's and Llama 4's rotation as
#: complex numbers since :mod:`blade_relax.frontend.complex_pairs`.
REFUSED: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {}


class _AgainstEager:
    """``peaks`` against ``eager_peaks``, for the results below."""

    peaks: tuple[int | None, ...]
    eager_peaks: tuple[int, ...]

    @property
    def peak_ratios(self) -> tuple[float | None, ...]:
        """``blade-relax``'s peak over torch eager's, per length (None where a run failed)."""
        return tuple(
            None if ours is None or not eager else ours / eager
            for ours, eager in zip(self.peaks, self.eager_peaks)
        )

    @property
    def at_or_below_eager(self) -> bool:
        ratios = self.peak_ratios
        return bool(ratios) and all(r is not None and r <= 1.0 for r in ratios)


@dataclass
class ArchitectureResult(_AgainstEager):
    """What :func:`check_architecture` found for one architecture.

    Attributes
    ----------
    architecture
        The ``model_type``.
    status
        ``"supported"`` (imported, every length correct), ``"incorrect"`` (imported, some
        length wrong) or ``"refused"`` (refused at import, :attr:`reason` says why).
    lengths
        The lengths measured.
    peaks, eager_peaks
        Peak bytes of ``blade-relax`` and of ``torch-eager`` per length.
    max_rel_error
        The largest relative error against torch over lengths, loss and gradients (but those
        in :attr:`float64_checked`).
    float64_checked
        The outputs (``grad:<parameter>``) checked against torch in float64 at some length,
        their float32 values being rounding noise (see the module docstring).
    reason
        Why it was refused (the operators and what they do).
    seconds
        Import, compilation and measurement, in seconds.
    inference
        The same for the inference import (:func:`check_inference`): its status, peaks,
        torch eager's peaks, largest relative error of the logits and reason; ``None`` where
        it was not measured.
    """

    architecture: str
    status: str
    lengths: tuple[int, ...] = ()
    peaks: tuple[int, ...] = ()
    eager_peaks: tuple[int, ...] = ()
    max_rel_error: float | None = None
    reason: str = ""
    seconds: float = 0.0
    float64_checked: tuple[str, ...] = ()
    inference: InferenceResult | None = None

    def __post_init__(self) -> None:
        if isinstance(self.inference, dict):  # read back from the JSON document
            self.inference = InferenceResult(**self.inference)


@dataclass
class InferenceResult(_AgainstEager):
    """What :func:`check_inference` found for one architecture (fields as in
    :class:`ArchitectureResult`; the error is the logits')."""

    status: str
    peaks: tuple[int, ...] = ()
    eager_peaks: tuple[int, ...] = ()
    max_rel_error: float | None = None
    reason: str = ""


#: Parameters the zoo draws again (normal, the config's ``initializer_range``) after the model's
#: own initialisation, by the end of their names: AFMoE zero-initialises its router, so that
#: every expert ties for every token and torch's CPU ``topk`` and TVM's break the ties
#: differently (experts 2, 3 against 0, 1; both valid, stock TVM's the same); a trained router
#: does not tie.
_DRAWN_AGAIN = {"afmoe": "router.gate.weight"}


def _model(config: Any) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    suffix = _DRAWN_AGAIN.get(config.model_type)
    if suffix is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(suffix):
                    torch.nn.init.normal_(param, std=config.initializer_range)
    return model


def check_architecture(
    architecture: str,
    lengths: Sequence[int] = LENGTHS,
    layers: int | None = None,
    inference: bool = False,
) -> tuple[ArchitectureResult, Any]:
    """Import, compile, check and measure one architecture of :data:`ARCHITECTURES` or
    :data:`REFUSED` (:func:`check_model` on its tiny model).

    Parameters
    ----------
    architecture
        The ``model_type``.
    lengths
        The sequence lengths checked and measured.
    layers
        Decoder layers of the tiny model, at most its config's: the first ``layers``
        (``layer_types`` included); ``None`` keeps them all.
    inference
        Also import the model for inference and check and measure that
        (:func:`check_inference`, the result's ``inference``), where the training step was not
        refused.

    Raises
    ------
    ValueError
        For an architecture in neither table, or ``layers`` outside 1 to the config's.
    """
    if architecture in REFUSED:
        make = REFUSED[architecture][0]
    elif architecture in ARCHITECTURES:
        make = ARCHITECTURES[architecture]
    else:
        known = ", ".join(sorted({*ARCHITECTURES, *REFUSED}))
        raise ValueError(f"unknown architecture {architecture!r}; the zoo has {known}")
    config = make()
    if layers is not None:
        config = _first_layers(config, layers)
    summary, result = check_model(architecture, _model(config), lengths)
    if inference and summary.status != "refused":
        start = time.perf_counter()
        summary.inference = check_inference(_model(config), lengths)
        summary.seconds += time.perf_counter() - start
    return summary, result


def _first_layers(config: Any, layers: int) -> Any:
    """``config`` cut to its first ``layers`` decoder layers."""
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(
            f"layers must be from 1 to the tiny config's {config.num_hidden_layers}, not {layers}"
        )
    config.num_hidden_layers = layers
    # Configs that name each layer's kind (sliding or full attention) keep the first ones.
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        config.layer_types = list(kinds[:layers])
    return config


def check_model(
    architecture: str, model: Any, lengths: Sequence[int] = LENGTHS
) -> tuple[ArchitectureResult, Any]:
    """Import ``model`` as a training step (lengths up to :data:`MAX_LEN`), compile it with the
    default pipeline, check it against torch (loss and every gradient) and measure its peak
    against torch eager's at ``lengths``.

    Returns
    -------
    (ArchitectureResult, BenchResult or None)
        The summary and the benchmark's result (``None`` when the model was refused).
    """
    from ..frontend import UnsupportedOperatorError, import_training_step

    start = time.perf_counter()
    try:
        graph = import_training_step(model, max_seq_len=MAX_LEN)
    except UnsupportedOperatorError as err:
        return ArchitectureResult(architecture, "refused", reason=str(err)), None
    result, ours, eager = _measure(architecture, graph, lengths)
    summary = ArchitectureResult(
        architecture,
        "supported" if result.all_correct else "incorrect",
        tuple(lengths),
        tuple(r.peak_bytes for r in ours),
        tuple(r.peak_bytes for r in eager),
        max((r.max_rel_error or 0.0) for r in ours),
        reason=_first_error(ours),
        seconds=time.perf_counter() - start,
        float64_checked=tuple(sorted({name for r in ours for name in r.float64_checked or ()})),
    )
    return summary, result


def check_inference(model: Any, lengths: Sequence[int] = LENGTHS) -> InferenceResult:
    """Import ``model`` for inference (``input_ids -> logits``, lengths up to
    :data:`MAX_LEN`), compile it with the default pipeline, check its logits against torch's
    and measure its peak against torch eager's at ``lengths``."""
    from ..frontend import UnsupportedOperatorError, import_inference

    try:
        graph = import_inference(model, max_seq_len=MAX_LEN)
    except UnsupportedOperatorError as err:
        return InferenceResult("refused", reason=str(err))
    result, ours, eager = _measure(model.config.model_type, graph, lengths)
    return InferenceResult(
        "supported" if result.all_correct else "incorrect",
        tuple(r.peak_bytes for r in ours),
        tuple(r.peak_bytes for r in eager),
        max((r.max_rel_error or 0.0) for r in ours),
        _first_error(ours),
    )


def _measure(name: str, graph: Any, lengths: Sequence[int]) -> tuple[Any, list, list]:
    """``blade-relax`` and ``torch-eager`` on ``graph`` at ``lengths``: the benchmark's result
    and the two configurations' measurements, a length each."""
    from .runner import run_benchmark
    from .workloads import ModelSizes, Workload

    workload = Workload(name, ModelSizes(max_seq_len=MAX_LEN), graph)
    result = run_benchmark(workload, ["blade-relax", "torch-eager"], list(lengths), repeat=1)
    rows = {(r.config, r.seq_len): r for r in result.measurements}
    return (
        result,
        [rows["blade-relax", n] for n in lengths],
        [rows["torch-eager", n] for n in lengths],
    )


def _first_error(measurements: Sequence[Any]) -> str:
    return next((f"s = {r.seq_len}: {r.error}" for r in measurements if r.error), "")


def table(results: Sequence[ArchitectureResult], per_row: int = 1) -> str:
    """A markdown table, ``per_row`` architectures a row (the inference import's error and
    peaks in two more columns where any was measured), a line per refused one saying why, and
    one naming the architectures with outputs checked against float64 (marked †)."""
    lengths = next((r.lengths for r in results if r.lengths), LENGTHS)
    at = ", ".join(str(n) for n in lengths)
    head = f"architecture | max rel. error | peak ÷ eager at s = {at}"
    align = "---|---:|---|"
    inference = any(r.inference is not None for r in results)
    if inference:
        head += " | inference: error | peak ÷ eager"
        align += "---:|---|"
    blank = " | ".join([""] * head.count("|")) + " |"
    cells = []
    for r in results:
        if r.status == "refused":
            cell = f"{r.architecture} | refused (below) | "
        else:
            mark = " †" if r.float64_checked else ""
            cell = f"{_named(r.architecture, r.status)} | {_measured(r, mark)}"
        if inference:
            cell += " | " + ("not measured | " if r.inference is None else _measured(r.inference))
        cells.append(cell)
    rows = [cells[i : i + per_row] for i in range(0, len(cells), per_row)]
    lines = [
        "| " + " | ".join([head] * per_row) + " |",
        "|" + align * per_row,
        *("| " + " | ".join(row + [blank] * (per_row - len(row))) + " |" for row in rows),
    ]
    notes = _refusals([r for r in results if r.status == "refused"])
    notes += [
        f"- {r.architecture}'s inference import: {r.inference.status}, {r.inference.reason}"
        for r in results
        if r.inference is not None and r.inference.reason
    ]
    checked = [f"{r.architecture} {len(r.float64_checked)}" for r in results if r.float64_checked]
    if checked:
        from .runner import FLOAT64_MULTIPLIER

        notes.append(
            f"- † gradients whose float32 values are rounding noise ({', '.join(checked)}), "
            f"checked against torch in float64: each at most {FLOAT64_MULTIPLIER:g} times as far "
            "from it as torch's own float32 result; the error shown is over the other outputs."
        )
    return "\n".join([*lines, *([""] + notes if notes else [])])


def _named(architecture: str, status: str) -> str:
    return architecture if status == "supported" else f"{architecture} ({status})"


def _measured(result: ArchitectureResult | InferenceResult, mark: str = "") -> str:
    """``error | ratios`` of a measured result (``refused`` for a refused inference import)."""
    if result.status == "refused":
        return "refused (below) | "
    ratios = ", ".join("failed" if x is None else f"{x:.3f}" for x in result.peak_ratios)
    error = "n/a" if result.max_rel_error is None else f"{result.max_rel_error:.1e}"
    status = "" if result.status == "supported" else f" ({result.status})"
    return f"{error}{mark}{status if isinstance(result, InferenceResult) else ''} | {ratios}"


def _refusals(refused: Sequence[ArchitectureResult]) -> list[str]:
    """A line per reason of refusal, naming the architectures it refuses."""
    names: dict[str, list[str]] = {}
    for r in refused:
        prefix = f"{r.architecture} is not supported: "
        why = r.reason[len(prefix) :] if r.reason.startswith(prefix) else r.reason
        names.setdefault(why, []).append(r.architecture)
    return [f"- {', '.join(archs)}: not supported, {why}" for why, archs in names.items()]


def build_parser(prog: str = DEFAULT_PROG) -> OneLineParser:
    parser = OneLineParser(
        prog=prog,
        description="Import, check against torch and measure every architecture of the zoo "
        "(tiny configs, random weights) as a training step and for inference.",
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated architectures (default: all of them)"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--no-inference",
        action="store_true",
        help="check and measure the training step only, not the inference import too",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="architectures checked at once, each in a process of its own (default 1; peaks are "
        "counted allocations, the same with any number)",
    )
    return parser


def _summary(architecture: str, inference: bool) -> ArchitectureResult:
    return check_architecture(architecture, inference=inference)[0]


def check_all(
    names: Sequence[str],
    jobs: int = 1,
    say: Callable[[str], None] | None = None,
    inference: bool = True,
) -> list[ArchitectureResult]:
    """:func:`check_architecture` on each of ``names`` (with its inference import unless
    ``inference`` is false), in that order, ``jobs`` at once in processes of their own
    (spawned: none inherits another's torch or TVM state). ``say`` is told each architecture
    as it starts (one process) or ends (several)."""
    if jobs == 1:
        results = []
        for name in names:
            if say is not None:
                say(f"... {name}")
            results.append(_summary(name, inference))
        return results
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_summary, name, inference): name for name in names}
        for future in concurrent.futures.as_completed(futures):
            if say is not None:
                say(f"... {futures[future]} done")
        return [future.result() for future in futures]


def main(argv: Sequence[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Entry point: prints the table; 0 when every architecture is supported or refused as
    expected (and every inference import measured is supported), 1 otherwise, 2 on bad
    input."""
    names = [*ARCHITECTURES, *REFUSED]
    try:
        args = build_parser(prog).parse_args(argv)
        if args.only:
            names = [n.strip() for n in args.only.split(",") if n.strip()]
            unknown = [n for n in names if n not in ARCHITECTURES and n not in REFUSED]
            if unknown:
                raise CliError(f"unknown architecture(s) {', '.join(unknown)} (see --help)")
        if args.jobs < 1:
            raise CliError(f"--jobs must be at least 1, not {args.jobs}")
        check_output_path(args.out, "--out")
    except CliError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    from .report import provenance

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = check_all(
        sorted(names), args.jobs, None if args.quiet else say, not args.no_inference
    )
    if args.out:
        command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
        document = {
            "schema": 2,
            "provenance": provenance(command),
            "max_len": MAX_LEN,
            "results": [dataclasses.asdict(r) for r in results],
        }
        with open(args.out, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    print(table(results))
    for r in results:
        if r.reason and r.status != "refused":
            print(f"{r.architecture}: {r.reason}")
    expected = all(
        (r.status == "refused") == (r.architecture in REFUSED)
        and r.status != "incorrect"
        and (r.inference is None or r.inference.status == "supported")
        for r in results
    )
    return 0 if expected else 1


if __name__ == "__main__":
    sys.exit(main())

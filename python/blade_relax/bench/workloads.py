"""Benchmark workloads: a model, its imported graph, and its torch counterpart.

``llama-train``
    ``LlamaForCausalLM`` training step (loss + every gradient), torch's joint export.
``gpt2-train``
    ``GPT2LMHeadModel`` training step (``tie_word_embeddings=False``).
``llama-sft``
    Supervised fine-tuning of the ``LlamaForCausalLM``, as users run it: batches of
    ``sizes.batch`` (prompt, response) pairs (4 when ``sizes.batch`` is 1) padded to the
    longest with an ``attention_mask``, labels of -100 on prompt and padding
    (:mod:`.sft`); ``b`` and ``s`` symbolic; every parameter trained.
``llama-lora-sft``
    The same with LoRA adapters (PEFT, rank :data:`LORA_RANK` on every projection of every
    layer) on the frozen model: only the adapters get gradients. Their ``lora_B`` starts
    drawn (``N(0, 0.02)``) rather than at PEFT's zeros, as after a few steps of training, so
    that every gradient is non-zero and checked against torch.
``gpt2-infer``
    ``GPT2LMHeadModel`` logits.
``mlp-train``
    A Relax-native MLP classifier over ``s`` tokens, differentiated by
    ``relax.transform.Gradient``; the same model in torch is its reference.
``tanh-mlp-train``
    The textbook case of checkpointing: a Relax-native regression MLP (4 hidden ``tanh``
    layers of width 384, squared error on 10 outputs, a batch of ``s`` rows) written as a new
    user would, differentiated by ``relax.transform.Gradient`` (the forward pass computed once:
    :func:`~blade_relax.frontend.relax_training_step` merges the copy ``Gradient`` makes of
    it). Its widths are fixed (:data:`TANH_MLP_WIDTHS`); of the sizes only
    the range of ``s`` applies.

Models are built from a config with seeded random weights (nothing is downloaded). Sizes come
from :class:`ModelSizes`: ``SMALL`` finishes on a 2-core CPU in minutes, ``REAL`` is the
size to run on a GPU, ``LLAMA_1B`` the Llama-2 architecture at 1.1B parameters (the size of
BladeDISC++'s evaluation, TinyLlama's shape), for the predicted mode (:mod:`.predict`) on a CPU
and for measuring on a GPU.

``weights="empty"`` builds the Hugging Face models without drawing their weights (storage
allocated, never written: the pages stay unmapped until read): the import still runs the real
loading code (``torch.export``, the joint graph, ``from_exported_program``), which copies the
parameters once, but nothing spends time on 1.1B random numbers. Use it only where no kernel
reads the weights (the predicted mode); the torch reference of such a graph is meaningless.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..frontend import ImportedGraph, import_inference, import_training_step, relax_training_step

__all__ = [
    "DTYPES",
    "LLAMA_1B",
    "PRESETS",
    "REAL",
    "SMALL",
    "WORKLOADS",
    "ModelSizes",
    "Workload",
    "build_workload",
    "gpt2_model",
    "import_sized",
    "llama_model",
    "lora_model",
    "workload_sizes",
]


@dataclass(frozen=True)
class ModelSizes:
    """Model and run sizes of a workload.

    Attributes
    ----------
    layers, hidden, heads, kv_heads, intermediate, vocab
        Decoder layers, hidden size, attention heads, key/value heads (Llama), MLP width and
        vocabulary (the number of classes for ``mlp-train``).
    max_seq_len, min_seq_len
        The exported range of the sequence length ``s``.
    batch
        Batch size (static).
    dtype
        Floating-point type of the Hugging Face models' weights and computation
        (``"float32"`` or ``"bfloat16"``; :data:`DTYPES`). The Relax-native MLPs are float32.
    autocast
        Mixed precision of the Hugging Face training workloads: ``None``, or ``"bfloat16"`` /
        ``"float16"`` for float32 weights with the forward under ``torch.autocast`` of that
        dtype (:func:`blade_relax.frontend.import_training_step`); needs ``dtype="float32"``.
    """

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_seq_len: int = 256
    min_seq_len: int = 2
    batch: int = 1
    dtype: str = "float32"
    autocast: str | None = None


SMALL = ModelSizes()
REAL = ModelSizes(
    layers=4,
    hidden=1024,
    heads=16,
    kv_heads=8,
    intermediate=2816,
    vocab=32000,
    max_seq_len=2048,
)
LLAMA_1B = ModelSizes(
    layers=22,
    hidden=2048,
    heads=32,
    kv_heads=4,
    intermediate=5632,
    vocab=32000,
    max_seq_len=2048,
)
PRESETS = {"small": SMALL, "real": REAL, "1b": LLAMA_1B}
WEIGHTS = ("random", "empty")
DTYPES = ("float32", "bfloat16")
# The workloads built from a Hugging Face model (the others are Relax-native, float32).
HF_WORKLOADS = ("llama-train", "gpt2-train", "gpt2-infer", "llama-sft", "llama-lora-sft")
# The fine-tuning workloads: padded batches of (prompt, response) pairs.
SFT_WORKLOADS = ("llama-sft", "llama-lora-sft")
#: Sequences a step of the fine-tuning workloads when ``ModelSizes.batch`` is 1.
SFT_BATCH = 4
#: LoRA rank, scale (``lora_alpha``) and target modules of ``llama-lora-sft``.
LORA_RANK = 16
LORA_ALPHA = 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Workload:
    """One benchmark workload, ready to be measured.

    Attributes
    ----------
    name
        Registry name (``"llama-train"``).
    sizes
        The sizes it was built with.
    graph
        The imported graph (symbolic length ``s``, upper bound kept); configurations derive
        their variants from it.
    """

    name: str
    sizes: ModelSizes
    graph: ImportedGraph

    @property
    def kind(self) -> str:
        return self.graph.kind

    @property
    def is_sft(self) -> bool:
        """Whether a step is a padded batch of (prompt, response) pairs (:mod:`.sft`)."""
        return self.name in SFT_WORKLOADS

    def inputs(self, length: int, seed: int = 0) -> list[np.ndarray]:
        """Seeded inputs at sequence length ``length`` (checked against the exported range).

        For the fine-tuning workloads: ``sizes.batch`` pairs padded to ``length``, the longest
        of them exactly ``length`` tokens (:func:`.sft.pairs_at`, on the right).
        """
        if self.is_sft:
            from .sft import pad_batch, pairs_at

            low, high = self.sizes.min_seq_len, self.sizes.max_seq_len
            self.graph.check_dims({"s": length})
            pairs = pairs_at(length, self.sizes.batch, low, high, seed=seed + length)
            batch = pad_batch(pairs, self.sizes.vocab, seed=seed + length)
            return [batch[name] for name in self.graph.input_names]
        dims = {"s": length}
        if "b" in self.graph.dims:
            dims["b"] = self.sizes.batch
        return self.graph.random_inputs(dims, seed=seed + length)


def _seed_torch(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _weights_context(weights: str) -> Any:
    """Where a model is built: drawing its weights (``"random"``) or not (``"empty"``)."""
    import contextlib

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")
    if weights == "random":
        return contextlib.nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")


def _torch_dtype(sizes: ModelSizes) -> Any:
    import torch

    _check_dtype(sizes.dtype)
    return getattr(torch, sizes.dtype)


def llama_model(
    sizes: ModelSizes,
    *,
    seed: int = 0,
    attn_implementation: str | None = "eager",
    weights: str = "random",
) -> Any:
    """A ``LlamaForCausalLM`` of ``sizes`` with seeded random weights (nothing downloaded).

    Parameters
    ----------
    sizes
        Layers, widths, vocabulary and ``max_seq_len`` (its position limit).
    seed
        ``torch.manual_seed`` before the weights are drawn.
    attn_implementation
        Passed to the config; ``None`` keeps the library's default (``sdpa``).
    weights
        ``"random"``, or ``"empty"``: allocated, not drawn (see the module docstring).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    _seed_torch(seed)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=max(sizes.max_seq_len, 2),
        tie_word_embeddings=False,
        **extra,
    )
    dtype = _torch_dtype(sizes)  # checked before the model is built
    with _weights_context(weights):
        return LlamaForCausalLM(config).to(dtype)


def gpt2_model(
    sizes: ModelSizes,
    *,
    seed: int = 0,
    tied: bool = False,
    attn_implementation: str | None = "eager",
    weights: str = "random",
) -> Any:
    """A ``GPT2LMHeadModel`` of ``sizes`` with seeded random weights and no dropout.

    Parameters
    ----------
    sizes
        Layers, widths (``kv_heads`` unused), vocabulary and ``max_seq_len``.
    seed
        ``torch.manual_seed`` before the weights are drawn.
    tied
        Tie the output projection to the token embedding (GPT-2's own default).
    attn_implementation
        Passed to the config; ``None`` keeps the library's default (``sdpa``).
    weights
        ``"random"``, or ``"empty"``: allocated, not drawn (see the module docstring).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    _seed_torch(seed)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = GPT2Config(
        vocab_size=sizes.vocab,
        n_embd=sizes.hidden,
        n_layer=sizes.layers,
        n_head=sizes.heads,
        n_inner=sizes.intermediate,
        n_positions=max(sizes.max_seq_len, 2),
        tie_word_embeddings=tied,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )
    dtype = _torch_dtype(sizes)  # checked before the model is built
    with _weights_context(weights):
        return GPT2LMHeadModel(config).to(dtype)


def import_sized(model: Any, sizes: ModelSizes, **batch: Any) -> ImportedGraph:
    """``model``'s training step (:func:`~blade_relax.frontend.hf.import_training_step`) over
    the lengths of ``sizes`` (``min_seq_len`` to ``max_seq_len``) under its ``autocast``.

    ``batch`` are the import's keywords about the batch (``batch_size``, ``max_batch_size`` for
    a dynamic batch axis, ``attention_mask``): every workload, the data-parallel benchmark and
    ``train --nproc`` import through this one function.
    """
    return import_training_step(
        model,
        max_seq_len=sizes.max_seq_len,
        min_seq_len=sizes.min_seq_len,
        autocast=sizes.autocast,
        **batch,
    )


def _llama_train(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return import_sized(
        llama_model(sizes, seed=seed, weights=weights), sizes, batch_size=sizes.batch
    )


def _gpt2_train(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return import_sized(
        gpt2_model(sizes, seed=seed, weights=weights), sizes, batch_size=sizes.batch
    )


def _sft_import(model: Any, sizes: ModelSizes) -> ImportedGraph:
    return import_sized(
        model, sizes, batch_size=sizes.batch, max_batch_size=sizes.batch, attention_mask=True
    )


def lora_model(model: Any, *, seed: int = 0, rank: int = LORA_RANK) -> Any:
    """``model`` with PEFT LoRA adapters of ``rank`` on :data:`LORA_TARGETS` (base frozen).

    ``lora_B`` is drawn from ``N(0, 0.02)`` (seeded) instead of PEFT's zeros: see the module
    docstring.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0
    )
    lora = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                draw = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(draw.to(param.dtype))
    return lora


def _llama_sft(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return _sft_import(llama_model(sizes, seed=seed, weights=weights), sizes)


def _llama_lora_sft(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    model = lora_model(llama_model(sizes, seed=seed, weights=weights), seed=seed)
    return _sft_import(model, sizes)


def _gpt2_infer(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return import_inference(
        gpt2_model(sizes, seed=seed, weights=weights),
        max_seq_len=sizes.max_seq_len,
        min_seq_len=sizes.min_seq_len,
        batch_size=sizes.batch,
    )


def mlp_forward_module(sizes: ModelSizes) -> tvm.IRModule:
    """``main(x, onehot, w0, b0, ..., w_out, b_out) -> loss`` with ``x: (s, hidden)``.

    ``layers`` hidden layers of ``Linear(hidden, intermediate) -> relu`` (the first from
    ``hidden``), a ``Linear(., vocab)`` head, and the summed cross-entropy
    ``-sum(log_softmax(logits) * onehot)`` (a sum: ``Gradient`` cannot differentiate ``mean``
    over a symbolic axis).
    """
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((s, sizes.hidden), "float32"))
    onehot = relax.Var("onehot", relax.TensorType((s, sizes.vocab), "float32"))
    widths = [sizes.hidden] + [sizes.intermediate] * sizes.layers + [sizes.vocab]
    weights: list[relax.Var] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        weights.append(relax.Var(f"w{i}", relax.TensorType((fan_in, fan_out), "float32")))
        weights.append(relax.Var(f"b{i}", relax.TensorType((fan_out,), "float32")))
    op = relax.op
    with bb.function("main", [x, onehot, *weights]):
        with bb.dataflow():
            h = x
            for i in range(len(widths) - 1):
                h = bb.emit(op.add(op.matmul(h, weights[2 * i]), weights[2 * i + 1]))
                if i < len(widths) - 2:
                    h = bb.emit(op.nn.relu(h))
            logp = bb.emit(op.nn.log_softmax(h, axis=-1))
            picked = bb.emit(op.sum(op.multiply(logp, onehot)))
            loss = bb.emit_output(op.negative(picked))
        bb.emit_func_output(loss)
    return bb.get()


def _mlp_torch(sizes: ModelSizes, params: Sequence[np.ndarray]) -> Any:
    import torch

    class MlpStep(torch.nn.Module):
        """The torch twin of :func:`mlp_forward_module`: ``(x, onehot) -> (loss,)``."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.from_numpy(np.array(p))) for p in params]
            )

        def forward(self, x, onehot):
            h = x
            count = len(self.weights) // 2
            for i in range(count):
                h = h @ self.weights[2 * i] + self.weights[2 * i + 1]
                if i < count - 1:
                    h = torch.relu(h)
            loss = -(torch.log_softmax(h, dim=-1) * onehot).sum()
            return (loss,)

    return MlpStep()


def _relax_native_graph(
    forward: tvm.IRModule, sizes: ModelSizes, seed: int, twin: Callable[[list], Any]
) -> ImportedGraph:
    """The training step of a Relax-native ``main(input_0, input_1, *params) -> loss``.

    Parameters are seeded (weights ``N(0, 1/fan_in)``, vectors ``N(0, 0.01)``); ``twin(params)``
    builds the same model in torch (a module whose ``weights`` are the parameters and whose
    forward returns ``(loss,)``), which gives the reference loss and gradients.
    """
    rng = np.random.default_rng(seed)
    params = []
    for param in forward["main"].params[2:]:
        shape = [int(v) for v in param.ty.shape.values]
        scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.1
        params.append((rng.standard_normal(shape) * scale).astype("float32"))
    names = [p.name for p in forward["main"].params[2:]]
    dims = {"s": (sizes.min_seq_len, sizes.max_seq_len)}
    try:
        import torch
    except ImportError:  # the Relax graph needs no torch: only its reference does
        return relax_training_step(
            forward, params=params, num_input=2, dims=dims, param_names=names
        )
    module = twin(params)

    def reference(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        (loss,) = module(*(torch.from_numpy(np.asarray(a)) for a in inputs))
        grads = torch.autograd.grad(loss, list(module.weights))
        return [loss.detach().numpy().copy(), *(g.numpy().copy() for g in grads)]

    graph = relax_training_step(
        forward, params=params, num_input=2, dims=dims, param_names=names, reference=reference
    )
    return dataclasses.replace(graph, torch_module=module, torch_params=list(module.weights))


def _mlp_train(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return _relax_native_graph(
        mlp_forward_module(sizes), sizes, seed, lambda params: _mlp_torch(sizes, params)
    )


# The tanh MLP's widths: input, the hidden layers, output.
TANH_MLP_WIDTHS = (384, 384, 384, 384, 384, 10)


def tanh_mlp_forward_module(widths: Sequence[int] = TANH_MLP_WIDTHS) -> tvm.IRModule:
    """``main(x, y, w0, b0, ..., w_out, b_out) -> sum((mlp(x) - y) ** 2)``, ``x: (s, widths[0])``.

    Every layer but the last is ``Linear -> tanh``.
    """
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((s, widths[0]), "float32"))
    y = relax.Var("y", relax.TensorType((s, widths[-1]), "float32"))
    weights: list[relax.Var] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        weights.append(relax.Var(f"w{i}", relax.TensorType((fan_in, fan_out), "float32")))
        weights.append(relax.Var(f"b{i}", relax.TensorType((fan_out,), "float32")))
    op = relax.op
    with bb.function("main", [x, y, *weights]):
        with bb.dataflow():
            h = x
            for i in range(len(widths) - 1):
                h = bb.emit(op.add(op.matmul(h, weights[2 * i]), weights[2 * i + 1]))
                if i < len(widths) - 2:
                    h = bb.emit(op.tanh(h))
            diff = bb.emit(op.subtract(h, y))
            loss = bb.emit_output(op.sum(op.multiply(diff, diff)))
        bb.emit_func_output(loss)
    return bb.get()


def _tanh_mlp_torch(params: Sequence[np.ndarray]) -> Any:
    import torch

    class TanhMlpStep(torch.nn.Module):
        """The torch twin of :func:`tanh_mlp_forward_module`: ``(x, y) -> (loss,)``."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.from_numpy(np.array(p))) for p in params]
            )

        def forward(self, x, y):
            h = x
            count = len(self.weights) // 2
            for i in range(count):
                h = h @ self.weights[2 * i] + self.weights[2 * i + 1]
                if i < count - 1:
                    h = torch.tanh(h)
            return (((h - y) * (h - y)).sum(),)

    return TanhMlpStep()


def _tanh_mlp_train(sizes: ModelSizes, seed: int, weights: str = "random") -> ImportedGraph:
    return _relax_native_graph(tanh_mlp_forward_module(), sizes, seed, _tanh_mlp_torch)


# name -> builder(sizes, seed, weights); the Relax-native MLPs are small and always drawn.
WORKLOADS: dict[str, Callable[[ModelSizes, int, str], ImportedGraph]] = {
    "llama-train": _llama_train,
    "gpt2-train": _gpt2_train,
    "gpt2-infer": _gpt2_infer,
    "llama-sft": _llama_sft,
    "llama-lora-sft": _llama_lora_sft,
    "mlp-train": _mlp_train,
    "tanh-mlp-train": _tanh_mlp_train,
}


def workload_sizes(name: str, sizes: ModelSizes) -> ModelSizes:
    """The sizes ``name`` is built with: a fine-tuning workload pads :data:`SFT_BATCH`
    sequences a step when ``sizes.batch`` is 1."""
    if name in SFT_WORKLOADS and sizes.batch == 1:
        return dataclasses.replace(sizes, batch=SFT_BATCH)
    return sizes


def build_workload(
    name: str, sizes: ModelSizes = SMALL, seed: int = 0, *, weights: str = "random"
) -> Workload:
    """Build the model (seeded random weights) and import its graph.

    ``weights="empty"`` leaves the weights of the Hugging Face models undrawn (see the module
    docstring): for the predicted mode, where no kernel runs.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if sizes.hidden % sizes.heads or sizes.heads % max(sizes.kv_heads, 1):
        raise ValueError(
            f"hidden ({sizes.hidden}) must be a multiple of heads ({sizes.heads}), and heads "
            f"a multiple of kv_heads ({sizes.kv_heads})"
        )
    _check_dtype(sizes.dtype)
    sizes = workload_sizes(name, sizes)
    if sizes.dtype != "float32" and name not in HF_WORKLOADS:
        raise ValueError(
            f"{name} is built in float32 only; dtype {sizes.dtype} is offered for the Hugging "
            f"Face workloads ({', '.join(HF_WORKLOADS)})"
        )
    if sizes.autocast is not None:
        if name not in HF_WORKLOADS or name == "gpt2-infer":
            raise ValueError(f"autocast applies to the Hugging Face training workloads, not {name}")
        if sizes.dtype != "float32":
            raise ValueError(
                f"autocast={sizes.autocast!r} keeps float32 weights; dtype {sizes.dtype} is a "
                "model already in 16 bits (use one or the other)"
            )
    return Workload(name=name, sizes=sizes, graph=WORKLOADS[name](sizes, seed, weights))

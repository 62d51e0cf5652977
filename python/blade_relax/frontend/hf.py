"""Hugging Face causal LMs to Relax, with a symbolic sequence length ``s`` (and batch ``b``).

Two graphs come out of one model object (built from a config, random weights):

* :func:`import_inference`: ``input_ids -> logits``, by ``torch.export`` with ``Dim`` objects
  and TVM's ``from_exported_program``.
* :func:`import_training_step`: ``(input_ids, labels) -> (loss, grad of every trainable
  parameter)``, from torch's joint forward+backward export
  (``torch.export.experimental._export_forward_backward``). The importer drops gradient outputs,
  so they are relabelled as user outputs first; a few ATen converters are replaced
  (:mod:`.converters`).

Conventions that hold for both: the model runs with ``attention_mask = ones_like(input_ids)``
(without it the traced packed-sequence detection yields graphs TVM cannot compile) and
``use_cache=False``; it is exported in eval mode (dropout off; gradients are still computed);
attention is exported with the ``eager`` implementation (matmul + softmax, which the joint graph
can differentiate and TVM can import), restored afterwards. Symbolic dims are renamed to ``s``
and ``b`` and keep the exported ``Dim`` range in ``ImportedGraph.dims``.

Mixed precision (``import_training_step(..., autocast="bfloat16")``) enters
``torch.autocast`` inside the exported wrapper's ``forward``: the casts are then recorded in
the graph. An ``autocast`` context around ``torch.export.export`` instead is not: the exported
program holds float32 ``linear`` calls with bfloat16 metadata, and the joint export's
decomposition fails on them (``Tensor dtype mismatch! Expected: torch.bfloat16``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .attention import export_settings
from .complex_pairs import as_real_pairs
from .converters import custom_convert_map
from .guards import decompose_checked, drop_proven_asserts, export
from .imported import (
    LOWER_BOUND_ATTR,
    SIZE_OPTIONS,
    UPPER_BOUND_ATTR,
    DimRange,
    ImportedGraph,
    drop_upper_bounds,
    with_function,
)
from .references import inference_reference, torch_to_numpy, training_reference
from .traceable_experts import traceable_experts

__all__ = [
    "AUTOCAST_DTYPES",
    "TiedParameterError",
    "UnsupportedOperatorError",
    "import_inference",
    "import_training_step",
    "inference_reference",
    "max_positions",
    "torch_to_numpy",
    "training_reference",
    "unsupported_reason",
]

_PREFIX = "model."
#: The ``autocast`` values :func:`import_training_step` accepts.
AUTOCAST_DTYPES = ("bfloat16", "float16")


class TiedParameterError(ValueError):
    """A tied (shared) parameter that the training import cannot handle as asked."""


class UnsupportedOperatorError(ValueError):
    """The exported model uses ATen operators that neither TVM's importer nor our converters
    handle: the model is refused before anything is compiled.

    Attributes
    ----------
    architecture
        The model's ``config.model_type`` (``None`` when it has none).
    operators
        The operators, as the exported graph names them (``histc.default``).
    """

    def __init__(self, architecture: str | None, operators: Sequence[str]) -> None:
        self.architecture = architecture
        self.operators = tuple(operators)
        reasons = "; ".join(f"{op} ({unsupported_reason(op)})" for op in self.operators)
        super().__init__(
            f"{architecture or 'this model'} is not supported: no converter for {reasons}"
        )


#: Why an operator is not imported, by the name of its overload packet (what precedes ``.``).
_UNSUPPORTED_REASONS = {
    "_grouped_mm": "torch's own grouped GEMM of a mixture-of-experts layer's experts (the "
    "fallback transformers uses without it is converted)",
}


def unsupported_reason(operator: str) -> str:
    """Why ``operator`` (``histc.default``) cannot be imported, in a few words."""
    packet = operator.split(".", 1)[0]
    return _UNSUPPORTED_REASONS.get(packet, "one can be passed as custom_converters")


def _model_type(model: Any) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _torch():
    try:
        import torch
        import torch.export.experimental  # noqa: F401  (registers _export_forward_backward)
    except ImportError as err:  # pragma: no cover - exercised only without the hf extra
        raise ImportError(
            "blade_relax.frontend needs torch and transformers: pip install 'blade-relax[hf]'"
        ) from err
    return torch


def step_wrappers() -> tuple[type, type, type]:
    """The torch modules an import exports, each wrapping a Hugging Face causal LM:
    ``InferenceStep`` (``input_ids -> logits``), ``TrainingStep`` (``(input_ids, labels) ->
    (loss,)``) and ``MaskedTrainingStep`` (with an ``attention_mask``; their
    docstrings give the signatures). Made on first use: torch is imported only then."""
    torch = _torch()

    class InferenceStep(torch.nn.Module):
        """``input_ids -> logits`` with an all-ones attention mask and no KV cache."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            out = self.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                use_cache=False,
            )
            return out.logits

    class TrainingStep(torch.nn.Module):
        """``(input_ids, labels) -> (loss,)``: the model's own shifted cross-entropy, every
        token attended.

        With ``autocast`` (a torch dtype), the forward runs under ``torch.autocast`` of that
        dtype; the backward follows the casts it recorded.
        """

        def __init__(self, model: Any, autocast: Any = None) -> None:
            super().__init__()
            self.model = model
            self.autocast = autocast

        def forward(self, input_ids, labels):
            return self.loss(input_ids, torch.ones_like(input_ids), labels)

        def loss(self, input_ids, attention_mask, labels):
            if self.autocast is None:
                region = contextlib.nullcontext()
            else:
                region = torch.autocast(device_type=input_ids.device.type, dtype=self.autocast)
            with region:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    labels=labels,
                    use_cache=False,
                )
            return (out.loss,)

    class MaskedTrainingStep(TrainingStep):
        """``(input_ids, attention_mask, labels) -> (loss,)``: padded batches, as collators
        make them (``attention_mask`` 0 on padding, ``labels`` -100 where not counted)."""

        def forward(self, input_ids, attention_mask, labels):
            return self.loss(input_ids, attention_mask, labels)

    return InferenceStep, TrainingStep, MaskedTrainingStep


def max_positions(model: Any) -> int | None:
    """The longest sequence a Hugging Face model's config declares, or None if it declares none.

    Read from ``config.max_position_embeddings`` (Llama and most models) or
    ``config.n_positions`` (GPT-2), the first that is an ``int``: the limit an import checks
    ``max_seq_len`` against, and the ``max_seq_len`` a :class:`~blade_relax.training.Trainer`
    takes when none is given.
    """
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_sizes(
    call: str,
    model: Any,
    min_seq_len: Any,
    max_seq_len: Any,
    batch_size: Any,
    max_batch_size: Any,
) -> tuple[int, int, int, int | None]:
    """The size options of ``call`` as ints, checked; each error names the option and what to
    pass."""
    limit = max_positions(model)
    if not _is_int(min_seq_len) or min_seq_len < 2:
        raise ValueError(
            f"min_seq_len must be an int >= 2 (torch.export specializes sizes 0 and 1), got "
            f"{min_seq_len!r}: pass min_seq_len=2 (the default) or more"
        )
    example = min(512, limit) if limit is not None else 512
    span = f"from {min_seq_len} to {limit}, the model's position limit" if limit else "an int"
    if max_seq_len is None:
        raise TypeError(
            f"{call} needs max_seq_len=, the longest sequence (in tokens) the step will take "
            f"({span}); e.g. {call}(model, max_seq_len={example})"
        )
    if not _is_int(max_seq_len):
        raise TypeError(
            f"max_seq_len must be an int, the longest sequence (in tokens) the step will take, "
            f"not {max_seq_len!r}; e.g. max_seq_len={example}"
        )
    if max_seq_len < min_seq_len:
        raise ValueError(
            f"max_seq_len {max_seq_len} is below min_seq_len {min_seq_len}: pass "
            f"max_seq_len={min_seq_len} or more"
        )
    if limit is not None and max_seq_len > limit:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the model's position limit {limit} "
            f"(config.max_position_embeddings / n_positions): pass max_seq_len={limit} or less"
        )
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(
            f"batch_size must be an int >= 1 (the batch of the exported example), got "
            f"{batch_size!r}; for batches of several sizes pass max_batch_size= instead"
        )
    if max_batch_size is not None:
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(
                f"max_batch_size must be None (a static batch of batch_size) or an int >= 1, the "
                f"largest batch the step will take, got {max_batch_size!r}"
            )
        if batch_size > max_batch_size:
            raise ValueError(
                f"batch_size {batch_size} is above max_batch_size {max_batch_size}: pass "
                f"max_batch_size={batch_size} or more"
            )
    return (
        int(min_seq_len),
        int(max_seq_len),
        int(batch_size),
        None if max_batch_size is None else int(max_batch_size),
    )


def size_options(call: str, model: Any, *, min_option: bool = True) -> dict[str, Any]:
    """The ``metadata[SIZE_OPTIONS]`` of a causal LM imported by ``call``: axis 0 is the batch
    (``max_batch_size``), axis 1 the sequence (``max_seq_len``, and ``min_seq_len`` when
    ``min_option``), within the model's position limit."""
    seq: dict[str, Any] = {"what": "sequence length", "max": "max_seq_len"}
    if min_option:
        seq.update({"min": "min_seq_len", "lowest": 2})
    seq["limit"] = max_positions(model)
    return {"call": call, "axes": [{"what": "batch", "max": "max_batch_size"}, seq]}


def _example_inputs(model: Any, names: Sequence[str], batch: int, length: int) -> tuple[Any, ...]:
    """Example tensors for ``names``: random token ids (and labels), an all-ones mask."""
    torch = _torch()
    vocab = int(getattr(model.config, "vocab_size", 2))
    generator = torch.Generator().manual_seed(0)
    return tuple(
        torch.ones((batch, length), dtype=torch.int64)
        if name == "attention_mask"
        else torch.randint(0, vocab, (batch, length), generator=generator)
        for name in names
    )


def _dims_spec(
    names: Sequence[str],
    min_seq_len: int,
    max_seq_len: int,
    max_batch_size: int | None,
) -> tuple[dict[str, dict[int, Any]], dict[str, DimRange]]:
    torch = _torch()
    seq = torch.export.Dim("s", min=min_seq_len, max=max_seq_len)
    ranges = {"s": DimRange("s", min_seq_len, max_seq_len)}
    axes: dict[int, Any] = {1: seq}
    if max_batch_size is not None:
        axes[0] = torch.export.Dim("b", min=1, max=max_batch_size)
        ranges["b"] = DimRange("b", 1, max_batch_size)
    return {name: dict(axes) for name in names}, ranges


def _rename_dims(
    func: relax.Function, num_input: int, dynamic_axes: dict[int, Any]
) -> tuple[relax.Function, dict[str, str]]:
    """Rename the torch symbols (``s27``) of the inputs' dynamic axes to the ``Dim`` names."""
    renames: dict[Any, tvm.tirx.Var] = {}
    old_to_new: dict[str, str] = {}
    # One variable per Dim: torch.export may give two inputs that share a Dim two symbols
    # (the batch axis of input_ids and labels when the example batch is the Dim's maximum);
    # the Dim says they are equal, and a broadcast between them needs one symbol to check.
    by_dim: dict[str, tvm.tirx.Var] = {}
    for param in func.params[:num_input]:
        values = param.ty.shape.values
        for axis, dim in dynamic_axes.items():
            var = values[axis]
            if isinstance(var, tvm.tirx.Var) and var.name not in old_to_new:
                new_name = dim.__name__
                old_to_new[var.name] = new_name
                if var.name == new_name and new_name not in by_dim:
                    by_dim[new_name] = var
                    continue
                target = by_dim.setdefault(new_name, tvm.tirx.Var(new_name, "int64"))
                if not target.same_as(var):
                    renames[var] = target
    if renames:
        func = func.bind_symbolic_vars(renames)
    for key in (UPPER_BOUND_ATTR, LOWER_BOUND_ATTR):
        if func.attrs is not None and key in func.attrs:
            bounds = {old_to_new.get(str(k), str(k)): v for k, v in func.attrs[key].items()}
            func = func.with_attr(key, bounds)
    return func, old_to_new


def _param_arrays(
    ep: Any, func: relax.Function, num_input: int
) -> tuple[list[str], list[np.ndarray]]:
    """Names (as in ``model.named_parameters()``) and arrays of ``main``'s parameters."""
    torch = _torch()
    by_arg = {
        spec.arg.name: spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind == torch.export.graph_signature.InputKind.PARAMETER
    }
    state = ep.state_dict
    names, arrays = [], []
    for param in func.params[num_input:]:
        target = by_arg.get(param.name)
        if target is None:
            raise RuntimeError(f"main parameter {param.name!r} is not a model parameter")
        names.append(target[len(_PREFIX) :] if target.startswith(_PREFIX) else target)
        arrays.append(torch_to_numpy(state[target]))
    return names, arrays


def _finish(
    mod: tvm.IRModule,
    ep: Any,
    num_input: int,
    dynamic_axes: dict[int, Any],
    keep_upper_bound: bool,
) -> tuple[tvm.IRModule, list[str], list[np.ndarray]]:
    func = mod["main"]
    names, arrays = _param_arrays(ep, func, num_input)
    if func.attrs is not None and "params" in func.attrs:
        # The importer parks the weights in an attribute; the caller holds them instead.
        func = func.without_attr("params")
    func, _ = _rename_dims(func, num_input, dynamic_axes)
    out = with_function(mod, func)
    if not keep_upper_bound:
        out = drop_upper_bounds(out)
    return out, names, arrays


def _import(
    ep: Any,
    custom_converters: dict | None,
    decompose: bool,
    accumulate: str | None = None,
    architecture: str | None = None,
) -> tvm.IRModule:
    """``from_exported_program`` with our converters, complex tensors first rewritten as real
    pairs (:mod:`.complex_pairs`; ``ep`` is changed in place); a model with operators no
    converter handles is refused with :class:`UnsupportedOperatorError` (TVM asserts, naming
    them)."""
    from tvm.relax.frontend.torch import from_exported_program

    as_real_pairs(ep)
    try:
        return from_exported_program(
            ep,
            keep_params_as_input=True,
            run_ep_decomposition=decompose,
            custom_convert_map=custom_convert_map(custom_converters, accumulate=accumulate),
        )
    except AssertionError as err:
        found = re.search(r"Unsupported function types \[(.*?)\]", str(err))
        if found is None:
            raise
        operators = [op.strip().strip("'\"") for op in found.group(1).split(",")]
        raise UnsupportedOperatorError(architecture, sorted(operators)) from err


def import_inference(
    model: Any,
    *,
    max_seq_len: int | None = None,
    min_seq_len: int = 2,
    batch_size: int = 1,
    max_batch_size: int | None = None,
    keep_upper_bound: bool = True,
    attn_implementation: str | None = "eager",
    custom_converters: dict[str, Callable] | None = None,
) -> ImportedGraph:
    """Import ``input_ids -> logits`` of a Hugging Face causal LM with a symbolic length.

    Parameters
    ----------
    model
        A ``transformers`` causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...).
    max_seq_len, min_seq_len
        The exported range of the sequence length ``s`` (``torch.export.Dim``). ``max_seq_len``
        is required (the default ``None`` raises a ``TypeError`` saying what to pass); it may
        not exceed the model's position limit.
    batch_size
        Batch of the example used for export (and of ``input_shapes`` when static).
    max_batch_size
        Make the batch symbolic too (``b`` in ``[1, max_batch_size]``); ``None``: static, so
        every batch must have ``batch_size`` rows (pass ``max_batch_size`` for batches of more
        than one, or of varying size).

    A batch outside these sizes is refused before anything runs, by an error that names the
    option to pass (:meth:`ImportedGraph.bind_dims`).
    keep_upper_bound
        Keep ``tir_var_upper_bound`` on ``main`` (stock TVM then plans every buffer at the
        bound); ``False`` drops it (sizes follow the actual length).
    attn_implementation
        Attention implementation used while exporting (``None``: the model's own).
    custom_converters
        Extra ``from_exported_program`` converters (they win over ours).

    A guard torch cannot prove over the declared sizes is deferred and checked at each of them
    (:mod:`blade_relax.frontend.guards`): :class:`GuardError` where one fails.

    Returns
    -------
    ImportedGraph
        ``main(input_ids, *params) -> logits``; ``reference`` runs the model in torch.
    """
    min_seq_len, max_seq_len, batch_size, max_batch_size = _check_sizes(
        "import_inference", model, min_seq_len, max_seq_len, batch_size, max_batch_size
    )
    _torch()  # without torch, the install hint before anything else
    inference_cls, _, _ = step_wrappers()
    wrapper = inference_cls(model)
    dynamic, ranges = _dims_spec(["input_ids"], min_seq_len, max_seq_len, max_batch_size)
    example_batch = max(batch_size, 2) if max_batch_size is not None else batch_size
    example = _example_inputs(
        model, ["input_ids"], example_batch, min(max_seq_len, max(min_seq_len, 16))
    )
    with export_settings(model, attn_implementation), traceable_experts(model):
        ep, deferred = export(wrapper, example, dynamic)
        if deferred:
            ep = decompose_checked(ep)
        mod = _import(
            ep, custom_converters, decompose=not deferred, architecture=_model_type(model)
        )
    mod, names, arrays = _finish(mod, ep, 1, dynamic["input_ids"], keep_upper_bound)
    batch_axis: int | str = "b" if max_batch_size is not None else batch_size
    named = dict(model.named_parameters(remove_duplicate=False))

    return ImportedGraph(
        mod=mod,
        params=arrays,
        input_names=["input_ids"],
        param_names=names,
        output_names=["logits"],
        input_shapes=[(batch_axis, "s")],
        input_dtypes=["int64"],
        dims=ranges,
        kind="inference",
        reference=inference_reference(model, wrapper),
        float64_reference=inference_reference(model, wrapper, float64=True),
        torch_module=wrapper,
        torch_params=[named[name] for name in names],
        int_input_high=int(model.config.vocab_size),
        metadata={
            "model_type": getattr(model.config, "model_type", type(model).__name__),
            SIZE_OPTIONS: size_options("import_inference", model),
        },
    )


def _autocast_dtype(model: Any, autocast: str | None) -> Any:
    """The torch dtype of ``autocast`` (``None`` stays ``None``), checked against the model."""
    if autocast is None:
        return None
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be None or one of {AUTOCAST_DTYPES}, not {autocast!r}")
    torch = _torch()
    other = sorted(
        {
            f"{name} ({param.dtype})"
            for name, param in model.named_parameters()
            if param.is_floating_point() and param.dtype != torch.float32
        }
    )
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise ValueError(
            f"autocast={autocast!r} needs float32 parameters (mixed precision keeps float32 "
            f"master weights and gradients), but the model has {shown}; build the model in "
            "float32, or import it without autocast"
        )
    return getattr(torch, autocast)


def _tied_groups(model: Any) -> list[list[str]]:
    """Groups of names that refer to one trainable parameter (first name first)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


@contextlib.contextmanager
def _untied(model: Any, groups: list[list[str]]) -> Iterator[None]:
    """Give every alias of a tied parameter its own copy while exporting; restore on exit.

    torch's joint export asserts that every parameter it lifts receives a gradient, and a tied
    parameter breaks that bookkeeping. Exporting untied and summing the aliases' gradients
    afterwards computes exactly the tied gradient.
    """
    torch = _torch()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for names in groups:
            for alias in names[1:]:
                owner_name, _, attr = alias.rpartition(".")
                owner = model.get_submodule(owner_name) if owner_name else model
                original = getattr(owner, attr)
                saved.append((owner, attr, original))
                copy = torch.nn.Parameter(original.detach().clone(), requires_grad=True)
                setattr(owner, attr, copy)
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _frozen_last(
    mod: tvm.IRModule,
    names: list[str],
    arrays: list[np.ndarray],
    trainable: set[str],
    num_input: int,
) -> tuple[tvm.IRModule, list[str], list[np.ndarray], int]:
    """Reorder ``main``'s parameters: the trainable ones first, the frozen ones last.

    torch lists a PEFT model's frozen base weights and its adapters interleaved; the graph's
    convention (:class:`ImportedGraph`) keeps the frozen ones after the trainable ones. Returns
    the module, the names and arrays in the new order, and how many are frozen.
    """
    order = [i for i, n in enumerate(names) if n in trainable]
    order += [i for i, n in enumerate(names) if n not in trainable]
    num_frozen = len(names) - sum(n in trainable for n in names)
    if order == list(range(len(names))):
        return mod, names, arrays, num_frozen
    func = mod["main"]
    params = list(func.params)
    reordered = params[:num_input] + [params[num_input + i] for i in order]
    new_func = relax.Function(reordered, func.body, func.ret_ty, func.is_pure, func.attrs)
    return (
        with_function(mod, new_func),
        [names[i] for i in order],
        [arrays[i] for i in order],
        num_frozen,
    )


def _regroup_outputs(
    mod: tvm.IRModule,
    names: list[str],
    arrays: list[np.ndarray],
    grad_targets: list[str],
    groups: list[list[str]],
    num_input: int,
) -> tuple[tvm.IRModule, list[str], list[np.ndarray]]:
    """Put gradients in parameter order; make each tied alias its primary, summing gradients.

    ``names`` lists the trainable parameters first (every one has a gradient in
    ``grad_targets``), then the frozen ones (none has). Returns the module, the parameter names
    and arrays left (aliases removed). Afterwards output ``i + 1`` is the gradient of
    parameter ``i``, for each trainable parameter.
    """
    func = mod["main"]
    params = list(func.params)
    alias_of = {alias: group[0] for group in groups for alias in group[1:]}
    binding = {
        params[num_input + names.index(alias)]: params[num_input + names.index(primary)]
        for alias, primary in alias_of.items()
        if alias in names and primary in names
    }
    dropped = {alias for alias, primary in alias_of.items() if alias in names and primary in names}
    kept = [i for i, n in enumerate(names) if n not in dropped]
    position = {target: 1 + i for i, target in enumerate(grad_targets)}
    plan = [[0]]
    for i in kept:
        name = names[i]
        if name not in position:  # frozen: no gradient
            continue
        sources = [position[name]]
        sources += [position[a] for a in dropped if alias_of[a] == name]
        plan.append(sources)
    identity = [[i] for i in range(len(grad_targets) + 1)]
    if binding:
        func = func.bind_params(binding)
    if plan != identity:
        func = _rewrite_outputs(func, plan)
    return (
        with_function(mod, func),
        [names[i] for i in kept],
        [arrays[i] for i in kept],
    )


def _rewrite_outputs(func: relax.Function, plan: list[list[int]]) -> relax.Function:
    """Replace the result tuple by one whose output ``k`` is the sum of old outputs ``plan[k]``."""
    body = func.body
    ret = body.body
    fields = list(ret.ty.fields)
    bindings: list[relax.Binding] = []
    items: list[relax.Var] = []
    for i, ty in enumerate(fields):
        var = relax.Var(f"out{i}", ty)
        bindings.append(relax.VarBinding(var, relax.TupleGetItem(ret, i)))
        items.append(var)
    results: list[relax.Var] = []
    for k, sources in enumerate(plan):
        total = items[sources[0]]
        for source in sources[1:]:
            summed = relax.Var(f"grad_sum{k}", fields[sources[0]])
            bindings.append(relax.VarBinding(summed, relax.op.add(total, items[source])))
            total = summed
        results.append(total)
    out = relax.Var("outputs", relax.TupleType([r.ty for r in results]))
    bindings.append(relax.VarBinding(out, relax.Tuple(results)))
    new_body = relax.SeqExpr([*body.blocks, relax.BindingBlock(bindings)], out)
    new_func = relax.Function(func.params, new_body, out.ty, func.is_pure, func.attrs)
    return relax.BlockBuilder().normalize(new_func)


def import_training_step(
    model: Any,
    *,
    max_seq_len: int | None = None,
    min_seq_len: int = 2,
    batch_size: int = 1,
    max_batch_size: int | None = None,
    keep_upper_bound: bool = True,
    attn_implementation: str | None = "eager",
    tied_parameters: str = "sum",
    attention_mask: bool = False,
    autocast: str | None = None,
    custom_converters: dict[str, Callable] | None = None,
) -> ImportedGraph:
    """Import a training step: loss and the gradient of every trainable parameter.

    The loss is the model's own cross-entropy on ``labels`` (shifted inside the model, as Hugging
    Face causal LMs do: labels of -100 are not counted, the mean is over the counted tokens).
    The graph is torch's joint forward+backward export; the relabelled gradient outputs follow
    the loss in the order of ``param_names``.

    Parameters with ``requires_grad=False`` (the base weights of a PEFT LoRA model, a frozen
    embedding) are frozen: they stay inputs of ``main``, after the trainable ones
    (``ImportedGraph.num_frozen``), and get no gradient.

    Parameters
    ----------
    model
        A ``transformers`` causal LM whose ``forward`` accepts ``labels``.
    max_seq_len, min_seq_len, batch_size, max_batch_size, keep_upper_bound,
    attn_implementation, custom_converters
        As for :func:`import_inference`.
    tied_parameters
        What to do with parameters shared by several modules (GPT-2's ``lm_head`` and ``wte``
        with ``tie_word_embeddings=True``): ``"sum"`` exports them untied and adds the
        aliases' gradients in the graph, which is the gradient of the tied parameter (one
        parameter, one gradient output); ``"error"`` raises :class:`TiedParameterError`.
    attention_mask
        Take the batch's ``attention_mask`` as an input (padded batches, padding on either
        side: 0 marks a pad token, which no token attends to); ``False``: every token is
        attended, as with a mask of ones.
    autocast
        ``None``: the model's own precision. ``"bfloat16"`` or ``"float16"``: mixed
        precision with ``torch.autocast`` semantics. The exported forward (and the
        ``reference``, and ``torch_module``) runs inside ``torch.autocast(device_type,
        dtype=autocast)``, so the operators autocast lowers (``linear``, ``matmul``, ``bmm``,
        ``addmm``, ...) compute in that dtype, summing their products in float32 as torch's
        kernels do, while the parameters, their gradients and the loss stay float32. Needs a
        float32 model (``ValueError`` otherwise). No loss scaling is applied. Compared with
        the reference, expect errors near the dtype's precision (norm-relative gradient
        errors up to about 1e-2 for bfloat16, as large as autocast's own error against
        float32), not float32 agreement.

    Returns
    -------
    ImportedGraph
        ``main(input_ids, [attention_mask,] labels, *params) -> (loss, grad_0, ...,
        grad_{k-1})`` for the ``k`` trainable parameters; ``reference`` runs the same step in
        torch and returns the loss and gradients as arrays.
    """
    sizes = _check_sizes(
        "import_training_step", model, min_seq_len, max_seq_len, batch_size, max_batch_size
    )
    _torch()  # without torch, the install hint before anything else
    groups = _tied_groups_to_sum(model, tied_parameters)
    autocast_dtype = _autocast_dtype(model, autocast)
    _, plain_cls, masked_cls = step_wrappers()
    wrapper = (masked_cls if attention_mask else plain_cls)(model, autocast=autocast_dtype)
    input_names = (
        ["input_ids", "attention_mask", "labels"] if attention_mask else ["input_ids", "labels"]
    )
    step = _export_training_step(
        model,
        wrapper,
        input_names,
        sizes,
        groups,
        keep_upper_bound,
        attn_implementation,
        autocast,
        custom_converters,
    )
    _arrange_parameters(step, groups)
    return _training_graph(model, wrapper, step, sizes, groups, autocast)


def _tied_groups_to_sum(model: Any, tied_parameters: str) -> list[list[str]]:
    """The model's tied parameter groups, whose gradients the graph will sum.

    Raises
    ------
    ValueError
        When ``tied_parameters`` is neither ``"sum"`` nor ``"error"``.
    TiedParameterError
        With ``"error"``, when the model ties parameters.
    """
    if tied_parameters not in ("sum", "error"):
        raise ValueError(f"tied_parameters must be 'sum' or 'error', not {tied_parameters!r}")
    groups = _tied_groups(model)
    if groups and tied_parameters == "error":
        listed = "; ".join(" = ".join(g) for g in groups)
        raise TiedParameterError(
            f"the model ties parameters ({listed}); build it with tie_word_embeddings=False "
            f"(or call import_training_step(..., tied_parameters='sum'))"
        )
    return groups


@dataclass
class _TrainingImport:
    """A training step on its way from torch's joint export to an :class:`ImportedGraph`.

    Attributes
    ----------
    mod
        ``main(*inputs, *params) -> (loss, *grads)``.
    names, arrays
        The parameters of ``main`` after the inputs: their names and values.
    input_names
        The inputs of ``main``.
    ranges
        The dims and their ranges.
    targets
        The parameter each gradient output is the gradient of, in output order.
    num_frozen
        How many of the parameters, the last ones, get no gradient.
    """

    mod: tvm.IRModule
    names: list[str]
    arrays: list[np.ndarray]
    input_names: list[str]
    ranges: dict[str, Any]
    targets: list[str]
    num_frozen: int = 0


def _export_training_step(
    model: Any,
    wrapper: Any,
    input_names: list[str],
    sizes: tuple[int, int, int, int | None],
    groups: list[list[str]],
    keep_upper_bound: bool,
    attn_implementation: str | None,
    autocast: str | None,
    custom_converters: dict[str, Callable] | None,
) -> _TrainingImport:
    """torch's joint forward+backward export of ``wrapper`` imported into Relax, each gradient
    output relabelled with its parameter.

    Raises
    ------
    TiedParameterError
        When a trainable parameter receives no gradient.
    GuardError
        When torch defers a guard that fails at some declared size (see :mod:`.guards`).
    """
    torch = _torch()
    min_seq_len, max_seq_len, batch_size, max_batch_size = sizes
    num_input = len(input_names)
    dynamic, ranges = _dims_spec(input_names, min_seq_len, max_seq_len, max_batch_size)
    example_batch = max(batch_size, 2) if max_batch_size is not None else batch_size
    example = _example_inputs(
        model, input_names, example_batch, min(max_seq_len, max(min_seq_len, 16))
    )
    with (
        export_settings(model, attn_implementation),
        _untied(model, groups),
        traceable_experts(model),
    ):
        ep, deferred = export(wrapper, example, dynamic)
        try:
            joint = torch.export.experimental._export_forward_backward(ep, joint_loss_index=0)
        except AssertionError as err:
            if "did not receive a gradient" in str(err):
                raise TiedParameterError(
                    "torch's joint export found a trainable parameter without a gradient; "
                    "freeze unused parameters (requires_grad=False) before importing"
                ) from err
            raise
        grad_targets = _relabel_gradients(joint)
        if deferred:
            drop_proven_asserts(joint)
        # torch sums 16-bit products in float32 and rounds once; autocast graphs do the same.
        accumulate = None if autocast is None else "float32"
        mod = _import(
            joint,
            custom_converters,
            decompose=False,
            accumulate=accumulate,
            architecture=_model_type(model),
        )
    mod, names, arrays = _finish(mod, joint, num_input, dynamic["input_ids"], keep_upper_bound)
    targets = [t[len(_PREFIX) :] if t.startswith(_PREFIX) else t for t in grad_targets]
    return _TrainingImport(mod, names, arrays, list(input_names), ranges, targets)


def _arrange_parameters(step: _TrainingImport, groups: list[list[str]]) -> None:
    """Put the frozen parameters last and give each tied group one gradient output.

    Raises
    ------
    RuntimeError
        When a gradient is of a tensor that is not a parameter of the model.
    ValueError
        When no parameter is trainable.
    """
    targets, num_input = step.targets, len(step.input_names)
    if not set(targets) <= set(step.names):
        raise RuntimeError(
            "the joint graph has gradients of tensors that are not parameters of the model: "
            f"{sorted(set(targets) - set(step.names))}"
        )
    if not targets:
        raise ValueError("the model has no trainable parameter (every requires_grad is False)")
    step.mod, step.names, step.arrays, step.num_frozen = _frozen_last(
        step.mod, step.names, step.arrays, set(targets), num_input
    )
    step.mod, step.names, step.arrays = _regroup_outputs(
        step.mod, step.names, step.arrays, targets, groups, num_input
    )


def _training_graph(
    model: Any,
    wrapper: Any,
    step: _TrainingImport,
    sizes: tuple[int, int, int, int | None],
    groups: list[list[str]],
    autocast: str | None,
) -> ImportedGraph:
    """The :class:`ImportedGraph` of an imported training step, with torch's step as its
    reference."""
    _, _, batch_size, max_batch_size = sizes
    num_input = len(step.input_names)
    trainable = step.names[: len(step.names) - step.num_frozen]
    output_names = ["loss"] + [f"grad:{name}" for name in trainable]
    batch_axis: int | str = "b" if max_batch_size is not None else batch_size
    named = dict(model.named_parameters(remove_duplicate=False))

    return ImportedGraph(
        mod=step.mod,
        params=step.arrays,
        input_names=step.input_names,
        param_names=step.names,
        output_names=output_names,
        input_shapes=[(batch_axis, "s")] * num_input,
        input_dtypes=["int64"] * num_input,
        dims=step.ranges,
        kind="training",
        reference=training_reference(model, wrapper, trainable),
        float64_reference=training_reference(model, wrapper, trainable, float64=True),
        torch_module=wrapper,
        torch_params=[named[name] for name in trainable],
        int_input_high=int(model.config.vocab_size),
        metadata={
            "model_type": getattr(model.config, "model_type", type(model).__name__),
            "tied": [list(g) for g in groups],
            "autocast": autocast,
            SIZE_OPTIONS: size_options("import_training_step", model),
        },
        num_frozen=step.num_frozen,
    )


def _relabel_gradients(joint: Any) -> list[str]:
    """Mark gradient outputs as user outputs (the importer keeps only those); their targets."""
    torch = _torch()
    kinds = torch.export.graph_signature.OutputKind
    targets = []
    for spec in joint.graph_signature.output_specs:
        if spec.kind == kinds.GRADIENT_TO_PARAMETER:
            targets.append(spec.target)
            spec.kind = kinds.USER_OUTPUT
    return targets

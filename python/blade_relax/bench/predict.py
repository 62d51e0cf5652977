"""Predicted peaks: every configuration at sizes too large to run, without running a kernel.

``python -m blade_relax.bench --predict`` fills the same table as the measuring ruler
(:mod:`.runner`) with figures computed instead of measured, each row marked
``source="predicted"``:

TVM configurations
    The module each configuration compiles (dynamic, bounded, specialized per length or per
    bucket) goes through the same passes (the configuration's :class:`~.configs.FlagsPipeline`)
    up to the memory stage (:func:`blade_relax.pipeline.lower_to_memory_stage`, which stops
    before ``VMShapeLower``: allocations, kills and kernel calls are still readable; no TIR is
    compiled). ``step_peak_bytes`` is the peak of the symbolic timeline of the function that
    runs at the length (:func:`blade_relax.analysis.memory_timeline` of
    :func:`blade_relax.transform.version_for`'s choice), kernel workspaces included: the figure
    the runtime accounting measures for the same executable (``blade-relax demo`` prints both
    side by side; ``tests/bench/test_predict.py`` asserts the equality for every configuration
    at a size where running is affordable). ``CheckDimRanges`` is left out of the lowering: its
    assertions allocate nothing.
Runtime budgets (``blade-relax@0.8``)
    The budget is the fraction of the reference's predicted step peak; the decision is the
    remat runtime's own (:meth:`blade_relax.runtime.remat.RematProgram.decision`, the code
    ``remat_begin`` runs) on the concrete timeline of the rewritten copy's metadata, and its
    ``peak`` is the step peak the runtime plans for and reaches. ``unevictable_bytes`` is the
    floor of that timeline.
``torch-eager``
    The same step on a twin of the module built on the ``meta`` device (sizes, no data, no
    compute), its storages counted by
    :class:`~blade_relax.training.torch_memory.LiveBytesCounter` with ``meta=True``: the counter sees the same ATen ops and storages as on the CPU.
    With SDPA attention (``torch-eager-sdpa``) two choices PyTorch and transformers make from
    what meta tensors lack are made as on the CPU: the attention backend (flash attention
    where the CPU picks it, not the meta device's math fallback) and whether the batch's
    attention mask is all ones (read from the inputs).
``torch-compile``
    Inductor cannot compile for the ``meta`` device. The step is compiled for the CPU as the
    measuring ruler compiles it (``dynamic=True``, one compilation for the trace) and run on CPU
    tensors with Inductor's kernels skipped
    (:func:`~blade_relax.training.torch_memory.inductor_kernels_skipped`): the generated wrapper
    allocates and frees every buffer as it would, and
    :class:`~blade_relax.training.torch_memory.LiveBytesCounter` counts them as on a real run
    (no weight or activation is ever written, so the memory is reserved but not touched; only the ATen
    fallbacks Inductor leaves, attention among them, compute). ``compile_time_s`` is then
    Dynamo's capture and Inductor's code generation, without the C++ compilation that a real
    run adds.

``compile_time_s`` is the time of the lowering to the memory stage (the Relax passes; not the
TIR code generation that a real compilation adds), ``compilations`` the number of lowerings the
configuration needs over the trace. Nothing checks correctness: ``loss``, ``max_rel_error``
and ``correct`` stay ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import tvm

from ..frontend import ImportedGraph, specialize
from .configs import BenchConfig, FlagsPipeline, TorchConfig, TvmConfig, resolve_configs
from .runner import (
    BenchResult,
    Measurement,
    _lower_bounds,
    _summary,
    _TorchRunner,
    pad_for_bucket,
)
from .workloads import Workload

__all__ = ["NOT_PREDICTED", "meta_twin", "predict_benchmark", "predict_torch_peak"]

#: How the ``error`` of a configuration the predicted mode cannot predict begins.
NOT_PREDICTED = "not predicted"


@dataclass(frozen=True)
class _Lowered:
    """One module lowered to the memory stage, and how long the lowering took."""

    mod: tvm.IRModule
    seconds: float


class _Lowerings:
    """Lowerings shared by the configurations of one run (``blade-relax@0.8`` reads the
    module ``blade-relax`` lowered), with the timelines read from them."""

    def __init__(self, target: tvm.target.Target) -> None:
        self.target = target
        self._mods: dict[tuple, _Lowered] = {}
        self._timelines: dict[tuple[int, str], Any] = {}

    def get(self, key: tuple, pipeline: FlagsPipeline, mod: tvm.IRModule) -> _Lowered:
        """The lowering of ``mod`` through ``pipeline``, cached under ``key``."""
        from ..pipeline import lower_to_memory_stage
        from ..transform import CompileClock

        full_key = (pipeline, *key)
        found = self._mods.get(full_key)
        if found is not None:
            return found
        # CheckDimRanges allocates nothing; its lowered condition would read as a dim.
        flags = {**pipeline.keywords(), "check_dims": False}
        clock = CompileClock()
        lowered = lower_to_memory_stage(mod, self.target, **flags)
        made = self._mods[full_key] = _Lowered(lowered, clock.seconds())
        return made

    def timeline(self, lowered: _Lowered, function: str) -> Any:
        """The symbolic memory timeline of ``function`` in ``lowered`` (cached)."""
        from ..analysis import memory_timeline

        key = (id(lowered), function)
        found = self._timelines.get(key)
        if found is None:
            found = memory_timeline(lowered.mod[function], mod=lowered.mod, target=self.target)
            self._timelines[key] = found
        return found


class _TvmPredictor:
    """What one TVM configuration would allocate, read from its lowered IR."""

    def __init__(self, config: TvmConfig, graph: ImportedGraph, lowerings: _Lowerings) -> None:
        if not isinstance(config.pipeline, FlagsPipeline):
            raise ValueError(
                f"{NOT_PREDICTED}: the pipeline of {config.name} is no FlagsPipeline, so the "
                "passes to lower it with are unknown"
            )
        self.config = config
        self.graph = graph
        self.lowerings = lowerings
        self.compilations = 0
        self.compile_time_s = 0.0
        self._seen: set[tuple] = set()

    def _module(self, dims: dict[str, int]) -> tuple[tuple, tvm.IRModule]:
        config, graph = self.config, self.graph
        if config.static or config.bucket is not None:
            key = ("specialized", tuple(sorted(dims.items())))
            return key, specialize(tvm.IRModule({"main": graph.main}), dims)
        return ("dynamic", config.keep_bounds), graph.with_upper_bounds(config.keep_bounds).mod

    def close(self) -> None:
        pass

    def predict(self, row: Measurement, dims: dict[str, int], budget: int | None) -> None:
        from ..transform import version_for

        key, mod = self._module(dims)
        lowered = self.lowerings.get(key, self.config.pipeline, mod)
        if key not in self._seen:  # a lowering this configuration needs: count it as its own
            self._seen.add(key)
            self.compilations += 1
            self.compile_time_s += lowered.seconds
            row.compile_time_s = lowered.seconds
        row.compilations = self.compilations
        function = version_for(lowered.mod, "main", dims)
        timeline = self.lowerings.timeline(lowered, function)
        evaluated = timeline.evaluate(dims)
        row.step_peak_bytes = int(evaluated.peak)
        row.workspace_bytes = int(evaluated.peak_workspace)
        if budget is not None:
            self._decide(row, lowered.mod, dims, budget)

    def _decide(
        self, row: Measurement, mod: tvm.IRModule, dims: dict[str, int], budget: int
    ) -> None:
        """The remat runtime's decision for ``budget`` bytes: its step peak and its floor."""
        from ..contract import REMAT_META_ATTR
        from ..runtime.remat import RematProgram
        from ..transform import version_for

        function = version_for(mod, "main", dims, budget=True)
        attrs = mod[function].attrs
        if attrs is None or REMAT_META_ATTR not in attrs:
            raise ValueError(f"{self.config.name}: {function} carries no remat metadata")
        program = RematProgram.from_json(str(attrs[REMAT_META_ATTR]))
        values = tuple(dims[name] for name in program.dims)
        decision = program.decision(values, budget)
        row.step_peak_bytes = int(decision.peak)
        row.unevictable_bytes = int(program.timeline(values).unevictable()[0] + row.caller_bytes)


# --------------------------------------------------------------------------------------------
# PyTorch on the meta device


def meta_twin(graph: ImportedGraph) -> tuple[Any, list[Any]]:
    """A copy of ``graph.torch_module`` on the ``meta`` device and its parameters in the order
    of ``graph.param_names``.

    A Hugging Face wrapper (``module.model`` with a ``config``) is rebuilt from the config on
    the meta device, so that nothing of the size of the model is allocated; other modules are
    copied and moved.
    """
    import copy

    module = graph.torch_module
    if module is None:
        raise ValueError("the workload has no torch module")
    model = getattr(module, "model", None)
    if model is not None and hasattr(model, "config"):
        twin_model = _meta_model(model)
        twin_model.train(model.training)
        extra = {"autocast": module.autocast} if hasattr(module, "autocast") else {}
        twin = type(module)(twin_model, **extra)
        named = dict(twin_model.named_parameters())
        return twin, [named[name] for name in graph.param_names[: graph.num_trainable]]
    twin = copy.deepcopy(module).to("meta")
    positions = {id(p): i for i, p in enumerate(module.parameters())}
    moved = list(twin.parameters())
    return twin, [moved[positions[id(p)]] for p in graph.torch_params or []]


def _meta_model(model: Any) -> Any:
    """``model`` rebuilt from its config on the meta device, in its dtype; a PEFT model is its
    base model rebuilt so, with the same adapters (``peft_config``) attached."""
    import torch

    peft_config = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_config is not None else model
    with torch.device("meta"):
        twin = type(base)(base.config)
    # Built from the config, the twin has the default dtype: give it the model's.
    twin = twin.to(next(base.parameters()).dtype)
    if peft_config is None:
        return twin
    from peft import get_peft_model

    (name, config), *others = peft_config.items()
    if others:
        raise ValueError("a PEFT model with several adapters cannot be predicted")
    with torch.device("meta"):
        return get_peft_model(twin, config, adapter_name=name)


def predict_torch_peak(
    graph: ImportedGraph,
    shapes: Sequence[tuple[int, ...]],
    *,
    checkpointing: bool = False,
    attention: str | None = None,
    mask_all_ones: bool = True,
) -> int:
    """The step peak PyTorch eager allocates for inputs of ``shapes``, counted on meta tensors.

    The step is the runner's: gradients reset to ``None``, the module's forward, and for a
    training graph ``loss.backward()``; the peak is what
    :class:`~blade_relax.training.torch_memory.LiveBytesCounter` counts on top of the
    parameters and inputs. With ``checkpointing`` the twin runs with Hugging Face gradient
    checkpointing (``torch-eager-ckpt``); with ``attention`` that attention implementation
    (``torch-eager-sdpa``). ``mask_all_ones``: whether the batch's attention mask has no
    padding, the one value of the data that changes what PyTorch allocates (see
    :func:`_mask_test_answered`).
    """
    import torch

    from ..frontend.attention import attention_implementation
    from ..training.hf_checkpointing import checkpointing_model, gradient_checkpointing
    from ..training.torch_memory import LiveBytesCounter

    twin, params = meta_twin(graph)
    tensors = [
        torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        for shape, dtype in zip(shapes, graph.input_dtypes)
    ]
    for param in params:
        param.grad = None
    counter = LiveBytesCounter(meta=True)
    context = torch.enable_grad() if graph.kind == "training" else torch.no_grad()
    ckpt = gradient_checkpointing(twin) if checkpointing else contextlib.nullcontext()
    attend = contextlib.nullcontext()
    if attention is not None:
        attend = attention_implementation(checkpointing_model(twin), attention)
    with ckpt, attend, _mask_test_answered(mask_all_ones), _sdpa_as_on_cpu(), context, counter:
        result = twin(*tensors)
        if graph.kind == "training":
            (loss,) = result
            loss.backward()
    peak = int(counter.peak_bytes)
    counter.detach_all()
    return peak


@contextlib.contextmanager
def _mask_test_answered(all_ones: bool) -> Iterator[None]:
    """transformers' test "is the attention mask all ones?" answered on meta tensors.

    With SDPA attention, transformers drops the causal mask (and lets SDPA apply it) where the
    padding mask is all ones, which it reads with ``.item()`` (``masking_utils.fast_all``), a
    value a meta tensor does not have. The answer is the batch's (``all_ones``); tensors
    with values are tested as before. Where transformers has no such test, nothing changes.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    original = getattr(masking_utils, "fast_all", None)
    if original is None:
        yield
        return

    def fast_all(tensor: Any) -> Any:
        return all_ones if tensor.device.type == "meta" else original(tensor)

    with mock.patch.object(masking_utils, "fast_all", fast_all):
        yield


@contextlib.contextmanager
def _sdpa_as_on_cpu() -> Iterator[None]:
    """``scaled_dot_product_attention`` on meta tensors run as on CPU tensors of their shapes.

    On the meta device PyTorch picks the math backend, which keeps the attention matrix for
    the backward pass; on the CPU it picks flash attention where it can, which keeps only the
    output and a log-sum-exp per row. The backend is chosen as for CPU tensors of the same
    shapes, dtypes and flags (``torch._fused_sdp_choice`` on zero-stride stand-ins, so that
    nothing of their size is allocated), and flash attention is called as the CPU's composite
    calls it (a boolean mask turned into an additive one first); the meta kernels of the flash
    operators, forward and backward, then allocate what the CPU's do.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    original = F.scaled_dot_product_attention

    def attention(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        flags = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if query.device.type != "meta":
            return original(query, key, value, attn_mask, **flags)
        stand_ins = [_cpu_stand_in(x) for x in (query, key, value, attn_mask)]
        choice = torch._fused_sdp_choice(*stand_ins, **flags)
        if choice != int(SDPBackend.FLASH_ATTENTION):
            return original(query, key, value, attn_mask, **flags)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
            minus = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=attn_mask.device)
            attn_mask = torch.where(attn_mask, zero, minus)
        output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return output

    with mock.patch.object(F, "scaled_dot_product_attention", attention):
        yield


def _cpu_stand_in(tensor: Any) -> Any:
    """A CPU tensor of ``tensor``'s shape, dtype and ``requires_grad`` over one row of
    memory (zero strides but the last), or ``None`` for ``None``."""
    import torch

    if tensor is None:
        return None
    shape = tuple(tensor.shape)
    row = torch.empty(shape[-1] if shape else 1, dtype=tensor.dtype)
    strides = (0,) * (len(shape) - 1) + (1,) if shape else ()
    return row.as_strided(shape, strides).requires_grad_(tensor.requires_grad)


def _mask_all_ones(graph: ImportedGraph, inputs: Sequence[np.ndarray]) -> bool:
    """Whether the attention mask among ``inputs`` has no padding (no mask input: the step
    wrappers pass ``ones_like(input_ids)``)."""
    return all(
        bool(np.all(value != 0))
        for name, value in zip(graph.input_names, inputs)
        if name == "attention_mask"
    )


# --------------------------------------------------------------------------------------------


def predict_benchmark(
    workload: Workload,
    config_names: Sequence[str],
    lengths: Sequence[int],
    *,
    target: str | dict | tvm.target.Target = "llvm",
    trace: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Predict every configuration at every length (see the module docstring).

    Parameters
    ----------
    workload
        What to predict (:func:`~.workloads.build_workload`; its weights are never read).
    config_names
        Registry names; budget references are added (and predicted first) when missing.
    lengths
        Sequence lengths, checked against the exported range.
    target
        The TVM target whose kernels' workspaces count.
    trace
        Description of the trace, copied into the result.
    progress
        Called with one line per step of the run.

    Returns
    -------
    BenchResult
        Rows with ``source="predicted"``; ``repeat`` is 0 (nothing is timed).
    """
    from ..pipeline import as_target

    say = progress or (lambda _msg: None)
    tgt = as_target(target)
    graph = workload.graph
    lengths = sorted(set(int(n) for n in lengths))
    inputs = {n: workload.inputs(n) for n in lengths}
    dims = {n: graph.bind_dims(inputs[n]) for n in lengths}
    caller = {n: graph.param_bytes + int(sum(a.nbytes for a in inputs[n])) for n in lengths}
    say("computing lower bounds")
    lower = _lower_bounds(graph, dims, say)

    lowerings = _Lowerings(tgt)
    summaries = []
    rows: list[Measurement] = []
    step_peaks: dict[tuple[str, int], int | None] = {}
    for config, requested in resolve_configs(list(config_names)):
        summary = _summary(config, requested)
        summaries.append(summary)
        predictor = _predictor(config, graph, lowerings)
        try:
            for n in lengths:
                row = Measurement(
                    config.name,
                    n,
                    caller_bytes=caller[n],
                    lower_bound_bytes=lower[n],
                    source="predicted",
                )
                rows.append(row)
                if isinstance(predictor, str):
                    row.error = predictor
                    continue
                say(f"{config.name}: s={n}")
                try:
                    _predict_row(row, config, predictor, graph, inputs[n], dims[n], step_peaks)
                except Exception as err:
                    row.error = _describe(err)
                    say(f"{config.name}: s={n}: {row.error}")
                step_peaks[(config.name, n)] = row.step_peak_bytes
        finally:
            # The compiled predictor holds Inductor's kernels skipped until it is closed.
            if not isinstance(predictor, str):
                predictor.close()
        if not isinstance(predictor, str):
            summary.compile_time_s = predictor.compile_time_s
            summary.compilations = predictor.compilations
    return BenchResult(
        workload=workload,
        target=str(tgt.kind.name) if not isinstance(target, str) else target,
        lengths=lengths,
        trace=trace or {},
        repeat=0,
        tolerance=0.0,
        configs=summaries,
        measurements=rows,
    )


class _EagerPredictor:
    """PyTorch eager, counted on the meta device (:func:`predict_torch_peak`)."""

    compilations = 0
    compile_time_s = 0.0

    def close(self) -> None:
        pass


class _CompiledPredictor:
    """``torch.compile``, run without its kernels (see the module docstring).

    The measuring ruler's own runner compiles and steps the module; its settings and the
    skipped kernels stay in force from the first length to :meth:`close`, so that the trace
    compiles as often as the ruler's run would.
    """

    def __init__(self, config: TorchConfig, graph: ImportedGraph) -> None:
        from ..training.torch_memory import inductor_kernels_skipped

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(inductor_kernels_skipped())
        self.runner = _TorchRunner(config, graph)
        self._stack.enter_context(self.runner._settings())
        self.compilations = 0
        self.compile_time_s = 0.0

    def predict(self, row: Measurement, inputs: list[np.ndarray]) -> None:
        runner = self.runner
        tensors = [runner.torch.from_numpy(np.array(a)) for a in inputs]
        # The first call compiles where the length needs it, as the ruler's does; the second
        # is counted.
        first_call, compiled_now = runner._first_step(tensors)
        row.step_peak_bytes, _ = runner._counted_step(tensors)
        row.compile_time_s = first_call if compiled_now else 0.0
        self.compile_time_s += row.compile_time_s
        self.compilations = row.compilations = runner._compilations_so_far()

    def close(self) -> None:
        for param in self.runner.params:
            param.grad = None
        self._stack.close()


def _predictor(config: BenchConfig, graph: ImportedGraph, lowerings: _Lowerings) -> Any:
    """A predictor for ``config``, or (a string) why it cannot be predicted."""
    if isinstance(config, TorchConfig):
        if graph.torch_module is None:
            return f"{NOT_PREDICTED}: the workload has no torch module"
        if config.compile:
            return _CompiledPredictor(config, graph)
        return _EagerPredictor()
    try:
        return _TvmPredictor(config, graph, lowerings)
    except ValueError as err:
        return str(err)


def _predict_row(
    row: Measurement,
    config: BenchConfig,
    predictor: Any,
    graph: ImportedGraph,
    inputs: list[np.ndarray],
    dims: dict[str, int],
    step_peaks: dict[tuple[str, int], int | None],
) -> None:
    if isinstance(predictor, _EagerPredictor):
        assert isinstance(config, TorchConfig)
        shapes = [a.shape for a in inputs]
        row.step_peak_bytes = predict_torch_peak(
            graph,
            shapes,
            checkpointing=config.checkpointing,
            attention=config.attention,
            mask_all_ones=_mask_all_ones(graph, inputs),
        )
        row.peak_bytes = row.step_peak_bytes + row.caller_bytes
        return
    if isinstance(predictor, _CompiledPredictor):
        predictor.predict(row, inputs)
        row.peak_bytes = row.step_peak_bytes + row.caller_bytes
        return
    assert isinstance(config, TvmConfig)
    if config.bucket is not None:
        padded, dims = pad_for_bucket(config, graph, inputs, dims)
        row.padded_to = dims["s"]
        row.caller_bytes = graph.param_bytes + int(sum(a.nbytes for a in padded))
    budget = None
    if config.budget is not None:
        reference = step_peaks.get((config.budget_of, row.seq_len))
        if reference is None:
            raise ValueError(f"no predicted peak of {config.budget_of} to take the budget from")
        budget = row.budget_bytes = max(1, int(config.budget * reference))
    predictor.predict(row, dims, budget)
    row.peak_bytes = row.step_peak_bytes + row.caller_bytes


def _describe(err: BaseException) -> str:
    from .runner import _describe as describe

    return describe(err)

"""A training loop over batches of varying length: one compilation, in-place updates, memory.

:class:`Trainer` compiles a :class:`~blade_relax.training.TrainingStep` once (the blade_relax
pipeline by default) and runs it on batches of any length inside the graph's declared range.
Parameters and optimizer state live on the device for the whole run and are updated in place.
Every batch is checked before any kernel runs (number of inputs, dtypes, shapes, the length
range, token ids inside the vocabulary), so a bad batch raises and leaves the parameters as
they were.

Peak bytes per step are the full step's: the parameters, the optimizer state and the scalars
(held across steps, counted once) plus the most bytes the step itself added, as the runtime
accounting measures them (:func:`blade_relax.runtime.measure_call`), the scratch buffers of the
kernel running at that point included.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..frontend.imported import SIZE_OPTIONS, ImportedGraph
from .optimizers import AdamW, InPlaceOptimizer
from .sharding import ZeroSharding
from .step import UPDATE_PLACEMENTS, TrainingStep, build_training_step

__all__ = ["TRAINER_UPDATES", "History", "StepRecord", "Trainer", "as_batch", "fit"]

#: Where a :class:`Trainer` places the optimizer's updates: one of
#: :data:`~.step.UPDATE_PLACEMENTS`, or ``"auto"``: a step per placement, compiled, and each
#: batch run by the one whose predicted peak at its sizes is lower.
TRAINER_UPDATES = (*UPDATE_PLACEMENTS, "auto")

#: The label value Hugging Face's cross-entropy ignores.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class StepRecord:
    """One training step.

    Attributes
    ----------
    step
        1-based step number.
    length
        Sequence length of the batch (the graph's ``s``).
    loss
        The loss the step computed (before its update).
    peak_bytes
        The full step's peak: persistent bytes (parameters, state, scalars) plus the most
        bytes the step added.
    step_peak_bytes
        The most bytes the step added on top of what was live when it started.
    time_s
        Wall time of the step (the call and its measurement).
    evictions, regenerations
        Tensors the remat runtime evicted and regenerated (under a budget).
    budget_reachable
        Under a budget: whether the runtime could hold it (when not, it ran at the smallest
        peak it can reach, which :meth:`Trainer.fit` reports instead of warning every step);
        ``None`` without a budget.
    updates
        Where the step that ran placed the optimizer's updates (``None`` for a loop that is
        not a :class:`Trainer`'s).
    """

    step: int
    length: int
    loss: float
    peak_bytes: int
    step_peak_bytes: int
    time_s: float
    evictions: int = 0
    regenerations: int = 0
    budget_reachable: bool | None = None
    updates: str | None = None


@dataclass
class History:
    """What a run did, step by step.

    Attributes
    ----------
    records
        One :class:`StepRecord` per step.
    persistent_bytes
        Bytes of parameters, optimizer state and scalars (held across steps).
    compilations
        How many times the step was compiled (one for the whole run).
    compile_time_s
        Time to compile it, as a cold compile takes (:class:`blade_relax.transform.CompileClock`).
    label
        What ran (``"blade_relax"``, ``"torch"``).
    """

    records: list[StepRecord] = field(default_factory=list)
    persistent_bytes: int = 0
    compilations: int = 0
    compile_time_s: float = 0.0
    label: str = "blade_relax"

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.records]

    @property
    def peaks(self) -> list[int]:
        return [r.peak_bytes for r in self.records]

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "persistent_bytes": self.persistent_bytes,
            "compilations": self.compilations,
            "compile_time_s": self.compile_time_s,
            "steps": [asdict(r) for r in self.records],
        }


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


def as_batch(graph: ImportedGraph, batch: Any) -> list[np.ndarray]:
    """The arrays of one batch, in the graph's input order.

    A batch is a sequence of arrays (one per input), a mapping from input names to arrays
    (torch tensors, numpy arrays or nested lists: what ``transformers`` data collators such as
    ``DataCollatorForSeq2Seq`` and ``DataCollatorWithPadding`` yield), or, for a causal LM whose
    inputs are ``input_ids`` and ``labels``, the token ids alone (the labels are the ids: the
    model shifts them). A mapping without ``labels`` takes the ids as labels (with ``-100``
    where ``attention_mask`` is 0), one without ``attention_mask`` (for a step that takes one)
    a mask of ones; a boolean ``attention_mask`` is read as 0/1.

    A step imported without ``attention_mask`` takes a mapping that has one only when the
    mask changes nothing: all ones, or padding on the right whose labels are all ``-100`` (no
    real token attends to a later one). Any other mask raises: that step would attend to the
    padding.

    Integer arrays of any integer dtype (``int32`` ids from a tokenizer, ``uint8`` masks, torch
    or numpy) are cast to the step's integer dtype when no value changes; a float array for an
    integer input raises ``TypeError``.
    """
    arrays = _batch_arrays(graph, batch)
    return [
        _as_dtype(name, array, dtype)
        for name, array, dtype in zip(graph.input_names, arrays, graph.input_dtypes)
    ]


def _as_dtype(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as the step's ``dtype``: integers cast losslessly, anything else as it is
    (:func:`check_batch` refuses a wrong dtype)."""
    want = np.dtype(dtype)
    if array.dtype == want or want.kind not in "iu":
        return array
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"input {name!r} has dtype {array.dtype}, but it holds integers (token ids, labels, "
            f"a 0/1 mask): pass an integer array (any integer dtype, int32 or int64 alike; it "
            f"is cast to {want})"
        )
    if not np.can_cast(array.dtype, want) and array.size:
        info = np.iinfo(want)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            value = high if high > info.max else low
            raise ValueError(
                f"input {name!r} holds {value}, which the step's dtype {want} cannot hold"
            )
    return array.astype(want)


def _batch_arrays(graph: ImportedGraph, batch: Any) -> list[np.ndarray]:
    """The arrays of ``batch`` in the graph's input order, as given (see :func:`as_batch`)."""
    names = graph.input_names
    if not isinstance(batch, (Mapping, list, tuple)) and _CAUSAL_LM_INPUTS.issuperset(names):
        batch = {"input_ids": batch}
    if isinstance(batch, Mapping):
        batch = _with_labels(dict(batch), names)
        if "attention_mask" in names and "attention_mask" not in batch and "input_ids" in batch:
            batch["attention_mask"] = np.ones_like(_to_numpy(batch["input_ids"]))
        if "attention_mask" in batch and "attention_mask" not in names:
            batch = _without_mask(batch)
        missing = [n for n in names if n not in batch]
        if missing:
            raise ValueError(f"the batch lacks {missing}; the step takes {names}")
        extra = sorted(set(batch) - set(names))
        if extra:
            raise ValueError(f"the batch has unknown inputs {extra}; the step takes {names}")
        return [_input_array(n, batch[n]) for n in names]
    if isinstance(batch, (list, tuple)):
        if len(batch) != len(names):
            raise ValueError(
                f"a batch has {len(names)} arrays ({', '.join(names)}), got {len(batch)}"
            )
        return [_input_array(n, b) for n, b in zip(names, batch)]
    raise TypeError(
        f"a batch is a sequence or a mapping of arrays for {names}, not {type(batch).__name__}"
    )


#: The inputs of a Hugging Face causal LM's training step.
_CAUSAL_LM_INPUTS = frozenset({"input_ids", "attention_mask", "labels"})


def _input_array(name: str, value: Any) -> np.ndarray:
    array = _to_numpy(value)
    if name == "attention_mask" and array.dtype == np.bool_:
        return array.astype("int64")
    return array


def _with_labels(batch: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The batch with ``labels``: the ids, ``-100`` where the mask is 0, when it has none."""
    if "labels" in batch or "labels" not in names or "input_ids" not in batch:
        return batch
    labels = np.array(_to_numpy(batch["input_ids"]), copy=True)
    if "attention_mask" in batch:
        mask = _input_array("attention_mask", batch["attention_mask"])
        if mask.shape == labels.shape:
            labels[mask == 0] = IGNORE_INDEX
    return {**batch, "labels": labels}


def _without_mask(batch: dict[str, Any]) -> dict[str, Any]:
    """Drop an ``attention_mask`` the step was not imported with, if it changes nothing."""
    mask = _input_array("attention_mask", batch["attention_mask"])
    rest = {k: v for k, v in batch.items() if k != "attention_mask"}
    if mask.size == 0 or bool((mask == 1).all()):
        return rest
    labels = _to_numpy(rest["labels"]) if "labels" in rest else None
    right_padded = bool((np.diff(mask.astype("int64"), axis=-1) <= 0).all()) and bool(
        np.isin(mask, (0, 1)).all()
    )
    if right_padded and labels is not None and labels.shape == mask.shape:
        if bool((labels[mask == 0] == IGNORE_INDEX).all()):
            return rest
    raise ValueError(
        "the batch pads with attention_mask, but the step was imported without one and would "
        "attend to the padding; import with import_training_step(..., attention_mask=True) "
        "(a Trainer built from the model does) or pad on the right with labels -100 there"
    )


def check_batch(graph: ImportedGraph, arrays: Sequence[np.ndarray]) -> dict[str, int]:
    """Check a batch against the graph (dtypes, shapes, dim ranges, token ids, masks, labels);
    its dims.

    Raises
    ------
    TypeError
        A wrong dtype.
    ValueError, DimOutOfRangeError
        A wrong shape, a length outside the declared range, a token id outside the vocabulary,
        an ``attention_mask`` holding anything but 0 and 1, or ``labels`` that count no token
        (every one ``-100``: the mean loss would be 0 / 0).
    """
    for name, array, dtype in zip(graph.input_names, arrays, graph.input_dtypes):
        if str(array.dtype) != dtype:
            cast = " (as_batch casts integer arrays to it)" if array.dtype.kind in "iu" else ""
            raise TypeError(f"input {name!r} has dtype {array.dtype}, the step takes {dtype}{cast}")
    dims = graph.bind_dims(arrays)
    high = graph.int_input_high
    for name, array in zip(graph.input_names, arrays):
        if array.dtype.kind not in "iu" or array.size == 0:
            continue
        if name == "attention_mask":
            bad = (array != 0) & (array != 1)
            if bad.any():
                raise ValueError(
                    f"input 'attention_mask' holds {int(array[bad].flat[0])}; a mask is 0 "
                    f"(padding) or 1 (a token)"
                )
            continue
        if high is None:
            continue
        low = IGNORE_INDEX if name == "labels" else 0
        bad = (array >= high) | ((array < 0) & (array != low))
        if bad.any():
            value = int(array[bad].flat[0])
            raise ValueError(
                f"input {name!r} holds {value}, outside [0, {high})"
                + (f" (or {IGNORE_INDEX}, ignored)" if name == "labels" else "")
                + (
                    f": token ids index the model's vocabulary (vocab_size {high})"
                    if name in ("input_ids", "labels")
                    else ""
                )
            )
        if name == "labels":
            # The model shifts the labels: position 0 is never a target.
            if not (array[..., 1:] != IGNORE_INDEX).any():
                raise ValueError(
                    f"input 'labels' counts no token (all {IGNORE_INDEX} after the first "
                    "position): the mean loss would be 0 / 0"
                )
    return dims


def _is_hf_model(source: Any) -> bool:
    return hasattr(source, "named_parameters") and hasattr(source, "config")


def _as_steps(
    source: Any,
    optimizer: InPlaceOptimizer | None,
    max_seq_len: int | None,
    max_batch_size: int | None = None,
    sharding: ZeroSharding | None = None,
    updates: str = "end",
) -> dict[str, TrainingStep]:
    """The training step of each placement ``updates`` asks for (both for ``"auto"``)."""
    if updates not in TRAINER_UPDATES:
        raise ValueError(f"updates must be one of {TRAINER_UPDATES}, not {updates!r}")
    if isinstance(source, TrainingStep):
        return {source.updates: _checked_step(source, optimizer, sharding, updates)}
    optimizer = optimizer if optimizer is not None else AdamW()
    graph = _as_graph(source, max_seq_len, max_batch_size)
    placements = UPDATE_PLACEMENTS if updates == "auto" else (updates,)
    return {
        placement: build_training_step(graph, optimizer, sharding, updates=placement)
        for placement in placements
    }


def _checked_step(
    step: TrainingStep,
    optimizer: InPlaceOptimizer | None,
    sharding: ZeroSharding | None,
    updates: str,
) -> TrainingStep:
    """A step given as it is: it has its optimizer, sharding and placement."""
    if optimizer is not None and optimizer is not step.optimizer:
        raise ValueError("the training step already has an optimizer")
    if updates == "auto":
        raise ValueError(
            "updates='auto' builds a step per placement: pass the training graph or the "
            "model, not a TrainingStep"
        )
    if updates != "end" and updates != step.updates:
        raise ValueError(
            f"the training step places its updates at {step.updates!r}; build it with "
            f"updates={updates!r} instead"
        )
    if step.sharding != sharding:
        raise ValueError(
            f"the training step is built for sharding {step.sharding}, the trainer runs {sharding}"
        )
    return step


def _as_graph(source: Any, max_seq_len: int | None, max_batch_size: int | None) -> ImportedGraph:
    """A training graph, given or imported from a Hugging Face model."""
    if isinstance(source, ImportedGraph):
        return source
    if _is_hf_model(source):
        from ..frontend.hf import import_training_step, max_positions, size_options

        limit = max_seq_len if max_seq_len is not None else max_positions(source)
        if limit is None:
            raise ValueError(
                "Trainer needs max_seq_len= for this model, the longest sequence (in tokens) it "
                "will train on (its config has no max_position_embeddings / n_positions); "
                "e.g. Trainer(model, max_seq_len=512)"
            )
        graph = import_training_step(
            source, max_seq_len=limit, max_batch_size=max_batch_size, attention_mask=True
        )
        # Shape errors then name the options of the call that imported the model.
        graph.metadata[SIZE_OPTIONS] = size_options("Trainer (or fit)", source, min_option=False)
        return graph
    raise TypeError(
        "train a TrainingStep, a training ImportedGraph or a Hugging Face causal LM, not "
        f"{type(source).__name__}"
    )


class Trainer:
    """Runs a training step, compiled once, over batches of varying length.

    Parameters
    ----------
    source
        A :class:`TrainingStep`, a training :class:`~blade_relax.frontend.ImportedGraph`, or a
        Hugging Face causal LM, a PEFT model included (imported with ``attention_mask``,
        ``max_seq_len``, default its position limit, and ``max_batch_size``).
    optimizer
        The optimizer (default :class:`AdamW` with torch's defaults); not with a
        :class:`TrainingStep`, which has one.
    target
        Where to compile and run: ``"host"`` (the default: llvm for this machine's CPU, its
        vector units used, :func:`blade_relax.pipeline.host_target`), ``"llvm"`` (a generic
        CPU of the architecture) or a CUDA target.
    pipeline
        The Relax pipeline (default :func:`blade_relax.get_pipeline` for ``target``).
    max_seq_len
        For a Hugging Face model: the longest sequence the step accepts.
    max_batch_size
        For a Hugging Face model: the largest batch the step accepts (``None``: batches of one).
    updates
        Where the step applies the updates: ``"end"`` or ``"early"`` (see
        :func:`~.step.build_training_step`); not with a :class:`TrainingStep`, which has its own.
        ``"auto"``: a step of each placement, both compiled; each batch runs the one whose
        predicted peak (:meth:`predicted_peak`, without a budget) is lower at its sizes (the
        updates at the end on a tie). Neither is lower at every length: an early update frees
        its gradient at once, but stops values that read its parameter from being recomputed.
        It compiles twice (the predictions read the memory stage each compilation keeps); it
        needs the default pipeline.
    """

    def __init__(
        self,
        source: Any,
        optimizer: InPlaceOptimizer | None = None,
        *,
        target: str | dict | tvm.target.Target = "host",
        pipeline: tvm.transform.Pass | None = None,
        max_seq_len: int | None = None,
        max_batch_size: int | None = None,
        updates: str = "end",
    ) -> None:
        from ..pipeline import as_target
        from ..runtime.devices import device_for_target

        if updates == "auto" and pipeline is not None:
            raise ValueError(
                "updates='auto' chooses by the default pipeline's predicted peaks; with a "
                "pipeline of your own, choose updates='end' or 'early'"
            )
        # The step of each placement run; the first is the trainer's step_ir.
        self.steps_ir = _as_steps(
            source, optimizer, max_seq_len, max_batch_size, self._sharding(), updates
        )
        self.step_ir = next(iter(self.steps_ir.values()))
        self.graph = self.step_ir.graph
        self.optimizer = self.step_ir.optimizer
        self.target = as_target(target)
        self.pipeline = pipeline
        self.device = device_for_target(self.target, self._device_index())
        self.executable: Any = None
        self.workspaces: dict[str, Any] = {}
        # Per placement: the compiled step and its kernels' workspaces.
        self._compiled: dict[str, Any] = {}
        self._choices: dict[tuple[tuple[str, int], ...], str] = {}
        # Per placement: its step lowered to the memory stage, for predicted_peaks, and the
        # timelines of that stage's versions of main, built as the predictions need them.
        self._memory_stages: dict[str, Any] = {}
        self._timelines: dict[str, dict[str, Any]] = {}
        self.compilations = 0
        self.compile_time_s = 0.0
        self.steps_done = 0
        # tvm.runtime.tensor copies: the graph's arrays stay the initial parameters.
        params = [np.asarray(p) for p in self.graph.params]
        states = self.step_ir.initial_state()
        self.params = [tvm.runtime.tensor(p, self.device) for p in params]
        self.states = [tvm.runtime.tensor(s, self.device) for s in states]
        scalar_bytes = self.optimizer.num_scalars * 4  # float32
        self.persistent_bytes = int(
            sum(a.nbytes for a in params) + sum(a.nbytes for a in states) + scalar_bytes
        )

    def _device_index(self) -> int:
        """The ordinal of the GPU to run on, for GPU targets (the first)."""
        return 0

    def _sharding(self) -> ZeroSharding | None:
        """How the optimizer state is sharded (none: one process holds it all)."""
        return None

    # ------------------------------------------------------------------ compile
    def compile(self) -> None:
        """Compile the step, each placement's with ``updates="auto"`` (once; later calls do
        nothing)."""
        # ``executable`` (the first placement's) may be given from outside, compiled before.
        default = self.step_ir.updates
        missing = [
            placement
            for placement in self.steps_ir
            if placement not in self._compiled
            and not (placement == default and self.executable is not None)
        ]
        if not missing:
            return
        from ..analysis.workspace import compile_keeping_module
        from ..pipeline import pipeline_keeping_memory_stage
        from ..transform import CompileClock

        clock = CompileClock()  # a cold compile's time, when the schedule was remembered
        for placement in missing:
            step = self.steps_ir[placement]
            pipeline, kept = self.pipeline, []
            if pipeline is None:
                # The default pipeline's memory stage is what predicted_peaks reads.
                pipeline = pipeline_keeping_memory_stage(self.target, kept)
            self._compiled[placement] = compile_keeping_module(step.mod, self.target, pipeline)
            # The kernels are loaded (LLVM's JIT runs) when the first VM of an executable is
            # made: 2.9 s on the small Llama's step, a compile time, not the first step's.
            relax.VirtualMachine(self._compiled[placement].executable, self.device)
            if kept:
                self._memory_stages.setdefault(placement, kept[-1])
            self.compilations += 1
        self.compile_time_s = clock.seconds()
        if default in missing:
            # The kernels' scratch buffers (TVM's workspace pool, behind the VM's allocator)
            # are counted while each kernel runs, as the bench counts them and the timeline
            # predicts.
            self.workspaces = self._compiled[default].workspaces
            self.executable = self._compiled[default].executable

    def _compiled_step(self, placement: str) -> tuple[Any, dict[str, Any]]:
        """The executable and kernel workspaces of ``placement``'s step."""
        if placement == self.step_ir.updates:
            return self.executable, self.workspaces
        compiled = self._compiled[placement]
        return compiled.executable, compiled.workspaces

    def predicted_peak(self, dims: Mapping[str, int]) -> int:
        """The full step's peak at ``dims`` (e.g. ``{"b": 2, "s": 57}``), predicted without
        running a kernel (:func:`~.step_peak.predicted_step_peak`: the bytes held across
        steps plus the peak of the step's symbolic timeline, the default pipeline's passes),
        the figure :meth:`step` measures: with ``updates="auto"``, of the placement it runs.

        Raises
        ------
        ValueError
            With a pipeline of the caller's (its passes are unknown here).
        """
        return min(self.predicted_peaks(dims).values())

    def placement_for(self, dims: Mapping[str, int]) -> str:
        """Where the step run at ``dims`` places its updates (see ``updates``)."""
        if len(self.steps_ir) == 1:
            return self.step_ir.updates
        key = tuple(sorted((name, int(value)) for name, value in dims.items()))
        chosen = self._choices.get(key)
        if chosen is None:
            peaks = self.predicted_peaks(dims)
            # The lower peak; on a tie, the first placement (the updates at the end).
            chosen = self._choices[key] = min(
                peaks, key=lambda p: (peaks[p], UPDATE_PLACEMENTS.index(p))
            )
        return chosen

    def predicted_peaks(self, dims: Mapping[str, int]) -> dict[str, int]:
        """Per placement the trainer runs (both with ``updates="auto"``), the full step's
        peak predicted at ``dims`` (see :meth:`predicted_peak`)."""
        from .step_peak import lower_step, predicted_step_peak

        if self.pipeline is not None:
            raise ValueError("predicted_peak reads the default pipeline; this trainer has its own")
        peaks = {}
        for placement, step in self.steps_ir.items():
            if placement not in self._memory_stages:
                self._memory_stages[placement] = lower_step(step, self.target)
            peaks[placement] = predicted_step_peak(
                step,
                dims,
                self.target,
                lowered=self._memory_stages[placement],
                timelines=self._timelines.setdefault(placement, {}),
            )
        return peaks

    # ------------------------------------------------------------------ steps
    def parameters(self) -> list[np.ndarray]:
        """The current parameters, as numpy copies (in the graph's order)."""
        return [p.numpy() for p in self.params]

    def state(self) -> list[np.ndarray]:
        """The current optimizer state, as numpy copies (``step_ir.state_names`` order)."""
        return [s.numpy() for s in self.states]

    def step(self, batch: Any, budget: int | float | None = None) -> StepRecord:
        """Run one step on ``batch`` (checked first: a bad batch changes nothing).

        Parameters
        ----------
        batch
            See :func:`as_batch`.
        budget
            ``None``; an ``int``: bytes the step may add on top of what is live when it starts;
            a ``float`` in ``(0, 1]``: that share of the step's peak without evictions, at its
            length (the remat runtime decides what to evict). Under any budget the step runs
            its rematerializing version, whose evictable tensors keep storage of their own: its
            peak without evictions lies above the unbudgeted step's, and the fraction is of
            that peak (so ``budget=1.0`` can exceed the unbudgeted peak).
        """
        arrays = as_batch(self.graph, batch)
        dims = check_batch(self.graph, arrays)
        return self._run(arrays, dims, [], budget)

    def _run(
        self,
        arrays: Sequence[np.ndarray],
        dims: Mapping[str, int],
        extra_args: Sequence[Any],
        budget: int | float | None,
        placement: str | None = None,
    ) -> StepRecord:
        """Run the step on checked ``arrays``, with ``extra_args`` after the scalars, by the
        step of ``placement`` (by default :meth:`placement_for` the dims)."""
        from ..runtime import (
            RematBudgetWarning,
            last_remat_decision,
            measure_call,
            set_relative_budget,
        )

        absolute, relative = _split_budget(budget)
        self.compile()
        placement = placement if placement is not None else self.placement_for(dims)
        executable, workspaces = self._compiled_step(placement)
        step = self.steps_done + 1
        scalars = tvm.runtime.tensor(self.optimizer.scalars(step), self.device)
        inputs = [tvm.runtime.tensor(np.ascontiguousarray(a), self.device) for a in arrays]
        args = [*inputs, *self.params, *self.states, scalars, *extra_args]
        scope = set_relative_budget(relative) if relative is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with scope:
            # On a fresh VM (measure_call's rule 2): nothing of the last step is live at entry.
            # Not collected first (rule 1): the record reads only the step's own bytes, which
            # garbage of earlier calls cannot change, and a full collection costs more than a
            # small step (0.5 s with a Hugging Face model imported).
            measured = measure_call(
                executable,
                args,
                budget=absolute,
                device=self.device,
                workspaces=workspaces,
                convert=lambda out: float(out[0].numpy()),
                collect_garbage=False,
                record_warnings=budget is not None,
            )
        elapsed = time.perf_counter() - start
        for caught in measured.recorded_warnings:  # budget warnings are summed up by fit()
            if not issubclass(caught.category, RematBudgetWarning):
                warnings.warn_explicit(
                    caught.message, caught.category, caught.filename, caught.lineno
                )
        decision = measured.decision
        if decision is None and relative is not None:  # made for the call's own budget
            decision = last_remat_decision()
        self.steps_done = step
        length = int(dims.get("s", arrays[0].shape[-1]))
        return StepRecord(
            step=step,
            length=length,
            loss=measured.outputs,
            peak_bytes=self.persistent_bytes + measured.peak_bytes,
            step_peak_bytes=measured.peak_bytes,
            time_s=elapsed,
            evictions=measured.evictions,
            regenerations=measured.regenerations,
            budget_reachable=None if decision is None else bool(decision["reachable"]),
            updates=placement,
        )

    def fit(
        self,
        batches: Iterable[Any],
        steps: int | None = None,
        budget: int | float | None = None,
        *,
        progress: bool = True,
    ) -> History:
        """Train on ``batches`` for ``steps`` steps (all of them when ``None``).

        Raises
        ------
        ValueError
            When ``batches`` is empty, or ``steps`` is not positive.
        """
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be positive, got {steps}")
        _split_budget(budget)  # a bad budget fails before anything runs
        iterator = iter(batches)
        first = next(iterator, _EMPTY)
        if first is _EMPTY:
            raise ValueError("no batches to train on: the iterator is empty")
        stream: Iterator[Any] = itertools.chain([first], iterator)
        if steps is not None:
            stream = itertools.islice(stream, steps)
        history = History(persistent_bytes=self.persistent_bytes, label="blade_relax")
        bar = _progress(steps, progress)
        try:
            for batch in stream:
                record = self.step(batch, budget)
                history.records.append(record)
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{record.loss:.4f}",
                        len=record.length,
                        peak=f"{record.peak_bytes / 2**20:.1f}MiB",
                        ms=f"{record.time_s * 1e3:.0f}",
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        history.compilations = self.compilations
        history.compile_time_s = self.compile_time_s
        missed = [r for r in history.records if r.budget_reachable is False]
        if missed:
            from ..runtime import RematBudgetWarning

            lengths = sorted({r.length for r in missed})
            warnings.warn(
                RematBudgetWarning(
                    f"{len(missed)} of {len(history.records)} steps could not stay within the "
                    f"budget (lengths {lengths[:8]}{' ...' if len(lengths) > 8 else ''}): "
                    "tensors no eviction removes exceed it there; those steps ran at the "
                    "smallest peak the runtime can reach"
                ),
                stacklevel=2,
            )
        return history


_EMPTY = object()


def _split_budget(budget: int | float | None) -> tuple[int | None, float | None]:
    """An ``int`` budget is bytes, a ``float`` a fraction; each checked by the runtime's rule."""
    from ..runtime.budget import check_budget, check_fraction

    if budget is None:
        return None, None
    if isinstance(budget, bool) or not isinstance(budget, int | float | np.integer | np.floating):
        raise TypeError(f"a budget is bytes (int) or a fraction (float), not {budget!r}")
    if isinstance(budget, int | np.integer):
        return check_budget(budget), None
    return None, check_fraction(budget)


def _progress(total: int | None, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return None
    return tqdm(total=total, desc="train", unit="step")


def fit(
    source: Any,
    batches: Iterable[Any],
    steps: int | None = None,
    budget: int | float | None = None,
    *,
    optimizer: InPlaceOptimizer | None = None,
    target: str | dict | tvm.target.Target = "host",
    progress: bool = True,
    max_seq_len: int | None = None,
    max_batch_size: int | None = None,
    updates: str = "end",
) -> History:
    """Train ``source`` on ``batches``: :class:`Trainer` then :meth:`Trainer.fit`.

    Returns
    -------
    History
        Per step: length, loss, peak bytes, time, evictions.
    """
    trainer = Trainer(
        source,
        optimizer,
        target=target,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        updates=updates,
    )
    return trainer.fit(batches, steps, budget, progress=progress)

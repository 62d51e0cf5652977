"""A training step's full peak at given sizes, predicted without compiling a kernel or holding a
device: what :meth:`~.trainer.Trainer.predicted_peak` computes, for a bare
:class:`~.step.TrainingStep` (the bench predicts per rank at sizes no CPU runs).

The full peak is the bytes held across steps (:func:`persistent_step_bytes`: parameters, the
optimizer state, this rank's blocks of it when sharded, the per-step scalars and the rank
input) plus the peak of the symbolic timeline of the step lowered to the memory stage with the
default pipeline's passes (:func:`blade_relax.pipeline.lower_to_memory_stage`;
``check_dims`` off: its assertions allocate nothing), evaluated at the sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import tvm

from .step import TrainingStep

__all__ = ["lower_step", "persistent_step_bytes", "predicted_step_peak"]

#: Bytes of the ``shard_rank`` input of a sharded step (one int64).
RANK_INPUT_BYTES = 8


def persistent_step_bytes(step: TrainingStep) -> int:
    """Bytes a rank holds across steps: every parameter, its optimizer state (blocks when
    sharded), the float32 scalars, and the rank input of a sharded step."""
    params = sum(np.asarray(p).nbytes for p in step.graph.params)
    state = sum(s.nbytes for s in step.initial_state())
    scalars = step.optimizer.num_scalars * 4
    rank = RANK_INPUT_BYTES if step.sharding is not None else 0
    return int(params + state + scalars + rank)


def lower_step(step: TrainingStep, target: str | tvm.target.Target = "llvm") -> tvm.IRModule:
    """``step`` lowered to the memory stage with the default pipeline's flags."""
    from ..pipeline import PipelineFlags, as_target, lower_to_memory_stage

    flags = PipelineFlags()
    keywords = {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    keywords["check_dims"] = False  # its assertions allocate nothing
    return lower_to_memory_stage(step.mod, as_target(target), **keywords)


def predicted_step_peak(
    step: TrainingStep,
    dims: Mapping[str, int],
    target: str | tvm.target.Target = "llvm",
    *,
    lowered: tvm.IRModule | None = None,
    timelines: MutableMapping[str, Any] | None = None,
) -> int:
    """The full step's peak at ``dims`` (a rank's own dims when sharded, e.g. ``{"b": 2,
    "s": 57}``): :func:`persistent_step_bytes` plus the timeline's peak.

    Parameters
    ----------
    lowered
        ``lower_step(step, target)``, when the caller keeps it (lowering a large step takes
        minutes; evaluating its timeline at more sizes does not).
    timelines
        A cache the caller keeps with ``lowered``: the symbolic timeline of each of its
        versions of ``main``, by name, filled as they are needed (building one takes about
        65 ms on the small Llama's step, evaluating it at a size a few).
    """
    from ..analysis import memory_timeline
    from ..pipeline import as_target
    from ..transform import version_for

    target = as_target(target)
    if lowered is None:
        lowered = lower_step(step, target)
    name = version_for(lowered, "main", dims)
    timeline = timelines.get(name) if timelines is not None else None
    if timeline is None:
        timeline = memory_timeline(lowered[name], mod=lowered, target=target)
        if timelines is not None:
            timelines[name] = timeline
    known = set(timeline.graph.dims)
    peak = timeline.evaluate({k: v for k, v in dims.items() if k in known}).peak
    return persistent_step_bytes(step) + int(peak)

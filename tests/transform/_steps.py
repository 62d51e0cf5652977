"""Two-layer training steps of the benchmark's Hugging Face workloads, lowered by the pipeline
with given flags and run on the VM: what the end-to-end tests of the attention passes compare."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.pipeline import lower_to_memory_stage, pipeline_phases


def tiny_training_graph(workload: str) -> tuple[Any, Any]:
    """The two-layer ``workload`` (its length unbounded, as the benchmark compiles it) and its
    sizes; skips without ``transformers``. Imported once per process: the tests only read it."""
    pytest.importorskip("transformers")
    return _imported(workload)


@functools.cache
def _imported(workload: str) -> tuple[Any, Any]:
    from blade_relax.bench.workloads import ModelSizes, build_workload

    sizes = ModelSizes(
        layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=64
    )
    return build_workload(workload, sizes).graph.with_upper_bounds(False), sizes


def run_step(
    graph: Any, sizes: Any, flags: dict[str, Any], lengths: tuple[int, ...] = (3, 40)
) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """The memory stage of ``graph`` under ``flags``, and the step's outputs (loss and
    gradients, flattened) at each of ``lengths``, on seeded token ids."""
    from blade_relax.frontend import flatten_outputs

    stage = lower_to_memory_stage(graph.mod, **flags)
    rest = tvm.transform.Sequential(pipeline_phases("llvm", **flags)["vm_lower"])
    vm = relax.VirtualMachine(tvm.compile(stage, "llvm", relax_pipeline=rest), tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    outs: list[np.ndarray] = []
    for s in lengths:
        ids = tvm.runtime.tensor(np.random.default_rng(s).integers(0, sizes.vocab, (1, s)))
        outs += [t.numpy() for t in flatten_outputs(vm["main"](ids, ids, *params))]
    return stage, outs

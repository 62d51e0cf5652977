"""One PyTorch training step of a benchmark workload, measured as the benchmark measures it."""

from __future__ import annotations

import numpy as np

from blade_relax.bench.configs import get_config
from blade_relax.bench.runner import Measurement, _TorchRunner


def measure_torch_step(workload, config: str, length: int) -> tuple[Measurement, list[np.ndarray]]:
    """One step of ``workload`` under the torch configuration ``config`` at length ``length``:
    the benchmark's row (peak bytes, correctness) and the step's outputs."""
    runner = _TorchRunner(get_config(config), workload.graph)
    row = Measurement(config, length)
    inputs = workload.inputs(length)
    arrays = runner.measure(row, inputs, workload.graph.bind_dims(inputs), 1, None)
    return row, arrays

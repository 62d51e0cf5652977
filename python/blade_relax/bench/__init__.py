"""The benchmark ruler: workloads, configurations side by side, one sequence-length trace.

``python -m blade_relax.bench --workload llama-train --configs tvm-dynamic,torch-eager`` (also
``blade-relax bench``) prints a markdown table and writes JSON (``--out``) and a plot
(``--plot``); ``--predict`` computes the peaks instead of measuring them, for sizes too large
to run (:mod:`.predict`). Configurations live in a registry (:mod:`.configs`); each memory
pass adds its own ``blade-relax*`` configurations there.

The names below are imported on first use, so that the command line answers ``--help`` and
rejects bad input without importing TVM.
"""

from __future__ import annotations

import importlib
from typing import Any

from .cli import main

# name -> submodule that defines it
_LAZY = {
    "TorchConfig": "configs",
    "TvmConfig": "configs",
    "available_configs": "configs",
    "budget_variant": "configs",
    "get_config": "configs",
    "register_budget_family": "configs",
    "register_config": "configs",
    "register_config_family": "configs",
    "BenchResult": "runner",
    "Measurement": "runner",
    "run_benchmark": "runner",
    "predict_benchmark": "predict",
    "length_trace": "trace",
    "LLAMA_1B": "workloads",
    "REAL": "workloads",
    "SMALL": "workloads",
    "WORKLOADS": "workloads",
    "ModelSizes": "workloads",
    "Workload": "workloads",
    "build_workload": "workloads",
}

__all__ = [
    "LLAMA_1B",
    "REAL",
    "SMALL",
    "WORKLOADS",
    "BenchResult",
    "Measurement",
    "ModelSizes",
    "TorchConfig",
    "TvmConfig",
    "Workload",
    "available_configs",
    "budget_variant",
    "build_workload",
    "get_config",
    "length_trace",
    "main",
    "predict_benchmark",
    "register_budget_family",
    "register_config",
    "register_config_family",
    "run_benchmark",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

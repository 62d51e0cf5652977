"""blade_relax: peak-memory optimizations on symbolic shapes for Apache TVM Relax.

Importing the package installs the runtime memory accounting (every storage that a Relax VM
created afterwards allocates is counted), registers the runtime builtins, and registers the
Relax pipeline ``"blade_relax"``. The passes live in :mod:`blade_relax.transform`.

The command lines (``blade-relax``, ``python -m blade_relax.bench``) are the one exception:
they answer ``--help`` and reject bad input without importing TVM (seconds on a small
machine), and import it, with everything above, when a command starts its work.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
import sys as _sys
from typing import Any as _Any

from ._quiet import quiet

__version__ = "0.1.0"

__all__ = ["get_pipeline", "quiet", "runtime", "__version__"]

# The modules `python -m` runs as blade_relax's command lines.
_COMMAND_MODULES = ("blade_relax.bench", "blade_relax.bench.cli", "blade_relax.cli")


def _is_command_line() -> bool:
    """Whether this process was started as one of blade_relax's command lines."""
    if _sys.argv and _os.path.basename(_sys.argv[0]) in ("blade-relax", "blade-relax.exe"):
        return True
    argv = list(getattr(_sys, "orig_argv", []))
    return any(a == "-m" and b in _COMMAND_MODULES for a, b in zip(argv, argv[1:]))


def _load() -> None:
    """Import the runtime (accounting, builtins) and the pipeline (registers ``blade_relax``)."""
    # importlib rather than `from . import runtime`, which would ask __getattr__ first.
    _importlib.import_module(f"{__name__}.runtime")  # installs accounting and builtins
    pipeline = _importlib.import_module(f"{__name__}.pipeline")
    globals()["get_pipeline"] = pipeline.get_pipeline


if not _is_command_line():
    _load()


def __getattr__(name: str) -> _Any:
    # Reached only in a command line before _load() (PEP 562).
    if name in ("get_pipeline", "runtime", "pipeline"):
        _load()
        if name == "get_pipeline":
            return globals()[name]
        return _sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""blade_relax: peak-memory optimizations on symbolic shapes for Apache TVM Relax.

Importing the package installs the runtime memory accounting (every storage that a Relax VM
created afterwards allocates is counted), registers the runtime builtins, and registers the
Relax pipeline ``"blade_relax"``. The passes live in :mod:`blade_relax.transform`.

The command lines (``blade-relax``, ``python -m blade_relax.bench``) are the one exception:
they answer ``--help`` and reject bad input without importing TVM (seconds on a small
machine), and import it, with everything above, when a command starts its work (:func:`load`).

The Hugging Face entry points are here too, imported on first use (PEP 562), so that
``import blade_relax`` needs neither torch nor transformers::

    import blade_relax

    graph = blade_relax.import_training_step(model, max_seq_len=512, max_batch_size=8)
    blade_relax.Trainer(graph).fit(batches)  # or blade_relax.Trainer(model, max_seq_len=512)

:func:`import_training_step` and :func:`import_inference` come from
:mod:`blade_relax.frontend`, :class:`Trainer`, :func:`fit`, :class:`AdamW` and :class:`SGD`
from :mod:`blade_relax.training`; torch is imported when a model is imported.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
import sys as _sys
from typing import Any as _Any

from .util.quiet import quiet

__version__ = "0.1.0"

#: The user-facing entry points, imported from these modules on first access.
_LAZY = {
    "import_inference": "frontend",
    "import_training_step": "frontend",
    "AdamW": "training",
    "SGD": "training",
    "Trainer": "training",
    "fit": "training",
}

__all__ = ["get_pipeline", "load", "quiet", "runtime", "__version__", *_LAZY]

# The modules `python -m` runs as blade_relax's command lines.
_COMMAND_MODULES = ("blade_relax.bench", "blade_relax.bench.cli", "blade_relax.cli")


def _is_command_line() -> bool:
    """Whether this process was started as one of blade_relax's command lines."""
    if _sys.argv and _os.path.basename(_sys.argv[0]) in ("blade-relax", "blade-relax.exe"):
        return True
    argv = list(getattr(_sys, "orig_argv", []))
    return any(a == "-m" and b in _COMMAND_MODULES for a, b in zip(argv, argv[1:]))


def load() -> None:
    """Import the runtime (accounting, builtins) and the pipeline (registers ``blade_relax``).

    What ``import blade_relax`` does, except in a process started as one of the command
    lines, which call it when a command starts its work (after ``--help`` and the checks of
    the arguments, which need no TVM). Idempotent: the modules are imported once.
    """
    # importlib rather than `from . import runtime`, which would ask __getattr__ first.
    _importlib.import_module(f"{__name__}.runtime")  # installs accounting and builtins
    pipeline = _importlib.import_module(f"{__name__}.pipeline")
    globals()["get_pipeline"] = pipeline.get_pipeline


if not _is_command_line():
    load()


def __getattr__(name: str) -> _Any:
    # PEP 562: the entry points of _LAZY on first access; the rest only in a command line
    # before load().
    if name in _LAZY:
        if "get_pipeline" not in globals():
            load()  # what `import blade_relax` does outside a command line
        module = _importlib.import_module(f"{__name__}.{_LAZY[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in ("get_pipeline", "runtime", "pipeline"):
        load()
        if name == "get_pipeline":
            return globals()[name]
        return _sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

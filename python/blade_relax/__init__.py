"""blade_relax: peak-memory optimizations on symbolic shapes for Apache TVM Relax.

Importing the package installs the runtime memory accounting (every storage that a Relax VM
created afterwards allocates is counted), registers the runtime builtins, and registers the
Relax pipeline ``"blade_relax"``. The passes live in :mod:`blade_relax.transform`.
"""

from __future__ import annotations

from . import runtime  # noqa: F401  (installs accounting and builtins)
from .pipeline import get_pipeline

__version__ = "0.1.0"

__all__ = ["get_pipeline", "runtime", "__version__"]

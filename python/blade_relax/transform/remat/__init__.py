"""Rematerialization: :class:`Rematerialize` writes evict / regenerate calls and their metadata,
:class:`RematTimeline` re-reads that metadata from the planned IR.

``rematerialize`` is the pass; ``_ir`` (the function as kernels and roots), ``_select`` (which
tensors to make evictable and how to recompute them), ``_rewrite`` (the runtime calls inserted)
and ``_timeline`` (the storage timeline the runtime decides on, written as the metadata of
:class:`blade_relax.contract.RematMetadata`) are its private parts.
"""

from ._timeline import RematHazardError, RematTimeline
from .rematerialize import Rematerialize, RematOptions

__all__ = ["RematHazardError", "RematOptions", "RematTimeline", "Rematerialize"]

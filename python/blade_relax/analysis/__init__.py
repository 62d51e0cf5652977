"""Analysis: facts about Relax functions (liveness, symbolic memory timeline, kernel
workspaces, reports).

Nothing in this package mutates IR.
"""

from .effects import *  # noqa: F403
from .effects import __all__ as _effects_all
from .inplace_reuse import InplaceVerdict, inplace_inputs, inplace_verdict
from .liveness import *  # noqa: F403
from .liveness import __all__ as _liveness_all
from .report import MemoryReport
from .storage_flow import StorageFlow, death_points, storage_flow
from .timeline import *  # noqa: F403
from .timeline import __all__ as _timeline_all
from .workspace import *  # noqa: F403
from .workspace import __all__ as _workspace_all

__all__ = [
    *_effects_all,
    *_liveness_all,
    *_timeline_all,
    *_workspace_all,
    "InplaceVerdict",
    "MemoryReport",
    "inplace_inputs",
    "inplace_verdict",
    "StorageFlow",
    "death_points",
    "storage_flow",
]

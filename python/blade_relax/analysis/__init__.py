"""Analysis: facts about Relax functions (liveness, symbolic memory timeline, kernel
workspaces, reports).

Nothing in this package mutates IR.
"""

from .effects import *  # noqa: F403
from .effects import __all__ as _effects_all
from .liveness import *  # noqa: F403
from .liveness import __all__ as _liveness_all
from .report import MemoryReport
from .timeline import *  # noqa: F403
from .timeline import __all__ as _timeline_all
from .workspace import *  # noqa: F403
from .workspace import __all__ as _workspace_all

__all__ = [*_effects_all, *_liveness_all, *_timeline_all, *_workspace_all, "MemoryReport"]

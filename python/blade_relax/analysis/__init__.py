"""Analysis: facts about Relax functions (liveness, symbolic memory timeline, reports).

Nothing in this package mutates IR.
"""

from .liveness import *  # noqa: F403
from .liveness import __all__ as _liveness_all
from .report import MemoryReport
from .timeline import *  # noqa: F403
from .timeline import __all__ as _timeline_all

__all__ = [*_liveness_all, *_timeline_all, "MemoryReport"]

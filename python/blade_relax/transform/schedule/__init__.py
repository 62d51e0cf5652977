"""Memory-aware scheduling: :class:`MemoryAwareSchedule` and its range copies.

``memory_aware_schedule`` is the pass; ``_model`` (a block's dependencies, buffers and live
bytes), ``_cost`` (symbolic byte comparisons), ``_search`` (the orders tried) and ``_versions``
(range copies and the dims they cover) are its private parts; ``_memo`` remembers the pass's
runs for an input met again in the process.
"""

from ._memo import CompileClock, forget_schedules, remembered_seconds
from .memory_aware_schedule import (
    BlockReport,
    MemoryAwareSchedule,
    ScheduleOptions,
    ScheduleReport,
    schedule_function,
    schedule_module,
)

__all__ = [
    "BlockReport",
    "CompileClock",
    "MemoryAwareSchedule",
    "ScheduleOptions",
    "ScheduleReport",
    "forget_schedules",
    "remembered_seconds",
    "schedule_function",
    "schedule_module",
]

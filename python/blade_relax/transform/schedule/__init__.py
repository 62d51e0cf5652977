"""Memory-aware scheduling: :class:`MemoryAwareSchedule` and its range copies.

``memory_aware_schedule`` is the pass; ``_model`` (a block's dependencies, buffers and live
bytes), ``_cost`` (symbolic byte comparisons), ``_search`` (the orders tried) and ``_versions``
(range copies and the dims they cover) are its private parts.
"""

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
    "MemoryAwareSchedule",
    "ScheduleOptions",
    "ScheduleReport",
    "schedule_function",
    "schedule_module",
]

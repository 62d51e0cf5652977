"""Passes: each a ``tvm.transform.Pass`` whose ``name`` equals its class name."""

from .memory_aware_schedule import MemoryAwareSchedule, ScheduleOptions
from .plan_memory import PlanMemory, PlanOptions
from .rematerialize import Rematerialize, RematOptions

__all__ = [
    "MemoryAwareSchedule",
    "PlanMemory",
    "PlanOptions",
    "RematOptions",
    "Rematerialize",
    "ScheduleOptions",
]

"""Passes: each a ``tvm.transform.Pass`` whose ``name`` equals its class name."""

from .check_dim_ranges import CheckDimRanges, DimRangeOptions
from .memory_aware_schedule import MemoryAwareSchedule, ScheduleOptions
from .plan_memory import PlanMemory, PlanOptions
from .rematerialize import Rematerialize, RematOptions

__all__ = [
    "CheckDimRanges",
    "DimRangeOptions",
    "MemoryAwareSchedule",
    "PlanMemory",
    "PlanOptions",
    "RematOptions",
    "Rematerialize",
    "ScheduleOptions",
]

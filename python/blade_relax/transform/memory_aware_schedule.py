"""Placeholder; being written."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleOptions:
    pass


class MemoryAwareSchedule:
    def __init__(self, options=None):
        raise NotImplementedError("MemoryAwareSchedule is being written")

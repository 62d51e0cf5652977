"""Placeholder; being written."""

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanOptions:
    pass


class PlanMemory:
    def __init__(self, options=None):
        raise NotImplementedError("PlanMemory is being written")

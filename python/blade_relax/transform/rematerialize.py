"""Placeholder; being written."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RematOptions:
    pass


class Rematerialize:
    def __init__(self, options=None):
        raise NotImplementedError("Rematerialize is being written")

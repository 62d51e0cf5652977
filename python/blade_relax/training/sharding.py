"""Data parallelism with sharded optimizer state (ZeRO stage 2), in one compiled step.

Every rank runs the same compiled step on its share of the batch. Each gradient, as soon as
the backward pass produces it, is reduce-scattered (:data:`~blade_relax.contract.REDUCE_GRADIENT`):
the rows of its leading axis that a rank owns (:func:`~blade_relax.contract.owned_rows`) then
hold the sum over the ranks of ``weight * gradient``, ``weight`` the rank's share of the
loss. The rank updates only those rows of the parameter, with the optimizer state of those rows
(1/N of the state), in place; the parameter is then all-gathered in place
(:data:`~blade_relax.contract.GATHER_PARAMETER`), so every rank holds all parameters for the
next forward pass. Each gradient lives from its producer to its update, as in the
single-process step (the memory passes place the collectives like any other call); nothing
allocates a shard buffer: the reduce-scatter writes into the gradient's own rows.

The rank is an input of the step (``shard_rank``), not a constant, so the program is the same
on every rank and so is the order of its collectives, whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..contract import owned_rows, shard_rows

__all__ = ["ZeroSharding"]


@dataclass(frozen=True)
class ZeroSharding:
    """Optimizer state sharded over ``world_size`` ranks, by blocks of the leading axis.

    Attributes
    ----------
    world_size
        How many ranks share the step (``torch.distributed``'s world size).
    """

    world_size: int

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, not {type(self.world_size).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")

    def state_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one rank's state for a parameter of ``shape`` (a tensor of rank 0 is
        one row)."""
        rows = int(shape[0]) if len(shape) else 1
        return (shard_rows(rows, self.world_size), *(int(d) for d in shape[1:]))

    def shard(self, array: np.ndarray, rank: int) -> np.ndarray:
        """The rows of ``array`` that ``rank`` owns, padded with zeros to the block's rows."""
        rows = array.reshape(1, *array.shape) if array.ndim == 0 else array
        start, stop = owned_rows(rows.shape[0], self.world_size, rank)
        block = np.zeros(self.state_shape(array.shape), array.dtype)
        block[: stop - start] = rows[start:stop]
        return block

    def unshard(self, blocks: Sequence[np.ndarray], shape: Sequence[int]) -> np.ndarray:
        """The whole tensor of ``shape`` from every rank's block (rank order)."""
        if len(blocks) != self.world_size:
            raise ValueError(f"{len(blocks)} blocks for a world of {self.world_size}")
        rows = int(shape[0]) if len(shape) else 1
        parts = [
            block[: stop - start]
            for rank, block in enumerate(blocks)
            for start, stop in [owned_rows(rows, self.world_size, rank)]
        ]
        return np.concatenate(parts).reshape(tuple(shape))

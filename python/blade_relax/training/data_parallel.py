"""Data-parallel training on ``torch.distributed``: one process per rank, the optimizer state
sharded (ZeRO stage 2, :mod:`.sharding`).

:class:`DataParallelTrainer` is a :class:`~.trainer.Trainer` whose step is the sharded step of
:func:`~.step.build_training_step`. Every rank is given the same global batch (as a
``DistributedSampler`` would give each its part, only cut here) and runs the step on its
block of rows (:func:`~blade_relax.contract.owned_rows` of the leading axis); the gradients
are summed over the ranks, each weighted by the rank's share of the loss, so the update is the
one a single process makes on the whole batch:

* with ``labels``, the loss is the mean over the targets that count (not ``-100``, after the
  shift by one position), and a rank's weight is its count over the batch's;
* without, the loss is a mean over rows of equal size, and a rank's weight is its rows over
  the batch's.

The loss a step reports is the batch's (the weighted sum of the ranks' losses). Peak bytes are
this rank's: its parameters (all of them: ZeRO stage 2 shards the state, not the parameters),
its blocks of the optimizer state, the step's inputs it holds across steps, and the most bytes
its step added.

The process group is the caller's (``torch.distributed.init_process_group``: torchrun's
environment, or :func:`init_from_environment`); gloo runs on the CPU, NCCL on GPUs.

Ranks on one machine share its cores: a launcher of this package starts them under
:func:`rank_threads`, which gives each its share as ``OMP_NUM_THREADS`` (torch's intra-op pool,
which runs the dispatched GEMMs, and TVM's thread pool both read it), as torchrun sets it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import tvm

from ..contract import owned_rows
from .sharding import ZeroSharding
from .trainer import IGNORE_INDEX, StepRecord, Trainer, as_batch, check_batch

__all__ = [
    "DataParallelTrainer",
    "LocalBatch",
    "init_from_environment",
    "rank_threads",
    "rank_weights",
    "threads_per_rank",
]


def threads_per_rank(ranks: int) -> int:
    """The cores this process may run on, shared by ``ranks`` processes (at least one each)."""
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks)


@contextlib.contextmanager
def rank_threads(ranks: int) -> Iterator[int]:
    """Within the block, processes started by this one run :func:`threads_per_rank` threads.

    Sets ``OMP_NUM_THREADS`` unless the caller set it (then it is left as it is), and restores
    the environment on exit; yields the number the ranks get. Without it every rank starts one
    thread per core: on 2 cores, 2 ranks measured 2-10x slower steps (theirs and PyTorch's DDP
    and FSDP2 alike) than with one thread each. torchrun sets ``OMP_NUM_THREADS=1`` for the
    same reason; this gives each rank its share of the cores instead.
    """
    given = os.environ.get("OMP_NUM_THREADS")
    threads = threads_per_rank(ranks)
    if given is None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield int(given) if given and given.isdigit() else threads
    finally:
        if given is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def init_from_environment(backend: str = "gloo") -> tuple[int, int]:
    """Join the process group that torchrun's environment describes (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), unless one exists; ``(rank,
    world_size)``. Under ``"nccl"`` the rank's CUDA device is ``LOCAL_RANK`` (default 0)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"no process group and no torchrun environment (missing {', '.join(missing)}): "
                "launch with torchrun or `blade-relax train --nproc N`"
            )
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def rank_weights(
    input_names: Sequence[str], arrays: Sequence[np.ndarray], world_size: int
) -> list[float]:
    """Each rank's share of the loss of the batch ``arrays`` (see the module docstring).

    Raises
    ------
    ValueError
        When the inputs disagree on their leading axis, or a rank would get no row.
    """
    rows = {int(a.shape[0]) for a in arrays if a.ndim}
    if len(rows) != 1:
        raise ValueError(
            f"a data-parallel step cuts every input along its leading axis; they have "
            f"{sorted(rows)} rows"
        )
    (total_rows,) = rows
    if total_rows < world_size:
        raise ValueError(
            f"a batch of {total_rows} rows cannot be shared by {world_size} ranks: give each "
            "rank at least one row"
        )
    blocks = [owned_rows(total_rows, world_size, r) for r in range(world_size)]
    if "labels" in input_names:
        labels = arrays[list(input_names).index("labels")]
        counts = [int((labels[a:b, 1:] != IGNORE_INDEX).sum()) for a, b in blocks]
    else:
        counts = [b - a for a, b in blocks]
    total = sum(counts)
    return [c / total for c in counts]


class LocalBatch(NamedTuple):
    """One rank's part of a global batch (:meth:`DataParallelTrainer.local_batch`)."""

    #: The rank's rows of each input, in the graph's input order.
    arrays: list[np.ndarray]
    #: Their dims (``{"b": rows, "s": length}``).
    dims: dict[str, int]
    #: The rank's share of the batch's loss (:func:`rank_weights`).
    weight: float
    #: The dims every rank chooses its step by: rank 0's rows (the most), the same on every
    #: rank, since all must run one program (its collectives must match).
    common_dims: dict[str, int]


def _group_device() -> Any:
    """Where the default process group's own tensors must live: NCCL reduces CUDA tensors only
    (the current device's), gloo CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DataParallelTrainer(Trainer):
    """A :class:`~.trainer.Trainer` for one rank of a data-parallel run (see the module
    docstring); the parameters take rank 0's values when it is made.

    Takes the arguments of :class:`~.trainer.Trainer`; ``batch`` arguments are the global
    batch, the same on every rank.

    Raises
    ------
    RuntimeError
        When no ``torch.distributed`` process group is initialized.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DataParallelTrainer runs inside a torch.distributed process group: call "
                "torch.distributed.init_process_group (or init_from_environment) first"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        super().__init__(*args, **kwargs)
        self.shard_rank = tvm.runtime.tensor(np.array([self.rank], "int64"), self.device)
        self.persistent_bytes += self.shard_rank.numpy().nbytes
        for param in self.params:  # every rank starts from rank 0's parameters
            dist.broadcast(torch.from_dlpack(param), src=0)

    def _device_index(self) -> int:
        """Under NCCL, the rank's current CUDA device (``torch.cuda.set_device``, which
        :func:`init_from_environment` makes ``LOCAL_RANK``); 0 otherwise."""
        device = _group_device()
        return device.index if device.type == "cuda" else 0

    def _sharding(self) -> ZeroSharding:
        import torch.distributed as dist

        return ZeroSharding(dist.get_world_size())

    def local_batch(self, batch: Any) -> LocalBatch:
        """This rank's rows of the global ``batch`` (checked first), their dims and the rank's
        share of the loss.

        Every rank checks the whole batch, so a bad one is refused on every rank alike, before
        any collective (a rank that raised alone would leave the others waiting in one).

        Raises
        ------
        ValueError
            Besides :func:`~.trainer.check_batch`'s errors, when some rank's rows count no
            target (every label ``-100`` after the shift): its step's mean loss would be 0 / 0.
        """
        arrays = as_batch(self.graph, batch)
        check_batch(self.graph, arrays)
        weights = rank_weights(self.graph.input_names, arrays, self.world_size)
        rows = int(arrays[0].shape[0])
        empty = [r for r, weight in enumerate(weights) if weight == 0]
        if empty:
            start, stop = owned_rows(rows, self.world_size, empty[0])
            raise ValueError(
                f"rank {empty[0]}'s rows {start}:{stop} of the batch count no target (every "
                f"label {IGNORE_INDEX} after the first position): each rank's step needs one; "
                "mix such rows with others or give fewer ranks"
            )
        # The global batch is checked: its rows need their dims only.
        start, stop = owned_rows(rows, self.world_size, self.rank)
        local = [np.ascontiguousarray(a[start:stop]) for a in arrays]
        first, last = owned_rows(rows, self.world_size, 0)
        common = self.graph.bind_dims([a[first:last] for a in arrays])
        return LocalBatch(local, self.graph.bind_dims(local), weights[self.rank], common)

    def predicted_batch_peak(self, batch: Any) -> int:
        """This rank's full-step peak on the global ``batch``, predicted (see
        :meth:`Trainer.predicted_peak`): at its own rows, by the step every rank runs."""
        local = self.local_batch(batch)
        placement = self.placement_for(local.common_dims)
        return self.predicted_peaks(local.dims)[placement]

    def step(self, batch: Any, budget: int | float | None = None) -> StepRecord:
        """Run one step on this rank's rows of the global ``batch``; the record's loss is the
        batch's, its bytes this rank's (see :meth:`Trainer.step`)."""
        import dataclasses

        import torch
        import torch.distributed as dist

        local = self.local_batch(batch)
        # With updates="auto" every rank runs the placement chosen for the same dims.
        placement = self.placement_for(local.common_dims)
        record = self._run(
            local.arrays, local.dims, [local.weight, self.shard_rank], budget, placement
        )
        loss = torch.tensor(
            [record.loss * local.weight], dtype=torch.float64, device=_group_device()
        )
        dist.all_reduce(loss)
        return dataclasses.replace(record, loss=float(loss[0]))

    def full_state(self) -> list[np.ndarray]:
        """The whole optimizer state (every rank's blocks, gathered; a collective: every rank
        calls it), in ``step_ir.state_names`` order."""
        import torch
        import torch.distributed as dist

        sharding = self.step_ir.sharding
        trainable = self.graph.params[: self.graph.num_trainable]
        n_state = len(self.optimizer.state_names)
        out = []
        device = _group_device()
        for i, block in enumerate(self.state()):
            mine = torch.from_numpy(block).to(device)
            blocks = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(blocks, mine)
            shape = np.asarray(trainable[i // n_state]).shape
            out.append(sharding.unshard([b.cpu().numpy() for b in blocks], shape))
        return out

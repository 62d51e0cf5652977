"""Data-parallel training in PyTorch: what :class:`~.data_parallel.DataParallelTrainer` is
compared with.

:func:`torch_data_parallel_fit` runs one rank of ``torch.distributed`` data parallelism on a
copy of the graph's torch model (from ``graph.params``, as :func:`~.torch_loop.torch_fit`
does), each rank on its block of rows of the same global batch (:func:`~blade_relax.contract.
owned_rows`), in one of two modes:

``"ddp"``
    ``DistributedDataParallel`` (gradients all-reduced in buckets, every rank holding all
    parameters, gradients and the whole AdamW state), with ``gradient_as_bucket_view=True``:
    the gradients are views of the reducer's buckets, no copy (the most favourable setting for
    its memory).
``"fsdp2"``
    ``torch.distributed.fsdp.fully_shard`` on each layer of every ``ModuleList`` and on the
    root, with ``reshard_after_forward=False``: the parameters are all-gathered in the forward
    and kept until the backward is done, each gradient reduce-scattered, 1/N of the parameters
    and of the AdamW state held between steps: FSDP2's counterpart of ZeRO stage 2.

Both average the gradients over the ranks (DDP divides the all-reduced sum by N, FSDP2 its
reduce-scatter likewise), so each rank's loss is scaled by ``weight * N``, ``weight`` the rank's
share of the batch's loss (:func:`~.data_parallel.rank_weights`): the update is the one a
single process makes on the whole batch, and the loss a step reports is the batch's (the
weighted sum over the ranks, all-reduced).

Peak bytes per step are counted as :func:`~.torch_loop.torch_fit` counts them, for this rank:
the bytes it holds across steps (its parameters, its optimizer state once it exists, and for
DDP the reducer's buckets, which hold every gradient) plus the most bytes the step allocated
(:class:`~.torch_memory.LiveBytesCounter`). FSDP2 frees and re-allocates the storage of the
gathered parameters by resizing it (``untyped_storage().resize_``), which no ATen op shows:
its ``alloc_storage`` / ``free_storage`` are wrapped while a step runs so that the counter
sees each resize as the allocation or the release it is.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..contract import owned_rows
from ..frontend.imported import ImportedGraph
from .data_parallel import rank_weights
from .optimizers import InPlaceOptimizer
from .torch_loop import model_copy, torch_optimizer
from .trainer import History, StepRecord, as_batch, check_batch

__all__ = ["MODES", "torch_data_parallel_fit"]

#: The PyTorch data-parallel modes, by the label of their runs.
MODES = {"ddp": "torch-ddp", "fsdp2": "torch-fsdp2"}


def _model_copy(graph: ImportedGraph) -> Any:
    """A copy of the graph's torch module holding ``graph.params``."""
    if graph.torch_module is None or graph.torch_params is None:
        raise ValueError("the graph was not imported from torch: there is no torch loop to run")
    return model_copy(graph)[0]


def _local(tensor: Any) -> Any:
    """The tensor a rank holds: a ``DTensor``'s local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _distinct_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of ``DTensor``\\ s)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in seen.items() if ptr)


def _held_bytes(module: Any, opt: Any, buckets: int) -> int:
    """What the rank holds across steps: parameters (trainable and frozen), optimizer state,
    ``buckets`` (DDP's)."""
    import torch

    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _distinct_bytes(module.parameters()) + _distinct_bytes(state) + buckets


def _layers(module: Any) -> list[Any]:
    """The entries of every ``ModuleList`` (a decoder's layers), the units FSDP2 shards."""
    import torch

    return [
        layer for sub in module.modules() if isinstance(sub, torch.nn.ModuleList) for layer in sub
    ]


def _wrap(module: Any, mode: str) -> tuple[Any, int]:
    """``module`` under ``mode``, and the bytes of DDP's buckets (0 for FSDP2)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        trainable = [p for p in module.parameters() if p.requires_grad]
        wrapped = DistributedDataParallel(module, gradient_as_bucket_view=True)
        # Every trainable parameter's gradient lives in one of the buckets, packed.
        return wrapped, sum(p.numel() * p.element_size() for p in trainable)
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(module):
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(module, reshard_after_forward=False)
    return module, 0


@contextlib.contextmanager
def _resizes_counted(counter: Any, mode: str) -> Iterator[None]:
    """While active, FSDP2's storage resizes add to / take from ``counter``'s live bytes."""
    if mode != "fsdp2":
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def counted(resize: Any) -> Any:
        def run(tensor: Any) -> None:
            before = tensor.untyped_storage().nbytes()
            resize(tensor)
            counter.live_bytes += tensor.untyped_storage().nbytes() - before
            counter.peak_bytes = max(counter.peak_bytes, counter.live_bytes)

        return run

    modules = (_fsdp_param, _fsdp_param_group)
    originals = [
        (m, name, getattr(m, name))
        for m in modules
        for name in vars(m)
        if name in ("alloc_storage", "free_storage")
    ]
    for m, name, function in originals:
        setattr(m, name, counted(function))
    try:
        yield
    finally:
        for m, name, function in originals:
            setattr(m, name, function)


def torch_data_parallel_fit(
    graph: ImportedGraph,
    optimizer: InPlaceOptimizer,
    batches: Iterable[Any],
    steps: int | None = None,
    *,
    mode: str = "ddp",
) -> History:
    """Run this rank's PyTorch data-parallel loop for ``graph``'s model (see the module
    docstring), inside an initialized ``torch.distributed`` process group.

    Parameters
    ----------
    graph
        A training graph imported from torch with a dynamic batch axis (each rank runs its
        rows of the global batch).
    optimizer
        The blade_relax optimizer whose ``torch.optim`` counterpart runs.
    batches, steps
        The global batches (the same on every rank) and how many to run (all when ``None``).
    mode
        ``"ddp"`` or ``"fsdp2"`` (:data:`MODES`).

    Returns
    -------
    History
        Labelled ``torch-ddp`` / ``torch-fsdp2``: per step the batch's loss, this rank's peak
        bytes and step time; ``parameters``, the final parameters (whole, gathered).

    Raises
    ------
    ValueError
        For an unknown ``mode`` or a graph without a torch module.
    RuntimeError
        When no process group is initialized.
    """
    import torch
    import torch.distributed as dist

    from .torch_memory import LiveBytesCounter

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch_data_parallel_fit runs inside a torch.distributed process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = _model_copy(graph)
    model, buckets = _wrap(module, mode)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch_optimizer(optimizer, params)
    history = History(label=MODES[mode])
    for count, batch in enumerate(batches, start=1):
        if steps is not None and count > steps:
            break
        arrays = as_batch(graph, batch)
        dims = check_batch(graph, arrays)
        weight = rank_weights(graph.input_names, arrays, world)[rank]
        start, stop = owned_rows(int(arrays[0].shape[0]), world, rank)
        local = [np.ascontiguousarray(a[start:stop]) for a in arrays]
        check_batch(graph, local)
        tensors = [torch.from_numpy(a) for a in local]
        for group in opt.param_groups:
            group["lr"] = optimizer.lr_at(count)
        opt.zero_grad(set_to_none=True)
        if mode == "ddp" and model.reducer._rebuild_buckets():
            # What DDP's forward does once, on the second step, before anything is measured:
            # new buckets in the order the gradients came, the old ones released.
            model._has_rebuilt_buckets = True
        gc.collect()
        held = _held_bytes(module, opt, buckets)
        counter = LiveBytesCounter()
        begin = time.perf_counter()
        with counter, _resizes_counted(counter, mode):
            (loss,) = model(*tensors)
            (loss * (weight * world)).backward()
            opt.step()
        elapsed = time.perf_counter() - begin
        counter.detach_all()
        total = torch.tensor([float(loss.detach()) * weight], dtype=torch.float64)
        dist.all_reduce(total)
        history.records.append(
            StepRecord(
                step=count,
                length=int(dims.get("s", arrays[0].shape[-1])),
                loss=float(total[0]),
                peak_bytes=held + int(counter.peak_bytes),
                step_peak_bytes=int(counter.peak_bytes),
                time_s=elapsed,
            )
        )
        del loss
    history.persistent_bytes = _held_bytes(module, opt, buckets)
    history.parameters = [  # type: ignore[attr-defined]
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
        for p in params
    ]
    return history

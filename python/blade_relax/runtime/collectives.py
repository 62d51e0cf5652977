"""Collectives on ``torch.distributed``: the packed functions a data-parallel step calls.

A sharded training step (:func:`blade_relax.training.build_training_step` with a
:class:`~blade_relax.training.ZeroSharding`) calls :data:`~blade_relax.contract.REDUCE_GRADIENT`
once per gradient and :data:`~blade_relax.contract.GATHER_PARAMETER` once per updated
parameter, both in place (``call_inplace_packed``). Each runs one collective of
``torch.distributed``'s default process group (gloo on the CPU, NCCL on GPUs: whatever the
caller initialized) on a zero-copy DLPack view of the VM's tensor. Nothing is allocated as a
tensor: the reduce-scatter writes its result into the rows this rank owns of the gradient
itself (the in-place form NCCL documents, and gloo computes the same), the all-gather reads the
rows this rank owns of the parameter and writes the others. The communication library may use
scratch memory of its own while a call runs, as it does under PyTorch's DDP and FSDP.

Why ``torch.distributed`` and not TVM's Disco: Disco's collectives need NCCL or RCCL (there is
no CPU backend), and the users of a data-parallel step already run ``torch.distributed``
(torchrun, DDP, FSDP); the step joins the process group they made.

When a leading axis does not split evenly, the gradient is all-reduced instead (twice the
traffic, no buffer) and the parameter's blocks are broadcast one by one from their owners.

The functions are registered when this module is imported, if PyTorch can be imported; torch
is imported at the first call. Nothing here imports a pass: the IR names the functions
(:mod:`blade_relax.contract`).
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi

from ..contract import GATHER_PARAMETER, REDUCE_GRADIENT, owned_rows
from .gemm import torch_found

__all__ = ["register_collectives"]


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a data-parallel step runs inside a torch.distributed process group: call "
            "torch.distributed.init_process_group first (torchrun and `blade-relax train "
            "--nproc` do)"
        )
    return dist


def _rows(tensor: Any) -> Any:
    """``tensor`` as a matrix of its leading axis (a tensor of rank 0 is one row), a view."""
    return tensor.reshape(1, -1) if tensor.dim() == 0 else tensor.view(tensor.shape[0], -1)


def _collective(dist: Any, name: str) -> Any:
    """``torch.distributed``'s single-tensor collective (renamed in torch 2.12)."""
    legacy = {"reduce_scatter_single": "reduce_scatter_tensor"}
    legacy["all_gather_single"] = "all_gather_into_tensor"
    return getattr(dist, name, None) or getattr(dist, legacy[name])


def reduce_gradient(grad: Any, weight: float) -> Any:
    """Sum ``weight * grad`` over the ranks into the rows this rank owns (in place)."""
    import torch

    dist = _dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    view = torch.from_dlpack(grad)
    if weight != 1.0:
        view.mul_(weight)
    rows = _rows(view)
    start, stop = owned_rows(rows.shape[0], world, rank)
    if world > 1 and rows.shape[0] % world == 0:
        flat = rows.view(-1)
        width = rows.shape[1]
        _collective(dist, "reduce_scatter_single")(flat[start * width : stop * width], flat)
    elif world > 1:
        dist.all_reduce(view)
    return grad


def gather_parameter(param: Any) -> Any:
    """Fill every row of ``param`` from the rank that owns it (in place)."""
    import torch

    dist = _dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return param
    rows = _rows(torch.from_dlpack(param))
    if rows.shape[0] % world == 0:
        flat = rows.view(-1)
        start, stop = owned_rows(rows.shape[0], world, rank)
        width = rows.shape[1]
        _collective(dist, "all_gather_single")(flat, flat[start * width : stop * width])
        return param
    for owner in range(world):
        start, stop = owned_rows(rows.shape[0], world, owner)
        if stop > start:
            dist.broadcast(rows[start:stop], src=owner)
    return param


def register_collectives() -> bool:
    """Register :data:`REDUCE_GRADIENT` and :data:`GATHER_PARAMETER` if torch is found, else
    remove them; whether they are registered (runs on import)."""
    functions = {REDUCE_GRADIENT: reduce_gradient, GATHER_PARAMETER: gather_parameter}
    if torch_found():
        for name, function in functions.items():
            tvm.register_global_func(name, function, override=True)
        return True
    for name in functions:
        if tvm.get_global_func(name, allow_missing=True) is not None:
            tvm_ffi.remove_global_func(name)
    return False


register_collectives()

"""Names the passes write into a module and the runtime reads back, each defined once here.

The compiler side (``transform/``) and the runtime side (``runtime/``) meet only through what an
executable carries: calls of packed functions by name, function attributes, and the remat
metadata JSON. This package is that contract. It imports nothing but the standard library, so
either side (and a user's tool that reads a compiled module) can use it without pulling in the
other.

Packed functions (registered by :mod:`blade_relax.runtime.remat`, called from the IR that
:class:`~blade_relax.transform.Rematerialize` writes):

* :data:`REMAT_BEGIN` ``(key, metadata, dims, release, *regenerators) -> frame``: one frame per
  call of a rematerialized function; decides, from the concrete dims and the thread's memory
  budget, which slots are evicted.
* :data:`EVICT` ``(frame, slot, tensor)``: drop the tensor (when the decision says so) or keep
  it in the frame until its ``regenerate``.
* :data:`REGENERATE` ``(frame, slot, *inputs) -> tensor``: the kept tensor, or a recomputed one.
* :data:`REMAT_ACTIVE` ``() -> bool``: whether this thread has a memory budget (a dispatcher
  calls the rewritten copy then, the plain one otherwise).

Packed functions registered by :mod:`blade_relax.runtime.gemm` (when PyTorch is installed) and
called from the IR that :class:`~blade_relax.transform.DispatchGemm` writes:

* :data:`GEMM_FUNCS` ``[layout]`` ``(a, b, out)``: ``out = op_a(a) @ op_b(b)``, written into
  ``out`` (destination passing, as the kernel call it replaces), ``op`` the identity (``N``) or the swap of the last
  two axes (``T``), for ``layout`` in :data:`GEMM_LAYOUTS` (``"NT"``: ``a @ b^T``). Batch axes
  are equal in ``a``, ``b`` and ``out``, or ``b`` is two-dimensional and ``a`` is not
  transposed (its batch axes are rows of one GEMM). ``out`` is the VM's tensor: nothing else
  is allocated as a tensor.

Packed functions registered by :mod:`blade_relax.runtime.collectives` (when PyTorch is
installed) and called from a data-parallel training step
(:func:`blade_relax.training.build_training_step` with a
:class:`~blade_relax.training.ZeroSharding`), each an in-place call
(``call_inplace_packed``) on ``torch.distributed``'s default process group. A tensor's shard is
a block of its leading axis: rank ``r`` of ``N`` owns rows ``[r * k, min((r + 1) * k, rows))``,
``k = ceil(rows / N)`` (a tensor of rank 0 is one row):

* :data:`REDUCE_GRADIENT` ``(grad, weight) -> grad``: afterwards the rows this rank owns hold
  ``sum over ranks of weight * grad`` (``weight`` a float, this rank's share of the loss); the
  other rows are scratch.
* :data:`GATHER_PARAMETER` ``(param) -> param``: afterwards every row holds what its owner
  wrote there.

Function attributes:

* :data:`GEMM_KERNEL_ATTR`: on a kernel that is a GEMM, what ``MarkGemmKernels`` recognized
  before a GPU schedule rewrote it (``"<layout>:<rank a>,<rank b>,<rank c>:<dtype>:<buffer
  positions>"``), for ``DispatchGemm`` after planning.
* :data:`ELEMENTWISE_KERNEL_ATTR`: on a kernel whose one block updates buffers in place, each
  iteration reading and writing only its own elements (the optimizers' update kernels);
  ``BindElementwiseKernels`` gives such a kernel its GPU threads, which dlight cannot.
* :data:`SOFTMAX_KERNEL_ATTR`: on a kernel that ``VectorizeSoftmax`` rewrote, the axis of the
  softmax it computes (its body no longer reads as topi's softmax); ``RecomputeCheapValues``
  recognizes attention probabilities by it.
* :data:`REMAT_META_ATTR`: the metadata JSON of a rematerialized function
  (:class:`RematMetadata`, format :data:`REMAT_FORMAT`: :mod:`.remat_metadata`).
* :data:`REMAT_REGEN_ATTR`: ``"<function>/<slot>"`` on a regeneration function.
* :data:`REMAT_RELEASE_ATTR`: on the module's no-op release function.
* :data:`REMAT_COPY_ATTR`: ``{"of": <dispatcher>, "budget": 0 | 1}`` on the two copies a remat
  dispatcher chooses from.
* :data:`NO_PLAN_ATTR`: variables whose allocation keeps a storage of its own (the memory
  planners must not share it: the remat runtime may hold it across its last use).
* :data:`SCHEDULE_VERSION_ATTR`: ``{"of": <function>, <dim>: [lo, hi]}`` on a range copy made
  by :class:`~blade_relax.transform.MemoryAwareSchedule`.
* :data:`CHECKED_DIMS_ATTR`: the dims whose range :class:`~blade_relax.transform.CheckDimRanges`
  already asserts in a function.
* :data:`UPPER_BOUND_ATTR`, :data:`LOWER_BOUND_ATTR`: TVM's own per-function dim bounds,
  read by TVM's memory planner and by ours.
* :data:`LENGTH_BUCKET_ATTR`: ``{"of": <function>, <dim>: <length>}`` on a static copy made
  by :class:`~blade_relax.transform.SpecializeBuckets`, named
  :func:`bucket_function_name`; :class:`blade_relax.runtime.cuda_graphs.BucketedRunner` calls
  it by that name.

CUDA graphs (TVM's, read by :mod:`blade_relax.runtime.cuda_graphs`): a module built with the
PassContext option :data:`CUDA_GRAPH_OPTION` has its captured regions launched through
:data:`CUDA_GRAPH_RUN` and its static storages in one function, :data:`CUDA_GRAPH_ALLOC`.

Data formats, each in a module of this package:

* :mod:`.dimexpr`: the integer expressions over dims that the compiler writes and the runtime
  evaluates (sizes, costs), with their one evaluator;
* :mod:`.remat_metadata`: the remat metadata (:class:`RematMetadata`), its JSON and its
  version :data:`REMAT_FORMAT`.
"""

from __future__ import annotations

import hashlib

from .remat_metadata import (
    REMAT_FORMAT,
    PlanNode,
    RematFormatError,
    RematMetadata,
    RematSlot,
)

__all__ = [
    "CHECKED_DIMS_ATTR",
    "COLLECTIVE_FUNCS",
    "EVICT",
    "GATHER_PARAMETER",
    "GEMM_FUNCS",
    "ELEMENTWISE_KERNEL_ATTR",
    "GEMM_KERNEL_ATTR",
    "GEMM_LAYOUTS",
    "CUDA_GRAPH_ALLOC",
    "CUDA_GRAPH_OPTION",
    "CUDA_GRAPH_RUN",
    "LENGTH_BUCKET_ATTR",
    "LOWER_BOUND_ATTR",
    "NO_PLAN_ATTR",
    "PlanNode",
    "REDUCE_GRADIENT",
    "REGENERATE",
    "REMAT_ACTIVE",
    "REMAT_BEGIN",
    "REMAT_COPY_ATTR",
    "REMAT_FORMAT",
    "REMAT_META_ATTR",
    "REMAT_REGEN_ATTR",
    "REMAT_RELEASE_ATTR",
    "SCHEDULE_VERSION_ATTR",
    "SOFTMAX_KERNEL_ATTR",
    "UPPER_BOUND_ATTR",
    "RematFormatError",
    "RematMetadata",
    "RematSlot",
    "bucket_function_name",
    "metadata_key",
    "owned_rows",
    "shard_rows",
]

# ----------------------------------------------------------------------- packed functions
REMAT_BEGIN = "blade_relax.remat_begin"
EVICT = "blade_relax.evict"
REGENERATE = "blade_relax.regenerate"
REMAT_ACTIVE = "blade_relax.remat_active"
#: The layouts of a GEMM's operands: ``N`` as stored, ``T`` with the last two axes swapped.
GEMM_LAYOUTS = ("NN", "NT", "TN", "TT")
GEMM_FUNCS = {layout: f"blade_relax.gemm_{layout}" for layout in GEMM_LAYOUTS}
REDUCE_GRADIENT = "blade_relax.dist.reduce_gradient"
GATHER_PARAMETER = "blade_relax.dist.gather_parameter"
#: The collectives: a binding that calls one runs on every rank in the same order, exactly
#: once (never recomputed, never skipped).
COLLECTIVE_FUNCS = frozenset({REDUCE_GRADIENT, GATHER_PARAMETER})

# --------------------------------------------------------------------- function attributes
#: A GEMM kernel's recognized form, kept through a GPU schedule (see the list above).
GEMM_KERNEL_ATTR = "blade_relax.gemm_kernel"
ELEMENTWISE_KERNEL_ATTR = "blade_relax.elementwise_inplace"
SOFTMAX_KERNEL_ATTR = "blade_relax.softmax_axis"
REMAT_META_ATTR = "blade_relax.remat"
REMAT_REGEN_ATTR = "blade_relax.remat_regen"
REMAT_RELEASE_ATTR = "blade_relax.remat_release"
REMAT_COPY_ATTR = "blade_relax.remat_copy"
NO_PLAN_ATTR = "blade_relax.no_plan"
SCHEDULE_VERSION_ATTR = "blade_relax.schedule_version"
CHECKED_DIMS_ATTR = "blade_relax.checked_dims"
UPPER_BOUND_ATTR = "tir_var_upper_bound"
LOWER_BOUND_ATTR = "tir_var_lower_bound"
LENGTH_BUCKET_ATTR = "blade_relax.length_bucket"

# ------------------------------------------------------------------------------ CUDA graphs
#: TVM's PassContext option that makes ``RewriteCUDAGraph`` rewrite (registered in C++).
CUDA_GRAPH_OPTION = "relax.backend.use_cuda_graph"
#: The function ``RewriteCUDAGraph`` lifts every static storage of the module into.
CUDA_GRAPH_ALLOC = "cuda_graph_alloc"
#: The VM builtin that replays a captured region (capturing it on its first call).
CUDA_GRAPH_RUN = "vm.builtin.cuda_graph.run_or_capture"


def bucket_function_name(function: str, dim: str, length: int) -> str:
    """The name of the static copy of ``function`` with ``dim`` bound to ``length``."""
    return f"{function}_{dim}{int(length)}"


def metadata_key(function: str, text: str) -> str:
    """The key a function's remat metadata is cached under: its name and a digest of the JSON."""
    return f"{function}:{hashlib.sha1(text.encode()).hexdigest()[:16]}"


# ----------------------------------------------------------------------- data parallelism
def shard_rows(rows: int, world_size: int) -> int:
    """Rows of the leading axis each of ``world_size`` ranks owns: ``ceil(rows / world_size)``
    (the last ranks' blocks may be short or empty)."""
    if world_size < 1:
        raise ValueError(f"a world has at least one rank, not {world_size}")
    return -(-max(rows, 0) // world_size)


def owned_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a leading axis of ``rows`` that ``rank`` owns."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    k = shard_rows(rows, world_size)
    return min(rank * k, rows), min((rank + 1) * k, rows)

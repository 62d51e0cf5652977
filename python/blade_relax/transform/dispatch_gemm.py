"""DispatchGemm: GEMM kernels run on a vendor BLAS (ATen's), in the buffers TVM planned for them.

TVM's CPU code for a matmul with a symbolic dimension is a naive loop nest (dlight has GEMV and
reduction rules on the CPU, no GEMM rule), and the PyPI wheel is built without cBLAS, DNNL or
cuBLAS, so TVM's BYOC dispatch to a vendor library is not there. This pass is that dispatch for
the kernels that are a GEMM, alone or followed by an elementwise tail: each call of a GEMM
kernel becomes a call of the packed function :data:`~blade_relax.contract.GEMM_FUNCS` ``[layout]`` with the same arguments, which
:mod:`blade_relax.runtime.gemm` runs with ``torch.mm`` / ``torch.bmm`` on zero-copy DLPack views
and writes into the output buffer the VM allocated.

Why at the end of the memory stage, not before legalization (where TVM's BYOC runs)
---------------------------------------------------------------------------------
The swap is made after memory planning (``PlanMemory`` or ``StaticPlanBlockMemory``),
``KillAfterLastUse`` and ``RematTimeline``, on the destination-passing calls ``CallTIRRewrite``
wrote (``cls.matmul(a, b, out)``), so every decision about memory was taken on TVM's kernels and
the swap changes none of them: same allocations, same sharing, same kills, same remat timeline.
(Rewriting ``relax.matmul`` before legalization instead takes every GEMM out of fusion; measured
on the benchmark's workloads, that raised the predicted peaks of the full pipeline by up to
10%.)

GEMMs with an epilogue
----------------------
A GEMM that ``FuseOps`` fused with an elementwise tail (``matmul -> add -> gelu``, a ReLU's
backward ``where(x < 0, 0, dy @ w^T)``) is one kernel whose GEMM result is an intermediate that
``InlineKernelIntermediates`` already reduced to one element at a time. Such a kernel is split:
ATen's GEMM writes its result into the kernel's output, then the kernel without its GEMM block
(``<kernel>_epilogue``, a TVM kernel) reads each element there and overwrites it with the tail's
value. No tensor is added, so what fusion saved stays saved. One case needs a decision per call
site: when planning wrote the output over a tensor the tail reads (an in-place placement), the
GEMM written first would overwrite that tensor before the tail reads it. There the GEMM's result
gets a tensor of its own (``<kernel>_epilogue_from`` reads it), live only during the call, if
the function's symbolic timeline proves that the bytes live then plus that tensor stay at or
below the function's peak for every admissible value of the dims; otherwise the fused kernel
stays TVM's (``GemmReport.kept_in_place``), as it does in functions that rematerialize (their
runtime plans from metadata written before this pass). Peaks are therefore never above those
of the undispatched program, and below them where a fused kernel held a workspace.

Stages
------
1. *Recognize* (per PrimFunc, remembered): a kernel of exactly one block besides the root, with
   three buffer parameters ``A, B, C`` of one dtype among ``dtypes`` (and any integer scalar
   parameters: the symbolic sizes TVM passes when a buffer's shape is an expression such as
   ``b * s``, which the GEMM reads from the tensors instead), whose block is
   ``C[b.., i, j] = 0; C[b.., i, j] += A[..] * B[..]`` over one reduction variable ``k``;
   ``A`` read at ``[b.., i, k]`` (``N``) or ``[b.., k, i]`` (``T``), ``B`` at ``[b.., k, j]``
   or ``[b.., j, k]``. The batch indices of an operand are all of ``C``'s, or none (a
   two-dimensional operand); a broadcast batch axis is not recognized. This is what TVM's
   legalized ``relax.matmul`` and ``SimplifyTransposes``' ``NT_matmul`` / ``TN_matmul`` /
   ``TT_matmul`` kernels are. With an epilogue: two blocks, that GEMM block writing an
   intermediate of the kernel, then a block of spatial iteration variables spanning the
   output's shape that stores ``out[v..]`` and reads the intermediate only at ``[v..]``.
2. *Accept* what the runtime computes without a copy: the right operand two-dimensional and the
   left one two-dimensional or not transposed (its batch axes become rows of one GEMM), or both
   batched (``batched``); transposed operands only with ``transposed``.
3. *Swap*: each call ``kernel(a, b, out)`` of a Relax function (``kernel(a, b, n, m, out)``
   with scalar sizes) becomes ``ExternFunc(GEMM_FUNCS[layout])(a, b, out)``; a kernel with an
   epilogue becomes that call followed by its tail's (see above); kernels no function refers
   to any more are removed.

Where it runs
-------------
In :func:`blade_relax.get_pipeline` (``dispatch_gemm``, on by default): in the ``finalize``
phase, after ``KillAfterLastUse`` (and ``RematTimeline``), before ``LowerRuntimeBuiltin``. It
needs the lowered, planned form (no ``call_tir`` left); on a module that still has ``call_tir``
it changes nothing. On CUDA targets dlight has scheduled every kernel by then, so a GEMM is known
by what ``MarkGemmKernels`` recorded before (mark_gemm_kernels.py), and only GEMMs without a
tail are dispatched (cuBLAS, through ATen); a kernel with an epilogue stays dlight's. A GEMM in
a region a CUDA graph captures (a function ``RewriteCUDAGraph`` lifted, when the PassContext
sets ``relax.backend.use_cuda_graph``) stays TVM's kernel too: ATen launches on PyTorch's
stream, which the capture does not record, so the replayed graph would run without it
(``GemmReport.kept_captured``).

What it assumes
---------------
The packed functions are registered (PyTorch installed, see :mod:`blade_relax.runtime.gemm`)
in the process that compiles the module and in the one that runs it. When they are not, the
pass changes nothing and says once per process, in one logged line, that GEMMs are not
dispatched.

Numerics: ATen's GEMMs sum in another order (blocked, vectorized) than TVM's loop nest, so
results agree to rounding (relative errors about 1e-6 in float32), not bit for bit. A
function's two versions under ``Rematerialize`` (``f__plain``, ``f__remat``) are planned apart:
where the rematerializing one keeps a GEMM-with-epilogue call whole (its output planned over an
operand, see above) and the plain one splits it, a step under a budget agrees with the step
without one to rounding, not bit for bit (``python -m blade_relax.bench.remat_quality`` says,
per budget, whether they are bitwise equal).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..analysis import memory_timeline
from ..analysis.cuda_graph_pool import captured_functions
from ..analysis.tir_fields import type_key
from ..contract import EVICT, GEMM_FUNCS, GEMM_KERNEL_ATTR, REGENERATE, REMAT_BEGIN
from ..symbolic import is_integer
from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish, snapshot

__all__ = [
    "NOT_DISPATCHED",
    "DispatchGemm",
    "GemmOptions",
    "GemmReport",
    "gemm_functions_registered",
    "gemm_layout",
]

_LOG = logging.getLogger("blade_relax")
#: Whether this process was told that GEMMs are not dispatched (told once).
_TOLD = False
NOT_DISPATCHED = (
    "DispatchGemm: GEMMs are not dispatched (PyTorch is not installed): TVM's kernels compute them"
)
_REDUCE = 2  # IterVar.iter_type of a commutative reduction


@dataclass(frozen=True)
class GemmOptions:
    """Options of :class:`DispatchGemm`.

    Attributes
    ----------
    transposed
        Dispatch GEMMs reading a transposed operand (``NT``, ``TN``, ``TT``).
    batched
        Dispatch GEMMs whose operands both have batch axes (``torch.bmm``); off, only GEMMs
        with a two-dimensional right operand are dispatched.
    dtypes
        The element types dispatched.
    epilogues
        Split kernels that are a GEMM followed by an elementwise tail: the GEMM on ATen into
        the kernel's output, then the tail in place (see the module docstring).
    """

    transposed: bool = True
    batched: bool = True
    dtypes: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")
    epilogues: bool = True


@dataclass
class GemmReport:
    """What one run of the pass changed, summed over the module's functions.

    Attributes
    ----------
    dispatched
        Layout (``"NN"``, ``"NT"``, ...) -> kernel calls now calling the packed function.
    epilogues
        Layout -> calls of GEMM-with-epilogue kernels split into the packed GEMM and the
        kernel's tail.
    kept
        Calls of GEMM kernels (with or without an epilogue) left to TVM: a layout, rank or
        dtype the options exclude.
    kept_in_place
        Calls of GEMM-with-epilogue kernels left to TVM because their output is placed over a
        tensor the kernel reads and a tensor of its own for the GEMM's result is not proven to
        leave the function's peak where it is.
    temporaries
        Calls among ``epilogues`` whose GEMM result got a tensor of its own.
    kept_captured
        Calls of GEMM kernels left to TVM because a CUDA graph captures them.
    """

    dispatched: dict[str, int] = field(default_factory=dict)
    epilogues: dict[str, int] = field(default_factory=dict)
    kept: int = 0
    kept_in_place: int = 0
    temporaries: int = 0
    kept_captured: int = 0

    @property
    def total(self) -> int:
        """Calls whose GEMM runs on ATen (plain GEMMs and epilogue kernels)."""
        return sum(self.dispatched.values()) + sum(self.epilogues.values())


@dataclass(frozen=True)
class GemmKernel:
    """A kernel recognized as a GEMM: its layout, ranks and dtype, and where its three buffers
    stand among its parameters (the others are scalar sizes)."""

    layout: str
    ranks: tuple[int, int, int]  # A, B, C
    dtype: str
    buffers: tuple[int, int, int] = (0, 1, 2)

    def encode(self) -> str:
        """The kernel's :data:`~blade_relax.contract.GEMM_KERNEL_ATTR` value."""
        ranks = ",".join(map(str, self.ranks))
        return f"{self.layout}:{ranks}:{self.dtype}:{','.join(map(str, self.buffers))}"

    @classmethod
    def decode(cls, text: str) -> GemmKernel:
        """The kernel an :meth:`encode` string describes."""
        layout, ranks, dtype, buffers = str(text).split(":")
        a, b, c = (int(x) for x in ranks.split(","))
        i, j, k = (int(x) for x in buffers.split(","))
        return cls(layout, (a, b, c), dtype, (i, j, k))


def gemm_functions_registered() -> bool:
    """Whether every packed function of :data:`GEMM_FUNCS` is registered in this process."""
    return all(tvm.get_global_func(n, allow_missing=True) is not None for n in GEMM_FUNCS.values())


# ------------------------------------------------------------------------------ recognize
_KERNELS: dict[Any, GemmKernel | None] = {}


def gemm_layout(func: tvm.tirx.PrimFunc) -> GemmKernel | None:
    """What ``func`` computes if it is a GEMM and nothing else (see the module docstring),
    else ``None``: what ``MarkGemmKernels`` recorded before a GPU schedule rewrote the kernel
    (:data:`~blade_relax.contract.GEMM_KERNEL_ATTR`), else what its blocks show. Remembered per
    kernel (kernels are immutable)."""
    if func in _KERNELS:
        return _KERNELS[func]
    marked = func.attrs.get(GEMM_KERNEL_ATTR) if func.attrs is not None else None
    try:
        kernel = GemmKernel.decode(marked) if marked is not None else _recognize(func)
    except Exception:  # noqa: BLE001 - a kernel the schedule cannot read is no GEMM to us
        kernel = None
    _KERNELS[func] = kernel
    return kernel


def _recognize(func: tvm.tirx.PrimFunc) -> GemmKernel | None:
    # In TVM 0.27 a buffer parameter is the buffer: a variable of a BufferType, which stores
    # and loads name directly. Other parameters may only be integer sizes.
    positions = _buffer_positions(func)
    if positions is None or len(positions) != 3:
        return None
    buffers = [func.params[i] for i in positions]
    if len({str(x.ty.dtype) for x in buffers}) != 1:
        return None
    _, blocks = _root_and_blocks(func)
    if len(blocks) != 1 or blocks[0].alloc_buffers:
        return None
    gemm = _gemm_block(blocks[0])
    if gemm is None or not all(x.same_as(y) for x, y in zip((gemm.a, gemm.b, gemm.c), buffers)):
        return None
    return GemmKernel(gemm.layout, gemm.ranks, str(gemm.c.ty.dtype), positions)


@dataclass(frozen=True, eq=False)
class _GemmBlock:
    """A block computing ``c = op_a(a) @ op_b(b)``: its layout, ranks and buffer variables."""

    layout: str
    ranks: tuple[int, int, int]
    a: Any
    b: Any
    c: Any


def _buffer_positions(func: tvm.tirx.PrimFunc) -> tuple[int, ...] | None:
    """Positions of the buffer parameters, ``None`` when another parameter is not an integer
    scalar (the only other kind a GEMM kernel may take: sizes)."""
    positions = tuple(
        i
        for i, x in enumerate(func.params)
        if type_key(getattr(x, "ty", None)) == "tirx.BufferType"
    )
    if not all(i in positions or is_integer(x) for i, x in enumerate(func.params)):
        return None
    return positions


def _root_and_blocks(func: tvm.tirx.PrimFunc) -> tuple[Any, list[Any]]:
    """``func``'s root block and the blocks under it, in program order."""
    sch = tvm.s_tir.Schedule(func)
    root = sch.get_sblock("root")
    return sch.get(root), [sch.get(b) for b in sch.get_child_blocks(root)]


def _gemm_block(block: Any) -> _GemmBlock | None:
    """What ``block`` computes if it is ``C[b.., i, j] (+)= A[..] * B[..]`` over one reduction
    variable, initialized to zero (see the module docstring), else ``None``."""
    if block.init is None or block.match_buffers:
        return None
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type != _REDUCE]
    reduce = [iv.var for iv in block.iter_vars if iv.iter_type == _REDUCE]
    if len(reduce) != 1 or len(spatial) < 2:
        return None
    (k,) = reduce
    init, body = block.init, block.body
    if not (isinstance(init, tvm.tirx.BufferStore) and isinstance(body, tvm.tirx.BufferStore)):
        return None
    c = body.buffer
    if not init.buffer.same_as(c):
        return None
    if not (_same_vars(init.indices, spatial) and _same_vars(body.indices, spatial)):
        return None
    if not (isinstance(init.value, tvm.tirx.FloatImm) and float(init.value.value) == 0.0):
        return None
    value = body.value
    if not isinstance(value, tvm.tirx.Add) or not isinstance(value.b, tvm.tirx.Mul):
        return None
    acc, product = value.a, value.b
    if not (_is_load(acc) and acc.source.same_as(c)):
        return None
    if not _same_vars(acc.indices, spatial):
        return None
    lhs, rhs = product.a, product.b
    if not (_is_load(lhs) and _is_load(rhs)):
        return None
    if lhs.source.same_as(c) or rhs.source.same_as(c):
        return None
    if len({str(x.source.ty.dtype) for x in (lhs, rhs)} | {str(c.ty.dtype)}) != 1:
        return None
    batch, i, j = spatial[:-2], spatial[-2], spatial[-1]
    op_a = _operand_layout(lhs.indices, batch, (i, k))
    op_b = _operand_layout(rhs.indices, batch, (k, j))
    if op_a is None or op_b is None:
        return None
    ranks = (len(lhs.indices), len(rhs.indices), len(spatial))
    return _GemmBlock(op_a + op_b, ranks, lhs.source, rhs.source, c)


def _is_load(node: Any) -> bool:
    return type_key(node) in ("ir.TensorLoad", "tirx.BufferLoad")


def _same_vars(indices: Any, variables: list[Any]) -> bool:
    return len(indices) == len(variables) and all(
        isinstance(x, tvm.tirx.Var) and x.same_as(v) for x, v in zip(indices, variables)
    )


def _operand_layout(indices: Any, batch: list[Any], inner: tuple[Any, Any]) -> str | None:
    """``"N"`` when an operand is read at ``[batch.., *inner]``, ``"T"`` at ``[batch..,
    *reversed(inner)]`` (``batch`` all of the output's batch indices, or none)."""
    indices = list(indices)
    if len(indices) not in (2, len(batch) + 2):
        return None
    if len(indices) > 2 and not _same_vars(indices[:-2], batch):
        return None
    if _same_vars(indices[-2:], list(inner)):
        return "N"
    if _same_vars(indices[-2:], list(reversed(inner))):
        return "T"
    return None


# ------------------------------------------------------------------ GEMM with an epilogue
@dataclass(frozen=True, eq=False)
class EpilogueKernel:
    """A kernel that is a GEMM followed by an elementwise tail (``FuseOps``' ``matmul -> add
    -> relu``), split in two: the GEMM, for ATen, and the tail, a kernel of TVM's.

    Attributes
    ----------
    gemm
        The GEMM: layout, ranks, dtype, and the positions of its operands ``A``, ``B`` among
        the kernel's parameters; its third position is the kernel's output ``C``, which the
        GEMM's result is written into.
    tail
        The kernel without its GEMM block: the same parameters; it reads the GEMM's result from
        ``C`` at the element it writes and overwrites it (in place, element by element).
    tail_from
        The same with one parameter more, last: the tensor holding the GEMM's result, for a call
        whose ``C`` lies in the memory of a tensor the tail reads.
    reads
        Positions of the buffer parameters the tail reads besides ``C``: those must not lie in
        ``C``'s memory, since the GEMM writes ``C`` before the tail runs.
    """

    gemm: GemmKernel
    tail: tvm.tirx.PrimFunc
    tail_from: tvm.tirx.PrimFunc
    reads: tuple[int, ...]


_EPILOGUES: dict[Any, EpilogueKernel | None] = {}


def epilogue_kernel(func: tvm.tirx.PrimFunc) -> EpilogueKernel | None:
    """``func`` split into a GEMM and its elementwise tail when it is exactly that (see the
    module docstring), else ``None``. Remembered per kernel."""
    if func in _EPILOGUES:
        return _EPILOGUES[func]
    try:
        kernel = _recognize_epilogue(func)
    except Exception:  # noqa: BLE001 - a kernel the schedule cannot read is left to TVM
        kernel = None
    _EPILOGUES[func] = kernel
    return kernel


def _recognize_epilogue(func: tvm.tirx.PrimFunc) -> EpilogueKernel | None:
    positions = _buffer_positions(func)
    if positions is None:
        return None
    root, blocks = _root_and_blocks(func)
    if len(blocks) != 2 or blocks[0].name_hint == blocks[1].name_hint:
        return None
    first, tail = blocks
    gemm = _gemm_block(first)
    if gemm is None or first.alloc_buffers:
        return None
    result = gemm.c  # the GEMM's result: an intermediate of the kernel, not a parameter
    if not any(x.same_as(result) for x in root.alloc_buffers):
        return None
    params = [func.params[i] for i in positions]
    out = _elementwise_store(tail, result)
    if out is None or not any(x.same_as(out) for x in params):
        return None
    if not _same_shape(result, out) or str(result.ty.dtype) != str(out.ty.dtype):
        return None
    index = {i: p for i, p in zip(positions, params)}
    found = {
        name: next((i for i, p in index.items() if p.same_as(buffer)), None)
        for name, buffer in (("a", gemm.a), ("b", gemm.b), ("c", out))
    }
    if None in found.values() or found["c"] in (found["a"], found["b"]):
        return None
    read = _loaded_buffers(tail.body.value)
    reads = tuple(
        i for i, p in index.items() if i != found["c"] and any(p.same_as(x) for x in read)
    )
    kernel = GemmKernel(
        gemm.layout, gemm.ranks, str(out.ty.dtype), (found["a"], found["b"], found["c"])
    )
    source = tvm.tirx.decl_buffer(out.ty.shape, str(out.ty.dtype), "gemm_result")
    return EpilogueKernel(
        kernel,
        _without_gemm(func, first.name_hint, result, out),
        _without_gemm(func, first.name_hint, result, source),
        reads,
    )


def _elementwise_store(block: Any, result: Any) -> Any | None:
    """The buffer ``block`` writes when it computes ``out[v..] = f(result[v..], ...)``: every
    iteration variable spatial, ``out`` stored at exactly those variables (spanning its
    shape), ``result`` read only at the same position, ``out`` not read. Else ``None``."""
    if block.init is not None or block.alloc_buffers or block.match_buffers:
        return None
    if any(iv.iter_type == _REDUCE for iv in block.iter_vars):
        return None
    store = block.body
    if not isinstance(store, tvm.tirx.BufferStore):
        return None
    variables = [iv.var for iv in block.iter_vars]
    out = store.buffer
    if not _same_vars(store.indices, variables) or len(out.ty.shape) != len(variables):
        return None
    for iv, extent in zip(block.iter_vars, out.ty.shape):
        if not (_is_zero(iv.dom.min) and tvm_ffi.structural_equal(iv.dom.extent, extent)):
            return None
    loads = _loads(store.value)
    if any(load.source.same_as(out) for load in loads):
        return None
    of_result = [load for load in loads if load.source.same_as(result)]
    if not of_result or not all(_same_vars(load.indices, variables) for load in of_result):
        return None
    return out


def _loads(expr: Any) -> list[Any]:
    """Every buffer load in ``expr``."""
    found: list[Any] = []
    # In TVM 0.27 a buffer load is an ``ir.TensorLoad`` (``tirx.BufferLoad`` builds one).
    tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, found.append))
    return found


def _loaded_buffers(expr: Any) -> list[Any]:
    return [load.source for load in _loads(expr)]


def _same_shape(x: Any, y: Any) -> bool:
    a, b = list(x.ty.shape), list(y.ty.shape)
    return len(a) == len(b) and all(tvm_ffi.structural_equal(m, n) for m, n in zip(a, b))


def _is_zero(value: Any) -> bool:
    return isinstance(value, tvm.tirx.IntImm) and int(value.value) == 0


_NOOP = tvm.tirx.Evaluate(0)


def _is_noop(stmt: Any) -> bool:
    return isinstance(stmt, tvm.tirx.Evaluate) and _is_zero(stmt.value)


def _without_gemm(
    func: tvm.tirx.PrimFunc, gemm_block: str, result: Any, source: Any
) -> tvm.tirx.PrimFunc:
    """``func`` with its GEMM block removed and its result read from ``source`` instead: a
    buffer parameter of ``func`` (its output), or a new buffer, appended as the last parameter.

    TVM 0.27's Python has no TIR mutator; ``tvm_ffi.structural_map`` (post-order callbacks by
    node type) is the generic one: the GEMM's block realization becomes a no-op, loops and
    sequences left empty go, the intermediate's variable is replaced by ``source``, and the
    root block no longer allocates it.
    """

    def realize(node: Any) -> Any:
        return _NOOP if node.block.name_hint == gemm_block else node

    def loop(node: Any) -> Any:
        return _NOOP if _is_noop(node.body) else node

    def sequence(node: Any) -> Any:
        kept = [x for x in node.seq if not _is_noop(x)]
        if len(kept) == len(node.seq):
            return node
        if not kept:
            return _NOOP
        return kept[0] if len(kept) == 1 else tvm.tirx.SeqStmt(kept)

    def variable(node: Any) -> Any:
        return source if node.same_as(result) else node

    def block(node: Any) -> Any:
        if node.name_hint != "root":
            return node
        allocs = [x for x in node.alloc_buffers if not (x.same_as(result) or x.same_as(source))]
        return tvm.s_tir.SBlock(
            node.iter_vars,
            node.reads,
            node.writes,
            node.name_hint,
            node.body,
            node.init,
            allocs,
            node.match_buffers,
            node.annotations,
        )

    if not any(p.same_as(source) for p in func.params):
        func = tvm.tirx.PrimFunc([*func.params, source], func.body, attrs=func.attrs)
    return tvm_ffi.structural_map(
        func,
        [
            (tvm.s_tir.SBlockRealize, realize),
            (tvm.tirx.For, loop),
            (tvm.tirx.SeqStmt, sequence),
            (tvm.ir.Var, variable),
            (tvm.s_tir.SBlock, block),
        ],
    )


# ------------------------------------------------------------------------------ rewrite
@mutator
class _Swapper(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: GemmOptions, report: GemmReport):
        super().__init__(mod)
        self.mod_ = mod
        self.options = options
        self.report = report
        #: (kernel, suffix) -> its tail's function in the module being built.
        self.tails: dict[tuple[tvm.ir.GlobalVar, str], Any] = {}
        #: Call of a GEMM-with-epilogue kernel -> how it is split (:func:`_epilogue_placements`),
        #: for the function visited.
        self.placements: dict[relax.Call, str] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        if not isinstance(new_call, relax.Call):
            return new_call
        recognized = _gemm_called(self.mod_, new_call, self.options)
        if recognized is None:
            return new_call
        if not _accepts(_gemm_part(recognized), self.options):
            self.report.kept += 1
            return new_call
        if isinstance(recognized, GemmKernel):
            _count(self.report.dispatched, recognized.layout)
            return _gemm_call(recognized, new_call)
        epilogue = recognized
        placement = self.placements.get(call, _KEPT)
        if placement == _KEPT:
            self.report.kept_in_place += 1
            return new_call
        _count(self.report.epilogues, epilogue.gemm.layout)
        op, args = new_call.op, new_call.args
        if placement == _IN_PLACE:
            self.builder_.emit(_gemm_call(epilogue.gemm, new_call))
            tail = self._function(op, epilogue.tail, "epilogue")
            return relax.Call(tail, args, new_call.attrs, new_call.ty_args)
        self.report.temporaries += 1
        result = self._emit_tensor_like(args[epilogue.gemm.buffers[2]])
        gemm = _gemm_call(epilogue.gemm, new_call)
        self.builder_.emit(relax.Call(gemm.op, [*gemm.args[:2], result], ty_args=gemm.ty_args))
        tail = self._function(op, epilogue.tail_from, "epilogue_from")
        self.builder_.emit(relax.Call(tail, [*args, result], new_call.attrs, new_call.ty_args))
        return relax.op.memory.kill_tensor(result)

    def _function(self, kernel: tvm.ir.GlobalVar, func: tvm.tirx.PrimFunc, suffix: str) -> Any:
        """The module's variable for ``func``, derived from ``kernel`` (added once)."""
        key = (kernel, suffix)
        if key not in self.tails:
            self.tails[key] = self.builder_.add_func(func, f"{kernel.name_hint}_{suffix}")
        return self.tails[key]

    def _emit_tensor_like(self, like: relax.Var) -> relax.Var:
        """A tensor of ``like``'s shape and dtype in a storage of its own, as
        ``LowerAllocTensor`` writes one (the storage released once the tensor holds it)."""
        ty = like.ty
        dtype = str(ty.dtype)
        itemsize = tvm.runtime.DataType(dtype).bits // 8
        nbytes = functools.reduce(lambda x, y: x * y, list(ty.shape.values), itemsize)
        storage = self.builder_.emit(
            relax.op.memory.alloc_storage(relax.ShapeExpr([nbytes]), 0, "global", "uint8")
        )
        tensor = self.builder_.emit(
            relax.op.memory.alloc_tensor(storage, 0, relax.ShapeExpr(ty.shape.values), dtype)
        )
        self.builder_.emit(relax.op.memory.kill_storage(storage))
        return tensor


def _gemm_called(
    mod: tvm.IRModule, call: relax.Call, options: GemmOptions
) -> GemmKernel | EpilogueKernel | None:
    """What the pass recognizes ``call`` to call: a GEMM kernel, a GEMM-with-epilogue kernel
    (only with ``options.epilogues``), or ``None`` (any other call, or a kernel called with
    other arguments than its parameters)."""
    op = call.op
    if not isinstance(op, tvm.ir.GlobalVar) or op not in mod.functions:
        return None
    func = mod[op]
    if not isinstance(func, tvm.tirx.PrimFunc) or len(call.args) != len(func.params):
        return None
    kernel = gemm_layout(func)
    if kernel is not None or not options.epilogues:
        return kernel
    return epilogue_kernel(func)


def _gemm_part(recognized: GemmKernel | EpilogueKernel) -> GemmKernel:
    return recognized if isinstance(recognized, GemmKernel) else recognized.gemm


def _accepts(kernel: GemmKernel, options: GemmOptions) -> bool:
    """Whether the runtime computes ``kernel`` without a copy, under ``options``."""
    rank_a, rank_b, rank_c = kernel.ranks
    if kernel.dtype not in options.dtypes:
        return False
    if kernel.layout != "NN" and not options.transposed:
        return False
    if rank_b == 2:
        # A weight: the batch axes of `a` fold into rows, which needs `a` as stored.
        return rank_a == 2 or kernel.layout[0] == "N"
    return options.batched and rank_a == rank_b == rank_c


def _count(counts: dict[str, int], layout: str) -> None:
    counts[layout] = counts.get(layout, 0) + 1


def _gemm_call(kernel: GemmKernel, call: relax.Call) -> relax.Call:
    """The packed call computing ``kernel``'s GEMM on ``call``'s tensors (the scalar sizes
    are dropped: ATen reads the sizes from the tensors)."""
    ty = call.ty if isinstance(call.ty, relax.TupleType) else relax.TupleType([])
    tensors = [call.args[i] for i in kernel.buffers]
    return relax.Call(relax.ExternFunc(GEMM_FUNCS[kernel.layout]), tensors, ty_args=[ty])


_ALLOC_IN_STORAGE = tvm.ir.Op.get("relax.memory.alloc_tensor")
_ALLOC_OWN = tvm.ir.Op.get("relax.builtin.alloc_tensor")
_VIEWS = (tvm.ir.Op.get("relax.reshape"), tvm.ir.Op.get("relax.memory.view"))


def _memory_of(func: relax.Function) -> dict[relax.Var, Any]:
    """Variable -> the object its memory belongs to: the storage a tensor was placed in
    (``R.memory.alloc_tensor``), the variable itself for memory of its own (an
    ``R.builtin.alloc_tensor``, a tensor ``regenerate`` handed back), what a view or an alias
    refers to; ``None`` when unknown (any other call). Parameters are absent (their own)."""
    memory: dict[relax.Var, Any] = {}

    def of(value: relax.Expr, var: relax.Var) -> Any:
        if isinstance(value, relax.Var):
            return memory.get(value, value)
        if isinstance(value, tvm.ir.expr.Constant):
            return value
        if not isinstance(value, relax.Call):
            return None
        if value.op.same_as(_ALLOC_IN_STORAGE):
            return value.args[0]
        if value.op.same_as(_ALLOC_OWN):
            return var
        if any(value.op.same_as(view) for view in _VIEWS):
            return of(value.args[0], var)
        if isinstance(value.op, relax.ExternFunc) and str(value.op.global_symbol) == REGENERATE:
            return var
        return None

    body = func.body
    for block in body.blocks if isinstance(body, relax.SeqExpr) else ():
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding):
                memory[binding.var] = of(binding.value, binding.var)
    return memory


def _apart(out: relax.Expr, operands: list[relax.Expr], memory: dict[relax.Var, Any]) -> bool:
    """Whether ``out``'s memory is known and none of ``operands`` may lie in it."""

    def owner(x: relax.Expr) -> Any:
        return memory.get(x, x) if isinstance(x, relax.Var) else x

    target = owner(out)
    if target is None or not isinstance(out, relax.Var):
        return False
    return all(owner(x) is not None and not owner(x).same_as(target) for x in operands)


#: How a call of a GEMM-with-epilogue kernel is split: the GEMM into the output then the tail
#: in place; the GEMM's result in a tensor of its own; not at all (TVM's fused kernel).
_IN_PLACE, _OWN_RESULT, _KEPT = "in place", "own result", "kept"


def _epilogue_placements(
    mod: tvm.IRModule, func: relax.Function, options: GemmOptions
) -> dict[relax.Call, str]:
    """How each call of a GEMM-with-epilogue kernel in ``func`` is split (see the module
    docstring).

    In place when the output's memory is known and no operand of the kernel may lie in it.
    Otherwise planning wrote the output over a tensor the kernel reads: the GEMM's result takes
    a tensor of its own where ``func``'s symbolic timeline
    (:func:`~blade_relax.analysis.memory_timeline`) proves that a tensor of the output's size,
    live only while the call runs, stays at or below the peak for every admissible value of the
    dims; never in a function that evicts and regenerates tensors (its runtime plans its peak
    from metadata written before this pass, which would not see the extra tensor).
    """
    memory = _memory_of(func)
    placements: dict[relax.Call, str] = {}
    over: list[tuple[relax.Var, relax.Call, relax.Expr]] = []
    for var, call in _bindings(func):
        epilogue = _gemm_called(mod, call, options)
        if not isinstance(epilogue, EpilogueKernel):
            continue
        out = call.args[epilogue.gemm.buffers[2]]
        operands = [call.args[i] for i in (*epilogue.gemm.buffers[:2], *epilogue.reads)]
        if _apart(out, operands, memory):
            placements[call] = _IN_PLACE
        else:
            placements[call] = _KEPT
            over.append((var, call, out))
    if not over or _rematerializes(func):
        return placements
    timeline = memory_timeline(func, mod=mod)
    during = {step.var: step.live_during for step in timeline.steps}
    for var, call, out in over:
        extra = timeline.graph.bytes_of(out)
        if var not in during or extra.is_unknown:
            continue
        if timeline.graph.compare(during[var] + extra, timeline.peak).holds_le:
            placements[call] = _OWN_RESULT
    return placements


def _bindings(func: relax.Function) -> Iterator[tuple[relax.Var, relax.Call]]:
    """The variable and value of each binding of ``func`` whose value is a call."""
    body = func.body
    for block in body.blocks if isinstance(body, relax.SeqExpr) else ():
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding) and isinstance(binding.value, relax.Call):
                yield binding.var, binding.value


def _dispatchable_calls(mod: tvm.IRModule, func: relax.Function, options: GemmOptions) -> int:
    """Calls in ``func`` that the swap would dispatch to ATen under ``options`` (an epilogue
    call counted whatever its placement)."""
    count = 0
    for _, call in _bindings(func):
        recognized = _gemm_called(mod, call, options)
        if recognized is not None and _accepts(_gemm_part(recognized), options):
            count += 1
    return count


def _rematerializes(func: relax.Function) -> bool:
    names = (REMAT_BEGIN, EVICT, REGENERATE)
    return any(
        isinstance(call.op, relax.ExternFunc) and str(call.op.global_symbol) in names
        for _, call in _bindings(func)
    )


@tvm.transform.module_pass(opt_level=0, name="DispatchGemm")
class DispatchGemm:
    """Run the kernels that are GEMMs (plain, batched, transposed) on ATen, after planning.

    Parameters
    ----------
    options
        A :class:`GemmOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`GemmReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass changes no allocation, so a function's peak is what it was).
    """

    def __init__(self, options: GemmOptions | None = None) -> None:
        if options is not None and not isinstance(options, GemmOptions):
            raise TypeError(f"DispatchGemm expects GemmOptions, got {type(options).__name__}")
        self.options = options or GemmOptions()
        self.report = GemmReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = GemmReport()
        if not gemm_functions_registered():
            _tell_not_dispatched()
            note = "GEMMs not dispatched: the packed functions are not registered (no PyTorch)"
            publish(self, PassResult("DispatchGemm", notes=(note,), detail=self.report))
            return mod
        swapper = _Swapper(mod, self.options, self.report)
        changes: dict[str, list[str]] = {}
        captured = captured_functions(mod)
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            if gv.name_hint in captured:
                self.report.kept_captured += _dispatchable_calls(mod, func, self.options)
                continue
            before = self.report.total
            swapper.placements = (
                _epilogue_placements(mod, func, self.options) if self.options.epilogues else {}
            )
            new_func = swapper.visit_expr(func)
            if self.report.total != before:
                swapper.builder_.update_func(gv, new_func)
                changes[gv.name_hint] = [
                    f"{counted(self.report.total - before, 'GEMM')} dispatched to ATen"
                ]
        if not changes:
            self._publish(mod, mod, changes)
            return mod
        out = _without_unused_kernels(swapper.builder_.get())
        self._publish(mod, out, changes)
        return out

    def _publish(
        self, before: tvm.IRModule, after: tvm.IRModule, changes: dict[str, list[str]]
    ) -> None:
        functions = function_results(before, after, changes)
        publish(self, PassResult("DispatchGemm", functions, detail=self.report))


def _without_unused_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the GEMM kernels (with or without an epilogue) no Relax function refers
    to any more (called or passed)."""
    used: set[str] = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            used.update(gv.name_hint for gv in relax.analysis.all_global_vars(func))
    unused = [
        gv
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc)
        and gv.name_hint not in used
        and (gemm_layout(func) is not None or epilogue_kernel(func) is not None)
    ]
    if not unused:
        return mod
    out = snapshot(mod)
    for gv in unused:
        del out[gv]
    return out


def _tell_not_dispatched() -> None:
    global _TOLD
    if not _TOLD:
        _TOLD = True
        _LOG.warning(NOT_DISPATCHED)

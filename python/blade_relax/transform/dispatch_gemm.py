"""DispatchGemm: GEMM kernels run on a vendor BLAS (ATen's), in the buffers TVM planned for them.

TVM's CPU code for a matmul with a symbolic dimension is a naive loop nest (dlight has GEMV and
reduction rules on the CPU, no GEMM rule), and the PyPI wheel is built without cBLAS, DNNL or
cuBLAS, so TVM's BYOC dispatch to a vendor library is not there. This pass is that dispatch for
the kernels that are a GEMM and nothing else: each call of one becomes a call of the packed
function :data:`~blade_relax.contract.GEMM_FUNCS` ``[layout]`` with the same arguments, which
:mod:`blade_relax.runtime.gemm` runs with ``torch.mm`` / ``torch.bmm`` on zero-copy DLPack views
and writes into the output buffer the VM allocated.

Why at the end of the memory stage, not before legalization (where TVM's BYOC runs)
---------------------------------------------------------------------------------
The swap is made after memory planning (``PlanMemory`` or ``StaticPlanBlockMemory``),
``KillAfterLastUse`` and ``RematTimeline``, on the destination-passing calls ``CallTIRRewrite``
wrote (``cls.matmul(a, b, out)``), so every decision about memory was taken on TVM's kernels and
the swap changes none of them: same allocations, same sharing, same kills, same remat timeline.
Peaks are those of the undispatched program, byte for byte, by construction (the packed
function allocates no tensor). A GEMM that ``FuseOps`` fused with an elementwise tail is a
kernel of several blocks, which this pass leaves to TVM: fusion keeps what it saved. (Rewriting
``relax.matmul`` before legalization instead takes every GEMM out of fusion; measured on the
benchmark's workloads, that raised the predicted peaks of the full pipeline by up to 10%.)

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
   ``TT_matmul`` kernels are.
2. *Accept* what the runtime computes without a copy: the right operand two-dimensional and the
   left one two-dimensional or not transposed (its batch axes become rows of one GEMM), or both
   batched (``batched``); transposed operands only with ``transposed``.
3. *Swap*: each call ``kernel(a, b, out)`` of a Relax function (``kernel(a, b, n, m, out)``
   with scalar sizes) becomes ``ExternFunc(GEMM_FUNCS[layout])(a, b, out)``; kernels no
   function refers to any more are removed.

Where it runs
-------------
In :func:`blade_relax.get_pipeline` (``dispatch_gemm=True``, CPU targets): in the ``finalize``
phase, after ``KillAfterLastUse`` (and ``RematTimeline``), before ``LowerRuntimeBuiltin``. It
needs the lowered, planned form (no ``call_tir`` left); on a module that still has ``call_tir``
it changes nothing.

What it assumes
---------------
The packed functions are registered (PyTorch installed, see :mod:`blade_relax.runtime.gemm`)
in the process that compiles the module and in the one that runs it. When they are not, the
pass changes nothing and says once per process, in one logged line, that GEMMs are not
dispatched.

Numerics: ATen's GEMMs sum in another order (blocked, vectorized) than TVM's loop nest, so
results agree to rounding (relative errors about 1e-6 in float32), not bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..analysis.tir_fields import type_key
from ..contract import GEMM_FUNCS
from ._collection import pauses_collection
from .result import PassResult, counted, function_results, publish

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
    """

    transposed: bool = True
    batched: bool = True
    dtypes: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")


@dataclass
class GemmReport:
    """What one run of the pass changed, summed over the module's functions.

    Attributes
    ----------
    dispatched
        Layout (``"NN"``, ``"NT"``, ...) -> kernel calls now calling the packed function.
    kept
        Calls of GEMM kernels left to TVM (a layout, rank or dtype the options exclude).
    """

    dispatched: dict[str, int] = field(default_factory=dict)
    kept: int = 0

    @property
    def total(self) -> int:
        return sum(self.dispatched.values())


@dataclass(frozen=True)
class GemmKernel:
    """A kernel recognized as a GEMM: its layout, ranks and dtype, and where its three buffers
    stand among its parameters (the others are scalar sizes)."""

    layout: str
    ranks: tuple[int, int, int]  # A, B, C
    dtype: str
    buffers: tuple[int, int, int] = (0, 1, 2)


def gemm_functions_registered() -> bool:
    """Whether every packed function of :data:`GEMM_FUNCS` is registered in this process."""
    return all(tvm.get_global_func(n, allow_missing=True) is not None for n in GEMM_FUNCS.values())


# ------------------------------------------------------------------------------ recognize
_KERNELS: dict[Any, GemmKernel | None] = {}


def gemm_layout(func: tvm.tirx.PrimFunc) -> GemmKernel | None:
    """What ``func`` computes if it is a GEMM and nothing else (see the module docstring),
    else ``None``. Remembered per kernel (kernels are immutable)."""
    if func in _KERNELS:
        return _KERNELS[func]
    try:
        kernel = _recognize(func)
    except Exception:  # noqa: BLE001 - a kernel the schedule cannot read is no GEMM to us
        kernel = None
    _KERNELS[func] = kernel
    return kernel


def _recognize(func: tvm.tirx.PrimFunc) -> GemmKernel | None:
    # In TVM 0.27 a buffer parameter is the buffer: a variable of a BufferType, which stores
    # and loads name directly. Other parameters may only be integer sizes.
    positions = tuple(
        i
        for i, x in enumerate(func.params)
        if type_key(getattr(x, "ty", None)) == "tirx.BufferType"
    )
    if len(positions) != 3:
        return None
    if not all(i in positions or _is_int_scalar(x) for i, x in enumerate(func.params)):
        return None
    buffers = [func.params[i] for i in positions]
    a, b, c = buffers
    dtypes = {str(x.ty.dtype) for x in buffers}
    if len(dtypes) != 1:
        return None
    sch = tvm.s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        return None
    block = sch.get(blocks[0])
    if block.init is None or block.match_buffers or block.alloc_buffers:
        return None
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type != _REDUCE]
    reduce = [iv.var for iv in block.iter_vars if iv.iter_type == _REDUCE]
    if len(reduce) != 1 or len(spatial) < 2:
        return None
    (k,) = reduce
    init, body = block.init, block.body
    if not (isinstance(init, tvm.tirx.BufferStore) and isinstance(body, tvm.tirx.BufferStore)):
        return None
    if not (init.buffer.same_as(c) and body.buffer.same_as(c)):
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
    if not (lhs.source.same_as(a) and rhs.source.same_as(b)):
        return None
    batch, i, j = spatial[:-2], spatial[-2], spatial[-1]
    op_a = _operand_layout(lhs.indices, batch, (i, k))
    op_b = _operand_layout(rhs.indices, batch, (k, j))
    if op_a is None or op_b is None:
        return None
    ranks = (len(lhs.indices), len(rhs.indices), len(spatial))
    return GemmKernel(op_a + op_b, ranks, dtypes.pop(), positions)


def _is_int_scalar(param: Any) -> bool:
    """Whether a kernel parameter is an integer scalar (a ``PrimType`` variable), not a buffer."""
    ty = getattr(param, "ty", None)
    if type_key(ty) != "ir.PrimType":
        return False
    return str(ty.dtype).startswith(("int", "uint"))


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


# ------------------------------------------------------------------------------ rewrite
@mutator
class _Swapper(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: GemmOptions, report: GemmReport):
        super().__init__(mod)
        self.mod_ = mod
        self.options = options
        self.report = report

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        op = new_call.op if isinstance(new_call, relax.Call) else None
        if not isinstance(op, tvm.ir.GlobalVar) or op not in self.mod_.functions:
            return new_call
        func = self.mod_[op]
        if not isinstance(func, tvm.tirx.PrimFunc) or len(new_call.args) != len(func.params):
            return new_call
        kernel = gemm_layout(func)
        if kernel is None:
            return new_call
        if not self._accepts(kernel):
            self.report.kept += 1
            return new_call
        self.report.dispatched[kernel.layout] = self.report.dispatched.get(kernel.layout, 0) + 1
        ty = new_call.ty if isinstance(new_call.ty, relax.TupleType) else relax.TupleType([])
        # The scalar sizes are dropped: ATen reads the sizes from the tensors.
        tensors = [new_call.args[i] for i in kernel.buffers]
        return relax.Call(relax.ExternFunc(GEMM_FUNCS[kernel.layout]), tensors, ty_args=[ty])

    def _accepts(self, kernel: GemmKernel) -> bool:
        rank_a, rank_b, rank_c = kernel.ranks
        if kernel.dtype not in self.options.dtypes:
            return False
        if kernel.layout != "NN" and not self.options.transposed:
            return False
        if rank_b == 2:
            # A weight: the batch axes of `a` fold into rows, which needs `a` as stored.
            return rank_a == 2 or kernel.layout[0] == "N"
        return self.options.batched and rank_a == rank_b == rank_c


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
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            before = self.report.total
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
    """``mod`` without the GEMM kernels no Relax function refers to any more (called or
    passed)."""
    used: set[str] = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            used.update(gv.name_hint for gv in relax.analysis.all_global_vars(func))
    unused = [
        gv
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc)
        and gv.name_hint not in used
        and gemm_layout(func) is not None
    ]
    if not unused:
        return mod
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs, global_infos=mod.global_infos)
    for gv in unused:
        del out[gv]
    return out


def _tell_not_dispatched() -> None:
    global _TOLD
    if not _TOLD:
        _TOLD = True
        _LOG.warning(NOT_DISPATCHED)

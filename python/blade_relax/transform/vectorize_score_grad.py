"""VectorizeScoreGrad: the score-gradient kernel of ``RewriteSoftmaxBackward`` as loops a CPU
vectorizes, with the same results.

``RewriteSoftmaxBackward`` emits ``dS = P * (A @ V^T - D) [* c]`` as one TE kernel
(``softmax_grad_NT_matmul``): for each element a dot product of a row of ``A`` and a row of
``V`` over the head dimension ``d``, then the epilogue. TVM's CPU build runs it as that loop nest
(``InlineKernelIntermediates`` only moves the epilogue under the reduction): one scalar product
at a time, ``V`` read along its rows once per row of ``A``. Measured alone on a 2-core CPU at
``(1, 2, 2048, 1024)``, ``d = 32``, it takes about 46 ms where ATen's GEMM and three in-place
elementwise calls take 4 to 7 ms; ``DispatchGemm`` cannot hand it to ATen, because the GEMM's
result would need a tensor of its own while ``dS`` is written over ``P``.

The schedule (``s_tir.Schedule`` on the kernel as TE built it):

* the column axis is padded to a multiple of ``tile`` (``pad_einsum``: ``V``'s rows past the
  end read as zeros, the padded columns of the product are never stored);
* for each batch index and each tile of ``tile`` columns, the tile of ``V`` is copied once,
  transposed, into a ``(d, tile)`` scratch buffer (``cache``), then every row of ``A`` is
  multiplied with it: ``tile`` accumulators updated by one vectorized multiply-add per ``k``;
* the epilogue of the row's tile follows at once from the accumulators; the partial last tile
  is split off by TVM's loop partitioning (``pragma_loop_partition_hint``), so the full tiles
  run without a bound check. (Its loop is marked vectorized, but TVM 0.27's lowering
  vectorizes before it partitions and leaves it scalar; the GEMM's multiply-adds, most of the
  work, are vector instructions.)

Each element still sums its ``d`` products in ascending ``k`` from zero and applies the same
epilogue expression: the results are the unscheduled kernel's, bit for bit. The scratch is the
``(d, tile)`` tile and ``tile`` accumulators, heap workspace of constant size that
:mod:`blade_relax.analysis.workspace` reads from the lowered kernel (``4 * tile * (d + 1)``
bytes per partition in float32, 4,224 bytes for ``d = 32``); no loop is parallel, so that
figure is exact. Measured alone as above (one thread): 6 to 8 ms instead of 46; at lengths
that are not a multiple of 16 (1000, 1001, 1016), 12 to 15 ms instead of 46 to 72.

What TVM lacks: no dlight rule schedules a GEMM on the CPU, and a GEMM with a symbolic dimension
gets no schedule from the stock CPU pipeline at all.

Where it runs
-------------
On CPU targets, on PrimFuncs, after ``FuseTIR`` and ``InlineKernelIntermediates`` (it recognizes
the kernel in TE's form or in the form that pass leaves) and before the memory passes, so that
every memory analysis sees the kernel that runs (``PlanMemory`` still writes ``dS`` over ``P``:
the epilogue reads ``P`` only at the element it stores); in :func:`blade_relax.get_pipeline`
right after ``VectorizeSoftmax``. It changes nothing unless ``RewriteSoftmaxBackward`` ran.

What it assumes
---------------
A kernel is matched only when rebuilding ``RewriteSoftmaxBackward``'s TE compute from its own
buffers (and the scale its epilogue multiplies by) gives a structurally equal PrimFunc, as TE
built it or as ``InlineKernelIntermediates`` leaves it; a kernel that fused anything else, or
any other kernel, keeps TVM's code. Relax functions are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from ..analysis.tir_fields import blocks, is_buffer
from ..util.collection import pauses_collection
from .inline_kernel_intermediates import inline_intermediates
from .result import PassResult, counted, function_results, publish, with_functions
from .rewrite_softmax_backward import EPILOGUE_BLOCK, GEMM_BLOCK, score_grad_kernel

__all__ = ["ScoreGradOptions", "VectorizeScoreGrad", "score_grad_scale", "vectorized_score_grad"]

#: Columns per tile: 16 single floats fill one AVX-512 register (two AVX2 ones).
_TILE = 16
#: The kernel's parameters: ``A``, ``V``, ``P``, ``D`` and the output.
_PARAMS = 5


@dataclass(frozen=True)
class ScoreGradOptions:
    """Options of :class:`VectorizeScoreGrad`.

    Attributes
    ----------
    tile
        Columns per tile: the accumulators of one vectorized multiply-add (a power of two from
        1 to 64).
    """

    tile: int = _TILE

    def __post_init__(self) -> None:
        if self.tile < 1 or self.tile > 64 or self.tile & (self.tile - 1):
            raise ValueError(f"tile must be a power of two from 1 to 64, got {self.tile}")


def _epilogue_scale(func: tirx.PrimFunc) -> tuple[bool, float | None]:
    """Whether ``func`` has the epilogue block, and the constant its value is multiplied by
    last (``None``: no such constant)."""
    found = [
        b.body.value
        for b in blocks(func)
        if b.name_hint == EPILOGUE_BLOCK and isinstance(b.body, tirx.BufferStore)
    ]
    if len(found) != 1:
        return False, None
    value = found[0]
    if isinstance(value, tirx.Mul) and isinstance(value.b, tirx.FloatImm):
        return True, float(value.b.value)
    return True, None


def _rebuilt(func: tirx.PrimFunc, scale: float | None, index_dtype: str | None):
    """``score_grad_kernel(scale)`` built by TE on placeholders of ``func``'s own buffers (with
    ``index_dtype`` for its loops, as ``BlockBuilder.call_te`` builds Relax's kernels)."""
    params = list(func.params)
    if len(params) != _PARAMS or not all(is_buffer(p) for p in params):
        return None
    holders = [te.placeholder(p.ty.shape, p.ty.dtype, p.name) for p in params[:-1]]
    try:
        result = score_grad_kernel(scale)(*holders)
        rebuilt = te.create_prim_func([*holders, result], index_dtype_override=index_dtype)
    except (tvm.TVMError, ValueError, TypeError):  # shapes TE cannot combine
        return None
    # TE names the function ``main``; the kernel's own attributes replace TE's.
    rebuilt = rebuilt.without_attr("global_symbol")
    for key, value in func.attrs.items() if func.attrs is not None else ():
        rebuilt = rebuilt.with_attr(key, value)
    return rebuilt


def _matched(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, float | None] | None:
    """The kernel TE builds for ``func`` (before ``InlineKernelIntermediates``) and its scale,
    when ``func`` is that kernel in either form; else ``None``."""
    has_epilogue, scale = _epilogue_scale(func)
    if not has_epilogue:
        return None
    # The epilogue of an unscaled kernel ends in ``P * (G - D)``, never in a constant factor.
    for index_dtype in ("int64", None):
        plain = _rebuilt(func, scale, index_dtype)
        if plain is None:
            continue
        for form in (plain, inline_intermediates(plain)[0]):
            if tvm_ffi.structural_equal(form, func):
                return plain, scale
    return None


def score_grad_scale(func: tirx.PrimFunc) -> tuple[bool, float | None]:
    """Whether ``func`` is ``RewriteSoftmaxBackward``'s score-gradient kernel (as TE built it or
    as ``InlineKernelIntermediates`` left it), and the scale folded into it.

    Returns
    -------
    tuple[bool, float | None]
        ``(True, scale)`` for that kernel (``scale`` ``None`` when none was folded), else
        ``(False, None)``.
    """
    matched = _matched(func)
    return (False, None) if matched is None else (True, matched[1])


def vectorized_score_grad(func: tirx.PrimFunc, tile: int = _TILE) -> tirx.PrimFunc:
    """The score-gradient kernel ``func`` (see :func:`score_grad_scale`) scheduled for a CPU
    (see the module docstring); ``func`` itself when it is not that kernel or a schedule step
    fails."""
    matched = _matched(func)
    if matched is None:
        return func
    plain = matched[0]
    try:
        sch = s_tir.Schedule(plain)
        gemm = sch.get_sblock(GEMM_BLOCK)
        epilogue = sch.get_sblock(EPILOGUE_BLOCK)
        ndim = len(sch.get_loops(gemm))  # the output's axes and the reduction
        sch.pad_einsum(gemm, [1] * (ndim - 2) + [tile, 1])
        sch.compute_inline(sch.get_sblock(f"{GEMM_BLOCK}_pad"))
        *batch, row, column, k = sch.get_loops(gemm)
        if len(batch) > 1:
            batch = [sch.fuse(*batch)]
        column, lane = sch.split(column, [None, tile])
        sch.reorder(*batch, column, row, k, lane)
        (cache,) = sch.get_producers(gemm)  # the padded V (A is not padded)
        sch.compute_at(cache, column)
        sch.transform_layout(cache, ("write", 0), lambda *i: (*i[:-2], i[-1], i[-2]))
        sch.reverse_compute_at(epilogue, row)
        sch.set_scope(gemm, 0, "local")
        sch.set_scope(cache, 0, "local")
        sch.annotate(column, "pragma_loop_partition_hint", 1)
        sch.vectorize(sch.get_loops(epilogue)[-1])
        sch.vectorize(lane)
        sch.decompose_reduction(gemm, k)
    except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
        return func
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="VectorizeScoreGrad")
class VectorizeScoreGrad:
    """Compute each score-gradient kernel of ``RewriteSoftmaxBackward`` with loops a CPU
    vectorizes, bit for bit (see the module docstring).

    Parameters
    ----------
    options
        A :class:`ScoreGradOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.last_result`` is a
    :class:`~blade_relax.transform.result.PassResult` and ``pass_obj.kernels`` the number of
    kernels replaced.
    """

    name = "VectorizeScoreGrad"

    def __init__(self, options: ScoreGradOptions | None = None) -> None:
        if options is not None and not isinstance(options, ScoreGradOptions):
            raise TypeError(
                f"VectorizeScoreGrad expects ScoreGradOptions, got {type(options).__name__}"
            )
        self.options = options or ScoreGradOptions()
        self.kernels = 0
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates, changes = {}, {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            scheduled = vectorized_score_grad(func, self.options.tile)
            if scheduled is not func:
                updates[gv] = scheduled
                changes[gv.name_hint] = ["score gradient over vectorizable tiles"]
        out = with_functions(mod, updates)
        self.kernels = len(changes)
        notes = (counted(self.kernels, "score-gradient kernel") + " replaced",)
        publish(
            self,
            PassResult(
                "VectorizeScoreGrad",
                function_results(mod, out, changes, kind=tirx.PrimFunc),
                notes=notes,
            ),
        )
        return out

"""DispatchGemm: matmuls run on a vendor BLAS (ATen's), in the VM's own output tensors.

TVM's CPU code for a matmul with a symbolic dimension is a naive loop nest (dlight has GEMV and
reduction rules on the CPU, no GEMM rule), and the PyPI wheel is built without cBLAS, DNNL or
cuBLAS, so TVM's BYOC dispatch to a vendor library is not there. This pass is that dispatch,
by ``R.call_dps_packed``: each GEMM it accepts becomes a call of the packed function
:data:`~blade_relax.contract.GEMM_FUNCS` ``[layout]``, which
:mod:`blade_relax.runtime.gemm` runs with ``torch.mm`` / ``torch.bmm`` on DLPack views of the
tensors. Destination passing keeps memory where the memory passes see it: the output is a
tensor the VM allocates (``CallTIRRewrite`` gives it a ``builtin.alloc_tensor``, the planners
plan it, the accounting counts it), exactly as for the ``call_tir`` it replaces.

Stages
------
1. *Match*: a ``relax.matmul`` call, each operand read through a ``permute_dims`` that swaps its
   last two axes (``transposed``), or a ``call_tir`` of a kernel carrying
   :data:`~blade_relax.contract.GEMM_LAYOUT_ATTR` (the ``NT_matmul`` / ``TN_matmul`` /
   ``TT_matmul`` kernels ``SimplifyTransposes`` emits), whose layout the attribute names.
2. *Accept*: operands and result are tensors of rank two or more with one dtype among
   ``dtypes`` (no mixed precision: ``out_dtype`` casts stay with TVM), and either the right
   operand is two-dimensional and the left one is not transposed (its batch axes become rows of
   one GEMM) or every operand has the same batch axes, proven equal (``batched``): a batch axis
   broadcast against another stays with TVM, which needs no copy for it.
3. *Rewrite*: ``R.call_dps_packed(GEMM_FUNCS[layout], (a, b), out_ty)`` where ``a`` and ``b``
   are the tensors as stored (a transposed operand is read in place); then
   ``DeadCodeElimination`` drops the transposes and kernels nothing reads any more.

Where it runs
-------------
On high-level Relax, after ``SimplifyTransposes`` (which cancels the imported graph's double
transposes and tags its kernels) and before ``LegalizeOps``: in :func:`blade_relax.get_pipeline`
it is the first pass of the ``library_dispatch`` phase, on CPU targets. It may run on a module
with or without dataflow blocks.

Memory: a dispatched GEMM is no longer fused with its elementwise tail by ``FuseOps``. The
result of the GEMM becomes a tensor of the VM where the fused kernel kept it in its workspace,
and the tail reads it; ``PlanMemory`` lets an elementwise tail write in place over it. The
pipeline keeps the dispatch only where the benchmark's peaks are byte for byte those of TVM's
kernels (see the README's "Speed" section for what was measured).

What it assumes
---------------
The packed functions are registered (PyTorch is installed, see :mod:`blade_relax.runtime.gemm`)
in the process that compiles the module and in the one that runs it. When they are not
registered, the pass changes nothing and says once per process, in one logged line, that GEMMs
are not dispatched. A kernel carrying :data:`~blade_relax.contract.GEMM_LAYOUT_ATTR` computes
``matmul`` of its two arguments read in that layout, batch axes broadcast as ``relax.matmul``
broadcasts them.

Numerics: ATen's GEMMs sum in another order (blocked, vectorized) than TVM's loop nest, so
results agree to rounding (relative errors of 1e-6 in float32), not bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..contract import GEMM_FUNCS, GEMM_LAYOUT_ATTR, GEMM_LAYOUTS
from ._collection import pauses_collection
from .result import PassResult, counted, function_results, publish

__all__ = ["DispatchGemm", "GemmOptions", "GemmReport", "gemm_functions_registered"]

_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")

_LOG = logging.getLogger("blade_relax")
#: Whether this process was told that GEMMs are not dispatched (told once).
_TOLD = False
NOT_DISPATCHED = (
    "DispatchGemm: GEMMs are not dispatched (PyTorch is not installed): TVM's kernels compute them"
)


@dataclass(frozen=True)
class GemmOptions:
    """Options of :class:`DispatchGemm`.

    Attributes
    ----------
    transposed
        Dispatch GEMMs reading a transposed operand (``NT``, ``TN``, ``TT``): a matmul on a
        ``permute_dims`` of the last two axes, or a tagged kernel of ``SimplifyTransposes``.
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
        Layout (``"NN"``, ``"NT"``, ...) -> GEMMs now calling the packed function.
    kept
        GEMMs (operands of rank two or more) left to TVM's kernels: broadcast batch axes,
        mixed precision, an option off.
    """

    dispatched: dict[str, int] = field(default_factory=dict)
    kept: int = 0

    @property
    def total(self) -> int:
        return sum(self.dispatched.values())


def gemm_functions_registered() -> bool:
    """Whether every packed function of :data:`GEMM_FUNCS` is registered in this process."""
    return all(tvm.get_global_func(n, allow_missing=True) is not None for n in GEMM_FUNCS.values())


def _is_last_two_swap(call: relax.Call) -> bool:
    ndim = call.args[0].ty.ndim
    if ndim < 2:
        return False
    axes = (
        list(reversed(range(ndim)))
        if call.attrs.axes is None
        else [int(a) for a in call.attrs.axes]
    )
    return axes == [*range(ndim - 2), ndim - 1, ndim - 2]


def _tensor(expr: relax.Expr) -> relax.TensorType | None:
    """The type of ``expr`` if it is a tensor of known rank (two or more) with a known shape."""
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and ty.ndim >= 2 and ty.shape is not None:
        return ty
    return None


@mutator
class _Dispatcher(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: GemmOptions, report: GemmReport):
        super().__init__(mod)
        self.mod_ = mod
        self.options = options
        self.report = report
        self.analyzer = tvm.sym.Analyzer()

    def _producer(self, expr: relax.Expr) -> relax.Call | None:
        """The ``permute_dims`` call bound to ``expr``, if it is one."""
        value = expr
        while isinstance(value, relax.Var):
            value = self.lookup_binding(value)
        if isinstance(value, relax.Call) and value.op.same_as(_PERMUTE):
            return value
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        if not isinstance(new_call, relax.Call):
            return new_call
        if new_call.op.same_as(_MATMUL):
            site = self._matmul_site(new_call)
        elif new_call.op.same_as(_CALL_TIR):
            site = self._kernel_site(new_call)
        else:
            return new_call
        if site is None or any(_tensor(e) is None for e in (site[0], site[1], new_call)):
            return new_call  # not a GEMM: a vector operand, or a rank or shape unknown
        a, b, layout = site
        if not self._accepts(a, b, layout, new_call):
            self.report.kept += 1
            return new_call
        self.report.dispatched[layout] = self.report.dispatched.get(layout, 0) + 1
        return relax.call_dps_packed(GEMM_FUNCS[layout], relax.Tuple([a, b]), new_call.ty)

    def _matmul_site(self, call: relax.Call) -> tuple[relax.Expr, relax.Expr, str] | None:
        operands = []
        for arg in call.args:
            producer = self._producer(arg) if self.options.transposed else None
            if producer is not None and _is_last_two_swap(producer):
                operands.append((producer.args[0], "T"))
            else:
                operands.append((arg, "N"))
        (a, ta), (b, tb) = operands
        return a, b, ta + tb

    def _kernel_site(self, call: relax.Call) -> tuple[relax.Expr, relax.Expr, str] | None:
        callee, args = call.args[0], call.args[1]
        if len(call.args) != 2 or not isinstance(callee, tvm.ir.GlobalVar):
            return None
        func = self.mod_[callee] if callee in self.mod_.functions else None
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
            return None
        if GEMM_LAYOUT_ATTR not in func.attrs:
            return None
        layout = str(func.attrs[GEMM_LAYOUT_ATTR])
        fields = list(args.fields) if isinstance(args, relax.Tuple) else []
        if layout not in GEMM_LAYOUTS or len(fields) != 2:
            return None
        return fields[0], fields[1], layout

    def _accepts(self, a: relax.Expr, b: relax.Expr, layout: str, call: relax.Call) -> bool:
        if layout != "NN" and not self.options.transposed:
            return False
        tys = [_tensor(a), _tensor(b), _tensor(call)]
        ta, tb, to = tys
        dtypes = {str(t.dtype) for t in tys}
        if len(dtypes) != 1 or dtypes.pop() not in self.options.dtypes:
            return False
        if tb.ndim == 2:
            # A weight: the batch axes of `a` fold into rows, which needs `a` as stored.
            return ta.ndim == 2 or layout[0] == "N"
        if not self.options.batched or not ta.ndim == tb.ndim == to.ndim:
            return False
        batch = zip(ta.shape.values[:-2], tb.shape.values[:-2], to.shape.values[:-2])
        return all(
            self.analyzer.can_prove_equal(x, y) and self.analyzer.can_prove_equal(x, z)
            for x, y, z in batch
        )


@tvm.transform.module_pass(opt_level=0, name="DispatchGemm")
class DispatchGemm:
    """Run matmuls (plain, batched, with transposed operands) on ATen's GEMMs.

    Parameters
    ----------
    options
        A :class:`GemmOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`GemmReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs before legalization, where a dispatched GEMM allocates what the
    ``call_tir`` it replaces would; what changes is fusion, which the later passes see).
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
        dispatcher = _Dispatcher(mod, self.options, self.report)
        changes: dict[str, list[str]] = {}
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            before = self.report.total
            new_func = dispatcher.visit_expr(func)
            if self.report.total != before:
                dispatcher.builder_.update_func(gv, new_func)
                changes[gv.name_hint] = [
                    f"{counted(self.report.total - before, 'GEMM')} dispatched to ATen"
                ]
        if not changes:
            self._publish(mod, mod, changes)
            return mod
        # The transposes and tagged kernels nothing reads any more.
        out = relax.transform.DeadCodeElimination()(dispatcher.builder_.get())
        self._publish(mod, out, changes)
        return out

    def _publish(
        self, before: tvm.IRModule, after: tvm.IRModule, changes: dict[str, list[str]]
    ) -> None:
        functions = function_results(before, after, changes)
        publish(self, PassResult("DispatchGemm", functions, detail=self.report))


def _tell_not_dispatched() -> None:
    global _TOLD
    if not _TOLD:
        _TOLD = True
        _LOG.warning(NOT_DISPATCHED)

"""RewriteSoftmaxBackward: attention's score gradient as one GEMM with an epilogue, in place.

The backward of ``P = softmax(S)`` followed by ``O = P @ V``, as autograd exports it, is

    dP = dO @ V^T                        (h, q, k): a GEMM
    t  = dP * P                          (h, q, k)
    D  = sum(t, axis=-1, keepdims=True)  (h, q, 1)
    dS = t - P * D                       (h, q, k)

so two ``(h, q, k)`` tensors are live at once: ``P`` (kept or recomputed for the backward) and
``dP`` (or ``t``), whatever the planner does, because ``D`` needs all of ``t`` before ``dS`` can
be formed. In a training step that is the peak: two attention matrices per layer.

The row sums have a second form. ``D[i] = sum_j dP[i, j] P[i, j] = sum_j sum_c dO[i, c] V[j, c]
P[i, j] = sum_c dO[i, c] O[i, c]``: the product of the output gradient and the forward's output,
``(h, q, d)`` tensors (the identity FlashAttention's backward is built on). With ``D`` from
``dO * O``, the score gradient is ``dS = P * (dO @ V^T - D)``: one kernel that computes each
element of the GEMM and at once its epilogue, reading ``P`` only at the element it writes.
The pass emits that kernel (``softmax_grad_NT_matmul``: the GEMM reads ``V`` untransposed, as
``SimplifyTransposes``' ``NT_matmul`` does); a constant scale that multiplied ``dS`` (the
``1/sqrt(d)`` of the scores) is folded into it. Then:

* ``dP`` and ``t`` are never materialized: on the CPU ``InlineKernelIntermediates`` computes the
  epilogue right after each element's reduction, on a GPU dlight schedules GEMM and epilogue as
  one kernel;
* ``dS`` may take ``P``'s memory (in place, see :mod:`blade_relax.analysis.inplace_reuse`: each
  element of ``P`` flows only into the element of ``dS`` at the same position), so one
  ``(h, q, k)`` tensor is live in the softmax's backward instead of two, once the other reader
  of ``P`` (``dV = P^T dO``) ran first (``MemoryAwareSchedule`` orders it so).

TVM has no such rewrite: ``relax.transform`` fuses and plans operators as exported, and its
``FuseOps`` cannot fuse a GEMM with an epilogue that waits for a row reduction of the GEMM.

Numerics: ``D`` sums ``d`` products instead of ``k``, and ``dS`` is ``P * (dP - D)`` instead of
``dP * P - P * D``: equal in exact arithmetic, not bit for bit (relative differences at float32
rounding, about 1e-6).

Why it is opt-in
----------------
``RecomputeCheapValues`` recomputes each layer's ``P`` for the backward where the timeline of
the unplanned program proves the peak no higher. That program holds every kernel's output next
to its inputs and every reshape kernel as a copy, so it sees neither this kernel writing over
``P`` nor the in-place scale, mask and softmax of the recomputation, and it may then keep a
layer's ``P`` from the forward instead (the last layer's, in the benchmark's two-layer steps).
Predicted peaks of the benchmark's training steps (``python -m blade_relax.bench --workload W
--predict --max-seq-len 1024 --lengths 20,57,128,256,512,1024 --configs
blade-relax,blade-relax-with-softmax-backward``), in MiB, without and with the pass:

============  =============  ============  =============  ==============
workload      s = 128        s = 256       s = 512        s = 1024
============  =============  ============  =============  ==============
llama-train   3.79 / 3.73    6.26 / 6.20   14.21 / 12.77  42.09 / 31.92
gpt2-train    4.33 / 4.33    7.08 / 7.15   14.85 / 14.29  43.12 / 34.58
============  =============  ============  =============  ==============

(equal at 20 and 57). The longer the sequence, the more the attention matrices weigh and the
more the pass saves; at GPT-2's s = 256 it costs 1 %. Measured on the VM (llama-train, the
same command without ``--predict``, with ``torch-eager`` and ``torch-compile``, one run) the
peaks are the predicted ones and every row matches torch. ``DispatchGemm`` leaves the kernel to
TVM (its output lies in ``P``'s storage, an operand); on a CPU ``VectorizeScoreGrad`` schedules
it. Timed in interleaved rounds (``python -m blade_relax.bench.overhead --workload W --base
blade-relax --configs blade-relax-with-softmax-backward --lengths 64,128,256 --target host``,
small sizes, 11 rounds), the step takes 0.98 / 1.00 / 0.89 of the default's time on
llama-train and 1.00 / 0.88 / 0.92 on gpt2-train; its peak there is 1.00 / 0.97 / 0.99 of the
default's on llama-train and 1.00 / 1.06 / 1.07 on gpt2-train (lengths bounded by 256, where
``RecomputeCheapValues`` keeps more of the probabilities). Forcing the recomputation of every
layer's ``P`` (an experiment, not a proof) gives llama-train's step at s = 256 a peak of
4,005,128 B where the default pipeline's is 4,854,020 B: turning the pass on by default waits
for recomputation decided on the planned program.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps``: in :func:`blade_relax.get_pipeline` (with
``softmax_backward=True``) after
``FoldBroadcastMatmul`` (whose head-shared GEMMs it matches as they are) and before
``SimplifyTransposes`` (it reads ``relax.matmul`` and ``relax.permute_dims``, which that pass
turns into kernels). Removing the bindings it made unused is left to
``DeadCodeElimination``, which it runs at the end.

What it assumes
---------------
A normalized module with dense tensors (a ``reshape`` keeps the row-major order). A site is
rewritten only when all of this is proven, else left unchanged:

* ``P = softmax(S, axis=-1)``; the forward reads it as ``O = matmul(P', V)``, ``P'`` a chain of
  ``reshape`` of ``P`` (the head-shared layout of ``FoldBroadcastMatmul``) or ``P`` itself;
* ``dP`` is a chain of ``reshape`` of ``matmul(A, B)``, where ``B`` is ``V`` with its last two
  axes swapped (a ``permute_dims`` of ``V`` or of the tensor ``V`` is a view of), ``A`` has
  ``O``'s shape and ``matmul(A, B)`` has ``P'``'s, and ``P``'s last extent is ``P'``'s (so that
  rows map to rows);
* ``t``, ``D``, ``P * D`` and the GEMM's result each feed nothing but the pattern, and every
  tensor has the same floating-point dtype;
* the binding replaced is a dataflow variable where its shape is not ``P'``'s (its
  ``reshape`` of the kernel's result is then a view).

Functions that are not Relax functions pass through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..util.collection import pauses_collection
from ._attention_match import constant_array
from .fold_broadcast_matmul import _all_equal, _shape
from .result import PassResult, counted, function_results, publish
from .simplify_transposes import _axes, _is_last_two_swap

__all__ = [
    "EPILOGUE_BLOCK",
    "GEMM_BLOCK",
    "RewriteSoftmaxBackward",
    "SoftmaxBackwardOptions",
    "SoftmaxBackwardReport",
    "score_grad_kernel",
]

_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_SUBTRACT = tvm.ir.Op.get("relax.subtract")
_SUM = tvm.ir.Op.get("relax.sum")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
#: Operators that are pure views of their first operand: equal calls give equal tensors.
_VIEWS = (_RESHAPE, _PERMUTE, tvm.ir.Op.get("relax.expand_dims"), tvm.ir.Op.get("relax.squeeze"))
_KERNEL_NAME = "softmax_grad_NT_matmul"
#: The kernel's blocks: the GEMM and its epilogue (``VectorizeScoreGrad`` schedules them).
GEMM_BLOCK, EPILOGUE_BLOCK = "NT_matmul", "softmax_grad"


@dataclass(frozen=True)
class SoftmaxBackwardOptions:
    """Options of :class:`RewriteSoftmaxBackward`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    fold_scale
        Fold a constant scalar that multiplies the score gradient into the kernel.
    """

    enabled: bool = True
    fold_scale: bool = True


@dataclass
class SoftmaxBackwardReport:
    """What one run of the pass changed, summed over the module's functions.

    Attributes
    ----------
    rewritten
        Softmax backwards now computed by one GEMM-with-epilogue kernel.
    scales_folded
        Of those, the ones whose constant scale is folded into the kernel.
    """

    rewritten: int = 0
    scales_folded: int = 0


@dataclass(frozen=True)
class _Site:
    """One softmax backward to rewrite (names as in the module docstring).

    ``probs_mm`` is ``P'`` (``P`` as the forward GEMM reads it), ``output`` is ``O``,
    ``grad_lhs`` is ``A`` (``dO`` in ``O``'s layout), ``values`` is ``V`` (as the forward
    GEMM reads it), ``reshape_to`` the shape of the binding replaced where it is not ``P'``'s
    (the kernel's result is then reshaped to it; ``None`` where it is) and ``scale`` the
    constant folded (or ``None``).
    """

    probs_mm: relax.Var
    output: relax.Var
    grad_lhs: relax.Expr
    values: relax.Expr
    reshape_to: tuple[tirx.PrimExpr, ...] | None
    scale: float | None
    #: The tensor ``grad_lhs`` is a chain of reshapes of: the row sums are computed right
    #: after it is bound, so that ``O`` may die before the rest of the backward.
    grad_source: relax.Var | None = None


def _dtype(expr: relax.Expr) -> str:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else ""


def _is_call(value: relax.Expr | None, op: tvm.ir.Op) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(op)


def _is_last_axis(axis: int, ndim: int) -> bool:
    return ndim > 0 and axis in (-1, ndim - 1)


def _scalar_constant(expr: relax.Expr) -> float | None:
    """The value of a scalar constant, or ``None``."""
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    data = constant_array(expr)
    return float(data.item()) if data.ndim == 0 else None


class _Sites:
    """Which bindings of a function end a softmax backward the pass can rewrite.

    Reads the bindings in order; never changes them.
    """

    def __init__(self, func: relax.Function, fold_scale: bool) -> None:
        self.analyzer = tvm.sym.Analyzer()
        self.fold_scale = fold_scale
        self.values: dict[relax.Var, relax.Expr] = {}
        #: For each variable, the variables whose bindings read it (and ``None`` for the
        #: function's result).
        self.readers: dict[relax.Var, list[relax.Var | None]] = {}
        if isinstance(func.body, relax.SeqExpr):
            for block in func.body.blocks:
                for binding in block.bindings:
                    if isinstance(binding, relax.VarBinding):
                        self.values[binding.var] = binding.value
                        self._read_by(binding.value, binding.var)
                    else:
                        self._read_by(binding.value, None)
            self._read_by(func.body.body, None)

    def _read_by(self, expr: relax.Expr, reader: relax.Var | None) -> None:
        for var in relax.analysis.free_vars(expr):
            self.readers.setdefault(var, []).append(reader)

    def _sole_reader(self, var: relax.Expr) -> relax.Var | None:
        readers = self.readers.get(var, []) if isinstance(var, relax.Var) else []
        return readers[0] if len(readers) == 1 else None

    def _equal(self, a: Sequence[tirx.PrimExpr] | None, b: Sequence[tirx.PrimExpr] | None) -> bool:
        return a is not None and b is not None and _all_equal(self.analyzer, a, b)

    def find(self) -> dict[relax.Var, _Site]:
        """The sites, keyed by the variable whose binding the rewrite replaces."""
        sites: dict[relax.Var, _Site] = {}
        for var, value in self.values.items():
            if _is_call(value, _SUBTRACT):
                site = self._site(var, value)
                if site is not None:
                    target, site = self._with_scale(var, site)
                    if self._equal(_shape(site.probs_mm), site.reshape_to):
                        site = dataclasses.replace(site, reshape_to=None)
                    # Only a dataflow variable's reshape becomes a view (RewriteDataflowReshape).
                    if isinstance(target, relax.DataflowVar) or site.reshape_to is None:
                        sites[target] = site
        return sites

    def _site(self, var: relax.Var, subtract: relax.Call) -> _Site | None:
        """``var = t - P * D`` as in the module docstring, or ``None``."""
        t, u = subtract.args
        t_value, u_value = self.values.get(t), self.values.get(u)
        if not (_is_call(t_value, _MULTIPLY) and _is_call(u_value, _MULTIPLY)):
            return None
        for probs, grad in (t_value.args, reversed(t_value.args)):
            if not _is_call(self.values.get(probs), _SOFTMAX):
                continue
            row_sum = [a for a in u_value.args if not a.same_as(probs)]
            if len(row_sum) != 1 or len(u_value.args) != 2:
                continue
            if not self._is_row_sum(row_sum[0], t):
                continue
            if self._sole_reader(u) is None or self._sole_reader(row_sum[0]) is None:
                continue
            t_readers = self.readers.get(t, [])
            if len(t_readers) != 2 or not all(
                any(r is not None and r.same_as(x) for r in t_readers) for x in (row_sum[0], var)
            ):
                continue
            site = self._gemms(probs, grad, _shape(var))
            if site is not None:
                return site
        return None

    def _is_row_sum(self, expr: relax.Expr, t: relax.Expr) -> bool:
        value = self.values.get(expr) if isinstance(expr, relax.Var) else None
        if not _is_call(value, _SUM) or not value.args[0].same_as(t):
            return False
        axes = value.attrs.axis
        ndim = len(_shape(t) or [])
        return (
            bool(value.attrs.keepdims)
            and axes is not None
            and len(axes) == 1
            and (_is_last_axis(int(axes[0]), ndim))
        )

    def _gemms(
        self, probs: relax.Var, grad: relax.Expr, shape: list[tirx.PrimExpr] | None
    ) -> _Site | None:
        """The forward GEMM reading ``probs`` and the backward GEMM ``grad`` is a view of."""
        softmax = self.values[probs]
        probs_shape = _shape(probs)
        if probs_shape is None or not _is_last_axis(int(softmax.attrs.axis), len(probs_shape)):
            return None
        gemm = self._through_reshapes(grad)
        if gemm is None:
            return None
        a, b = self.values[gemm].args
        gemm_shape = _shape(gemm)
        if gemm_shape is None or not self.analyzer.can_prove_equal(gemm_shape[-1], probs_shape[-1]):
            return None
        dtype = _dtype(probs)
        if not dtype.startswith(("float", "bfloat")):
            return None
        for probs_mm, output in self._forward_gemms(probs):
            forward = self.values[output]
            values = forward.args[1]
            if not self._equal(_shape(probs_mm), gemm_shape):
                continue
            if not self._equal(_shape(a), _shape(output)) or not self._transposed(b, values):
                continue
            # The kernel indexes V with the output's batch indices: no broadcast batch axis.
            a_shape = _shape(a)
            expected_values = [*gemm_shape[:-2], gemm_shape[-1], a_shape[-1]]
            if not self._equal(_shape(values), expected_values):
                continue
            operands = (a, values, output, self.values[gemm], forward)
            if any(_dtype(x) != dtype for x in operands):
                continue
            source = self._reshape_root(a)
            return _Site(probs_mm, output, a, values, tuple(shape or probs_shape), None, source)
        return None

    def _reshape_root(self, expr: relax.Expr) -> relax.Var | None:
        """The first variable of the chain of reshapes ``expr`` is (``expr`` itself when it
        is no reshape), or ``None`` for an expression that is not a variable."""
        if not isinstance(expr, relax.Var):
            return None
        while _is_call(self.values.get(expr), _RESHAPE) and isinstance(
            self.values[expr].args[0], relax.Var
        ):
            expr = self.values[expr].args[0]
        return expr

    def _through_reshapes(self, expr: relax.Expr) -> relax.Var | None:
        """The ``relax.matmul`` binding ``expr`` is a chain of sole-reader reshapes of."""
        while isinstance(expr, relax.Var) and self._sole_reader(expr) is not None:
            value = self.values.get(expr)
            if _is_call(value, _MATMUL):
                return expr
            if not _is_call(value, _RESHAPE):
                return None
            expr = value.args[0]
        return None

    def _forward_gemms(self, probs: relax.Var) -> list[tuple[relax.Var, relax.Var]]:
        """``(P', O)`` for each ``O = matmul(P', V)``, ``P'`` a reshape chain of ``probs``."""
        found, frontier = [], [probs]
        while frontier:
            view = frontier.pop()
            for reader in self.readers.get(view, []):
                value = self.values.get(reader) if reader is not None else None
                if _is_call(value, _RESHAPE):
                    frontier.append(reader)
                elif _is_call(value, _MATMUL) and value.args[0].same_as(view):
                    if not value.args[1].same_as(view):
                        found.append((view, reader))
        return found

    def _transposed(self, b: relax.Expr, values: relax.Expr) -> bool:
        """Whether ``b`` is ``values`` with its last two axes swapped."""
        value = self.values.get(b) if isinstance(b, relax.Var) else None
        if not _is_call(value, _PERMUTE):
            return False
        axes = _axes(value)
        if axes is None:
            return False
        if _is_last_two_swap(axes):
            return self._same_tensor(value.args[0], values)
        other = self.values.get(values) if isinstance(values, relax.Var) else None
        if not _is_call(other, _PERMUTE) or _axes(other) is None:
            return False
        swapped = [*axes[:-2], axes[-1], axes[-2]]
        return swapped == _axes(other) and self._same_tensor(value.args[0], other.args[0])

    def _same_tensor(self, a: relax.Expr, b: relax.Expr, depth: int = 6) -> bool:
        """Whether ``a`` and ``b`` are provably the same tensor: the same variable, or equal
        view calls of the same tensor."""
        if a.same_as(b):
            return True
        va = self.values.get(a) if isinstance(a, relax.Var) else None
        vb = self.values.get(b) if isinstance(b, relax.Var) else None
        if depth == 0 or not (isinstance(va, relax.Call) and isinstance(vb, relax.Call)):
            return False
        if not any(va.op.same_as(op) for op in _VIEWS) or not va.op.same_as(vb.op):
            return False
        if not (tvm_ffi.structural_equal(va.attrs, vb.attrs) and len(va.args) == len(vb.args)):
            return False
        if not self._equal(_shape(a), _shape(b)):
            return False
        rest_equal = all(tvm_ffi.structural_equal(x, y) for x, y in zip(va.args[1:], vb.args[1:]))
        return rest_equal and self._same_tensor(va.args[0], vb.args[0], depth - 1)

    def _with_scale(self, var: relax.Var, site: _Site) -> tuple[relax.Var, _Site]:
        """Fold ``var * c`` (``c`` a scalar constant, ``var``'s only reader) into the site."""
        reader = self._sole_reader(var)
        value = self.values.get(reader) if reader is not None else None
        if not (self.fold_scale and _is_call(value, _MULTIPLY)):
            return var, site
        others = [a for a in value.args if not a.same_as(var)]
        scale = _scalar_constant(others[0]) if len(others) == 1 else None
        if scale is None or _dtype(others[0]) != _dtype(var):
            return var, site
        return reader, dataclasses.replace(site, scale=scale)


def score_grad_kernel(scale: float | None):
    """A TE compute of ``P * (A @ V^T - D) [* c]``, ``V`` read untransposed.

    Each element sums its ``d`` products in ascending order (the legalized ``NT_matmul``'s
    order), then applies the epilogue; ``D`` holds one value per row (a trailing axis of 1).
    """

    def compute(a: te.Tensor, v: te.Tensor, probs: te.Tensor, row: te.Tensor) -> te.Tensor:
        out_shape = list(probs.shape)

        def gemm(*idx: tirx.Var) -> tirx.PrimExpr:
            k = te.reduce_axis((0, a.shape[-1]), name="k")
            *batch, i, j = idx
            return te.sum(a(*batch, i, k) * v(*batch, j, k), axis=k)

        product = te.compute(out_shape, gemm, name=GEMM_BLOCK)

        def epilogue(*idx: tirx.Var) -> tirx.PrimExpr:
            *batch, i, _ = idx
            grad = probs(*idx) * (product(*idx) - row(*batch, i, 0))
            return grad if scale is None else grad * tirx.const(scale, probs.dtype)

        return te.compute(out_shape, epilogue, name=EPILOGUE_BLOCK)

    return compute


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, report: SoftmaxBackwardReport) -> None:
        super().__init__(mod)
        self.report = report
        self.sites: dict[relax.Var, _Site] = {}
        #: The row sums emitted ahead of their site, by the site's target variable.
        self.row_sums: dict[relax.Var, relax.Var] = {}
        #: The variable of the binding being visited.
        self.bound: relax.Var | None = None

    def rewrite(self, func: relax.Function, fold_scale: bool) -> relax.Expr:
        self.sites = _Sites(func, fold_scale).find()
        self.row_sums = {}
        if not self.sites:
            return func
        return self.visit_expr(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: D102
        self.bound = binding.var
        super().visit_var_binding_(binding)
        for target, site in self.sites.items():
            if site.grad_source is not None and site.grad_source.same_as(binding.var):
                self.row_sums[target] = self._row_sum(site)

    def _row_sum(self, site: _Site) -> relax.Var:
        """``D = rowsum(dO * O)``: the ``d``-wide form of ``rowsum(dP * P)``."""
        a = self.visit_expr(site.grad_source)
        if not site.grad_source.same_as(site.grad_lhs):
            a = self.builder_.emit(relax.op.reshape(a, _shape(site.grad_lhs)))
        product = self.builder_.emit(relax.op.multiply(a, self.visit_expr(site.output)))
        return self.builder_.emit(relax.op.sum(product, axis=[-1], keepdims=True))

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        site = self.sites.get(self.bound)
        if site is None:
            return super().visit_call_(call)
        self.sites.pop(self.bound)
        self.report.rewritten += 1
        a, values = self.visit_expr(site.grad_lhs), self.visit_expr(site.values)
        probs = self.visit_expr(site.probs_mm)
        row = self.row_sums.pop(self.bound, None)
        if row is None:  # the source is bound outside the block, or is a parameter
            row = self._row_sum(dataclasses.replace(site, grad_source=site.grad_lhs))
        if site.scale is not None:
            self.report.scales_folded += 1
        kernel = score_grad_kernel(site.scale)
        grad = self.builder_.emit(
            self.builder_.call_te(kernel, a, values, probs, row, primfunc_name_hint=_KERNEL_NAME)
        )
        if site.reshape_to is None:
            return grad
        return relax.op.reshape(grad, list(site.reshape_to))


@tvm.transform.module_pass(opt_level=0, name="RewriteSoftmaxBackward")
class RewriteSoftmaxBackward:
    """Compute attention's score gradient as one GEMM-with-epilogue kernel over ``P``.

    Parameters
    ----------
    options
        A :class:`SoftmaxBackwardOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`SoftmaxBackwardReport` of the last
    run and ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no
    byte figures: the pass runs before legalization, where the kernels and their memory are
    not known yet).
    """

    def __init__(self, options: SoftmaxBackwardOptions | None = None) -> None:
        if options is not None and not isinstance(options, SoftmaxBackwardOptions):
            raise TypeError(
                "RewriteSoftmaxBackward expects SoftmaxBackwardOptions, got "
                f"{type(options).__name__}"
            )
        self.options = options or SoftmaxBackwardOptions()
        self.report = SoftmaxBackwardReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = SoftmaxBackwardReport()
        if not self.options.enabled:
            result = PassResult("RewriteSoftmaxBackward", notes=("disabled by its options",))
            publish(self, result)
            return mod
        rewriter = _Rewriter(mod, self.report)
        changes: dict[str, list[str]] = {}
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            before = self.report.rewritten
            new_func = rewriter.rewrite(func, self.options.fold_scale)
            if self.report.rewritten == before:
                continue
            rewriter.builder_.update_func(gv, new_func)
            rewritten = self.report.rewritten - before
            changes[gv.name_hint] = [
                f"{counted(rewritten, 'softmax backward')} computed as one GEMM with an epilogue"
            ]
        out = mod
        if changes:
            out = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        publish(
            self,
            PassResult(
                "RewriteSoftmaxBackward", function_results(mod, out, changes), detail=self.report
            ),
        )
        return out

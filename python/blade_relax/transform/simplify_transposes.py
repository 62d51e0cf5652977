"""SimplifyTransposes: no materialized transpose where a matmul can read its operand in place.

Imported training graphs are full of layout artefacts. torch's joint export of ``nn.Linear``
writes ``y = x @ permute_dims(W)`` in the forward and ``dx = dy @ permute_dims(permute_dims(W))``
in the backward, and the weight gradient as ``permute_dims(permute_dims(permute_dims(dy) @ x))``.
Stock TVM cancels none of these and ``FuseOps`` does not fuse a transpose into a matmul, so the
forward ``W^T`` of every linear layer is a real buffer that stays live from the forward until
the backward (its second consumer), and every weight gradient is computed once and copied twice.

Stages
------
1. *Compose*: ``permute_dims(permute_dims(x, a), b)`` becomes ``permute_dims(x, a∘b)``, and
   ``x`` itself when the composition is the identity. Chains of any length collapse to one
   transpose of the original tensor; the intermediates, once unused, are removed by
   ``DeadCodeElimination``, and the aliases left by cancelled pairs by
   ``CanonicalizeBindings`` (both TVM passes, run at the end of this pass).
2. *Fuse into matmul*: ``matmul(permute_dims(a), b)`` / ``matmul(a, permute_dims(b))`` where the
   transpose swaps the last two axes (leading axes fixed) becomes one kernel that reads ``a``
   (or ``b``) with swapped indices: ``NT_matmul`` (``x @ W^T``, the forward of a linear layer),
   ``TN_matmul`` (``dy^T @ x``, its weight gradient) or ``TT_matmul``. The transposed copy is
   then never allocated. TVM's ``relax.transform.FuseTransposeMatmul`` covers only the ``NT``
   case, only for a transpose with no other consumer (it fails on the unmodified training
   graph, see ``shared`` notes), and emits no ``TN`` kernel; this stage covers all three on
   any operand and leaves a transpose with other consumers in place for them.
3. *Move to the narrow operand*: a transpose of a matmul's rows, ``permute_dims(reshape(
   matmul(a, W)))`` with a two-dimensional ``W`` of shape ``(K, N)``, ``K < N``, where the
   reshape and the permutation keep the last axis ``N`` and move only whole rows, becomes
   ``matmul(permute_dims(reshape(a)), W)``: each row of the product depends on one row of
   ``a`` alone, so the rows may be moved before the product as well as after, and before it
   the copy is ``K`` wide instead of ``N``. Without it the product and its transposed copy
   are live together (a relative-position projection, ``(s * heads, 16) @ (16, 512)`` moved
   to ``(heads, s, 512)``, holds two ``512``-wide tensors where torch holds one and a view).
   Only where the product and the reshape have no other reader (else the product would be
   computed twice) and ``K`` and ``N`` are known numbers. TVM's ``FuseOps`` cannot fuse the
   transpose into the product, and no TVM pass moves it.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps`` (it matches ``relax.permute_dims`` and
``relax.matmul`` calls, and emits ``call_tir`` kernels that ``LegalizeOps`` leaves as they are
and ``FuseOps`` treats like any other reduction kernel). In :func:`blade_relax.get_pipeline` it
is the first pass, ahead of library dispatch. It may run on a module with or without dataflow
blocks.

What it assumes
---------------
Nothing beyond a normalized module. A ``permute_dims`` whose operand has an unknown rank, a
matmul with a one-dimensional operand, or with operands of unknown shape or dtype, is left
unchanged. Functions that are not Relax functions pass through.

Numerics: a fused kernel computes the same products and sums them over the reduction axis in
the same order as the legalized ``matmul`` (``out_dtype`` casts included), so results are equal
to the unfused graph's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish

__all__ = ["SimplifyTransposes", "TransposeOptions", "TransposeReport"]

_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


@dataclass(frozen=True)
class TransposeOptions:
    """Options of :class:`SimplifyTransposes`.

    Attributes
    ----------
    compose
        Collapse chains of ``permute_dims`` into one, and drop those that compose to the
        identity.
    fuse_matmul
        Replace a matmul on a last-two-axes transpose by a kernel that reads the operand in
        place (``NT_matmul``, ``TN_matmul``, ``TT_matmul``).
    move_to_narrow_operand
        Move a transpose of a matmul's rows onto its narrower operand (stage 3 above).
    """

    compose: bool = True
    fuse_matmul: bool = True
    move_to_narrow_operand: bool = True


@dataclass
class TransposeReport:
    """What one run of the pass changed, summed over the module's functions.

    Attributes
    ----------
    composed
        ``permute_dims`` of a ``permute_dims`` rewritten to one transpose of the original.
    cancelled
        Of those, the ones whose composition is the identity (now the original tensor).
    fused
        Matmuls that now read a transposed operand in place.
    moved
        Transposes of a matmul's rows moved onto its narrower operand.
    """

    composed: int = 0
    cancelled: int = 0
    fused: int = 0
    moved: int = 0

    def rewrites(self) -> int:
        """Rewrites of any kind (cancelled pairs are among the composed chains)."""
        return self.composed + self.fused + self.moved


def _axes(call: relax.Call) -> list[int] | None:
    """The permutation of a ``permute_dims`` call (``None`` when the rank is unknown)."""
    ndim = call.args[0].ty.ndim
    if ndim < 0:
        return None
    if call.attrs.axes is None:
        return list(reversed(range(ndim)))
    return [int(a) for a in call.attrs.axes]


def _is_last_two_swap(axes: Sequence[int]) -> bool:
    n = len(axes)
    return n >= 2 and list(axes) == [*range(n - 2), n - 1, n - 2]


def _static_rank_tensor(expr: relax.Expr) -> bool:
    ty = expr.ty
    return (
        isinstance(ty, relax.TensorType)
        and ty.ndim >= 2
        and ty.shape is not None
        and str(ty.dtype) not in ("", "void")
    )


def _matmul_kernel(trans_a: bool, trans_b: bool, out_dtype: str):
    """A TE compute of ``matmul(A, B)`` reading ``A``/``B`` stored with the last two axes swapped.

    Batch axes broadcast as ``relax.matmul`` broadcasts them (a constant 1 against a larger
    extent). Each output element is ``sum_k A[.., i, k] * B[.., k, j]`` in ascending ``k``, the
    order of the legalized ``matmul``.
    """

    def compute(a: te.Tensor, b: te.Tensor, out_shape: Sequence[tirx.PrimExpr]) -> te.Tensor:
        k_extent = a.shape[-2] if trans_a else a.shape[-1]
        batch_rank = len(out_shape) - 2

        def batch_indices(shape: Sequence[tirx.PrimExpr], idx: Sequence[tirx.Var]) -> list:
            offset = batch_rank - (len(shape) - 2)
            picked = []
            for pos, extent in enumerate(shape[:-2]):
                out_extent = out_shape[offset + pos]
                broadcast = (
                    isinstance(extent, tirx.IntImm)
                    and int(extent) == 1
                    and not (isinstance(out_extent, tirx.IntImm) and int(out_extent) == 1)
                )
                picked.append(
                    tirx.const(0, idx[offset + pos].dtype) if broadcast else idx[offset + pos]
                )
            return picked

        def element(*idx: tirx.Var) -> tirx.PrimExpr:
            k = te.reduce_axis((0, k_extent), name="k")
            i, j = idx[-2], idx[-1]
            a_idx = [*batch_indices(a.shape, idx), *((k, i) if trans_a else (i, k))]
            b_idx = [*batch_indices(b.shape, idx), *((j, k) if trans_b else (k, j))]
            lhs, rhs = a(*a_idx), b(*b_idx)
            if out_dtype:
                lhs, rhs = lhs.astype(out_dtype), rhs.astype(out_dtype)
            return te.sum(lhs * rhs, axis=k)

        name = ("T" if trans_a else "N") + ("T" if trans_b else "N") + "_matmul"
        return te.compute(out_shape, element, name=name)

    return compute


def _reader_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings (and the function's result) read each variable of ``func``."""
    counts: dict[relax.Var, int] = {}
    body = func.body
    values = [b.value for block in body.blocks for b in block.bindings] + [body.body]
    for value in values:
        for var in relax.analysis.free_vars(value):
            counts[var] = counts.get(var, 0) + 1
    return counts


def _known_int(value: object) -> int | None:
    return int(value) if isinstance(value, tirx.IntImm) else None


@mutator
class _Simplifier(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: TransposeOptions, report: TransposeReport):
        super().__init__(mod)
        self.options = options
        self.report = report
        #: Readers of each variable of the function being visited (its original variables).
        self.readers: dict[relax.Var, int] = {}

    def _producer(self, expr: relax.Expr) -> relax.Call | None:
        """The ``permute_dims`` call bound to ``expr``, if it is one."""
        value = expr
        while isinstance(value, relax.Var):  # through the aliases a cancelled pair leaves
            value = self.lookup_binding(value)
        if isinstance(value, relax.Call) and value.op.same_as(_PERMUTE):
            return value
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        if not isinstance(new_call, relax.Call):
            return new_call
        new_call = self.builder_.normalize(new_call)
        if new_call.op.same_as(_PERMUTE):
            composed = self._compose(new_call) if self.options.compose else new_call
            if composed is new_call and self.options.move_to_narrow_operand:
                return self._move_to_narrow_operand(new_call)
            return composed
        if new_call.op.same_as(_MATMUL) and self.options.fuse_matmul:
            return self._fuse(new_call)
        return new_call

    def _compose(self, call: relax.Call) -> relax.Expr:
        inner = self._producer(call.args[0])
        if inner is None:
            return call
        outer_axes, inner_axes = _axes(call), _axes(inner)
        if outer_axes is None or inner_axes is None:
            return call
        composed = [inner_axes[a] for a in outer_axes]
        source = inner.args[0]
        self.report.composed += 1
        if composed == list(range(len(composed))):
            self.report.cancelled += 1
            return source
        return relax.op.permute_dims(source, composed)

    def _sole_binding(self, var: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        """The ``op`` call bound to ``var`` when ``var`` has no reader but the one at hand."""
        if not isinstance(var, relax.Var) or self.readers.get(var) != 1:
            return None
        value = self.lookup_binding(var)
        return value if isinstance(value, relax.Call) and value.op.same_as(op) else None

    def _move_to_narrow_operand(self, call: relax.Call) -> relax.Expr:
        """Stage 3: ``permute_dims(reshape(matmul(a, W)))`` as ``matmul(permute_dims(reshape(a)),
        W)`` where that moves only rows and ``W`` is narrower on its input side."""
        axes = _axes(call)
        if axes is None or axes[-1] != len(axes) - 1:
            return call
        rows = self._sole_binding(call.args[0], _RESHAPE)
        product = self._sole_binding(call.args[0] if rows is None else rows.args[0], _MATMUL)
        if product is None:
            return call
        a, weight = product.args
        if a.ty.ndim < 2 or weight.ty.ndim != 2 or weight.ty.shape is None:
            return call
        k, n = (_known_int(d) for d in weight.ty.shape.values)
        if k is None or n is None or k >= n:
            return call
        if rows is not None:
            shape = list(rows.ty.shape.values) if rows.ty.shape is not None else None
            if shape is None or _known_int(shape[-1]) != n:
                return call
            a = self.builder_.emit(relax.op.reshape(a, [*shape[:-1], k]))
        moved = self.builder_.emit(relax.op.permute_dims(a, axes))
        self.report.moved += 1
        return relax.op.matmul(moved, weight, out_dtype=product.attrs.out_dtype)

    def _fuse(self, call: relax.Call) -> relax.Expr:
        lhs, rhs = call.args
        operands = []
        for arg in (lhs, rhs):
            producer = self._producer(arg)
            if producer is not None:
                axes = _axes(producer)
                if axes is not None and _is_last_two_swap(axes):
                    operands.append((producer.args[0], True))
                    continue
            operands.append((arg, False))
        (a, trans_a), (b, trans_b) = operands
        if not (trans_a or trans_b):
            return call
        if not (_static_rank_tensor(a) and _static_rank_tensor(b) and _static_rank_tensor(call)):
            return call
        out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype else ""
        if out_dtype == "void":
            out_dtype = ""
        kernel = _matmul_kernel(trans_a, trans_b, out_dtype)
        self.report.fused += 1
        name = ("T" if trans_a else "N") + ("T" if trans_b else "N") + "_matmul"
        return self.builder_.call_te(
            kernel, a, b, list(call.ty.shape.values), primfunc_name_hint=name
        )


@tvm.transform.module_pass(opt_level=0, name="SimplifyTransposes")
class SimplifyTransposes:
    """Cancel and compose transposes, let matmuls read transposed operands in place, and move a
    transpose of a matmul's rows onto its narrower operand.

    Parameters
    ----------
    options
        A :class:`TransposeOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`TransposeReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs on whole imported graphs before legalization, where a memory
    timeline of each changed function would cost more than the pass; every rewrite removes a
    transposed copy or makes it narrower, never adds one).
    """

    def __init__(self, options: TransposeOptions | None = None) -> None:
        if options is not None and not isinstance(options, TransposeOptions):
            raise TypeError(
                f"SimplifyTransposes expects TransposeOptions, got {type(options).__name__}"
            )
        self.options = options or TransposeOptions()
        self.report = TransposeReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = TransposeReport()
        if not (
            self.options.compose or self.options.fuse_matmul or self.options.move_to_narrow_operand
        ):
            publish(self, PassResult("SimplifyTransposes", notes=("disabled by its options",)))
            return mod
        simplifier = _Simplifier(mod, self.options, self.report)
        changed = False
        changes: dict[str, list[str]] = {}
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            before = dataclasses.replace(self.report)
            simplifier.readers = _reader_counts(func)
            new_func = simplifier.visit_expr(func)
            changes[gv.name_hint] = _changes(self.report, before)
            if self.report.rewrites() != before.rewrites():
                simplifier.builder_.update_func(gv, new_func)
                changed = True
        if not changed:
            self._publish(mod, mod, changes)
            return mod
        out = simplifier.builder_.get()
        # Aliases left by cancelled pairs, then the transposes nothing reads any more.
        out = relax.transform.CanonicalizeBindings()(out)
        out = relax.transform.DeadCodeElimination()(out)
        self._publish(mod, out, changes)
        return out

    def _publish(
        self, before: tvm.IRModule, after: tvm.IRModule, changes: dict[str, list[str]]
    ) -> None:
        functions = function_results(before, after, changes)
        publish(self, PassResult("SimplifyTransposes", functions, detail=self.report))


def _changes(report: TransposeReport, before: TransposeReport) -> list[str]:
    """What one function's visit added to ``report``, which was ``before`` before it."""
    composed = report.composed - before.composed
    cancelled = report.cancelled - before.cancelled
    fused = report.fused - before.fused
    moved = report.moved - before.moved
    out = []
    if composed - cancelled:
        out.append(f"{counted(composed - cancelled, 'transpose chain')} composed")
    if cancelled:
        out.append(f"{counted(cancelled, 'transpose pair')} cancelled")
    if fused:
        out.append(f"{counted(fused, 'matmul')} fused with a transpose")
    if moved:
        out.append(f"{counted(moved, 'transpose')} moved onto a matmul's narrower operand")
    return out

"""FoldBroadcastMatmul: a matmul reads a head-shared operand once, not one copy per head.

Multi-query and grouped-query attention share each key/value head among several query heads.
torch writes the sharing as a view (``repeat_kv``: ``k[:, :, None].expand(b, kv, rep, s, d)
.reshape(b, kv * rep, s, d)``, GPT-BigCode's ``key.expand(...)``); imported into Relax, that
view is a ``broadcast_to`` followed by a ``reshape``, a real tensor ``rep`` times the size of
the key, and the joint training graph keeps it from the forward until the backward, where
``dP = dO @ V^T`` and ``dQ = dS @ K`` read it again. ``FuseOps`` fuses the copy into no
matmul, and TVM has no pass that folds a broadcast into one.

The rewrite
-----------
For ``matmul(A, B)`` whose right operand is ``reshape(broadcast_to(x, [*lead, *rep, k, n]))``
(through a transpose of the last two axes, identity broadcasts and further reshapes of the
batch axes), where ``x`` is 1 on the trailing batch axes ``rep`` and equal to the full shape on
the leading ones ``lead``, and ``A``'s batch axes are ``B``'s::

    matmul(A, B) == reshape(matmul(reshape(A, [*lead, R * m, k]), x'), out.shape)

with ``R = prod(rep)`` and ``x'`` the key without its broadcast axes (``[*lead, k, n]``, two
dimensional when ``lead`` is empty, as for multi-query attention). The query heads that share a
key become rows of one GEMM against it. Both reshapes are views of dense tensors; the broadcast
copy, once nothing reads it, is removed (``DeadCodeElimination``). Each output element is the
same sum over ``k`` in the same order, so results are bit for bit those of the unfolded graph.

Identity broadcasts
-------------------
torch exports ``torch.matmul`` of two 4-d tensors as ``expand`` + ``view`` + ``bmm``, with an
``expand`` even where nothing broadcasts; imported, that is a ``broadcast_to`` of a tensor to
its own shape. At run time it costs nothing: legalized, it is a copy with the reshape pattern,
which ``RewriteDataflowReshape`` makes a view. Until then it is one more kernel between
attention's probabilities ``P`` and ``P @ V`` (and between a mask and its ``where``, a
transpose and its reader), and the passes that decide on the fused graph read it as one:
``RecomputeCheapValues`` recomputes ``P`` for the backward through it. With these kernels in
the way it accepted that for the first layer of a two-layer GPT-2 only (the length unbounded)
and for neither layer of a two-layer Llama compiled for one exact length, so those layers'
``P`` (``(b, h, s, s)`` tensors) stayed live from the forward until the backward. With
``BroadcastMatmulOptions.identities`` every ``broadcast_to`` bound to a dataflow variable
whose operand provably has the target shape (``tvm.sym.Analyzer``, extent by extent) is
replaced by its operand; ``CanonicalizeBindings`` removes the alias. Every layer's ``P`` is
then recomputed in both (``tests/transform/test_fold_broadcast_matmul.py``). No live set
grows: the operand was live where the copy was made, and now lives only as long as the copy
did. TVM has no pass that removes the broadcast before legalization (its
``RemoveRedundantReshape`` matches reshapes only).

Not folded: a matmul whose result leaves its dataflow block (``RewriteDataflowReshape`` makes
views of dataflow variables only, so restoring its shape would copy it), a broadcast left
operand (attention has none: its broadcast keys and values are always on the right), a
broadcast on an inner batch axis with a real one after it, a left operand whose batch axes are
not the right one's, operands of unknown rank or shape.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps``: in :func:`blade_relax.get_pipeline` after
``FuseAttention`` (which matches attention as imported) and before ``SimplifyTransposes``
(which then reads the key's transpose inside the matmul, ``NT_matmul``). It may run on a
module with or without dataflow blocks.

What it assumes
---------------
A normalized module whose tensors are dense (Relax's): a ``reshape`` keeps the row-major
order. Functions that are not Relax functions pass through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish
from .simplify_transposes import _axes, _is_last_two_swap

__all__ = ["BroadcastMatmulOptions", "BroadcastMatmulReport", "FoldBroadcastMatmul"]

_BROADCAST = tvm.ir.Op.get("relax.broadcast_to")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_EXPAND_DIMS = tvm.ir.Op.get("relax.expand_dims")
_SQUEEZE = tvm.ir.Op.get("relax.squeeze")
_MATMUL = tvm.ir.Op.get("relax.matmul")
#: Operators that only regroup the axes of a dense tensor (same elements, same order).
_VIEWS = (_RESHAPE, _EXPAND_DIMS, _SQUEEZE)


@dataclass(frozen=True)
class BroadcastMatmulOptions:
    """Options of :class:`FoldBroadcastMatmul`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    identities
        Also replace broadcasts of a tensor to its own shape by the tensor (see "Identity
        broadcasts" in the module docstring).
    """

    enabled: bool = True
    identities: bool = True


@dataclass
class BroadcastMatmulReport:
    """What one run of the pass changed, summed over the module's functions.

    Attributes
    ----------
    folded
        Matmuls that now read the un-broadcast operand.
    identities
        Broadcasts of a tensor to its own shape replaced by the tensor.
    """

    folded: int = 0
    identities: int = 0


@dataclass(frozen=True)
class _Broadcast:
    """A tensor that equals ``reshape(broadcast_to(x, full), its shape)``.

    ``full`` is in the tensor's orientation (its last two axes are the tensor's);
    ``x_batch`` are ``x``'s batch extents aligned to ``full``'s (1 where broadcast);
    ``transposed``: ``x``'s last two axes are swapped against ``full``'s.
    """

    x: relax.Var
    full: tuple[tirx.PrimExpr, ...]
    x_batch: tuple[tirx.PrimExpr, ...]
    transposed: bool


def _shape(expr: relax.Expr) -> list[tirx.PrimExpr] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim < 0:
        return None
    shape = ty.shape
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _is_one(extent: tirx.PrimExpr) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _equal(analyzer: tvm.sym.Analyzer, a: tirx.PrimExpr, b: tirx.PrimExpr) -> bool:
    return bool(analyzer.can_prove_equal(a, b))


def _all_equal(analyzer: tvm.sym.Analyzer, a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(_equal(analyzer, x, y) for x, y in zip(a, b))


def _product(extents: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
    return math.prod(extents, start=tirx.IntImm("int64", 1))


class _Broadcasts:
    """Which variables of a function are reshaped broadcasts (:class:`_Broadcast`).

    Reads the bindings in order; never changes them.
    """

    def __init__(self, analyzer: tvm.sym.Analyzer) -> None:
        self.analyzer = analyzer
        self.found: dict[relax.Var, _Broadcast] = {}
        self.values: dict[relax.Var, relax.Expr] = {}
        #: Dataflow variables bound to a broadcast of a tensor to its own shape.
        self.identities: set[relax.Var] = set()

    def visit(self, func: relax.Function) -> dict[relax.Var, _Broadcast]:
        if isinstance(func.body, relax.SeqExpr):
            for block in func.body.blocks:
                for binding in block.bindings:
                    if isinstance(binding, relax.VarBinding):
                        self.values[binding.var] = binding.value
                        if self._is_identity(binding):
                            self.identities.add(binding.var)
                        found = self._describe(binding.value)
                        if found is not None:
                            self.found[binding.var] = found
        return self.found

    def _is_identity(self, binding: relax.VarBinding) -> bool:
        value = binding.value
        if not isinstance(binding.var, relax.DataflowVar) or not isinstance(value, relax.Call):
            return False
        if not value.op.same_as(_BROADCAST):
            return False
        source, shape = _shape(value.args[0]), _shape(value)
        return source is not None and shape is not None and _all_equal(self.analyzer, source, shape)

    def _describe(self, value: relax.Expr) -> _Broadcast | None:
        if isinstance(value, relax.Var):
            return self.found.get(value)
        if not isinstance(value, relax.Call) or not value.args:
            return None
        arg, shape = value.args[0], _shape(value)
        if shape is None or len(shape) < 2:
            return None
        inner = self.found.get(arg) if isinstance(arg, relax.Var) else None
        if value.op.same_as(_BROADCAST):
            return self._broadcast(arg, inner, shape)
        if value.op.same_as(_RESHAPE) and inner is not None:
            batch_kept = _equal(self.analyzer, _product(shape[:-2]), _product(inner.full[:-2]))
            if _all_equal(self.analyzer, shape[-2:], inner.full[-2:]) and batch_kept:
                return inner
            return None
        if value.op.same_as(_PERMUTE) and inner is not None:
            axes = _axes(value)
            if axes is not None and _is_last_two_swap(axes):
                full = (*inner.full[:-2], inner.full[-1], inner.full[-2])
                return _Broadcast(inner.x, full, inner.x_batch, not inner.transposed)
        return None

    def _broadcast(
        self, arg: relax.Expr, inner: _Broadcast | None, shape: list[tirx.PrimExpr]
    ) -> _Broadcast | None:
        source = _shape(arg)
        if source is None or len(source) < 2 or len(source) > len(shape):
            return None
        if inner is not None and _all_equal(self.analyzer, source, shape):
            return inner  # broadcast to its own shape: the same tensor
        if not isinstance(arg, relax.Var) or len(shape) < 3:
            return None
        aligned = [tirx.IntImm("int64", 1)] * (len(shape) - len(source)) + source
        if not _all_equal(self.analyzer, aligned[-2:], shape[-2:]):
            return None  # the matrix axes themselves broadcast
        for have, want in zip(aligned[:-2], shape[:-2]):
            if not (_is_one(have) or _equal(self.analyzer, have, want)):
                return None
        return _Broadcast(arg, tuple(shape), tuple(aligned[:-2]), transposed=False)


@mutator
class _Folder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, report: BroadcastMatmulReport) -> None:
        super().__init__(mod)
        self.report = report
        self.analyzer = tvm.sym.Analyzer()
        self.broadcasts: dict[relax.Var, _Broadcast] = {}
        self.values: dict[relax.Var, relax.Expr] = {}
        self.identities: set[relax.Var] = set()
        #: The variable of the binding being visited.
        self.bound: relax.Var | None = None

    def fold(self, func: relax.Function, identities: bool) -> relax.Expr:
        found = _Broadcasts(self.analyzer)
        self.broadcasts, self.values = found.visit(func), found.values
        self.identities = found.identities if identities else set()
        if not self.broadcasts and not self.identities:
            return func
        return self.visit_expr(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: D102
        self.bound = binding.var
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        if self.bound in self.identities and self.values[self.bound].same_as(call):
            self.report.identities += 1
            return new_call.args[0]
        if not (isinstance(new_call, relax.Call) and new_call.op.same_as(_MATMUL)):
            return new_call
        # Only a dataflow variable's reshape becomes a view (RewriteDataflowReshape); the
        # reshape that restores the product's shape would be a copy anywhere else.
        if not isinstance(self.bound, relax.DataflowVar):
            return new_call
        rhs = call.args[1]
        found = self.broadcasts.get(rhs) if isinstance(rhs, relax.Var) else None
        if found is None:
            return new_call
        folded = self._fold(call, new_call.args[0], found)
        if folded is None:
            return new_call
        self.report.folded += 1
        return folded

    def _fold(self, call: relax.Call, lhs: relax.Expr, found: _Broadcast) -> relax.Expr | None:
        a_shape, b_shape, out_shape = _shape(call.args[0]), _shape(call.args[1]), _shape(call)
        if a_shape is None or b_shape is None or out_shape is None:
            return None
        if len(a_shape) != len(b_shape) or len(b_shape) < 3:
            return None
        if not _all_equal(self.analyzer, a_shape[:-2], b_shape[:-2]):
            return None
        # The broadcast axes must be the trailing batch axes: they become rows.
        lead = len(found.x_batch)
        while lead > 0 and _is_one(found.x_batch[lead - 1]):
            lead -= 1
        repeated = found.full[lead:-2]
        if all(_is_one(e) for e in repeated):
            return None
        if not _all_equal(self.analyzer, found.x_batch[:lead], found.full[:lead]):
            return None
        rows, depth = a_shape[-2:]
        rows_shape = [*found.full[:lead], _product(repeated) * rows, depth]
        lhs = self.builder_.emit(relax.op.reshape(lhs, rows_shape))
        rhs = self._operand(found, lead)
        product = self.builder_.emit(relax.op.matmul(lhs, rhs, out_dtype=call.attrs.out_dtype))
        return relax.op.reshape(product, out_shape)

    def _operand(self, found: _Broadcast, lead: int) -> relax.Expr:
        """``found.x`` without its broadcast axes, in the matmul's orientation."""
        source = found.x
        while True:  # reshape the tensor the views were made of, not a view of it
            value = self.values.get(source) if isinstance(source, relax.Var) else None
            if not (isinstance(value, relax.Call) and any(value.op.same_as(v) for v in _VIEWS)):
                break
            source = value.args[0]
        shape = [*found.full[:lead], *_shape(found.x)[-2:]]
        operand = self.visit_expr(source)
        if not _all_equal(self.analyzer, _shape(source) or [], shape):
            operand = self.builder_.emit(relax.op.reshape(operand, shape))
        if found.transposed:
            axes = [*range(lead), lead + 1, lead]
            operand = self.builder_.emit(relax.op.permute_dims(operand, axes))
        return operand


def _changes(folded: int, identities: int) -> list[str]:
    """What the pass changed in one function, in words."""
    changes = []
    if folded:
        changes.append(f"{counted(folded, 'matmul')} read a broadcast operand in place")
    if identities:
        changes.append(
            f"{counted(identities, 'copy', 'copies')} of a tensor to its own shape removed"
        )
    return changes


@tvm.transform.module_pass(opt_level=0, name="FoldBroadcastMatmul")
class FoldBroadcastMatmul:
    """Let matmuls read a head-shared (broadcast) right operand once, as rows of one GEMM.

    Parameters
    ----------
    options
        A :class:`BroadcastMatmulOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`BroadcastMatmulReport` of the last
    run and ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult`
    (no byte figures: the pass runs before legalization; each fold removes a broadcast copy
    once nothing else reads it, and adds no tensor).
    """

    def __init__(self, options: BroadcastMatmulOptions | None = None) -> None:
        if options is not None and not isinstance(options, BroadcastMatmulOptions):
            raise TypeError(
                f"FoldBroadcastMatmul expects BroadcastMatmulOptions, got {type(options).__name__}"
            )
        self.options = options or BroadcastMatmulOptions()
        self.report = BroadcastMatmulReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = BroadcastMatmulReport()
        if not self.options.enabled:
            publish(self, PassResult("FoldBroadcastMatmul", notes=("disabled by its options",)))
            return mod
        folder = _Folder(mod, self.report)
        changes: dict[str, list[str]] = {}
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            folded, identities = self.report.folded, self.report.identities
            new_func = folder.fold(func, self.options.identities)
            folded, identities = self.report.folded - folded, self.report.identities - identities
            if not (folded or identities):
                continue
            folder.builder_.update_func(gv, new_func)
            changes[gv.name_hint] = _changes(folded, identities)
        out = mod
        if changes:
            out = folder.builder_.get()
            out = relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(out))
        publish(
            self,
            PassResult(
                "FoldBroadcastMatmul", function_results(mod, out, changes), detail=self.report
            ),
        )
        return out

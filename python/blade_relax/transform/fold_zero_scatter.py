"""FoldZeroScatter: scatters into a fresh zero tensor become predicates and reductions.

Imported training graphs build two kinds of tensors by scattering into zeros:

* the one-hot of a cross-entropy backward, ``scatter_elements(zeros(s, V), labels (s, 1),
  -1, axis=1)`` (torch's ``nll_loss_backward``);
* the gradient of an embedding, ``scatter_elements(zeros(V, H), ids (s, H), dy (s, H), axis=0,
  reduction="add")`` (the importer's form of ``index_put_(..., accumulate=True)``).

Legalized, each allocates the zeros, copies them into the scatter's own output, then writes the
few non-zero entries: two buffers of the full size where one (or none) is needed, and the one-hot
is a real ``(s, V)`` tensor that ``FuseOps`` cannot fuse into its consumers (a scatter is
opaque). This pass rewrites both without the zero buffer:

* ``reduction="update"`` with one index per line along the axis (the index tensor's extent
  there is 1): ``where(iota == index, updates, 0)``, an elementwise predicate that ``FuseOps``
  fuses into the consumers, so the one-hot is never materialized;
* ``reduction="add"``: one kernel ``out[.., v, ..] = sum_i (index[.., i, ..] == v ?
  updates[.., i, ..] : 0)`` that writes each output element once (no zero fill, no copy, no
  atomics, so it is deterministic and schedulable on a GPU like any reduction). Its work is
  ``out.size * index.shape[axis]`` compares; the sums run over ``i`` in ascending order, the
  order in which the legalized scatter adds, so results are equal.

Negative indices count from the end of the axis, as ``scatter_elements`` reads them.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps`` (it matches ``relax.scatter_elements`` whose data is
``zeros`` / ``zeros_like`` / ``full`` / ``full_like`` of a zero constant). In
:func:`blade_relax.get_pipeline` it runs right after ``SimplifyTransposes``. The zero tensor, when
nothing else reads it, is removed by ``DeadCodeElimination`` at the end of the pass.

What it assumes
---------------
A normalized module. A scatter is rewritten only when the shapes of data, indices and updates
are known, indices and updates have the same shape, and that shape equals the data's on every
axis but the scatter axis (which ``scatter_elements`` allows to be smaller, writing nothing
past it: such calls are left unchanged), and for ``"update"`` when the extent on the axis is
the constant 1 (several indices per line could name one element twice, and which write wins is
the order of the loop) and the axis has a constant extent. Other reductions (``"mul"``, ``"mean"``, ...) and non-zero data pass
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as T

from ..symbolic.relax_ir import as_int64
from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish

__all__ = ["FoldZeroScatter", "ScatterReport", "ZeroScatterOptions"]

_SCATTER = tvm.ir.Op.get("relax.scatter_elements")
_ZERO_SHAPED = {tvm.ir.Op.get("relax.zeros"), tvm.ir.Op.get("relax.zeros_like")}
_FILLED = {tvm.ir.Op.get("relax.full"), tvm.ir.Op.get("relax.full_like")}


@dataclass(frozen=True)
class ZeroScatterOptions:
    """Options of :class:`FoldZeroScatter`.

    Attributes
    ----------
    one_hot
        Rewrite single-index ``"update"`` scatters into zeros as ``where(iota == index, ...)``.
    accumulate
        Rewrite ``"add"`` scatters into zeros as one reduction kernel.
    serial_accumulate
        Write that kernel as a loop over the updates instead (``out`` zeroed, then each update
        added to the element its index names, in the order of the updates): work
        ``out.size + updates.size`` instead of ``out.size * index.shape[axis]``, with the same
        sums in the same order. A serial loop, for CPU targets (``get_pipeline`` turns it on
        there when ``fold_scatter_options`` is not given); a GPU would run it on one thread.
    """

    one_hot: bool = True
    accumulate: bool = True
    serial_accumulate: bool = False


@dataclass
class ScatterReport:
    """What one run changed: ``one_hot`` predicates and ``accumulate`` kernels emitted (serial
    loops or reductions)."""

    one_hot: int = 0
    accumulate: int = 0


def _is_zero_constant(expr: relax.Expr) -> bool:
    if not isinstance(expr, tvm.ir.expr.Constant):
        return False
    value = expr.value
    return bool(np.all((value.numpy() if hasattr(value, "numpy") else np.asarray(value)) == 0))


def _static_shape(expr: relax.Expr) -> list[tirx.PrimExpr] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim < 0:
        return None
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return list(shape.values)


def _same_extent(a: tirx.PrimExpr, b: tirx.PrimExpr) -> bool:
    return bool(tvm.sym.Analyzer().can_prove_equal(a, b))


def _is_prim(expr: object) -> bool:
    """Whether ``expr`` is a scalar TIR expression (not a Relax value)."""
    return isinstance(getattr(expr, "ty", None), tvm.ir.PrimType)


def _is_one(extent: tirx.PrimExpr) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _unit_alignment(call: relax.Call, inner: list, outer: list) -> list[int | None] | None:
    """For ``out = call(x)`` that only inserts, drops or widens unit axes: for each axis of
    ``x``, the axis of ``out`` whose coordinate it takes (``None``: a unit axis, read at 0), so
    that ``out[c] == x[[c[m] if m is not None else 0 for m in mapping]]``. ``None`` when the
    call does anything else."""
    name = call.op.name
    if name in ("relax.reshape", "relax.expand_dims"):
        inner_axes = [d for d, e in enumerate(inner) if not _is_one(e)]
        outer_axes = [d for d, e in enumerate(outer) if not _is_one(e)]
        if len(inner_axes) != len(outer_axes) or not all(
            _same_extent(inner[a], outer[b]) for a, b in zip(inner_axes, outer_axes)
        ):
            return None
        mapping: list[int | None] = [None] * len(inner)
        for a, b in zip(inner_axes, outer_axes):
            mapping[a] = b
        return mapping
    if name == "relax.broadcast_to":
        lead = len(outer) - len(inner)
        if lead < 0:
            return None
        mapping = []
        for d, extent in enumerate(inner):
            if _same_extent(extent, outer[lead + d]):
                mapping.append(lead + d)
            elif _is_one(extent):
                mapping.append(None)
            else:
                return None
        return mapping
    return None


@dataclass(frozen=True)
class _IndexReader:
    """How the scatter's index is read from a tensor further up its chain of producers.

    ``steps`` go from the index back to ``root``: ``("axes", mapping)`` for a producer that only
    moves unit axes (see :func:`_unit_alignment`), ``("clip", lo, hi)`` for ``clip``.
    """

    root: relax.Expr
    steps: tuple[tuple, ...]

    def read(self, root: te.Tensor, coords: list) -> tirx.PrimExpr:
        """The index at ``coords``, read from ``root`` (its TE tensor)."""
        clips = []
        for step in self.steps:
            if step[0] == "axes":
                zero = tirx.const(0, "int64")
                coords = [coords[m] if m is not None else zero for m in step[1]]
            else:
                clips.append(step[1:])
        value = root(*coords)
        for lo, hi in reversed(clips):  # the clip nearest the root applies first
            value = tirx.max(tirx.min(value, hi.astype(root.dtype)), lo.astype(root.dtype))
        return value


def _wrapped(index: tirx.PrimExpr, extent: tirx.PrimExpr) -> tirx.PrimExpr:
    """``index`` read as ``scatter_elements`` reads it: a negative one from the end of an axis
    of ``extent``."""
    return tirx.Select(index < 0, index + extent.astype(str(index.ty.dtype)), index)


def _accumulate_kernel(axis: int, reader: _IndexReader):
    """TE: ``out[p] = sum_i (norm(index[q]) == p[axis] ? updates[q] : 0)``, ``q`` = ``p`` with
    ``q[axis] = i``; the index is read through ``reader``."""

    def compute(root: te.Tensor, updates: te.Tensor, out_shape) -> te.Tensor:
        extent = out_shape[axis]

        def element(*p: tirx.Var) -> tirx.PrimExpr:
            i = te.reduce_axis((0, updates.shape[axis]), name="i")
            at = [*p[:axis], i, *p[axis + 1 :]]
            target = _wrapped(reader.read(root, at), extent)
            hit = target == p[axis].astype(root.dtype)
            return te.sum(tirx.Select(hit, updates(*at), tirx.const(0, updates.dtype)), axis=i)

        return te.compute(out_shape, element, name="scatter_add_zero")

    return compute


def _serial_accumulate_kernel(
    axis: int, reader: _IndexReader, updates: relax.Expr, out_shape: list[tirx.PrimExpr]
) -> tuple[tirx.PrimFunc, list[tirx.Var]]:
    """TIR: ``out = 0``, then ``out[q with q[axis] = norm(index[q])] += updates[q]`` for every
    ``q`` of the updates in row-major order, an index outside the axis skipped (the reduction
    kernel of :func:`_accumulate_kernel` never matches it either).

    TE has no scatter, hence TVM's TIR builder (the legalized scatter is also a TIR loop, after
    a copy of the zeros). For each element the updates are added in ascending ``q[axis]``, as
    the reduction sums them, so the results are equal.

    Returns the kernel and the function's dims it takes as scalars, after its two tensors: those
    no buffer shape binds on its own (``b`` and ``s`` of a ``(b * s,)`` index).
    """
    root_ty, update_ty = reader.root.ty, updates.ty
    # The kernel's dims are its own variables (bound by its buffers), not the function's.
    dims: dict[Any, tirx.Var] = {}
    out_shape = _own_dims(out_shape, dims)
    update_shape = _own_dims(update_ty.shape.values, dims)
    root_shape = _own_dims(root_ty.shape.values, dims)
    bound = [x for x in (*out_shape, *update_shape, *root_shape) if isinstance(x, tirx.Var)]
    scalars = [v for v in dims if not any(dims[v].same_as(x) for x in bound)]
    extent = out_shape[axis]
    with IRBuilder() as builder:
        with T.prim_func():
            root = T.arg("index", T.buffer(root_shape, root_ty.dtype))
            source = T.arg("updates", T.buffer(update_shape, update_ty.dtype))
            for var in scalars:
                T.arg(var.name, dims[var])
            out = T.arg("out", T.buffer(out_shape, update_ty.dtype))
            T.func_attr({"tirx.noalias": True})
            with T.grid(*out_shape) as p:
                T.buffer_store(out, tirx.const(0, update_ty.dtype), _loop_vars(p))
            with T.grid(*update_shape) as q:
                q = _loop_vars(q)
                target = as_int64(_wrapped(reader.read(_Loader(root, root_ty.dtype), q), extent))
                at = [*q[:axis], target, *q[axis + 1 :]]
                with T.If(tirx.all(target >= 0, target < extent)):
                    with T.Then():
                        T.buffer_store(out, out[tuple(at)] + source[tuple(q)], at)
    return builder.get(), scalars


def _loop_vars(loops: Any) -> list[tirx.Var]:
    """The variables of ``T.grid``: one variable (not a list) for a one-dimensional grid."""
    return [loops] if isinstance(loops, tirx.Var) else list(loops)


def _own_dims(shape: Any, dims: dict[Any, tirx.Var]) -> list[tirx.PrimExpr]:
    """``shape`` (as int64) with each dim variable replaced by one of ``dims`` (made once)."""

    def own(var: Any) -> Any:
        if var not in dims:
            dims[var] = tirx.Var(var.name, var.ty)
        return dims[var]

    return [as_int64(tvm_ffi.structural_map(x, [(tirx.Var, own)])) for x in shape]


@dataclass(frozen=True)
class _Loader:
    """A buffer read as :meth:`_IndexReader.read` reads a TE tensor: called with coordinates."""

    buffer: Any
    dtype: str

    def __call__(self, *coords: tirx.PrimExpr) -> tirx.PrimExpr:
        return self.buffer[tuple(coords)]


@mutator
class _Folder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: ZeroScatterOptions, report: ScatterReport):
        super().__init__(mod)
        self.options = options
        self.report = report

    def _is_zero_fill(self, expr: relax.Expr) -> bool:
        value = expr
        while isinstance(value, relax.Var):
            value = self.lookup_binding(value)
        if not isinstance(value, relax.Call):
            return False
        if any(value.op.same_as(op) for op in _ZERO_SHAPED):
            return True
        if any(value.op.same_as(op) for op in _FILLED):
            return _is_zero_constant(value.args[1])
        return False

    def _binding(self, expr: relax.Expr) -> relax.Expr:
        value = expr
        while isinstance(value, relax.Var):
            bound = self.lookup_binding(value)
            if bound is None:
                return value
            value = bound
        return value

    def _index_reader(self, index: relax.Expr) -> _IndexReader:
        """Read the index through the producers that only move unit axes or clip it.

        The embedding backward's index is ``broadcast_to(expand_dims(reshape(clip(ids))))``:
        reading ``ids`` directly spares the ``(s, H)`` integer intermediate and the clipped copy.
        """
        steps: list[tuple] = []
        current = index
        while True:
            call = self._binding(current)
            if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
                break
            source = call.args[0] if call.args else None
            outer = _static_shape(current)
            inner = _static_shape(source) if source is not None else None
            if outer is None or inner is None:
                break
            if call.op.name == "relax.clip":
                # Bounds arrive as PrimExprs, or wrapped in a PrimValue's ``value``.
                bounds = [a if _is_prim(a) else getattr(a, "value", None) for a in call.args[1:]]
                if len(bounds) != 2 or not all(_is_prim(b) for b in bounds):
                    break
                steps.append(("clip", *bounds))
            else:
                mapping = _unit_alignment(call, inner, outer)
                if mapping is None:
                    break
                steps.append(("axes", mapping))
            current = source
        return _IndexReader(current, tuple(steps))

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        new_call = super().visit_call_(call)
        if (
            not isinstance(new_call, relax.Call)
            or not new_call.op.same_as(_SCATTER)
            or not self._is_zero_fill(new_call.args[0])
        ):
            return new_call
        new_call = self.builder_.normalize(new_call)
        return self._fold(new_call)

    def _fold(self, call: relax.Call) -> relax.Expr:
        data, index, updates = call.args
        shapes = [_static_shape(x) for x in (data, index, updates)]
        if any(s is None for s in shapes):
            return call
        data_shape, index_shape, update_shape = shapes
        rank = len(data_shape)
        if rank == 0 or len(index_shape) != rank or len(update_shape) != rank:
            return call
        axis = int(call.attrs.axis) % rank
        if not all(_same_extent(a, b) for a, b in zip(index_shape, update_shape)):
            return call
        if not all(_same_extent(index_shape[d], data_shape[d]) for d in range(rank) if d != axis):
            return call
        reduction = str(call.attrs.reduction)
        if reduction == "update" and self.options.one_hot:
            lines, extent = index_shape[axis], data_shape[axis]
            if (
                isinstance(lines, tirx.IntImm)
                and int(lines) == 1
                and isinstance(extent, tirx.IntImm)
            ):
                return self._one_hot(data, index, updates, axis, int(extent), rank)
        if reduction == "add" and self.options.accumulate:
            self.report.accumulate += 1
            reader = self._index_reader(index)
            if self.options.serial_accumulate:
                kernel, scalars = _serial_accumulate_kernel(axis, reader, updates, data_shape)
                gv = self.builder_.add_func(kernel, "scatter_add_zero")
                out_ty = relax.TensorType(data_shape, str(updates.ty.dtype))
                sizes = [relax.prim_value(v) for v in scalars]
                return relax.call_tir(gv, [reader.root, updates, *sizes], out_ty)
            return self.builder_.call_te(
                _accumulate_kernel(axis, reader),
                reader.root,
                updates,
                data_shape,
                primfunc_name_hint="scatter_add_zero",
            )
        return call

    def _one_hot(self, data, index, updates, axis: int, extent: int, rank: int) -> relax.Expr:
        emit = self.builder_.emit
        index_dtype = index.ty.dtype
        iota = emit(relax.op.arange(0, extent, dtype=index_dtype))
        along_axis = [1] * rank
        along_axis[axis] = extent
        iota = emit(relax.op.reshape(iota, relax.ShapeExpr(along_axis)))
        # scatter_elements reads a negative index from the end of the axis.
        negative = emit(relax.op.less(index, relax.const(0, index_dtype)))
        shifted = emit(relax.op.add(index, relax.const(extent, index_dtype)))
        wrapped = emit(relax.op.where(negative, shifted, index))
        hit = emit(relax.op.equal(iota, wrapped))
        self.report.one_hot += 1
        return relax.op.where(hit, updates, relax.const(0, data.ty.dtype))


@tvm.transform.module_pass(opt_level=0, name="FoldZeroScatter")
class FoldZeroScatter:
    """Scatters into zeros as predicates (one-hots) and reduction kernels (accumulations).

    Parameters
    ----------
    options
        A :class:`ZeroScatterOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`ScatterReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs on whole imported graphs before legalization, where a memory
    timeline of each changed function would cost more than the pass; every rewrite drops a
    zero buffer).
    """

    def __init__(self, options: ZeroScatterOptions | None = None) -> None:
        if options is not None and not isinstance(options, ZeroScatterOptions):
            raise TypeError(
                f"FoldZeroScatter expects ZeroScatterOptions, got {type(options).__name__}"
            )
        self.options = options or ZeroScatterOptions()
        self.report = ScatterReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = ScatterReport()
        if not (self.options.one_hot or self.options.accumulate):
            publish(self, PassResult("FoldZeroScatter", notes=("disabled by its options",)))
            return mod
        folder = _Folder(mod, self.options, self.report)
        changed = False
        changes: dict[str, list[str]] = {}
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            before = (self.report.one_hot, self.report.accumulate)
            new_func = folder.visit_expr(func)
            if (self.report.one_hot, self.report.accumulate) != before:
                folder.builder_.update_func(gv, new_func)
                changed = True
                changes[gv.name_hint] = _changes(self.report, before)
        out = mod
        if changed:
            # The zero tensors nothing reads any more.
            out = relax.transform.DeadCodeElimination()(folder.builder_.get())
        functions = function_results(mod, out, changes)
        publish(self, PassResult("FoldZeroScatter", functions, detail=self.report))
        return out


def _changes(report: ScatterReport, before: tuple[int, int]) -> list[str]:
    """What one function's visit added to ``report``, which held ``before`` (one_hot,
    accumulate) before it."""
    one_hot = report.one_hot - before[0]
    accumulate = report.accumulate - before[1]
    out = []
    if one_hot:
        out.append(f"{counted(one_hot, 'one-hot scatter')} folded (predicate)")
    if accumulate:
        out.append(f"{counted(accumulate, 'accumulating scatter')} folded (reduction kernel)")
    return out

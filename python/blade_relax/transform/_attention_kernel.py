"""The kernel of an attention group: TE stages, the PrimFunc and its loop nest.

The two matmuls and the softmax are TE stages over the group's accessors
(``_attention_access``), written so that an ``s_tir.Schedule`` computes one row of scores at a
time; :func:`build_kernel` falls back to the plain stages where a step of the schedule fails.
The loop nest, the keys' copy and the rows that stop at the diagonal are described in
:mod:`blade_relax.transform.fuse_attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx, topi

from ._attention_access import (
    Accessor,
    broadcast_index,
    elements,
    elementwise,
    mask_accessor,
    of_tensor,
    operand,
    permuted,
    reshape_map,
    shifted,
)
from ._attention_match import (
    LAYOUT_OPS,
    MASK_OPS,
    SCORE_OPS,
    Block,
    Unsupported,
    const_int,
    element_reads,
    op_name,
    shape_of,
)

#: Lanes of the running maximum of a row of scores (16 single floats: one AVX-512 register,
#: four SSE ones).
_LANES = 16
#: Blocks whose reduction loop goes outside their spatial loop, so the inner loop runs along
#: contiguous elements: a row of ``O``, the lanes of the maximum (and, with the keys copied, a
#: row of scores).
_REDUCTION_OUTSIDE = ("matmul_1", "row_max_lanes")


#: How the kernel reads the keys: in place (``False``), copied (``True``), or copied where one
#: head's keys take at most the bytes of an integer expression over the dims, in place
#: elsewhere (see :func:`_keys_stage`).
KeysCopy = bool | tvm.ir.Expr


#: The length of a row of scores the kernel computes, as a parameter of the unscheduled
#: kernel, and what it stands for outside the row loop (the number of keys): see
#: :func:`_masked_above_diagonal`.
RowLength = tuple[tirx.Var, tvm.ir.Expr]


def build_kernel(
    info: Block,
    group: Sequence[int],
    copy_keys: KeysCopy = False,
    masks: Sequence[relax.Var] = (),
    stop_rows: bool = False,
) -> tuple[tirx.PrimFunc, list[relax.Var]]:
    """The PrimFunc computing the group's result, and the outer tensors it reads (in order):
    the scheduled kernel, or where a step of its schedule fails, the plain one (stages as TE
    writes them, which ``InlineKernelIntermediates`` computes row by row).

    Raises
    ------
    Unsupported
        When an operator or a shape of the group is not handled; the group is then left as it
        is.
    """
    kernel, inputs, rows = _kernel(
        info, group, scheduled=True, copy_keys=copy_keys, masks=masks, stop_rows=stop_rows
    )
    kernel = _schedule(kernel, copy_keys is not False, rows)
    if kernel is None:
        kernel, inputs, _ = _kernel(info, group, scheduled=False)
    # A private function (the builder names it) with its own symbolic vars, as ``call_te``
    # makes them: the placeholders' shapes still hold the Relax function's vars.
    return s_tir.renew_defs(kernel).without_attr("global_symbol"), inputs


def _kernel(
    info: Block,
    group: Sequence[int],
    scheduled: bool,
    copy_keys: KeysCopy = False,
    masks: Sequence[relax.Var] = (),
    stop_rows: bool = False,
) -> tuple[tirx.PrimFunc, list[relax.Var], RowLength | None]:
    """The kernel's PrimFunc before any schedule, with the stages :func:`_schedule` expects
    (``scheduled``; a ``keys`` stage with ``copy_keys``; rows of scores that stop at the
    diagonal with ``stop_rows`` where the mask allows it) or the plain ones: the keys read
    where they lie, ``topi.nn.softmax``."""
    inputs = _inputs(info, group)
    placeholders = [te.placeholder(shape_of(v), str(v.ty.dtype), v.name) for v in inputs]
    access: dict[relax.Var, Accessor] = {v: of_tensor(t) for v, t in zip(inputs, placeholders)}
    splits: dict[relax.Var, tuple[relax.Var, list[int], int]] = {}
    matmuls: list[relax.Var] = []
    rows: RowLength | None = None
    for pos in group:
        binding = info.bindings[pos]
        var, value, name = binding.var, binding.value, op_name(binding)
        if name == "TupleGetItem":
            source, starts, axis = splits[value.tuple_value]
            access[var] = shifted(access[source], axis, starts[value.index])
            continue
        if isinstance(value, tvm.ir.expr.Constant):  # a scalar of a mask
            access[var] = operand(value, access, 0)
            continue
        if name in MASK_OPS and name not in LAYOUT_OPS and name not in SCORE_OPS:
            access[var] = mask_accessor(name, value, shape_of(var), str(var.ty.dtype), access)
            continue
        args = value.args
        if name == "relax.split":
            splits[var] = (args[0], *_split_items(value))
            continue
        out_shape = shape_of(var)
        if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
            index_map = reshape_map(shape_of(args[0]), out_shape)
            inner = access[args[0]]
            access[var] = lambda idx, inner=inner, index_map=index_map: inner(index_map(idx))
        elif name == "relax.permute_dims":
            axes = value.attrs.axes
            rank = len(out_shape)
            axes = list(reversed(range(rank))) if axes is None else [int(a) for a in axes]
            access[var] = permuted(access[args[0]], axes)
        elif name == "relax.broadcast_to":
            access[var] = operand(args[0], access, len(out_shape))
        elif name in SCORE_OPS:
            rank = len(out_shape)
            lhs, rhs = operand(args[0], access, rank), operand(args[1], access, rank)
            access[var] = lambda idx, lhs=lhs, rhs=rhs, name=name: elementwise(
                name, lhs(idx), rhs(idx)
            )
        elif name == "relax.matmul":
            a_shape, b_shape = shape_of(args[0]), shape_of(args[1])
            if len(a_shape) < 2 or len(b_shape) < 2:
                raise Unsupported("a matmul of a vector")
            rhs = access[args[1]]
            if scheduled and copy_keys is not False and not matmuls:
                # The keys as a stage, contiguous along a row of scores (see _schedule).
                rhs = _keys_stage(rhs, b_shape, str(args[1].ty.dtype), copy_keys)
            # P @ V reads the first ``length`` probabilities of a row where the rows stop.
            length = rows[0] if rows is not None and matmuls else None
            matmuls.append(var)
            access[var] = of_tensor(
                _matmul(
                    access[args[0]], a_shape, rhs, b_shape, out_shape, str(var.ty.dtype), length
                )
            )
        elif name == "relax.nn.softmax" and scheduled:
            if stop_rows and _masked_above_diagonal(info, args[0], masks, access):
                rows = (tirx.Var("row_length", "int64"), out_shape[-1])
            access[var] = _softmax(access[args[0]], out_shape, rows and rows[0])
        elif name == "relax.nn.softmax":
            scores = te.compute(out_shape, elements(access[args[0]]), name="scores")
            access[var] = of_tensor(topi.nn.softmax(scores, axis=len(out_shape) - 1))
        else:
            raise Unsupported(str(name))
    result = info.bindings[group[-1]].var
    out = te.compute(shape_of(result), elements(access[result]), name="attention")
    params = [*placeholders, out, *([rows[0]] if rows is not None else [])]
    return te.create_prim_func(params, index_dtype_override="int64"), inputs, rows


def _inputs(info: Block, group: Sequence[int]) -> list[relax.Var]:
    """The tensors from outside the group whose elements it reads, in the order first read:
    the kernel's parameters."""
    members = {info.bindings[p].var for p in group}
    inputs: list[relax.Var] = []
    for pos in group:
        binding = info.bindings[pos]
        reads = element_reads(binding)
        for var in relax.analysis.free_vars(binding.value):
            if isinstance(var.ty, tvm.ir.PrimType) or var in members or var in inputs:
                continue  # symbolic dims are bound by the inputs' shapes
            if not isinstance(var.ty, relax.TensorType):
                raise Unsupported("an input that is not a tensor")
            if var in reads:
                inputs.append(var)
    return inputs


def _split_items(call: relax.Call) -> tuple[list[int], int]:
    """Where the items of a ``split`` start along its axis, and the axis (a constant one)."""
    src = shape_of(call.args[0])
    axis = int(call.attrs.axis) % len(src)
    sections = call.attrs.indices_or_sections
    if isinstance(sections, (int, tirx.IntImm)):
        extent = const_int(src[axis])
        if extent is None or extent % int(sections):
            raise Unsupported("a split of a symbolic axis")
        starts = [extent // int(sections) * n for n in range(int(sections))]
    else:
        starts = [0, *(int(x) for x in sections)]
    return starts, axis


def _matmul(
    a: Accessor,
    a_shape: Sequence[tvm.ir.Expr],
    b: Accessor,
    b_shape: Sequence[tvm.ir.Expr],
    out_shape: Sequence[tvm.ir.Expr],
    dtype: str,
    length: tvm.ir.Expr | None = None,
) -> te.Tensor:
    """``matmul`` as ``relax.matmul`` legalizes it: batch axes broadcast, ascending ``k``
    (up to ``length`` instead of the whole axis, when given)."""
    k = te.reduce_axis((0, a_shape[-1] if length is None else length), name="k")

    def element(*idx):
        i, j = idx[-2], idx[-1]
        a_idx = [*broadcast_index(idx[:-2], a_shape[:-2]), i, k]
        b_idx = [*broadcast_index(idx[:-2], b_shape[:-2]), k, j]
        return te.sum(a(a_idx).astype(dtype) * b(b_idx).astype(dtype), axis=k)

    return te.compute(out_shape, element, name="matmul")


def _softmax(
    scores: Accessor, shape: Sequence[tvm.ir.Expr], length: tvm.ir.Expr | None = None
) -> Accessor:
    """``softmax`` over the last axis as ``topi.nn.softmax`` computes it (the maximum, ``exp``
    of the difference, the sum, the quotient), in stages a row of scores at a time.

    Each ``exp`` is a stage of its own (``row_exp``), so the sum and the quotient read it
    instead of computing it again. The maximum is taken over :data:`_LANES` interleaved lanes
    and a tail (:func:`_lane_max`): the lanes vectorize where one running value is a scalar
    chain, bound by the latency of its operation, and a maximum does not depend on the order.
    The sum does: it runs in ascending order, as ``topi.nn.softmax``'s, so that every value is
    the unfused graph's. The quotient is the accessor returned, not a stage: ``P @ V`` divides
    as it reads, once per element of ``P`` (the division is invariant in its inner loop), and
    holds no row of ``P``. With ``length``, the maximum and the sum run over the first
    ``length`` scores of a row (see :func:`_masked_above_diagonal`).
    """
    length = shape[-1] if length is None else length
    row_max = _lane_max(scores, shape, "row_max", length)
    exps = te.compute(shape, lambda *idx: te.exp(scores(idx) - row_max(*idx[:-1])), name="row_exp")
    j = te.reduce_axis((0, length), name="j")
    row_sum = te.compute(shape[:-1], lambda *r: te.sum(exps(*r, j), axis=j), name="row_sum")
    return lambda idx: exps(*idx) / row_sum(*idx[:-1])


def _lane_max(
    values: Accessor, shape: Sequence[tvm.ir.Expr], name: str, length: tvm.ir.Expr
) -> te.Tensor:
    """The maximum of ``values`` over the last axis of ``shape``, as four stages (the lanes
    change the order in which it is taken, which a maximum does not depend on).

    ``{name}_lanes[..., l]`` is the maximum of the elements ``j = L * jo + l`` for
    ``jo < n // L``, ``{name}_tail`` that of the last ``n % L`` elements, ``{name}_total`` that
    of the lanes, and ``{name}`` the larger of the two (``n`` is ``length``). No stage reads
    past ``n``, for a symbolic ``n`` too (a split with a predicate would make its producer's
    row longer, past the end of the keys).
    """
    lanes = _LANES
    rows = list(shape[:-1])
    full = tirx.floordiv(length, lanes)
    jo = te.reduce_axis((0, full), name="jo")
    part = te.compute(
        [*rows, lanes],
        lambda *r: te.max(values([*r[:-1], jo * lanes + r[-1]]), axis=jo),
        name=f"{name}_lanes",
    )
    t = te.reduce_axis((0, length - full * lanes), name="t")
    tail = te.compute(
        rows, lambda *r: te.max(values([*r, full * lanes + t]), axis=t), name=f"{name}_tail"
    )
    lane = te.reduce_axis((0, lanes), name="lane")
    total = te.compute(rows, lambda *r: te.max(part(*r, lane), axis=lane), name=f"{name}_total")
    return te.compute(rows, lambda *r: tirx.max(total(*r), tail(*r)), name=name)


def _keys_stage(
    keys: Accessor, shape: Sequence[tvm.ir.Expr], dtype: str, copy_keys: KeysCopy
) -> Accessor:
    """The keys ``(..., d, s)`` read through a ``keys`` stage (``copy_keys`` is ``True``), or
    through one whose last axis is ``s`` where one head's keys (``d * s`` elements) take at most
    ``copy_keys`` bytes and 0 elsewhere: the score matmul then reads the copy where it exists
    and the keys in place where it does not (a branch on the dims, the same for every score,
    which LLVM takes out of the loops)."""
    if copy_keys is True:
        return of_tensor(te.compute(shape, elements(keys), name="keys"))
    head = shape[-2] * shape[-1] * (tvm.DataType(dtype).bits // 8)
    fits = copy_keys >= head
    # 1 where the copy fits, else 0: integer arithmetic, which the workspace sizes express.
    length = shape[-1] * tirx.min(1, tirx.floordiv(copy_keys, tirx.max(head, 1)))
    copied = te.compute([*shape[:-1], length], elements(keys), name="keys")
    return lambda idx: tirx.if_then_else(fits, copied(*idx), keys(idx))


def _masked_above_diagonal(
    info: Block, scores: relax.Var, masks: Sequence[relax.Var], access: dict
) -> bool:
    """Whether ``scores`` is ``X + M`` with ``M`` a mask the kernel computes that is the lowest
    float (or ``-inf``) above the diagonal and 0 on it, for every row (a causal mask, no
    padding).

    A row ``i`` then needs only its first ``i + 1`` scores: above the diagonal ``X + M`` is
    ``-3.4e38`` or lower while the row's maximum is at least ``X[i, i]``, so each ``exp`` of
    their difference is 0 exactly (``expf`` is 0 below -104), adds nothing to the sum and
    nothing to ``P @ V``; the maximum is that of the kept scores. Results are unchanged for
    scores below about 1e37 in magnitude (a score that large overflows anyway). With a
    padding mask the diagonal itself may be masked, a row then entirely: its softmax runs over
    all keys, and the rows are not cut.
    """
    pos = info.producer(scores)
    if pos is None or op_name(info.bindings[pos]) != "relax.add":
        return False
    operands = info.bindings[pos].value.args
    mask = next((a for a in operands if any(a.same_as(m) for m in masks)), None)
    if mask is None or mask not in access:
        return False
    shape = shape_of(scores)
    analyzer = tvm.sym.Analyzer()
    if len(shape) < 2 or not analyzer.can_prove_equal(shape[-2], shape[-1]):
        return False
    element = operand(mask, access, len(shape))
    batch = [tirx.Var(f"b{axis}", "int64") for axis in range(len(shape) - 2)]
    row, past = tirx.Var("i", "int64"), tirx.Var("t", "int64")
    for var, extent in [*zip(batch, shape), (row, shape[-1]), (past, shape[-1])]:
        analyzer.bind(var, tvm.ir.Range(0, extent))
    try:
        above = analyzer.simplify(element([*batch, row, row + 1 + past]))
        diagonal = analyzer.simplify(element([*batch, row, row]))
    except TypeError:
        # A mask that reads a tensor inside a comparison (Llama 4's chunks): TVM's simplifier
        # hashes the tensor's placeholder, which has no structural hash. Not proven causal.
        return False
    if not isinstance(above, tirx.FloatImm) or not isinstance(diagonal, tirx.FloatImm):
        return False
    dtype = str(getattr(above.ty, "dtype", above.ty))
    if dtype not in ("float16", "float32", "float64"):
        return False
    return above.value <= float(np.finfo(dtype).min) and diagonal.value == 0.0


def _schedule(
    kernel: tirx.PrimFunc, copy_keys: bool = False, rows: RowLength | None = None
) -> tirx.PrimFunc | None:
    """The kernel's loop nest (see :mod:`blade_relax.transform.fuse_attention`), or ``None``
    where a step fails.

    With ``rows``, the row length is ``i + 1`` under the loop of row ``i`` and the number of
    keys elsewhere (the keys copied for a head); the parameter is then gone."""
    sch = s_tir.Schedule(kernel)
    try:
        pv = sch.get_sblock("matmul_1")
        loops = sch.get_loops(pv)
        row = loops[-3]
        sch.reverse_compute_at(sch.get_sblock("attention"), row, preserve_unit_loops=True)
        # Consumers first: each producer is then computed for the slice its readers need.
        for block in reversed(sch.get_child_blocks(sch.get_sblock("root"))):
            if sch.get(block).name_hint not in ("matmul_1", "attention", "keys"):
                sch.compute_at(block, row, preserve_unit_loops=True)
        if copy_keys and len(loops) > 3:  # the keys of one head at a time
            sch.compute_at(sch.get_sblock("keys"), loops[-4], preserve_unit_loops=True)
        for name in (*(("matmul",) if copy_keys else ()), *_REDUCTION_OUTSIDE):
            block = sch.get_sblock(name)
            spatial, reduce = sch.get_loops(block)[-2:]
            sch.reorder(reduce, spatial)
            sch.decompose_reduction(block, reduce)
        if not copy_keys:  # keys read in place: one dot product (along a row of K) per score
            scores = sch.get_sblock("matmul")
            sch.decompose_reduction(scores, sch.get_loops(scores)[-1])
        # The tail's loop has no iteration where s % 16 == 0, and an init inside the loop (TVM
        # lowers it to ``if t == 0``) would then never run.
        tail = sch.get_sblock("row_max_tail")
        sch.decompose_reduction(tail, sch.get_loops(tail)[-1])
        row_var = sch.get(row).loop_var
    except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
        return None
    kernel = sch.mod["main"]
    if rows is None:
        return kernel
    # A row length of ``i + 1`` makes the extents of blocks under the row loop depend on
    # that loop, which a block with iteration variables may not: the blocks become opaque
    # first (TVM's lowering does the same a few passes later).
    lowered = tvm.IRModule({"main": kernel})
    lowered = s_tir.transform.ConvertBlocksToOpaque()(s_tir.transform.LowerInitBlock()(lowered))
    kernel = lowered["main"]
    length, keys = rows

    def under_row(loop: tirx.For, mutator: Any) -> Any:
        if not loop.loop_var.same_as(row_var):
            return mutator.default_mutate(loop)
        return tvm_ffi.structural_map(
            loop, [(tirx.Var, lambda var: row_var + 1 if var.same_as(length) else var)]
        )

    kernel = kernel.with_body(tvm_ffi.structural_mutate(kernel.body, [(tirx.For, under_row)]))
    return kernel.specialize({length: keys})

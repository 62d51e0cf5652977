"""FuseAttention: an attention block becomes one kernel that never holds its score matrix.

An imported attention layer is a chain of whole-tensor operators: ``S = Q @ K^T`` (a
``(b, h, s, s)`` tensor), a scale and a mask, ``P = softmax(S)`` (another ``(b, h, s, s)``
tensor), ``O = P @ V``; around it the heads are cut out of a fused ``qkv`` projection by a
``split`` (three copies) and moved into place by ``permute_dims`` (three more), and the result
is moved back. ``FuseOps`` never puts two matmuls in one kernel, so every one of these tensors
is materialized: at long lengths the two score tensors dominate the peak of an inference step,
at short lengths the ``split`` copies next to ``qkv`` do. ``torch.compile`` reads the heads as
strided views and calls a flash-attention kernel, which holds neither.

This pass replaces the chain by one kernel (``call_tir``), built with TE and scheduled here:

* every layout operator of the group is an *index map*, so the kernel reads ``Q``, ``K`` and
  ``V`` where they lie in ``qkv`` and writes its result in the layout its reader wants. TVM's
  own route (group the operators, ``LegalizeOps``, ``FuseTIR``) was tried first: the legalized
  ``reshape`` ravels and unravels over the whole shape, leaving ``floormod(x, s)`` index terms
  that TVM's simplifier cannot remove for a symbolic ``s``, and no schedule can then relate
  the loops. Here reshape axes are matched in groups of equal size, so indices stay affine;
* the two matmuls are TE reductions in ascending ``k``, as ``relax.matmul`` legalizes, and the
  softmax computes what ``topi.nn.softmax`` computes, in the same order, so results are
  those of the unfused graph bit for bit;
* the kernel computes one row of scores at a time, for each head (batch axes) and query row
  ``i``, and keeps no ``(b, h, s, s)`` tensor.

The loop nest
-------------
Written for the CPU, where each inner loop should run over contiguous elements so that LLVM
vectorizes it (a scalar reduction chain is bound by the latency of its adds)::

    for each head:
        for i in s:                                # one row of scores
            S[j] = 0;  for j in s: for k in d: S[j] += Q[i, k] * K[j, k]
            M[l] = max over jo < s // 16 of X[16 jo + l]   (X = S scaled and masked)
            m = max(max over l of M[l], max over the last s % 16 of X)
            E[j] = exp(X[j] - m)                   # once per score
            z = sum over j of E[j]                 # in ascending j, as topi's softmax
            O[d] = 0;  for k in s: for d in dh: O[d] += E[k] / z * V[k, d]
            out[i, head, :] = O                    # in the layout of the reader

Per element the matmuls keep their ascending order (their loops are only interchanged), and
a maximum does not depend on the order, so the 16 lanes of ``M`` change no value: results
stay those of the unfused graph bit for bit (on a target without fused multiply-adds, where
LLVM cannot contract differently shaped loops differently). Lanes for the sum ``z``, or a
split of ``P @ V``, would make the kernel 16% (7%) faster at ``s = 256`` and change its
rounding, and were left out for that reason. ``E[k] / z`` is computed as ``P @ V`` reads it
(the quotient is invariant in the ``d`` loop), so no row of ``P`` is kept. The scratch is the
row of scores (``E`` takes its place after TVM's storage rewrite), 16 lanes for the maximum
and ``d`` accumulators: less than the plain kernel's two rows once ``s`` exceeds ``16 + d``.

With ``AttentionOptions.copy_keys`` the kernel first copies ``K^T`` of each head
(``keys[k, j] = K[j, k]``, under the head loop) and computes a row of scores as
``for k in d: for j in s: S[j] += Q[i, k] * keys[k, j]``: vector multiply-adds along the row
instead of ``s`` dot products of length ``d`` (the kernel 3.3 times faster on gpt2-infer's
attention at ``s = 256``, same results). It costs ``d * s`` elements of scratch while the
kernel runs, and the attention call is often the step's peak (it is in the benchmark's
gpt2-infer at every length). So by default (``copy_keys_within_mask``) the keys are copied
only where the kernel has taken the place of a mask tensor (below) and the copy fits in the
bytes that mask held: a branch on the dims (``s >= d`` for a float32 ``(1, 1, s, s)`` mask),
the keys read in place elsewhere; the copy's extent is ``s`` or 0 by the same test, so the
kernel's workspace says what it holds at every length.

The mask
--------
A Hugging Face model adds a mask to the scores that it builds from indices: an ``arange``
compared with another (causal), a padding mask indexed, a ``where`` of 0 and the lowest
float. Materialized, it is a ``(b, 1, s, s)`` tensor live from the first attention to the
last, on the peak of an inference step. With ``AttentionOptions.absorb_masks`` the bindings
that build it (operators of ``_MASK_OPS``, followed upstream from the score operator) are
copied into every kernel that adds it, as accessors like the layout operators: each kernel
computes the mask element it adds, as TVM's kernels would (the same comparisons, ``Select``
and casts: results unchanged), from tensors with fewer symbolic axes (an index, the ``(b, s)``
padding mask). The original bindings are left for their other readers and removed when none
is left.

Where the kernel computes a causal mask and proves it (``AttentionOptions.stop_rows``), row
``i`` stops at the diagonal: its scores, maximum, sum and ``P @ V`` run over ``i + 1`` keys,
the rest adding exact zeros (see ``_masked_above_diagonal``); half the work at the same
results. The stages are written over a row length that the schedule, once done, sets to
``i + 1`` under the row loop (the blocks made opaque first) and to ``s`` outside it.

The loops are built with TE and an ``s_tir.Schedule`` (``compute_at`` under the row loop,
``reorder`` and ``decompose_reduction`` of the reductions), which work for a symbolic ``s``.
Where a schedule step fails, the kernel is the plain TE one (``topi.nn.softmax``, keys read
in place), which ``InlineKernelIntermediates`` (its ``rows`` stage) computes row by row; it
finds nothing to do in the scheduled kernel.

The group
---------
*Core*: ``P = softmax(X, axis=-1)`` where ``X`` is reached from a matmul ``S`` through
elementwise operators with one other operand each (a scale, a mask) and
``reshape``/``broadcast_to``; and ``O = matmul(P', V)`` where ``P'`` is ``P`` through
``reshape``/``broadcast_to``. Every value of the core except ``O`` has exactly one reader, the
next one in the chain.

*Masks*: the bindings that build a mask the core adds (see above); they may be copied into
several groups.

*Extensions*: a binding of a layout operator (``reshape``, ``permute_dims``,
``broadcast_to``, ``expand_dims``, ``squeeze``, ``split`` and its items) joins the group when
every reader of its value is in the group (upstream); so does the layout reader of the result
while it is the only reader (downstream). A value read after its block or by a binding outside
the group never becomes internal to it. Other inputs (the mask) are read as tensors.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps``; in :func:`blade_relax.get_pipeline` it is the
first pass (``SimplifyTransposes`` would turn the score matmul into an ``NT_matmul`` kernel
this pass does not match; the transposes it would cancel are index maps here anyway). On CPU
targets only: the loop nest is written for one, and on a GPU the kernel would need a schedule
dlight does not have.

What it assumes
---------------
A normalized module with dataflow blocks. Functions already marked ``Primitive`` or
``Codegen`` are left alone, as is every chain that does not match (a softmax whose result is
also read elsewhere, as in a training graph whose backward reads it; a chain without a
matmul, an operator or a reshape the kernel builder does not handle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx, topi

from ..symbolic import is_integer
from ._block_edit import rewrite_dataflow_blocks, vars_read_after
from ._collection import pauses_collection
from .result import PassResult, counted, function_results, publish

__all__ = ["AttentionOptions", "AttentionReport", "FuseAttention"]

#: Operators that only move data: an attention group may absorb them on either side.
_LAYOUT_OPS = frozenset(
    {
        "relax.reshape",
        "relax.permute_dims",
        "relax.broadcast_to",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.split",
    }
)
_LAYOUT_NAMES = _LAYOUT_OPS | {"TupleGetItem"}
#: Layout readers of the result the group may take (a split's items would leave the group).
_RESULT_LAYOUT_OPS = _LAYOUT_OPS - {"relax.split"}

#: Elementwise operators allowed between the score matmul and the softmax (scale, mask).
_SCORE_OPS = frozenset(
    {
        "relax.add",
        "relax.subtract",
        "relax.multiply",
        "relax.divide",
        "relax.maximum",
        "relax.minimum",
    }
)
#: Operators that only change the shape between the matmuls and the softmax.
_RESHAPE_OPS = frozenset({"relax.reshape", "relax.broadcast_to"})

#: Comparisons a mask is built of, as TE expressions (``topi.less`` and its kin).
_COMPARISONS: dict[str, Callable[[tvm.ir.Expr, tvm.ir.Expr], tvm.ir.Expr]] = {
    "relax.less": lambda a, b: a < b,
    "relax.less_equal": lambda a, b: a <= b,
    "relax.greater": lambda a, b: a > b,
    "relax.greater_equal": lambda a, b: a >= b,
    "relax.equal": lambda a, b: a == b,
    "relax.not_equal": lambda a, b: a != b,
}
#: Logical operators of a mask (on ``bool`` tensors, which is all a mask holds).
_LOGICAL_OPS = frozenset(
    {
        "relax.bitwise_and",
        "relax.bitwise_or",
        "relax.logical_and",
        "relax.logical_or",
        "relax.logical_not",
    }
)
#: Operators that make a tensor from its shape and a value, reading no element.
_FILL_OPS = frozenset({"relax.full", "relax.full_like", "relax.zeros", "relax.ones"})
#: Operators a mask may be computed with inside the kernel (see :func:`_mask_bindings`):
#: index generators, comparisons, logic, selection, casts, arithmetic and layout.
_MASK_OPS = (
    frozenset({"relax.arange", "relax.where", "relax.astype", "relax.index_tensor"})
    | _FILL_OPS
    | _LOGICAL_OPS
    | frozenset(_COMPARISONS)
    | _SCORE_OPS
    | _LAYOUT_OPS
)


@dataclass(frozen=True)
class AttentionOptions:
    """Options of :class:`FuseAttention`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    absorb_inputs
        Let the group absorb the layout operators that only it reads (the ``split`` of
        ``qkv``, the head transposes) and the layout readers of its result; without it only
        the core chain is grouped.
    max_group
        The most bindings one group may have.
    absorb_masks
        Compute the mask added to the scores inside the kernel, from what it is built of (an
        ``arange`` compared with another, a padding mask indexed), instead of reading it as
        a ``(b, 1, s, s)`` tensor that lives from its producer to the last attention: the
        bindings that build it are copied into each kernel that reads it (see
        :func:`_mask_bindings`); the tensor is then no longer computed.
    copy_keys
        Copy the keys of one head, transposed, into the kernel's scratch, so that a row of
        scores is vector multiply-adds along the row (the score matmul about 3 times faster
        on an AVX-512 CPU at ``s = 256``; results unchanged). It costs ``d * s`` elements of
        scratch while the kernel runs, where the attention call is often the step's peak:
        off by default, so that the kernel never holds more than the rows it computes.
    copy_keys_within_mask
        Where the kernel computes its mask (``absorb_masks``) and that mask tensor then no
        longer exists, copy the keys of a head at run time where they take at most the
        mask's bytes (a float32 ``(1, 1, s, s)`` mask and heads of width ``d``: ``s >= d``)
        and read them in place elsewhere: the copy then fits in what the mask held, and no
        peak rises.
    stop_rows
        Where the kernel computes a causal mask without padding (the lowest float above the
        diagonal, 0 on it, proven from its expression), row ``i`` computes its first
        ``i + 1`` scores only: half the work, the same results (see
        :func:`_masked_above_diagonal`).
    """

    enabled: bool = True
    absorb_inputs: bool = True
    max_group: int = 96
    absorb_masks: bool = True
    copy_keys: bool = False
    copy_keys_within_mask: bool = True
    stop_rows: bool = True

    def __post_init__(self) -> None:
        if self.max_group < 4:
            raise ValueError(f"max_group must be at least 4, got {self.max_group}")


@dataclass
class AttentionReport:
    """What one run changed: attention chains ``fused``, with ``absorbed`` extra bindings, and
    ``masks`` bindings that build a mask copied into the kernels."""

    fused: int = 0
    absorbed: int = 0
    masks: int = 0


def _op_name(binding: relax.Binding) -> str | None:
    value = binding.value
    if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call):
        if isinstance(value.op, tvm.ir.Op):
            return value.op.name
    if isinstance(binding, relax.VarBinding) and isinstance(value, relax.TupleGetItem):
        return "TupleGetItem"
    return None


def _tensor_args(binding: relax.Binding) -> list[relax.Var]:
    value = binding.value
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value] if isinstance(value.tuple_value, relax.Var) else []
    if not isinstance(value, relax.Call):
        return []
    return [a for a in value.args if isinstance(a, relax.Var)]


class _Block:
    """Definitions and readers of the variables of one dataflow block."""

    def __init__(self, block: relax.DataflowBlock, read_after: set[relax.Var]) -> None:
        self.bindings = list(block.bindings)
        self.position = {b.var: i for i, b in enumerate(self.bindings)}
        self.readers: dict[relax.Var, set[int]] = {}
        for i, binding in enumerate(self.bindings):
            for var in relax.analysis.free_vars(binding.value):
                self.readers.setdefault(var, set()).add(i)
        self.escaping = {b.var for b in self.bindings if not isinstance(b.var, relax.DataflowVar)}
        self.escaping |= read_after

    def sole_reader(self, var: relax.Var) -> int | None:
        readers = self.readers.get(var, set())
        if var in self.escaping or len(readers) != 1:
            return None
        return next(iter(readers))

    def producer(self, var: relax.Var) -> int | None:
        return self.position.get(var)


def _is_matmul(binding: relax.Binding) -> bool:
    return _op_name(binding) == "relax.matmul"


def _softmax_axis_is_last(binding: relax.Binding) -> bool:
    call = binding.value
    ndim = call.args[0].ty.ndim
    axis = int(call.attrs.axis)
    return axis == -1 or (ndim > 0 and axis == ndim - 1)


def _core(info: _Block, softmax_pos: int) -> list[int] | None:
    """Positions of the core chain around the softmax at ``softmax_pos`` (see the module
    docstring), or ``None`` when it does not match."""
    bindings = info.bindings
    chain = [softmax_pos]
    current = bindings[softmax_pos].value.args[0]
    # Backwards to the score matmul.
    while True:
        if not isinstance(current, relax.Var) or info.sole_reader(current) is None:
            return None
        pos = info.producer(current)
        if pos is None:
            return None
        binding = bindings[pos]
        name = _op_name(binding)
        if _is_matmul(binding):
            chain.append(pos)
            break
        if name in _RESHAPE_OPS or name in _SCORE_OPS:
            chain.append(pos)
            # The scores flow through one operand; the others are the scale or the mask.
            operands = [a for a in binding.value.args if isinstance(a, relax.Var)]
            scores = [a for a in operands if _reaches_matmul(info, a)]
            if len(scores) != 1:
                return None
            current = scores[0]
            continue
        return None
    # Forwards to the output matmul.
    current = bindings[softmax_pos].var
    while True:
        reader = info.sole_reader(current)
        if reader is None:
            return None
        binding = bindings[reader]
        name = _op_name(binding)
        if _is_matmul(binding):
            if not binding.value.args[0].same_as(current):
                return None
            chain.append(reader)
            break
        if name in _RESHAPE_OPS and binding.value.args[0].same_as(current):
            chain.append(reader)
            current = binding.var
            continue
        return None
    return sorted(chain)


def _reaches_matmul(info: _Block, var: relax.Var, depth: int = 8) -> bool:
    """Whether ``var`` is a matmul's result through at most ``depth`` reshape/score
    operators of the block."""
    pos = info.producer(var)
    if pos is None or depth == 0:
        return False
    binding = info.bindings[pos]
    if _is_matmul(binding):
        return True
    name = _op_name(binding)
    if name not in _RESHAPE_OPS and name not in _SCORE_OPS:
        return False
    return any(
        _reaches_matmul(info, a, depth - 1) for a in binding.value.args if isinstance(a, relax.Var)
    )


def _extend(info: _Block, group: set[int], options: AttentionOptions) -> set[int]:
    """The group with the layout bindings only it reads (upstream: the heads cut out of
    ``qkv``) and the layout readers of its result while each is the only one (downstream)."""
    group = set(group)
    last = max(group)
    while len(group) < options.max_group:
        reader = info.sole_reader(info.bindings[last].var)
        if reader is None or _op_name(info.bindings[reader]) not in _RESULT_LAYOUT_OPS:
            break
        group.add(reader)
        last = reader
    changed = True
    while changed and len(group) < options.max_group:
        changed = False
        for pos in sorted(group):
            for var in _tensor_args(info.bindings[pos]):
                producer = info.producer(var)
                if producer is None or producer in group or var in info.escaping:
                    continue
                if _op_name(info.bindings[producer]) not in _LAYOUT_NAMES:
                    continue
                if not info.readers.get(var, set()) <= group:
                    continue
                group.add(producer)
                changed = True
    return group


def _symbolic_axes(var: relax.Expr) -> int | None:
    """How many axes of ``var``'s shape are not constants (``None``: not a tensor of known
    shape)."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return sum(1 for extent in ty.shape.values if _const_int(extent) is None)


def _is_mask_op(binding: relax.Binding) -> bool:
    if isinstance(binding, relax.VarBinding) and isinstance(binding.value, tvm.ir.expr.Constant):
        return _constant_array(binding.value).ndim == 0
    return _op_name(binding) in _MASK_OPS


def _element_reads(binding: relax.Binding) -> list[relax.Var]:
    """The tensors whose elements ``binding`` reads (a fill reads its template's shape only)."""
    if _op_name(binding) in _FILL_OPS:
        return []
    return [
        v for v in relax.analysis.free_vars(binding.value) if isinstance(v.ty, relax.TensorType)
    ]


def _mask_bindings(
    info: _Block, core: Sequence[int], group: set[int]
) -> tuple[set[int], list[relax.Var]]:
    """Positions of the bindings that build the masks the ``core`` adds to its scores, to be
    computed inside the kernel (:attr:`AttentionOptions.absorb_masks`), and the masks.

    A mask is an operand of a score operator that does not come from the score matmul. Its
    bindings are followed upstream while each is an operator of :data:`_MASK_OPS` (or a
    scalar constant); the tensors where the walk stops become inputs of the kernel. They are
    taken only when every such input has fewer symbolic axes than the mask itself (an
    ``(s,)`` index or a ``(b, s)`` padding mask for a ``(b, 1, s, s)`` mask), so that the
    kernel reads less than the mask would hold. The bindings stay where they are for their
    other readers (another layer's attention reads the same mask); once no reader is left,
    ``DeadCodeElimination`` removes them.
    """
    chosen: set[int] = set()
    masks: list[relax.Var] = []
    for pos in core:
        binding = info.bindings[pos]
        if _op_name(binding) not in _SCORE_OPS:
            continue
        for operand in binding.value.args:
            if not isinstance(operand, relax.Var) or _reaches_matmul(info, operand):
                continue
            found = _generated_by(info, operand, group)
            if found and _reads_less(info, found, operand):
                chosen |= found
                masks.append(operand)
    return chosen, masks


def _dims_of(shape: Sequence[tvm.ir.Expr]) -> set[tirx.Var]:
    """The symbolic dims a shape's extents use."""
    return {var for extent in shape for var in tirx.analysis.undefined_vars(extent)}


def _freed_mask_bytes(
    info: _Block, masks: Sequence[relax.Var], result: relax.Var
) -> tvm.ir.Expr | None:
    """Bytes of the masks that no longer exist once every attention computes them itself:
    masks read only by score operators of attention chains, inside the block, whose shapes
    use no dim the kernel's result does not (the kernel must be able to compute the figure).
    ``None`` when there is none."""
    dims = _dims_of(_shape(result))
    total = None
    for mask in dict.fromkeys(masks):
        readers = info.readers.get(mask, set())
        if mask in info.escaping or not all(
            _op_name(info.bindings[r]) in _SCORE_OPS
            and any(_reaches_matmul(info, a) for a in _tensor_args(info.bindings[r]))
            for r in readers
        ):
            continue
        shape = _shape(mask)
        if not _dims_of(shape) <= dims:
            continue
        nbytes = tirx.IntImm("int64", tvm.DataType(str(mask.ty.dtype)).bits // 8)
        for extent in shape:
            nbytes = nbytes * extent
        total = nbytes if total is None else total + nbytes
    return total


def _generated_by(info: _Block, var: relax.Var, group: set[int]) -> set[int]:
    """The bindings of the block that compute ``var`` with mask operators, upstream to the
    first tensor that is not (empty when ``var`` itself is not computed so)."""
    found: set[int] = set()
    pending = [var]
    while pending:
        pos = info.producer(pending.pop())
        if pos is None or pos in found or pos in group:
            continue
        binding = info.bindings[pos]
        if not _is_mask_op(binding) or len(found) >= _MAX_MASK_BINDINGS:
            continue
        found.add(pos)
        pending.extend(_element_reads(binding))
    return found


#: The most bindings one mask may take into a kernel (each is an operation per score).
_MAX_MASK_BINDINGS = 48


def _reads_less(info: _Block, found: set[int], mask: relax.Var) -> bool:
    """Whether every tensor the bindings ``found`` read from outside has fewer symbolic axes
    than ``mask``."""
    axes = _symbolic_axes(mask)
    defined = {info.bindings[p].var for p in found}
    for pos in found:
        for var in _element_reads(info.bindings[pos]):
            if var in defined:
                continue
            outside = _symbolic_axes(var)
            if axes is None or outside is None or outside >= axes:
                return False
    return True


# The kernel. Every value of the group is an *accessor* (index -> element expression): layout
# operators compose index maps, so the heads are read where they lie in ``qkv``; only the two
# matmuls and the softmax are TE stages.

Accessor = Callable[[Sequence[tvm.ir.Expr]], tvm.ir.Expr]


class _Unsupported(Exception):
    """The group uses an operator or a shape the kernel builder does not handle."""


def _shape(var: relax.Expr) -> list[tvm.ir.Expr]:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise _Unsupported("a tensor of unknown shape")
    return list(ty.shape.values)


def _const_int(expr: tvm.ir.Expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def _zero(shape: Sequence[tvm.ir.Expr]) -> tvm.ir.Expr:
    return tirx.IntImm(str(shape[0].ty) if shape else "int64", 0)


def _reshape_map(
    src: Sequence[tvm.ir.Expr], dst: Sequence[tvm.ir.Expr]
) -> Callable[[Sequence[tvm.ir.Expr]], list[tvm.ir.Expr]]:
    """Index map of ``reshape(src -> dst)``: a destination index -> the source index.

    ``topi.reshape`` ravels and unravels over the whole shape, which leaves ``floormod(x, s)``
    terms TVM's simplifier cannot remove for a symbolic ``s`` (and schedules then cannot
    relate the loops). Here the axes are matched in groups of equal size (unit axes apart, a
    symbolic axis only with an equal one, constant axes merged or split), so every index is a
    mixed-radix conversion over constant extents.
    """
    analyzer = tvm.sym.Analyzer()
    src_axes = [i for i, e in enumerate(src) if _const_int(e) != 1]
    dst_axes = [i for i, e in enumerate(dst) if _const_int(e) != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src_axes) and j < len(dst_axes):
        a, b = src[src_axes[i]], dst[dst_axes[j]]
        if analyzer.can_prove_equal(a, b):
            groups.append(([src_axes[i]], [dst_axes[j]]))
            i, j = i + 1, j + 1
            continue
        size_a, size_b = _const_int(a), _const_int(b)
        if size_a is None or size_b is None:
            raise _Unsupported("a reshape mixes a symbolic axis with others")
        group_src, group_dst = [src_axes[i]], [dst_axes[j]]
        i, j = i + 1, j + 1
        while size_a != size_b:
            if size_a < size_b:
                extent = _const_int(src[src_axes[i]]) if i < len(src_axes) else None
                if extent is None:
                    raise _Unsupported("reshape groups do not line up")
                size_a *= extent
                group_src.append(src_axes[i])
                i += 1
            else:
                extent = _const_int(dst[dst_axes[j]]) if j < len(dst_axes) else None
                if extent is None:
                    raise _Unsupported("reshape groups do not line up")
                size_b *= extent
                group_dst.append(dst_axes[j])
                j += 1
        groups.append((group_src, group_dst))
    if i != len(src_axes) or j != len(dst_axes):
        raise _Unsupported("a reshape that changes the size")

    def index_map(idx: Sequence[tvm.ir.Expr]) -> list[tvm.ir.Expr]:
        out = [_zero(src) for _ in src]
        for group_src, group_dst in groups:
            flat = idx[group_dst[0]]
            for axis in group_dst[1:]:
                flat = flat * dst[axis] + idx[axis]
            for axis in reversed(group_src[1:]):
                out[axis] = tirx.floormod(flat, src[axis])
                flat = tirx.floordiv(flat, src[axis])
            out[group_src[0]] = flat
        return out

    return index_map


def _broadcast_index(idx: Sequence[tvm.ir.Expr], src: Sequence[tvm.ir.Expr]) -> list[tvm.ir.Expr]:
    """The index into a tensor of shape ``src`` broadcast (numpy rules) to ``len(idx)`` axes."""
    offset = len(idx) - len(src)
    if offset < 0:
        raise _Unsupported("a broadcast to a lower rank")
    return [
        _zero(src) if _const_int(extent) == 1 else idx[offset + axis]
        for axis, extent in enumerate(src)
    ]


def _elementwise(name: str, lhs: tvm.ir.Expr, rhs: tvm.ir.Expr) -> tvm.ir.Expr:
    if name == "relax.add":
        return lhs + rhs
    if name == "relax.subtract":
        return lhs - rhs
    if name == "relax.multiply":
        return lhs * rhs
    if name == "relax.divide":
        return lhs / rhs
    if name == "relax.maximum":
        return tirx.max(lhs, rhs)
    return tirx.min(lhs, rhs)


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
        a_idx = [*_broadcast_index(idx[:-2], a_shape[:-2]), i, k]
        b_idx = [*_broadcast_index(idx[:-2], b_shape[:-2]), k, j]
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


def _elements(accessor: Accessor) -> Callable[..., tvm.ir.Expr]:
    """A TE compute body (one argument per axis) from an accessor."""
    return lambda *idx: accessor(idx)


def _of_tensor(tensor: te.Tensor) -> Accessor:
    return lambda idx: tensor(*idx)


def _constant_array(expr: tvm.ir.expr.Constant) -> np.ndarray:
    value = expr.value
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def _operand(expr: relax.Expr, access: dict, rank: int) -> Accessor:
    """An argument of an elementwise operator, broadcast to ``rank`` axes."""
    if isinstance(expr, tvm.ir.expr.Constant):
        data = _constant_array(expr)
        if data.ndim != 0:
            raise _Unsupported("a constant that is not a scalar")
        value = tirx.const(data.item(), str(data.dtype))
        return lambda idx: value
    if expr not in access:
        raise _Unsupported("an operand outside the group")
    src, inner = _shape(expr), access[expr]
    return lambda idx: inner(_broadcast_index(idx, src))


def _mask_accessor(
    name: str, call: relax.Call, shape: Sequence[tvm.ir.Expr], dtype: str, access: dict
) -> Accessor:
    """The elements of a mask operator's result, as TVM's legalization computes them."""
    args, rank = call.args, len(shape)
    if name in _FILL_OPS:
        fill = {"relax.zeros": 0, "relax.ones": 1}.get(name)
        if fill is None:
            if not isinstance(args[1], tvm.ir.expr.Constant):
                raise _Unsupported("a fill with a value that is not a constant")
            data = _constant_array(args[1])
            if data.ndim != 0:
                raise _Unsupported("a fill with a value that is not a constant scalar")
            fill = data.item()
        value = tirx.const(fill, dtype)
        return lambda idx: value
    if name == "relax.arange":
        start, _end, step = (getattr(a, "value", a) for a in args)
        start, step = (tirx.IntImm("int64", x) if isinstance(x, int) else x for x in (start, step))
        if not dtype.startswith("int") or not all(is_integer(x) for x in (start, step)):
            raise _Unsupported("an arange that is not of integers")
        return lambda idx: tirx.Cast(dtype, start + step * idx[0])
    if name == "relax.astype":
        inner = _operand(args[0], access, rank)
        return lambda idx: tirx.Cast(dtype, inner(idx))
    if name == "relax.where":
        if str(args[0].ty.dtype) != "bool":
            raise _Unsupported("a where whose condition is not bool")
        cond, then, other = (_operand(a, access, rank) for a in args)
        return lambda idx: tirx.Select(cond(idx), then(idx), other(idx))
    if name in _COMPARISONS:
        lhs, rhs, compare = (*(_operand(a, access, rank) for a in args), _COMPARISONS[name])
        return lambda idx: compare(lhs(idx), rhs(idx))
    if name in _LOGICAL_OPS:
        if any(str(a.ty.dtype) != "bool" for a in args):
            raise _Unsupported(f"{name} of tensors that are not bool")
        operands = [_operand(a, access, rank) for a in args]
        if name == "relax.logical_not":
            return lambda idx: tirx.Not(operands[0](idx))
        combine = tirx.And if name.endswith("_and") else tirx.Or
        return lambda idx: combine(operands[0](idx), operands[1](idx))
    return _index_tensor(args, access)


def _index_tensor(args: Sequence[relax.Expr], access: dict) -> Accessor:
    """``index_tensor(data, (i0, ..., ik))`` as ``topi.adv_index`` computes it: the indices
    broadcast to one shape, read as they are (no wrap of negative ones)."""
    data, indices = args
    if not isinstance(indices, relax.Tuple) or data not in access:
        raise _Unsupported("an index_tensor of tensors outside the group")
    index_shapes = [_shape(i) for i in indices.fields]
    if any(i not in access for i in indices.fields):
        raise _Unsupported("an index_tensor of tensors outside the group")
    width = max(len(shape) for shape in index_shapes)
    inner, readers = access[data], [access[i] for i in indices.fields]

    def element(idx):
        front = [
            read(_broadcast_index(idx[:width], shape)) for read, shape in zip(readers, index_shapes)
        ]
        return inner([*front, *idx[width:]])

    return element


def _keys_stage(
    keys: Accessor, shape: Sequence[tvm.ir.Expr], dtype: str, copy_keys: KeysCopy
) -> Accessor:
    """The keys ``(..., d, s)`` read through a ``keys`` stage (``copy_keys`` is ``True``), or
    through one whose last axis is ``s`` where one head's keys (``d * s`` elements) take at most
    ``copy_keys`` bytes and 0 elsewhere: the score matmul then reads the copy where it exists
    and the keys in place where it does not (a branch on the dims, the same for every score,
    which LLVM takes out of the loops)."""
    if copy_keys is True:
        return _of_tensor(te.compute(shape, _elements(keys), name="keys"))
    head = shape[-2] * shape[-1] * (tvm.DataType(dtype).bits // 8)
    fits = copy_keys >= head
    # 1 where the copy fits, else 0: integer arithmetic, which the workspace sizes express.
    length = shape[-1] * tirx.min(1, tirx.floordiv(copy_keys, tirx.max(head, 1)))
    copied = te.compute([*shape[:-1], length], _elements(keys), name="keys")
    return lambda idx: tirx.if_then_else(fits, copied(*idx), keys(idx))


def _permuted(inner: Accessor, axes: Sequence[int]) -> Accessor:
    def access(idx):
        src_idx = [idx[0]] * len(axes)
        for position, axis in enumerate(axes):
            src_idx[axis] = idx[position]
        return inner(src_idx)

    return access


def _shifted(inner: Accessor, axis: int, start: int) -> Accessor:
    def access(idx):
        idx = list(idx)
        idx[axis] = idx[axis] + start
        return inner(idx)

    return access


#: How the kernel reads the keys: in place (``False``), copied (``True``), or copied where one
#: head's keys take at most the bytes of an integer expression over the dims, in place
#: elsewhere (see :func:`_keys_stage`).
KeysCopy = bool | tvm.ir.Expr


def _build_kernel(
    info: _Block,
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
    _Unsupported
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


#: The length of a row of scores the kernel computes, as a parameter of the unscheduled
#: kernel, and what it stands for outside the row loop (the number of keys): see
#: :func:`_masked_above_diagonal`.
RowLength = tuple[tirx.Var, tvm.ir.Expr]


def _kernel(
    info: _Block,
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
    members = {info.bindings[p].var for p in group}
    inputs: list[relax.Var] = []
    for pos in group:
        binding = info.bindings[pos]
        reads = _element_reads(binding)
        for var in relax.analysis.free_vars(binding.value):
            if isinstance(var.ty, tvm.ir.PrimType) or var in members or var in inputs:
                continue  # symbolic dims are bound by the inputs' shapes
            if not isinstance(var.ty, relax.TensorType):
                raise _Unsupported("an input that is not a tensor")
            if var in reads:
                inputs.append(var)
    placeholders = [te.placeholder(_shape(v), str(v.ty.dtype), v.name) for v in inputs]
    access: dict[relax.Var, Accessor] = {v: _of_tensor(t) for v, t in zip(inputs, placeholders)}
    splits: dict[relax.Var, tuple[relax.Var, list[int], int]] = {}
    matmuls: list[relax.Var] = []
    rows: RowLength | None = None
    for pos in group:
        binding = info.bindings[pos]
        var, value, name = binding.var, binding.value, _op_name(binding)
        if name == "TupleGetItem":
            source, starts, axis = splits[value.tuple_value]
            access[var] = _shifted(access[source], axis, starts[value.index])
            continue
        if isinstance(value, tvm.ir.expr.Constant):  # a scalar of a mask
            access[var] = _operand(value, access, 0)
            continue
        if name in _MASK_OPS and name not in _LAYOUT_OPS and name not in _SCORE_OPS:
            access[var] = _mask_accessor(name, value, _shape(var), str(var.ty.dtype), access)
            continue
        args = value.args
        if name == "relax.split":
            src = _shape(args[0])
            axis = int(value.attrs.axis) % len(src)
            sections = value.attrs.indices_or_sections
            if isinstance(sections, (int, tirx.IntImm)):
                extent = _const_int(src[axis])
                if extent is None or extent % int(sections):
                    raise _Unsupported("a split of a symbolic axis")
                starts = [extent // int(sections) * n for n in range(int(sections))]
            else:
                starts = [0, *(int(x) for x in sections)]
            splits[var] = (args[0], starts, axis)
            continue
        out_shape = _shape(var)
        if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
            index_map = _reshape_map(_shape(args[0]), out_shape)
            inner = access[args[0]]
            access[var] = lambda idx, inner=inner, index_map=index_map: inner(index_map(idx))
        elif name == "relax.permute_dims":
            axes = value.attrs.axes
            rank = len(out_shape)
            axes = list(reversed(range(rank))) if axes is None else [int(a) for a in axes]
            access[var] = _permuted(access[args[0]], axes)
        elif name == "relax.broadcast_to":
            access[var] = _operand(args[0], access, len(out_shape))
        elif name in _SCORE_OPS:
            rank = len(out_shape)
            lhs, rhs = _operand(args[0], access, rank), _operand(args[1], access, rank)
            access[var] = lambda idx, lhs=lhs, rhs=rhs, name=name: _elementwise(
                name, lhs(idx), rhs(idx)
            )
        elif name == "relax.matmul":
            a_shape, b_shape = _shape(args[0]), _shape(args[1])
            if len(a_shape) < 2 or len(b_shape) < 2:
                raise _Unsupported("a matmul of a vector")
            rhs = access[args[1]]
            if scheduled and copy_keys is not False and not matmuls:
                # The keys as a stage, contiguous along a row of scores (see _schedule).
                rhs = _keys_stage(rhs, b_shape, str(args[1].ty.dtype), copy_keys)
            # P @ V reads the first ``length`` probabilities of a row where the rows stop.
            length = rows[0] if rows is not None and matmuls else None
            matmuls.append(var)
            access[var] = _of_tensor(
                _matmul(
                    access[args[0]], a_shape, rhs, b_shape, out_shape, str(var.ty.dtype), length
                )
            )
        elif name == "relax.nn.softmax" and scheduled:
            if stop_rows and _masked_above_diagonal(info, args[0], masks, access):
                rows = (tirx.Var("row_length", "int64"), out_shape[-1])
            access[var] = _softmax(access[args[0]], out_shape, rows and rows[0])
        elif name == "relax.nn.softmax":
            scores = te.compute(out_shape, _elements(access[args[0]]), name="scores")
            access[var] = _of_tensor(topi.nn.softmax(scores, axis=len(out_shape) - 1))
        else:
            raise _Unsupported(str(name))
    result = info.bindings[group[-1]].var
    out = te.compute(_shape(result), _elements(access[result]), name="attention")
    params = [*placeholders, out, *([rows[0]] if rows is not None else [])]
    return te.create_prim_func(params, index_dtype_override="int64"), inputs, rows


def _masked_above_diagonal(
    info: _Block, scores: relax.Var, masks: Sequence[relax.Var], access: dict
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
    if pos is None or _op_name(info.bindings[pos]) != "relax.add":
        return False
    operands = info.bindings[pos].value.args
    mask = next((a for a in operands if any(a.same_as(m) for m in masks)), None)
    if mask is None or mask not in access:
        return False
    shape = _shape(scores)
    analyzer = tvm.sym.Analyzer()
    if len(shape) < 2 or not analyzer.can_prove_equal(shape[-2], shape[-1]):
        return False
    element = _operand(mask, access, len(shape))
    batch = [tirx.Var(f"b{axis}", "int64") for axis in range(len(shape) - 2)]
    row, past = tirx.Var("i", "int64"), tirx.Var("t", "int64")
    for var, extent in [*zip(batch, shape), (row, shape[-1]), (past, shape[-1])]:
        analyzer.bind(var, tvm.ir.Range(0, extent))
    above = analyzer.simplify(element([*batch, row, row + 1 + past]))
    diagonal = analyzer.simplify(element([*batch, row, row]))
    if not isinstance(above, tirx.FloatImm) or not isinstance(diagonal, tirx.FloatImm):
        return False
    dtype = str(getattr(above.ty, "dtype", above.ty))
    if dtype not in ("float16", "float32", "float64"):
        return False
    return above.value <= float(np.finfo(dtype).min) and diagonal.value == 0.0


#: Lanes of the running maximum of a row of scores (16 single floats: one AVX-512 register,
#: four SSE ones).
_LANES = 16
#: Blocks whose reduction loop goes outside their spatial loop, so the inner loop runs along
#: contiguous elements: a row of ``O``, the lanes of the maximum (and, with the keys copied, a
#: row of scores).
_REDUCTION_OUTSIDE = ("matmul_1", "row_max_lanes")


def _schedule(
    kernel: tirx.PrimFunc, copy_keys: bool = False, rows: RowLength | None = None
) -> tirx.PrimFunc | None:
    """The kernel's loop nest (see the module docstring), or ``None`` where a step fails.

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


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Compute each attention chain as one kernel (see the module docstring).

    Parameters
    ----------
    options
        An :class:`AttentionOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is an :class:`AttentionReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs on whole imported graphs before legalization, where a memory
    timeline of each changed function would cost more than the pass; a fused chain holds
    neither score tensor).
    """

    def __init__(self, options: AttentionOptions | None = None) -> None:
        if options is not None and not isinstance(options, AttentionOptions):
            raise TypeError(f"FuseAttention expects AttentionOptions, got {type(options).__name__}")
        self.options = options or AttentionOptions()
        self.report = AttentionReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = AttentionReport()
        if not self.options.enabled:
            publish(self, PassResult("FuseAttention", notes=("disabled by its options",)))
            return mod
        builder = relax.BlockBuilder(mod)
        names = {func: gv.name_hint for gv, func in mod.functions.items()}
        # function: attention chains fused, layout bindings absorbed, mask bindings copied
        counts: dict[str, list[int]] = {}
        notes: dict[str, list[str]] = {}

        def rewrite(func, index, block, _blocks):
            attrs = func.attrs or {}
            if any(key in attrs for key in ("Primitive", "Codegen", "Composite")):
                notes[names[func]] = ["a Primitive, Codegen or Composite function: left alone"]
                return None
            before = (self.report.fused, self.report.absorbed, self.report.masks)
            new_block = self._fuse_block(block, vars_read_after(func, index), builder)
            after = (self.report.fused, self.report.absorbed, self.report.masks)
            count = counts.setdefault(names[func], [0, 0, 0])
            for i, (old, new) in enumerate(zip(before, after)):
                count[i] += new - old
            return new_block

        out = rewrite_dataflow_blocks(mod, rewrite, builder)
        if out is not mod:
            # The bindings the kernels replaced are now unused.
            out = relax.transform.DeadCodeElimination()(out)
        changes = {
            name: [f"{counted(fused, 'attention chain')} fused"]
            + ([f"{counted(absorbed, 'layout binding')} absorbed"] if absorbed else [])
            + ([f"{counted(masks, 'mask binding')} computed in the kernels"] if masks else [])
            for name, (fused, absorbed, masks) in counts.items()
            if fused
        }
        functions = function_results(mod, out, changes, notes=notes)
        publish(self, PassResult("FuseAttention", functions, detail=self.report))
        return out

    def _fuse_block(
        self,
        block: relax.DataflowBlock,
        read_after: set[relax.Var],
        builder: relax.BlockBuilder,
    ) -> relax.DataflowBlock | None:
        info = _Block(block, read_after)
        taken: set[int] = set()
        replace_at: dict[int, relax.Binding] = {}
        for pos, binding in enumerate(info.bindings):
            if _op_name(binding) != "relax.nn.softmax" or pos in taken:
                continue
            if not _softmax_axis_is_last(binding):
                continue
            core = _core(info, pos)
            if core is None or taken & set(core):
                continue
            group = set(core)
            if self.options.absorb_inputs:
                group = _extend(info, group, self.options) - taken
            if len(group) > self.options.max_group:
                continue
            masks, mask_vars = set(), []
            if self.options.absorb_masks:
                masks, mask_vars = _mask_bindings(info, core, group)
            if len(group) + len(masks) > self.options.max_group:
                masks, mask_vars = set(), []
            copy_keys: KeysCopy = self.options.copy_keys
            if not copy_keys and self.options.copy_keys_within_mask and mask_vars:
                freed = _freed_mask_bytes(info, mask_vars, info.bindings[max(group)].var)
                copy_keys = False if freed is None else freed
            try:
                kernel, inputs = _build_kernel(
                    info, sorted(group | masks), copy_keys, mask_vars, self.options.stop_rows
                )
            except _Unsupported:
                if not masks:
                    continue
                try:  # the mask as a tensor the kernel reads
                    masks = set()
                    kernel, inputs = _build_kernel(info, sorted(group), self.options.copy_keys)
                except _Unsupported:
                    continue
            gv = builder.add_func(kernel, "fused_attention")
            result = max(group)
            last = info.bindings[result]
            call = relax.call_tir(gv, inputs, last.var.ty)
            replace_at[result] = relax.VarBinding(last.var, call)
            # The mask's bindings are not taken: another attention may compute the same mask.
            taken |= group
            self.report.fused += 1
            self.report.absorbed += len(group) - len(core)
            self.report.masks += len(masks)
        if not replace_at:
            return None
        # Only the last binding of a group is replaced; the others are left for
        # DeadCodeElimination (nothing else reads them).
        return relax.DataflowBlock(
            [replace_at.get(pos, binding) for pos, binding in enumerate(info.bindings)]
        )

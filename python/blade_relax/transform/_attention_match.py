"""Which bindings of a dataflow block form an attention group for ``FuseAttention``.

The *core* (a softmax between two matmuls, see :func:`attention_core`), the layout bindings it
absorbs (:func:`extend_group`) and the bindings that build a mask it may compute itself
(:func:`mask_bindings`), as :mod:`blade_relax.transform.fuse_attention` describes them; and the
facts about Relax values that the kernel builder reads too (a tensor's shape, a constant).
Reads the block, never changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax, tirx

#: Operators that only move data: an attention group may absorb them on either side.
LAYOUT_OPS = frozenset(
    {
        "relax.reshape",
        "relax.permute_dims",
        "relax.broadcast_to",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.split",
    }
)
_LAYOUT_NAMES = LAYOUT_OPS | {"TupleGetItem"}
#: Layout readers of the result the group may take (a split's items would leave the group).
_RESULT_LAYOUT_OPS = LAYOUT_OPS - {"relax.split"}
#: Elementwise operators allowed between the score matmul and the softmax (scale, mask).
SCORE_OPS = frozenset(
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
COMPARISONS: dict[str, Callable[[tvm.ir.Expr, tvm.ir.Expr], tvm.ir.Expr]] = {
    "relax.less": lambda a, b: a < b,
    "relax.less_equal": lambda a, b: a <= b,
    "relax.greater": lambda a, b: a > b,
    "relax.greater_equal": lambda a, b: a >= b,
    "relax.equal": lambda a, b: a == b,
    "relax.not_equal": lambda a, b: a != b,
}
#: Logical operators of a mask (on ``bool`` tensors, which is all a mask holds).
LOGICAL_OPS = frozenset(
    {
        "relax.bitwise_and",
        "relax.bitwise_or",
        "relax.logical_and",
        "relax.logical_or",
        "relax.logical_not",
    }
)
#: Operators that make a tensor from its shape and a value, reading no element.
FILL_OPS = frozenset({"relax.full", "relax.full_like", "relax.zeros", "relax.ones"})
#: Operators a mask may be computed with inside the kernel (see :func:`mask_bindings`):
#: index generators, comparisons, logic, selection, casts, arithmetic and layout.
MASK_OPS = (
    frozenset({"relax.arange", "relax.where", "relax.astype", "relax.index_tensor"})
    | FILL_OPS
    | LOGICAL_OPS
    | frozenset(COMPARISONS)
    | SCORE_OPS
    | LAYOUT_OPS
)


class Unsupported(Exception):
    """The group uses an operator or a shape the kernel builder does not handle."""


def shape_of(var: relax.Expr) -> list[tvm.ir.Expr]:
    """The extents of a tensor's shape; :class:`Unsupported` when it is not known."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise Unsupported("a tensor of unknown shape")
    return list(ty.shape.values)


def const_int(expr: tvm.ir.Expr) -> int | None:
    """The value of an integer constant (``None``: a symbolic expression)."""
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def constant_array(expr: tvm.ir.expr.Constant) -> np.ndarray:
    """The data of a Relax constant as a numpy array."""
    value = expr.value
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def op_name(binding: relax.Binding) -> str | None:
    """The operator a binding calls (``"TupleGetItem"`` for an item of a tuple; ``None``
    for anything else)."""
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


class Block:
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
        """The position of the one binding that reads ``var``, where no other binding reads
        it and it is not read after the block (else ``None``)."""
        readers = self.readers.get(var, set())
        if var in self.escaping or len(readers) != 1:
            return None
        return next(iter(readers))

    def producer(self, var: relax.Var) -> int | None:
        """The position of the binding that defines ``var`` in the block (else ``None``)."""
        return self.position.get(var)


def _is_matmul(binding: relax.Binding) -> bool:
    return op_name(binding) == "relax.matmul"


def softmax_axis_is_last(binding: relax.Binding) -> bool:
    """Whether a softmax binding normalizes over the last axis (the keys)."""
    call = binding.value
    ndim = call.args[0].ty.ndim
    axis = int(call.attrs.axis)
    return axis == -1 or (ndim > 0 and axis == ndim - 1)


def attention_core(info: Block, softmax_pos: int) -> list[int] | None:
    """Positions of the core chain around the softmax at ``softmax_pos`` (see
    :mod:`blade_relax.transform.fuse_attention`), or ``None`` when it does not match."""
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
        name = op_name(binding)
        if _is_matmul(binding):
            chain.append(pos)
            break
        if name in _RESHAPE_OPS or name in SCORE_OPS:
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
        name = op_name(binding)
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


def _reaches_matmul(info: Block, var: relax.Var, depth: int = 8) -> bool:
    """Whether ``var`` is a matmul's result through at most ``depth`` reshape/score
    operators of the block."""
    pos = info.producer(var)
    if pos is None or depth == 0:
        return False
    binding = info.bindings[pos]
    if _is_matmul(binding):
        return True
    name = op_name(binding)
    if name not in _RESHAPE_OPS and name not in SCORE_OPS:
        return False
    return any(
        _reaches_matmul(info, a, depth - 1) for a in binding.value.args if isinstance(a, relax.Var)
    )


def extend_group(info: Block, group: set[int], max_group: int) -> set[int]:
    """The group with the layout bindings only it reads (upstream: the heads cut out of
    ``qkv``) and the layout readers of its result while each is the only one (downstream)."""
    group = set(group)
    last = max(group)
    while len(group) < max_group:
        reader = info.sole_reader(info.bindings[last].var)
        if reader is None or op_name(info.bindings[reader]) not in _RESULT_LAYOUT_OPS:
            break
        group.add(reader)
        last = reader
    changed = True
    while changed and len(group) < max_group:
        changed = False
        for pos in sorted(group):
            for var in _tensor_args(info.bindings[pos]):
                producer = info.producer(var)
                if producer is None or producer in group or var in info.escaping:
                    continue
                if op_name(info.bindings[producer]) not in _LAYOUT_NAMES:
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
    return sum(1 for extent in ty.shape.values if const_int(extent) is None)


def _is_mask_op(binding: relax.Binding) -> bool:
    if isinstance(binding, relax.VarBinding) and isinstance(binding.value, tvm.ir.expr.Constant):
        return constant_array(binding.value).ndim == 0
    return op_name(binding) in MASK_OPS


def element_reads(binding: relax.Binding) -> list[relax.Var]:
    """The tensors whose elements ``binding`` reads (a fill reads its template's shape only)."""
    if op_name(binding) in FILL_OPS:
        return []
    return [
        v for v in relax.analysis.free_vars(binding.value) if isinstance(v.ty, relax.TensorType)
    ]


def mask_bindings(
    info: Block, core: Sequence[int], group: set[int]
) -> tuple[set[int], list[relax.Var]]:
    """Positions of the bindings that build the masks the ``core`` adds to its scores, to be
    computed inside the kernel (:attr:`~blade_relax.transform.AttentionOptions.absorb_masks`),
    and the masks.

    A mask is an operand of a score operator that does not come from the score matmul. Its
    bindings are followed upstream while each is an operator of :data:`MASK_OPS` (or a
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
        if op_name(binding) not in SCORE_OPS:
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


def freed_mask_bytes(
    info: Block, masks: Sequence[relax.Var], result: relax.Var
) -> tvm.ir.Expr | None:
    """Bytes of the masks that no longer exist once every attention computes them itself:
    masks read only by score operators of attention chains, inside the block, whose shapes
    use no dim the kernel's result does not (the kernel must be able to compute the figure).
    ``None`` when there is none."""
    dims = _dims_of(shape_of(result))
    total = None
    for mask in dict.fromkeys(masks):
        readers = info.readers.get(mask, set())
        if mask in info.escaping or not all(
            op_name(info.bindings[r]) in SCORE_OPS
            and any(_reaches_matmul(info, a) for a in _tensor_args(info.bindings[r]))
            for r in readers
        ):
            continue
        shape = shape_of(mask)
        if not _dims_of(shape) <= dims:
            continue
        nbytes = tirx.IntImm("int64", tvm.DataType(str(mask.ty.dtype)).bits // 8)
        for extent in shape:
            nbytes = nbytes * extent
        total = nbytes if total is None else total + nbytes
    return total


def _generated_by(info: Block, var: relax.Var, group: set[int]) -> set[int]:
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
        pending.extend(element_reads(binding))
    return found


#: The most bindings one mask may take into a kernel (each is an operation per score).
_MAX_MASK_BINDINGS = 48


def _reads_less(info: Block, found: set[int], mask: relax.Var) -> bool:
    """Whether every tensor the bindings ``found`` read from outside has fewer symbolic axes
    than ``mask``."""
    axes = _symbolic_axes(mask)
    defined = {info.bindings[p].var for p in found}
    for pos in found:
        for var in element_reads(info.bindings[pos]):
            if var in defined:
                continue
            outside = _symbolic_axes(var)
            if axes is None or outside is None or outside >= axes:
                return False
    return True

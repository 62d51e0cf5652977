"""MemoryAwareSchedule: reorder the bindings of dataflow blocks to lower the peak of live bytes.

Where it runs
-------------
After ``FuseOps``/``FuseTIR`` (so it sees the kernels whose buffers the VM will allocate) and
before ``ToNonDataflow`` (dataflow blocks, whose bindings may be reordered freely as long as
dependencies hold, exist only until then). It also works on unfused graphs of high-level
operators, before ``LegalizeOps``. It must not run after ``StaticPlanBlockMemory``.

What it assumes
---------------
The module is normalized and well formed. Bindings of a dataflow block are pure, so any order
that respects the def-use edges computes the same values. The pass adds edges where purity
alone is not enough:

* a ``match_cast`` that defines a symbolic var comes before every binding that mentions it;
* a binding that writes into an argument (``call_tir_inplace``, ``call_inplace_packed``) keeps
  its position relative to every other binding that touches the same buffer.

A block with anything else (an impure call, ``If``, a local function, an unknown expression
kind) is left untouched, and so is a function whose shapes cannot be analysed.

Memory model
------------
Orders are scored by the bytes of storage the VM will hold, as the runtime accounting
(:func:`blade_relax.runtime.memory_stats`) measures them. Plain liveness first: a binding that
computes a tensor (an operator, ``call_tir``, a packed call) allocates its result (one buffer
per field of a tuple result); views (``reshape``, a ``call_tir`` of a reshape kernel that
``RewriteDataflowReshape`` turns into a view, tuples, ``TupleGetItem``, ``match_cast``) keep
their source alive. A buffer is freed after the last binding that reads a variable referring
to it, unless one of those variables is used after the block. Parameters belong to the caller
and are never counted; values of earlier blocks are live on entry and freed after their last
use in the block. At a binding, live bytes are ``live_before + allocated``.

Two facts of the stock lowering are modelled on top, because they decide the measured peak:

* ``KillAfterLastUse`` kills only variables that are read. After ``CallTIRRewrite`` the
  result of a multi-output kernel is a tuple variable that nothing reads (``TupleGetItem``
  folds to the field), so its fields live until the function returns; so does the source of a
  view or a tuple that is never read.
* With ``ScheduleOptions.planner="static"`` (the default), ``StaticPlanBlockMemory``'s storage
  reuse: a buffer's storage token returns to the pool after the last *call* that reads it, a
  new buffer takes a pooled token of the same dtype and provably equal size (for constant
  sizes, the closest within a factor 16, enlarged if needed), and a storage lives from its
  first buffer's allocation to its last buffer's last use.

On fused graphs these figures equal the memory-stage timeline
(:func:`blade_relax.analysis.memory_timeline`) of the lowered function, which equals the
measured bytes (tested).

How it decides
--------------
Byte counts are symbolic (:class:`blade_relax.symbolic.ShapeGraph`). Candidate orders come from
several strategies (``ScheduleOptions.strategies``):

``greedy-delta``
    List scheduling: among the ready bindings, run the one whose effect on live bytes
    (allocated minus freed) is provably smallest (``ShapeGraph.compare``); ties by allocated
    bytes, then by input position.
``greedy-peak``
    The same with the keys swapped: least allocated bytes (live bytes *during* the binding)
    first, then least net effect.
``depth-first``
    Post-order depth-first from the block's sinks, arguments in order (what
    ``relax.transform.TopologicalSort(order="depth-first", direction="from-outputs")`` does).
``refine``
    Local search from the input order: at the step where the peak is reached (each acceptance
    point in turn, largest peak first), move the producer of a live buffer, with the ancestors
    only it needs, to just before its first other reader, or the last reader of a live buffer,
    with the ancestors it still waits for, to just before the peak step; keep a move only if
    the peak gets no higher at any acceptance point and lower (or reached by fewer steps) at
    the point being worked on. At most ``refine_evaluations`` orders are scored. With the
    storage planner's model the search also runs once on plain liveness, and its moves are
    replayed one by one under the planner's model, keeping those that leave no point above the
    input (``refine-liveness``).

When a comparison in a greedy step is UNKNOWN (it holds for some admissible shapes only), the
tie is broken by the values at ``ShapeGraph.representative_points()``: the smaller value at
the majority of the points, then the smaller value at the last point. With
``point_variants`` every greedy strategy that met an UNKNOWN runs again once per point,
deciding each UNKNOWN by that point's values.

The input order is always a candidate, and a candidate replaces it only if its symbolic peak
is **proven** no higher than the input's for every admissible value of the dims, or (with
``accept_sampled``) if no proof is found but it is no higher at every *acceptance point* (the
representative points and every power of two in the dims' ranges, see
:mod:`._schedule_cost`) and all byte counts can be evaluated. It must also be strictly lower at
one of those points. Among the accepted candidates the pass keeps the lowest worst-case ratio
to the input's peak over the acceptance points, then the lowest mean ratio, proven orders
first on ties; so the result is never worse than the input order at any of those points.

Cost: each strategy is a list scheduler whose steps cost ``O(#distinct ready keys)`` cached
comparisons; peaks of an order are numpy cumulative sums. Blocks of several thousand bindings
schedule in seconds.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..symbolic import Ordering, ShapeGraph, SymbolicExpr
from ._schedule_cost import ByteSpace, OrderProfile, UnsupportedBytes, front_le, pareto_front

__all__ = [
    "BlockReport",
    "MemoryAwareSchedule",
    "ScheduleOptions",
    "ScheduleReport",
    "schedule_function",
    "schedule_module",
]

STRATEGIES = ("refine", "greedy-delta", "greedy-peak", "depth-first")

_VIEW_OPS = frozenset({"relax.reshape", "relax.memory.view", "relax.memory.ensure_zero_offset"})
_VIEW_PACKED = frozenset({"vm.builtin.reshape", "vm.builtin.tensor_view"})
_PACKED_CALLS = frozenset(
    {"relax.call_pure_packed", "relax.call_builtin_with_ctx", "relax.call_inplace_packed"}
)
_INPLACE = frozenset({"relax.call_tir_inplace", "relax.call_inplace_packed"})
# Values that read no variable and allocate nothing the VM counts (constants live in the
# executable; prim values, strings and dtypes are constants in TVM 0.27's IR).
_LEAVES = (
    tvm.ir.expr.Constant,
    tvm.ir.expr.StringImm,
    relax.ShapeExpr,
    relax.ExternFunc,
    tvm.ir.GlobalVar,
)


@dataclass(frozen=True)
class ScheduleOptions:
    """Options of :class:`MemoryAwareSchedule`.

    Attributes
    ----------
    strategies
        Candidate generators, tried in this order (see the module docstring): any of
        ``"refine"``, ``"greedy-delta"``, ``"greedy-peak"``, ``"depth-first"``. The input order
        is always a candidate.
    point_variants
        Re-run a greedy strategy that met an UNKNOWN comparison once per representative point,
        deciding each UNKNOWN at that point.
    accept_sampled
        Accept an order whose peak is not proven no higher than the input's when it is no
        higher at every acceptance point. With False, only proven orders are accepted.
    proof_budget
        Slow symbolic comparisons (``ShapeGraph.compare``) allowed per proof of one candidate
        against another; a proof that runs out counts as not found.
    planner
        The memory planner the schedule is scored for: ``"static"`` models the storage reuse
        of ``StaticPlanBlockMemory`` (the stock planner that follows the pass in the default
        pipeline), ``"none"`` plain liveness (each tensor freed after its last use).
    refine_evaluations
        Orders the ``refine`` strategy may score per block.
    refine_moves
        Moves ``refine`` tries at each peak.
    min_bindings
        Blocks with fewer bindings are left as they are.
    max_bindings
        Blocks with more bindings are left as they are (None: no limit).
    """

    strategies: tuple[str, ...] = STRATEGIES
    point_variants: bool = True
    accept_sampled: bool = True
    proof_budget: int = 256
    planner: str = "static"
    refine_evaluations: int = 400
    refine_moves: int = 8
    min_bindings: int = 3
    max_bindings: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown schedule strategies {unknown}; choose from {STRATEGIES}")
        if self.planner not in ("static", "none"):
            raise ValueError(f"planner must be 'static' or 'none', got {self.planner!r}")
        if self.proof_budget < 0:
            raise ValueError(f"proof_budget must be >= 0, got {self.proof_budget}")
        if self.refine_evaluations < 0 or self.refine_moves < 1:
            raise ValueError("refine_evaluations must be >= 0 and refine_moves >= 1")
        if self.min_bindings < 0:
            raise ValueError(f"min_bindings must be >= 0, got {self.min_bindings}")


@dataclass
class BlockReport:
    """What the pass did to one dataflow block.

    Attributes
    ----------
    function, block
        The function's name and the block's index in its body.
    bindings
        Number of bindings.
    strategy
        The strategy whose order was kept (``"input"`` when unchanged), or why the block was
        skipped (``"skipped: ..."``).
    proven
        Whether the kept order's peak is proven no higher than the input's (True when
        unchanged).
    points
        The acceptance points (free dims only).
    peak_before, peak_after
        Peak live bytes of the block at each acceptance point, input order and kept order.
    candidates
        Per candidate strategy: ``"proven"`` (accepted, peak proven no higher), ``"sampled"``
        (accepted from the acceptance points), ``"rejected"``, ``"no gain"`` or
        ``"duplicate"`` (same order as an earlier candidate or the input).
    peak_expr_before, peak_expr_after
        The symbolic peaks (Max over the steps that can be the peak).
    seconds
        Time spent on the block.
    """

    function: str
    block: int
    bindings: int
    strategy: str
    proven: bool = True
    points: list[dict[str, int]] = field(default_factory=list)
    peak_before: list[int] = field(default_factory=list)
    peak_after: list[int] = field(default_factory=list)
    candidates: dict[str, str] = field(default_factory=dict)
    peak_expr_before: SymbolicExpr | None = None
    peak_expr_after: SymbolicExpr | None = None
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return self.strategy not in ("input",) and not self.strategy.startswith("skipped")


@dataclass
class ScheduleReport:
    """Per-block reports of one run of the pass."""

    blocks: list[BlockReport] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(b.changed for b in self.blocks)


# ====================================================================== the block graph


class _Unsupported(Exception):
    """The block holds a construct the scheduler does not reorder."""


@dataclass
class _Block:
    """Dependencies and buffers of one dataflow block (indices are input positions)."""

    bindings: list[relax.Binding]
    preds: list[list[int]]
    succs: list[list[int]]
    touch: list[list[int]]  # buffers each binding reads through its vars, or creates
    alloc: np.ndarray  # n x M: bytes allocated by each binding
    sizes: np.ndarray  # B x M: bytes of each buffer
    escaping: np.ndarray  # B: used after the block, never freed in it
    initial: np.ndarray  # M: bytes live on entry (buffers from earlier blocks)
    consumers: list[list[int]]
    space: ByteSpace
    planner: str  # "static": model StaticPlanBlockMemory's reuse; "none": plain liveness
    plannable: np.ndarray  # B: buffers StaticPlanBlockMemory will place in pooled storage
    dtypes: list[str]  # B: element type of each buffer ("" when unknown)
    size_keys: list[tuple]  # B: the size vector as a hashable key
    const_sizes: list[int | None]  # B: the size when it is a constant
    call_cons_buffer: np.ndarray  # like cons_*, counting only calls (what releases a token)
    call_cons_start: np.ndarray
    call_cons_node: np.ndarray
    touch_rank: list[dict[int, int]]  # position of each buffer among a binding's arguments
    created_by: np.ndarray  # B: binding that allocates each buffer (-1: live on entry)
    cons_buffer: np.ndarray  # buffers with consumers, ascending
    cons_start: np.ndarray  # start of each of those buffers' runs in cons_node
    cons_node: np.ndarray  # consumers, grouped by buffer

    @property
    def n(self) -> int:
        return len(self.bindings)


def _callee(call: relax.Call) -> tuple[str | None, list[relax.Expr]]:
    op = call.op
    args = list(call.args)
    if isinstance(op, tvm.ir.Op):
        if op.name in _PACKED_CALLS and args and isinstance(args[0], relax.ExternFunc):
            return args[0].global_symbol, args[1:]
        return op.name, args
    if isinstance(op, relax.ExternFunc):
        return op.global_symbol, args
    return None, args


def _tir_var_names(exprs: Sequence) -> set[str]:
    names: set[str] = set()
    for e in exprs:
        names.update(v.name for v in e)
    return names


class _BlockBuilder:
    """Reads one dataflow block into a :class:`_Block`."""

    def __init__(
        self,
        block: relax.DataflowBlock,
        graph: ShapeGraph,
        mod: tvm.IRModule | None,
        params: set[relax.Var],
        used_after: set[relax.Var],
        tir_defined_before: set[str],
        planner: str = "static",
    ) -> None:
        self.planner = planner
        self.block = block
        self.graph = graph
        self.mod = mod
        self.params = params
        self.used_after = used_after
        self.tir_defined_before = tir_defined_before
        self.size_exprs: list[SymbolicExpr] = []
        self.external: list[int] = []
        self.refs: dict[relax.Var, tuple[int, ...]] = {}
        self.field_refs: dict[relax.Var, list[tuple[int, ...]]] = {}
        self.bytes_cache: dict[int, list[tuple[tvm.ir.Type, SymbolicExpr]]] = {}
        self.dtypes: list[str] = []
        self.plannable: set[int] = set()  # allocated through builtin.alloc_tensor once lowered
        self.discarded: set[int] = set()  # reach something StaticPlanBlockMemory does not plan
        self.is_view = False  # whether the last value read by _value_refs was a view
        # Buffers the lowered function holds until it returns: the fields of a multi-output
        # kernel (after CallTIRRewrite the result is a tuple var that no one reads, since
        # TupleGetItem folds to the field, so KillAfterLastUse never kills it), and the source
        # of a view or tuple that is never read (KillAfterLastUse only kills used variables).
        self.leaked: set[int] = set()

    # -------------------------------------------------------------- buffers
    def _bytes(self, ty: tvm.ir.Type, var: relax.Var | None = None) -> SymbolicExpr:
        # Most bindings of a block share a handful of types: read each type's size once. Free
        # dims are compared by identity, so equal types have equal sizes, except when the size
        # is unknown: each such value keeps its own opaque size (named after ``var``).
        key = tvm_ffi.structural_hash(ty)
        for known, nbytes in self.bytes_cache.get(key, ()):
            if tvm_ffi.structural_equal(known, ty):
                return nbytes
        nbytes = self.graph.bytes_of(ty)
        if nbytes.is_unknown:
            return self.graph.bytes_of(var) if var is not None else nbytes
        self.bytes_cache.setdefault(key, []).append((ty, nbytes))
        return nbytes

    def _new_buffer(self, nbytes: SymbolicExpr, ty: tvm.ir.Type | None = None) -> int | None:
        if nbytes.is_constant and nbytes.expr == 0:
            return None
        self.size_exprs.append(nbytes)
        dtype = getattr(ty, "dtype", None) if isinstance(ty, relax.TensorType) else None
        self.dtypes.append("" if dtype is None else str(dtype))
        return len(self.size_exprs) - 1

    def _refs_of(self, var: relax.Var) -> tuple[int, ...]:
        cached = self.refs.get(var)
        if cached is not None:
            return cached
        out: tuple[int, ...] = ()
        if var not in self.params:
            # A value of an earlier block: live on entry.
            buffer = self._new_buffer(self._bytes(var.ty, var), var.ty)
            if buffer is not None:
                self.external.append(buffer)
                out = (buffer,)
        self.refs[var] = out
        return out

    def _refs_of_expr(self, expr: relax.Expr) -> tuple[int, ...]:
        if isinstance(expr, relax.Var):
            return self._refs_of(expr)
        if isinstance(expr, relax.Tuple):
            out: list[int] = []
            for f in expr.fields:
                out.extend(self._refs_of_expr(f))
            return tuple(dict.fromkeys(out))
        return ()

    def _allocate_result(self, var: relax.Var) -> tuple[int, ...]:
        ty = var.ty
        if isinstance(ty, relax.TupleType):
            fields: list[tuple[int, ...]] = []
            for f in ty.fields:
                buffer = self._new_buffer(self._bytes(f), f)
                fields.append(() if buffer is None else (buffer,))
            self.field_refs[var] = fields
            return tuple(b for f in fields for b in f)
        buffer = self._new_buffer(self._bytes(ty, var), ty)
        return () if buffer is None else (buffer,)

    def _is_reshape_kernel(self, call: relax.Call, var: relax.Var) -> relax.Expr | None:
        """The argument a ``call_tir`` of a reshape kernel views (RewriteDataflowReshape)."""
        if self.mod is None or not isinstance(var, relax.DataflowVar):
            return None
        gv = call.args[0]
        if not isinstance(gv, tvm.ir.GlobalVar) or gv not in self.mod.functions:
            return None
        func = self.mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            return None
        args = call.args[1]
        fields = list(args.fields) if isinstance(args, relax.Tuple) else [args]
        if len(fields) != 1 or not isinstance(fields[0], relax.Var):
            return None
        src = fields[0]
        src_ty, dst_ty = src.ty, var.ty
        if not (isinstance(src_ty, relax.TensorType) and isinstance(dst_ty, relax.TensorType)):
            return None
        if str(src_ty.dtype) != str(dst_ty.dtype):
            return None
        if self.graph.compare(self._bytes(src_ty, src), self._bytes(dst_ty, var)) != Ordering.EQ:
            return None
        try:
            if not relax.analysis.has_reshape_pattern(func):
                return None
        except Exception:  # an unusual PrimFunc: treat the call as computing a new tensor
            return None
        return src

    def _value_refs(
        self, var: relax.Var, value: relax.Expr, inplace: list[tuple[int, tuple[int, ...]]], i: int
    ) -> tuple[int, ...]:
        self.is_view = False
        if isinstance(value, relax.Var):
            if value in self.field_refs:
                self.field_refs[var] = self.field_refs[value]
            return self._refs_of(value)
        if isinstance(value, relax.Tuple):
            fields = [self._refs_of_expr(f) for f in value.fields]
            self.field_refs[var] = fields
            return tuple(dict.fromkeys(b for f in fields for b in f))
        if isinstance(value, relax.TupleGetItem):
            src = value.tuple_value
            if isinstance(src, relax.Var) and src in self.field_refs:
                fields = self.field_refs[src]
                if 0 <= value.index < len(fields):
                    return fields[value.index]
            return self._refs_of_expr(src)
        if isinstance(value, _LEAVES):
            return ()
        if isinstance(value, relax.Call):
            if relax.analysis.contains_impure_call(value):
                raise _Unsupported(f"impure call in binding {var.name}")
            name, args = _callee(value)
            if name in _VIEW_OPS or name in _VIEW_PACKED:
                self.is_view = True
                return self._refs_of_expr(args[0]) if args else ()
            if name == "relax.call_tir":
                src = self._is_reshape_kernel(value, var)
                if src is not None:
                    self.is_view = True
                    return self._refs_of(src)
            if self._discards(value):
                for arg in args:
                    self.discarded.update(self._refs_of_expr(arg))
            if name in _INPLACE:
                return self._inplace_refs(value, name, args, var, inplace, i)
            before = len(self.size_exprs)
            refs = self._allocate_result(var)
            if isinstance(value.op, tvm.ir.Op) and value.op.name not in _PACKED_CALLS:
                # Operators, call_tir and call_dps_packed write into a builtin.alloc_tensor.
                self.plannable.update(range(before, len(self.size_exprs)))
                if isinstance(var.ty, relax.TupleType):
                    self.leaked.update(range(before, len(self.size_exprs)))
            return refs
        raise _Unsupported(f"{type(value).__name__} in binding {var.name}")

    def _discards(self, call: relax.Call) -> bool:
        """Whether StaticPlanBlockMemory gives up planning the arguments of ``call``: it plans
        only values passed to PrimFuncs and packed functions (and views of them)."""
        op = call.op
        if isinstance(op, tvm.ir.GlobalVar):
            callee = self.mod[op] if self.mod is not None and op in self.mod.functions else None
            return not isinstance(callee, tvm.tirx.PrimFunc)
        if isinstance(op, tvm.ir.Op):
            return op.name == "relax.call_builtin_with_ctx"
        return not isinstance(op, relax.ExternFunc)

    def _inplace_refs(
        self,
        call: relax.Call,
        name: str,
        args: list[relax.Expr],
        var: relax.Var,
        inplace: list[tuple[int, tuple[int, ...]]],
        i: int,
    ) -> tuple[int, ...]:
        indices = [int(k) for k in call.attrs.inplace_indices]
        if name == "relax.call_tir_inplace":
            tensor_args = list(args[1].fields) if isinstance(args[1], relax.Tuple) else [args[1]]
        else:
            tensor_args = args
        written: list[tuple[int, ...]] = []
        for k in indices:
            if k >= 0:
                if k >= len(tensor_args):
                    raise _Unsupported(f"in-place index {k} out of range in {var.name}")
                written.append(self._refs_of_expr(tensor_args[k]))
            else:
                written.append(())
        fresh = any(k < 0 for k in indices)
        before = len(self.size_exprs)
        allocated = self._allocate_result(var) if fresh else ()
        if name == "relax.call_tir_inplace":
            self.plannable.update(range(before, len(self.size_exprs)))
        aliased = tuple(dict.fromkeys(b for w in written for b in w))
        inplace.append((i, aliased))
        if isinstance(var.ty, relax.TupleType):
            fresh_fields = list(self.field_refs.get(var, [()] * len(indices)))
            self.field_refs[var] = [
                w if k >= 0 else (fresh_fields[j] if j < len(fresh_fields) else ())
                for j, (k, w) in enumerate(zip(indices, written))
            ]
        return tuple(dict.fromkeys(aliased + allocated))

    # -------------------------------------------------------------- the graph
    def build(self) -> _Block:
        bindings = list(self.block.bindings)
        n = len(bindings)
        index_of: dict[relax.Var, int] = {}
        uses: list[list[relax.Var]] = []
        creates: list[tuple[int, ...]] = []
        touch: list[list[int]] = []
        inplace: list[tuple[int, tuple[int, ...]]] = []
        preds: list[set[int]] = [set() for _ in range(n)]
        match_defs: list[tuple[int, set[str]]] = []
        external_set: set[int] = set()
        is_call: list[bool] = []
        view_like: list[bool] = []
        for i, binding in enumerate(bindings):
            var = binding.var
            value = binding.value
            used = list(dict.fromkeys(relax.analysis.free_vars(value)))
            uses.append(used)
            for u in used:
                j = index_of.get(u)
                if j is not None:
                    preds[i].add(j)
            before = len(self.size_exprs)
            if isinstance(binding, relax.MatchCast):
                if not isinstance(value, (relax.Var, relax.Tuple, *_LEAVES)):
                    raise _Unsupported(f"match_cast of a {type(value).__name__} in {var.name}")
                refs = self._value_refs(var, value, inplace, i)
                defined = (
                    _tir_var_names([relax.analysis.definable_tir_vars_in_type(binding.ty)])
                    - self.tir_defined_before
                )
                if defined:
                    match_defs.append((i, defined))
            else:
                refs = self._value_refs(var, value, inplace, i)
            is_call.append(
                isinstance(value, relax.Call)
                and not self.is_view
                and not isinstance(binding, relax.MatchCast)
            )
            view_like.append(self.is_view)
            # Buffers created by this binding (external ones met now are live on entry).
            external_set.update(self.external[len(external_set) :])
            own = tuple(b for b in range(before, len(self.size_exprs)) if b not in external_set)
            creates.append(own)
            self.refs[var] = refs
            index_of[var] = i
            t: list[int] = []
            for u in used:
                t.extend(self._refs_of(u))
            t.extend(own)
            touch.append(list(dict.fromkeys(t)))

        read: set[relax.Var] = {u for used in uses for u in used}
        for i, binding in enumerate(bindings):
            var = binding.var
            if var in read or var in self.used_after:
                continue
            if view_like[i] or isinstance(binding.value, relax.Tuple):
                self.leaked.update(self.refs.get(var, ()))
        if match_defs:
            self._match_cast_edges(bindings, match_defs, preds)
        num_buffers = len(self.size_exprs)
        consumers: list[list[int]] = [[] for _ in range(num_buffers)]
        for i, t in enumerate(touch):
            for b in t:
                consumers[b].append(i)
        for i, written in inplace:
            for b in written:
                for j in consumers[b]:
                    if j < i:
                        preds[i].add(j)
                    elif j > i:
                        preds[j].add(i)
        escaping = np.zeros(num_buffers, dtype=bool)
        for var, refs in self.refs.items():
            if var in self.used_after:
                escaping[list(refs)] = True

        space = ByteSpace(self.graph, self.size_exprs)
        sizes = space.vectors
        alloc = np.zeros((n, space.size), dtype=space.dtype)
        for i, own in enumerate(creates):
            for b in own:
                alloc[i] += sizes[b]
        initial = space.zero()
        for b in self.external:
            initial = initial + sizes[b]
        plannable = np.zeros(num_buffers, dtype=bool)
        plannable[sorted(self.plannable - self.discarded - set(self.external))] = True
        plannable &= ~escaping
        # Values the lowered function never kills live until it returns (see _BlockBuilder).
        escaping[sorted(self.leaked)] = True
        size_keys = [tuple(row.tolist()) for row in sizes]
        const_sizes = [space.constant_value(row) for row in sizes]
        call_consumers = [[j for j in cons if is_call[j]] for cons in consumers]
        call_cons_buffer = np.array(
            [b for b in range(num_buffers) if call_consumers[b]], dtype=np.int64
        )
        call_runs = [len(call_consumers[b]) for b in call_cons_buffer]
        call_cons_start = np.concatenate([[0], np.cumsum(call_runs)[:-1]]).astype(np.int64)
        call_cons_node = np.array(
            [j for b in call_cons_buffer for j in call_consumers[b]], dtype=np.int64
        )
        pred_lists = [sorted(p) for p in preds]
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(pred_lists):
            for j in p:
                succs[j].append(i)
        # Argument order for the depth-first strategy: first use first.
        ordered_preds = []
        for i in range(n):
            seen = dict.fromkeys(index_of[u] for u in uses[i] if u in index_of)
            ordered_preds.append(list(seen) + [j for j in pred_lists[i] if j not in seen])
        created_by = np.full(num_buffers, -1, dtype=np.int64)
        for i, own in enumerate(creates):
            created_by[list(own)] = i
        cons_buffer = np.array([b for b in range(num_buffers) if consumers[b]], dtype=np.int64)
        runs = [len(consumers[b]) for b in cons_buffer]
        cons_start = np.concatenate([[0], np.cumsum(runs)[:-1]]).astype(np.int64)
        cons_node = np.array([j for b in cons_buffer for j in consumers[b]], dtype=np.int64)
        return _Block(
            planner=self.planner,
            plannable=plannable,
            dtypes=self.dtypes,
            size_keys=size_keys,
            const_sizes=const_sizes,
            call_cons_buffer=call_cons_buffer,
            call_cons_start=call_cons_start if call_cons_buffer.size else np.zeros(0, np.int64),
            call_cons_node=call_cons_node,
            touch_rank=[{b: r for r, b in enumerate(t)} for t in touch],
            created_by=created_by,
            cons_buffer=cons_buffer,
            cons_start=cons_start if cons_buffer.size else np.zeros(0, dtype=np.int64),
            cons_node=cons_node,
            bindings=bindings,
            preds=ordered_preds,
            succs=succs,
            touch=touch,
            alloc=alloc,
            sizes=sizes,
            escaping=escaping,
            initial=initial,
            consumers=consumers,
            space=space,
        )

    @staticmethod
    def _match_cast_edges(
        bindings: list[relax.Binding], match_defs: list[tuple[int, set[str]]], preds: list[set[int]]
    ) -> None:
        for j, binding in enumerate(bindings):
            mentioned = _tir_var_names(
                [
                    relax.analysis.tir_vars_in_type(binding.var.ty),
                    relax.analysis.free_symbolic_vars(binding.value),
                ]
            )
            if isinstance(binding, relax.MatchCast):
                mentioned |= _tir_var_names([relax.analysis.tir_vars_in_type(binding.ty)])
            for i, defined in match_defs:
                if j > i and mentioned & defined:
                    preds[j].add(i)


# ====================================================================== strategies


class _Decider:
    """Orders two keys (tuples of byte vectors): proven relations first, then sample points."""

    def __init__(self, space: ByteSpace, point: int | None) -> None:
        self.space = space
        self.point = point
        self.met_unknown = False
        self._values: dict[tuple, np.ndarray] = {}

    def _at_points(self, vec: tuple) -> np.ndarray:
        cached = self._values.get(vec)
        if cached is None:
            cached = self.space.at_decision_points(np.array(vec, dtype=self.space.dtype))
            self._values[vec] = cached
        return cached

    def less(self, a: tuple, b: tuple) -> bool:
        """Whether key ``a`` should run before key ``b`` (False on a tie)."""
        for va, vb in zip(a, b):
            order = self.space.compare(va, vb)
            if order is Ordering.EQ:
                continue
            if order in (Ordering.LT, Ordering.LE):
                return True
            if order in (Ordering.GT, Ordering.GE):
                return False
            self.met_unknown = True
            xa, xb = self._at_points(va), self._at_points(vb)
            if self.point is not None and xa[self.point] != xb[self.point]:
                return bool(xa[self.point] < xb[self.point])
            smaller = int((xa < xb).sum())
            larger = int((xa > xb).sum())
            if smaller != larger:
                return smaller > larger
            if xa[-1] != xb[-1]:
                return bool(xa[-1] < xb[-1])
        return False


def _greedy(block: _Block, kind: str, decider: _Decider) -> list[int]:
    n = block.n
    sizes, alloc, escaping = block.sizes, block.alloc, block.escaping
    indegree = [len(p) for p in block.preds]
    pending = [set(c) for c in block.consumers]
    key_of: dict[int, tuple] = {}
    buckets: dict[tuple, list[int]] = {}
    counts: dict[tuple, int] = {}

    def key(u: int) -> tuple:
        delta = alloc[u].copy()
        for b in block.touch[u]:
            if not escaping[b] and len(pending[b]) == 1:
                delta -= sizes[b]
        a = tuple(alloc[u].tolist())
        d = tuple(delta.tolist())
        return (a, d) if kind == "greedy-peak" else (d, a)

    def insert(u: int) -> None:
        k = key(u)
        key_of[u] = k
        heapq.heappush(buckets.setdefault(k, []), u)
        counts[k] = counts.get(k, 0) + 1

    def remove(u: int) -> None:
        k = key_of.pop(u)
        counts[k] -= 1
        if counts[k] == 0:
            del counts[k]
            del buckets[k]

    for u in range(n):
        if indegree[u] == 0:
            insert(u)
    order: list[int] = []
    while counts:
        best = None
        for k in counts:
            if best is None or decider.less(k, best):
                best = k
        heap = buckets[best]
        while True:
            u = heapq.heappop(heap)
            if key_of.get(u) == best:
                break
        remove(u)
        order.append(u)
        for b in block.touch[u]:
            waiting = pending[b]
            waiting.discard(u)
            if len(waiting) == 1 and not escaping[b]:
                (w,) = waiting
                if w in key_of:
                    remove(w)
                    insert(w)
        for s in block.succs[u]:
            indegree[s] -= 1
            if indegree[s] == 0:
                insert(s)
    if len(order) != n:
        raise RuntimeError("dependency cycle in a dataflow block")  # pragma: no cover
    return order


def _depth_first(block: _Block) -> list[int]:
    n = block.n
    visited = [False] * n
    order: list[int] = []
    roots = [i for i in range(n) if not block.succs[i]]
    for root in roots + list(range(n)):
        if visited[root]:
            continue
        visited[root] = True
        stack = [(root, iter(block.preds[root]))]
        while stack:
            node, it = stack[-1]
            for p in it:
                if not visited[p]:
                    visited[p] = True
                    stack.append((p, iter(block.preds[p])))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


@dataclass
class _Timeline:
    """Live bytes of one order: symbolic rows and their values at the acceptance points."""

    order: list[int]
    pos: np.ndarray  # position of each binding
    free_step: np.ndarray  # position after which each buffer is freed (-1: never)
    during: np.ndarray  # n x M: live bytes while each step runs
    values: np.ndarray  # n x P: ``during`` at the acceptance points
    peaks: np.ndarray  # P


def _rows(
    block: _Block,
    starts: np.ndarray,
    start_sizes: np.ndarray,
    ends: np.ndarray,
    end_sizes: np.ndarray,
) -> np.ndarray:
    """``live_during`` rows from allocations (step, size) and frees (after step, size)."""
    n = block.n
    space = block.space

    def per_step(steps: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        if not space.float_exact:
            out = np.zeros((n, space.size), dtype=space.dtype)
            np.add.at(out, steps, sizes)
            return out
        out = np.zeros((n, space.size), dtype=np.int64)
        for m in range(space.size):
            column = sizes[:, m]
            if column.any():
                # Integer sums through float weights are exact below 2**53 (``float_exact``).
                out[:, m] = np.rint(np.bincount(steps, weights=column, minlength=n))
        return out

    allocated = per_step(starts, start_sizes)
    freed = per_step(ends, end_sizes)
    return block.initial + np.cumsum(allocated, axis=0) - (np.cumsum(freed, axis=0) - freed)


def _last_position(
    pos: np.ndarray, nodes: np.ndarray, starts: np.ndarray, count: int, buffers: np.ndarray
) -> np.ndarray:
    out = np.full(count, -1, dtype=np.int64)
    if nodes.size:
        out[buffers] = np.maximum.reduceat(pos[nodes], starts)
    return out


def _timeline(block: _Block, order: Sequence[int], planner: str | None = None) -> _Timeline:
    """Live bytes of ``order``; with ``planner="static"`` (the default of the block), storage
    reuse as ``StaticPlanBlockMemory`` will plan it (see :func:`_plan_storage`)."""
    planner = block.planner if planner is None else planner
    order_arr = np.asarray(order, dtype=np.int64)
    pos = np.empty(block.n, dtype=np.int64)
    pos[order_arr] = np.arange(block.n, dtype=np.int64)
    num_buffers = block.sizes.shape[0]
    free_step = _last_position(
        pos, block.cons_node, block.cons_start, num_buffers, block.cons_buffer
    )
    own = block.created_by >= 0
    freeable = (~block.escaping) & (free_step >= 0)
    if planner == "static" and block.plannable.any():
        plain = own & ~block.plannable
        token_start, token_end, token_sizes = _plan_storage(block, pos, free_step)
        starts = np.concatenate([pos[block.created_by[plain]], token_start])
        start_sizes = np.concatenate([block.sizes[plain], token_sizes])
        gone = freeable & ~block.plannable
        freed_tokens = token_end >= 0
        ends = np.concatenate([free_step[gone], token_end[freed_tokens]])
        end_sizes = np.concatenate([block.sizes[gone], token_sizes[freed_tokens]])
    else:
        starts, start_sizes = pos[block.created_by[own]], block.sizes[own]
        ends, end_sizes = free_step[freeable], block.sizes[freeable]
    during = _rows(block, starts, start_sizes, ends, end_sizes)
    values = block.space.at_acceptance_points(during)
    return _Timeline(
        order=list(order),
        pos=pos,
        free_step=free_step,
        during=during,
        values=values,
        peaks=values.max(axis=0),
    )


_NEVER = -2  # token end of a storage that lives until the function returns


def _plan_storage(
    block: _Block, pos: np.ndarray, free_step: np.ndarray, assignment: dict | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Storage tokens that ``StaticPlanBlockMemory`` gives the plannable buffers of an order.

    Mirrors its token allocator: a buffer's token returns to the pool after the last *call*
    that reads it (views, tuples and ``match_cast`` do not count); a new buffer takes the
    first-released pooled token of the same dtype and provably equal symbolic size, or, for a
    constant size, the smallest pooled constant token of at least its size within a factor
    16 (else the largest smaller one, enlarged). A token's storage is live from its first
    buffer's allocation to its last buffer's last use.

    Returns
    -------
    tuple
        Start steps, end steps and size rows of the tokens.
    """
    import bisect

    release = _last_position(
        pos,
        block.call_cons_node,
        block.call_cons_start,
        block.sizes.shape[0],
        block.call_cons_buffer,
    )
    buffers = np.nonzero(block.plannable)[0]
    created = pos[block.created_by[buffers]]
    alloc_order = buffers[np.lexsort((buffers, created))]
    # Tokens released by one call go back to the pool in the order of its arguments.
    order = np.empty(block.n, dtype=np.int64)
    order[pos] = np.arange(block.n, dtype=np.int64)
    released = buffers[release[buffers] >= 0]
    arg_rank = np.array(
        [block.touch_rank[int(order[release[b]])].get(int(b), 0) for b in released],
        dtype=np.int64,
    )
    release_order = released[np.lexsort((released, arg_rank, release[released]))]
    token_of = {} if assignment is None else assignment
    starts: list[int] = []
    ends: list[int] = []
    sizes: list[np.ndarray] = []
    const: list[int | None] = []
    dynamic_pool: dict[tuple, list[int]] = {}
    const_pool: dict[str, list[tuple[int, int, int]]] = {}
    seq = 0
    r = 0
    for b in alloc_order:
        b = int(b)
        step = int(pos[block.created_by[b]])
        # Tokens released by calls before this step are back in the pool.
        while r < release_order.size and release[release_order[r]] < step:
            rb = int(release_order[r])
            r += 1
            t = token_of[rb]
            if const[t] is None:
                dynamic_pool.setdefault((block.dtypes[rb], block.size_keys[rb]), []).append(t)
            else:
                pool = const_pool.setdefault(block.dtypes[rb], [])
                bisect.insort(pool, (const[t], seq, t))
                seq += 1
        value = block.const_sizes[b]
        token = None
        if value is None:
            waiting = dynamic_pool.get((block.dtypes[b], block.size_keys[b]))
            if waiting:
                token = waiting.pop(0)
        else:
            pool = const_pool.get(block.dtypes[b])
            if pool:
                lo = bisect.bisect_left(pool, (value // 16, -1, -1))
                hi = bisect.bisect_right(pool, (value * 16, seq + 1, -1))
                mid = bisect.bisect_left(pool, (value, -1, -1))
                if mid < hi:
                    token = pool.pop(mid)[2]
                elif mid > lo:
                    token = pool.pop(mid - 1)[2]
                    if const[token] < value:
                        const[token] = value
        if token is None:
            token = len(starts)
            starts.append(step)
            ends.append(-1)
            sizes.append(block.sizes[b])
            const.append(value)
        token_of[b] = token
        if block.escaping[b] or ends[token] == _NEVER:
            ends[token] = _NEVER
        else:
            ends[token] = max(ends[token], int(free_step[b]))
    rows = np.array(
        [
            sizes[t] if const[t] is None else block.space.constant(const[t])
            for t in range(len(starts))
        ],
        dtype=block.space.dtype,
    ).reshape(len(starts), block.space.size)
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), rows


def _profile(block: _Block, order: Sequence[int]) -> OrderProfile:
    tl = _timeline(block, order)
    allocating = block.alloc[np.asarray(order, dtype=np.int64)].any(axis=1)
    allocating[0] = True
    return OrderProfile(
        order=list(order), peaks=tl.peaks, front=pareto_front(block.space, tl.during[allocating])
    )


_MAX_GROUP = 256


def _move(order: Sequence[int], group: Sequence[int], dst: int) -> list[int]:
    """``order`` with the bindings at positions ``group`` (ascending) moved, in their order,
    to just before the binding now at position ``dst`` (``len(order)``: to the end)."""
    arr = np.asarray(order, dtype=np.int64)
    idx = np.asarray(group, dtype=np.int64)
    keep = np.ones(arr.size, dtype=bool)
    keep[idx] = False
    rest = arr[keep]
    at = dst - int((idx < dst).sum())
    return np.concatenate([rest[:at], arr[idx], rest[at:]]).tolist()


def _delay_group(block: _Block, pos: np.ndarray, u: int) -> list[int]:
    """``u`` and its ancestors whose results only ``u`` (or this group) reads, as positions."""
    group = {u}
    heap = [-int(pos[q]) for q in block.preds[u]]
    heapq.heapify(heap)
    order_at = {int(pos[q]): q for q in block.preds[u]}
    while heap and len(group) < _MAX_GROUP:
        a = order_at[-heapq.heappop(heap)]
        if a in group:
            continue
        # Visited in decreasing position: every successor of ``a`` is already decided.
        if all(x in group for x in block.succs[a]):
            group.add(a)
            for q in block.preds[a]:
                if int(pos[q]) not in order_at:
                    order_at[int(pos[q])] = q
                    heapq.heappush(heap, -int(pos[q]))
    return sorted(int(pos[x]) for x in group)


def _hoist_group(block: _Block, pos: np.ndarray, v: int, k: int) -> list[int] | None:
    """``v`` and its ancestors placed after step ``k`` (positions), or None when one of them
    needs the binding at ``k`` itself."""
    group = {v}
    stack = [v]
    while stack:
        x = stack.pop()
        for q in block.preds[x]:
            pq = int(pos[q])
            if pq == k:
                return None
            if pq > k and q not in group:
                if len(group) >= _MAX_GROUP:
                    return None
                group.add(q)
                stack.append(q)
    return sorted(int(pos[x]) for x in group)


def _peak_moves(block: _Block, tl: _Timeline, k: int, point: int, limit: int) -> list[tuple]:
    """Moves that may lower the live bytes at step ``k``: each ``(bytes, group, dst)``.

    For every buffer live at step ``k``, largest first: run its producer, with the ancestors
    only it needs, just before the producer's first other reader (if that is after ``k``); or
    run its last reader, with the ancestors it still waits for, just before step ``k``.
    """
    pos, order = tl.pos, tl.order
    n = block.n
    created = block.created_by
    live = np.nonzero(
        ((created < 0) | (pos[np.maximum(created, 0)] <= k))
        & ((tl.free_step >= k) | (tl.free_step < 0) | block.escaping)
    )[0]
    if live.size == 0:
        return []
    sizes = block.space.at_acceptance_points(block.sizes[live])[:, point]
    moves: dict[tuple, int] = {}
    for rank in np.argsort(-_as_float(sizes), kind="stable")[: 2 * limit]:
        b = int(live[rank])
        nbytes = int(sizes[rank])
        if nbytes <= 0:
            continue
        u = int(created[b])
        if u >= 0 and pos[u] <= k:
            group = _delay_group(block, pos, u)
            succ = [int(pos[x]) for x in block.succs[u]]
            target = min(succ) if succ else n
            if target > k + 1 or (target > k and pos[u] < k):
                moves.setdefault((tuple(group), target), nbytes)
        if not block.escaping[b] and tl.free_step[b] > k:
            v = order[int(tl.free_step[b])]
            group = _hoist_group(block, pos, v, k)
            if group is not None:
                moves.setdefault((tuple(group), k), nbytes)
    ranked = sorted(moves.items(), key=lambda item: -item[1])[:limit]
    return [(nbytes, group, dst) for (group, dst), nbytes in ranked]


def _refine(
    block: _Block,
    start: list[int],
    evaluations: int,
    moves_per_step: int,
    planner: str | None = None,
    trajectory: list[tuple[tuple[int, ...], int]] | None = None,
) -> list[int]:
    """Local search from ``start``: move bindings across the peak while no point gets worse.

    A move is kept when the peak is no higher at every acceptance point and, at the point being
    worked on, either lower or reached by fewer steps. Deterministic; at most ``evaluations``
    orders are scored, with the memory model of ``planner`` (the block's by default). The
    moves kept are appended to ``trajectory`` as (bindings moved, binding they now precede,
    -1 for the end).
    """
    tl = _timeline(block, start, planner)
    spent = 0
    # Work on the points in decreasing order of their peaks: the largest shapes first.
    points = list(np.argsort(-_as_float(tl.peaks), kind="stable"))
    while spent < evaluations:
        improved = False
        for p in points:
            column = tl.values[:, p]
            peak = column.max()
            at_peak = int((column == peak).sum())
            k = int(np.argmax(column))
            best = None
            for _, group, dst in _peak_moves(block, tl, k, p, moves_per_step):
                if spent >= evaluations:
                    break
                spent += 1
                cand = _timeline(block, _move(tl.order, group, dst), planner)
                if (cand.peaks > tl.peaks).any():
                    continue
                new_peak = cand.peaks[p]
                new_count = int((cand.values[:, p] == new_peak).sum())
                if new_peak < peak or (new_peak == peak and new_count < at_peak):
                    key = (new_peak, new_count)
                    if best is None or key < best[0]:
                        best = (key, cand, group, dst)
            if best is not None:
                if trajectory is not None:
                    _, _, group, dst = best
                    trajectory.append(
                        (tuple(tl.order[g] for g in group), tl.order[dst] if dst < block.n else -1)
                    )
                tl = best[1]
                improved = True
                break
        if not improved:
            break
    return tl.order


def _replay(
    block: _Block,
    start: list[int],
    trajectory: list[tuple[tuple[int, ...], int]],
    reference: np.ndarray,
) -> list[int]:
    """Re-apply the moves of a search made with another memory model, keeping each one that
    is still valid (dependencies) and, with the block's model, leaves no point above
    ``reference`` and lowers the mean ratio to it."""
    ref = np.maximum(_as_float(reference), 1.0)
    order = list(start)
    tl = _timeline(block, order)
    current = float((_as_float(tl.peaks) / ref).mean())
    for nodes, before in trajectory:
        pos = tl.pos
        group = sorted(int(pos[x]) for x in nodes)
        dst = int(pos[before]) if before >= 0 else block.n
        moved = _move(tl.order, group, dst)
        new_pos = np.empty(block.n, dtype=np.int64)
        new_pos[np.asarray(moved, dtype=np.int64)] = np.arange(block.n, dtype=np.int64)
        if any(new_pos[q] > new_pos[x] for x in nodes for q in block.preds[x]) or any(
            new_pos[y] < new_pos[x] for x in nodes for y in block.succs[x]
        ):
            continue
        cand = _timeline(block, moved)
        if (cand.peaks > reference).any():
            continue
        mean = float((_as_float(cand.peaks) / ref).mean())
        if mean < current:
            tl, current = cand, mean
    return tl.order


def _as_float(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float64) if values.dtype == object else values


# ====================================================================== choosing


def _schedule_block(
    block: _Block, options: ScheduleOptions, report: BlockReport
) -> list[int] | None:
    space = block.space
    identity = list(range(block.n))
    candidates: dict[str, list[int]] = {}
    for strategy in options.strategies:
        if strategy == "depth-first":
            candidates[strategy] = _depth_first(block)
            continue
        if strategy == "refine":
            candidates[strategy] = _refine(
                block, identity, options.refine_evaluations, options.refine_moves
            )
            if block.planner == "static":
                # Storage reuse makes the search landscape flat in places; the same search on
                # plain liveness finds other moves, which are then scored with the planner.
                moves: list[tuple[tuple[int, ...], int]] = []
                _refine(
                    block,
                    identity,
                    options.refine_evaluations,
                    options.refine_moves,
                    "none",
                    moves,
                )
                reference = _timeline(block, identity).peaks
                candidates["refine-liveness"] = _replay(block, identity, moves, reference)
            continue
        decider = _Decider(space, None)
        candidates[strategy] = _greedy(block, strategy, decider)
        if options.point_variants and decider.met_unknown:
            for p in range(len(space.decision_points)):
                candidates[f"{strategy}@{p}"] = _greedy(block, strategy, _Decider(space, p))

    base = _profile(block, identity)
    report.points = [dict(p) for p in space.acceptance_points]
    report.peak_before = [int(v) for v in base.peaks]
    report.peak_after = list(report.peak_before)
    report.peak_expr_before = base.peak_expr(space)
    report.peak_expr_after = report.peak_expr_before

    accepted: list[tuple[str, OrderProfile, bool]] = []
    seen: set[tuple[int, ...]] = {tuple(identity)}
    for name, order in candidates.items():
        key = tuple(order)
        if key in seen:
            report.candidates[name] = "duplicate"
            continue
        seen.add(key)
        prof = _profile(block, order)
        no_worse = bool((prof.peaks <= base.peaks).all())
        better = bool((prof.peaks < base.peaks).any())
        if space.exact and not no_worse:
            report.candidates[name] = "rejected"
            continue
        if space.exact and not better:
            report.candidates[name] = "no gain"
            continue
        proven = front_le(space, prof.front, base.front, options.proof_budget)
        if proven and better:
            report.candidates[name] = "proven"
            accepted.append((name, prof, True))
        elif options.accept_sampled and space.exact and no_worse and better:
            report.candidates[name] = "sampled"
            accepted.append((name, prof, False))
        else:
            report.candidates[name] = "rejected"
    if not accepted:
        return None

    # Every accepted order is no worse than the input at every acceptance point; keep the one
    # with the lowest worst-case ratio to the input's peak (an order proven no higher than
    # another has no higher ratios), then the lowest mean ratio, proven orders first on ties.
    base_peaks = np.maximum(base.peaks.astype(np.float64), 1.0)
    rank = {name: i for i, name in enumerate(candidates)}

    def score(entry: tuple[str, OrderProfile, bool]) -> tuple[float, float, bool, int]:
        ratios = entry[1].peaks.astype(np.float64) / base_peaks
        return (float(ratios.max()), float(ratios.mean()), not entry[2], rank[entry[0]])

    name, prof, proven = min(accepted, key=score)
    report.strategy = name
    report.proven = proven
    report.peak_after = [int(v) for v in prof.peaks]
    report.peak_expr_after = prof.peak_expr(space)
    return prof.order


# ====================================================================== functions and modules


def _used_vars(expr: relax.Expr) -> list[relax.Var]:
    return list(relax.analysis.free_vars(expr))


def schedule_function(
    func: relax.Function,
    mod: tvm.IRModule | None = None,
    options: ScheduleOptions | None = None,
    name: str = "",
) -> tuple[relax.Function, ScheduleReport]:
    """Reorder the dataflow blocks of one function.

    Parameters
    ----------
    func
        A normalized ``relax.Function``.
    mod
        The module ``func`` belongs to (lets ``call_tir`` of reshape kernels count as views).
    options
        :class:`ScheduleOptions` (defaults when None).
    name
        The function's name, for the report.

    Returns
    -------
    tuple
        The function (the same object when nothing changed) and a :class:`ScheduleReport`.
    """
    options = options or ScheduleOptions()
    report = ScheduleReport()
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not any(
        isinstance(b, relax.DataflowBlock) for b in body.blocks
    ):
        return func, report
    try:
        graph = ShapeGraph.from_function(func)
    except Exception as err:  # unusual shapes: leave the function as it is
        warnings.warn(
            f"MemoryAwareSchedule: {name or 'function'} left unchanged: {err}", stacklevel=2
        )
        return func, report

    blocks = list(body.blocks)
    # Variables used after each block: by later blocks or by the result.
    used_after: list[set[relax.Var]] = [set() for _ in blocks]
    later: set[relax.Var] = set(_used_vars(body.body))
    for k in range(len(blocks) - 1, -1, -1):
        used_after[k] = set(later)
        for binding in blocks[k].bindings:
            later.update(_used_vars(binding.value))
    params = set(func.params)
    tir_defined: set[str] = set()
    for p in func.params:
        tir_defined |= _tir_var_names([relax.analysis.definable_tir_vars_in_type(p.ty)])

    new_blocks = []
    changed = False
    for k, blk in enumerate(blocks):
        new_blocks.append(blk)
        if isinstance(blk, relax.DataflowBlock):
            order = _schedule_one(
                blk, k, graph, mod, params, used_after[k], tir_defined, options, name, report
            )
            if order is not None:
                bindings = list(blk.bindings)
                new_blocks[-1] = relax.DataflowBlock([bindings[i] for i in order], blk.span)
                changed = True
        for binding in blk.bindings:
            if isinstance(binding, relax.MatchCast):
                tir_defined |= _tir_var_names(
                    [relax.analysis.definable_tir_vars_in_type(binding.ty)]
                )
    if not changed:
        return func, report
    new_body = relax.SeqExpr(new_blocks, body.body, body.span)
    new_func = relax.Function(
        func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span
    )
    return relax.BlockBuilder().normalize(new_func), report


def _schedule_one(
    blk: relax.DataflowBlock,
    index: int,
    graph: ShapeGraph,
    mod: tvm.IRModule | None,
    params: set[relax.Var],
    used_after: set[relax.Var],
    tir_defined: set[str],
    options: ScheduleOptions,
    name: str,
    report: ScheduleReport,
) -> list[int] | None:
    start = time.perf_counter()
    n = len(blk.bindings)
    entry = BlockReport(function=name, block=index, bindings=n, strategy="input")
    report.blocks.append(entry)
    try:
        if n < max(options.min_bindings, 2):
            entry.strategy = "skipped: too few bindings"
            return None
        if options.max_bindings is not None and n > options.max_bindings:
            entry.strategy = "skipped: too many bindings"
            return None
        try:
            block = _BlockBuilder(
                blk, graph, mod, params, used_after, tir_defined, options.planner
            ).build()
        except (_Unsupported, UnsupportedBytes) as err:
            entry.strategy = f"skipped: {err}"
            return None
        order = _schedule_block(block, options, entry)
        if order is None or order == list(range(n)):
            entry.strategy = "input"
            return None
        return order
    finally:
        entry.seconds = time.perf_counter() - start


def schedule_module(
    mod: tvm.IRModule, options: ScheduleOptions | None = None
) -> tuple[tvm.IRModule, ScheduleReport]:
    """Apply :func:`schedule_function` to every Relax function of ``mod``.

    Returns the new module (``mod`` itself when nothing changed) and the merged report.
    """
    report = ScheduleReport()
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        if func.attrs is not None and "Primitive" in func.attrs:
            continue  # fused sub-functions: FuseTIR turns them into kernels
        new_func, sub = schedule_function(func, mod, options, gv.name_hint)
        report.blocks.extend(sub.blocks)
        if new_func is not func:
            updates[gv] = new_func
    if not updates:
        return mod, report
    functions = {gv: updates.get(gv, func) for gv, func in mod.functions.items()}
    out = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
    return out, report


@tvm.transform.module_pass(opt_level=0, name="MemoryAwareSchedule")
class MemoryAwareSchedule:
    """Reorder the bindings of every dataflow block to lower the peak of live bytes.

    See the module docstring for where it runs, its memory model and how it decides.

    Parameters
    ----------
    options
        :class:`ScheduleOptions` (defaults when None).
    """

    def __init__(self, options: ScheduleOptions | None = None) -> None:
        if options is not None and not isinstance(options, ScheduleOptions):
            raise TypeError(f"options must be a ScheduleOptions, got {type(options).__name__}")
        self.options = options or ScheduleOptions()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        new_mod, _ = schedule_module(mod, self.options)
        return new_mod

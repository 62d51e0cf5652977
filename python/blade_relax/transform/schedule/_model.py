"""The block model of :mod:`.memory_aware_schedule`: dependencies, buffers and live bytes.

A dataflow block is read once into a :class:`Block`: the def-use edges (plus the edges that
``match_cast`` and in-place calls need), the buffers each binding allocates and reads, which
buffers escape the block, and their byte counts as vectors of a
:class:`~._cost.ByteSpace`. The buffers and what each variable keeps alive are the storage
flow's (:func:`blade_relax.analysis.storage_flow`, walked with the effects of :mod:`._effects`,
the values of earlier blocks as buffers live on entry). :func:`timeline` then scores any order of the bindings:
the live bytes at every step, symbolic and at the acceptance points, under one of the memory
models of :data:`PLANNERS` (see the docstring of :mod:`.memory_aware_schedule`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ...analysis.effects import SHAPE_ONLY_OPS, in_place_writes
from ...analysis.inplace_reuse import inplace_inputs
from ...analysis.liveness import Liveness, block_liveness
from ...analysis.storage_flow import storage_flow
from ...analysis.workspace import call_workspace
from ...symbolic import Ordering, ShapeGraph, SymbolicExpr, TypeSizes
from .._warn import warn_fallback
from ._cost import ByteSpace, OrderProfile, pareto_front
from ._effects import FIELDS, ValueRead, ValueReader, allocated, vars_in

# ====================================================================== the block graph


@dataclass
class Block:
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
    planner: str  # one of PLANNERS
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
    # In-place placements PlanMemory may make (``planner="plan"``), in the order it tries
    # them: binding, input buffer whose storage the binding's output takes when the binding
    # is the input's last reader, and output buffer (see :func:`inplace_ends`).
    inplace_binding: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inplace_input: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inplace_output: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # n x M: bytes each binding's kernel holds only while it runs (its workspace, as
    # :func:`blade_relax.analysis.memory_timeline` counts it); None when no binding has one.
    workspace: np.ndarray | None = None
    cache: dict = field(default_factory=dict)  # order-independent tables (see _plan_tables)

    @property
    def n(self) -> int:
        return len(self.bindings)


#: Memory models an order can be scored with: ``"static"`` (StaticPlanBlockMemory's storage
#: reuse), ``"none"`` (plain liveness, as the stock lowering kills values), ``"plan"`` (plain
#: liveness with the fields of multi-output kernels released after their last use, as
#: PlanMemory's lowering does).
PLANNERS = ("static", "none", "plan")


def tir_var_names(exprs: Sequence) -> set[str]:
    names: set[str] = set()
    for e in exprs:
        names.update(v.name for v in e)
    return names


@dataclass
class _BlockRead:
    """What :meth:`BlockReader._read_bindings` finds in a block, per binding."""

    preds: list[set[int]]
    uses: list[list[relax.Var]] = field(default_factory=list)
    creates: list[tuple[int, ...]] = field(default_factory=list)
    touch: list[list[int]] = field(default_factory=list)
    match_defs: list[tuple[int, set[str]]] = field(default_factory=list)
    is_call: list[bool] = field(default_factory=list)
    view_like: list[bool] = field(default_factory=list)
    index_of: dict[relax.Var, int] = field(default_factory=dict)


def _consumer_runs(consumers: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers with consumers (ascending), the start of each one's run, and the runs
    (consumers grouped by buffer), as flat arrays."""
    buffers = np.array([b for b in range(len(consumers)) if consumers[b]], dtype=np.int64)
    runs = [len(consumers[b]) for b in buffers]
    if not buffers.size:
        return buffers, np.zeros(0, dtype=np.int64), np.array([], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(runs)[:-1]]).astype(np.int64)
    nodes = np.array([j for b in buffers for j in consumers[b]], dtype=np.int64)
    return buffers, starts, nodes


class BlockReader:
    """Reads one dataflow block into a :class:`Block`."""

    def __init__(
        self,
        block: relax.DataflowBlock,
        graph: ShapeGraph,
        mod: tvm.IRModule | None,
        params: set[relax.Var],
        used_after: set[relax.Var],
        tir_defined_before: set[str],
        planner: str = "static",
        inplace: bool = False,
        workspaces: bool = False,
    ) -> None:
        self.planner = planner
        # Add each kernel's workspace to its step; see ``ScheduleOptions.model_workspaces``.
        self.model_workspaces = workspaces
        # Model PlanMemory's in-place placements (``planner="plan"``); see
        # ``ScheduleOptions.model_inplace``.
        self.model_inplace = inplace
        self.block = block
        self.graph = graph
        self.mod = mod
        self.params = params
        self.used_after = used_after
        self.tir_defined_before = tir_defined_before
        self.size_exprs: list[SymbolicExpr] = []
        self.external: list[int] = []
        # What each variable keeps alive, in the order its value meets them (the storage flow's).
        self.refs: dict[relax.Var, tuple[int, ...]] = {}
        self.sizes = TypeSizes(graph)
        self.dtypes: list[str] = []
        self.plannable: set[int] = set()  # allocated through builtin.alloc_tensor once lowered
        self.discarded: set[int] = set()  # reach something StaticPlanBlockMemory does not plan
        # Buffers the lowered function holds until it returns: the fields of a multi-output
        # kernel (after CallTIRRewrite the result is a tuple var that no one reads, since
        # TupleGetItem folds to the field, so KillAfterLastUse never kills it), and the source
        # of a view or tuple that is never read (KillAfterLastUse only kills used variables).
        self.leaked: set[int] = set()
        # Fields of multi-output kernels: leaked under the stock lowering, released by
        # PlanMemory (it kills such tuples after their last item access).
        self.tuple_fields: set[int] = set()
        # Buffers read by a call other than a kernel's (PlanMemory never places an output in
        # them), and the in-place candidates (binding, input buffer, output buffer).
        self.opaque: set[int] = set()
        self.inplace: list[tuple[int, int, int]] = []
        # Kernel workspaces: (binding, bytes), for the bindings whose kernel allocates one.
        self.workspaces: list[tuple[int, SymbolicExpr]] = []

    # -------------------------------------------------------------- buffers
    def _bytes(self, ty: tvm.ir.Type, var: relax.Var | None = None) -> SymbolicExpr:
        # Most bindings of a block share a handful of types: read each type's size once.
        return self.sizes.bytes_of(ty, var)

    def _outside(self, var: relax.Var) -> SymbolicExpr | None:
        """A value of an earlier block is a buffer live on entry; a parameter owns none here."""
        return None if var in self.params else allocated(self._bytes(var.ty, var))

    def _read_flow(self, info: Liveness, reads: list[ValueRead]) -> list[list[int]]:
        """The block's buffers and what each variable keeps alive, in order: the storage flow
        of the block's bindings, with the effects of ``reads`` and the values of earlier blocks
        as buffers live on entry. Returns the buffers each binding creates."""
        flow = storage_flow(
            info,
            lambda binding: reads[binding.index].effect,
            lambda var: self._bytes(var.ty, var),
            explicit_kills=False,
            fields=FIELDS,
            lifetimes=False,
            outside=self._outside,
        )
        created: list[list[int]] = [[] for _ in reads]
        for alloc in flow.allocations:
            ty = alloc.var.ty if alloc.field is None else alloc.var.ty.fields[alloc.field]
            dtype = getattr(ty, "dtype", None) if isinstance(ty, relax.TensorType) else None
            self.size_exprs.append(alloc.nbytes)
            self.dtypes.append("" if dtype is None else str(dtype))
            if alloc.start < 0:
                self.external.append(alloc.id)
            else:
                created[alloc.start].append(alloc.id)
        self.refs = flow.refs_in_order
        return created

    def _note_buffers(self, got: ValueRead, own: tuple[int, ...]) -> None:
        """How the lowering will treat the buffers a binding creates and reads."""
        for arg in got.discards:
            for source in vars_in(arg):
                self.discarded.update(self.refs[source])
        if got.plannable:
            self.plannable.update(own)
            if got.tuple_fields:
                self.tuple_fields.update(own)

    def _write_edges(
        self, bindings: list[relax.Binding], uses: list[list[relax.Var]], preds: list[set[int]]
    ) -> None:
        """Keep a binding that writes into existing memory (``call_tir_inplace``,
        ``call_inplace_packed``) in place relative to every binding that reads that memory,
        through any alias, view or tuple: a value of the block or a parameter (which owns no
        buffer here)."""
        writes = in_place_writes(bindings, self.mod)
        if not writes.writes:
            return
        touched: dict[relax.Var, list[int]] = {}
        for j, used in enumerate(uses):
            for u in used:
                for root in writes.roots_of(u):
                    touched.setdefault(root, []).append(j)
        for i, written in writes.writes.items():
            for root in written:
                for j in touched.get(root, ()):
                    if j < i:
                        preds[i].add(j)
                    elif j > i:
                        preds[j].add(i)

    def _note_inplace(
        self, i: int, call: relax.Call, own: tuple[int, ...], touched: list[int]
    ) -> None:
        """Record where PlanMemory may place the outputs of binding ``i`` in place.

        As in ``PlanMemory``: a kernel's output takes the storage of an input of provably equal
        size that dies at the call, when the kernel's access pattern allows it
        (:func:`blade_relax.analysis.inplace_reuse.inplace_inputs`). Inputs read by anything but
        kernels (packed functions, Relax functions, operators) are never taken.
        """
        callee = call.args[0] if call.args else None
        func = (
            self.mod[callee]
            if self.mod is not None
            and isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.call_tir"
            and isinstance(callee, tvm.ir.GlobalVar)
            and callee in self.mod.functions
            else None
        )
        if not isinstance(func, tvm.tirx.PrimFunc):
            if not isinstance(call.op, tvm.ir.Op) or call.op.name not in SHAPE_ONLY_OPS:
                self.opaque.update(b for b in touched if b not in own)
            return
        packed = call.args[1]
        args = list(packed.fields) if isinstance(packed, relax.Tuple) else [packed]
        outputs = [b for b in own if b in self.plannable]
        for j, out in enumerate(outputs):
            for var, _ in inplace_inputs(func, args, len(args) + j):
                refs = self.refs.get(var, ())
                if len(refs) != 1:
                    continue
                size_in, size_out = self.size_exprs[refs[0]], self.size_exprs[out]
                if size_in.expr == size_out.expr or (
                    self.graph.compare(size_in, size_out) == Ordering.EQ
                ):
                    self.inplace.append((i, refs[0], out))

    def _note_workspace(self, i: int, call: relax.Call, var: relax.Var) -> None:
        """Record the workspace binding ``i``'s kernel holds while it runs.

        The lowered function's peak includes it (:func:`blade_relax.analysis.memory_timeline`
        and the runtime count it): an order whose peak step runs a kernel with scratch memory
        peaks that much higher than its tensors alone. A workspace the call's shapes cannot
        give (UNKNOWN) is left out, as is any a kernel's TIR does not let us read.
        """
        if self.mod is None:
            return
        try:
            nbytes = call_workspace(call, var, self.mod, self.graph)
        except Exception as err:  # reading a kernel's lowered TIR may fail in any way
            warn_fallback("MemoryAwareSchedule", "the workspace of a kernel", var.name, err)
            return
        if nbytes is None or nbytes.is_unknown or (nbytes.is_constant and nbytes.expr == 0):
            return
        self.workspaces.append((i, nbytes))

    # -------------------------------------------------------------- the graph
    def build(self) -> Block:
        bindings = list(self.block.bindings)
        n = len(bindings)
        read = self._read_bindings(bindings)
        self._mark_leaked(bindings, read)
        preds = read.preds
        if read.match_defs:
            self._match_cast_edges(bindings, read.match_defs, preds)
        num_buffers = len(self.size_exprs)
        consumers: list[list[int]] = [[] for _ in range(num_buffers)]
        for i, t in enumerate(read.touch):
            for b in t:
                consumers[b].append(i)
        self._write_edges(bindings, read.uses, preds)
        escaping = np.zeros(num_buffers, dtype=bool)
        for var, refs in self.refs.items():
            if var in self.used_after:
                escaping[list(refs)] = True
        space, sizes, alloc, initial, workspace = self._byte_arrays(read.creates, n)
        plannable = np.zeros(num_buffers, dtype=bool)
        plannable[sorted(self.plannable - self.discarded - set(self.external))] = True
        plannable &= ~escaping
        # Values the lowered function never kills live until it returns (see BlockReader).
        leaked = self.leaked if self.planner == "plan" else self.leaked | self.tuple_fields
        escaping[sorted(leaked)] = True
        call_consumers = [[j for j in cons if read.is_call[j]] for cons in consumers]
        call_cons_buffer, call_cons_start, call_cons_node = _consumer_runs(call_consumers)
        cons_buffer, cons_start, cons_node = _consumer_runs(consumers)
        pred_lists = [sorted(p) for p in preds]
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(pred_lists):
            for j in p:
                succs[j].append(i)
        # Argument order for the depth-first strategy: first use first.
        ordered_preds = []
        for i in range(n):
            seen = dict.fromkeys(read.index_of[u] for u in read.uses[i] if u in read.index_of)
            ordered_preds.append(list(seen) + [j for j in pred_lists[i] if j not in seen])
        created_by = np.full(num_buffers, -1, dtype=np.int64)
        for i, own in enumerate(read.creates):
            created_by[list(own)] = i
        candidates = [
            (i, u, t)
            for i, u, t in self.inplace
            if plannable[u] and plannable[t] and u not in self.opaque
        ]
        inplace = np.array(candidates, dtype=np.int64).reshape(-1, 3)
        return Block(
            inplace_binding=inplace[:, 0].copy(),
            inplace_input=inplace[:, 1].copy(),
            inplace_output=inplace[:, 2].copy(),
            workspace=workspace,
            planner=self.planner,
            plannable=plannable,
            dtypes=self.dtypes,
            size_keys=[tuple(row.tolist()) for row in sizes],
            const_sizes=[space.constant_value(row) for row in sizes],
            call_cons_buffer=call_cons_buffer,
            call_cons_start=call_cons_start,
            call_cons_node=call_cons_node,
            touch_rank=[{b: r for r, b in enumerate(t)} for t in read.touch],
            created_by=created_by,
            cons_buffer=cons_buffer,
            cons_start=cons_start,
            cons_node=cons_node,
            bindings=bindings,
            preds=ordered_preds,
            succs=succs,
            touch=read.touch,
            alloc=alloc,
            sizes=sizes,
            escaping=escaping,
            initial=initial,
            consumers=consumers,
            space=space,
        )

    def _read_bindings(self, bindings: list[relax.Binding]) -> _BlockRead:
        """Read every binding: what it uses and creates, the buffers it touches, its
        def-use predecessors, the dims a ``match_cast`` defines, and the notes on in-place
        placements and workspaces."""
        info = block_liveness(self.block)
        reader = ValueReader(self.graph, self.mod, self.sizes)
        reads = [reader.read(binding) for binding in bindings]
        created = self._read_flow(info, reads)
        read = _BlockRead(preds=[set() for _ in bindings])
        for i, binding in enumerate(bindings):
            var, value, got = binding.var, binding.value, reads[i]
            used = list(info.bindings[i].uses)
            read.uses.append(used)
            for u in used:
                j = read.index_of.get(u)
                if j is not None:
                    read.preds[i].add(j)
            if isinstance(binding, relax.MatchCast):
                defined = (
                    tir_var_names([relax.analysis.definable_tir_vars_in_type(binding.ty)])
                    - self.tir_defined_before
                )
                if defined:
                    read.match_defs.append((i, defined))
            is_call = isinstance(value, relax.Call) and not got.is_view
            read.is_call.append(is_call and not isinstance(binding, relax.MatchCast))
            read.view_like.append(got.is_view)
            own = tuple(created[i])
            self._note_buffers(got, own)
            read.creates.append(own)
            read.index_of[var] = i
            t: list[int] = []
            for u in used:
                t.extend(self.refs[u])
            t.extend(own)
            read.touch.append(list(dict.fromkeys(t)))
            if is_call:
                if self.model_inplace:
                    self._note_inplace(i, value, own, t)
                if self.model_workspaces:
                    self._note_workspace(i, value, var)
        return read

    def _mark_leaked(self, bindings: list[relax.Binding], read: _BlockRead) -> None:
        """Views and tuples nobody reads: the lowered function never kills them."""
        used_vars: set[relax.Var] = {u for used in read.uses for u in used}
        for i, binding in enumerate(bindings):
            var = binding.var
            if var in used_vars or var in self.used_after:
                continue
            if read.view_like[i] or isinstance(binding.value, relax.Tuple):
                self.leaked.update(self.refs.get(var, ()))

    def _byte_arrays(
        self, creates: list[tuple[int, ...]], n: int
    ) -> tuple[ByteSpace, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The byte space of the block's sizes and workspaces; each buffer's size vector,
        the bytes each binding allocates, the bytes live on entry, and the workspace each
        binding holds while it runs (None without workspaces)."""
        num_buffers = len(self.size_exprs)
        space = ByteSpace(self.graph, self.size_exprs + [w for _, w in self.workspaces])
        sizes = space.vectors[:num_buffers]
        workspace = None
        if self.workspaces:
            workspace = np.zeros((n, space.size), dtype=space.dtype)
            for k, (i, _) in enumerate(self.workspaces):
                workspace[i] += space.vectors[num_buffers + k]
        alloc = np.zeros((n, space.size), dtype=space.dtype)
        for i, own in enumerate(creates):
            for b in own:
                alloc[i] += sizes[b]
        initial = space.zero()
        for b in self.external:
            initial = initial + sizes[b]
        return space, sizes, alloc, initial, workspace

    @staticmethod
    def _match_cast_edges(
        bindings: list[relax.Binding], match_defs: list[tuple[int, set[str]]], preds: list[set[int]]
    ) -> None:
        for j, binding in enumerate(bindings):
            mentioned = tir_var_names(
                [
                    relax.analysis.tir_vars_in_type(binding.var.ty),
                    relax.analysis.free_symbolic_vars(binding.value),
                ]
            )
            if isinstance(binding, relax.MatchCast):
                mentioned |= tir_var_names([relax.analysis.tir_vars_in_type(binding.ty)])
            for i, defined in match_defs:
                if j > i and mentioned & defined:
                    preds[j].add(i)


@dataclass
class Timeline:
    """Live bytes of one order: symbolic rows and their values at the acceptance points."""

    order: list[int]
    pos: np.ndarray  # position of each binding
    free_step: np.ndarray  # position after which each buffer is freed (-1: never)
    during: np.ndarray  # n x M: live bytes while each step runs
    by_point: np.ndarray  # P x n: ``during`` at each acceptance point
    peaks: np.ndarray  # P
    groups: dict = field(default_factory=dict)  # move groups computed for this order
    _positions: list[int] | None = field(default=None, repr=False)

    def positions(self) -> list[int]:
        """``pos`` as a list: the move searches index it element by element, which numpy
        arrays do slowly."""
        if self._positions is None:
            self._positions = self.pos.tolist()
        return self._positions


def _rows(
    block: Block,
    starts: np.ndarray,
    start_sizes: np.ndarray,
    ends: np.ndarray,
    end_sizes: np.ndarray,
) -> np.ndarray:
    """``live_during`` rows from allocations (step, size) and frees (after step, size)."""
    n = block.n
    space = block.space
    if not space.float_exact:
        allocated = np.zeros((n, space.size), dtype=space.dtype)
        np.add.at(allocated, starts, start_sizes)
        freed = np.zeros((n, space.size), dtype=space.dtype)
        np.add.at(freed, ends, end_sizes)
        return block.initial + np.cumsum(allocated, axis=0) - (np.cumsum(freed, axis=0) - freed)
    m = space.size
    columns = np.arange(m, dtype=np.int64)

    def per_step(steps: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        # One bincount over (step, column) pairs. Integer sums through float weights are
        # exact below 2**53 (``float_exact``).
        flat = (steps[:, None] * m + columns).ravel()
        sums = np.bincount(flat, weights=sizes.ravel(), minlength=n * m)
        return np.rint(sums).astype(np.int64).reshape(n, m)

    # Live during step i: allocated at steps <= i, less freed after steps < i (int64 sums
    # wrap alike in any order, so this equals the two cumulative sums it replaces).
    delta = per_step(starts, start_sizes)
    delta[1:] -= per_step(ends, end_sizes)[:-1]
    return block.initial + np.cumsum(delta, axis=0)


def _last_position(
    pos: np.ndarray, nodes: np.ndarray, starts: np.ndarray, count: int, buffers: np.ndarray
) -> np.ndarray:
    out = np.full(count, -1, dtype=np.int64)
    if nodes.size:
        out[buffers] = np.maximum.reduceat(pos[nodes], starts)
    return out


@dataclass
class _TimelineTables:
    """Order-independent selections :func:`timeline` makes for every order it scores."""

    steps: np.ndarray  # arange(n)
    kept: np.ndarray  # B: not escaping (may be freed in the block)
    own_creator: np.ndarray  # binding that allocates each buffer created in the block
    own_sizes: np.ndarray  # their sizes
    plain_creator: np.ndarray  # the same for those not plannable (``"static"``)
    plain_sizes: np.ndarray
    kept_unplanned: np.ndarray  # B: not escaping and not plannable
    inplace_kept: np.ndarray  # per in-place candidate: its input is not escaping


def _timeline_tables(block: Block) -> _TimelineTables:
    tables = block.cache.get("timeline")
    if tables is None:
        own = block.created_by >= 0
        plain = own & ~block.plannable
        kept = ~block.escaping
        tables = _TimelineTables(
            steps=np.arange(block.n, dtype=np.int64),
            kept=kept,
            own_creator=block.created_by[own],
            own_sizes=block.sizes[own],
            plain_creator=block.created_by[plain],
            plain_sizes=block.sizes[plain],
            kept_unplanned=kept & ~block.plannable,
            inplace_kept=kept[block.inplace_input],
        )
        block.cache["timeline"] = tables
    return tables


def timeline(block: Block, order: Sequence[int], planner: str | None = None) -> Timeline:
    """Live bytes of ``order``; with ``planner="static"`` (the default of the block), storage
    reuse as ``StaticPlanBlockMemory`` will plan it (see :func:`plan_storage`)."""
    planner = block.planner if planner is None else planner
    tables = _timeline_tables(block)
    order_arr = np.asarray(order, dtype=np.int64)
    pos = np.empty(block.n, dtype=np.int64)
    pos[order_arr] = tables.steps
    num_buffers = block.sizes.shape[0]
    free_step = _last_position(
        pos, block.cons_node, block.cons_start, num_buffers, block.cons_buffer
    )
    freeable = tables.kept & (free_step >= 0)
    if planner == "static" and block.plannable.any():
        token_start, token_end, token_sizes = plan_storage(block, pos, free_step)
        starts = np.concatenate([pos[tables.plain_creator], token_start])
        start_sizes = np.concatenate([tables.plain_sizes, token_sizes])
        gone = tables.kept_unplanned & (free_step >= 0)
        freed_tokens = token_end >= 0
        ends = np.concatenate([free_step[gone], token_end[freed_tokens]])
        end_sizes = np.concatenate([block.sizes[gone], token_sizes[freed_tokens]])
    else:
        starts, start_sizes = pos[tables.own_creator], tables.own_sizes
        end_step = free_step
        if planner == "plan" and block.inplace_binding.size:
            end_step = inplace_ends(block, pos, free_step)
        ends, end_sizes = end_step[freeable], block.sizes[freeable]
    during = _rows(block, starts, start_sizes, ends, end_sizes)
    if block.workspace is not None:
        during = during + block.workspace[order_arr]
    by_point = block.space.by_acceptance_point(during)
    return Timeline(
        order=list(order),
        pos=pos,
        free_step=free_step,
        during=during,
        by_point=by_point,
        peaks=by_point.max(axis=1),
    )


def inplace_ends(block: Block, pos: np.ndarray, free_step: np.ndarray) -> np.ndarray:
    """``free_step`` with PlanMemory's in-place placements of an order applied.

    A binding whose output PlanMemory places in the storage of a dying input allocates
    nothing: the input's bytes become the output's. Modelled by ending the input one step
    earlier (its last reader runs with the output in its place). A placement applies when the
    binding is the input's last reader and the input is freed in the block; each output takes
    the first such input in PlanMemory's order, each input goes to one output.
    """
    binding, inputs = block.inplace_binding, block.inplace_input
    at = pos[binding]
    active = np.flatnonzero((free_step[inputs] == at) & _timeline_tables(block).inplace_kept)
    if not active.size:
        return free_step
    outputs = block.inplace_output[active]
    taken = outputs.tolist()
    given = inputs[active].tolist()
    if len(set(given)) == len(given):
        # Distinct inputs: each output goes to its first candidate (the loop below, faster).
        first = dict(zip(reversed(taken), range(len(taken) - 1, -1, -1)))
        chosen = active if len(first) == len(taken) else active[sorted(first.values())]
    else:
        taken_in: set[int] = set()
        taken_out: set[int] = set()
        picks = []
        for c, t, u in zip(active.tolist(), taken, given):
            if u not in taken_in and t not in taken_out:
                taken_in.add(u)
                taken_out.add(t)
                picks.append(c)
        chosen = np.asarray(picks, dtype=np.int64)
    ends = free_step.copy()
    ends[inputs[chosen]] = at[chosen] - 1
    return ends


_NEVER = -2  # token end of a storage that lives until the function returns


@dataclass
class _PlanTables:
    """Order-independent facts :func:`plan_storage` needs, as plain Python values."""

    buffers: np.ndarray  # plannable buffers
    creator: np.ndarray  # binding that allocates each of them
    kind: list[int]  # per buffer: pool class (dtype and size) of a symbolic size, -1 if constant
    dtype_id: list[int]  # per buffer: dtype class
    const: list[int]  # per buffer: the constant size, -1 if symbolic
    escaping: list[bool]
    call_rank: np.ndarray  # per entry of call_cons_node: the buffer's rank among its arguments
    const_column: int  # monomial index of the constant term (-1 if none)


def _plan_tables(block: Block) -> _PlanTables:
    tables = block.cache.get("plan")
    if tables is not None:
        return tables
    num_buffers = block.sizes.shape[0]
    kinds: dict[tuple, int] = {}
    dtypes: dict[str, int] = {}
    kind, dtype_id, const = [-1] * num_buffers, [0] * num_buffers, [-1] * num_buffers
    for b in range(num_buffers):
        dtype_id[b] = dtypes.setdefault(block.dtypes[b], len(dtypes))
        value = block.const_sizes[b]
        if value is None:
            kind[b] = kinds.setdefault((block.dtypes[b], block.size_keys[b]), len(kinds))
        else:
            const[b] = int(value)
    rank = np.zeros(block.call_cons_node.size, dtype=np.int64)
    for i, b in enumerate(block.call_cons_buffer):
        begin = int(block.call_cons_start[i])
        stop = (
            int(block.call_cons_start[i + 1])
            if i + 1 < block.call_cons_buffer.size
            else block.call_cons_node.size
        )
        for j in range(begin, stop):
            rank[j] = block.touch_rank[int(block.call_cons_node[j])].get(int(b), 0)
    has_constant = any(v is not None and v != 0 for v in block.const_sizes)
    unit = block.space.constant(1) if has_constant else block.space.zero()
    nonzero = np.flatnonzero(unit)
    buffers = np.nonzero(block.plannable)[0]
    tables = _PlanTables(
        buffers=buffers,
        creator=block.created_by[buffers],
        kind=kind,
        dtype_id=dtype_id,
        const=const,
        escaping=[bool(x) for x in block.escaping],
        call_rank=rank,
        const_column=int(nonzero[0]) if nonzero.size else -1,
    )
    block.cache["plan"] = tables
    return tables


def plan_storage(
    block: Block, pos: np.ndarray, free_step: np.ndarray, assignment: dict | None = None
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
    tables = _plan_tables(block)
    num_buffers = block.sizes.shape[0]
    # The releasing call of each buffer is its last call consumer; encode (position, argument
    # rank) in one integer so that one reduction finds both.
    release = np.full(num_buffers, -1, dtype=np.int64)
    rank_of = np.zeros(num_buffers, dtype=np.int64)
    if block.call_cons_node.size:
        scale = int(tables.call_rank.max()) + 1
        combined = pos[block.call_cons_node] * scale + tables.call_rank
        last = np.maximum.reduceat(combined, block.call_cons_start)
        release[block.call_cons_buffer] = last // scale
        rank_of[block.call_cons_buffer] = last % scale
    buffers = tables.buffers
    created = pos[tables.creator]
    alloc_order = buffers[np.lexsort((buffers, created))].tolist()
    # Tokens released by one call go back to the pool in the order of its arguments.
    released = buffers[release[buffers] >= 0]
    release_order = released[np.lexsort((released, rank_of[released], release[released]))].tolist()
    release_at = release.tolist()
    step_of = pos[block.created_by].tolist() if num_buffers else []
    free_at = free_step.tolist()
    kind, dtype_id, const_of, escaping = tables.kind, tables.dtype_id, tables.const, tables.escaping
    token_of = {} if assignment is None else assignment
    starts: list[int] = []
    ends: list[int] = []
    first: list[int] = []  # first buffer of each token
    const: list[int] = []  # constant size of each token (-1: symbolic)
    dynamic_pool: dict[int, list[int]] = {}
    const_pool: dict[int, list[tuple[int, int, int]]] = {}
    seq = 0
    r = 0
    count = len(release_order)
    for b in alloc_order:
        step = step_of[b]
        # Tokens released by calls before this step are back in the pool.
        while r < count and release_at[release_order[r]] < step:
            rb = release_order[r]
            r += 1
            t = token_of[rb]
            if const[t] < 0:
                dynamic_pool.setdefault(kind[rb], []).append(t)
            else:
                bisect.insort(const_pool.setdefault(dtype_id[rb], []), (const[t], seq, t))
                seq += 1
        value = const_of[b]
        token = -1
        if value < 0:
            waiting = dynamic_pool.get(kind[b])
            if waiting:
                token = waiting.pop(0)
        else:
            pool = const_pool.get(dtype_id[b])
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
        if token < 0:
            token = len(starts)
            starts.append(step)
            ends.append(-1)
            first.append(b)
            const.append(value)
        token_of[b] = token
        if escaping[b] or ends[token] == _NEVER:
            ends[token] = _NEVER
        elif free_at[b] > ends[token]:
            ends[token] = free_at[b]
    rows = block.sizes[np.asarray(first, dtype=np.int64)].copy()
    const_arr = np.asarray(const, dtype=np.int64)
    fixed = const_arr >= 0
    if fixed.any():
        rows[fixed] = 0
        if tables.const_column >= 0:
            rows[fixed, tables.const_column] = const_arr[fixed]
    rows = rows.astype(block.space.dtype).reshape(len(starts), block.space.size)
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), rows


def profile(block: Block, order: Sequence[int]) -> OrderProfile:
    tl = timeline(block, order)
    order_arr = np.asarray(order, dtype=np.int64)
    allocating = block.alloc[order_arr].any(axis=1)
    if block.workspace is not None:
        allocating |= block.workspace[order_arr].any(axis=1)
    allocating[0] = True
    return OrderProfile(
        order=list(order), peaks=tl.peaks, front=pareto_front(block.space, tl.during[allocating])
    )

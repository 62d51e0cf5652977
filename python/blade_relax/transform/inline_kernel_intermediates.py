"""InlineKernelIntermediates: fused CPU kernels compute their chains without scratch buffers.

``FuseTIR`` builds a fused kernel by concatenating the blocks of the operators it fuses; each
operator's output becomes an intermediate buffer of the full size (``T.sblock_alloc_buffer``),
which the CPU build allocates as a kernel workspace (``TVMBackendAllocWorkspace``) every time
the kernel runs. On a GPU, dlight's schedules inline such chains; on the CPU nothing does (the
stock CPU pipeline has no TIR schedule), so a fused ``add -> multiply -> add -> transpose`` holds
three extra copies of its input while it runs, and a softmax holds its full ``exp``. This pass
computes an intermediate written by a spatial block (no reduction) inside its consumers
(``s_tir.Schedule.compute_inline``), in every PrimFunc of the module, when each consumer reads
one element of it per iteration, a different one each time (its read region is one point
whose coordinates are distinct iteration vars, each plus a constant, or constants, the vars
covering every iteration var of extent above 1), and there are at most ``max_consumers`` of
them (2 by default) or they together run at most that many times as many iterations as the
intermediate has elements. Inlining then computes each element once per read of it: ``k`` consumers that each read all of
it compute it ``k`` times (a softmax's ``exp`` for the sum and again for the quotient), and
the parts of a split read it once in all (the three of a fused ``qkv`` projection, moved to
``(heads, s, 3 * d)`` and split, hold no ``3 * d`` wide copy while the kernel runs). The
second check compares the iteration counts symbolically, every dimension taken as
non-negative.

A reduction's result cannot be inlined; when one elementwise block reads it (a
``matmul -> add`` epilogue), that block is moved under the reduction's spatial loops
(``reverse_compute_at``), right after each element's reduction loop, and TVM's lowering
(``PlanAndUpdateBufferAllocationLocation``, ``CompactBufferAllocation``) then allocates one
element of the result instead of the whole tensor.

The values computed are the same expressions (no reassociation), so results are
bit-identical.

Where it runs
-------------
After ``FuseOps``/``FuseTIR`` (the fused kernels exist) on CPU targets; in
:func:`blade_relax.get_pipeline` right after the legalize phase, ahead of
``MemoryAwareSchedule``. Not on GPU targets, where dlight schedules the same kernels (and an
inlined chain would change the patterns its rules match). The Relax functions are untouched.

What it assumes
---------------
PrimFuncs in block form (what ``LegalizeOps`` and ``FuseTIR`` produce) with a root block named
``root``. A PrimFunc that cannot be scheduled (no root block, opaque code) is left unchanged;
so is every intermediate the checks above do not clear.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish, with_functions

__all__ = [
    "InlineKernelIntermediates",
    "InlineOptions",
    "InlineReport",
    "inline_intermediates",
]


@dataclass(frozen=True)
class InlineOptions:
    """Options of :class:`InlineKernelIntermediates`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    max_consumers
        Inline an intermediate read by at most this many blocks (each recomputes what it
        reads), or by more that together run at most this many times as many iterations as it
        has elements.
    epilogues
        Nest the elementwise reader of a reduction's result under the reduction's spatial
        loops, so that the result needs one element of scratch, not the whole tensor.
    rows
        Compute an intermediate inside the outer loops of its readers, one slice per
        iteration, where that computes no element twice (the scores and softmax statistics of
        a fused attention, one row at a time).
    """

    enabled: bool = True
    max_consumers: int = 2
    epilogues: bool = True
    rows: bool = True

    def __post_init__(self) -> None:
        if self.max_consumers < 1:
            raise ValueError(f"max_consumers must be at least 1, got {self.max_consumers}")


@dataclass
class InlineReport:
    """What one run changed: intermediates ``inlined``, reduction readers ``nested`` under
    their reductions, producers computed per slice under their readers' loops (``rows``), in
    how many ``kernels``."""

    inlined: int = 0
    nested: int = 0
    rows: int = 0
    kernels: int = 0


def _is_one(extent: object) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _index_var(index: object) -> tirx.Var | None | bool:
    """The iteration var of one coordinate of a read: ``v`` or ``v + c`` gives ``v``, a
    constant ``None``, anything else ``False``."""
    if isinstance(index, tirx.Var):
        return index
    if isinstance(index, tirx.IntImm):
        return None
    if isinstance(index, tirx.Add):
        for var, offset in ((index.a, index.b), (index.b, index.a)):
            if isinstance(var, tirx.Var) and isinstance(offset, tirx.IntImm):
                return var
    return False


def _reads_each_element_once(block: object, buffer: object) -> bool:
    """Whether ``block`` reads one point of ``buffer`` per iteration, a different one each.

    Block read regions are exact in block form: one load of an element is a region of extents
    1 whose minima are the indices. Those must be distinct iteration vars, each plus a
    constant, or constants, the vars covering every iteration var of extent above 1.
    """
    regions = [r for r in block.reads if r.source.same_as(buffer)]
    if len(regions) != 1:
        return False
    index_vars = []
    for rng in regions[0].region:
        var = _index_var(rng.min)
        if not _is_one(rng.extent) or var is False:
            return False
        if var is not None:
            index_vars.append(var)
    if any(a.same_as(b) for i, a in enumerate(index_vars) for b in index_vars[i + 1 :]):
        return False
    wanted = [iv.var for iv in block.iter_vars if not _is_one(iv.dom.extent)]
    return all(any(v.same_as(w) for v in index_vars) for w in wanted)


def _iterations(block: object) -> tvm.ir.Expr:
    return _instances([iv.dom.extent for iv in block.iter_vars])


def _work_at_most(consumers: list, producer: object, times: int) -> bool:
    """Whether ``consumers`` run at most ``times`` as many iterations as ``producer`` (each
    dimension taken as non-negative)."""
    analyzer = tvm.sym.Analyzer()
    total = tirx.IntImm("int64", 0)
    for consumer in consumers:
        total = total + _iterations(consumer)
    bound = _iterations(producer) * times
    for var in tirx.analysis.undefined_vars(bound - total, []):
        analyzer.update(var, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
    return analyzer.can_prove(total <= bound)


def _inline_one(sch: s_tir.Schedule, max_consumers: int) -> bool:
    """Inline the first intermediate that qualifies; whether one was."""
    root = sch.get_sblock("root")
    intermediates = list(sch.get(root).alloc_buffers)
    for block_rv in sch.get_child_blocks(root):
        block = sch.get(block_rv)
        if len(block.writes) != 1 or block.init is not None:
            continue
        buffer = block.writes[0].source
        if not any(buffer.same_as(b) for b in intermediates):
            continue
        if any(int(iv.iter_type) != int(tirx.IterVar.DataPar) for iv in block.iter_vars):
            continue
        consumers = [sch.get(c) for c in sch.get_consumers(block_rv)]
        if not consumers:
            continue
        if not all(_reads_each_element_once(c, buffer) for c in consumers):
            continue
        # Each reader reads an element at most once, so k readers do at most k times the
        # producer's work; readers of parts of it (a split's) may be more, doing less each.
        if len(consumers) > max_consumers and not _work_at_most(consumers, block, max_consumers):
            continue
        try:
            sch.compute_inline(block_rv)
        except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
            continue
        return True
    return False


def inline_intermediates(
    func: tirx.PrimFunc, options: InlineOptions | None = None
) -> tuple[tirx.PrimFunc, InlineReport]:
    """``func`` with its spatial intermediates inlined (see the module docstring).

    Parameters
    ----------
    func
        A PrimFunc in block form.
    options
        :class:`InlineOptions` (``None``: defaults).

    Returns
    -------
    tuple[tirx.PrimFunc, InlineReport]
        The new PrimFunc (``func`` itself when nothing changed) and what changed in it.
    """
    options = options or InlineOptions()
    report = InlineReport()
    try:
        sch = s_tir.Schedule(func)
        sch.get_sblock("root")
    except (RuntimeError, ValueError):  # TVM raises RuntimeError subclasses
        return func, report
    while _inline_one(sch, options.max_consumers):
        report.inlined += 1
    if options.epilogues:
        report.nested = _nest_epilogues(sch)
    if options.rows:
        report.rows = _nest_producers(sch)
    if not (report.inlined or report.nested or report.rows):
        return func, report
    report.kernels = 1
    return sch.mod["main"], report


def _nest_epilogues(sch: s_tir.Schedule) -> int:
    """Move the readers of a reduction's intermediate under the reduction's spatial loops
    (``reverse_compute_at``), in program order; how many were moved.

    A reader then runs for each finished slice of the result, right after its reduction loop
    (a bias add per element of a matmul; a softmax's sum and quotient per row of its maximum),
    and TVM's own lowering (``PlanAndUpdateBufferAllocationLocation`` +
    ``CompactBufferAllocation``) shrinks the intermediate to the slice each iteration touches.
    ``reverse_compute_at`` refuses a move that would change what is computed.
    """
    root = sch.get_sblock("root")
    intermediates = list(sch.get(root).alloc_buffers)
    moved = 0
    for block_rv in sch.get_child_blocks(root):
        block = sch.get(block_rv)
        if block.init is None or len(block.writes) != 1:
            continue
        buffer = block.writes[0].source
        if not any(buffer.same_as(b) for b in intermediates):
            continue
        spatial = sum(int(iv.iter_type) == int(tirx.IterVar.DataPar) for iv in block.iter_vars)
        loops = sch.get_loops(block_rv)
        if spatial == 0 or len(loops) <= spatial:
            continue
        for consumer in sch.get_consumers(block_rv):
            try:
                sch.reverse_compute_at(consumer, loops[spatial - 1])
            except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
                break
            moved += 1
    return moved


def _instances(extents: list) -> tvm.ir.Expr:
    total = tirx.IntImm("int64", 1)
    for extent in extents:
        total = total * extent
    return total


def _common_loops(sch: s_tir.Schedule, blocks: list) -> list:
    """The loops enclosing every block of ``blocks``, outermost first."""
    nests = [sch.get_loops(b) for b in blocks]
    common = []
    for depth, loop in enumerate(nests[0]):
        stmt = sch.get(loop)
        if not all(len(n) > depth and sch.get(n[depth]).same_as(stmt) for n in nests[1:]):
            break
        common.append(loop)
    return common


def _row_loop(sch: s_tir.Schedule, block_rv: object, loops: list) -> object | None:
    """The deepest of ``loops`` under which ``block_rv`` can be computed per iteration without
    computing any of its instances twice (tried on a copy of the schedule)."""
    analyzer = tvm.sym.Analyzer()
    block = sch.get(block_rv)
    before = _instances([iv.dom.extent for iv in block.iter_vars])
    for depth in range(len(loops) - 1, -1, -1):
        if all(_is_one(sch.get(loop).extent) for loop in loops[: depth + 1]):
            return None  # nothing to slice: the block would still compute everything at once
        trial = sch.copy()
        try:
            trial.compute_at(block_rv, loops[depth], preserve_unit_loops=True)
        except (RuntimeError, ValueError):  # ScheduleError and TVM's failed checks
            continue
        after = _instances([trial.get(loop).extent for loop in trial.get_loops(block_rv)])
        if analyzer.can_prove_equal(before, after):
            return loops[depth]
    return None


def _nest_producers(sch: s_tir.Schedule) -> int:
    """Compute intermediates inside their readers' common outer loops (``compute_at``), last
    producers first; how many were moved.

    Each is placed under the deepest common loop where it computes every instance once (the
    number of instances before and after is compared symbolically), so the work is unchanged
    and ``CompactBufferAllocation`` keeps the slice one iteration writes: a row of an
    attention's scores, one maximum and one sum, instead of the ``(b, h, s, s)`` scores.
    """
    moved = 0
    progressed = True
    while progressed:
        progressed = False
        root = sch.get_sblock("root")
        intermediates = list(sch.get(root).alloc_buffers)
        for block_rv in reversed(sch.get_child_blocks(root)):
            block = sch.get(block_rv)
            if len(block.writes) != 1:
                continue
            if not any(block.writes[0].source.same_as(b) for b in intermediates):
                continue
            consumers = sch.get_consumers(block_rv)
            if not consumers:
                continue
            common = _common_loops(sch, consumers)
            own = sch.get_loops(block_rv)
            if not common or (own and any(sch.get(own[0]).same_as(sch.get(c)) for c in common)):
                continue  # no loop to go under, or already under the readers' loops
            target = _row_loop(sch, block_rv, common)
            if target is None:
                continue
            sch.compute_at(block_rv, target, preserve_unit_loops=True)
            moved += 1
            progressed = True
            break
    return moved


@tvm.transform.module_pass(opt_level=0, name="InlineKernelIntermediates")
class InlineKernelIntermediates:
    """Inline the spatial intermediates of fused kernels into their consumers.

    Parameters
    ----------
    options
        An :class:`InlineOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is an :class:`InlineReport` summed over the module
    and ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` with one
    entry per PrimFunc (no byte figures: the pass changes kernels, not Relax functions; their
    callers' timelines count the smaller workspaces once read with the new module).
    """

    def __init__(self, options: InlineOptions | None = None) -> None:
        if options is not None and not isinstance(options, InlineOptions):
            raise TypeError(
                f"InlineKernelIntermediates expects InlineOptions, got {type(options).__name__}"
            )
        self.options = options or InlineOptions()
        self.report = InlineReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = InlineReport()
        if not self.options.enabled:
            publish(
                self, PassResult("InlineKernelIntermediates", notes=("disabled by its options",))
            )
            return mod
        updates = {}
        changes: dict[str, list[str]] = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            new_func, report = inline_intermediates(func, self.options)
            if report.kernels:
                updates[gv] = new_func
                self.report.inlined += report.inlined
                self.report.nested += report.nested
                self.report.rows += report.rows
                self.report.kernels += 1
                changes[gv.name_hint] = _changes(report)
        out = with_functions(mod, updates)
        functions = function_results(mod, out, changes, kind=tirx.PrimFunc)
        publish(self, PassResult("InlineKernelIntermediates", functions, detail=self.report))
        return out


def _changes(report: InlineReport) -> list[str]:
    """What :func:`inline_intermediates` did to one kernel, in words."""
    out = []
    if report.inlined:
        out.append(f"{counted(report.inlined, 'intermediate')} inlined")
    if report.nested:
        out.append(f"{counted(report.nested, 'reduction reader')} moved under the reduction loops")
    if report.rows:
        out.append(f"{counted(report.rows, 'producer')} computed per slice of a reader")
    return out

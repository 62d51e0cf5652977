"""FuseIntoSoleReader: an elementwise kernel whose one reader is an elementwise kernel is
computed inside that reader, when its inputs are live there anyway.

``FuseOps`` fuses an injective producer into its consumer only when the consumer is its sole
reader in the graph it sees. A training step's graph changes after fusion: ``RecomputeCheapValues``
binds copies of cheap values just before their late readers (``x * x``, ``tanh(..)`` of a GELU,
read again by its backward kernel), and the forward's copy then has only its forward readers.
Each such value is a full-size buffer that lives from its binding to its one reader; several of
them read by one backward kernel are live together, at the step's peak (BLOOM's GELU backward
reads four). Computed inside the reader, they need no buffer at all.

The rule
--------
For ``v = P(a, b, ...)`` in a dataflow block, where ``P`` is an injective kernel (``op_pattern``
at most 2, not a reshape) with one tensor result: when ``v`` is read by exactly one binding of
the block, ``w = C(.., v, ..)`` with ``C`` injective too, and ``v`` is not read after the block,
``v``'s binding is removed and ``w`` calls one new kernel computing ``P`` inside ``C``. Each input
of ``P`` must be live at ``w`` anyway (a constant, a parameter, read after the block, or read at
``w`` or later), or the inputs that are not must together be proven no larger than ``v`` for
every admissible value of the dims (``ShapeGraph.compare``): a mask ``[1, 1, 1, s]`` kept alive
a few bindings longer to save the ``[1, 1, s, s]`` scores bias built from it. Several producers
of one reader fuse into it at once; the fused kernel may absorb more producers in the next
round (rounds repeat until nothing fuses).

Why it never raises the peak
----------------------------
``v`` is gone. Inputs of ``P`` live at ``w`` anyway change nothing; an input kept alive from its
last read to ``w`` is live only where ``v`` was, and the inputs so kept are no larger than
``v``: at no binding do the live bytes rise. A group is kept only if the fused kernel holds no
scratch buffer of a producer (:func:`~blade_relax.transform.inline_kernel_intermediates.
inline_intermediates`, then ``compute_inline`` for a producer its reader reads with
broadcasting, which then evaluates each of its elements once per broadcast copy: elementwise
work traded for a whole buffer); otherwise it is left as it was. The values are the same
expressions evaluated in the same order, so results are bit-identical.

A group is also left as it was when its fused kernel would hold a producer's conditional
(``Select``, ``if_then_else``) at more than one place, its reader reading the value at
several: TVM's simplifier enters each copy under every condition that encloses it, and a
causal LM's loss gradient specialized to one length (Llama's, GPT-2's at s = 40) took 34-38 s
to lower so (its labels' shift at the seven places the cross-entropy's ``where`` chain reads
it), its reader alone 0.25 s.

What the library lacked
-----------------------
TVM's ``FuseOps`` decides on the graph as it is when it runs, before the passes that make
single readers appear; running it again would re-decide every group. This pass builds the one
group it wants as a ``Primitive`` function in a module of its own and lets TVM's ``FuseTIR``
write the fused kernel, then inlines its intermediates with
:func:`~blade_relax.transform.inline_kernel_intermediates.inline_intermediates`.

Where it runs
-------------
After ``RecomputeCheapValues`` and before ``ToNonDataflow``, on CPU targets (on CUDA, dlight
has scheduled the kernels by then, and ``FuseTIR`` works on unscheduled kernels only): in
:func:`blade_relax.get_pipeline` right after ``RecomputeCheapValues``.

What it assumes
---------------
A normalized module after ``FuseTIR`` with kernels in block form (``op_pattern`` is computed
by ``AnnotateTIROpPattern`` on a copy). Bindings that are not such calls, kernels with
symbolic-var or scalar arguments, and groups that ``FuseTIR`` cannot fuse are left as they
are.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprVisitor, visitor
from tvm.relax.utils import copy_with_new_vars

from ..analysis.effects import in_place_writes, reshape_pattern
from ..analysis.tir_fields import occurrences
from ..symbolic import ShapeGraph, TypeSizes
from ..util.collection import pauses_collection
from ._block_edit import rewrite_dataflow_blocks, vars_read_after
from .inline_kernel_intermediates import inline_intermediates
from .recompute_cheap_values import kernel_patterns
from .result import PassResult, counted, function_results, publish

__all__ = ["FuseIntoSoleReader", "FuseReaderOptions", "FuseReaderReport"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")


@dataclass(frozen=True)
class FuseReaderOptions:
    """Options of :class:`FuseIntoSoleReader`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    max_pattern
        The largest ``op_pattern`` of a producer and of its reader: 0 elementwise, 1 broadcast,
        2 injective (the default).
    max_rounds
        The most rounds of fusion (each fuses producers into readers of the previous round's
        program).
    """

    enabled: bool = True
    max_pattern: int = 2
    max_rounds: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.max_pattern <= 2:
            raise ValueError(f"max_pattern must be 0, 1 or 2, got {self.max_pattern}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {self.max_rounds}")


@dataclass
class FuseReaderReport:
    """What one run changed: producers ``fused`` into their readers, as ``kernels`` new kernels;
    groups ``refused`` because the fused kernel would keep a scratch buffer or copy a
    producer's conditional, or could not be built."""

    fused: int = 0
    kernels: int = 0
    refused: int = 0


def _kernel_call(
    mod: tvm.IRModule, patterns: dict[str, int], value: relax.Expr, max_pattern: int
) -> list[relax.Expr] | None:
    """The arguments of an injective kernel call (variables and constants), or ``None`` when
    ``value`` is no such call."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR):
        return None
    if len(value.args) != 2 or not isinstance(value.ty, relax.TensorType):
        return None
    callee = value.args[0]
    if not isinstance(callee, relax.GlobalVar) or patterns.get(callee.name_hint, 99) > max_pattern:
        return None
    kernel = mod[callee]
    if not isinstance(kernel, tirx.PrimFunc) or reshape_pattern(kernel):
        return None
    fields = _args(value)
    # Tensors only: a scalar argument (a dim passed as a value, ``(x, s)``) is a kernel
    # parameter that FuseTIR's group function would not pass on.
    if not all(
        isinstance(arg, relax.Var | tvm.ir.expr.Constant) and isinstance(arg.ty, relax.TensorType)
        for arg in fields
    ):
        return None
    return fields


class _Sizes:
    """Byte sizes of one function's values, read when a fusion would keep an input alive
    longer (its shape graph is built then, once)."""

    def __init__(self, func: relax.Function) -> None:
        self.func = func
        self._sizes: TypeSizes | None = None

    def covers(self, value: relax.Var, extended: Sequence[relax.Var]) -> bool:
        """Whether ``value``'s bytes are proven at least those of ``extended`` together, for
        every admissible value of the dims."""
        if self._sizes is None:
            try:
                self._sizes = TypeSizes(ShapeGraph.from_function(self.func))
            except Exception:  # user IR: reading its shapes may fail in any way; then no proof
                return False
        sizes = self._sizes
        kept = sizes.bytes_of(value.ty, value)
        total = functools.reduce(operator.add, [sizes.bytes_of(a.ty, a) for a in extended])
        if kept.is_unknown or total.is_unknown:
            return False
        return sizes.graph.compare(kept, total).holds_ge


@dataclass(frozen=True)
class _Group:
    """Fuse the producers at ``producers`` (positions, ascending) into the reader at
    ``reader``."""

    reader: int
    producers: tuple[int, ...]


def _groups(
    mod: tvm.IRModule,
    patterns: dict[str, int],
    block: relax.DataflowBlock,
    live: set[relax.Var],
    max_pattern: int,
    sizes: _Sizes,
) -> list[_Group]:
    """The groups of one round in ``block``; ``live`` holds the variables live throughout it
    (parameters, values read after it)."""
    bindings = list(block.bindings)
    inputs = [
        _kernel_call(mod, patterns, b.value, max_pattern)
        if isinstance(b, relax.VarBinding)
        else None
        for b in bindings
    ]
    reads: dict[relax.Var, list[int]] = {}
    for position, binding in enumerate(bindings):
        for var in relax.analysis.free_vars(binding.value):
            reads.setdefault(var, []).append(position)
    # Computed inside its reader, a producer reads its inputs there: not when memory it reads
    # is written in place in between (an optimizer's update of a parameter).
    writes = in_place_writes(bindings, mod)
    producers: dict[int, list[int]] = {}
    for position, binding in enumerate(bindings):
        if inputs[position] is None or binding.var in live:
            continue
        readers = reads.get(binding.var, [])
        if len(readers) != 1:
            continue
        reader = readers[0]
        reader_args = inputs[reader]
        if reader_args is None or sum(a.same_as(binding.var) for a in reader_args) != 1:
            continue
        if any(
            isinstance(a, relax.Var) and writes.written_between(a, position, reader)
            for a in inputs[position]
        ):
            continue
        extended = [a for a in inputs[position] if not _live_at(a, reader, live, reads)]
        if not extended or sizes.covers(binding.var, extended):
            producers.setdefault(reader, []).append(position)
    # A reader that is itself a producer this round waits for the next one.
    return [
        _Group(reader, tuple(group))
        for reader, group in sorted(producers.items())
        if not any(p in producers for p in group)
    ]


def _args(call: relax.Call) -> list[relax.Expr]:
    """The tensor arguments of a ``call_tir``."""
    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def _live_at(
    arg: relax.Expr, position: int, live: set[relax.Var], reads: dict[relax.Var, list[int]]
) -> bool:
    """Whether ``arg`` is live at ``position`` anyway: a constant, a variable live throughout
    the block, or one read there or later."""
    return not isinstance(arg, relax.Var) or arg in live or reads[arg][-1] >= position


def _outer(bindings: Sequence[relax.Binding], group: _Group) -> list[relax.Expr]:
    """The variables and constants from outside ``group`` that it reads, in order of first
    read."""
    fused = {bindings[p].var for p in group.producers}
    outer: list[relax.Expr] = []
    for position in (*group.producers, group.reader):
        for arg in _args(bindings[position].value):
            if arg not in fused and arg not in outer:
                outer.append(arg)
    return outer


def _group_function(
    bindings: Sequence[relax.Binding], group: _Group
) -> tuple[relax.Function, list[relax.Expr]]:
    """The group as a ``Primitive`` function, and the outer variables and constants it takes,
    in order (:func:`_outer`)."""
    outer = _outer(bindings, group)
    params = _params(outer)
    renames: dict[relax.Expr, relax.Var] = dict(zip(outer, params))
    inner: list[relax.Binding] = []
    for position in (*group.producers, group.reader):
        call = bindings[position].value
        args = [renames[a] for a in _args(call)]
        var = relax.DataflowVar(bindings[position].var.name, bindings[position].var.ty)
        inner.append(relax.VarBinding(var, relax.call_tir(call.args[0], args, call.ty)))
        renames[bindings[position].var] = var
    result = inner[-1].var
    out_var = relax.Var(result.name, result.ty)
    inner[-1] = relax.VarBinding(out_var, inner[-1].value)
    body = relax.SeqExpr([relax.DataflowBlock(inner)], out_var)
    func = relax.Function(params, body, result.ty, True).with_attr("Primitive", True)
    return func, outer


def _params(outer: Sequence[relax.Expr]) -> list[relax.Var]:
    """A parameter for each outer variable or constant a group reads."""
    return [
        relax.Var(arg.name if isinstance(arg, relax.Var) else f"c{i}", arg.ty)
        for i, arg in enumerate(outer)
    ]


def _fused_kernel(
    mod: tvm.IRModule, bindings: Sequence[relax.Binding], group: _Group, name: str
) -> tuple[tirx.PrimFunc, list[int]] | None:
    """The fused kernel of ``group`` and, for each of its tensor arguments, the index of the
    outer variable it reads (see :func:`_group_function`); ``None`` when ``FuseTIR`` cannot
    build it, it keeps a scratch buffer of a producer or it copies a producer's conditional."""
    func, outer = _group_function(bindings, group)
    parts = [bindings[p].value.args[0] for p in (*group.producers, group.reader)]
    kernels = set(parts)
    reader_kernel = mod[bindings[group.reader].value.args[0]]
    builder = relax.BlockBuilder(tvm.IRModule({gv: mod[gv] for gv in kernels}))
    # Fresh variables, symbolic ones included: a module is well formed only when no two
    # functions share a variable (TVM's copy_with_new_vars renews both kinds).
    group_gv = builder.add_func(copy_with_new_vars(builder.normalize(func)), name)
    params = _params(outer)
    body = relax.SeqExpr([], relax.Call(group_gv, params))
    # Public (a global symbol), or FuseTIR's cleanup drops it with everything it calls.
    caller = relax.Function(params, body, func.ret_ty, True).with_attr("global_symbol", "caller")
    builder.add_func(copy_with_new_vars(builder.normalize(caller)), "caller")
    try:
        fused_mod = relax.transform.FuseTIR()(builder.get())
    except (RuntimeError, ValueError):  # TVM raises RuntimeError subclasses
        return None
    caller = fused_mod["caller"]
    call = _only_call(caller)
    if call is None or len(call.args) != 2:  # symbolic-var arguments: not handled
        return None
    index = {param: i for i, param in enumerate(caller.params)}
    fields = _args(call)
    if not all(isinstance(a, relax.Var) and a in index for a in fields):
        return None
    kernel = _inline_broadcasts(inline_intermediates(fused_mod[call.args[0]])[0])
    if _scratch_buffers(kernel) > _scratch_buffers(reader_kernel):
        return None
    if _conditionals(kernel) > sum(_conditionals(mod[gv]) for gv in parts):
        return None
    return kernel, [index[a] for a in fields]


def _conditionals(kernel: tirx.PrimFunc) -> int:
    """How many conditional expressions (``Select``, ``if_then_else``) the kernel holds as
    written, one per place it is read: more in a fused kernel than in its parts means a
    producer's conditional was copied to each place its reader reads it (see the module
    docstring)."""
    return occurrences(kernel.body, _is_conditional)


def _is_conditional(node: object) -> bool:
    """Whether ``node`` is a ``Select`` or an ``if_then_else`` call."""
    return isinstance(node, tirx.Select) or (
        isinstance(node, tvm.ir.Call) and node.op.same_as(_IF_THEN_ELSE)
    )


def _inline_broadcasts(kernel: tirx.PrimFunc) -> tirx.PrimFunc:
    """``kernel`` with each remaining spatial intermediate computed inside its readers where
    TVM's ``compute_inline`` allows it.

    :func:`inline_intermediates` leaves an intermediate that a reader reads with broadcasting
    (a mask ``[1, 1, s, s]`` added to scores ``[1, h, s, s]``), since inlining computes each of
    its elements once per broadcast copy. Here that work (``h`` evaluations of an elementwise
    expression instead of one) buys a whole buffer, which a fused pair must not keep."""
    try:
        sch = s_tir.Schedule(kernel)
        root = sch.get_sblock("root")
    except (RuntimeError, ValueError):  # TVM raises RuntimeError subclasses
        return kernel
    changed = False
    for block_rv in sch.get_child_blocks(root):
        block = sch.get(block_rv)
        if block.init is not None or len(block.writes) != 1:
            continue
        if not any(block.writes[0].source.same_as(b) for b in sch.get(root).alloc_buffers):
            continue
        try:
            sch.compute_inline(block_rv)
        except (RuntimeError, ValueError):
            continue
        changed = True
    return sch.mod["main"] if changed else kernel


def _only_call(func: relax.Function) -> relax.Call | None:
    """The ``call_tir`` ``FuseTIR`` left in the caller's body."""
    body = func.body
    value = body.body
    if isinstance(value, relax.Var):
        for block in body.blocks:
            for binding in block.bindings:
                if binding.var.same_as(value):
                    value = binding.value
    if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
        return value
    return None


def _scratch_buffers(kernel: tirx.PrimFunc) -> int:
    """How many buffers the kernel's root block allocates (what the CPU build allocates as
    workspace on every run)."""
    body = kernel.body
    if not isinstance(body, tvm.s_tir.SBlockRealize):
        return 0
    return len(body.block.alloc_buffers)


@tvm.transform.module_pass(opt_level=0, name="FuseIntoSoleReader")
class FuseIntoSoleReader:
    """Compute injective kernels inside their one injective reader (see the module
    docstring).

    Parameters
    ----------
    options
        A :class:`FuseReaderOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`FuseReaderReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the live set only shrinks, see the module docstring).
    """

    def __init__(self, options: FuseReaderOptions | None = None) -> None:
        if options is not None and not isinstance(options, FuseReaderOptions):
            raise TypeError(
                f"FuseIntoSoleReader expects FuseReaderOptions, got {type(options).__name__}"
            )
        self.options = options or FuseReaderOptions()
        self.report = FuseReaderReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = FuseReaderReport()
        if not self.options.enabled:
            publish(self, PassResult("FuseIntoSoleReader", notes=("disabled by its options",)))
            return mod
        fused: dict[str, int] = {}
        # Fused kernels built so far, by the kernels they fuse and how (see _fusion).
        made: dict[tuple, tuple[relax.GlobalVar, list[int]] | None] = {}
        out = mod
        for _ in range(self.options.max_rounds):
            new = self._round(out, fused, made)
            if new is out:
                break
            out = new
        if out is not mod:
            out = _without_unused_kernels(out, mod)
        changes = {
            name: [f"{counted(count, 'kernel')} computed inside their one reader"]
            for name, count in fused.items()
        }
        publish(
            self,
            PassResult(
                "FuseIntoSoleReader", function_results(mod, out, changes), detail=self.report
            ),
        )
        return out

    def _round(self, mod: tvm.IRModule, fused: dict[str, int], made: dict) -> tvm.IRModule:
        """One round: every group of every dataflow block (``mod`` itself when none fused)."""
        patterns = kernel_patterns(mod)
        names = {func: gv.name_hint for gv, func in mod.functions.items()}
        builder = relax.BlockBuilder(mod)
        sizes: dict[relax.Function, _Sizes] = {}

        def rewrite(func, index, block, _blocks):
            live = set(func.params) | vars_read_after(func, index)
            if func not in sizes:
                sizes[func] = _Sizes(func)
            groups = _groups(mod, patterns, block, live, self.options.max_pattern, sizes[func])
            bindings = list(block.bindings)
            removed: set[int] = set()
            replaced: dict[int, relax.Binding] = {}
            for group in groups:
                fusion = self._fusion(mod, builder, bindings, group, made)
                if fusion is None:
                    continue
                replaced[group.reader] = relax.VarBinding(bindings[group.reader].var, fusion)
                removed.update(group.producers)
                self.report.fused += len(group.producers)
                fused[names[func]] = fused.get(names[func], 0) + len(group.producers)
            if not replaced:
                return None
            return relax.DataflowBlock(
                [replaced.get(p, b) for p, b in enumerate(bindings) if p not in removed]
            )

        return rewrite_dataflow_blocks(mod, rewrite, builder)

    def _fusion(self, mod, builder, bindings, group: _Group, made) -> relax.Call | None:
        """The call of the fused kernel of ``group``: one kernel per distinct combination of
        kernels wired the same way (the layers of a model share them), built by
        :func:`_fused_kernel`."""
        outer = _outer(bindings, group)
        key = tuple(
            (bindings[p].value.args[0].name_hint, _arg_pattern(bindings, group, p, outer))
            for p in (*group.producers, group.reader)
        )
        if key not in made:
            names = [bindings[p].value.args[0].name_hint for p in (*group.producers, group.reader)]
            name = "fused_" + "_".join(n.removeprefix("fused_") for n in names)[:80]
            built = _fused_kernel(mod, bindings, group, name)
            if built is None:
                self.report.refused += 1
            else:
                self.report.kernels += 1
                built = (builder.add_func(built[0], name), built[1])
            made[key] = built
        if made[key] is None:
            return None
        gv, arg_index = made[key]
        return relax.call_tir(gv, [outer[i] for i in arg_index], bindings[group.reader].var.ty)


@visitor
class _GlobalVarsRead(PyExprVisitor):
    """The names of the global functions a Relax function refers to."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def visit_global_var_(self, op: relax.GlobalVar) -> None:  # noqa: D102
        self.names.add(op.name_hint)


def _without_unused_kernels(out: tvm.IRModule, before: tvm.IRModule) -> tvm.IRModule:
    """``out`` without the kernels that ``before`` called and ``out`` no longer calls (the
    producers computed inside their readers everywhere)."""
    called_before, called_now = _called(before), _called(out)
    unused = [
        gv
        for gv, func in out.functions.items()
        if isinstance(func, tirx.PrimFunc)
        and gv.name_hint in called_before
        and gv.name_hint not in called_now
    ]
    if not unused:
        return out
    return tvm.IRModule(
        {gv: f for gv, f in out.functions.items() if gv not in unused},
        attrs=out.attrs,
        global_infos=out.global_infos,
    )


def _called(mod: tvm.IRModule) -> set[str]:
    """The names of the global functions the Relax functions of ``mod`` refer to."""
    read = _GlobalVarsRead()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            read.visit_expr(func)
    return read.names


def _arg_pattern(
    bindings: Sequence[relax.Binding], group: _Group, position: int, outer: list[relax.Expr]
) -> tuple:
    """How the call at ``position`` reads the group's values and its ``outer`` ones: equal for
    two groups that one fused kernel serves (the same kernels wired the same way)."""
    produced = {bindings[p].var: i for i, p in enumerate(group.producers)}
    return tuple(
        ("v", produced[a]) if a in produced else ("x", outer.index(a))
        for a in _args(bindings[position].value)
    )

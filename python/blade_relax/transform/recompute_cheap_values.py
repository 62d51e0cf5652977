"""RecomputeCheapValues: recompute elementwise results where they are read late, when their inputs
are live there anyway.

A training step keeps forward values for the backward. Many of them are cheap functions of
other values the backward keeps anyway: a normalized hidden state ``x * rsqrt(..) * w`` of the
residual stream ``x`` (which the norm's own backward reads), a gated activation ``silu(g) * u``
of the two projections (which the activation's backward reads). Keeping both the inputs and
the result from the forward until the backward holds the result's bytes across everything in
between; recomputing it just before its late readers holds them only there. This is what
``torch.compile``'s min-cut partitioner does for pointwise ops; here it is decided on the fixed
order of the block.

The rule
--------
For a binding ``v = k(a, b, ...)`` of a dataflow block, where ``k`` is an injective kernel (a
``call_tir`` of a PrimFunc whose op pattern is at most ``max_pattern``: elementwise,
broadcast, injective; not a reshape, which costs nothing to keep) with one tensor result read
only inside the block: the reads of ``v`` are split at the largest gap between consecutive
reads; if the reads after the gap all come no later than the last read of every tensor input
(``a``, ``b``, ... are then live at each of them anyway), a copy ``v' = k(a, b, ...)`` is bound
just before the first late read, and the late reads read ``v'``.

Why it never raises the peak
----------------------------
At every point of the block the new live set is a subset of the old one: ``v`` now dies at its
last early read instead of its last late read; ``v'`` is live from just before the first late
read to the last one, where ``v`` was live before (and it has ``v``'s size); the inputs were
live at every late read already, so the recomputation extends no lifetime. This holds for every
value of the symbolic dims, so no comparison of sizes is needed, and the bytes live in the gap
drop by ``v``'s size. The memory planners that run later only share storage where the unshared
program allows it (``PlanMemory`` proves its sharing never raises that program's peak), and the
runtime's memory accounting and ``blade_relax.analysis.memory_timeline`` see the smaller
lifetimes. The cost is one more run of the kernel per recomputed value (elementwise work, next
to the matmuls around it).

Where it runs
-------------
After ``MemoryAwareSchedule`` (the order of the block is the one that will run) and before
``ToNonDataflow`` (it inserts bindings into dataflow blocks): in :func:`blade_relax.get_pipeline`
right after the schedule pass. The recomputed copy is a pure binding, so the passes after it
(fusion is over, planning comes later) treat it as any other kernel call.

What it assumes
---------------
A normalized module after ``FuseTIR``: kernels are ``call_tir`` of PrimFuncs, whose op pattern
``AnnotateTIROpPattern`` computes (on a copy of the module: fused kernels carry none). Bindings
that are not such calls, values read after their block, and blocks of other kinds are left as
they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

__all__ = ["RecomputeCheapValues", "RecomputeOptions", "RecomputeReport"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclass(frozen=True)
class RecomputeOptions:
    """Options of :class:`RecomputeCheapValues`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    max_pattern
        The largest ``op_pattern`` of a kernel that may be recomputed: 0 elementwise,
        1 broadcast, 2 injective (the default).
    min_gap
        The fewest bindings between the last early read and the first late read for a
        recomputation (a shorter gap saves too little to pay for the kernel).
    """

    enabled: bool = True
    max_pattern: int = 2
    min_gap: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.max_pattern <= 2:
            raise ValueError(f"max_pattern must be 0, 1 or 2, got {self.max_pattern}")
        if self.min_gap < 1:
            raise ValueError(f"min_gap must be at least 1, got {self.min_gap}")


@dataclass
class RecomputeReport:
    """What one run changed: values ``recomputed`` (one copy each)."""

    recomputed: int = 0


def kernel_patterns(mod: tvm.IRModule) -> dict[str, int]:
    """The ``op_pattern`` of every PrimFunc of ``mod``, by name.

    ``FuseTIR`` emits fused kernels without the attribute; ``AnnotateTIROpPattern`` (run on a
    copy, the module is not changed) computes it for them as for any kernel.
    """
    annotated = relax.transform.AnnotateTIROpPattern()(mod)
    out = {}
    for gv, func in annotated.functions.items():
        if (
            isinstance(func, tirx.PrimFunc)
            and func.attrs is not None
            and "op_pattern" in func.attrs
        ):
            out[gv.name_hint] = int(func.attrs["op_pattern"])
    return out


def _cheap_kernel(
    mod: tvm.IRModule, patterns: dict[str, int], value: relax.Expr, max_pattern: int
) -> bool:
    if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR):
        return False
    if not isinstance(value.ty, relax.TensorType):
        return False
    callee = value.args[0]
    if not isinstance(callee, relax.GlobalVar) or patterns.get(callee.name_hint, 99) > max_pattern:
        return False
    return not relax.analysis.has_reshape_pattern(mod[callee])


def _tensor_inputs(value: relax.Call) -> list[relax.Var] | None:
    """The variables a kernel call reads, or ``None`` if an argument is not a var/constant."""
    args = value.args[1]
    fields = args.fields if isinstance(args, relax.Tuple) else [args]
    out = []
    for arg in fields:
        if isinstance(arg, relax.Var):
            out.append(arg)
        elif not isinstance(arg, tvm.ir.expr.Constant):
            return None
    if len(value.args) > 2:  # symbolic-var arguments: only shapes of vars, nothing to keep alive
        extra = value.args[2]
        if not isinstance(extra, relax.ShapeExpr):
            return None
    return out


def _reads(bindings: Sequence[relax.Binding]) -> dict[relax.Var, list[int]]:
    """Positions of the bindings that read each variable, in order."""
    reads: dict[relax.Var, list[int]] = {}
    for position, binding in enumerate(bindings):
        for var in relax.analysis.free_vars(binding.value):
            reads.setdefault(var, []).append(position)
    return reads


def _plan_block(
    mod: tvm.IRModule,
    patterns: dict[str, int],
    block: relax.DataflowBlock,
    live_throughout: set[relax.Var],
    options: RecomputeOptions,
) -> dict[int, list[int]]:
    """For each binding to recompute, the positions of its late reads.

    ``live_throughout``: variables live during the whole block (parameters, values read after
    it). A value that is an input of a recomputed value, or computed from one, is not
    recomputed itself: the copy would read the original at a point where it may be dead.
    """
    bindings = list(block.bindings)
    reads = _reads(bindings)
    candidates: list[tuple[int, list[int], list[relax.Var]]] = []
    for position, binding in enumerate(bindings):
        var = binding.var
        if var in live_throughout or not isinstance(binding, relax.VarBinding):
            continue
        if not _cheap_kernel(mod, patterns, binding.value, options.max_pattern):
            continue
        inputs = _tensor_inputs(binding.value)
        uses = reads.get(var, [])
        if inputs is None or len(uses) < 2:
            continue
        points = [position, *uses]
        gaps = [points[i + 1] - points[i] for i in range(len(points) - 1)]
        split = max(range(1, len(gaps)), key=lambda i: gaps[i], default=None)
        if split is None or gaps[split] <= options.min_gap:
            continue
        late = uses[split:]
        if any(v not in live_throughout and reads[v][-1] < late[-1] for v in inputs):
            continue
        candidates.append((position, late, inputs))
    plan: dict[int, list[int]] = {}
    involved: set[relax.Var] = set()
    for position, late, inputs in candidates:
        var = bindings[position].var
        if var in involved or any(v in involved for v in inputs):
            continue
        plan[position] = late
        involved.add(var)
        involved.update(inputs)
    return plan


def _rewrite_block(
    block: relax.DataflowBlock, plan: dict[int, list[int]]
) -> tuple[relax.DataflowBlock, int]:
    bindings = list(block.bindings)
    # Late read position -> [(original var, binding to copy)].
    copies_before: dict[int, list[tuple[relax.Var, relax.VarBinding]]] = {}
    renamed_at: dict[int, dict[relax.Var, relax.Var]] = {}
    for position, late in plan.items():
        original = bindings[position]
        copy_var = relax.DataflowVar(original.var.name + "_recompute", original.var.ty)
        copies_before.setdefault(late[0], []).append(
            (original.var, relax.VarBinding(copy_var, original.value))
        )
        for read in late:
            renamed_at.setdefault(read, {})[original.var] = copy_var
    out: list[relax.Binding] = []
    for position, binding in enumerate(bindings):
        for _, copy in copies_before.get(position, []):
            out.append(copy)
        renames = renamed_at.get(position)
        if renames:
            new_value = _Renamer(renames).visit_expr(binding.value)
            if isinstance(binding, relax.MatchCast):
                binding = relax.MatchCast(binding.var, new_value, binding.ty)
            else:
                binding = relax.VarBinding(binding.var, new_value)
        out.append(binding)
    return relax.DataflowBlock(out), len(plan)


@mutator
class _Renamer(PyExprMutator):
    """Reads of the renamed variables become reads of their copies."""

    def __init__(self, renames: dict[relax.Var, relax.Var]) -> None:
        super().__init__()
        self.renames = renames

    def visit_var_(self, var: relax.Var) -> relax.Expr:  # noqa: D102
        return self.renames.get(var, var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:  # noqa: D102
        return self.renames.get(var, var)


@tvm.transform.module_pass(opt_level=0, name="RecomputeCheapValues")
class RecomputeCheapValues:
    """Recompute injective kernel results before their late readers (see the module docstring).

    Parameters
    ----------
    options
        A :class:`RecomputeOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is a :class:`RecomputeReport` of the last run.
    """

    def __init__(self, options: RecomputeOptions | None = None) -> None:
        if options is not None and not isinstance(options, RecomputeOptions):
            raise TypeError(
                f"RecomputeCheapValues expects RecomputeOptions, got {type(options).__name__}"
            )
        self.options = options or RecomputeOptions()
        self.report = RecomputeReport()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = RecomputeReport()
        if not self.options.enabled:
            return mod
        patterns = kernel_patterns(mod)
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            new_func = self._function(mod, patterns, func)
            if new_func is not None:
                updates[gv] = new_func
        if not updates:
            return mod
        builder = relax.BlockBuilder(mod)
        for gv, func in updates.items():
            builder.update_func(gv, func)
        return builder.get()

    def _function(
        self, mod: tvm.IRModule, patterns: dict[str, int], func: relax.Function
    ) -> relax.Function | None:
        body = func.body
        blocks = list(body.blocks)
        changed = False
        for index, block in enumerate(blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            # Values read after the block (its outputs) and parameters live throughout it.
            live = set(func.params)
            live.update(relax.analysis.free_vars(body.body))
            for later in blocks[index + 1 :]:
                for binding in later.bindings:
                    live.update(relax.analysis.free_vars(binding.value))
            plan = _plan_block(mod, patterns, block, live, self.options)
            if not plan:
                continue
            blocks[index], count = _rewrite_block(block, plan)
            self.report.recomputed += count
            changed = True
        if not changed:
            return None
        new_func = relax.Function(
            func.params, relax.SeqExpr(blocks, body.body), func.ret_ty, func.is_pure, func.attrs
        )
        return relax.BlockBuilder().normalize(new_func)

"""Kernel workspaces: the scratch memory a compiled TIR kernel holds while it runs.

What is counted
---------------
A legalized or fused PrimFunc may keep intermediate buffers of its own (``T.alloc_buffer`` in
its blocks; the legalized softmax's ``T_softmax_exp`` has the shape ``(1, h, s, s)`` of its
input). TVM's TIR lowering turns the global-scope ones into ``TVMBackendAllocWorkspace`` /
``TVMBackendFreeWorkspace`` calls around the kernel body (``LowerTVMBuiltin``): heap memory the
kernel holds while it runs, taken from the device's workspace pool behind the VM's allocator,
so that neither ``vm.builtin.alloc_storage`` nor a Relax-level analysis sees it.

The description is read from what the compiled kernel really allocates: the PrimFunc is lowered
by the TIR pipeline ``tvm.compile`` uses for the target (``tvm.tirx.get_default_tir_pipeline``,
then the host finalization passes, as ``tvm.tirx.build`` runs them) and its
``TVMBackendAllocWorkspace`` calls are collected. Whatever the lowering does to the
intermediates is therefore in the figure: ``StorageRewrite`` reuses a dead intermediate for a
later one or computes in place (the softmax's four intermediates become two), buffers are
compacted to the region a loop nest touches. Lowering is deterministic, so lowering again gives
the kernel that was built; descriptions are cached by the PrimFunc's structural hash and target.

Not counted, because they are not heap workspace:

* global allocations TVM places on the stack: on a CPU target, constant-size ones of fewer than
  ``runtime::kMaxStackAlloca`` = 1024 bytes stay an ``alloca`` (``LowerTVMBuiltin``,
  ``src/tirx/transform/lower_tvm_builtin.cc``);
* ``local``, ``shared`` and ``warp`` scopes (registers and on-chip memory of GPU kernels: the
  CUDA pipeline's dlight schedules keep a softmax's intermediates there, so CUDA kernels
  usually hold no workspace at all);
* the kernel's parameters (tensors the VM allocated: the runtime accounting counts them).

The description
---------------
:class:`KernelWorkspace`, one per kernel: each ``TVMBackendAllocWorkspace`` call with its size
as an integer expression over *reads* of the kernel's arguments (dim ``j`` of the shape of
buffer argument ``i``, or the value of scalar argument ``i``), and the sets of calls whose
allocations are live at the same time, in program order (alloc, free). The kernel's workspace is
the largest total of one such set, held from the kernel's start to its end (the allocations sit
at the top of the lowered body, which is where ``StorageRewrite`` hoists them).

It is read in three places, from the same expression:

* by the symbolic timeline, at a Relax call site (:func:`call_workspace`): the reads become the
  shapes of the call's arguments, which gives bytes over the caller's dims;
* by the rematerialization runtime's timeline (``transform.remat._timeline``, through
  :func:`call_reads` and :meth:`KernelWorkspace.substitute`), whose budgets then include it;
* by the runtime accounting, from the tensors the VM passes the kernel
  (:meth:`KernelWorkspace.nbytes_of`; :func:`workspace_table` builds the table the accounting
  reads, see :func:`blade_relax.runtime.measure_memory`). The table must come from the module
  the executable was built from: :func:`compile_keeping_module` compiles and keeps it.

Sizes are dim expressions (:mod:`blade_relax.contract.dimexpr`) written by
:func:`blade_relax.analysis.dimexpr.from_prim_expr`, the converter the remat timeline uses too:
TIR's truncating ``Div``/``Mod`` stay truncating, except over values proven non-negative (the
reads of shape dims are), where they equal ``//`` and ``%``. A size is written without
comparisons or ``Select``, which its symbolic evaluation could not branch on.

Assumptions: an allocation inside a loop is allocated and freed once per iteration, so it
counts once (inside a ``parallel`` loop it would be once per thread: such a kernel is flagged
inexact in :attr:`KernelWorkspace.notes`). A kernel the lowering cannot handle, or a size the
reads cannot express, is described as no workspace with a note saying why.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..contract.dimexpr import compile_expressions, substitute
from ..symbolic import ShapeGraph, SymbolicExpr
from .dimexpr import SYMBOLIC_FUNCTIONS, UndefinedVariable, UnsupportedNode, from_prim_expr

__all__ = [
    "CompiledModule",
    "KernelWorkspace",
    "ShapeRead",
    "WorkspaceAllocation",
    "call_reads",
    "call_workspace",
    "called_kernel",
    "compile_keeping_module",
    "kernel_call_args",
    "kernel_workspace",
    "kernel_workspaces",
    "workspace_table",
]

_ALLOC = "tirx.TVMBackendAllocWorkspace"
_FREE = "tirx.TVMBackendFreeWorkspace"


@dataclass(frozen=True)
class ShapeRead:
    """A value a workspace size depends on, read from the kernel's arguments.

    Attributes
    ----------
    param
        Index of the kernel parameter.
    dim
        Index of the dim in that buffer argument's shape; ``None`` for a scalar parameter
        (the value itself).
    name
        The kernel's variable (for display).
    """

    param: int
    dim: int | None
    name: str


@dataclass(frozen=True)
class WorkspaceAllocation:
    """One ``TVMBackendAllocWorkspace`` call of the lowered kernel.

    Attributes
    ----------
    buffer
        The buffer it backs (``T_softmax_exp``).
    nbytes
        Bytes, as a dim expression over ``v0``, ``v1``, ... (the values of
        :attr:`KernelWorkspace.reads`, in order).
    device_type
        The DLPack device type the call allocates on (1: CPU, 2: CUDA).
    """

    buffer: str
    nbytes: str
    device_type: int


@dataclass(frozen=True)
class KernelWorkspace:
    """The workspace of one kernel (see the module docstring).

    Attributes
    ----------
    kernel
        The kernel's name, as the VM calls it (its global symbol).
    reads
        The argument values the sizes depend on; the expressions call them ``v0``, ``v1``...
    allocations
        Every workspace allocation, in program order.
    live_sets
        Maximal sets of allocations (indices into ``allocations``) live at the same time.
    notes
        Why the description may be inexact (empty when it is exact).
    """

    kernel: str
    reads: tuple[ShapeRead, ...] = ()
    allocations: tuple[WorkspaceAllocation, ...] = ()
    live_sets: tuple[tuple[int, ...], ...] = ()
    notes: tuple[str, ...] = ()
    _integer: Any = field(default=None, init=False, repr=False, compare=False)
    _symbolic: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names, formula = self._names(), [self.formula]
        object.__setattr__(self, "_integer", compile_expressions(names, formula))
        symbolic = compile_expressions(names, formula, SYMBOLIC_FUNCTIONS)
        object.__setattr__(self, "_symbolic", symbolic)

    def _names(self) -> list[str]:
        """The names the formula calls the reads by."""
        return [f"v{i}" for i in range(len(self.reads))]

    @property
    def formula(self) -> str:
        """The kernel's workspace in bytes: the largest total of one live set (a dim
        expression over ``v0``, ``v1``, ...)."""
        totals = [
            " + ".join(self.allocations[i].nbytes for i in live) for live in self.live_sets if live
        ]
        totals = list(dict.fromkeys(totals))
        if not totals:
            return "0"
        return totals[0] if len(totals) == 1 else f"max({', '.join(totals)})"

    @property
    def exact(self) -> bool:
        return not self.notes

    @property
    def is_empty(self) -> bool:
        """Whether the kernel allocates no workspace at all."""
        return not self.allocations

    def evaluate(self, values: Sequence[Any]) -> Any:
        """The workspace for given values of :attr:`reads`.

        Works for integers (bytes) and for :class:`~blade_relax.symbolic.SymbolicExpr` values
        (symbolic bytes): the same expression serves the timeline and the runtime.
        """
        if len(values) != len(self.reads):
            raise ValueError(f"{self.kernel}: {len(self.reads)} values needed, got {len(values)}")
        symbolic = any(isinstance(v, SymbolicExpr) for v in values)
        return (self._symbolic if symbolic else self._integer)(*values)[0]

    def substitute(self, texts: Sequence[str]) -> str:
        """The workspace as a dim expression with each read replaced by ``texts[i]`` (e.g. an
        expression over a caller's dims)."""
        if len(texts) != len(self.reads):
            raise ValueError(f"{self.kernel}: {len(self.reads)} values needed, got {len(texts)}")
        return substitute(self.formula, dict(zip(self._names(), texts)))

    def nbytes_of(self, args: Sequence[Any]) -> int:
        """Bytes of workspace for one call, from the arguments the VM passes the kernel.

        Parameters
        ----------
        args
            The kernel's arguments in parameter order: tensors (anything with ``.shape``) for
            buffer parameters, integers for scalar parameters.
        """
        values = [
            args[r.param] if r.dim is None else args[r.param].shape[r.dim] for r in self.reads
        ]
        return int(self._integer(*values)[0])


# --------------------------------------------------------------------------- lowering
def _signature_reads(func: tirx.PrimFunc) -> dict[Any, ShapeRead]:
    """The kernel's variables that the VM's arguments define: buffer dims, scalar params."""
    reads: dict[Any, ShapeRead] = {}
    for index, param in enumerate(func.params):
        ty = getattr(param, "ty", None)
        if isinstance(ty, tirx.BufferType):
            for dim, value in enumerate(ty.shape):
                if isinstance(value, tirx.Var) and value not in reads:
                    reads[value] = ShapeRead(index, dim, value.name)
        elif isinstance(param, tirx.Var) and param not in reads:
            reads[param] = ShapeRead(index, None, param.name)
    return reads


def _resolve_target(func: tirx.PrimFunc, target: Any) -> tvm.target.Target:
    if target is not None:
        return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    attrs = func.attrs
    if attrs is not None and "target" in attrs:
        return attrs["target"]
    current = tvm.target.Target.current(allow_none=True)
    return current if current is not None else tvm.target.Target("llvm")


def _lower(func: tirx.PrimFunc, name: str, target: tvm.target.Target) -> tvm.IRModule:
    """The host side of ``func`` as ``tvm.tirx.build`` lowers it for ``target``."""
    from tvm.tirx.build import split_host_device_mods

    if target.host is not None:
        host = target.host
    elif target.get_target_device_type() == tvm.cpu().dlpack_device_type():
        host = target
    else:
        host = tvm.target.Target("llvm")
    # MakePackedAPI only exports functions with a global symbol; the VM calls the kernel by it.
    func = func.with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    # The build's options (``tirx.*`` config, disabled passes) as the ambient context has them;
    # not its instruments, which watch the caller's pipeline, not this lowering.
    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(
        opt_level=current.opt_level,
        config=current.config,
        disabled_pass=list(current.disabled_pass),
    ):
        mod = tirx.transform.BindTarget(target.with_host(host))(mod)
        pipeline, finalize_host, _ = tvm.tirx.get_default_tir_pipeline(target)
        mod = pipeline(mod)
        host_mod, _ = split_host_device_mods(mod)
        return finalize_host()(host_mod)


@dataclass
class _Collector:
    """Workspace calls of a lowered function, in program order, with what is live at each."""

    reads: Mapping[Any, str]
    # The reads that are dims of a buffer's shape (never negative).
    dims: frozenset[Any] = frozenset()
    binds: dict[Any, Any] = field(default_factory=dict)
    allocations: list[WorkspaceAllocation] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    sets: list[tuple[int, ...]] = field(default_factory=list)
    buffers: list[tuple[Any, int]] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)
    loops: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def run(self, body: Any) -> None:
        tvm_ffi.structural_visit(
            body,
            [
                (tirx.Bind, self._bind),
                (tirx.DeclBuffer, self._decl),
                (tirx.For, self._loop),
                (tvm.ir.expr.Call, self._call),
            ],
        )

    def _bind(self, node: Any, visitor: Any) -> Any:
        self.binds[node.var] = node.value
        return visitor.default_visit(node)

    def _decl(self, node: Any, visitor: Any) -> Any:
        data = getattr(node, "data", None)
        if _op_name(data) == _ALLOC:
            index = self._allocate(data, node.buffer.name)
            self.buffers.append((node.buffer, index))
        return visitor.default_visit(node)

    def _loop(self, node: Any, visitor: Any) -> Any:
        self.loops.append(node)
        try:
            return visitor.default_visit(node)
        finally:
            self.loops.pop()

    def _call(self, node: Any, visitor: Any) -> Any:
        name = _op_name(node)
        if name == _ALLOC and not any(node.same_as(s) for s in self.seen):
            self._allocate(node, "")
        elif name == _FREE:
            self._free(node.args[2])
        return visitor.default_visit(node)

    def _allocate(self, call: Any, buffer: str) -> int:
        self.seen.append(call)
        device_type = int(call.args[0].value) if isinstance(call.args[0], tirx.IntImm) else 0
        if any(loop.kind == tirx.ForKind.PARALLEL for loop in self.loops):
            self.notes.append(f"{buffer or 'a workspace'} is allocated once per parallel thread")
        try:
            nbytes = self._size(call.args[2])
        except ValueError as err:
            self.notes.append(f"{buffer or 'a workspace'}: {err}; not counted")
            nbytes = "0"
        index = len(self.allocations)
        self.allocations.append(WorkspaceAllocation(buffer, nbytes, device_type))
        self.live.append(index)
        self.sets.append(tuple(self.live))
        return index

    def _size(self, expr: Any) -> str:
        """An allocation's bytes over the reads, let-bound variables inlined."""
        try:
            return from_prim_expr(
                expr, self.reads, strict=True, nonnegative=self.dims, lets=self.binds, logic=False
            )
        except UndefinedVariable as err:
            raise ValueError(f"variable {err.var.name} is not read from the arguments") from None
        except UnsupportedNode as err:
            raise ValueError(f"{type(err.node).__name__} in a size") from None

    def _free(self, data: Any) -> None:
        target = data.args[0] if _op_name(data) == "tirx.buffer_data" and data.args else data
        for buffer, index in self.buffers:
            if _same_buffer(buffer, target) and index in self.live:
                self.live.remove(index)
                return
        # A free the collector cannot match: the allocation stays live to the end (a sum).


def _same_buffer(buffer: Any, target: Any) -> bool:
    if buffer.same_as(target):
        return True
    data = getattr(buffer, "data", None)
    if data is not None and _op_name(data) == "tirx.buffer_data" and data.args:
        return data.args[0].same_as(target)
    return False


def _op_name(expr: Any) -> str | None:
    op = getattr(expr, "op", None)
    return getattr(op, "name", None) if isinstance(op, tvm.ir.Op) else None


def _maximal(sets: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The sets not contained in another one (sizes are non-negative: the others never peak)."""
    unique = list(dict.fromkeys(sets))
    keep = [s for s in unique if not any(set(s) < set(t) for t in unique)]
    return tuple(keep)


def _describe(func: tirx.PrimFunc, name: str, target: tvm.target.Target) -> KernelWorkspace:
    signature = _signature_reads(func)
    read_names = {var: f"v{i}" for i, var in enumerate(signature)}
    try:
        lowered = _lower(func, name, target)
    except Exception as err:  # a kernel this target cannot lower on its own
        note = f"lowering for {target.kind.name} failed ({type(err).__name__}); not counted"
        return KernelWorkspace(kernel=name, notes=(note,))
    dims = frozenset(var for var, read in signature.items() if read.dim is not None)
    collector = _Collector(read_names, dims)
    for fn in lowered.functions.values():
        if isinstance(fn, tirx.PrimFunc):
            collector.run(fn.body)
    if not collector.allocations:
        return KernelWorkspace(kernel=name, notes=tuple(collector.notes))
    return KernelWorkspace(
        kernel=name,
        reads=tuple(signature.values()),
        allocations=tuple(collector.allocations),
        live_sets=_maximal(collector.sets),
        notes=tuple(collector.notes),
    )


# (structural hash, target) -> description, named after the first kernel it was built for.
_CACHE: dict[tuple[int, str], KernelWorkspace] = {}
_CACHE_LIMIT = 4096
# The structural hash of each PrimFunc object met, by its handle: the passes ask about the same
# kernel object once per call of it, and hashing a kernel's whole body costs more than the
# lookup. Each entry holds its PrimFunc, so no other object can take the handle meanwhile.
_HASHES: dict[int, tuple[tirx.PrimFunc, int]] = {}


def _structural_hash(func: tirx.PrimFunc) -> int:
    handle = hash(func)  # the object's address: equal for every wrapper of one node
    entry = _HASHES.get(handle)
    if entry is not None and entry[0].same_as(func):
        return entry[1]
    if len(_HASHES) >= _CACHE_LIMIT:
        _HASHES.clear()
    value = tvm_ffi.structural_hash(func)
    _HASHES[handle] = (func, value)
    return value


def kernel_workspace(
    func: tirx.PrimFunc, name: str = "kernel", target: Any = None
) -> KernelWorkspace:
    """The workspace description of one kernel.

    Parameters
    ----------
    func
        The PrimFunc as it goes to ``tvm.compile``'s TIR build (after the Relax pipeline).
    name
        Its name in the module (the symbol the VM calls).
    target
        The target it is built for: by default the PrimFunc's ``target`` attribute, else the
        current target scope, else ``llvm``.

    Returns
    -------
    KernelWorkspace
    """
    tgt = _resolve_target(func, target)
    key = (_structural_hash(func), str(tgt))
    found = _CACHE.get(key)
    if found is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = _describe(func, name, tgt)
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = found
    return found if found.kernel == name else replace(found, kernel=name)


def _symbol(gv: tvm.ir.GlobalVar, func: tirx.PrimFunc) -> str:
    attrs = func.attrs
    if attrs is not None and "global_symbol" in attrs:
        return str(attrs["global_symbol"])
    return gv.name_hint


def kernel_workspaces(mod: tvm.IRModule, target: Any = None) -> dict[str, KernelWorkspace]:
    """Every kernel of ``mod`` that allocates workspace, by the symbol the VM calls it by.

    Parameters
    ----------
    mod
        A module after the Relax pipeline (or any stage that holds the final kernels, such as
        :func:`blade_relax.pipeline.lower_to_memory_stage`'s result).
    target
        As for :func:`kernel_workspace`.
    """
    out: dict[str, KernelWorkspace] = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            name = _symbol(gv, func)
            ws = kernel_workspace(func, name, target)
            if not ws.is_empty:
                out[name] = ws
    return out


def workspace_table(
    mod: tvm.IRModule, target: Any = None
) -> dict[str, Callable[[Sequence[Any]], int]]:
    """The table the runtime accounting reads: kernel symbol -> bytes from its arguments.

    A plain mapping of callables, so that the runtime needs nothing from this module (see
    :func:`blade_relax.runtime.measure_memory`).
    """
    return {name: ws.nbytes_of for name, ws in kernel_workspaces(mod, target).items()}


@dataclass
class CompiledModule:
    """An executable, and the module ``tvm.compile`` built it from (after the Relax pipeline).

    Attributes
    ----------
    executable
        What ``tvm.compile`` returned.
    module
        The module its Relax pipeline produced: what the VM code generator and the TIR build
        received (this analysis reads it; nothing changes it).
    target
        The target it was built for.
    """

    executable: Any
    module: tvm.IRModule
    target: Any

    @functools.cached_property
    def workspaces(self) -> dict[str, Callable[[Sequence[Any]], int]]:
        """The executable's kernel workspace table (:func:`workspace_table` of ``module``)."""
        return workspace_table(self.module, self.target)


def compile_keeping_module(
    mod: tvm.IRModule, target: Any = "llvm", relax_pipeline: Any = None
) -> CompiledModule:
    """``tvm.compile``, keeping the module its Relax pipeline produced.

    The compilation is ``tvm.compile``'s own (the pipeline runs unchanged; a last pass only
    takes note of its result), so the executable is the one a plain ``tvm.compile`` gives.

    Parameters
    ----------
    mod, target
        As for ``tvm.compile``.
    relax_pipeline
        The whole Relax pipeline (``tvm.transform.Pass``); ``None`` for TVM's ``"default"``.
    """
    from tvm import relax as _relax

    kept: list[tvm.IRModule] = []

    @tvm.transform.module_pass(opt_level=0, name="KeepCompiledModule")
    def keep(m: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        kept.append(m)
        return m

    pipeline = relax_pipeline if relax_pipeline is not None else _relax.get_pipeline("default")
    exe = tvm.compile(mod, target, relax_pipeline=tvm.transform.Sequential([pipeline, keep]))
    return CompiledModule(exe, kept[-1], target)


# --------------------------------------------------------------------------- call sites
_KERNEL_CALL_OPS = frozenset(
    {"relax.call_tir", "relax.call_tir_with_grad", "relax.call_tir_inplace"}
)


def called_kernel(call: relax.Call, mod: tvm.IRModule) -> tvm.ir.GlobalVar | None:
    """The PrimFunc of ``mod`` a Relax call runs: the callee of ``R.call_tir`` /
    ``call_tir_with_grad`` / ``call_tir_inplace``, or the function called directly (after
    ``CallTIRRewrite``); None when the call runs no PrimFunc of ``mod``."""
    op = call.op
    if isinstance(op, tvm.ir.Op) and op.name in _KERNEL_CALL_OPS:
        gv = call.args[0]
    elif isinstance(op, tvm.ir.GlobalVar):
        gv = op
    else:
        return None
    if not isinstance(gv, tvm.ir.GlobalVar) or gv not in mod.functions:
        return None
    return gv if isinstance(mod[gv], tirx.PrimFunc) else None


def kernel_call_args(
    call: relax.Call, var: relax.Var, mod: tvm.IRModule
) -> tuple[tvm.ir.GlobalVar, list[Any]] | None:
    """The kernel a Relax binding calls and what each of its parameters receives.

    Each entry is a list of PrimExprs (the shape of a tensor argument or output) or a PrimExpr
    (a scalar argument). Handles ``R.call_tir`` / ``call_tir_with_grad`` (arguments, then the
    outputs of the bound variable's type, then ``tir_vars``), ``R.call_tir_inplace`` (the
    outputs not written in place) and direct calls of a PrimFunc (after ``CallTIRRewrite``).

    Returns
    -------
    tuple or None
        ``(kernel, params)``, or None when the binding calls no PrimFunc of ``mod``.
    """
    gv = called_kernel(call, mod)
    if gv is None:
        return None
    return gv, _kernel_params(call, var)


def _kernel_params(call: relax.Call, var: relax.Var) -> list[Any]:
    """:func:`kernel_call_args`' parameters of a call known to run a kernel."""
    op = call.op
    args = list(call.args)
    if isinstance(op, tvm.ir.Op):
        inputs = list(args[1].fields) if isinstance(args[1], relax.Tuple) else [args[1]]
        out_types = list(var.ty.fields) if isinstance(var.ty, relax.TupleType) else [var.ty]
        if op.name == "relax.call_tir_inplace":
            indices = [int(i) for i in call.attrs.inplace_indices]
            out_types = [t for t, i in zip(out_types, indices) if i < 0]
        params: list[Any] = [_values_of(a) for a in inputs]
        params += [_shape_of_type(t) for t in out_types]
        if len(args) > 2 and isinstance(args[2], relax.ShapeExpr):
            params += list(args[2].values)
    else:  # a direct call of the kernel
        params = [_values_of(a) for a in args]
    return params


def _shape_of_type(ty: Any) -> list[Any] | None:
    shape = getattr(ty, "shape", None)
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _values_of(arg: Any) -> Any:
    """What a kernel parameter receives: a tensor's shape, or a scalar's value."""
    ty = getattr(arg, "ty", None)
    if isinstance(ty, relax.TensorType):
        return _shape_of_type(ty)
    if isinstance(ty, tvm.ir.PrimType):
        # A Relax prim value is a PrimExpr in TVM 0.27 (``s``, ``T.int64(3)``); a variable
        # typed ``R.Prim(value=...)`` knows its value.
        value = getattr(ty, "value", None)
        return value if value is not None else arg
    return None


def call_reads(
    call: relax.Call, var: relax.Var, mod: tvm.IRModule, target: Any = None
) -> tuple[KernelWorkspace, list[Any]] | None:
    """The workspace of the kernel a binding calls, and its reads' values at this call.

    Returns
    -------
    tuple or None
        ``(workspace, values)``: ``values[i]`` is the PrimExpr (over the caller's variables)
        that :attr:`KernelWorkspace.reads` ``[i]`` takes at this call, or None where the
        call's types do not give it. None when the binding calls no kernel of ``mod``.
    """
    gv = called_kernel(call, mod)
    if gv is None:
        return None
    kernel = mod[gv]
    ws = kernel_workspace(kernel, _symbol(gv, kernel), target)
    if not ws.reads:
        # Most kernels read no dim for their workspace: the call's argument shapes, read
        # through the FFI per call, would go unused.
        return ws, []
    params = _kernel_params(call, var)
    values = []
    for read in ws.reads:
        given = params[read.param] if read.param < len(params) else None
        values.append(given if read.dim is None else _dim(given, read.dim))
    return ws, values


def call_workspace(
    call: relax.Call,
    var: relax.Var,
    mod: tvm.IRModule,
    graph: ShapeGraph,
    target: Any = None,
) -> SymbolicExpr | None:
    """Workspace bytes of the kernel a binding calls, over the caller's dims.

    Parameters
    ----------
    call, var
        The bound call and its variable.
    mod
        The module holding the kernel.
    graph
        The caller's shape graph (the result is canonical in it).
    target
        As for :func:`kernel_workspace`.

    Returns
    -------
    SymbolicExpr or None
        None when the binding calls no kernel of ``mod``; 0 for a kernel without workspace; an
        UNKNOWN expression when the call's argument shapes do not give a value it reads.
    """
    found = call_reads(call, var, mod, target)
    if found is None:
        return None
    ws, values = found
    if ws.is_empty:
        return SymbolicExpr.constant(0)
    if any(v is None for v in values):
        return SymbolicExpr.unknown(f"workspace of {ws.kernel} at {var.name}")
    return graph.canonical(ws.evaluate([SymbolicExpr.from_prim_expr(v) for v in values]))


def _dim(shape: Any, dim: int) -> Any:
    if isinstance(shape, list) and dim < len(shape):
        return shape[dim]
    return None

"""The memory pool CUDA graphs run in: which storages TVM lifts into it, and its size.

TVM's ``RewriteCUDAGraph`` (``src/relax/transform/rewrite_cuda_graph.cc``) lifts every
*static* storage of every Relax function in a module into one allocation function,
``cuda_graph_alloc``, called once per VM (``vm.builtin.cuda_graph.get_cached_alloc``); the
captured graphs read and write only those storages, so their addresses never change. A storage
is static when its size is a constant and it does not hold an output of its function (an
output must outlive the call; TVM's ``OutputStorageCollector``). The storages of different
functions are *merged* (``MergeAllocationPlans``): each function's static storages are sorted
by size, largest first, and the ``k``-th of every function shares slot ``k``, sized by the
largest of them. The functions never run concurrently, so sharing is safe.

This module computes the same thing from the planned IR (after memory planning, before
``RewriteCUDAGraph``): :func:`static_storages` per function and :func:`merged_pool`, the slot
sizes TVM will allocate. The merge is optimal for the given plans (slot ``k`` must hold the
``k``-th largest storage of every function), and when one function's sorted storages are each
at least those of every other function -- static copies of one function at growing lengths,
planned alike -- the pool is exactly that function's storages: the largest bucket's planned
bytes, and further (smaller) buckets add nothing. :class:`PoolPlan` says whether that holds and,
when it does not, how many bytes the merge adds (``excess_bytes``).

:func:`captured_functions` names the functions ``RewriteCUDAGraph`` lifted the captured regions
into, whose every call is recorded into a graph once and replayed after.

Nothing here changes IR.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from ..contract import CUDA_GRAPH_ALLOC, CUDA_GRAPH_RUN

__all__ = [
    "PoolPlan",
    "alloc_function_storages",
    "captured_functions",
    "merged_pool",
    "output_storages",
    "pool_plan",
    "static_storages",
]

_ALLOC_STORAGE = ("relax.memory.alloc_storage", "relax.vm.alloc_storage")
_ALLOC_TENSOR = "relax.memory.alloc_tensor"


def _bindings(func: relax.Function) -> list[relax.Binding]:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [binding for block in body.blocks for binding in block.bindings]


def _op_name(value: relax.Expr) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def captured_functions(mod: tvm.IRModule) -> set[str]:
    """The names of the functions a CUDA graph captures: each one that a
    :data:`~blade_relax.contract.CUDA_GRAPH_RUN` call of the module replays (empty when
    ``RewriteCUDAGraph`` did not rewrite the module)."""
    captured: set[str] = set()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        for binding in _bindings(func):
            value = binding.value
            if not isinstance(value, relax.Call) or not value.args:
                continue
            callee = value.args[0]
            if isinstance(callee, relax.ExternFunc) and str(callee.global_symbol) == CUDA_GRAPH_RUN:
                for arg in value.args[1:]:
                    captured.update(gv.name_hint for gv in relax.analysis.all_global_vars(arg))
    return captured


def output_storages(func: relax.Function) -> set[relax.Var]:
    """The storages of ``func`` that hold one of its outputs (TVM's
    ``OutputStorageCollector``): followed back from the returned value through variable and
    tuple bindings to the ``alloc_tensor`` that placed it."""
    outputs = set(relax.analysis.free_vars(func.body.body))
    found: set[relax.Var] = set()
    for binding in reversed(_bindings(func)):
        if not isinstance(binding, relax.VarBinding) or binding.var not in outputs:
            continue
        value = binding.value
        if isinstance(value, relax.Var):
            outputs.add(value)
        elif isinstance(value, relax.Tuple):
            outputs.update(f for f in value.fields if isinstance(f, relax.Var))
        elif _op_name(value) == _ALLOC_TENSOR and isinstance(value.args[0], relax.Var):
            found.add(value.args[0])
    return found


def _constant_bytes(call: relax.Call) -> int | None:
    shape = call.args[0]
    if not isinstance(shape, relax.ShapeExpr) or len(shape.values) != 1:
        return None
    size = shape.values[0]
    return int(size.value) if isinstance(size, tvm.tirx.IntImm) else None


def _scope(call: relax.Call) -> str:
    for arg in call.args[1:]:
        if isinstance(arg, tvm.ir.expr.StringImm):
            return str(arg.value)
    return "global"


def static_storages(func: relax.Function) -> dict[str, list[int]]:
    """Bytes of each storage of ``func`` that ``RewriteCUDAGraph`` lifts into the pool, by
    storage scope: constant-size ``alloc_storage`` bindings that hold no output."""
    outputs = output_storages(func)
    found: dict[str, list[int]] = {}
    for binding in _bindings(func):
        value = binding.value
        if _op_name(value) not in _ALLOC_STORAGE or binding.var in outputs:
            continue
        nbytes = _constant_bytes(value)
        if nbytes is not None:
            found.setdefault(_scope(value), []).append(nbytes)
    return found


def merged_pool(storages: Mapping[str, Sequence[int]]) -> list[int]:
    """The slot sizes of TVM's ``MergeAllocationPlans`` for one storage scope:
    slot ``k`` is the largest ``k``-th largest storage over the functions."""
    ranked = [sorted(sizes, reverse=True) for sizes in storages.values()]
    slots = max((len(r) for r in ranked), default=0)
    return [max(r[k] for r in ranked if k < len(r)) for k in range(slots)]


def alloc_function_storages(mod: tvm.IRModule) -> list[int]:
    """The storages ``cuda_graph_alloc`` allocates in a module ``RewriteCUDAGraph`` rewrote
    (empty when it did not rewrite: no CUDA target, or the option off)."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    if CUDA_GRAPH_ALLOC not in names:
        return []
    func = mod[names[CUDA_GRAPH_ALLOC]]
    sizes = []
    for binding in _bindings(func):
        if _op_name(binding.value) in _ALLOC_STORAGE:
            nbytes = _constant_bytes(binding.value)
            if nbytes is not None:
                sizes.append(nbytes)
    return sizes


@dataclass(frozen=True)
class PoolPlan:
    """The static storages of each function of a module, and the pool they merge into.

    Attributes
    ----------
    functions
        Function name -> its static storages in bytes (all storage scopes), largest first.
    pool
        The pool's slots in bytes (every scope), as ``RewriteCUDAGraph`` allocates them.
    """

    functions: dict[str, tuple[int, ...]]
    pool: tuple[int, ...]

    @property
    def pool_bytes(self) -> int:
        """Bytes of the one pool every function shares."""
        return sum(self.pool)

    @property
    def largest_function(self) -> str | None:
        """The function with the most static bytes (the largest bucket)."""
        if not self.functions:
            return None
        return max(self.functions, key=lambda name: sum(self.functions[name]))

    @property
    def largest_bytes(self) -> int:
        """Static bytes of :attr:`largest_function`: what a pool can at best be."""
        name = self.largest_function
        return sum(self.functions[name]) if name is not None else 0

    @property
    def excess_bytes(self) -> int:
        """What the merge adds above :attr:`largest_bytes` (0 when the largest function's
        storages dominate every other's rank by rank)."""
        return self.pool_bytes - self.largest_bytes

    @property
    def unshared_bytes(self) -> int:
        """Bytes if every function had a pool of its own (no sharing)."""
        return sum(sum(sizes) for sizes in self.functions.values())


def pool_plan(mod: tvm.IRModule, functions: Sequence[str] | None = None) -> PoolPlan:
    """The :class:`PoolPlan` of a planned module (after memory planning, before
    ``RewriteCUDAGraph``), over ``functions`` (default: every Relax function with a static
    storage)."""
    by_scope: dict[str, dict[str, list[int]]] = {}
    per_function: dict[str, tuple[int, ...]] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        if functions is not None and gv.name_hint not in functions:
            continue
        scopes = static_storages(func)
        if not scopes:
            continue
        every = []
        for scope, sizes in scopes.items():
            by_scope.setdefault(scope, {})[gv.name_hint] = sizes
            every += sizes
        per_function[gv.name_hint] = tuple(sorted(every, reverse=True))
    pool: list[int] = []
    for scope in sorted(by_scope):
        pool += merged_pool(by_scope[scope])
    return PoolPlan(per_function, tuple(pool))

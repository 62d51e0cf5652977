"""Random dynamic-shape Relax programs for differential testing.

A program is grown one binding at a time with ``relax.BlockBuilder``: every operand is taken from
the values already defined (so fan-out and long-lived tensors happen naturally), every new
parameter is created on demand with a shape made only of constants and symbolic dims, and every
operator is one whose result type Relax infers without help. The generator therefore never
produces an ill-typed program: a program the stock pipeline rejects is a bug of the generator.

What the programs contain
-------------------------
* 1 to ``max_dims`` symbolic dims (``n``, ``m``, ``k``) with a range; the function sometimes
  declares the range through the ``tir_var_lower_bound`` / ``tir_var_upper_bound`` attributes
  (read by ``StaticPlanBlockMemory``, which then plans at the upper bound).
* Elementwise unary and binary operators (with broadcasting), ``matmul`` (2-D and batched),
  reductions (``sum``, ``max``, ``mean``), ``reshape`` (flatten, merge, split, unsqueeze),
  ``concat``, ``broadcast_to``, ``permute_dims``, ``astype`` between float32 and float16, tuples
  (construction, ``split``, item access, tuple results).
* Dataflow blocks and plain binding blocks; an ``If`` on a data-dependent condition (plain
  blocks only); calls to other Relax functions of the module (which may hold an ``If`` of their
  own); a destination-passing call to a Python packed function (``R.call_dps_packed``), an
  operator no memory pass knows.

Two ways to draw the choices
----------------------------
:func:`generate_program` takes a :class:`Choices`: :class:`RandomChoices` (a seeded
``random.Random``: cheap, for fixed seed sets and long runs) or, through :func:`programs`, a
hypothesis strategy (shrinks a failing program to a small one).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from ..contract import LOWER_BOUND_ATTR, UPPER_BOUND_ATTR

__all__ = [
    "COPY_PACKED_FUNC",
    "Choices",
    "DimRange",
    "GeneratedProgram",
    "GeneratorConfig",
    "RandomChoices",
    "generate_program",
    "program_from_seed",
    "programs",
]

T = TypeVar("T")

#: Global name of the packed function behind the generator's ``R.call_dps_packed`` bindings: it
#: copies its input into the output buffer the VM allocated.
COPY_PACKED_FUNC = "blade_relax.testing.copy"


def _copy_into(src: Any, dst: Any) -> None:
    src.copyto(dst)


tvm.register_global_func(COPY_PACKED_FUNC, _copy_into, override=True)


class Choices(Protocol):
    """Source of the generator's decisions."""

    def integer(self, lo: int, hi: int) -> int:
        """An integer in ``[lo, hi]`` (both included)."""
        ...

    def boolean(self, p: float = 0.5) -> bool:
        """True with probability about ``p``."""
        ...


class RandomChoices:
    """Decisions from a seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def boolean(self, p: float = 0.5) -> bool:
        return self.rng.random() < p


class _DrawChoices:
    """Decisions drawn from hypothesis, so that failing programs shrink."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self._draw = draw
        self._st = st

    def integer(self, lo: int, hi: int) -> int:
        return self._draw(self._st.integers(lo, hi))

    def boolean(self, p: float = 0.5) -> bool:
        # Shrinks towards False: the rare features vanish first.
        return self._draw(self._st.integers(0, 999)) >= round(1000 * (1.0 - p))


def _pick(ch: Choices, options: Sequence[T]) -> T:
    return options[ch.integer(0, len(options) - 1)]


def _weighted(ch: Choices, options: Sequence[tuple[T, int]]) -> T:
    total = sum(w for _, w in options)
    k = ch.integer(0, total - 1)
    for value, weight in options:
        if k < weight:
            return value
        k -= weight
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class GeneratorConfig:
    """Size and mix of the generated programs.

    Attributes
    ----------
    max_dims
        Most symbolic dims in ``main``.
    max_ops
        Most operator bindings in ``main`` (helpers and ``If`` branches come on top).
    max_blocks
        Most binding blocks in ``main``.
    max_const
        Largest constant dim of a parameter.
    max_upper
        Largest upper end of a dim's range.
    p_plain_block
        Chance that a block is a plain (non-dataflow) block.
    p_declare_bounds
        Chance, per dim, that ``main`` declares its range in the bound attributes.
    allow_control_flow
        Whether ``If`` bindings may appear.
    allow_calls
        Whether calls to other Relax functions may appear.
    allow_opaque
        Whether ``R.call_dps_packed`` bindings may appear.
    allow_float16
        Whether ``astype`` to float16 may appear.
    """

    max_dims: int = 3
    max_ops: int = 10
    max_blocks: int = 3
    max_const: int = 6
    max_upper: int = 24
    p_plain_block: float = 0.3
    p_declare_bounds: float = 0.3
    allow_control_flow: bool = True
    allow_calls: bool = True
    allow_opaque: bool = True
    allow_float16: bool = True


@dataclass(frozen=True)
class DimRange:
    """A symbolic dim of ``main`` and the values the program accepts for it.

    ``declared_lower`` / ``declared_upper`` tell whether the range is written in the function's
    ``tir_var_lower_bound`` / ``tir_var_upper_bound`` attributes; an undeclared end is only the
    range the fuzzer samples from.
    """

    name: str
    lower: int
    upper: int
    declared_lower: bool = False
    declared_upper: bool = False


@dataclass
class GeneratedProgram:
    """A generated module and what is needed to run it.

    Attributes
    ----------
    mod
        The module; ``main`` is the entry point, other functions are helpers it calls.
    dims
        The symbolic dims of ``main`` (every one appears as a whole entry of a parameter shape).
    ops
        One line per generated binding, for reports.
    seed
        The seed of :class:`RandomChoices` that produced it (``None`` under hypothesis).
    """

    mod: tvm.IRModule
    dims: tuple[DimRange, ...]
    ops: list[str] = field(default_factory=list)
    seed: int | None = None

    @property
    def features(self) -> frozenset[str]:
        """Operator kinds that occur (``"if"``, ``"call"``, ``"matmul"``, ...)."""
        return frozenset(line.split(" ", 1)[0] for line in self.ops)

    @property
    def has_control_flow(self) -> bool:
        """Whether any function holds an ``If`` or ``main`` calls another Relax function."""
        return bool({"if", "call"} & self.features)

    def sample_dims(self, rng: random.Random) -> dict[str, int]:
        """Random admissible values of the dims, the ends of the ranges often included."""
        out = {}
        for dim in self.dims:
            r = rng.random()
            if r < 0.15:
                out[dim.name] = dim.lower
            elif r < 0.3:
                out[dim.name] = dim.upper
            else:
                out[dim.name] = rng.randint(dim.lower, dim.upper)
        return out

    def arguments(self, dims: dict[str, int], seed: int = 0) -> list[np.ndarray]:
        """Random arguments of ``main`` at ``dims`` (floats in [-1, 1])."""
        rng = np.random.default_rng(seed)
        arrays = []
        for param in self.mod["main"].params:
            ty = param.ty
            shape = [_eval_dim(v, dims) for v in ty.shape.values]
            arrays.append(rng.uniform(-1.0, 1.0, size=shape).astype(str(ty.dtype)))
        return arrays

    def script(self) -> str:
        """The module as TVMScript (for failure reports)."""
        return self.mod.script(show_meta=False)

    def __repr__(self) -> str:
        dims = ", ".join(
            f"{d.name}∈[{d.lower},{d.upper}]"
            + ("" if not (d.declared_lower or d.declared_upper) else " (declared)")
            for d in self.dims
        )
        return f"GeneratedProgram(seed={self.seed}, dims=[{dims}], ops={self.ops})"


def _eval_dim(value: Any, dims: dict[str, int]) -> int:
    if isinstance(value, tirx.IntImm):
        return int(value.value)
    if isinstance(value, tirx.Var):
        return dims[value.name]
    raise ValueError(f"parameter shape entry {value} is not a constant or a dim")


# ----------------------------------------------------------------------------- the builder
_UNARY = {
    "relu": relax.op.nn.relu,
    "negative": relax.op.negative,
    "abs": relax.op.abs,
    "tanh": relax.op.tanh,
    "sigmoid": relax.op.sigmoid,
    "exp": relax.op.exp,
}
_BINARY = {
    "add": relax.op.add,
    "subtract": relax.op.subtract,
    "multiply": relax.op.multiply,
    "maximum": relax.op.maximum,
    "minimum": relax.op.minimum,
}
_REDUCE = {"sum": relax.op.sum, "max": relax.op.max, "mean": relax.op.mean}


def _shape(var: relax.Expr) -> list[Any]:
    return list(var.ty.shape.values)


def _dtype(var: relax.Expr) -> str:
    return str(var.ty.dtype)


def _same_prim(a: Any, b: Any) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


def _same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(_same_prim(x, y) for x, y in zip(a, b))


def _is_tensor(var: relax.Expr) -> bool:
    ty = var.ty
    return isinstance(ty, relax.TensorType) and ty.shape is not None


class _FunctionBuilder:
    """Grows one function. ``main`` and helpers share the code; helpers are smaller."""

    def __init__(
        self,
        ch: Choices,
        cfg: GeneratorConfig,
        bb: relax.BlockBuilder,
        dims: dict[str, tirx.Var],
        log: list[str],
        module: _ModuleBuilder | None,
    ) -> None:
        self.ch = ch
        self.cfg = cfg
        self.bb = bb
        self.dims = dims
        self.log = log
        self.module = module
        self.params: list[relax.Var] = []
        self.pool: list[relax.Var] = []
        self.tuples: list[relax.Var] = []
        self.in_dataflow = False
        # Helpers keep their one parameter: a new parameter would change the call signature.
        self.allow_new_params = module is not None

    # -- values
    def new_param(
        self, shape: Sequence[Any], dtype: str = "float32", prefix: str = "w"
    ) -> relax.Var:
        var = relax.Var(f"{prefix}{len(self.params)}", relax.TensorType(list(shape), dtype))
        self.params.append(var)
        self.pool.append(var)
        return var

    def operand(self, pred: Callable[[relax.Var], bool] = lambda v: True) -> relax.Var | None:
        """The latest value half of the time, an older one otherwise (fan-out, long lives)."""
        cands = [v for v in self.pool if pred(v)]
        if not cands:
            return None
        if self.ch.boolean(0.5):
            return cands[-1]
        return _pick(self.ch, cands)

    def emit(self, expr: relax.Expr, text: str, escape: bool | None = None) -> relax.Var:
        if self.in_dataflow:
            if escape is None:
                escape = self.ch.boolean(0.4)
            var = self.bb.emit_output(expr) if escape else self.bb.emit(expr)
        else:
            var = self.bb.emit(expr)
        self.log.append(text)
        if isinstance(var.ty, relax.TupleType):
            self.tuples.append(var)
        elif _is_tensor(var):
            self.pool.append(var)
        return var

    def end_dataflow(self) -> None:
        self.pool = [v for v in self.pool if not isinstance(v, relax.DataflowVar)]
        self.tuples = [v for v in self.tuples if not isinstance(v, relax.DataflowVar)]

    def plain_entry(self, allow_dims: bool = True) -> Any:
        """A new shape entry: a small constant or one of the function's dims."""
        if allow_dims and self.dims and self.ch.boolean(0.5):
            return _pick(self.ch, list(self.dims.values()))
        return tirx.IntImm("int64", self.ch.integer(1, self.cfg.max_const))

    def is_plain(self, entry: Any) -> bool:
        if isinstance(entry, tirx.IntImm):
            return True
        return isinstance(entry, tirx.Var) and any(entry.same_as(d) for d in self.dims.values())

    # -- operators; each returns False when it does not apply to the state
    def op_unary(self) -> bool:
        x = self.operand()
        if x is None:
            return False
        name = _pick(self.ch, sorted(_UNARY))
        self.emit(_UNARY[name](x), f"unary {name}({x.name})")
        return True

    def op_binary(self) -> bool:
        x = self.operand()
        if x is None:
            return False
        shape, dtype = _shape(x), _dtype(x)
        mode = _weighted(self.ch, [("same", 5), ("broadcast", 2), ("scalar", 1)])
        y: relax.Expr | None = None
        if mode == "same":
            y = self.operand(lambda v: _dtype(v) == dtype and _same_shape(_shape(v), shape))
        elif mode == "broadcast" and shape and self.allow_new_params:
            keep = self.ch.integer(1, len(shape))
            suffix = shape[len(shape) - keep :]
            new_shape = [
                e if self.is_plain(e) and self.ch.boolean(0.7) else tirx.IntImm("int64", 1)
                for e in suffix
            ]
            y = self.new_param(new_shape, dtype)
        if y is None:
            y = relax.const(0.5, dtype)
        name = _pick(self.ch, sorted(_BINARY))
        if self.ch.boolean(0.3):
            x, y = y, x
        y_name = y.name if isinstance(y, relax.Var) else "const"
        x_name = x.name if isinstance(x, relax.Var) else "const"
        self.emit(_BINARY[name](x, y), f"binary {name}({x_name}, {y_name})")
        return True

    def op_matmul(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) >= 2 and self.is_plain(_shape(v)[-1]))
        if x is None:
            return False
        k = _shape(x)[-1]
        dtype = _dtype(x)
        w = None
        if self.ch.boolean(0.4):
            w = self.operand(
                lambda v: _dtype(v) == dtype and len(_shape(v)) == 2 and _same_prim(_shape(v)[0], k)
            )
        if w is None:
            w = self.new_param([k, self.plain_entry()], dtype)
        self.emit(relax.op.matmul(x, w), f"matmul {x.name} @ {w.name}")
        return True

    def op_reduce(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) >= 1)
        if x is None:
            return False
        rank = len(_shape(x))
        name = _pick(self.ch, sorted(_REDUCE))
        axis = None if self.ch.boolean(0.2) else [self.ch.integer(0, rank - 1)]
        keepdims = self.ch.boolean(0.5)
        self.emit(
            _REDUCE[name](x, axis=axis, keepdims=keepdims),
            f"reduce {name}({x.name}, axis={axis}, keepdims={keepdims})",
        )
        return True

    def op_reshape(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) >= 1)
        if x is None:
            return False
        shape = _shape(x)
        kind = _pick(self.ch, ["flatten", "merge", "unsqueeze", "split"])
        new: list[Any] | None = None
        if kind == "flatten" and len(shape) >= 2:
            new = [-1]
        elif kind == "merge" and len(shape) >= 2:
            i = self.ch.integer(0, len(shape) - 2)
            new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2 :]
        elif kind == "unsqueeze" and len(shape) <= 3:
            i = self.ch.integer(0, len(shape))
            new = shape[:i] + [tirx.IntImm("int64", 1)] + shape[i:]
        elif kind == "split":
            splittable = [
                i
                for i, e in enumerate(shape)
                if isinstance(e, tirx.IntImm) and int(e.value) >= 4 and int(e.value) % 2 == 0
            ]
            if splittable:
                i = _pick(self.ch, splittable)
                c = int(shape[i].value)
                new = shape[:i] + [tirx.IntImm("int64", 2), tirx.IntImm("int64", c // 2)]
                new += shape[i + 1 :]
        if new is None:
            return False
        self.emit(relax.op.reshape(x, new), f"reshape {kind}({x.name})")
        return True

    def op_concat(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) >= 1)
        if x is None:
            return False
        shape, dtype = _shape(x), _dtype(x)
        axis = self.ch.integer(0, len(shape) - 1)

        def fits(v: relax.Var) -> bool:
            s = _shape(v)
            return (
                _dtype(v) == dtype
                and len(s) == len(shape)
                and all(i == axis or _same_prim(a, b) for i, (a, b) in enumerate(zip(s, shape)))
            )

        others = [
            o for o in (self.operand(fits) for _ in range(self.ch.integer(1, 2))) if o is not None
        ]
        if not others and all(self.is_plain(e) for i, e in enumerate(shape) if i != axis):
            new_shape = list(shape)
            new_shape[axis] = self.plain_entry()
            others = [self.new_param(new_shape, dtype)]
        if not others:
            others = [x]
        parts = [x, *others]
        self.emit(
            relax.op.concat(parts, axis=axis),
            f"concat ({', '.join(p.name for p in parts)}), axis={axis}",
        )
        return True

    def op_broadcast(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) <= 3)
        if x is None:
            return False
        shape = _shape(x)
        target = [
            self.plain_entry() if isinstance(e, tirx.IntImm) and int(e.value) == 1 else e
            for e in shape
        ]
        if self.ch.boolean(0.5) or not shape:
            target = [self.plain_entry()] + target
        self.emit(relax.op.broadcast_to(x, target), f"broadcast_to {x.name}")
        return True

    def op_permute(self) -> bool:
        x = self.operand(lambda v: len(_shape(v)) >= 2)
        if x is None:
            return False
        axes = list(range(len(_shape(x))))
        for i in range(len(axes) - 1, 0, -1):  # Fisher-Yates through the choices
            j = self.ch.integer(0, i)
            axes[i], axes[j] = axes[j], axes[i]
        self.emit(relax.op.permute_dims(x, axes), f"permute_dims {x.name} {axes}")
        return True

    def op_astype(self) -> bool:
        if not self.cfg.allow_float16:
            return False
        x = self.operand()
        if x is None:
            return False
        target = "float16" if _dtype(x) == "float32" else "float32"
        self.emit(relax.op.astype(x, target), f"astype {x.name} -> {target}")
        return True

    def op_tuple(self) -> bool:
        if self.tuples and self.ch.boolean(0.6):
            t = _pick(self.ch, self.tuples)
            i = self.ch.integer(0, len(t.ty.fields) - 1)
            if _is_tensor_type(t.ty.fields[i]):
                self.emit(relax.TupleGetItem(t, i), f"tuple get({t.name}, {i})")
                return True
            return False
        if self.ch.boolean(0.4):
            x = self.operand(
                lambda v: any(
                    isinstance(e, tirx.IntImm) and int(e.value) % 2 == 0 and int(e.value) >= 2
                    for e in _shape(v)
                )
            )
            if x is not None:
                axes = [
                    i
                    for i, e in enumerate(_shape(x))
                    if isinstance(e, tirx.IntImm) and int(e.value) % 2 == 0 and int(e.value) >= 2
                ]
                axis = _pick(self.ch, axes)
                self.emit(relax.op.split(x, 2, axis=axis), f"tuple split({x.name}, axis={axis})")
                return True
        members = [
            m for m in (self.operand() for _ in range(self.ch.integer(1, 3))) if m is not None
        ]
        if not members:
            return False
        self.emit(relax.Tuple(members), f"tuple make({', '.join(m.name for m in members)})")
        return True

    def op_opaque(self) -> bool:
        if not self.cfg.allow_opaque:
            return False
        x = self.operand()
        if x is None:
            return False
        out_ty = relax.TensorType(_shape(x), _dtype(x))
        self.emit(
            relax.op.call_dps_packed(COPY_PACKED_FUNC, [x], out_ty=out_ty),
            f"opaque call_dps_packed({x.name})",
        )
        return True

    def op_call(self) -> bool:
        if not self.cfg.allow_calls or self.module is None:
            return False
        x = self.operand()
        if x is None:
            return False
        gv = self.module.helper_for(x)
        self.emit(relax.Call(gv, [x]), f"call {gv.name_hint}({x.name})")
        return True

    def op_if(self) -> bool:
        if not self.cfg.allow_control_flow or self.in_dataflow:
            return False
        x = self.operand(lambda v: len(_shape(v)) >= 1)
        if x is None:
            return False
        total = self.bb.emit(relax.op.sum(x))
        cond = self.bb.emit(relax.op.greater(total, relax.const(0.0, _dtype(x))))
        names = sorted(_UNARY)
        branches = []
        for tag in ("then", "else"):
            first = _UNARY[_pick(self.ch, names)](x)
            bindings = []
            var = relax.Var(f"{tag}_a", self.bb.normalize(first).ty)
            bindings.append(relax.VarBinding(var, first))
            if self.ch.boolean(0.5):
                partner = self.operand(
                    lambda v: _dtype(v) == _dtype(x) and _same_shape(_shape(v), _shape(x))
                )
                if partner is not None:
                    second = _BINARY[_pick(self.ch, sorted(_BINARY))](var, partner)
                    var2 = relax.Var(f"{tag}_b", self.bb.normalize(second).ty)
                    bindings.append(relax.VarBinding(var2, second))
                    var = var2
            branches.append(relax.SeqExpr([relax.BindingBlock(bindings)], var))
        self.emit(relax.If(cond, branches[0], branches[1]), f"if sum({x.name}) > 0")
        return True

    _OPS: tuple[tuple[str, int], ...] = (
        ("unary", 4),
        ("binary", 4),
        ("matmul", 2),
        ("reduce", 2),
        ("reshape", 2),
        ("concat", 2),
        ("broadcast", 1),
        ("permute", 1),
        ("astype", 1),
        ("tuple", 2),
        ("opaque", 1),
        ("call", 1),
        ("if", 2),
    )

    def random_op(self, allowed: Sequence[str] | None = None) -> None:
        ops = [(n, w) for n, w in self._OPS if allowed is None or n in allowed]
        for _ in range(8):
            if getattr(self, f"op_{_weighted(self.ch, ops)}")():
                return
        self.op_unary()


def _is_tensor_type(ty: Any) -> bool:
    return isinstance(ty, relax.TensorType) and ty.shape is not None


class _ModuleBuilder:
    """Owns the module's BlockBuilder and the helper functions ``main`` calls."""

    def __init__(self, ch: Choices, cfg: GeneratorConfig) -> None:
        self.ch = ch
        self.cfg = cfg
        self.bb = relax.BlockBuilder()
        self.log: list[str] = []
        self.helpers: list[tuple[tuple[str, tuple[Any, ...]], relax.GlobalVar]] = []

    def helper_for(self, x: relax.Var) -> relax.GlobalVar:
        """A helper taking a tensor like ``x`` (one is reused when its signature fits)."""
        shape, dtype = _shape(x), _dtype(x)
        consts = tuple(int(e.value) if isinstance(e, tirx.IntImm) else None for e in shape)
        key = (dtype, consts)
        for have, gv in self.helpers:
            if have == key and self.ch.boolean(0.6):
                return gv
        name = f"helper{len(self.helpers)}"
        hdims = {}
        param_shape = []
        for i, c in enumerate(consts):
            if c is None:
                var = tirx.Var(f"h{len(self.helpers)}_{i}", "int64")
                hdims[var.name] = var
                param_shape.append(var)
            else:
                param_shape.append(tirx.IntImm("int64", c))
        hb = relax.BlockBuilder()
        fb = _FunctionBuilder(self.ch, self.cfg, hb, hdims, self.log, None)
        p = fb.new_param(param_shape, dtype, prefix="p")
        allowed = ("unary", "binary", "if")
        with hb.function(name, [p], private=True):
            if self.ch.boolean(0.5):
                with hb.dataflow():
                    fb.in_dataflow = True
                    for _ in range(self.ch.integer(1, 3)):
                        # Same-shape ops only: the helper returns a tensor shaped like x.
                        fb.pool = [v for v in fb.pool if _same_shape(_shape(v), param_shape)]
                        fb.random_op(("unary", "binary"))
                    out = fb.pool[-1]
                    if isinstance(out, relax.DataflowVar):
                        out = hb.emit_output(out)
                    fb.in_dataflow = False
            else:
                for _ in range(self.ch.integer(1, 3)):
                    fb.pool = [v for v in fb.pool if _same_shape(_shape(v), param_shape)]
                    fb.random_op(allowed)
                out = fb.pool[-1]
            hb.emit_func_output(out)
        func = hb.get()[name]
        gv = self.bb.add_func(func, name)
        self.helpers.append((key, gv))
        self.log.append(f"helper {name}")
        return gv


def generate_program(ch: Choices, config: GeneratorConfig | None = None) -> GeneratedProgram:
    """Build one random program.

    Parameters
    ----------
    ch
        Where the decisions come from (:class:`RandomChoices`, or hypothesis via
        :func:`programs`).
    config
        Size and mix of the program.

    Returns
    -------
    GeneratedProgram
    """
    cfg = config or GeneratorConfig()
    mb = _ModuleBuilder(ch, cfg)
    names = ["n", "m", "k"][: max(1, min(cfg.max_dims, 3))]
    ndims = ch.integer(1, len(names))
    dim_ranges = []
    dims: dict[str, tirx.Var] = {}
    for name in names[:ndims]:
        lower = _weighted(ch, [(1, 4), (2, 2), (3, 1)])
        upper = lower + ch.integer(0, cfg.max_upper - lower)
        dim_ranges.append(
            DimRange(
                name,
                lower,
                upper,
                declared_lower=ch.boolean(cfg.p_declare_bounds),
                declared_upper=ch.boolean(cfg.p_declare_bounds),
            )
        )
        dims[name] = tirx.Var(name, "int64")

    fb = _FunctionBuilder(ch, cfg, mb.bb, dims, mb.log, mb)
    # Activations: every dim appears as a whole entry of some parameter shape.
    for var in dims.values():
        rank = ch.integer(1, 3)
        shape = [fb.plain_entry() for _ in range(rank)]
        shape[ch.integer(0, rank - 1)] = var
        fb.new_param(shape, "float32", prefix="x")
    if ch.boolean(0.3):
        fb.new_param([fb.plain_entry() for _ in range(ch.integer(1, 2))], "float32", prefix="x")

    total_ops = ch.integer(1, cfg.max_ops)
    blocks = ch.integer(1, min(cfg.max_blocks, total_ops))
    # Split the operators over the blocks, every block getting at least one.
    cuts = sorted({ch.integer(1, total_ops - 1) for _ in range(blocks - 1)}) if blocks > 1 else []
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, total_ops])]
    with mb.bb.function("main"):
        for count in counts:
            if ch.boolean(cfg.p_plain_block):
                for _ in range(count):
                    fb.random_op()
            else:
                with mb.bb.dataflow():
                    fb.in_dataflow = True
                    for _ in range(count):
                        fb.random_op()
                    last = fb.pool[-1]
                    if isinstance(last, relax.DataflowVar):
                        fb.emit(last, f"output {last.name}", escape=True)
                    fb.in_dataflow = False
                fb.end_dataflow()
        outputs = [fb.pool[-1]]
        for _ in range(ch.integer(0, 2)):
            extra = fb.operand(lambda v: all(not v.same_as(o) for o in outputs))
            if extra is not None:
                outputs.append(extra)
        if fb.tuples and ch.boolean(0.2):
            outputs.append(_pick(ch, fb.tuples))
        result = outputs[0] if len(outputs) == 1 else relax.Tuple(outputs)
        mb.bb.emit_func_output(result, params=fb.params)
    mod = mb.bb.get()
    main = mod["main"]
    lower = {d.name: d.lower for d in dim_ranges if d.declared_lower}
    upper = {d.name: d.upper for d in dim_ranges if d.declared_upper}
    if lower:
        main = main.with_attr(LOWER_BOUND_ATTR, lower)
    if upper:
        main = main.with_attr(UPPER_BOUND_ATTR, upper)
    mod["main"] = main
    mod = relax.transform.Normalize()(mod)
    return GeneratedProgram(mod=mod, dims=tuple(dim_ranges), ops=mb.log)


def program_from_seed(seed: int, config: GeneratorConfig | None = None) -> GeneratedProgram:
    """The program of one seed (the fixed CI set and the long runs use these)."""
    program = generate_program(RandomChoices(seed), config)
    program.seed = seed
    return program


def programs(config: GeneratorConfig | None = None) -> Any:
    """A hypothesis strategy of :class:`GeneratedProgram` (failing programs shrink).

    Parameters
    ----------
    config
        Size and mix of the programs.
    """
    from hypothesis import strategies as st

    @st.composite
    def _programs(draw: Callable[[Any], Any]) -> GeneratedProgram:
        return generate_program(_DrawChoices(draw), config)

    return _programs()

"""ExpandMathIntrinsics: ``exp``, ``tanh``, ``sigmoid`` and small integral powers in CPU kernels
become arithmetic that LLVM vectorizes.

On an llvm target TVM lowers ``T.exp(x)`` to LLVM's ``llvm.exp`` intrinsic, which becomes a call
of libm's ``expf`` for one element at a time (``tanh`` and ``sigmoid`` are lowered through
``exp``, ``pow`` to ``powf``). LLVM's loop vectorizer cannot vectorize a loop that calls a scalar
function unless it is given a vector math library, and TVM's llvm target has no option that
names one; so every softmax, GELU, SiLU and cross-entropy kernel computes its transcendental
functions one element at a time, several nanoseconds each, while PyTorch computes them in SIMD
registers (SLEEF). Measured on the benchmark's gpt2-train step at s = 256 on an AVX-512 CPU, a
GELU kernel and a softmax kernel took 10 of the step's 25 ms.

This pass replaces those calls, in the float32 PrimFuncs of the module, by plain arithmetic
(multiplies, adds, a ``floor``, integer shifts and a bit cast), which LLVM's loop vectorizer
vectorizes like any other loop body:

* ``exp(x)``: ``x = n ln 2 + r`` with ``n = floor(x log2(e) + 1/2)`` and ``ln 2`` in two parts
  (Cody and Waite), ``e^r`` by the degree-5 minimax polynomial of Cephes' ``expf``, scaled by
  ``2^n`` as two powers of two built from exponent bits (so that every ``n`` of the range is
  exact, and results in the subnormal range round as libm's do). NaN stays NaN, ``x > 88.72``
  (``+inf`` included) gives ``inf``, ``x < -103.98`` (``-inf`` included) gives 0. The error is
  at most one unit in the last place (checked in the tests against float64 over the whole
  range).
* ``sigmoid(x) = 1 / (1 + exp(-x))`` and ``tanh(x) = sign(x) (1 - e) / (1 + e)``,
  ``e = exp(-2|x|)``: the formulas TVM's own llvm lowering uses, with the ``exp`` above.
* ``pow(x, 2)`` and ``pow(x, 3)`` (GELU's cube): products.

Results therefore agree with the unexpanded kernels to rounding (about one unit in the last
place per function), not bit for bit; :func:`blade_relax.get_pipeline` runs the pass by default
(``expand_math=False`` leaves libm's calls), as it does ``DispatchGemm``.

When it helps, and when the pass does nothing
----------------------------------------------
Vectorizing the expanded arithmetic needs vector ``floor`` and fused multiply-adds, which the
generic x86-64 target (SSE2, no ``mcpu``) lacks: there the expanded code measured slower than
libm's scalar calls. The pass therefore expands only for an llvm target that names its CPU
(``mcpu``, e.g. :func:`blade_relax.pipeline.host_target`'s), unless
``MathOptions.require_mcpu`` is off; otherwise, and on non-llvm targets, it changes nothing and
says why in its result.

Where it runs
-------------
On PrimFuncs, at any point after ``FuseTIR``; it changes no buffer, no loop and no Relax
function, so no memory figure and no other pass's view of a kernel's blocks changes. In
:func:`blade_relax.get_pipeline` (``expand_math``, on by default) it runs last in the memory
stage, after ``DispatchGemm`` (whose epilogue kernels are PrimFuncs like any other).

What it assumes
---------------
Nothing beyond well-formed PrimFuncs: calls of other dtypes (float16, bfloat16, float64) and
powers with other exponents are left to TVM's lowering.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from ..util.collection import pauses_collection
from .result import PassResult, counted, function_results, publish, with_functions

__all__ = ["ExpandMathIntrinsics", "MathOptions", "MathReport", "expanded_exp"]

_F32 = "float32"
# exp(x) overflows to inf above this (ln of the largest float32) and underflows to 0 below the
# other (ln of half the smallest subnormal).
_EXP_HIGH = 88.72283935546875
_EXP_LOW = -103.97208404541016
# ln 2 = _LN2_HIGH + _LN2_LOW, the high part with few enough bits that n * _LN2_HIGH is exact.
_LN2_HIGH = 0.693359375
_LN2_LOW = -2.12194440e-4
_LOG2_E = 1.44269504088896341
# Cephes expf: e^r ~ 1 + r + r^2 (P0 r^5 + P1 r^4 + ... + P5), |r| <= ln(2) / 2.
_EXP_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_EXPANDED = ("exp", "sigmoid", "tanh", "pow")


@dataclass(frozen=True)
class MathOptions:
    """Options of :class:`ExpandMathIntrinsics`.

    Attributes
    ----------
    functions
        The calls expanded, among ``"exp"``, ``"sigmoid"``, ``"tanh"`` and ``"pow"``.
    require_mcpu
        Expand only for an llvm target that names its CPU (``mcpu``); see the module docstring.
    """

    functions: tuple[str, ...] = _EXPANDED
    require_mcpu: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.functions) - set(_EXPANDED))
        if unknown:
            raise ValueError(f"MathOptions.functions: {unknown} not among {_EXPANDED}")


@dataclass
class MathReport:
    """What one run of the pass changed.

    Attributes
    ----------
    expanded
        Function name (``"exp"``, ...) -> calls expanded, over the module's PrimFuncs.
    kernels
        PrimFuncs with at least one expanded call.
    skipped
        Why the pass changed nothing (the target), or ``None``.
    """

    expanded: dict[str, int] = field(default_factory=dict)
    kernels: int = 0
    skipped: str | None = None


def _f32(value: float) -> Any:
    return tirx.const(value, _F32)


def _power_of_two(exponent: Any) -> Any:
    """``2.0 ** exponent`` for an int32 ``exponent`` in [-126, 127], from its exponent bits."""
    biased = exponent + tirx.const(127, "int32")
    return tirx.reinterpret(_F32, tirx.shift_left(biased, tirx.const(23, "int32")))


def expanded_exp(x: Any) -> Any:
    """``exp(x)`` for a float32 TIR expression ``x``, as arithmetic (see the module docstring)."""
    clamped = tirx.max(tirx.min(x, _f32(_EXP_HIGH)), _f32(_EXP_LOW))
    n = tirx.floor(clamped * _f32(_LOG2_E) + _f32(0.5))
    r = clamped - n * _f32(_LN2_HIGH) - n * _f32(_LN2_LOW)
    poly = _f32(_EXP_POLY[0])
    for coefficient in _EXP_POLY[1:]:
        poly = poly * r + _f32(coefficient)
    mantissa = poly * (r * r) + r + _f32(1.0)
    # 2^n in two factors: n reaches -150 (a subnormal result) and 128, beyond one exponent field.
    whole = tirx.Cast("int32", n)
    half = tirx.shift_right(whole, tirx.const(1, "int32"))
    value = mantissa * _power_of_two(half) * _power_of_two(whole - half)
    value = tirx.Select(x < _f32(_EXP_LOW), _f32(0.0), value)
    value = tirx.Select(x > _f32(_EXP_HIGH), _f32(float("inf")), value)
    return tirx.Select(tirx.isnan(x), x, value)


def _expanded_sigmoid(x: Any) -> Any:
    return _f32(1.0) / (_f32(1.0) + expanded_exp(-x))


def _expanded_tanh(x: Any) -> Any:
    e = expanded_exp(_f32(-2.0) * tirx.Select(x < _f32(0.0), -x, x))
    magnitude = (_f32(1.0) - e) / (_f32(1.0) + e)
    return tirx.Select(x < _f32(0.0), -magnitude, magnitude)


def _expanded_pow(base: Any, exponent: Any) -> Any | None:
    if not isinstance(exponent, tirx.FloatImm) or exponent.value not in (2.0, 3.0):
        return None
    return base * base if exponent.value == 2.0 else base * base * base


def _expansion(call: Any, functions: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(function name, expansion)`` for a float32 call of an expanded function, else ``None``."""
    op = call.op
    if not isinstance(op, tvm.ir.Op) or not op.name.startswith("tirx."):
        return None
    name = op.name[len("tirx.") :]
    if name not in functions or str(call.ty) != _F32:
        return None
    if name == "exp":
        return name, expanded_exp(call.args[0])
    if name == "sigmoid":
        return name, _expanded_sigmoid(call.args[0])
    if name == "tanh":
        return name, _expanded_tanh(call.args[0])
    powered = _expanded_pow(*call.args)
    return None if powered is None else (name, powered)


def expand_prim_func(
    func: tirx.PrimFunc, functions: tuple[str, ...] = _EXPANDED
) -> tuple[tirx.PrimFunc, Counter[str]]:
    """``func`` with its float32 calls of ``functions`` expanded, and the calls expanded by name.

    TVM 0.27's Python has no TIR expression mutator; ``tvm_ffi.structural_map`` rewrites the
    calls bottom-up (an ``exp`` inside a ``tanh``'s argument is expanded first).
    """
    counts: Counter[str] = Counter()

    def call(node: Any) -> Any:
        found = _expansion(node, functions)
        if found is None:
            return node
        counts[found[0]] += 1
        return found[1]

    out = tvm_ffi.structural_map(func, [(tvm.ir.Call, call)])
    return (out if counts else func), counts


def _skip_reason(target: tvm.target.Target | None, options: MathOptions) -> str | None:
    if target is None:
        return "no target in scope"
    if target.kind.name != "llvm":
        return f"not an llvm target ({target.kind.name})"
    if options.require_mcpu and not target.attrs.get("mcpu"):
        return "the llvm target names no CPU (mcpu): the expansion would not be vectorized"
    return None


@tvm.transform.module_pass(opt_level=0, name="ExpandMathIntrinsics")
class ExpandMathIntrinsics:
    """Expand float32 ``exp``, ``tanh``, ``sigmoid`` and ``pow(x, 2 | 3)`` in PrimFuncs into
    arithmetic LLVM vectorizes (see the module docstring).

    Parameters
    ----------
    options
        A :class:`MathOptions` (``None``: defaults).

    The target is the PrimFunc's ``target`` attribute, else the target in scope
    (``with target:``, as :func:`blade_relax.get_pipeline` runs its passes). After the pass
    ran, ``pass_obj.report`` is a :class:`MathReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass changes no allocation).
    """

    name = "ExpandMathIntrinsics"

    def __init__(self, options: MathOptions | None = None) -> None:
        if options is not None and not isinstance(options, MathOptions):
            raise TypeError(
                f"ExpandMathIntrinsics expects MathOptions, got {type(options).__name__}"
            )
        self.options = options or MathOptions()
        self.report = MathReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = MathReport()
        totals: Counter[str] = Counter()
        changes: dict[str, list[str]] = {}
        updates: dict[tvm.ir.GlobalVar, tirx.PrimFunc] = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            target = func.attrs.get("target") if func.attrs else None
            reason = _skip_reason(target or tvm.target.Target.current(True), self.options)
            if reason is not None:
                self.report.skipped = reason
                continue
            new_func, counts = expand_prim_func(func, self.options.functions)
            if not counts:
                continue
            updates[gv] = new_func
            totals.update(counts)
            changes[gv.name_hint] = [
                ", ".join(counted(n, f"{name} call") for name, n in sorted(counts.items()))
                + " expanded"
            ]
        out = with_functions(mod, updates)
        self.report.expanded = dict(sorted(totals.items()))
        self.report.kernels = len(changes)
        if changes:
            self.report.skipped = None
        notes = () if self.report.skipped is None else (f"nothing expanded: {self.report.skipped}",)
        publish(
            self,
            PassResult(
                "ExpandMathIntrinsics",
                function_results(mod, out, changes, kind=tirx.PrimFunc),
                notes=notes,
                detail=self.report,
            ),
        )
        return out

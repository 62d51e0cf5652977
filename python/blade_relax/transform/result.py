"""What one run of a pass changed, in one form for every pass: :class:`PassResult`.

Every pass of :mod:`blade_relax.transform` sets ``pass_obj.last_result`` at the end of each
run (``None`` before its first run): per function of the input module, whether the pass changed
it, what changed in a few words, and, in the spirit of the before / after sizes of XLA's
``HloRematerialization``, the predicted peak bytes of the function before and after the pass
(:func:`blade_relax.analysis.memory_timeline`, symbolic over the function's dims). The memory
passes (``MemoryAwareSchedule``, ``Rematerialize``, ``PlanMemory``) predict them for every
function they change, building the timelines only when a figure is first read (a compilation
nobody reports on pays nothing for them); the other passes leave them ``None`` (each says why
in its docstring).

The pass object is what a user holds in a ``Sequential``; a pipeline built elsewhere (say
:func:`blade_relax.get_pipeline`) keeps its pass objects to itself, so the results of every pass
that runs in this thread can also be gathered with :func:`collect_results`::

    with collect_results() as results:
        lowered = lower_to_memory_stage(mod, "llvm", schedule=True, plan=True)
    for result in results:
        print(result.summary({"s": 128}))
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import relax

from ..symbolic import SymbolicExpr

__all__ = ["FunctionResult", "PassResult", "PeakSource", "collect_results"]

#: A byte figure computed when it is first read (see :class:`FunctionResult`).
PeakSource = Callable[[], "SymbolicExpr | None"]


class _Peak:
    """A :class:`FunctionResult` field holding a ``SymbolicExpr``, ``None``, or a
    :data:`PeakSource` that gives one on first read (and may raise: the figure is then ``None``
    and :attr:`FunctionResult.prediction_notes` says why)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> SymbolicExpr | None:
        if obj is None:
            return None  # the field's default
        value = obj.__dict__.get(self._slot)
        if callable(value):
            try:
                value = value()
            except Exception as err:  # an IR the timeline cannot read: no prediction
                why = str(err).splitlines()[0] if str(err) else ""
                obj.__dict__.setdefault("_problems", []).append(
                    f"no byte prediction ({type(err).__name__}: {why})"
                )
                value = None
            obj.__dict__[self._slot] = value
        return value

    def __set__(self, obj: Any, value: SymbolicExpr | PeakSource | None) -> None:
        obj.__dict__[self._slot] = value


@dataclass(frozen=True)
class FunctionResult:
    """What one run of a pass did to one function.

    Attributes
    ----------
    function
        The function's name in the pass's input module.
    changed
        Whether the pass rewrote the function.
    changes
        What changed, in short phrases (``"2 bindings moved"``, ``"3 tensors evictable"``).
    peak_before, peak_after
        Predicted peak bytes of the function before and after the pass (the ``peak`` of
        :func:`blade_relax.analysis.memory_timeline`, over the function's dims; parameters
        excluded). ``None`` where the pass does not predict them, e.g. for a function it left
        unchanged, or at a stage where the prediction would cost more than the pass. A pass
        may give a :data:`PeakSource` instead: the timeline is then built when the figure is
        first read, so that a compilation nobody reports on pays nothing for it.
    notes
        Why the function was left alone, or what the figures stand for.
    """

    function: str
    changed: bool
    changes: tuple[str, ...] = ()
    peak_before: SymbolicExpr | None = _Peak()
    peak_after: SymbolicExpr | None = _Peak()
    notes: tuple[str, ...] = ()

    @property
    def prediction_notes(self) -> tuple[str, ...]:
        """Why a figure the pass meant to predict is ``None`` (reading the figures first)."""
        _ = (self.peak_before, self.peak_after)
        return tuple(self.__dict__.get("_problems", ()))

    def evaluate(self, dims: Mapping[str, int]) -> tuple[int | None, int | None]:
        """The peak bytes before and after at concrete dims.

        Parameters
        ----------
        dims
            A value for every dim the figures depend on, e.g. ``{"s": 128}``.

        Returns
        -------
        tuple
            ``(before, after)``; ``None`` for a figure the pass did not predict.

        Raises
        ------
        ValueError
            If a dim is missing from ``dims`` or a figure cannot be evaluated.
        """
        return tuple(  # type: ignore[return-value]
            None if peak is None else peak.evaluate(dims)
            for peak in (self.peak_before, self.peak_after)
        )

    def summary(self, dims: Mapping[str, int] | None = None) -> str:
        """One line: the function, what changed (or why not), and the peak before and after
        (in bytes at ``dims`` where they evaluate there, else symbolic)."""
        text = ", ".join(self.changes) if self.changed else "unchanged"
        if self.changed and not self.changes:
            text = "changed"
        parts = [f"{self.function}: {text}"]
        peaks = _peaks_text(self, dims)
        if peaks:
            parts.append(peaks)
        notes = self.notes + self.prediction_notes
        if notes:
            parts.append("; ".join(notes))
        return "; ".join(parts)

    def to_dict(self, dims: Mapping[str, int] | None = None) -> dict[str, Any]:
        """A JSON-ready dict; with ``dims``, the byte figures evaluated there too."""
        out: dict[str, Any] = {
            "function": self.function,
            "changed": self.changed,
            "changes": list(self.changes),
            "notes": list(self.notes + self.prediction_notes),
            "peak_before": None if self.peak_before is None else str(self.peak_before),
            "peak_after": None if self.peak_after is None else str(self.peak_after),
        }
        if dims is not None:
            before, after = _evaluated(self, dims)
            out["peak_before_bytes"] = before
            out["peak_after_bytes"] = after
        return out


@dataclass(frozen=True)
class PassResult:
    """What one run of a pass did to a module.

    Attributes
    ----------
    pass_name
        The pass's name (its class name).
    functions
        One :class:`FunctionResult` per function the pass looked at, in module order, then
        the functions it added (range copies of ``MemoryAwareSchedule``).
    notes
        Notes on the whole run (``"disabled by its options"``).
    detail
        The pass's own, more detailed report where it has one (``ScheduleReport``, the
        ``FunctionPlan`` of each function, ``TransposeReport``, ...); not compared.
    """

    pass_name: str
    functions: tuple[FunctionResult, ...] = ()
    notes: tuple[str, ...] = ()
    detail: Any = field(default=None, compare=False, repr=False)

    @property
    def changed(self) -> bool:
        """Whether the pass changed any function."""
        return any(f.changed for f in self.functions)

    @property
    def changed_functions(self) -> tuple[FunctionResult, ...]:
        """The results of the functions the pass changed."""
        return tuple(f for f in self.functions if f.changed)

    def __getitem__(self, name: str) -> FunctionResult:
        """The result of the function ``name`` (``KeyError`` when the pass did not look at
        it)."""
        for result in self.functions:
            if result.function == name:
                return result
        raise KeyError(f"{self.pass_name} reports no function {name!r}")

    def evaluate(self, dims: Mapping[str, int]) -> dict[str, tuple[int | None, int | None]]:
        """The peak bytes before and after of every function with a predicted figure.

        Parameters
        ----------
        dims
            A value for every dim of those functions, e.g. ``{"s": 128}``.

        Returns
        -------
        dict
            Function name: ``(before, after)`` (see :meth:`FunctionResult.evaluate`).

        Raises
        ------
        ValueError
            If a dim is missing from ``dims`` or a figure cannot be evaluated.
        """
        return {
            f.function: f.evaluate(dims)
            for f in self.functions
            if f.peak_before is not None or f.peak_after is not None
        }

    def summary(
        self, dims: Mapping[str, int] | None = None, max_functions: int | None = None
    ) -> str:
        """A few lines for people: a headline, then one line per changed function, then per
        function left alone with a reason; the other unchanged functions are counted.

        Parameters
        ----------
        dims
            Concrete dims to evaluate the byte figures at (those that do not evaluate there
            are shown symbolic).
        max_functions
            Show at most this many function lines (``None``: all); the rest are counted.
        """
        changed = self.changed_functions
        head = f"{self.pass_name}: "
        if changed:
            head += f"changed {len(changed)} of {len(self.functions)} functions"
        else:
            head += "no change"
        if self.notes:
            head += f" ({'; '.join(self.notes)})"
        # The changed functions first, then those left alone for a reason.
        told = [f for f in self.functions if f.changed]
        told += [f for f in self.functions if not f.changed and f.notes]
        limit = len(told) if max_functions is None else max(max_functions, 0)
        lines = [head, *("  " + f.summary(dims) for f in told[:limit])]
        if len(told) > limit:
            lines.append(f"  ({counted(len(told) - limit, 'more function')})")
        quiet = len(self.functions) - len(told)
        if quiet and told:
            lines.append(f"  {counted(quiet, 'other function')} unchanged")
        return "\n".join(lines)

    def to_dict(self, dims: Mapping[str, int] | None = None) -> dict[str, Any]:
        """A JSON-ready dict; with ``dims``, the byte figures evaluated there too (``None``
        where they do not evaluate)."""
        return {
            "pass": self.pass_name,
            "changed": self.changed,
            "notes": list(self.notes),
            "functions": [f.to_dict(dims) for f in self.functions],
        }


# ----------------------------------------------------------------------------- collecting
_LOCAL = threading.local()


@contextlib.contextmanager
def collect_results() -> Iterator[list[PassResult]]:
    """Gather the :class:`PassResult` of every pass that finishes in this thread.

    Yields a list that receives each result, in the order the passes ran. Collectors nest:
    a result goes to the innermost one only, so a pass that runs another pass on a trial
    module (``MemoryAwareSchedule`` runs ``RecomputeCheapValues``) keeps that run out of its
    caller's list.
    """
    stack = _collectors()
    results: list[PassResult] = []
    stack.append(results)
    try:
        yield results
    finally:
        stack.pop()


def _collectors() -> list[list[PassResult]]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def publish(pass_obj: Any, result: PassResult) -> None:
    """Set ``pass_obj.last_result`` and hand ``result`` to the innermost collector."""
    pass_obj.last_result = result
    stack = _collectors()
    if stack:
        stack[-1].append(result)


# ------------------------------------------------------------------------ for the passes
def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``"1 tensor"``, ``"3 tensors"``."""
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def timeline_peak(
    func: relax.Function, mod: tvm.IRModule, lower: Callable[[], tvm.IRModule] | None = None
) -> PeakSource:
    """A :data:`PeakSource`: ``memory_timeline(func, mod=mod).peak``, built when first read.

    Kernel workspaces depend on the target, so the target current now (the pipeline's) is the
    one the timeline is built for, whenever that is.

    Parameters
    ----------
    func, mod
        The function and its module (for its kernels); ``mod`` a :func:`snapshot` when the
        pass hands it on (a later pass or the user may update a module in place).
    lower
        Gives the module to read instead of ``mod``, with ``func`` replaced by its function of
        the same name there (e.g. ``mod`` with the kills a later pass inserts); called when the
        figure is read.
    """
    from ..analysis import memory_timeline

    target = tvm.target.Target.current(allow_none=True)
    if lower is not None:
        name = next(gv.name_hint for gv, f in mod.functions.items() if f.same_as(func))

    def peak() -> SymbolicExpr:
        read_mod, read_func = mod, func
        if lower is not None:
            read_mod = lower()
            read_func = read_mod[name]
        with contextlib.ExitStack() as stack:
            if target is not None:
                stack.enter_context(target)
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")  # the analysis's own; the pass already ran
            return memory_timeline(read_func, mod=read_mod).peak

    return peak


def snapshot(mod: tvm.IRModule) -> tvm.IRModule:
    """A new module holding the functions of ``mod`` (the functions themselves are immutable):
    what ``mod`` is now, whatever in-place updates it gets later."""
    return tvm.IRModule(dict(mod.functions), attrs=mod.attrs, global_infos=mod.global_infos)


def with_functions(
    mod: tvm.IRModule, updates: Mapping[tvm.ir.GlobalVar, tvm.ir.BaseFunc]
) -> tvm.IRModule:
    """``mod`` with the functions of ``updates`` in place of its own: a :func:`snapshot` with
    them, or ``mod`` itself when there are none (a pass that changed nothing returns its input).
    """
    if not updates:
        return mod
    out = snapshot(mod)
    for gv, func in updates.items():
        out[gv] = func
    return out


def differs(before: relax.Function, after: relax.Function | None) -> bool:
    """Whether ``after`` is not ``before`` nor structurally equal to it (``None``: the function
    is gone). For the functions a pass did not rewrite itself, which a module-wide cleanup it
    runs (``DeadCodeElimination``, ``CanonicalizeBindings``) may have."""
    if after is None:
        return True
    return not before.same_as(after) and not tvm_ffi.structural_equal(
        before, after, map_free_vars=True
    )


def function_results(
    before: tvm.IRModule,
    after: tvm.IRModule,
    changes: Mapping[str, Sequence[str]],
    kind: type = relax.Function,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> tuple[FunctionResult, ...]:
    """One :class:`FunctionResult` (no byte figures) per function of ``before`` of type
    ``kind``: changed with the phrases of ``changes`` where it has any; otherwise unchanged,
    unless the pass's module-wide cleanup rewrote or removed it (:func:`differs`).

    Parameters
    ----------
    before, after
        The pass's input and output modules.
    changes
        Function name: what the pass changed in it.
    kind
        The functions the pass works on (``relax.Function`` or ``tirx.PrimFunc``).
    notes
        Function name: notes (why it was left alone).
    """
    notes = notes or {}
    out_functions = {gv.name_hint: f for gv, f in after.functions.items()}
    results = []
    for gv, func in before.functions.items():
        if not isinstance(func, kind):
            continue
        name = gv.name_hint
        done = tuple(changes.get(name, ()))
        extra = tuple(notes.get(name, ()))
        if done:
            results.append(FunctionResult(name, True, done, notes=extra))
        elif after is not before and differs(func, out_functions.get(name)):
            what = "rewritten by the pass's cleanup" if name in out_functions else "removed"
            results.append(FunctionResult(name, True, (what,), notes=extra))
        else:
            results.append(FunctionResult(name, False, notes=extra))
    return tuple(results)


def _evaluated(result: FunctionResult, dims: Mapping[str, int]) -> tuple[int | None, int | None]:
    out = []
    for peak in (result.peak_before, result.peak_after):
        try:
            out.append(None if peak is None else peak.evaluate(dims))
        except ValueError:
            out.append(None)
    return out[0], out[1]


def _short(expr: SymbolicExpr, limit: int = 72) -> str:
    text = str(expr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _peaks_text(result: FunctionResult, dims: Mapping[str, int] | None) -> str:
    if result.peak_before is None and result.peak_after is None:
        return ""
    before, after = _evaluated(result, dims) if dims is not None else (None, None)
    shown = []
    for peak, value in ((result.peak_before, before), (result.peak_after, after)):
        if peak is None:
            shown.append("n/a")
        elif value is not None:
            shown.append(f"{value:,} B")
        else:
            shown.append(_short(peak))
    text = f"peak {shown[0]} -> {shown[1]}"
    if before is not None and after is not None:
        if after == before:
            text += " (same)"
        elif before:
            text += f" ({after - before:+,} B, {(after - before) / before:+.1%})"
        used = sorted(
            (result.peak_before.dim_names | result.peak_after.dim_names) & set(dims or {})
        )
        if used:
            text += " at " + ", ".join(f"{name}={dims[name]}" for name in used)
    return text

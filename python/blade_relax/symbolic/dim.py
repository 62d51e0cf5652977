"""Symbolic dims: one tirx shape variable of a Relax function, with its value range.

A dim is named by its tirx var name (one namespace per function) and carries the sympy symbol
that stands for it in every :class:`~blade_relax.symbolic.expr.SymbolicExpr`. Symbols are
interned by name and lower bound, so two expressions built independently over the dim ``s``
share the same symbol and cancel when subtracted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy

#: Prefix of the names of opaque symbols that stand for unsupported PrimExpr nodes.
UNKNOWN_PREFIX = "__unknown__"

#: Value range of a dim when nothing else is declared: every dim is at least 1, unbounded above.
DEFAULT_LOWER = 1


@functools.cache
def dim_symbol(name: str, lower: int | None = DEFAULT_LOWER) -> sympy.Symbol:
    """Return the interned sympy symbol of the dim ``name``.

    Parameters
    ----------
    name : str
        The tirx var name.
    lower : int or None
        The dim's lower bound; it selects the sympy assumptions (``positive`` for ``lower >= 1``,
        ``nonnegative`` for ``lower == 0``, plain ``integer`` otherwise), which keep sympy's own
        automatic simplifications (``Max(s, 0) -> s``) correct.

    Returns
    -------
    sympy.Symbol
        An integer symbol.
    """
    if lower is not None and lower >= 1:
        return sympy.Symbol(name, integer=True, positive=True)
    if lower is not None and lower >= 0:
        return sympy.Symbol(name, integer=True, nonnegative=True)
    return sympy.Symbol(name, integer=True)


@functools.cache
def unknown_symbol(key: str) -> sympy.Symbol:
    """Return the opaque symbol standing for an unsupported expression identified by ``key``.

    The same key gives the same symbol, so an unsupported expression compares EQ with itself
    and cancels in a difference, and nothing else can be proven about it.
    """
    return sympy.Symbol(f"{UNKNOWN_PREFIX}{key}", integer=True)


def is_unknown_symbol(symbol: sympy.Basic) -> bool:
    """Whether ``symbol`` is an opaque UNKNOWN symbol."""
    return isinstance(symbol, sympy.Symbol) and symbol.name.startswith(UNKNOWN_PREFIX)


def symbol_default_range(symbol: sympy.Symbol) -> tuple[int | None, int | None]:
    """The range a symbol unknown to a graph is assumed to have, read from its assumptions."""
    if is_unknown_symbol(symbol):
        return (None, None)
    if symbol.is_positive:
        return (1, None)
    if symbol.is_nonnegative:
        return (0, None)
    return (None, None)


@dataclass(frozen=True)
class SymbolicDim:
    """One symbolic dim of a function: a tirx var name, its value range, its equivalence class.

    Attributes
    ----------
    name : str
        The tirx var name (``var.name``).
    lower : int
        Smallest admissible value (1 unless declared otherwise).
    upper : int or None
        Largest admissible value; None when unbounded.
    symbol : sympy.Symbol
        The sympy symbol of this dim (filled in from ``name`` and ``lower`` when omitted).
    eq_class : frozenset of str
        Names of the dims proven equal to this one (itself included). In a graph the class's
        range is the intersection of the declared ranges of its members.
    """

    name: str
    lower: int = DEFAULT_LOWER
    upper: int | None = None
    symbol: sympy.Symbol = field(default=None, compare=False)  # type: ignore[assignment]
    eq_class: frozenset[str] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        if self.upper is not None and self.upper < self.lower:
            raise ValueError(
                f"dim {self.name!r}: empty range [{self.lower}, {self.upper}] (upper < lower)"
            )
        if self.symbol is None:
            object.__setattr__(self, "symbol", dim_symbol(self.name, self.lower))
        if not self.eq_class:
            object.__setattr__(self, "eq_class", frozenset({self.name}))

    @property
    def range_str(self) -> str:
        """The range as text, e.g. ``[1, 2048]`` or ``[1, inf)``."""
        return format_range(self.lower, self.upper)


def format_range(lower: int | None, upper: int | None) -> str:
    """Format a range for error messages: ``[1, 2048]``, ``[1, inf)``."""
    lo = "(-inf" if lower is None else f"[{lower}"
    hi = "inf)" if upper is None else f"{upper}]"
    return f"{lo}, {hi}"

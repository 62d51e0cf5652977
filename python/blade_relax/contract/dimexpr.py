"""Dim expressions: the integer formulas over named dims that the compiler writes and the runtime
evaluates.

A size the runtime needs (the bytes of a storage or of a kernel's workspace, a recompute cost)
is known at compile time only as a formula over a function's dims. The compiler writes it as
text (:func:`blade_relax.analysis.dimexpr.from_prim_expr` converts a TIR ``PrimExpr``), an
executable carries the text (the remat metadata, :mod:`.remat_metadata`), and the runtime
evaluates it once per shape. This module is that language: its text format, its validation
and its one evaluator. Like the rest of the contract it imports only the standard library.

The text format
---------------
A Python expression made only of:

* integer literals, and names (the dims, or the names a caller compiles the text over);
* ``+``, ``-``, ``*``, ``//``, ``%`` and unary ``-``;
* the comparisons ``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=`` and ``and``, ``or``, ``not``;
* the conditional ``a if c else b``;
* calls of ``max`` and ``min`` (two or more arguments), ``tdiv`` and ``tmod`` (two).

For example ``"((s * 4) * max(b, 1))"`` or ``"tdiv((s - 1), 2)"``.

Semantics
---------
Values are Python integers: exact, never wrapping around at 64 bits. A comparison gives a
boolean, which counts as 0 or 1 in arithmetic.

Division and modulo come in the two kinds TIR has:

``a // b``, ``a % b``: floor
    The quotient rounded toward negative infinity; the remainder has the sign of ``b``:
    ``-7 // 2 == -4``, ``-7 % 2 == 1``. TIR's ``FloorDiv`` and ``FloorMod``.
``tdiv(a, b)``, ``tmod(a, b)``: truncating
    The quotient rounded toward zero; the remainder has the sign of ``a``:
    ``tdiv(-7, 2) == -3``, ``tmod(-7, 2) == -1``. TIR's ``Div`` and ``Mod`` on integers (C's
    ``/`` and ``%``).

Either way ``a == q * b + r``. The two kinds agree when neither operand is negative, which is
why the converter writes ``//`` and ``%`` for a TIR ``Div`` / ``Mod`` whose operands it proves
non-negative. Division by zero raises ``ZeroDivisionError``.

Evaluation
----------
:func:`compile_expressions` validates texts and compiles them once into one Python function of
the names' values that returns every text's value; calling it is the cost of evaluating the
arithmetic. The operators are the values' own, so the same function also computes over other
number types (a symbolic one, given ``max``, ``min``, ``tdiv`` and ``tmod`` for it).
"""

from __future__ import annotations

import ast
import functools
import keyword
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "FUNCTIONS",
    "DimExprError",
    "compile_expressions",
    "substitute",
    "tdiv",
    "tmod",
    "validate",
]


class DimExprError(ValueError):
    """A text that is not a dim expression over the given names."""


def tdiv(a: int, b: int) -> int:
    """Integer division truncating toward zero (TIR ``Div`` on integers)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def tmod(a: int, b: int) -> int:
    """The remainder of :func:`tdiv`: it has the sign of ``a`` (TIR ``Mod`` on integers)."""
    return a - b * tdiv(a, b)


#: The functions a text may call, as they compute on integers.
FUNCTIONS: Mapping[str, Callable[..., Any]] = {"max": max, "min": min, "tdiv": tdiv, "tmod": tmod}
# How many arguments each function takes: at least, at most (None: no limit).
_ARITY = {"max": (2, None), "min": (2, None), "tdiv": (2, 2), "tmod": (2, 2)}

_ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Mod,
    ast.USub,
    ast.Not,
    ast.And,
    ast.Or,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Eq,
    ast.NotEq,
)


def _parse(text: str, names: frozenset[str]) -> ast.expr:
    """The checked syntax tree of one text (see the module docstring for what is accepted)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise DimExprError(f"dim expression {text!r}: {err.msg}") from None
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise DimExprError(f"dim expression: unsupported node {type(node).__name__}")
        if isinstance(node, ast.Name) and node.id not in names and id(node) not in called:
            raise DimExprError(f"dim expression: unknown name {node.id!r}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise DimExprError(f"dim expression: non-integer constant {node.value!r}")
        if isinstance(node, ast.Call):
            _check_call(node)
    return tree.body


def _check_call(node: ast.Call) -> None:
    func = node.func
    if not isinstance(func, ast.Name) or func.id not in FUNCTIONS or node.keywords:
        raise DimExprError(f"dim expression: only {'/'.join(FUNCTIONS)} may be called")
    low, high = _ARITY[func.id]
    count = len(node.args)
    if count < low or (high is not None and count > high):
        raise DimExprError(f"dim expression: {func.id} of {count} arguments")


def validate(text: str, names: Iterable[str]) -> None:
    """Check that ``text`` is a dim expression over ``names``.

    Raises
    ------
    DimExprError
        A syntax error, a construct outside the language, or a name not in ``names``.
    """
    _parse(text, frozenset(names))


def _parameters(names: Sequence[str]) -> list[str]:
    """Parameter names for ``names``: a name no text can read (a duplicate's earlier
    occurrence, which the later one hides, or a name that is no identifier) gets a placeholder."""
    last = {name: i for i, name in enumerate(names)}
    taken = set(names)
    params = []
    for i, name in enumerate(names):
        if last[name] == i and name.isidentifier() and not keyword.iskeyword(name):
            params.append(name)
            continue
        placeholder = f"_unread{i}"
        while placeholder in taken:
            placeholder += "_"
        taken.add(placeholder)
        params.append(placeholder)
    return params


@functools.lru_cache(maxsize=1024)
def _compiled(names: tuple[str, ...], texts: tuple[str, ...]) -> Any:
    """The code of ``lambda *names: (texts...)``, built from the checked syntax trees (the
    texts are never pasted into other source text)."""
    known = frozenset(names)
    bodies = [_parse(text, known) for text in texts]
    args = ast.arguments(
        posonlyargs=[],
        args=[ast.arg(arg=p) for p in _parameters(names)],
        kwonlyargs=[],
        kw_defaults=[],
        defaults=[],
    )
    tree = ast.Expression(ast.Lambda(args=args, body=ast.Tuple(elts=bodies, ctx=ast.Load())))
    return compile(ast.fix_missing_locations(tree), "<dim expressions>", "eval")


def compile_expressions(
    names: Sequence[str],
    texts: Sequence[str],
    functions: Mapping[str, Callable[..., Any]] | None = None,
) -> Callable[..., tuple]:
    """Validate ``texts`` and compile them into one function of the names' values.

    Parameters
    ----------
    names
        The names the texts read, in the order the function takes their values (a name given
        twice takes the later value).
    texts
        Dim expressions, e.g. ``"(32 * n)"``.
    functions
        What ``max``, ``min``, ``tdiv`` and ``tmod`` compute with; by default
        :data:`FUNCTIONS` (integers). Other values (a symbolic number type) need their own.

    Returns
    -------
    Callable
        ``f(*values) -> tuple``: the value of each text, in order. Values are used as given:
        pass Python integers (a NumPy integer would wrap around at 64 bits).

    Raises
    ------
    DimExprError
        When a text is not a dim expression over ``names`` (see :func:`validate`).
    """
    code = _compiled(tuple(names), tuple(texts))
    scope: dict[str, Any] = {"__builtins__": {}}
    scope.update(FUNCTIONS if functions is None else functions)
    # The only evaluation of dim expressions: the code was built from checked syntax trees
    # (integer arithmetic over the names and the four functions, nothing else).
    return eval(code, scope)  # noqa: S307


_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def substitute(text: str, replacements: Mapping[str, str]) -> str:
    """``text`` with each name in ``replacements`` replaced by its text, parenthesized.

    For example ``substitute("(v0 * 4)", {"v0": "b * s"}) == "((b * s) * 4)"``: a kernel's
    workspace written over its own reads, expressed in its caller's dims.
    """
    return _NAME.sub(
        lambda m: f"({replacements[m.group(0)]})" if m.group(0) in replacements else m.group(0),
        text,
    )

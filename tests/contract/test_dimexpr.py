"""Dim expressions: the language the compiler writes sizes in and the runtime evaluates."""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

import blade_relax
from blade_relax.contract.dimexpr import (
    FUNCTIONS,
    DimExprError,
    compile_expressions,
    substitute,
    tdiv,
    tmod,
    validate,
)


# --------------------------------------------------------------------------- semantics
def test_truncating_division_rounds_toward_zero_and_floor_division_down():
    assert (tdiv(-7, 2), tmod(-7, 2)) == (-3, -1)
    assert (tdiv(7, -2), tmod(7, -2)) == (-3, 1)
    assert (tdiv(-7, -2), tmod(-7, -2)) == (3, -1)
    assert compile_expressions([], ["-7 // 2", "-7 % 2", "7 // -2", "7 % -2"])() == (-4, 1, -4, -1)


@given(st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70).filter(bool))
def test_both_divisions_satisfy_the_division_identity(a, b):
    q, r = tdiv(a, b), tmod(a, b)
    assert a == q * b + r and abs(r) < abs(b) and (r == 0 or (r > 0) == (a > 0))
    assert q == int(Fraction(a, b))  # the exact quotient, truncated: no float rounding
    fq, fr = compile_expressions(["a", "b"], ["a // b", "a % b"])(a, b)
    assert a == fq * b + fr and (fr == 0 or (fr > 0) == (b > 0))


def test_both_kinds_agree_when_no_operand_is_negative():
    for a, b in itertools.product(range(0, 30), range(1, 9)):
        assert (tdiv(a, b), tmod(a, b)) == (a // b, a % b)


def test_division_by_zero_raises():
    with pytest.raises(ZeroDivisionError):
        compile_expressions(["s"], ["4 // s"])(0)
    with pytest.raises(ZeroDivisionError):
        tdiv(4, 0)


# --------------------------------------------------------------------------- evaluation
def test_one_function_evaluates_every_text_in_order():
    evaluate = compile_expressions(
        ["b", "s"],
        [
            "((b * s) * 4)",
            "max((s * 4), 16, b)",
            "min(b, s)",
            "tdiv((s - 9), 4)",
            "tmod((s - 9), 4)",
            "(s if (b < s) else b)",
            "((b == 2) and (not (s != 3)))",
            "(-s + 1)",
        ],
    )
    assert evaluate(2, 3) == (24, 16, 2, -1, -2, 3, True, -2)
    assert evaluate(5, 3) == (60, 16, 3, -1, -2, 5, False, -2)


def test_names_are_bound_by_position_and_a_repeated_name_takes_the_later_value():
    assert compile_expressions(["s", "b"], ["s", "b"])(1, 2) == (1, 2)
    assert compile_expressions(["s", "s"], ["s"])(1, 2) == (2,)
    # A name no text can spell (not an identifier) is accepted and never read.
    assert compile_expressions(["n.0", "s"], ["(s * 2)"])(7, 3) == (6,)


def test_values_are_exact_integers():
    big = 2**63
    assert compile_expressions(["s"], ["(s * s)"])(big) == (big * big,)


def test_other_number_types_bring_their_own_functions():
    calls = []

    def traced(name):
        def f(*args):
            calls.append(name)
            return FUNCTIONS[name](*(int(a) for a in args))

        return f

    functions = {name: traced(name) for name in FUNCTIONS}
    evaluate = compile_expressions(["s"], ["max(s, 3)", "tdiv(s, 2)"], functions)
    assert evaluate(Fraction(10)) == (10, 5)
    assert calls == ["max", "tdiv"]


@pytest.mark.parametrize(
    "bad",
    [
        "__import__('os')",  # not a function of the language
        "s.real",  # attribute
        "open(s)",
        "1.5 * s",  # a float
        "t + 1",  # an unknown name
        "s[0]",
        "lambda: s",
        "max(s)",  # too few arguments
        "tdiv(s, 2, 3)",
        "max(s, key=s)",
        "max + 1",  # a function as a value
        "s ** 2",
        "s / 2",  # true division
        "s), (open('x')",  # a text is one expression, never pasted into other source
        "s,",
        "",
    ],
)
def test_anything_outside_the_language_is_refused(bad):
    with pytest.raises(DimExprError):
        validate(bad, ["s"])
    with pytest.raises(ValueError):  # DimExprError is a ValueError
        compile_expressions(["s"], ["s", bad])


def test_substitute_replaces_whole_names_parenthesized():
    assert substitute("((v0 * 4) + max(v1, v10))", {"v0": "b * s", "v1": "s"}) == (
        "(((b * s) * 4) + max((s), v10))"
    )


def test_the_language_needs_nothing_but_the_standard_library():
    """The runtime and a user's tool read it without TVM, NumPy or the compiler."""
    # The contract package alone, past blade_relax's own __init__ (which loads TVM).
    code = (
        "import sys, types; "
        "pkg = types.ModuleType('blade_relax'); pkg.__path__ = [sys.argv[1]]; "
        "sys.modules['blade_relax'] = pkg; "
        "import blade_relax.contract.dimexpr, blade_relax.contract.remat_metadata; "
        "heavy = {'tvm', 'numpy', 'sympy', 'blade_relax.analysis', 'blade_relax.runtime'}; "
        "loaded = sorted(heavy & set(sys.modules)); "
        "sys.exit(' '.join(loaded) if loaded else 0)"
    )
    root = str(pathlib.Path(blade_relax.__file__).parent)
    run = subprocess.run(
        [sys.executable, "-c", code, root], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr or run.stdout

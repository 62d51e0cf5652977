"""The in-place reuse analysis's fallbacks (its verdicts are tested with PlanMemory's kernels in
tests/transform/plan/test_plan_memory.py)."""

import pytest

from blade_relax.analysis.inplace_reuse import _free_prim_vars


def test_extent_that_is_no_prim_expr_warns_and_binds_nothing():
    # A block iterator's extent is always a PrimExpr in valid TIR, so the fallback is reached
    # only by calling the helper with something else.
    with pytest.warns(
        UserWarning,
        match=r"^in-place analysis: the extents of block exp are read without bounds: "
        r"InternalError: ",
    ):
        assert _free_prim_vars("not an expression", "exp") == []

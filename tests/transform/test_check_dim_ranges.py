# ruff: noqa: E501, F841
"""CheckDimRanges: assertions on declared dim ranges, placed before any allocation or kernel.

Functions are written as the pass sees them in the pipeline: after ``RemovePurityChecking``
(``relax.force_pure``) and ``CallTIRRewrite``, or impure. Kernels are stubs: only their names
matter to ``main``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.pipeline import get_pipeline
from blade_relax.transform import CheckDimRanges, DimRangeOptions
from blade_relax.transform.check_dim_ranges import DimCheck, declared_dim_checks


def _check(mod: tvm.IRModule, options: DimRangeOptions | None = None) -> tvm.IRModule:
    return CheckDimRanges(options)(mod)


# fmt: off
@I.ir_module
class Bounded:
    @T.prim_func(private=True, s_tir=True)
    def exp(a: T.handle, b: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", "m"), "float32")) -> R.Tensor(("n", "m"), "float32"):
        R.func_attr({"relax.force_pure": True, "tir_var_lower_bound": {"n": 2, "m": 1}, "tir_var_upper_bound": {"n": 16}})
        n = T.int64()
        m = T.int64()
        cls = Bounded
        y = R.builtin.alloc_tensor(R.shape([n, m]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(x, y)
        return y


@I.ir_module
class BoundedChecked:
    @T.prim_func(private=True, s_tir=True)
    def exp(a: T.handle, b: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", "m"), "float32")) -> R.Tensor(("n", "m"), "float32"):
        R.func_attr({"blade_relax.checked_dims": ["n"], "relax.force_pure": True, "tir_var_lower_bound": {"n": 2, "m": 1}, "tir_var_upper_bound": {"n": 16}})
        n = T.int64()
        m = T.int64()
        cls = BoundedChecked
        R.call_packed("relax.run.assert_op", R.prim_value(T.And(n >= 2, n <= 16)), R.str("dim n = {} is outside its declared range [2, 16]"), R.prim_value(n), ty_args=R.Tuple())
        y = R.builtin.alloc_tensor(R.shape([n, m]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(x, y)
        return y
# fmt: on


def test_bounded_dim_is_asserted_first_and_lower_bound_of_one_is_not():
    tvm.ir.assert_structural_equal(_check(Bounded), BoundedChecked)


def test_pass_name_and_record_of_checked_dims():
    pass_obj = CheckDimRanges()
    assert pass_obj.info.name == "CheckDimRanges"
    pass_obj(Bounded)
    assert pass_obj.checked == {"main": ("n",)}


# fmt: off
@I.ir_module
class UpperOnly:
    @R.function(pure=False)
    def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((4, 4), "float32")):
        R.func_attr({"tir_var_upper_bound": {"s": 128, "b": 8}})
        b = T.int64()
        s = T.int64()
        y = R.call_packed("my.kernel", x, w, ty_args=R.Tensor((b, s, 4), "float32"))
        return y


@I.ir_module
class UpperOnlyChecked:
    @R.function(pure=False)
    def main(x: R.Tensor(("b", "s", 4), "float32"), w: R.Tensor((4, 4), "float32")):
        R.func_attr({"blade_relax.checked_dims": ["b", "s"], "tir_var_upper_bound": {"s": 128, "b": 8}})
        b = T.int64()
        s = T.int64()
        R.call_packed("relax.run.assert_op", R.prim_value(b <= 8), R.str("dim b = {} is outside its declared range (-inf, 8]"), R.prim_value(b), ty_args=R.Tuple())
        R.call_packed("relax.run.assert_op", R.prim_value(s <= 128), R.str("dim s = {} is outside its declared range (-inf, 128]"), R.prim_value(s), ty_args=R.Tuple())
        y = R.call_packed("my.kernel", x, w, ty_args=R.Tensor((b, s, 4), "float32"))
        return y
# fmt: on


def test_only_upper_bounds_in_an_impure_function():
    tvm.ir.assert_structural_equal(_check(UpperOnly), UpperOnlyChecked)


# fmt: off
@I.ir_module
class NoBounds:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        y = R.call_packed("my.kernel", x, ty_args=R.Tensor((n, 4), "float32"))
        return y


@I.ir_module
class LowerOneOnly:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32"), ks: R.Shape(["k"])):
        R.func_attr({"tir_var_lower_bound": {"n": 1, "k": 0}})
        n = T.int64()
        y = R.call_packed("my.kernel", x, ty_args=R.Tensor((n, 4), "float32"))
        return y
# fmt: on


@pytest.mark.parametrize("mod", [NoBounds, LowerOneOnly], ids=["no-bounds", "lower-0-or-1"])
def test_functions_without_a_range_to_check_are_unchanged(mod):
    pass_obj = CheckDimRanges()
    after = pass_obj(mod)
    tvm.ir.assert_structural_equal(after, mod)
    assert pass_obj.checked == {}


def test_last_result_says_what_changed_per_function():
    pass_obj = CheckDimRanges()
    once = pass_obj(Bounded)
    assert pass_obj.last_result["main"].changed
    assert pass_obj.last_result["main"].changes == ("1 dim checked (n)",)
    pass_obj(once)
    assert not pass_obj.last_result.changed
    assert pass_obj.last_result["main"].notes == ("already checked",)
    pass_obj(NoBounds)
    assert not pass_obj.last_result.changed and not pass_obj.last_result["main"].changed


def test_disabled_pass_changes_nothing():
    tvm.ir.assert_structural_equal(_check(Bounded, DimRangeOptions(enabled=False)), Bounded)
    tvm.ir.assert_structural_equal(_check(Bounded, DimRangeOptions(functions=("other",))), Bounded)


def test_running_twice_adds_nothing():
    once = _check(Bounded)
    tvm.ir.assert_structural_equal(_check(once), once)


# fmt: off
@I.ir_module
class WithIfAndCall:
    @R.function(pure=False)
    def helper(x: R.Tensor(("k", 4), "float32")) -> R.Tensor(("k", 4), "float32"):
        R.func_attr({"tir_var_upper_bound": {"k": 32}})
        k = T.int64()
        y = R.call_packed("my.kernel", x, ty_args=R.Tensor((k, 4), "float32"))
        return y

    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32"), flag: R.Tensor((), "bool")) -> R.Tensor(("n", 4), "float32"):
        R.func_attr({"tir_var_lower_bound": {"n": 3}, "tir_var_upper_bound": {"n": 32}})
        n = T.int64()
        cls = WithIfAndCall
        if flag:
            y = cls.helper(x)
            r = y
        else:
            r = x
        return r


@I.ir_module
class WithIfAndCallChecked:
    @R.function(pure=False)
    def helper(x: R.Tensor(("k", 4), "float32")) -> R.Tensor(("k", 4), "float32"):
        R.func_attr({"blade_relax.checked_dims": ["k"], "tir_var_upper_bound": {"k": 32}})
        k = T.int64()
        R.call_packed("relax.run.assert_op", R.prim_value(k <= 32), R.str("dim k = {} is outside its declared range (-inf, 32]"), R.prim_value(k), ty_args=R.Tuple())
        y = R.call_packed("my.kernel", x, ty_args=R.Tensor((k, 4), "float32"))
        return y

    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32"), flag: R.Tensor((), "bool")) -> R.Tensor(("n", 4), "float32"):
        R.func_attr({"blade_relax.checked_dims": ["n"], "tir_var_lower_bound": {"n": 3}, "tir_var_upper_bound": {"n": 32}})
        n = T.int64()
        cls = WithIfAndCallChecked
        R.call_packed("relax.run.assert_op", R.prim_value(T.And(n >= 3, n <= 32)), R.str("dim n = {} is outside its declared range [3, 32]"), R.prim_value(n), ty_args=R.Tuple())
        if flag:
            y = cls.helper(x)
            r = y
        else:
            r = x
        return r
# fmt: on


def test_function_with_if_and_calls():
    tvm.ir.assert_structural_equal(_check(WithIfAndCall), WithIfAndCallChecked)


# fmt: off
@I.ir_module
class MatchCastDim:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32"), shape: R.Shape(ndim=1)):
        R.func_attr({"tir_var_lower_bound": {"m": 2}, "tir_var_upper_bound": {"n": 64, "m": 8}})
        n = T.int64()
        m = T.int64()
        t = R.call_packed("my.kernel", x, ty_args=R.Tensor((n, 4), "float32"))
        s = R.match_cast(shape, R.Shape([m]))
        y = R.call_packed("my.kernel", t, s, ty_args=R.Tensor((m, 4), "float32"))
        return y


@I.ir_module
class MatchCastDimChecked:
    @R.function(pure=False)
    def main(x: R.Tensor(("n", 4), "float32"), shape: R.Shape(ndim=1)):
        R.func_attr({"blade_relax.checked_dims": ["n", "m"], "tir_var_lower_bound": {"m": 2}, "tir_var_upper_bound": {"n": 64, "m": 8}})
        n = T.int64()
        m = T.int64()
        R.call_packed("relax.run.assert_op", R.prim_value(n <= 64), R.str("dim n = {} is outside its declared range (-inf, 64]"), R.prim_value(n), ty_args=R.Tuple())
        t = R.call_packed("my.kernel", x, ty_args=R.Tensor((n, 4), "float32"))
        s = R.match_cast(shape, R.Shape([m]))
        R.call_packed("relax.run.assert_op", R.prim_value(T.And(m >= 2, m <= 8)), R.str("dim m = {} is outside its declared range [2, 8]"), R.prim_value(m), ty_args=R.Tuple())
        y = R.call_packed("my.kernel", t, s, ty_args=R.Tensor((m, 4), "float32"))
        return y
# fmt: on


def test_dim_defined_by_match_cast_is_checked_where_it_is_bound():
    tvm.ir.assert_structural_equal(_check(MatchCastDim), MatchCastDimChecked)


# fmt: off
@I.ir_module
class StillPure:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        R.func_attr({"tir_var_upper_bound": {"n": 16}})
        n = T.int64()
        with R.dataflow():
            y = R.exp(x)
            R.output(y)
        return y
# fmt: on


def test_function_still_checked_for_purity_is_left_unchanged_with_a_warning():
    with pytest.warns(UserWarning, match="after RemovePurityChecking"):
        after = _check(StillPure)
    tvm.ir.assert_structural_equal(after, StillPure)


@pytest.mark.parametrize(
    ("lower", "upper", "error"),
    [
        ({"n": 9}, {"n": 4}, "empty declared range"),
        ({"n": "many"}, None, "must map dim names to integers"),
    ],
)
def test_bad_range_attributes_are_a_clear_error(lower, upper, error):
    func = (
        Bounded["main"].without_attr("tir_var_upper_bound").with_attr("tir_var_lower_bound", lower)
    )
    if upper is not None:
        func = func.with_attr("tir_var_upper_bound", upper)
    with pytest.raises(ValueError, match=error):
        declared_dim_checks(func, "main")


def test_options_are_checked():
    with pytest.raises(TypeError, match="DimRangeOptions"):
        CheckDimRanges({"enabled": False})
    with pytest.raises(TypeError, match="tuple of names"):
        DimRangeOptions(functions="main")
    assert DimCheck("s", 2, 16).message == "dim s = {} is outside its declared range [2, 16]"
    assert DimCheck("s", 2, None).range_text == "[2, inf)"


# ----------------------------------------------------------------------------- in the pipeline
def _compile(mod: tvm.IRModule, **flags) -> relax.VirtualMachine:
    exe = tvm.compile(mod, "llvm", relax_pipeline=get_pipeline("llvm", **flags))
    return relax.VirtualMachine(exe, tvm.cpu())


# fmt: off
@I.ir_module
class ShapeParam:
    @R.function
    def main(x: R.Tensor(("n",), "float32"), ks: R.Shape(["k"])) -> R.Tensor(("n",), "float32"):
        R.func_attr({"tir_var_lower_bound": {"k": 2}, "tir_var_upper_bound": {"k": 4}})
        n = T.int64()
        k = T.int64()
        with R.dataflow():
            y = R.add(x, R.const(1.0, "float32"))
            R.output(y)
        return y
# fmt: on


def test_pipeline_checks_a_dim_of_a_shape_parameter_and_can_be_turned_off():
    x = tvm.runtime.tensor(np.zeros(3, "float32"))
    checked = _compile(ShapeParam, schedule=False, remat=False, plan=False)
    np.testing.assert_array_equal(checked["main"](x, tvm.runtime.ShapeTuple([3])).numpy(), 1.0)
    with pytest.raises(Exception, match=r"dim k = 5 is outside its declared range \[2, 4\]"):
        checked["main"](x, tvm.runtime.ShapeTuple([5]))
    unchecked = _compile(ShapeParam, check_dims=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = unchecked["main"](x, tvm.runtime.ShapeTuple([5]))
    np.testing.assert_array_equal(out.numpy(), 1.0)

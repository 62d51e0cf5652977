# ruff: noqa: E501, F841
"""PlanMemory: in-place reuse, sharing proven by ``>=``, refusals, and the stock fallback.

Before/Expected pairs compare the planned ``main``; the Expected modules declare the kernels as
stubs (only their names matter to ``main``). Kernels in Before carry real bodies: in-place
placement is decided from their access patterns.
"""

from __future__ import annotations

import dataclasses

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from blade_relax.analysis import memory_timeline
from blade_relax.analysis.inplace_reuse import inplace_verdict
from blade_relax.transform import PassFallbackWarning, PlanMemory, PlanOptions


def _plan(mod: tvm.IRModule, options: PlanOptions | None = None) -> tvm.IRModule:
    return PlanMemory(options)(mod)


def _assert_main_equal(actual: tvm.IRModule, expected: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(actual["main"], expected["main"], map_free_vars=True)


# ---------------------------------------------------------------------- kernels
# fmt: off
@I.ir_module
class Kernels:
    @T.prim_func(private=True, s_tir=True)
    def exp(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = T.exp(A[vi, vj])

    @T.prim_func(private=True, s_tir=True)
    def add(a: T.handle, b: T.handle, c: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        C = T.match_buffer(c, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vi, vj] + B[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def reverse(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("reverse"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, T.int64(3) - vj]

    @T.prim_func(private=True, s_tir=True)
    def rowsum(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(1)), "float32")
        for i, j, k in T.grid(n, T.int64(1), T.int64(4)):
            with T.sblock("rowsum"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    B[vi, vj] = T.float32(0)
                B[vi, vj] = B[vi, vj] + A[vi, vk]

    @T.prim_func(private=True, s_tir=True)
    def broadcast_add(a: T.handle, b: T.handle, c: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(1)), "float32")
        C = T.match_buffer(c, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("badd"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vi, vj] + B[vi, T.int64(0)]

    @T.prim_func(private=True, s_tir=True)
    def flatten_exp(a: T.handle, b: T.handle):
        # A reshape stage followed by an elementwise stage: element i of the output depends on
        # the input element at the same flat offset only.
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n * T.int64(4),), "float32")
        flat = T.sblock_alloc_buffer((n * T.int64(4),), "float32")
        for i in range(n * T.int64(4)):
            with T.sblock("flat"):
                vi = T.axis.spatial(n * T.int64(4), i)
                flat[vi] = A[vi // T.int64(4) % n, vi % T.int64(4)]
        for i in range(n * T.int64(4)):
            with T.sblock("exp"):
                vi = T.axis.spatial(n * T.int64(4), i)
                B[vi] = T.exp(flat[vi])

    @T.prim_func(private=True, s_tir=True)
    def split(a: T.handle, b: T.handle, c: T.handle):
        # A copy stage, then two halves: the first output element i depends on input element i,
        # but the second output reads input elements that the first may already overwrite.
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(8)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        C = T.match_buffer(c, (n, T.int64(4)), "float32")
        copy = T.sblock_alloc_buffer((n, T.int64(8)), "float32")
        for i, j in T.grid(n, T.int64(8)):
            with T.sblock("copy"):
                vi, vj = T.axis.remap("SS", [i, j])
                copy[vi, vj] = A[vi, vj]
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("lo"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = copy[vi, vj]
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("hi"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = copy[vi, vj + T.int64(4)]
# fmt: on


# ---------------------------------------------------------------------- access analysis
@pytest.mark.parametrize(
    ("kernel", "inputs", "output", "ok"),
    [
        ("exp", [0], 1, True),
        ("add", [0], 2, True),
        ("add", [0, 1], 2, True),  # the same tensor passed twice
        ("reverse", [0], 1, False),  # reads another element than it writes
        ("rowsum", [0], 1, False),  # reduction
        ("broadcast_add", [0], 2, True),
        ("broadcast_add", [1], 2, False),  # broadcast input: read by many output elements
        ("flatten_exp", [0], 1, True),  # flat offsets match through the intermediate
        ("split", [0], 1, False),  # the other output reads overwritten input
    ],
)
def test_inplace_verdict_reads_the_access_pattern(kernel, inputs, output, ok):
    verdict = inplace_verdict(Kernels[kernel], inputs, output)
    assert bool(verdict) is ok, verdict.reason


def test_inplace_verdict_refuses_pointer_access():
    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def opaque(a: T.handle, b: T.handle):
        A = T.match_buffer(a, (T.int64(4),), "float32")
        B = T.match_buffer(b, (T.int64(4),), "float32")
        for i in range(T.int64(4)):
            with T.sblock("copy"):
                vi = T.axis.spatial(T.int64(4), i)
                T.evaluate(T.call_extern("int32", "consume", T.address_of(A[vi])))
                B[vi] = A[vi]
    # fmt: on
    assert not inplace_verdict(opaque, [0], 1)


# ---------------------------------------------------------------------- in-place
def test_inplace_chain_of_elementwise_kernels():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            alloc = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, alloc)
            alloc1 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(alloc, alloc1)
            alloc2 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(alloc1, alloc2)
            return alloc2

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            storage = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
            alloc = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _ = cls.exp(x, alloc)
            # `alloc` dies at this call, which reads each element before overwriting it.
            alloc1 = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _1 = cls.exp(alloc, alloc1)
            # The function's result keeps its own allocation.
            alloc2 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(alloc1, alloc2)
            return alloc2
    # fmt: on
    pass_ = PlanMemory()
    after = pass_(Before)
    _assert_main_equal(after, Expected)
    assert pass_.plans["main"].inplace == (("alloc", "alloc1"),)
    assert pass_.plans["main"].refusals == {"alloc2": "part of the function's result"}


def test_inplace_refused_while_input_is_read_later_or_kernel_not_elementwise():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @T.prim_func(private=True, s_tir=True)
        def reverse(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("reverse"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = A[vi, T.int64(3) - vj]

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.handle, b: T.handle, c: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            C = T.match_buffer(c, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj] + B[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            alloc = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, alloc)
            alloc1 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(alloc, alloc1)
            alloc2 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.reverse(alloc1, alloc2)
            alloc3 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _3 = cls.add(alloc, alloc2, alloc3)
            return alloc3

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            T.evaluate(0)

        @T.prim_func(private=True, s_tir=True)
        def reverse(a: T.handle, b: T.handle):
            T.evaluate(0)

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.handle, b: T.handle, c: T.handle):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            storage = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
            alloc = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _ = cls.exp(x, alloc)
            # `alloc` is read again later: no in-place placement.
            storage1 = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
            alloc1 = R.memory.alloc_tensor(storage1, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _1 = cls.exp(alloc, alloc1)
            # `alloc1` dies here, but `reverse` reads other elements than it writes.
            storage2 = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
            alloc2 = R.memory.alloc_tensor(storage2, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _2 = cls.reverse(alloc1, alloc2)
            alloc3 = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _3 = cls.add(alloc, alloc2, alloc3)
            return alloc3
    # fmt: on
    pass_ = PlanMemory()
    _assert_main_equal(pass_(Before), Expected)
    assert pass_.plans["main"].inplace == ()


# ---------------------------------------------------------------------- sharing
# fmt: off
@I.ir_module
class ShrinkingChain:
    """``a: (n, 8)`` dies; ``c: (n, 4)`` is allocated later and may reuse its storage."""

    @T.prim_func(private=True, s_tir=True)
    def exp8(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(8)), "float32")
        B = T.match_buffer(b, (n, T.int64(8)), "float32")
        for i, j in T.grid(n, T.int64(8)):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = T.exp(A[vi, vj])

    @T.prim_func(private=True, s_tir=True)
    def fold(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(8)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("fold"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] + A[vi, vj + T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def reverse(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("reverse"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, T.int64(3) - vj]

    @R.function
    def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(("n", 4), "float32"):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = ShrinkingChain
        a = R.builtin.alloc_tensor(R.shape([n, 8]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _ = cls.exp8(x, a)
        b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _1 = cls.fold(a, b)
        c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _2 = cls.reverse(b, c)
        d = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _3 = cls.reverse(c, d)
        return d


@I.ir_module
class ShrinkingChainExpected:
    @T.prim_func(private=True, s_tir=True)
    def exp8(a: T.handle, b: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True, s_tir=True)
    def fold(a: T.handle, b: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True, s_tir=True)
    def reverse(a: T.handle, b: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(("n", 4), "float32"):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = ShrinkingChainExpected
        storage = R.memory.alloc_storage(R.shape([n * 32]), R.prim_value(0), R.str("global"), R.dtype("float32"))
        a = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 8]), R.dtype("float32"), R.prim_value(0))
        _ = cls.exp8(x, a)
        storage1 = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
        b = R.memory.alloc_tensor(storage1, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
        _1 = cls.fold(a, b)
        # 32 * n >= 16 * n for every n: `c` takes the storage `a` no longer needs.
        c = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
        _2 = cls.reverse(b, c)
        d = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _3 = cls.reverse(c, d)
        return d
# fmt: on


def test_sharing_proven_by_greater_or_equal():
    pass_ = PlanMemory()
    _assert_main_equal(pass_(ShrinkingChain), ShrinkingChainExpected)
    plan = pass_.plans["main"]
    assert [s.tensors for s in plan.storages] == [("a", "c"), ("b",)]
    assert plan.allocations == 3  # two storages and the result


def test_last_result_reports_sharing_and_the_timeline_peaks():
    pass_ = PlanMemory()
    after = pass_(ShrinkingChain)
    assert pass_.last_result.detail is pass_.plans
    main = pass_.last_result["main"]
    assert main.changed
    assert main.changes == ("3 tensors placed in 2 storages", "2 buffers share storage")
    # After planning, as the VM runs it: with the kills the next passes insert.
    lower = [relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse()]
    killed = tvm.transform.Sequential(lower)(after)
    for n in (1, 10, 1000):
        dims = {"n": n}
        assert main.evaluate(dims) == (
            memory_timeline(ShrinkingChain["main"], mod=ShrinkingChain).evaluate(dims).peak,
            memory_timeline(killed["main"], mod=killed).evaluate(dims).peak,
        )

    # fmt: off
    @I.ir_module
    class ResultOnly:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = ResultOnly
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            return a
    # fmt: on
    pass_(ResultOnly)
    assert not pass_.last_result.changed and not pass_.last_result["main"].changed


def test_sharing_off_gives_one_storage_per_tensor():
    pass_ = PlanMemory(PlanOptions(share=False, inplace=False))
    pass_(ShrinkingChain)
    assert [s.tensors for s in pass_.plans["main"].storages] == [("a",), ("b",), ("c",)]


# fmt: off
@I.ir_module
class TwoLengths:
    """``a: (n, 8)`` dies before ``c: (m, 4)``: 32n and 16m are not ordered."""

    @T.prim_func(private=True, s_tir=True)
    def exp8(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(8)), "float32")
        B = T.match_buffer(b, (n, T.int64(8)), "float32")
        for i, j in T.grid(n, T.int64(8)):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = T.exp(A[vi, vj])

    @T.prim_func(private=True, s_tir=True)
    def fold(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(8)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("fold"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] + A[vi, vj + T.int64(4)]

    @T.prim_func(private=True, s_tir=True)
    def reverse(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n, T.int64(4)), "float32")
        B = T.match_buffer(b, (n, T.int64(4)), "float32")
        for i, j in T.grid(n, T.int64(4)):
            with T.sblock("reverse"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, T.int64(3) - vj]

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor(("m", 4), "float32")) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("m", 4), "float32")):
        n = T.int64()
        m = T.int64()
        R.func_attr({"relax.force_pure": True, "tir_var_upper_bound": {"n": 16, "m": 16}})
        cls = TwoLengths
        a = R.builtin.alloc_tensor(R.shape([n, 8]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _ = cls.exp8(x, a)
        b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _1 = cls.fold(a, b)
        c = R.builtin.alloc_tensor(R.shape([m, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _2 = cls.reverse(y, c)
        d = R.builtin.alloc_tensor(R.shape([m, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _3 = cls.reverse(c, d)
        return (b, d)


@I.ir_module
class TwoLengthsExpected:
    @T.prim_func(private=True, s_tir=True)
    def exp8(a: T.handle, b: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True, s_tir=True)
    def fold(a: T.handle, b: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True, s_tir=True)
    def reverse(a: T.handle, b: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor(("m", 4), "float32")) -> R.Tuple(R.Tensor(("n", 4), "float32"), R.Tensor(("m", 4), "float32")):
        n = T.int64()
        m = T.int64()
        R.func_attr({"relax.force_pure": True, "tir_var_upper_bound": {"n": 16, "m": 16}})
        cls = TwoLengthsExpected
        # Sized by the symbolic expression, not by the upper bounds (16 * 8 * 4 bytes).
        storage = R.memory.alloc_storage(R.shape([n * 32]), R.prim_value(0), R.str("global"), R.dtype("float32"))
        a = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 8]), R.dtype("float32"), R.prim_value(0))
        _ = cls.exp8(x, a)
        b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _1 = cls.fold(a, b)
        # compare(32n, 16m) is UNKNOWN: `c` may not reuse `a`'s storage as it is.
        storage1 = R.memory.alloc_storage(R.shape([m * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
        c = R.memory.alloc_tensor(storage1, R.prim_value(0), R.shape([m, 4]), R.dtype("float32"), R.prim_value(0))
        _2 = cls.reverse(y, c)
        d = R.builtin.alloc_tensor(R.shape([m, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        _3 = cls.reverse(c, d)
        return (b, d)
# fmt: on


def test_sharing_refused_when_sizes_are_not_ordered():
    pass_ = PlanMemory(PlanOptions(grow=False))
    _assert_main_equal(pass_(TwoLengths), TwoLengthsExpected)


def test_growth_refused_when_it_would_raise_the_peak():
    # Growing `a`'s storage to max(32n, 16m) for `c` would keep 32n bytes where `c` needs 16m
    # while the result `d` is allocated, the peak for n > m / 2. With n, m <= 16 every admissible
    # (n, m) is checked, and the growth is refused.
    pass_ = PlanMemory()
    pass_(TwoLengths)
    plan = pass_.plans["main"]
    assert plan.exhaustive
    assert [s.tensors for s in plan.storages] == [("a",), ("c",)]


def test_storage_grows_to_the_max_of_its_tensors():
    # Without the peak check, `c` reuses `a`'s storage, whose size becomes a run-time max.
    pass_ = PlanMemory(PlanOptions(peak_safe=False))
    after = pass_(TwoLengths)
    assert [s.tensors for s in pass_.plans["main"].storages] == [("a", "c")]
    size = after["main"].body.blocks[0].bindings[0].value.args[0].values[0]
    assert isinstance(size, tvm.tirx.Max), size
    assert {str(size.a), str(size.b)} == {"n * T.int64(32)", "m * T.int64(16)"}


@pytest.mark.parametrize(
    "options", [PlanOptions(max_grid_points=16), PlanOptions(max_grid_cells=16)]
)
def test_smaller_grid_leaves_the_rest_of_the_range_to_symbolic_proofs(options):
    # n, m <= 16: the 256 points are checked one by one by default (see above). A grid of 16
    # points (or of 16 points x allocation points) covers n, m <= 4; the symbolic proofs over
    # the rest of the range refuse the growth as well.
    pass_ = PlanMemory(options)
    pass_(TwoLengths)
    plan = pass_.plans["main"]
    assert not plan.exhaustive
    assert [s.tensors for s in plan.storages] == [("a",), ("c",)]


def test_sharing_that_adds_bytes_refused_without_proof_budget():
    # `c` in `a`'s storage holds 32n bytes where `c` needs 16n: within the peak, but with n
    # unbounded only a symbolic comparison proves it, and max_proofs=0 allows none.
    pass_ = PlanMemory(PlanOptions(max_proofs=0))
    pass_(ShrinkingChain)
    assert [s.tensors for s in pass_.plans["main"].storages] == [("a",), ("b",), ("c",)]


# ---------------------------------------------------------------------- refusals
def test_view_keeps_storage_alive():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.handle, b: T.handle, c: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            C = T.match_buffer(c, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("add"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj] + B[vi, vj]

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            v = R.reshape(a, R.shape([n, 4]))
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(x, b)
            c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.add(v, b, c)
            return c
    # fmt: on
    pass_ = PlanMemory()
    pass_(Before)
    storages = [s.tensors for s in pass_.plans["main"].storages]
    # `a` is dead after the reshape, but its view `v` is read by the last kernel: `b` may not
    # take its storage.
    assert storages == [("a",), ("b",)]


def test_inplace_refused_through_a_view_at_an_offset():
    # `v` starts 16 bytes into `a`'s storage: element i of `v` is not element i of the storage,
    # so writing `b` over it element for element would clobber elements `exp` has yet to read.
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n - 1", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            v = R.memory.view(a, R.shape([n - 1, 4]), R.dtype("float32"), R.prim_value(16))
            b = R.builtin.alloc_tensor(R.shape([n - 1, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(v, b)
            c = R.builtin.alloc_tensor(R.shape([n - 1, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(b, c)
            return c
    # fmt: on
    pass_ = PlanMemory()
    pass_(Before)
    plan = pass_.plans["main"]
    assert plan.inplace == ()
    assert [s.tensors for s in plan.storages] == [("a",), ("b",)]


def test_tensors_reaching_packed_calls_or_marked_keep_their_storage():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function(pure=False)
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"blade_relax.no_plan": ["b"]})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            _k = R.call_packed("test.keep", a, ty_args=R.Object)
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(a, b)
            c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(b, c)
            d = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _3 = cls.exp(c, d)
            return d
    # fmt: on
    pass_ = PlanMemory()
    after = pass_(Before)
    plan = pass_.plans["main"]
    assert plan.refusals["a"] == "passed to the packed function test.keep"
    assert plan.refusals["b"].startswith("marked as not plannable")
    assert [s.tensors for s in plan.storages] == [("c",)]
    ops = [
        b.value.op.name
        for b in after["main"].body.blocks[0].bindings
        if isinstance(b.value.op, tvm.ir.Op)
    ]
    assert ops.count("relax.builtin.alloc_tensor") == 3  # a, b and the result d


def test_trusted_packed_functions_leave_their_arguments_plannable():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function(pure=False)
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            _r = R.call_packed("test.read", a, ty_args=R.Object)
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(a, b)
            c = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(b, c)
            return c
    # fmt: on
    pass_ = PlanMemory()
    pass_(Before)
    plan = pass_.plans["main"]
    assert plan.refusals["a"] == "passed to the packed function test.read"
    assert [s.tensors for s in plan.storages] == [("b",)]

    # Trusted to neither keep nor alias `a`: it is planned, and `b` is written over it.
    pass_ = PlanMemory(PlanOptions(trusted_packed=("test.read",)))
    pass_(Before)
    plan = pass_.plans["main"]
    assert "a" not in plan.refusals
    assert [s.tensors for s in plan.storages] == [("a", "b")]
    assert plan.inplace == (("a", "b"),)


def test_evicted_tensors_keep_their_storage_and_regenerate_arguments_stay_planned():
    # The runtime rematerialization protocol: `x` handed to `evict` must own its storage; the
    # tensor `regenerate` returns extends `x`'s lifetime; `regenerate` only reads `y`. Once
    # `regenerate` returned, only the VM holds `x1`: `w` is written over it where it dies.
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function(pure=False)
        def main(x0: R.Tensor(("n", 4), "float32"), frame: R.Object) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            cls = Before
            x = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x0, x)
            y = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(x, y)
            _e = R.call_builtin_with_ctx("blade_relax.evict", (frame, R.prim_value(0), x), ty_args=R.Object)
            z = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.exp(y, z)
            x1 = R.call_packed("blade_relax.regenerate", frame, R.prim_value(0), y, ty_args=R.Tensor((n, 4), "float32"))
            w = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _3 = cls.exp(x1, w)
            out = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _4 = cls.exp(w, out)
            return out
    # fmt: on
    pass_ = PlanMemory()
    after = pass_(Before)
    plan = pass_.plans["main"]
    assert plan.refusals["x"] == "handed to the runtime for eviction"
    placed = {t for s in plan.storages for t in s.tensors}
    assert {"y", "z"} <= placed and not {"x", "w"} & placed
    assert ("x1", "w") in plan.inplace
    values = {b.var.name: b.value for blk in after["main"].body.blocks for b in blk.bindings}
    assert isinstance(values["w"], relax.Var) and values["w"].name == "x1"
    # Without in-place placements `w` gets a storage of its own like any other tensor.
    pass_ = PlanMemory(PlanOptions(inplace=False))
    pass_(Before)
    assert "w" in {t for s in pass_.plans["main"].storages for t in s.tensors}


def test_nothing_provable_is_left_to_stock_planner():
    # Sizes built from an operation the symbolic engine does not model: nothing can be proven,
    # so the function is planned exactly as StaticPlanBlockMemory plans it.
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def copy(a: T.handle, b: T.handle):
            k = T.int64()
            A = T.match_buffer(a, (k,), "float32")
            B = T.match_buffer(b, (k,), "float32")
            for i in range(k):
                with T.sblock("copy"):
                    vi = T.axis.spatial(k, i)
                    B[vi] = A[vi]

        @R.function
        def main(x: R.Tensor(("n",), "float32")) -> R.Tensor(("n",), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([T.bitwise_and(n, 7)]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.copy(x, a)
            b = R.builtin.alloc_tensor(R.shape([T.bitwise_and(n, 7)]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.copy(a, b)
            c = R.builtin.alloc_tensor(R.shape([T.bitwise_and(n, 7)]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _2 = cls.copy(b, c)
            return x
    # fmt: on
    pass_ = PlanMemory()
    with pytest.warns(UserWarning, match="unsupported PrimExpr"):
        after = pass_(Before)
    assert pass_.plans["main"].mode == "stock"
    tvm.ir.assert_structural_equal(after, relax.transform.StaticPlanBlockMemory()(Before))


def test_stock_planning_at_the_upper_bound_only_when_asked():
    # A dynamic function output is left to StaticPlanBlockMemory, which plans every storage of
    # the function at `tir_var_upper_bound` when it sees it (n <= 16: 16 * 4 * 4 bytes).
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True, "relax.memory_plan_dynamic_func_output": True, "tir_var_upper_bound": {"n": 16}})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(a, b)
            return b
    # fmt: on

    def storage_sizes(options: PlanOptions) -> list:
        pass_ = PlanMemory(options)
        after = pass_(Before)
        assert pass_.plans["main"].mode == "stock"
        return [
            b.value.args[0].values[0]
            for b in after["main"].body.blocks[0].bindings
            if b.value.op.same_as(tvm.ir.Op.get("relax.memory.alloc_storage"))
        ]

    sizes = storage_sizes(PlanOptions())
    assert len(sizes) == 2 and not any(isinstance(s, tvm.tirx.IntImm) for s in sizes), sizes
    assert [int(s) for s in storage_sizes(PlanOptions(plan_at_upper_bound=True))] == [256, 256]


def test_release_of_tuples_read_only_through_items():
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            t = (a,)
            a0 = t[0]
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(a0, b)
            return b

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            storage = R.memory.alloc_storage(R.shape([n * 16]), R.prim_value(0), R.str("global"), R.dtype("float32"))
            a = R.memory.alloc_tensor(storage, R.prim_value(0), R.shape([n, 4]), R.dtype("float32"), R.prim_value(0))
            _ = cls.exp(x, a)
            t = (a,)
            a0 = t[0]
            # KillAfterLastUse would never kill `t` (its item access is canonicalized away),
            # holding `a` until the function returns.
            _2 = R.vm.kill_object(t)
            b = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _1 = cls.exp(a0, b)
            return b
    # fmt: on
    _assert_main_equal(PlanMemory()(Before), Expected)
    kept = PlanMemory(PlanOptions(release_tuples=False))(Before)
    assert "kill_object" not in kept["main"].script()


def test_unsupported_ir_passes_through():
    # An allocation used inside an If is not planned; the pass neither crashes nor changes it.
    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def exp(a: T.handle, b: T.handle):
            n = T.int64()
            A = T.match_buffer(a, (n, T.int64(4)), "float32")
            B = T.match_buffer(b, (n, T.int64(4)), "float32")
            for i, j in T.grid(n, T.int64(4)):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.exp(A[vi, vj])

        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), cond: R.Prim("bool")) -> R.Tensor(("n", 4), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a = R.builtin.alloc_tensor(R.shape([n, 4]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            _ = cls.exp(x, a)
            if cond:
                r = a
            else:
                r = x
            return r
    # fmt: on
    pass_ = PlanMemory()
    after = pass_(Before)
    tvm.ir.assert_structural_equal(after["main"], Before["main"])
    assert (
        "If" in pass_.plans["main"].refusals["a"] or "result" in pass_.plans["main"].refusals["a"]
    )


def test_unreadable_shapes_warn_and_are_left_to_stock_planner():
    # An empty range (lower bound above the upper bound): the shape graph refuses it.
    before = ShrinkingChain.clone()
    before["main"] = (
        ShrinkingChain["main"]
        .with_attr("tir_var_lower_bound", {"n": 8})
        .with_attr("tir_var_upper_bound", {"n": 4})
    )
    pass_ = PlanMemory()
    with pytest.warns(
        PassFallbackWarning,
        match=r"^PlanMemory: allocations left unchanged for main \(StaticPlanBlockMemory plans "
        r"them\): ValueError: dim 'n': empty range \[8, 4\]",
    ):
        pass_(before)
    assert pass_.plans["main"].mode == "stock"


def test_pass_identity_and_option_errors():
    pass_ = PlanMemory()
    assert pass_.info.name == "PlanMemory"
    with pytest.raises(TypeError, match="PlanOptions"):
        PlanMemory({"share": False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanOptions().share = False  # type: ignore[misc]


def test_unreadable_parameter_type_warns_and_is_left_unknown():
    """A type TVM's shape-var helper rejects: a PlanMemory fallback warning, no shape vars."""
    from blade_relax.transform.plan._collect import _tir_vars_in_type

    with pytest.warns(PassFallbackWarning, match="PlanMemory: the shape vars of a parameter"):
        assert _tir_vars_in_type("not a type") == []


def test_block_maxima_answer_range_maxima_after_updates():
    """The placement screen's range maxima (by blocks of rows) equal numpy's on the updated
    array, for ranges inside one block, across blocks, and on block edges."""
    import numpy as np

    from blade_relax.transform.plan._peak import _BlockMax

    rng = np.random.default_rng(3)
    live = rng.integers(0, 1000, (101, 4))
    blocks = _BlockMax(live, block=8)
    for step in range(2000):
        a = int(rng.integers(0, 100))
        b = int(rng.integers(a + 1, 102))
        if step % 3 == 0:
            live[a:b] += rng.integers(-9, 9, 4)
            blocks.refresh(a, b)
        np.testing.assert_array_equal(blocks.max(a, b), live[a:b].max(axis=0))

"""Kernel workspaces: the description read from the lowered kernel, the timeline holding it
while the kernel runs, and the VM's measured peak equal to the prediction."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import blade_relax  # noqa: F401  (installs the runtime accounting)
from blade_relax.analysis import (
    ShapeRead,
    call_workspace,
    compile_keeping_module,
    kernel_workspace,
    kernel_workspaces,
    memory_timeline,
)
from blade_relax.contract.dimexpr import compile_expressions
from blade_relax.pipeline import lower_to_memory_stage, stock_pipeline
from blade_relax.runtime import measure_memory
from blade_relax.symbolic import ShapeGraph, SymbolicExpr


@I.ir_module
class Scratch:
    """A kernel with an intermediate global buffer of symbolic size: ``(n, 8)`` floats."""

    @T.prim_func(s_tir=True)
    def exp_pairs(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        scratch = T.alloc_buffer((n, 8), "float32")
        for i, j in T.grid(n, 8):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                scratch[vi, vj] = T.exp(X[vi, vj % 4])
        for i, j in T.grid(n, 4):
            with T.sblock("pair"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = scratch[vi, vj] + scratch[vi, vj + 4]

    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        cls = Scratch
        with R.dataflow():
            y = R.call_tir(cls.exp_pairs, (x,), out_ty=R.Tensor((n, 4), "float32"))
            R.output(y)
        return y


@I.ir_module
class NoScratch:
    """The same call without an intermediate."""

    @T.prim_func(s_tir=True)
    def exp4(x: T.handle, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n, 4), "float32")
        Y = T.match_buffer(y, (n, 4), "float32")
        for i, j in T.grid(n, 4):
            with T.sblock("exp"):
                vi, vj = T.axis.remap("SS", [i, j])
                Y[vi, vj] = T.exp(X[vi, vj])

    @R.function
    def main(x: R.Tensor(("n", 4), "float32")):
        n = T.int64()
        cls = NoScratch
        with R.dataflow():
            y = R.call_tir(cls.exp4, (x,), out_ty=R.Tensor((n, 4), "float32"))
            R.output(y)
        return y


def _constant_scratch(elements: int) -> tvm.tirx.PrimFunc:
    """A kernel with a constant-size ``elements``-float intermediate."""

    @T.prim_func(s_tir=True)
    def copy_through(x: T.Buffer((elements,), "float32"), y: T.Buffer((elements,), "float32")):
        scratch = T.alloc_buffer((elements,), "float32")
        for i in range(elements):
            with T.sblock("in"):
                vi = T.axis.remap("S", [i])
                scratch[vi] = x[vi] * T.float32(2)
        for i in range(elements):
            with T.sblock("out"):
                vi = T.axis.remap("S", [i])
                y[vi] = scratch[elements - 1 - vi]

    return copy_through


LENGTHS = (1, 7, 100, 1000)


def _run(compiled, n, *, count_workspaces=True):
    vm = relax.VirtualMachine(compiled.executable, tvm.cpu())
    table = compiled.workspaces
    x = tvm.runtime.tensor(np.linspace(-1, 1, n * 4, dtype="float32").reshape(n, 4))
    with measure_memory(vm, workspaces=table if count_workspaces else None) as measured:
        out = vm["main"](x)
    return out.numpy(), measured


# ----------------------------------------------------------------------------- description
def test_scratch_buffer_is_described_over_the_kernels_argument_shapes():
    ws = kernel_workspace(Scratch["exp_pairs"], "exp_pairs")
    assert ws.kernel == "exp_pairs" and ws.exact
    assert ws.reads == (ShapeRead(param=0, dim=0, name="n"),)
    assert [a.buffer for a in ws.allocations] == ["scratch"]
    assert ws.allocations[0].device_type == tvm.cpu().dlpack_device_type()
    for n in LENGTHS:
        assert ws.evaluate([n]) == n * 8 * 4
        x = tvm.runtime.tensor(np.zeros((n, 4), "float32"))
        assert ws.nbytes_of([x, x]) == n * 8 * 4
    # Symbolically, and as text over another expression (a caller's dims).
    assert ws.evaluate([SymbolicExpr.dim("s")]) == SymbolicExpr.dim("s") * 32
    assert compile_expressions(["m"], [ws.substitute(["2 * m"])])(5) == (10 * 32,)


def test_kernel_without_intermediates_has_no_workspace():
    ws = kernel_workspace(NoScratch["exp4"], "exp4")
    assert ws.is_empty and ws.formula == "0" and ws.exact
    assert ws.nbytes_of([]) == 0
    assert kernel_workspaces(NoScratch) == {}
    assert set(kernel_workspaces(Scratch)) == {"exp_pairs"}


@pytest.mark.parametrize("elements, expected", [(255, 0), (256, 1024), (1000, 4000)])
def test_small_constant_scratch_stays_on_the_stack(elements, expected):
    """On a CPU target TVM keeps constant-size allocations under 1024 bytes on the stack
    (``kMaxStackAlloca`` in ``LowerTVMBuiltin``): only larger ones are heap workspace."""
    ws = kernel_workspace(_constant_scratch(elements), "copy_through", "llvm")
    assert ws.evaluate([]) == expected
    assert ws.reads == ()


def test_call_site_maps_the_kernels_dims_to_the_callers():
    main = Scratch["main"]
    graph = ShapeGraph.from_function(main)
    binding = main.body.blocks[0].bindings[0]
    ws = call_workspace(binding.value, binding.var, Scratch, graph)
    assert graph.evaluate(ws, {"n": 9}) == 9 * 32
    # The lowered call (a direct call of the kernel with the output as an argument) too.
    low = lower_to_memory_stage(Scratch)
    lowered_main = low["main"]
    graph = ShapeGraph.from_function(lowered_main)
    calls = [
        b
        for block in lowered_main.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)
    ]
    (call,) = calls
    assert graph.evaluate(call_workspace(call.value, call.var, low, graph), {"n": 9}) == 9 * 32
    # Not a kernel call: no workspace to speak of.
    assert call_workspace(relax.op.add(call.var, call.var), call.var, low, graph) is None


# ----------------------------------------------------------------------------- timeline
def test_timeline_holds_the_workspace_while_the_kernel_runs():
    timeline = memory_timeline(Scratch["main"], mod=Scratch)
    assert timeline.stage == "lowered"  # call_tir: the call allocates its output
    n = 10
    at = timeline.evaluate({"n": n})
    # The output (16n bytes) is allocated by the call; the scratch (32n) lives only during it.
    assert at.live_during == [16 * n + 32 * n]
    assert at.live_after == [16 * n]
    assert at.workspace == [32 * n] and at.peak_workspace == 32 * n
    assert timeline.graph.evaluate(timeline.peak, {"n": n}) == 48 * n
    # Without the module (or with workspaces off) the kernel's scratch is not seen.
    assert memory_timeline(Scratch["main"]).evaluate({"n": n}).peak == 16 * n
    off = memory_timeline(Scratch["main"], mod=Scratch, workspaces=False)
    assert off.evaluate({"n": n}).peak == 16 * n


def test_workspace_is_part_of_the_working_set():
    timeline = memory_timeline(Scratch["main"], mod=Scratch)
    assert timeline.evaluate({"n": 10}).lower_bound == 16 * 10 * 2 + 32 * 10


@pytest.mark.parametrize("n", LENGTHS)
def test_memory_stage_prediction_equals_the_measured_peak(n):
    low = lower_to_memory_stage(Scratch)
    predicted = memory_timeline(low["main"], mod=low).evaluate({"n": n})
    assert predicted.peak == 48 * n and predicted.peak_workspace == 32 * n
    compiled = compile_keeping_module(Scratch, "llvm", stock_pipeline("llvm"))
    out, measured = _run(compiled, n)
    assert measured.peak_bytes == predicted.peak
    assert measured.workspace_bytes == 32 * n
    # The same call without the table: only the VM's own allocation (the blind spot).
    same, blind = _run(compiled, n, count_workspaces=False)
    assert blind.peak_bytes == 16 * n and blind.workspace_bytes == 0
    assert np.array_equal(out, same)


def test_kernel_without_intermediates_adds_nothing_measured():
    compiled = compile_keeping_module(NoScratch, "llvm", stock_pipeline("llvm"))
    assert compiled.workspaces == {}
    low = lower_to_memory_stage(NoScratch)
    timeline = memory_timeline(low["main"], mod=low)
    for n in LENGTHS:
        _, measured = _run(compiled, n)
        assert measured.peak_bytes == timeline.evaluate({"n": n}).peak == 16 * n
        assert measured.workspace_bytes == 0


# ----------------------------------------------------------------------------- stock TVM
@I.ir_module
class Attention:
    @R.function
    def main(x: R.Tensor((1, 4, "s", "s"), "float32")):
        with R.dataflow():
            p = R.nn.softmax(x, axis=-1)
            y = R.multiply(p, p)
            R.output(y)
        return y


def test_stock_softmax_counts_its_exponentials():
    """TVM's legalized and fused softmax keeps ``T_softmax_exp`` (1, 4, s, s) inside the
    kernel: the stock executable's peak includes it, predicted and measured alike."""
    compiled = compile_keeping_module(Attention, "llvm", stock_pipeline("llvm"))
    exe, table = compiled.executable, compiled.workspaces
    low = lower_to_memory_stage(Attention)
    (name, ws), *_ = kernel_workspaces(low).items()
    assert "softmax" in name and name in table
    buffers = [a.buffer for a in ws.allocations]
    assert "T_softmax_exp" in buffers
    timeline = memory_timeline(low["main"], mod=low)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for s in (20, 57, 256):
        x = tvm.runtime.tensor(np.random.default_rng(s).random((1, 4, s, s), "float32"))
        with measure_memory(vm, workspaces=table) as measured:
            out = vm["main"](x)
        del out
        predicted = timeline.evaluate({"s": s})
        # The output, the exponentials (4 s^2 floats) and the row maxima/sums (4 s floats; the
        # lowering reuses one buffer for both, and computes the normalized values in place).
        assert measured.peak_bytes == predicted.peak == 16 * s * s + 16 * s * s + 16 * s
        assert measured.workspace_bytes == predicted.peak_workspace == 16 * s * s + 16 * s
    assert measured.workspace_bytes == 1_052_672  # 1 MiB of exponentials at s = 256


def test_report_shows_the_workspace_in_the_peak():
    from blade_relax.analysis import MemoryReport

    report = MemoryReport.from_function(Scratch["main"], {"n": 10}, mod=Scratch)
    assert report.summary()["peak_workspace_bytes"] == 320
    assert [r["workspace_bytes"] for r in report.rows()] == [320]
    assert "320 B of it kernel workspace" in report.to_text()


def test_cuda_kernels_scheduled_by_dlight_keep_the_softmax_on_chip():
    """Built for CUDA (no GPU needed), the stock pipeline's dlight schedule keeps the softmax's
    intermediates in shared and local memory: no heap workspace is left to count."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("this TVM has no CUDA code generator")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    compiled = compile_keeping_module(Attention, target, stock_pipeline(target))
    kernels = [gv for gv, f in compiled.module.functions.items() if "softmax" in gv.name_hint]
    assert kernels
    assert compiled.workspaces == {}
    ws = kernel_workspace(compiled.module[kernels[0]], kernels[0].name_hint, target)
    assert ws.is_empty and ws.exact

"""PlanMemory end to end: numerics and measured peak bytes against stock planning.

Every built-in dynamic model is compiled four ways: without any memory planning (each tensor in
its own storage), with stock ``StaticPlanBlockMemory`` (upper bounds dropped, and kept), and with
``PlanMemory``. At three lengths the planned program must compute exactly what the unplanned
one computes, and its peak, as the runtime accounting measures it, must not exceed either stock
plan's. Allocation counts per call are recorded for the report.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.frontend import flatten_outputs, set_dim_bounds
from blade_relax.frontend.builtin import BUILTIN_MODELS, random_arguments
from blade_relax.pipeline import get_pipeline, stock_pipeline
from blade_relax.runtime import memory_stats, reset_memory_stats
from blade_relax.transform import PlanOptions

LENGTHS = (3, 17, 64)
UPPER = 64
# PlanMemory alone among the memory passes, the GEMMs on TVM's kernels: the planned program
# computes bit for bit what the unplanned one computes (ATen's GEMMs agree to rounding only).
PLAN_ONLY = {"schedule": False, "remat": False, "plan": True, "dispatch_gemm": False}


def _unplanned_pipeline(target: str = "llvm") -> tvm.transform.Pass:
    """The stock pipeline without StaticPlanBlockMemory: every tensor gets its own storage."""
    return stock_pipeline(target, plan_memory=False)


def _vm(mod: tvm.IRModule, pipeline: tvm.transform.Pass) -> relax.VirtualMachine:
    return relax.VirtualMachine(tvm.compile(mod, "llvm", relax_pipeline=pipeline), tvm.cpu())


def _run(vm: relax.VirtualMachine, args: list[np.ndarray]) -> tuple[list[np.ndarray], int, int]:
    inputs = [tvm.runtime.tensor(a) for a in args]
    reset_memory_stats()
    before = memory_stats()["live_bytes"]
    out = vm["main"](*inputs)
    stats = memory_stats()
    return (
        [o.numpy() for o in flatten_outputs(out)],
        stats["peak_bytes"] - before,
        stats["allocations"],
    )


def _dims_of(mod: tvm.IRModule) -> list[str]:
    names: dict[str, None] = {}
    for param in mod["main"].params:
        for var in relax.analysis.tir_vars_in_type(param.ty):
            names.setdefault(var.name, None)
    return list(names)


@pytest.mark.parametrize("model", ["mlp", "attention", "layer-norm", "mlp-train"])
def test_planned_matches_unplanned_and_never_exceeds_stock(model, record_property):
    mod = BUILTIN_MODELS[model]()
    dims = _dims_of(mod)
    bounded = set_dim_bounds(mod, upper={d: UPPER for d in dims})
    vms = {
        "unplanned": _vm(mod, _unplanned_pipeline()),
        "stock-dynamic": _vm(mod, stock_pipeline("llvm")),
        "stock-bounded": _vm(bounded, stock_pipeline("llvm")),
        "plan": _vm(bounded, get_pipeline("llvm", **PLAN_ONLY)),
    }
    report = {}
    for length in LENGTHS:
        args = random_arguments(mod["main"], {d: length for d in dims}, seed=length)
        results = {name: _run(vm, args) for name, vm in vms.items()}
        reference = results["unplanned"][0]
        planned, peak, allocations = results["plan"]
        assert len(planned) == len(reference)
        for got, want in zip(planned, reference):
            np.testing.assert_array_equal(got, want)
        assert peak <= results["stock-dynamic"][1], (length, results)
        assert peak <= results["stock-bounded"][1], (length, results)
        report[length] = {name: {"peak": r[1], "allocations": r[2]} for name, r in results.items()}
        # Allocation calls per call: never more than one per tensor.
        assert allocations <= results["unplanned"][2]
    record_property("plan_memory", report)


def test_greedy_sharing_and_growth_keep_numerics():
    # Greedy best fit with Max-sized storages (no peak check) exercises run-time evaluated
    # storage sizes; the numbers must still be exactly those of the unplanned program.
    mod = BUILTIN_MODELS["attention"]()
    greedy = get_pipeline("llvm", **PLAN_ONLY, plan_options=PlanOptions(peak_safe=False))
    planned_vm = _vm(mod, greedy)
    unplanned_vm = _vm(mod, _unplanned_pipeline())
    for length in LENGTHS:
        args = random_arguments(mod["main"], {"s": length}, seed=length)
        got, _, allocations = _run(planned_vm, args)
        want, _, unplanned_allocations = _run(unplanned_vm, args)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert allocations < unplanned_allocations

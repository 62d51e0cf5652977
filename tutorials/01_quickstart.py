"""
Quickstart: symbolic shapes, the memory timeline, and our pipeline
===================================================================

This tutorial takes a small training step whose batch size ``b`` is unknown at compile time,
builds its **symbolic shape graph** and **memory timeline**, compiles it with TVM's stock
pipeline and with blade_relax's, and measures the peak bytes of both at several batch sizes.

Run it with ``python tutorials/01_quickstart.py`` (``BLADE_RELAX_VERBOSE=1`` shows TVM's native
warnings, hidden by default).
"""

######################################################################
# A dynamic training step
# -----------------------
# ``mlp_training_step`` builds ``loss = sum(mlp(x) ** 2)`` and its gradients with
# ``relax.transform.Gradient``; the batch dim ``b`` is symbolic.
import os
import sys

import tvm
from tvm import relax

import blade_relax
from blade_relax.analysis import memory_timeline
from blade_relax.frontend.builtin import mlp_training_step, random_arguments
from blade_relax.runtime import memory_stats, reset_memory_stats
from blade_relax.symbolic import ShapeGraph, SymbolicExpr

blade_relax.quiet()  # TVM's C++ warnings on stderr; BLADE_RELAX_VERBOSE=1 shows them
small = os.environ.get("BLADE_RELAX_TUTORIAL_SMALL") == "1"
hidden, intermediate = (32, 64) if small else (256, 1024)
mod = mlp_training_step(hidden=hidden, intermediate=intermediate)
# ``show()`` colours the script for a terminal; redirected output gets plain text.
if sys.stdout.isatty():
    mod["main"].show()
else:
    print(mod["main"].script())

######################################################################
# The symbolic shape graph
# ------------------------
# Every dim becomes a :class:`SymbolicDim` with a range (``b >= 1`` by default), every tensor
# a byte count over the dims. Comparisons are *proven* for all admissible ``b`` or UNKNOWN.
graph = ShapeGraph.from_function(mod["main"])
print("dims:", dict(graph.dims))
b = SymbolicExpr.dim("b")
print(
    "b*hidden*4 vs hidden*intermediate*4:", graph.compare(b * hidden * 4, hidden * intermediate * 4)
)
print("b*intermediate*4 vs b*hidden*4:", graph.compare(b * intermediate * 4, b * hidden * 4))

######################################################################
# The memory timeline
# -------------------
# Live bytes after every binding, as sympy expressions over ``b``, and the symbolic peak: a
# ``Max`` of only those candidates that can be the largest for some ``b``.
#
# Two quantities, two bases. The **peak** counts what the function allocates (activations,
# gradients, the loss): the bytes the runtime accounting measures for a call. The parameters
# and inputs belong to the caller and are not in it; they are the timeline's **persistent**
# bytes. The **lower bound** is persistent bytes plus the largest single-op working set
# (inputs + outputs of one op): no schedule or rematerialization goes below it. Compared with
# the lower bound, the peak must therefore include the persistent bytes.
timeline = memory_timeline(mod["main"])
print("symbolic peak (allocated by the function):", timeline.peak)
print("persistent bytes (parameters and inputs): ", timeline.persistent)
print("lower bound (persistent + one op's set):  ", timeline.lower_bound)
for batch in (8, 512):
    at = timeline.evaluate({"b": batch})
    total = at.peak + at.persistent
    print(
        f"b={batch}: peak {at.peak:,} B allocated + {at.persistent:,} B parameters and inputs "
        f"= {total:,} B, lower bound {at.lower_bound:,} B"
    )
    assert at.lower_bound <= total

######################################################################
# Compile: stock TVM vs blade_relax
# ---------------------------------
# ``blade_relax.get_pipeline(target)`` is TVM's pipeline for the target with our passes at
# their places. Importing ``blade_relax`` installed a byte-exact accounting of every storage
# the VM allocates, so both executables are measured by the same ruler.
stock = tvm.compile(mod, "llvm", relax_pipeline=blade_relax.pipeline.stock_pipeline("llvm"))
ours = tvm.compile(mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm"))


def measured_peak(exe, dims):
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], dims)]
    reset_memory_stats()
    base = memory_stats()["live_bytes"]
    outputs = vm["main"](*args)
    peak = memory_stats()["peak_bytes"] - base
    return peak, outputs


# The losses agree to rounding: our pipeline runs the GEMMs on ATen's BLAS, which sums in
# another order than TVM's kernels (``dispatch_gemm=False`` keeps those, bit for bit).
print(f"{'b':>6} {'stock peak':>12} {'blade_relax':>12} {'ratio':>6}  loss rel. diff")
for batch in (16, 128, 1024):
    stock_peak, stock_out = measured_peak(stock, {"b": batch})
    our_peak, our_out = measured_peak(ours, {"b": batch})
    stock_loss, our_loss = float(stock_out[0].numpy()), float(our_out[0].numpy())
    diff = abs(our_loss - stock_loss) / abs(stock_loss)
    print(f"{batch:>6} {stock_peak:>12,} {our_peak:>12,} {our_peak / stock_peak:>6.2f}  {diff:.1e}")
    assert diff <= 1e-5 and our_peak <= stock_peak

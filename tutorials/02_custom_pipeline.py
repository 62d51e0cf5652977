"""
Registering blade_relax passes in your own Relax pipeline
==========================================================

Our passes are ordinary ``tvm.transform.Pass`` objects with stable names, so they compose
with TVM's own phases in a ``tvm.transform.Sequential``, can be switched off by name with
``PassContext(disabled_pass=[...])``, and the whole pipeline is registered as the Relax
pipeline ``"blade_relax"``.

Run it with ``python tutorials/02_custom_pipeline.py`` (``BLADE_RELAX_VERBOSE=1`` shows TVM's
native warnings, hidden by default).
"""

######################################################################
# The registered pipeline
# -----------------------
# ``import blade_relax`` registers ``relax.get_pipeline("blade_relax")``; it takes the same
# keyword arguments as :func:`blade_relax.get_pipeline`.
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu

import blade_relax  # registers the "blade_relax" pipeline
from blade_relax.frontend.builtin import attention_block, random_arguments
from blade_relax.transform import MemoryAwareSchedule, PlanMemory, Rematerialize

blade_relax.quiet()  # TVM's C++ warnings on stderr; BLADE_RELAX_VERBOSE=1 shows them
mod = attention_block(hidden=64, heads=4)
exe = tvm.compile(mod, "llvm", relax_pipeline=relax.get_pipeline("blade_relax", target="llvm"))
print("compiled with relax.get_pipeline('blade_relax')")

######################################################################
# Our passes inside your own Sequential
# -------------------------------------
# Where each pass goes: ``MemoryAwareSchedule`` after fusion and before ``ToNonDataflow``
# (it reorders dataflow blocks); ``Rematerialize`` after ``ToNonDataflow``/``CallTIRRewrite``
# and before memory planning (it inserts impure builtins); ``PlanMemory`` in place of
# ``StaticPlanBlockMemory``.
target = tvm.target.Target("llvm")
finalize = [
    PlanMemory() if p.info.name == "StaticPlanBlockMemory" else p
    for p in cpu.finalize_passes(target)
]
passes = (
    cpu.library_dispatch_passes(target)
    + cpu.legalize_passes(target)
    + [MemoryAwareSchedule()]
    + cpu.dataflow_lower_passes(target)
    + [Rematerialize()]
    + finalize
)
print(
    "pass names:",
    [
        p.info.name
        for p in passes
        if p.info.name in ("MemoryAwareSchedule", "Rematerialize", "PlanMemory")
    ],
)


@tvm.transform.module_pass(opt_level=0, name="MyPipeline")
def my_pipeline(mod, _ctx):
    with target:
        return tvm.transform.Sequential(passes)(mod)


exe_custom = tvm.compile(mod, target, relax_pipeline=my_pipeline)

######################################################################
# Switching a pass off by name
# ----------------------------
# ``disabled_pass`` matches the pass ``name``, which equals the class name.
with tvm.transform.PassContext(opt_level=3, disabled_pass=["Rematerialize"]):
    exe_no_remat = tvm.compile(mod, target, relax_pipeline=my_pipeline)

######################################################################
# All three executables compute the same thing
# --------------------------------------------
import numpy as np  # noqa: E402

args = [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], {"s": 48})]
results = [
    relax.VirtualMachine(e, tvm.cpu())["main"](*args).numpy()
    for e in (exe, exe_custom, exe_no_remat)
]
for r in results[1:]:
    np.testing.assert_array_equal(results[0], r)
print("outputs identical across the three pipelines")

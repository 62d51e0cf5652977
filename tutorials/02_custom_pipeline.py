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

import blade_relax  # registers the "blade_relax" pipeline
from blade_relax.frontend.builtin import attention_block, random_arguments
from blade_relax.pipeline import PHASES, PipelineFlags, pipeline_phases

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
# ``StaticPlanBlockMemory``. ``pipeline_phases`` gives TVM's phases for the target with the
# passes you switch on already in place (by position in TVM's phase list, which it checks:
# a TVM whose phases changed shape is an error, not a silently dropped pass), so your own
# passes can go between any two phases.
target = tvm.target.Target("llvm")
phases = pipeline_phases(
    target,
    **{flag: flag in ("schedule", "remat", "plan") for flag in PipelineFlags.switches()},
)
passes = [p for phase in PHASES for p in phases[phase]]
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
# To rounding: the registered pipeline runs the GEMMs on ATen's BLAS (``DispatchGemm``, on by
# default), the two others, built with the memory passes alone, on TVM's kernels.
import numpy as np  # noqa: E402

args = [tvm.runtime.tensor(a) for a in random_arguments(mod["main"], {"s": 48})]
results = [
    relax.VirtualMachine(e, tvm.cpu())["main"](*args).numpy()
    for e in (exe, exe_custom, exe_no_remat)
]
np.testing.assert_array_equal(results[1], results[2])
for r in results[1:]:
    np.testing.assert_allclose(results[0], r, rtol=1e-5, atol=1e-5)
print("outputs agree across the three pipelines")

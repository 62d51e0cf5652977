"""What the tests of the kernel passes start from: TVM's legalized and fused kernels, after
``InlineKernelIntermediates`` (where ``VectorizeSoftmax`` and ``VectorizeColumnReductions``
run)."""

import tvm
from tvm import relax

from blade_relax.transform import InlineKernelIntermediates

LLVM = tvm.target.Target("llvm")


def fuse(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` legalized and fused by TVM, then ``InlineKernelIntermediates``."""
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        InlineKernelIntermediates(),
    ]
    with LLVM:
        return tvm.transform.Sequential(passes)(mod)


def kernels(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    """The PrimFuncs of ``mod`` by name."""
    return {g.name_hint: f for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}

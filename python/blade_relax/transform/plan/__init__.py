"""Memory planning on symbolic sizes: :class:`PlanMemory`.

``plan_memory`` is the pass; ``_collect`` (the allocations and who reads them), ``_peak`` (the
live-byte model its sharing decisions are proven on) and ``_index`` (the storages by where they
end, searched for free ones) are its private parts. In-place verdicts
(which input a kernel's output may overwrite) are read from the kernels by
:func:`blade_relax.analysis.inplace_reuse.inplace_verdict`, shared with ``MemoryAwareSchedule``.
"""

from .plan_memory import FunctionPlan, PlanMemory, PlanOptions, StoragePlan, plan_function

__all__ = ["FunctionPlan", "PlanMemory", "PlanOptions", "StoragePlan", "plan_function"]

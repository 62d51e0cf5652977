"""Memory planning on symbolic sizes: :class:`PlanMemory`.

``plan_memory`` is the pass; ``_collect`` (the allocations and who reads them), ``_peak`` (the
live-byte model its sharing decisions are proven on) and ``_tir`` (in-place verdicts read from
the kernels) are its private parts.
"""

from .plan_memory import FunctionPlan, PlanMemory, PlanOptions, StoragePlan, plan_function

__all__ = ["FunctionPlan", "PlanMemory", "PlanOptions", "StoragePlan", "plan_function"]

"""Batch plans: split a global batch into micro-batch x accumulation steps x ranks."""

from .elastic import CompatibleBatchSize, compatible_batch_sizes
from .rounding import batch_multiple, feasible_range, nearest_plannable, plannable_grid, round_global_batch
from .solver import BatchPlan, PlanError, plan_batch

__all__ = [
    "BatchPlan",
    "CompatibleBatchSize",
    "PlanError",
    "batch_multiple",
    "compatible_batch_sizes",
    "feasible_range",
    "nearest_plannable",
    "plan_batch",
    "plannable_grid",
    "round_global_batch",
]

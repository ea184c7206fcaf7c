"""The DeepSpeed runtime: ``initialize`` and ``AdaptiveBatchEngine``."""

from .engine import AdaptiveBatchEngine
from .initialize import initialize
from .lr import BatchCoupledLR
from .metrics import PlanChange, StepMetrics

__all__ = ["AdaptiveBatchEngine", "BatchCoupledLR", "PlanChange", "StepMetrics", "initialize"]

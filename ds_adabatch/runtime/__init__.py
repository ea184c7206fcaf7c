"""The DeepSpeed runtime: ``initialize`` and ``AdaptiveBatchEngine``."""

from .engine import AdaptiveBatchEngine
from .initialize import initialize
from .lr import BatchCoupledLR
from .metrics import PlanChange, StepMetrics
from .step_loss import StepLoss

__all__ = ["AdaptiveBatchEngine", "BatchCoupledLR", "PlanChange", "StepLoss", "StepMetrics", "initialize"]

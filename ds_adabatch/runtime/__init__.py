"""The DeepSpeed runtime: ``initialize`` and ``AdaptiveBatchEngine``."""

from .engine import AdaptiveBatchEngine
from .initialize import initialize
from .lr import BatchCoupledLR
from .memory import MicroBatchMemory
from .metrics import PlanChange, StepMetrics
from .oom import UnrecoverableOutOfMemory
from .step_loss import StepLoss

__all__ = [
    "AdaptiveBatchEngine",
    "BatchCoupledLR",
    "MicroBatchMemory",
    "PlanChange",
    "StepLoss",
    "StepMetrics",
    "UnrecoverableOutOfMemory",
    "initialize",
]

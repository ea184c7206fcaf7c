"""The DeepSpeed runtime: ``initialize``, ``AdaptiveBatchEngine`` and ``AdaptivePipelineEngine``."""

from .engine import AdaptiveBatchEngine
from .initialize import initialize
from .live_recovery import LiveRecoveryFailed
from .lr import BatchCoupledLR
from .memory import MicroBatchMemory
from .metrics import PlanChange, StepMetrics
from .oom import UnrecoverableOutOfMemory
from .pipeline import AdaptivePipelineEngine
from .step_loss import StepLoss

__all__ = [
    "AdaptiveBatchEngine",
    "AdaptivePipelineEngine",
    "BatchCoupledLR",
    "LiveRecoveryFailed",
    "MicroBatchMemory",
    "PlanChange",
    "StepLoss",
    "StepMetrics",
    "UnrecoverableOutOfMemory",
    "initialize",
]

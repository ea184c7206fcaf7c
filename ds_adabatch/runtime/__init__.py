"""The DeepSpeed runtime: ``initialize``, ``AdaptiveBatchEngine`` and ``AdaptivePipelineEngine``."""

from .core.loss import StepLoss
from .core.lr import BatchCoupledLR
from .core.metrics import PlanChange, StepMetrics
from .engine.data_parallel import AdaptiveBatchEngine
from .initialize.build import initialize
from .live.recovery import LiveRecoveryFailed
from .memory.limit import MicroBatchMemory
from .memory.oom import UnrecoverableOutOfMemory
from .pipeline.engine import AdaptivePipelineEngine

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

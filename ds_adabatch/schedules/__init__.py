"""Batch-size schedules: pure rules from a training context to a desired global batch.

``build_schedule`` turns a ``"schedule"`` config into its rule; ``BatchSizeController`` wraps the
rule with the section's bounds, granularity, change cap and update interval and answers, before each
optimizer step, with an integer global batch the planner can split. Nothing here imports torch,
DeepSpeed or matplotlib at import time.
"""

from .base import Schedule, ScheduleContext, ScheduleError, StatefulSchedule
from .base_lr import BaseLRSource, DeepSpeedSchedulerCurve, base_lr_from_ds_config
from .controller import BatchSizeController, Decision
from .lr import lr_multiplier
from .registry import build_schedule
from .seesaw import SeesawSchedule, seesaw_batch
from .simulate import simulate

__all__ = [
    "BaseLRSource",
    "BatchSizeController",
    "DeepSpeedSchedulerCurve",
    "Decision",
    "Schedule",
    "ScheduleContext",
    "ScheduleError",
    "SeesawSchedule",
    "StatefulSchedule",
    "base_lr_from_ds_config",
    "build_schedule",
    "lr_multiplier",
    "seesaw_batch",
    "simulate",
]

"""Batch-size schedules: pure rules from a training context to a desired global batch.

``build_schedule`` turns a ``"schedule"`` config into its rule; ``BatchSizeController`` wraps the
rule with the section's bounds, granularity, change cap and update interval and answers, before each
optimizer step, with an integer global batch the planner can split. Nothing here imports torch,
DeepSpeed or matplotlib at import time.
"""

from .base import Schedule, ScheduleContext, ScheduleError, StatefulSchedule, build_schedule
from .controller import BatchSizeController, Decision
from .lr import lr_multiplier
from .simulate import simulate

__all__ = [
    "BatchSizeController",
    "Decision",
    "Schedule",
    "ScheduleContext",
    "ScheduleError",
    "StatefulSchedule",
    "build_schedule",
    "lr_multiplier",
    "simulate",
]

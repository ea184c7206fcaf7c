"""Measurements that schedules feed on: a smoothed loss, the gradient-noise scale, the statistical
efficiency it implies, and the step-time model of the goodput schedule.

All take already all-reduced numbers, so every rank holds the same values and takes the same
batch-size decision. They are plain Python (0-d tensors are accepted wherever a float is).
"""

from .efficiency import efficiency_form, statistical_efficiency
from .ema import EmaLoss
from .noise import GradientNoiseEstimator
from .step_time_fit import SimulatedDevice, StepTimeFit, parse_step_time_curve
from .throughput import ThroughputModel

__all__ = [
    "EmaLoss",
    "GradientNoiseEstimator",
    "SimulatedDevice",
    "StepTimeFit",
    "ThroughputModel",
    "efficiency_form",
    "parse_step_time_curve",
    "statistical_efficiency",
]

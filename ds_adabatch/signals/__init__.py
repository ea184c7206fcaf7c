"""Measurements that schedules feed on: a smoothed loss and the gradient-noise scale.

Both take already all-reduced numbers, so every rank holds the same values and takes the same
batch-size decision. They are plain Python (0-d tensors are accepted wherever a float is).
"""

from .ema import EmaLoss
from .noise import GradientNoiseEstimator

__all__ = ["EmaLoss", "GradientNoiseEstimator"]

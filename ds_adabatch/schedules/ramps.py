"""Deterministic schedules: functions of the training clock alone (no state, no measurements)."""

from __future__ import annotations

import bisect
from typing import Any

from .base import ScheduleContext, ScheduleError

__all__ = ["ConstantSchedule", "LinearSchedule", "PiecewiseSchedule", "StepSchedule"]


class ConstantSchedule:
    """``value`` at every step."""

    name = "constant"
    requires: frozenset[str] = frozenset()

    def __init__(self, config: Any) -> None:
        self.value = int(config.value)
        self.last_reason = f"constant {self.value}"

    def __call__(self, ctx: ScheduleContext) -> float:
        return float(self.value)


class LinearSchedule:
    """``start`` -> ``end`` linearly in samples consumed over ``ramp_samples``, then ``end``."""

    name = "linear"
    requires: frozenset[str] = frozenset()

    def __init__(self, config: Any) -> None:
        self.start = int(config.start)
        self.end = int(config.end)
        self.ramp_samples = int(config.ramp_samples)
        self.last_reason = ""

    def __call__(self, ctx: ScheduleContext) -> float:
        if self.ramp_samples <= 0 or ctx.samples >= self.ramp_samples:
            self.last_reason = f"linear ramp done: {self.end}"
            return float(self.end)
        value = self.start + (self.end - self.start) * ctx.samples / self.ramp_samples
        self.last_reason = f"linear ramp at sample {ctx.samples}/{self.ramp_samples}: {value:.6g}"
        return value


class StepSchedule:
    """Megatron-style staircase: ``start`` moves by ``increment`` in equal sample intervals to ``end``."""

    name = "step"
    requires: frozenset[str] = frozenset()

    def __init__(self, config: Any) -> None:
        self.start = int(config.start)
        self.end = int(config.end)
        self.increment = int(config.increment)
        self.ramp_samples = int(config.ramp_samples)
        self.steps = abs(self.end - self.start) // self.increment
        self.last_reason = ""

    def __call__(self, ctx: ScheduleContext) -> float:
        if self.steps == 0 or ctx.samples >= self.ramp_samples:
            taken = self.steps
        else:
            # Integer arithmetic: floor(samples / (ramp / steps)) without float error at the edges.
            taken = min(self.steps, ctx.samples * self.steps // self.ramp_samples)
        sign = 1 if self.end >= self.start else -1
        value = self.start + sign * self.increment * taken
        self.last_reason = f"step {taken}/{self.steps} of the staircase: {value}"
        return float(value)


def clock_value(ctx: ScheduleContext, unit: str) -> float:
    """The context's position on the ``unit`` clock (samples, tokens or completed steps)."""
    if unit == "samples":
        return ctx.samples
    if unit == "steps":
        return ctx.step
    if unit == "tokens":
        if ctx.tokens is None:
            raise ScheduleError(
                "this schedule is keyed on tokens but the context carries no token count; give the "
                "runtime a token count (or simulate a tokens_per_sample), or switch the unit to samples"
            )
        return ctx.tokens
    raise ValueError(f"unknown clock unit {unit!r}; use samples, tokens or steps")


class PiecewiseSchedule:
    """Batches given at points of a clock; held or linearly interpolated between points."""

    name = "piecewise"

    def __init__(self, config: Any) -> None:
        points = [(int(at), int(batch)) for at, batch in config.points]
        self.ats = [at for at, _ in points]
        self.batches = [batch for _, batch in points]
        self.unit = str(config.unit)
        self.interpolate = bool(config.interpolate)
        self.requires = frozenset({"tokens"}) if self.unit == "tokens" else frozenset()
        self.last_reason = ""

    def __call__(self, ctx: ScheduleContext) -> float:
        x = clock_value(ctx, self.unit)
        # Index of the last point at or before x (-1 when x is before the first point).
        i = bisect.bisect_right(self.ats, x) - 1
        if i < 0:
            value = float(self.batches[0])
        elif i == len(self.ats) - 1 or not self.interpolate:
            value = float(self.batches[i])
        else:
            frac = (x - self.ats[i]) / (self.ats[i + 1] - self.ats[i])
            value = self.batches[i] + (self.batches[i + 1] - self.batches[i]) * frac
        self.last_reason = f"piecewise at {self.unit}={x:g}: {value:.6g}"
        return value

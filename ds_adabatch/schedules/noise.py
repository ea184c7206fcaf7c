"""The ``gradient_noise`` schedule: follow ``scale`` x the gradient-noise scale B_simple.

The rule reads ``ctx.noise_scale``, the smoothed estimate the runtime keeps with
:class:`ds_adabatch.signals.GradientNoiseEstimator` (configured with this schedule's ``ema_beta`` and
fed every ``measure_every`` optimizer steps). Per evaluation::

    if step < warmup or no estimate:          hold the current batch (``start`` at first)
    target = scale * noise_scale
    if target / current in [1/(1+h), 1+h]:    hold
    else:                                     target

The controller then clamps the target to the bounds, caps the change by ``max_change_factor`` and
rounds it. ``warmup`` is ``warmup_steps`` when set, else one time constant of the estimator's EMA,
``ceil(measure_every / (1 - ema_beta))`` steps: the first moment its estimate averages a full window of
measurements.
"""

from __future__ import annotations

import math
from typing import Any

from .base import ScheduleContext, check_state

__all__ = ["GradientNoiseSchedule", "auto_warmup_steps"]

_STATE_VERSION = 1


def auto_warmup_steps(measure_every: int, ema_beta: float) -> int:
    """Optimizer steps until the noise EMA has averaged one time constant of measurements.

    An EMA with factor ``beta`` remembers about ``1 / (1 - beta)`` measurements; before that many
    have arrived its (bias-corrected) value leans on the first few, which are the noisiest and, early in
    training, the least representative.
    """
    # The small tolerance keeps 1 / (1 - 0.95) = 20.000000000000018 at 20.
    return math.ceil(measure_every / (1.0 - ema_beta) - 1e-9)


class GradientNoiseSchedule:
    """The rule of ``GradientNoiseScheduleConfig``."""

    name = "gradient_noise"
    requires: frozenset[str] = frozenset({"noise_scale"})

    def __init__(self, config: Any) -> None:
        self.scale = float(config.scale)
        self.hysteresis = float(config.hysteresis)
        self.measure_every = int(config.measure_every)
        self.ema_beta = float(config.ema_beta)
        self.warmup_steps = (
            int(config.warmup_steps)
            if config.warmup_steps is not None
            else auto_warmup_steps(self.measure_every, self.ema_beta)
        )
        """Steps held at ``start`` (the configured value, or the EMA's time constant)."""
        self.last_target: float | None = None
        """The last target that left the hysteresis band (samples), for logs and checkpoints."""
        self.moves = 0
        """How many evaluations asked for a change."""
        self.last_reason = ""

    def __call__(self, ctx: ScheduleContext) -> float:
        current = float(ctx.global_batch)
        if ctx.step < self.warmup_steps:
            self.last_reason = f"noise-scale warm-up (step {ctx.step} < {self.warmup_steps}): hold"
            return current
        estimate = ctx.noise_scale
        if estimate is None or not math.isfinite(estimate) or estimate <= 0:
            self.last_reason = f"no usable noise-scale estimate ({estimate!r}): hold"
            return current
        target = self.scale * estimate
        ratio = target / current
        band = 1.0 + self.hysteresis
        if 1.0 / band <= ratio <= band:
            self.last_reason = (
                f"B_noise {estimate:.6g} x {self.scale:g} = {target:.6g} within {self.hysteresis:g} of "
                f"{current:g}: hold"
            )
            return current
        self.last_target = target
        self.moves += 1
        self.last_reason = f"B_noise {estimate:.6g} x {self.scale:g}: target {target:.6g} (was {current:g})"
        return target

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "GradientNoiseSchedule",
            "version": _STATE_VERSION,
            "last_target": self.last_target,
            "moves": self.moves,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, kind="GradientNoiseSchedule", version=_STATE_VERSION)
        target = state["last_target"]
        self.last_target = None if target is None else float(target)
        self.moves = int(state["moves"])

"""The ``gradient_noise`` schedule: follow ``scale`` x the gradient-noise scale B_simple.

The rule reads ``ctx.noise_scale``, the smoothed estimate the runtime keeps with
:class:`ds_adabatch.signals.GradientNoiseEstimator` (configured with this schedule's ``ema_beta`` and
fed every ``measure_every`` optimizer steps). Per evaluation, with ``band = 1 + hysteresis``::

    if step < warmup or no estimate:                    hold the current batch (``start`` at first)
    if relative error > max_relative_error:             hold (not yet confident)
    target = scale * noise_scale
    if grow_only and target <= current * band:          hold
    if target / current in [1/band, band]:              hold
    if the move reverses the previous one and
       target / previous_target in [1/band, band]:      hold
    else:                                               target
    the target is then kept in [current / f, current * f], f = the schedule's max_change_factor

The controller then clamps the target to the bounds, caps the change by the section's
``max_change_factor`` and rounds it. ``warmup`` is ``warmup_steps`` when set, else one time constant of
the estimator's EMA, ``ceil(measure_every / (1 - ema_beta))`` steps: the first moment its estimate
averages a full window of measurements. The relative error is the estimator's
(:attr:`~ds_adabatch.signals.GradientNoiseEstimator.relative_error`, ``ctx.noise_scale_error``); the
config's field descriptions give the reason for each default.

Why the reversal test: the band around the current batch alone cannot stop a flip-flop when one
rounding step is wider than the band. With granularity 8 and a target hovering at 20, 20.5 rounds to
24, and from 24 a jitter to 19.5 is outside 24's band and rounds back to 16, and so on. The batch the
controller planned is the rounding of the target that asked for it, so a move back is measured against
that target, not against its rounding: it needs the estimate itself to move back by the band, and a
target jittering around one rounding midpoint holds whichever neighbour it reached first.
"""

from __future__ import annotations

import math
from typing import Any

from .base import ScheduleContext, check_state

__all__ = ["GradientNoiseSchedule", "auto_warmup_steps"]

_STATE_VERSION = 2


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
        self._settings = config
        self.geometry: str | None = None if config.geometry == "auto" else config.geometry
        """The geometry the noise scale is measured in; None while ``"auto"`` is unresolved."""
        self.scale = float(config.scale_for(self.geometry or "adam"))
        """The multiplier in use: the configured ``scale`` or the default for :attr:`geometry` (adam's
        until an ``"auto"`` geometry is resolved)."""
        self.hysteresis = float(config.hysteresis)
        self.grow_only = bool(config.grow_only)
        self.measure_every = int(config.measure_every)
        self.ema_beta = float(config.ema_beta)
        self.max_relative_error = (
            None if config.max_relative_error is None else float(config.max_relative_error)
        )
        self.max_change_factor = None if config.max_change_factor is None else float(config.max_change_factor)
        self.warmup_steps = (
            int(config.warmup_steps)
            if config.warmup_steps is not None
            else auto_warmup_steps(self.measure_every, self.ema_beta)
        )
        """Steps held at ``start`` (the configured value, or the EMA's time constant)."""
        self.last_target: float | None = None
        """The last target that left the hysteresis band (samples), for logs, checkpoints and the
        reversal test."""
        self.last_direction = 0
        """+1 if ``last_target`` asked for a larger batch, -1 for a smaller one, 0 before any move."""
        self.moves = 0
        """How many evaluations asked for a change."""
        self.last_reason = ""

    def use_geometry(self, geometry: str) -> None:
        """The runtime measures in ``geometry`` (``"sgd"`` or ``"adam"``): an unset ``scale`` takes that
        geometry's default."""
        self.geometry = geometry
        self.scale = float(self._settings.scale_for(geometry))

    def __call__(self, ctx: ScheduleContext) -> float:
        current = float(ctx.global_batch)
        if ctx.step < self.warmup_steps:
            self.last_reason = f"noise-scale warm-up (step {ctx.step} < {self.warmup_steps}): hold"
            return current
        estimate = ctx.noise_scale
        if estimate is None or not math.isfinite(estimate) or estimate <= 0:
            self.last_reason = f"no usable noise-scale estimate ({estimate!r}): hold"
            return current
        error = ctx.noise_scale_error
        if self.max_relative_error is not None and error is not None and not error <= self.max_relative_error:
            # None: a caller that does not measure the error (a replay); the runtime always does.
            self.last_reason = (
                f"B_noise {estimate:.6g} not yet confident (relative error {error:.3g} > "
                f"{self.max_relative_error:g}): hold"
            )
            return current
        target = self.scale * estimate
        band = 1.0 + self.hysteresis
        said = f"B_noise {estimate:.6g} x {self.scale:g} = {target:.6g}"
        if self.grow_only and target <= current * band:
            self.last_reason = f"{said}, not above {current:g} x {band:g} (grow only): hold"
            return current
        if 1.0 / band <= target / current <= band:
            self.last_reason = f"{said} within {self.hysteresis:g} of {current:g}: hold"
            return current
        direction = 1 if target > current else -1
        if (
            direction == -self.last_direction
            and self.last_target is not None
            and 1.0 / band <= target / self.last_target <= band
        ):
            self.last_reason = (
                f"{said} would reverse the last move but is within {self.hysteresis:g} of its target "
                f"{self.last_target:.6g}: hold"
            )
            return current
        self.last_target = target
        self.last_direction = direction
        self.moves += 1
        self.last_reason = f"{said}: target (was {current:g})"
        f = self.max_change_factor
        if f is not None and not current / f <= target <= current * f:
            target = min(max(target, current / f), current * f)
            self.last_reason += f", capped to a factor {f:g} per update: {target:.6g}"
        return target

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "GradientNoiseSchedule",
            "version": _STATE_VERSION,
            "last_target": self.last_target,
            "last_direction": self.last_direction,
            "moves": self.moves,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (
            isinstance(state, dict)
            and state.get("kind") == "GradientNoiseSchedule"
            and state.get("version") == 1
        ):
            # Version 1 did not record the direction of the last move: resume without a reversal test
            # until the next move, which is what the version-1 rule did.
            state = {**state, "version": _STATE_VERSION, "last_direction": 0}
        check_state(state, kind="GradientNoiseSchedule", version=_STATE_VERSION)
        target = state["last_target"]
        self.last_target = None if target is None else float(target)
        direction = int(state["last_direction"])
        if direction not in (-1, 0, 1):
            raise ValueError(
                f"GradientNoiseSchedule state has last_direction {direction!r}; expected -1, 0 or 1"
            )
        self.last_direction = direction
        self.moves = int(state["moves"])

"""Seesaw: turn the learning-rate schedule's decay into batch growth.

Meterez, Morwani et al. 2025, "Seesaw: Accelerating Training by Balancing Learning Rate and Batch Size
Scheduling" (arXiv 2510.14717): wherever a standard schedule would multiply the learning rate by a
factor ``a < 1`` (halve it, for ``a = 1/2``), Seesaw multiplies it by ``sqrt(a)`` and the batch by
``1 / a``. For Adam-type optimizers this keeps the loss against samples (FLOPs) on the curve of the
original schedule while taking fewer optimizer steps. Written with the base schedule's own decay
``alpha(s) = peak / eta(s)`` (``eta(s)`` the base LR after ``s`` samples, ``peak`` its maximum):

    B(s)   = B_0 * alpha(s)                                  (continuous form)
    B(s)   = B_0 * f ** floor(log_f(alpha(s)))              (discrete form, f = factor, 2 in the paper)
    lr(s)  = eta(s) * sqrt(B_planned(s) / B_0)

``alpha`` is floored at 1, so warmup runs at ``B_0``. The learning rate is not computed here: the
runtime's ``lr_scaling: "sqrt"`` with ``reference_batch = B_0`` multiplies the base LR by
``sqrt(B / B_0)`` for the batch ``B`` that was actually planned, after bounds, granularity and
rounding. So the applied LR follows the batch the run trains with, not the one the rule wanted; once
the batch is held at ``max_global_batch`` the multiplier stops growing and the LR simply follows the
base schedule's decay from there (plain LR decay). In the continuous form, with a batch the planner
can represent exactly, ``lr(s) = eta(s) * sqrt(alpha(s)) = peak / sqrt(alpha(s))``: "batch
proportional to peak LR / base LR". With ``lr_scaling: "linear"`` the same rule is the SGD form
(batch x alpha, LR held at the peak; Smith et al. 2018, "Don't Decay the Learning Rate, Increase the
Batch Size").

The base LR comes through a :class:`~ds_adabatch.schedules.base_lr.BaseLRSource` that the runtime (or
``simulate``) binds with :meth:`SeesawSchedule.bind_base_lr`; this module imports nothing of DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any

from .base import ScheduleContext, ScheduleError, check_state
from .base_lr import BaseLRSource

__all__ = ["SeesawSchedule", "seesaw_batch"]

_STATE_VERSION = 1
# Batches beyond this multiple of the start are clamped (the controller clamps to max_global_batch
# anyway); it keeps the answer finite when the base LR reaches 0.
_MAX_ALPHA = 1e12


def seesaw_batch(start: float, alpha: float, *, discrete: bool, factor: float = 2.0) -> float:
    """The rule's batch for a base-LR decay ``alpha = peak / base LR`` (``alpha`` < 1 counts as 1)."""
    alpha = min(max(1.0, alpha), _MAX_ALPHA)
    if not discrete:
        return start * alpha
    # The small tolerance keeps an exact halving (alpha = 2.0 from 2e-3 / 1e-3) on its step.
    k = math.floor(math.log(alpha) / math.log(factor) + 1e-9)
    return start * factor**k


class SeesawSchedule:
    """The ``seesaw`` rule (see the module docstring for the formula).

    State (checkpointed): the running peak of the base LR and the last decay factor. Resume continues
    the same sequence because the rule is a function of the base LR at the current samples and that
    peak alone.
    """

    name = "seesaw"
    requires: frozenset[str] = frozenset()

    def __init__(self, config: Any, *, max_global_batch: int | None = None) -> None:
        self.start = int(config.start)
        self.discrete = bool(config.discrete)
        self.factor = float(config.factor)
        self.fixed_peak = None if config.peak_lr is None else float(config.peak_lr)
        self.max_global_batch = max_global_batch
        self.source: BaseLRSource | None = None
        self.peak = 0.0 if self.fixed_peak is None else self.fixed_peak
        self.alpha = 1.0
        self.last_reason = ""

    def bind_base_lr(self, source: BaseLRSource) -> None:
        """Give the rule the run's base LR (``source.base_lr(samples)``); the runtime calls this."""
        if not callable(getattr(source, "base_lr", None)):
            raise TypeError(f"a base-LR source needs a base_lr(samples) method, got {type(source).__name__}")
        self.source = source

    def decay(self, samples: int) -> tuple[float, float]:
        """``(base LR, alpha)`` after ``samples`` samples, updating the running peak."""
        if self.source is None:
            raise ScheduleError(
                "the seesaw schedule has no base learning rate to follow: ds_adabatch.initialize binds "
                "the run's LR scheduler; outside it call schedule.bind_base_lr(source)"
            )
        lr = float(self.source.base_lr(samples))
        if not math.isfinite(lr) or lr < 0:
            raise ScheduleError(f"the base learning rate at sample {samples} is {lr!r}; it must be >= 0")
        if self.fixed_peak is None:
            self.peak = max(self.peak, lr)
        if self.peak <= 0 or lr >= self.peak:
            alpha = 1.0
        elif lr <= 0:
            alpha = _MAX_ALPHA
        else:
            alpha = self.peak / lr
        return lr, alpha

    def __call__(self, ctx: ScheduleContext) -> float:
        lr, alpha = self.decay(ctx.samples)
        self.alpha = alpha
        value = seesaw_batch(self.start, alpha, discrete=self.discrete, factor=self.factor)
        if self.max_global_batch is not None and value > self.max_global_batch:
            value = float(self.max_global_batch)
            tail = f"; held at max_global_batch {self.max_global_batch}, the LR decays from here"
        else:
            tail = ""
        self.last_reason = f"seesaw: base LR {lr:.4g} = peak / {alpha:.4g} -> batch {value:.6g}{tail}"
        return value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "SeesawSchedule", "version": _STATE_VERSION, "peak": self.peak, "alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, kind="SeesawSchedule", version=_STATE_VERSION)
        if self.fixed_peak is None:
            self.peak = float(state["peak"])
        self.alpha = float(state["alpha"])

"""The ``loss_plateau`` schedule: change the batch when the smoothed loss stops moving.

One evaluation (one call, with a loss in the context)::

    smoothed = bias-corrected EMA of the loss           (ema_beta = 0: the raw loss)
    keep the last `window` smoothed values
    measure = |newest - oldest|                          (change = "net")
            | mean |v[i] - v[i-1]| over the window       (change = "mean_abs_step")
    measure /= |oldest|                                  (relative)
    if cooling down:            hold
    elif LR rose since the last evaluation at this batch (and hold_while_lr_rises):
        streak = 0; hold
    elif window full and measure < threshold:
        streak += 1; at `patience`: batch *= or /= factor, start `cooldown`
    else:
        streak = 0; batch *= otherwise_factor (if set)

Calls without a loss (step 0, a skipped measurement) hold the batch and change nothing.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from .base import ScheduleContext, check_state

__all__ = ["LossPlateauSchedule"]

_STATE_VERSION = 1


class LossPlateauSchedule:
    """The rule of ``LossPlateauScheduleConfig``; see that model for the parameters."""

    name = "loss_plateau"
    requires: frozenset[str] = frozenset({"loss"})

    def __init__(
        self, config: Any, *, min_global_batch: int | None = None, max_global_batch: int | None = None
    ) -> None:
        self.config = config
        self.lo = float(min_global_batch) if min_global_batch is not None else 1.0
        self.hi = float(max_global_batch) if max_global_batch is not None else math.inf
        self.current = self._clamp(float(config.start))
        """The rule's own batch, unrounded, so that small factors accumulate across rounding."""
        self.ema_value = 0.0
        self.ema_count = 0
        self.history: deque[float] = deque(maxlen=int(config.window))
        self.streak = 0
        self.cooldown_left = 0
        self.last_lr: float | None = None
        """Learning rate at the previous evaluation that had one (for ``hold_while_lr_rises``)."""
        self.last_lr_batch: int | None = None
        """The global batch that ``last_lr`` was seen with."""
        self.last_reason = "no loss seen yet"

    def _clamp(self, value: float) -> float:
        return min(self.hi, max(self.lo, value))

    def _smooth(self, loss: float) -> float:
        beta = float(self.config.ema_beta)
        self.ema_count += 1
        self.ema_value = beta * self.ema_value + (1.0 - beta) * loss
        # Bias correction: the EMA starts at 0, so early values are scaled up by 1 / (1 - beta^t).
        return self.ema_value / (1.0 - beta**self.ema_count)

    def change_measure(self) -> float | None:
        """The window's change (see the module docstring), None until the window is full."""
        if len(self.history) < self.history.maxlen:
            return None
        values = list(self.history)
        if self.config.change == "net":
            change = abs(values[-1] - values[0])
        else:
            steps = [abs(values[i] - values[i - 1]) for i in range(1, len(values))]
            change = sum(steps) / len(steps)
        if not self.config.relative:
            return change
        reference = abs(values[0])
        if reference == 0.0:
            return 0.0 if change == 0.0 else math.inf
        return change / reference

    def _lr_rose(self, ctx: ScheduleContext) -> bool:
        """True when the LR is higher than at the previous evaluation with the same batch.

        Only a change at an unchanged batch counts: with LR scaling a batch change moves the LR by
        itself, and that is not a warmup.
        """
        lr, batch = ctx.lr, int(ctx.global_batch)
        if lr is None or not math.isfinite(lr):
            return False
        rose = (
            self.last_lr is not None
            and self.last_lr_batch == batch
            # A relative tolerance: a constant LR recomputed in floating point is not a rise.
            and lr > self.last_lr * (1.0 + 1e-9)
        )
        self.last_lr, self.last_lr_batch = float(lr), batch
        return rose

    def __call__(self, ctx: ScheduleContext) -> float:
        # Tracked on every call, so a warmup is seen even across evaluations without a loss.
        lr_rose = self._lr_rose(ctx)
        loss = ctx.loss
        if loss is None or not math.isfinite(loss):
            self.last_reason = "no finite loss in this evaluation: hold"
            return self.current
        self.history.append(self._smooth(float(loss)))
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.last_reason = f"cooling down after a plateau change ({self.cooldown_left} left): hold"
            return self.current

        cfg = self.config
        if lr_rose and getattr(cfg, "hold_while_lr_rises", False):
            self.streak = 0
            self.last_reason = f"learning rate rising ({ctx.lr:.4g}): hold"
            return self.current

        measure = self.change_measure()
        if measure is not None and measure < cfg.threshold:
            self.streak += 1
            if self.streak < cfg.patience:
                self.last_reason = (
                    f"plateau ({measure:.4g} < {cfg.threshold:g}), {self.streak}/{cfg.patience}: hold"
                )
                return self.current
            self.streak = 0
            self.cooldown_left = int(cfg.cooldown)
            if cfg.direction == "grow":
                value = self.current * cfg.factor
            else:
                value = self.current / cfg.factor
                if cfg.floor_on_shrink:
                    value = float(math.floor(value))
            before, self.current = self.current, self._clamp(value)
            verb = "grow" if cfg.direction == "grow" else "shrink"
            self.last_reason = (
                f"plateau ({measure:.4g} < {cfg.threshold:g}): {verb} {before:.6g} -> {self.current:.6g}"
            )
            return self.current

        self.streak = 0
        shown = "window not full" if measure is None else f"change {measure:.4g} >= {cfg.threshold:g}"
        if cfg.otherwise_factor is not None:
            before, self.current = self.current, self._clamp(self.current * cfg.otherwise_factor)
            self.last_reason = f"{shown}: x{cfg.otherwise_factor:g} {before:.6g} -> {self.current:.6g}"
        else:
            self.last_reason = f"{shown}: hold"
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "LossPlateauSchedule",
            "version": _STATE_VERSION,
            "current": self.current,
            "ema_value": self.ema_value,
            "ema_count": self.ema_count,
            "history": list(self.history),
            "streak": self.streak,
            "cooldown_left": self.cooldown_left,
            "last_lr": self.last_lr,
            "last_lr_batch": self.last_lr_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, kind="LossPlateauSchedule", version=_STATE_VERSION)
        # A changed window keeps the newest values that still fit; a changed bound re-clamps.
        self.history = deque((float(v) for v in state["history"]), maxlen=self.history.maxlen)
        self.current = self._clamp(float(state["current"]))
        self.ema_value = float(state["ema_value"])
        self.ema_count = int(state["ema_count"])
        self.streak = int(state["streak"])
        self.cooldown_left = int(state["cooldown_left"])
        # Absent from states written before hold_while_lr_rises existed: start without an LR memory.
        last_lr, last_batch = state.get("last_lr"), state.get("last_lr_batch")
        self.last_lr = None if last_lr is None else float(last_lr)
        self.last_lr_batch = None if last_batch is None else int(last_batch)

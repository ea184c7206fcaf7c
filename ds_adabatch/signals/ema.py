"""A bias-corrected exponential moving average of the training loss."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EmaLoss"]

_STATE_VERSION = 1


class EmaLoss:
    """Bias-corrected EMA: ``value = m_t / (1 - beta^t)`` with ``m_t = beta m_{t-1} + (1 - beta) x_t``.

    Feed it the all-reduced (global-mean) loss so every rank holds the same value. Non-finite losses
    (an fp16 overflow step) are skipped and counted in ``skipped``, so one bad step cannot poison the
    average. Accepts floats or 0-d tensors. Restoring a state written with another ``beta`` restarts
    the average from the restored value.

    Args:
        beta: weight of the past, in [0, 1); 0 keeps the latest loss.
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EMA beta must be in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self._raw = 0.0
        self.count = 0
        """Values averaged so far."""
        self.skipped = 0
        """Non-finite values ignored."""

    @property
    def value(self) -> float | None:
        """The smoothed loss, None before the first finite value."""
        if self.count == 0:
            return None
        return self._raw / (1.0 - self.beta**self.count)

    def update(self, loss: Any) -> float | None:
        """Add one loss and return the smoothed value."""
        x = float(loss)
        if not math.isfinite(x):
            self.skipped += 1
            return self.value
        self.count += 1
        self._raw = self.beta * self._raw + (1.0 - self.beta) * x
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "EmaLoss",
            "version": _STATE_VERSION,
            "beta": self.beta,
            "raw": self._raw,
            "count": self.count,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "EmaLoss")
        self.skipped = int(state["skipped"])
        count = int(state["count"])
        if state["beta"] == self.beta or count == 0:
            self._raw, self.count = float(state["raw"]), count
            return
        # A changed beta cannot reuse the raw sum (its bias correction depends on beta): restart the
        # average from the restored smoothed value, weighted as one observation.
        restored = float(state["raw"]) / (1.0 - float(state["beta"]) ** count)
        self._raw, self.count = (1.0 - self.beta) * restored, 1


def _check_state(state: Any, kind: str, version: int = _STATE_VERSION) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"expected a {kind} state dict, got {found!r}")
    if state.get("version") != version:
        raise ValueError(
            f"{kind} state has version {state.get('version')!r}; this ds_adabatch reads {version}"
        )

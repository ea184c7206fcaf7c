"""The gradient-noise scale B_simple = tr(Sigma) / |G|^2 from gradient norms at two batch sizes.

For a gradient averaged over ``b`` independent samples, ``E |g_b|^2 = |G|^2 + tr(Sigma) / b``, where
``G`` is the true gradient and ``Sigma`` the per-sample gradient covariance (McCandlish et al. 2018,
appendix A). Two measured batch sizes give unbiased estimates of both terms::

    |G|^2     ~ (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / b_small - 1 / b_big)

Each single estimate is very noisy (|G|^2 can even come out negative), so the ratio is taken of two
separate bias-corrected EMAs, never of one measurement.

What the runtime measures, every ``measure_every`` optimizer steps, on a data-parallel job with
micro-batch ``m``, ``GAS`` accumulation steps and ``W`` ranks:

* ``b_small = m`` and ``sq_norm_small`` = the mean over ranks and micro-batches of the squared norm
  of one micro-batch's own mean gradient (all-reduce the sum of squares, divide by the count);
* ``b_big = W x m x GAS`` (the global batch) and ``sq_norm_big`` = the squared norm of the reduced
  mean gradient the optimizer steps with (before clipping).

All four numbers must be the same on every rank (all-reduced) so every rank holds the same estimate.
"""

from __future__ import annotations

import math
from typing import Any

from .ema import _check_state

__all__ = ["GradientNoiseEstimator"]

_STATE_VERSION = 1


class GradientNoiseEstimator:
    """Smoothed estimates of |G|^2, tr(Sigma) and their ratio B_simple (in samples).

    Restoring a state written with another ``ema_beta`` restarts both averages from the restored values.

    Args:
        ema_beta: weight of the past in both EMAs, in [0, 1), per measurement.
    """

    def __init__(self, ema_beta: float = 0.95) -> None:
        if not 0.0 <= ema_beta < 1.0:
            raise ValueError(f"ema_beta must be in [0, 1), got {ema_beta!r}")
        self.ema_beta = float(ema_beta)
        self._g2 = 0.0
        self._trace = 0.0
        self.count = 0
        """Measurements averaged so far."""
        self.skipped = 0
        """Measurements ignored because a norm was not finite (overflow steps)."""
        self.last_grad_sq_norm: float | None = None
        """The latest single |G|^2 estimate (unsmoothed)."""
        self.last_trace_sigma: float | None = None
        """The latest single tr(Sigma) estimate (unsmoothed)."""

    def _corrected(self, raw: float) -> float | None:
        if self.count == 0:
            return None
        return raw / (1.0 - self.ema_beta**self.count)

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed |G|^2, None before the first measurement."""
        return self._corrected(self._g2)

    @property
    def trace_sigma(self) -> float | None:
        """Smoothed tr(Sigma) (per-sample gradient variance, summed over parameters)."""
        return self._corrected(self._trace)

    @property
    def noise_scale(self) -> float | None:
        """B_simple = smoothed tr(Sigma) / smoothed |G|^2, in samples; None while |G|^2 <= 0."""
        g2, trace = self.grad_sq_norm, self.trace_sigma
        if g2 is None or trace is None or g2 <= 0.0:
            return None
        return trace / g2

    def update(self, b_small: float, sq_norm_small: Any, b_big: float, sq_norm_big: Any) -> float | None:
        """Add one measurement (floats or 0-d tensors) and return the current ``noise_scale``.

        Raises:
            ValueError: the batch sizes are not ``0 < b_small < b_big``.
        """
        if not 0 < b_small < b_big:
            raise ValueError(
                f"need 0 < b_small < b_big to separate signal from noise, got b_small={b_small!r}, "
                f"b_big={b_big!r}; measure with at least two micro-batches per optimizer step"
            )
        small, big = float(sq_norm_small), float(sq_norm_big)
        if not (math.isfinite(small) and math.isfinite(big)):
            self.skipped += 1
            return self.noise_scale
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
        beta = self.ema_beta
        self.count += 1
        self._g2 = beta * self._g2 + (1.0 - beta) * g2
        self._trace = beta * self._trace + (1.0 - beta) * trace
        self.last_grad_sq_norm, self.last_trace_sigma = g2, trace
        return self.noise_scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "GradientNoiseEstimator",
            "version": _STATE_VERSION,
            "ema_beta": self.ema_beta,
            "grad_sq_norm_raw": self._g2,
            "trace_sigma_raw": self._trace,
            "count": self.count,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "GradientNoiseEstimator")
        self.skipped = int(state["skipped"])
        count = int(state["count"])
        g2, trace = float(state["grad_sq_norm_raw"]), float(state["trace_sigma_raw"])
        if state["ema_beta"] == self.ema_beta or count == 0:
            self._g2, self._trace, self.count = g2, trace, count
            return
        # A changed ema_beta cannot reuse the raw sums (their bias correction depends on beta):
        # restart both averages from the restored smoothed values, weighted as one measurement.
        correction = 1.0 - float(state["ema_beta"]) ** count
        self._g2 = (1.0 - self.ema_beta) * g2 / correction
        self._trace = (1.0 - self.ema_beta) * trace / correction
        self.count = 1

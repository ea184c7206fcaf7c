"""The gradient-noise scale B_simple = tr(Sigma) / |G|^2 from gradient norms at two batch sizes.

For a gradient averaged over ``b`` independent samples, ``E |g_b|^2 = |G|^2 + tr(Sigma) / b``, where
``G`` is the true gradient and ``Sigma`` the per-sample gradient covariance (McCandlish et al. 2018,
appendix A). Two measured batch sizes give unbiased estimates of both terms::

    |G|^2     ~ (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / b_small - 1 / b_big)

Each single estimate is very noisy (|G|^2 can even come out negative), so the ratio is taken of two
separate bias-corrected EMAs, never of one measurement. Two things keep a schedule from acting on noise:

* the memory scales with the batch: a measurement of a global batch of ``B`` samples decays the past
  by ``ema_beta ** (B / reference_batch)`` (AdaptDL's rule), so the averages remember a fixed number of
  samples rather than of measurements. A measurement's information grows with the micro-batches it
  compares (``B / b_small`` of them), so this keeps the precision of the average the same at every
  batch, instead of trusting 20 steps of 2 samples as much as 20 steps of 64;
* :attr:`GradientNoiseEstimator.relative_error` is the standard error of the smoothed ratio relative
  to its value, from the weighted spread of the single estimates (first-order, covariance included).
  A schedule can wait until it is small: at micro-batches far below B_noise single estimates scatter
  over orders of magnitude and the average needs many of them.

What the runtime measures, every ``measure_every`` optimizer steps, on a data-parallel job with
micro-batch ``m``, ``GAS`` accumulation steps and ``W`` ranks:

* ``b_small = m`` and ``sq_norm_small`` = the mean over ranks and micro-batches of the squared norm
  of one micro-batch's own mean gradient (all-reduce the sum of squares, divide by the count);
* ``b_big = W x m x GAS`` (the global batch) and ``sq_norm_big`` = the squared norm of the reduced
  mean gradient the optimizer steps with (before clipping).

All four numbers must be the same on every rank (all-reduced) so every rank holds the same estimate.

With ``geometry: "adam"`` the runtime measures both squared norms with every coordinate divided by the
denominator of the Adam step taken, ``sqrt(v_hat) + eps`` (``ds_adabatch.runtime.noise.adam_geometry``). The
estimator is the same: for a per-coordinate weight ``P`` fixed within the step, ``E |P g_b|^2 = |P G|^2
+ tr(P Sigma P) / b``, so the ratio is the noise scale of the preconditioned step. (``v_hat`` includes
the step's own reduced gradient, a ``(1 - beta2)`` share of it, a small dependence the formula ignores.)
"""

from __future__ import annotations

import math
from typing import Any

from .ema import _check_state
from .noise_trend import extrapolate

__all__ = ["GradientNoiseEstimator"]

_STATE_VERSION = 2


class GradientNoiseEstimator:
    """Smoothed estimates of |G|^2, tr(Sigma) and their ratio B_simple (in samples), with an error bar.

    Restoring a state written with another ``ema_beta`` or ``reference_batch`` restarts the averages
    from the restored values.

    Args:
        ema_beta: weight of the past in both EMAs, in [0, 1), per measurement of ``reference_batch``
            samples.
        reference_batch: global batch (samples) at which one measurement decays the past by exactly
            ``ema_beta``; a measurement of ``B`` samples decays it by ``ema_beta ** (B /
            reference_batch)`` and weighs accordingly more. ``None``: every measurement decays by
            ``ema_beta`` whatever its batch.
        trend: also keep a twin of half the memory (``ema_beta ** 2``), fed the same measurements, and
            read :attr:`noise_scale_now` at the trend of the two (``ds_adabatch.signals.noise_trend``);
            off: :attr:`noise_scale_now` is :attr:`noise_scale`.
    """

    def __init__(
        self, ema_beta: float = 0.95, reference_batch: float | None = None, trend: bool = False
    ) -> None:
        if not 0.0 <= ema_beta < 1.0:
            raise ValueError(f"ema_beta must be in [0, 1), got {ema_beta!r}")
        if reference_batch is not None and not reference_batch > 0:
            raise ValueError(f"reference_batch must be > 0 samples or None, got {reference_batch!r}")
        self.ema_beta = float(ema_beta)
        self.reference_batch = None if reference_batch is None else float(reference_batch)
        # Decayed sums over measurements i with weights w_i: sum w, sum w^2, sum w x, sum w x^2 for
        # x = |G|^2 (g) and tr(Sigma) (t), and sum w g t. The means are the bias-corrected EMAs.
        self._w = self._w2 = 0.0
        self._g = self._gg = 0.0
        self._t = self._tt = 0.0
        self._gt = 0.0
        self._wi = 0.0  # sum w x (the measurement's number): the measurements' mean age
        self.count = 0
        """Measurements averaged so far."""
        self.skipped = 0
        """Measurements ignored because a norm was not finite (overflow steps)."""
        self.last_grad_sq_norm: float | None = None
        """The latest single |G|^2 estimate (unsmoothed)."""
        self.last_trace_sigma: float | None = None
        """The latest single tr(Sigma) estimate (unsmoothed)."""
        self.trend: GradientNoiseEstimator | None = (
            GradientNoiseEstimator(self.ema_beta**2, self.reference_batch) if trend else None
        )
        """The half-memory twin (``trend`` on), else None."""

    def _decay(self, b_big: float) -> float:
        if self.reference_batch is None:
            return self.ema_beta
        return self.ema_beta ** (b_big / self.reference_batch)

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed |G|^2, None before the first measurement."""
        return None if self.count == 0 or self._w <= 0 else self._g / self._w

    @property
    def trace_sigma(self) -> float | None:
        """Smoothed tr(Sigma) (per-sample gradient variance, summed over parameters)."""
        return None if self.count == 0 or self._w <= 0 else self._t / self._w

    @property
    def noise_scale(self) -> float | None:
        """B_simple = smoothed tr(Sigma) / smoothed |G|^2, in samples; None while |G|^2 <= 0."""
        g2, trace = self.grad_sq_norm, self.trace_sigma
        if g2 is None or trace is None or g2 <= 0.0:
            return None
        return trace / g2

    @property
    def noise_scale_or_inf(self) -> float | None:
        """:attr:`noise_scale`, with ``inf`` in place of None where measurements exist but the smoothed
        |G|^2 is not positive (the gradient reads as all noise); None only before a measurement. What a
        rule that reads "all noise" as a limit (AdaScale's gain: the batch ratio) is given."""
        if self.count == 0 or self._w <= 0:
            return None
        scale = self.noise_scale
        return math.inf if scale is None else scale

    @property
    def mean_age(self) -> float:
        """The weighted mean age of the averaged measurements, in measurements (0: the latest)."""
        return self.count - self._wi / self._w if self._w > 0 else 0.0

    @property
    def noise_scale_now(self) -> float | None:
        """:attr:`noise_scale` read at its trend's value now where ``trend`` is on and the half-memory
        twin clearly differs (``ds_adabatch.signals.noise_trend``); else :attr:`noise_scale`."""
        return self._now()[0]

    @property
    def relative_error_now(self) -> float:
        """The relative standard error of :attr:`noise_scale_now`."""
        return self._now()[1]

    def _now(self) -> tuple[float | None, float]:
        if self.trend is None:
            return self.noise_scale, self.relative_error
        return extrapolate(self, self.trend)

    @property
    def effective_measurements(self) -> float:
        """How many equally weighted measurements the averages are worth: (sum w)^2 / sum w^2."""
        return self._w * self._w / self._w2 if self._w2 > 0 else 0.0

    @property
    def relative_error(self) -> float:
        """Standard error of :attr:`noise_scale` relative to its value (``inf`` while unknown).

        First-order (delta method) error of the ratio of the two weighted means, from the weighted
        variances and covariance of the single estimates and the effective number of measurements;
        ``inf`` with fewer than two effective measurements or no usable estimate.
        """
        scale = self.noise_scale
        n = self.effective_measurements
        if scale is None or scale <= 0 or n <= 1.0 + 1e-9:
            return math.inf
        w = self._w
        g, t = self._g / w, self._t / w
        var_g = max(self._gg / w - g * g, 0.0)
        var_t = max(self._tt / w - t * t, 0.0)
        cov = self._gt / w - g * t
        rel_sq = var_t / (t * t) + var_g / (g * g) - 2.0 * cov / (g * t)
        return math.sqrt(max(rel_sq, 0.0) / (n - 1.0))

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
        f = self._decay(float(b_big))
        w = 1.0 - f  # a bias-corrected EMA: the newest measurement weighs 1 - decay
        self.count += 1
        self._w = f * self._w + w
        self._w2 = f * f * self._w2 + w * w
        self._g = f * self._g + w * g2
        self._gg = f * self._gg + w * g2 * g2
        self._t = f * self._t + w * trace
        self._tt = f * self._tt + w * trace * trace
        self._gt = f * self._gt + w * g2 * trace
        self._wi = f * self._wi + w * self.count
        if self.trend is not None:
            self.trend.update(b_small, small, b_big, big)
        self.last_grad_sq_norm, self.last_trace_sigma = g2, trace
        return self.noise_scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "GradientNoiseEstimator",
            "version": _STATE_VERSION,
            "ema_beta": self.ema_beta,
            "reference_batch": self.reference_batch,
            "sums": [self._w, self._w2, self._g, self._gg, self._t, self._tt, self._gt],
            "count": self.count,
            "skipped": self.skipped,
            "index_sum": self._wi,
            "trend": None if self.trend is None else self.trend.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version") if isinstance(state, dict) else None
        if version == 1 and state.get("kind") == "GradientNoiseEstimator":
            state = _from_version_1(state)
        _check_state(state, "GradientNoiseEstimator", _STATE_VERSION)
        self.skipped = int(state["skipped"])
        count = int(state["count"])
        sums = [float(v) for v in state["sums"]]
        same = state["ema_beta"] == self.ema_beta and state["reference_batch"] == self.reference_batch
        twin = state.get("trend")
        if self.trend is not None and isinstance(twin, dict):
            self.trend.load_state_dict(twin)  # (a state without one: the twin starts empty)
        if same or count == 0:
            self._w, self._w2, self._g, self._gg, self._t, self._tt, self._gt = sums
            self.count = count
            # A state without the measurements' ages reads them as the latest's (no trend until new
            # measurements age them).
            self._wi = float(state.get("index_sum", self._w * count))
            return
        # Other smoothing settings cannot reuse the sums (their weights depend on them): restart both
        # averages from the restored means, weighted as one measurement (its error then unknown).
        w = sums[0]
        g, t = sums[2] / w, sums[4] / w
        self._w = self._w2 = 1.0
        self._g, self._gg, self._t, self._tt, self._gt = g, g * g, t, t * t, g * t
        self.count = 1
        self._wi = 1.0


def _from_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept the two plain EMAs only: their means carry over, their spread is unknown.

    The restored averages count as one measurement, so :attr:`GradientNoiseEstimator.relative_error`
    is unknown until new measurements arrive.
    """
    count = int(state["count"])
    beta = float(state["ema_beta"])
    w = 1.0 - beta**count if count else 0.0
    g, t = float(state["grad_sq_norm_raw"]), float(state["trace_sigma_raw"])
    mean_g, mean_t = (g / w, t / w) if w > 0 else (0.0, 0.0)
    sums = [w, w * w, g, w * mean_g * mean_g, t, w * mean_t * mean_t, w * mean_g * mean_t]
    return {
        "kind": "GradientNoiseEstimator",
        "version": _STATE_VERSION,
        "ema_beta": beta,
        "reference_batch": None,
        "sums": sums,
        "count": count,
        "skipped": int(state["skipped"]),
    }

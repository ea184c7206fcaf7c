"""The gradient-noise scale read at its trend's value now, not at the average age of its measurements.

A smoothed estimate (:class:`~ds_adabatch.signals.GradientNoiseEstimator`) reads the noise scale as it
was about one EMA memory ago: its measurements' weighted mean age is ``f / (1 - f)`` measurements at a
decay ``f`` per measurement (19 at 0.95). Where a measurement comes only every ~17 steps (one rank at GAS
1, whose noise is measured by splitting a step, ``ds_adabatch.runtime.noise.probe``) that is ~320 steps,
while early in training B_noise grows several-fold over a few hundred steps: the estimate then reads it
2-2.5x low, and a schedule that rates batches by it (``goodput``) holds a batch the noise has outgrown.

With ``trend`` on, the estimator keeps a second estimate of half the memory (decay ``f^2``: mean age
about half) fed the same measurements. Where the noise scale changes as ``exp(r x age)``, the two read
it at their mean ages ``a_long`` and ``a_short``::

    log B_short - log B_long = r (a_long - a_short)      =>      log B_now = log B_long + r a_long

and the extrapolation to age 0 is ``B_long x (B_short / B_long) ** (a_long / (a_long - a_short))``
(about the square of their ratio). It is taken only where the two differ by more than twice the standard
error of their log ratio, so a noise scale that does not move reads exactly as the long estimate. That
standard error: the two averages share their measurements, so their difference scatters less than
either; for EMAs of decays ``f^2`` and ``f`` its variance is ``(Var_short - Var_long) / 3`` within a few
percent for ``f`` in 0.8-0.99 (exact for one decay per measurement as ``f -> 1``; with the batch-scaled
decays of the estimator a close approximation). The extrapolated value's relative error adds the
extrapolation's own: ``sqrt(e_long^2 + k^2 se^2)`` with ``k = a_long / (a_long - a_short)``.

The extrapolation is bounded: it moves the long estimate by at most :data:`MAX_FACTOR` either way.
"""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["MAX_FACTOR", "extrapolate"]

MAX_FACTOR = 4.0
"""The most the trend moves the long estimate, up or down (a ratio)."""


class _Smoothed(Protocol):
    noise_scale: float | None
    relative_error: float
    mean_age: float


def extrapolate(long: _Smoothed, short: _Smoothed) -> tuple[float | None, float]:
    """``(noise scale, relative error)`` at the trend's value now (module docstring), from the long
    estimate and its half-memory twin; the long estimate's own where the two do not clearly differ or
    either is unknown."""
    b_long, e_long = long.noise_scale, long.relative_error
    b_short, e_short = short.noise_scale, short.relative_error
    if b_long is None or b_short is None or b_long <= 0 or b_short <= 0:
        return b_long, e_long
    if not (math.isfinite(e_long) and math.isfinite(e_short)):
        return b_long, e_long
    diff = math.log(b_short / b_long)
    se = math.sqrt(max(e_short * e_short - e_long * e_long, 0.0) / 3.0)
    age_long, age_short = long.mean_age, short.mean_age
    if abs(diff) <= 2.0 * se or not age_long > age_short:
        return b_long, e_long
    k = age_long / (age_long - age_short)
    step = max(-math.log(MAX_FACTOR), min(math.log(MAX_FACTOR), k * diff))
    return b_long * math.exp(step), math.sqrt(e_long * e_long + k * k * se * se)

"""How the ``goodput`` schedule compares two batches' measured or predicted speeds, says its ratings,
and reads the noise estimate's uncertainty.

A speed is ``(samples per second, plan)``; a rating ``(samples per second, efficiency, plan)`` (the plan
a batch runs as: a :class:`~ds_adabatch.plan.BatchPlan`, or with token budgets a
:class:`~ds_adabatch.schedules.goodput_tokens.PackedShape`).
"""

from __future__ import annotations

import math
from typing import Any

from .goodput_tokens import describe_split

__all__ = ["WIDEST_ERROR", "cost_gains", "rated", "sped", "step_cost", "uncertainty_band"]

WIDEST_ERROR = 5.0
"""Relative errors above this bound nothing (a factor exp(10) either way): the schedule holds."""


def cost_gains(
    batch: int, speed: tuple[float, Any], ref: int, ref_speed: tuple[float, Any]
) -> tuple[float, float]:
    """``batch``'s goodput over ``ref``'s at the two ends of B_noise: near 0 (their steps/s ratio) and
    far above both (their samples/s ratio)."""
    samples = speed[0] / ref_speed[0]
    return samples * ref / batch, samples


def step_cost(batch: int, speed: tuple[float, Any], ref: int, ref_speed: tuple[float, Any]) -> str:
    """How much more (or less) a step of ``batch`` costs than one of ``ref``, as a signed percentage."""
    return f"{1.0 / cost_gains(batch, speed, ref, ref_speed)[0] - 1:+.1%}"


def sped(speed: tuple[float, Any]) -> str:
    """``123.4 samples/s (micro 8 x gas 2)``."""
    samples_per_s, plan = speed
    return f"{samples_per_s:.4g} samples/s ({describe_split(plan)})"


def rated(rating: tuple[float, float, Any]) -> str:
    """``123.4 samples/s x efficiency 0.900 = goodput 111.1 (micro 8 x gas 2)``."""
    samples_per_s, efficiency, plan = rating
    return (
        f"{samples_per_s:.4g} samples/s x efficiency {efficiency:.3f} = goodput {samples_per_s * efficiency:.4g} "
        f"({describe_split(plan)})"
    )


def uncertainty_band(
    noise: float, error: float | None, max_relative_error: float | None
) -> tuple[float, ...] | None:
    """Where the noise scale may be: None for a confident estimate (relative ``error`` at most
    ``max_relative_error``, no test, or no error given); else ``(low, high)``: two relative standard
    errors either side on a log scale, as ``max_relative_error`` reads them; ``()`` for an error too
    large (or unknown) to bound."""
    if max_relative_error is None or error is None or error <= max_relative_error:
        return None  # no test, or a value given without an error (ds-adabatch simulate)
    if not math.isfinite(error) or error > WIDEST_ERROR:
        return ()
    spread = math.exp(2.0 * error)
    return (noise / spread, noise * spread)

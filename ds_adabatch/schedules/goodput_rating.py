"""Which batches the ``goodput`` schedule rates, how it compares two batches' measured or predicted
speeds, how it says its ratings, and how it reads the noise estimate's uncertainty.

A speed is ``(samples per second, plan)``; a rating ``(samples per second, efficiency, plan)`` (the plan
a batch runs as: a :class:`~ds_adabatch.plan.BatchPlan`, or with token budgets a
:class:`~ds_adabatch.schedules.goodput_tokens.PackedShape`).
"""

from __future__ import annotations

import math
from typing import Any

from ..plan import plannable_grid
from .goodput_tokens import describe_split

__all__ = [
    "WIDEST_ERROR",
    "candidate_batches",
    "cost_gains",
    "rated",
    "sped",
    "step_cost",
    "uncertainty_band",
]

MAX_CANDIDATES = 512
"""More plannable batches than this are rated on a geometric grid of about 1% steps (on multiples)."""

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


def candidate_batches(
    world: int,
    reference: int,
    current: int,
    bounds: tuple[int, int | None, float | None],
    granularity: int,
    allow_uneven: bool,
) -> list[int]:
    """The batches a decision from ``reference`` rates at ``world`` ranks: the plannable ones (multiples
    of the world size and ``granularity``, or any with ``allow_uneven``) within ``bounds`` (the smallest
    and largest batch considered, and the section's ``max_change_factor`` about ``current``), with
    ``reference`` itself; above :data:`MAX_CANDIDATES` on a geometric grid."""
    min_global_batch, max_global_batch, f = bounds
    multiple, lowest, highest = plannable_grid(
        world, granularity, min_global_batch, max_global_batch, allow_uneven
    )
    if highest is None:  # the config requires max_global_batch; a replay without one stays near
        highest = max(reference, lowest) * 4
    if f is not None:  # the controller's window about the current batch
        lowest = max(lowest, math.ceil(current / f / multiple - 1e-9) * multiple)
        highest = min(highest, math.floor(current * f / multiple + 1e-9) * multiple)
    count = (highest - lowest) // multiple + 1
    if count <= MAX_CANDIDATES:
        values: set[int] | range = range(lowest, highest + 1, multiple)
    else:  # a geometric grid of about 1% steps, on multiples
        ratio = (highest / lowest) ** (1.0 / (MAX_CANDIDATES - 1))
        values = {lowest, highest}
        for i in range(MAX_CANDIDATES):
            values.add(min(highest, max(lowest, round(lowest * ratio**i / multiple) * multiple)))
    return sorted({*values, reference})

"""Round a schedule's desired global batch to one the planner can split.

A schedule's intermediate values need not be plannable (a linear ramp 16 -> 64 on 2 ranks passes 17).
The runtime rounds every desired value with :func:`round_global_batch`; the rounding is logged, never
an error. Only a setting with *no* feasible value at all (bounds that admit no multiple) is an error.
"""

from __future__ import annotations

import math

from .solver import PlanError

__all__ = ["batch_multiple", "feasible_range", "nearest_plannable", "plannable_grid", "round_global_batch"]


def batch_multiple(world_size: int, granularity: int = 1, allow_uneven: bool = False) -> int:
    """Every planned global batch is a multiple of this number.

    ``granularity`` always applies; without ``allow_uneven`` the world size does too (an even split),
    so the multiple is their least common multiple.
    """
    return granularity if allow_uneven else math.lcm(granularity, world_size)


def feasible_range(
    world_size: int,
    *,
    granularity: int = 1,
    min_global_batch: int | None = None,
    max_global_batch: int | None = None,
    allow_uneven: bool = False,
) -> tuple[int, int | None]:
    """The smallest and largest plannable global batch (``None``: unbounded above).

    Raises:
        PlanError: the bounds admit no multiple of :func:`batch_multiple`.
    """
    step = batch_multiple(world_size, granularity, allow_uneven)
    lo = math.ceil(max(min_global_batch or 1, 1) / step) * step
    hi = None if max_global_batch is None else (max_global_batch // step) * step
    if hi is not None and hi < lo:
        why = f"granularity {granularity}" + ("" if allow_uneven else f" and world size {world_size}")
        raise PlanError(
            f"no global batch between min_global_batch={min_global_batch} and "
            f"max_global_batch={max_global_batch} is a multiple of {step} ({why}); widen the bounds "
            f"or change granularity" + ("" if allow_uneven else " or set allow_uneven")
        )
    return lo, hi


def round_global_batch(
    desired: float,
    world_size: int,
    *,
    granularity: int = 1,
    min_global_batch: int | None = None,
    max_global_batch: int | None = None,
    allow_uneven: bool = False,
) -> int:
    """The plannable global batch nearest to ``desired`` (ties round up), inside the bounds.

    Planned batches are multiples of ``granularity`` and, without ``allow_uneven``, of the world
    size; they never leave ``[min_global_batch, max_global_batch]``.
    """
    if not math.isfinite(desired):
        raise PlanError(f"desired global batch must be a finite number, got {desired!r}")
    step, lo, hi = plannable_grid(world_size, granularity, min_global_batch, max_global_batch, allow_uneven)
    return _clamp(math.floor(desired / step + 0.5) * step, lo, hi)


def nearest_plannable(
    value: int,
    world_size: int,
    *,
    granularity: int = 1,
    min_global_batch: int | None = None,
    max_global_batch: int | None = None,
    allow_uneven: bool = False,
) -> list[int]:
    """The plannable global batches next to ``value`` (below and above, inside the bounds), ascending.

    What an error should suggest instead of a batch that cannot be planned: multiples of
    :func:`batch_multiple` within ``[min_global_batch, max_global_batch]``.

    Raises:
        PlanError: the bounds admit no plannable batch at all.
    """
    step, lo, hi = plannable_grid(world_size, granularity, min_global_batch, max_global_batch, allow_uneven)
    below, above = (value // step) * step, -(-value // step) * step
    return sorted({_clamp(below, lo, hi), _clamp(above, lo, hi)})


def plannable_grid(
    world_size: int,
    granularity: int,
    min_global_batch: int | None,
    max_global_batch: int | None,
    allow_uneven: bool,
) -> tuple[int, int, int | None]:
    """(multiple, smallest, largest or None) of the plannable global batches: :func:`batch_multiple`
    and :func:`feasible_range` together."""
    lo, hi = feasible_range(
        world_size,
        granularity=granularity,
        min_global_batch=min_global_batch,
        max_global_batch=max_global_batch,
        allow_uneven=allow_uneven,
    )
    return batch_multiple(world_size, granularity, allow_uneven), lo, hi


def _clamp(value: int, lo: int, hi: int | None) -> int:
    return int(max(value, lo) if hi is None else min(max(value, lo), hi))

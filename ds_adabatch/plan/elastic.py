"""Global batch sizes that stay valid when the number of GPUs changes.

DeepSpeed's ``elasticity`` section (removed in 0.19.8) computed batch sizes that admit an even split
for a whole range of GPU counts, so a job can be restarted on more or fewer GPUs with the same
optimisation. :func:`compatible_batch_sizes` does the same on top of :func:`plan_batch`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .solver import PlanError, plan_batch

__all__ = ["CompatibleBatchSize", "compatible_batch_sizes"]


@dataclass(frozen=True)
class CompatibleBatchSize:
    """A global batch size and the world sizes for which it has an even plan."""

    global_batch_size: int
    world_sizes: tuple[int, ...]
    """World sizes (from the requested set) with an even plan meeting the micro/GAS limits."""

    @property
    def coverage(self) -> int:
        return len(self.world_sizes)


def compatible_batch_sizes(
    max_batch_size: int,
    world_sizes: Iterable[int],
    max_micro_batch_per_gpu: int,
    *,
    min_batch_size: int = 1,
    min_micro_batch_per_gpu: int = 1,
    max_gradient_accumulation_steps: int | None = None,
    granularity: int = 1,
) -> list[CompatibleBatchSize]:
    """Global batch sizes in ``[min_batch_size, max_batch_size]`` with an even plan on many world sizes.

    A world size ``W`` counts for a batch ``B`` when ``plan_batch(B, W, max_micro_batch_per_gpu)``
    exists, its micro-batch is at least ``min_micro_batch_per_gpu`` (so a GPU is not left nearly idle)
    and its accumulation steps are at most ``max_gradient_accumulation_steps``.

    Returns:
        Every batch valid for at least one world size, ranked by the number of world sizes it is
        valid for (most first), then by size (largest first): the first entry is the pick that
        survives the most changes of GPU count.
    """
    sizes = sorted(set(world_sizes))
    if not sizes or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in sizes):
        raise PlanError(f"world_sizes must be a non-empty set of integers >= 1, got {sizes!r}")
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_micro_batch_per_gpu", max_micro_batch_per_gpu),
        ("min_batch_size", min_batch_size),
        ("min_micro_batch_per_gpu", min_micro_batch_per_gpu),
        ("granularity", granularity),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    if min_micro_batch_per_gpu > max_micro_batch_per_gpu:
        raise PlanError(
            f"min_micro_batch_per_gpu ({min_micro_batch_per_gpu}) exceeds max_micro_batch_per_gpu "
            f"({max_micro_batch_per_gpu})"
        )

    found: list[CompatibleBatchSize] = []
    first = -(-min_batch_size // granularity) * granularity
    for batch in range(first, max_batch_size + 1, granularity):
        valid = []
        for w in sizes:
            if batch % w:
                continue
            plan = plan_batch(batch, w, max_micro_batch_per_gpu)
            if plan.micro_batch_per_gpu < min_micro_batch_per_gpu:
                continue
            if (
                max_gradient_accumulation_steps
                and plan.gradient_accumulation_steps > max_gradient_accumulation_steps
            ):
                continue
            valid.append(w)
        if valid:
            found.append(CompatibleBatchSize(batch, tuple(valid)))
    found.sort(key=lambda c: (-c.coverage, -c.global_batch_size))
    return found

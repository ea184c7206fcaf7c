"""Solve ``global batch = ranks x micro-batch x gradient-accumulation steps`` for one optimizer step.

A :class:`BatchPlan` says, for every data-parallel rank and every accumulation step, how many samples
that rank processes. All ranks always run the same number of accumulation steps (a collective in every
backward pass requires it); with ``allow_uneven`` the sizes of those micro-batches may differ by one,
and a rank may hold an empty slot (filled by the runtime with a zero-weight pad) when the global batch
is smaller than ``world_size x steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["BatchPlan", "PlanError", "plan_batch"]


class PlanError(ValueError):
    """A global batch cannot be split under the given constraints; the message names feasible ones."""


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split over ranks and accumulation steps.

    Slots are numbered step-major: slot ``k = step * world_size + rank``. Every slot holds ``base``
    samples and the first ``extra`` slots hold one more, so sizes differ by at most one and the fuller
    slots come first. An even plan has ``extra == 0``.
    """

    global_batch_size: int
    """Real samples in the optimizer step, over all ranks and accumulation steps."""
    world_size: int
    """Data-parallel ranks."""
    gradient_accumulation_steps: int
    """Forward/backward passes per rank before the optimizer step (same on every rank)."""
    max_micro_batch_per_gpu: int = field(compare=False)
    """The bound the plan was solved under (samples per forward pass)."""

    def __post_init__(self) -> None:
        # plan_batch builds valid plans; this guards plans built by hand or loaded from a checkpoint.
        for name in (
            "global_batch_size",
            "world_size",
            "gradient_accumulation_steps",
            "max_micro_batch_per_gpu",
        ):
            _check_positive_int(name, getattr(self, name))
        if self.micro_batch_per_gpu > self.max_micro_batch_per_gpu:
            raise PlanError(
                f"a micro-batch of {self.micro_batch_per_gpu} exceeds max_micro_batch_per_gpu "
                f"{self.max_micro_batch_per_gpu}: use more gradient_accumulation_steps"
            )

    @property
    def _slots(self) -> int:
        return self.world_size * self.gradient_accumulation_steps

    @property
    def _base(self) -> int:
        return self.global_batch_size // self._slots

    @property
    def _extra(self) -> int:
        return self.global_batch_size % self._slots

    @property
    def micro_batch_per_gpu(self) -> int:
        """The largest micro-batch of the plan (samples per forward pass on one rank)."""
        return self._base + (1 if self._extra else 0)

    @property
    def is_even(self) -> bool:
        """True when every rank processes the same number of samples in every accumulation step."""
        return self._extra == 0

    @property
    def has_padding(self) -> bool:
        """True when some slot is empty: that rank runs a zero-weight pad in that step."""
        return self._base == 0

    def micro_batch_sizes(self, rank: int) -> tuple[int, ...]:
        """Samples of ``rank`` in each accumulation step (one entry per step; 0 means a pad)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return tuple(
            self._base + (1 if step * self.world_size + rank < self._extra else 0)
            for step in range(self.gradient_accumulation_steps)
        )

    def rank_batch_size(self, rank: int) -> int:
        """Real samples ``rank`` processes in the whole optimizer step."""
        return sum(self.micro_batch_sizes(rank))

    def slot_offsets(self) -> list[list[tuple[int, int]]]:
        """``[step][rank] -> (start, stop)`` positions of each slot inside the global batch.

        The global batch is laid out step-major, so the samples of accumulation step 0 on all ranks
        come first. Data code uses this to cut one global order into shards.
        """
        out: list[list[tuple[int, int]]] = []
        pos = 0
        for step in range(self.gradient_accumulation_steps):
            row = []
            for rank in range(self.world_size):
                n = self._base + (1 if step * self.world_size + rank < self._extra else 0)
                row.append((pos, pos + n))
                pos += n
            out.append(row)
        return out

    def deepspeed_batch_keys(self) -> dict[str, int]:
        """DeepSpeed's three batch keys for this plan.

        DeepSpeed requires ``train_batch_size == micro x GAS x world``; for an uneven plan the keys
        describe the padded shape (largest micro-batch), while the runtime weights each micro-batch by
        its real size so the update is still the mean over ``global_batch_size`` samples.
        """
        micro = self.micro_batch_per_gpu
        gas = self.gradient_accumulation_steps
        return {
            "train_batch_size": micro * gas * self.world_size,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }

    def describe(self) -> str:
        """One line: ``global 14 = micro 4 x gas 4 on 1 rank (uneven)``."""
        ranks = "rank" if self.world_size == 1 else "ranks"
        shape = "" if self.is_even else (" (uneven, padded)" if self.has_padding else " (uneven)")
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_per_gpu} x gas "
            f"{self.gradient_accumulation_steps} on {self.world_size} {ranks}{shape}"
        )

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "micro_batch_per_gpu": self.micro_batch_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "max_micro_batch_per_gpu": self.max_micro_batch_per_gpu,
            "even": self.is_even,
        }


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _nearest_multiples(value: int, multiple: int) -> list[int]:
    low = (value // multiple) * multiple
    return sorted({m for m in (low, low + multiple) if m >= multiple})


def plan_batch(
    global_batch_size: int,
    world_size: int,
    max_micro_batch_per_gpu: int,
    *,
    allow_uneven: bool = False,
) -> BatchPlan:
    """Split ``global_batch_size`` samples over ``world_size`` ranks with the fewest accumulation steps.

    Even plans (every slot the same size) need ``global_batch_size % world_size == 0``; they use the
    fewest steps ``g`` such that ``g`` divides the per-rank count and the micro-batch fits
    ``max_micro_batch_per_gpu``. With ``allow_uneven=True`` any global batch >= 1 is possible and the
    fewest steps win, ``ceil(B / (world x max_micro))``, even where an even plan with more steps exists:
    14 samples, 1 rank, max micro 4 gives ``4, 4, 3, 3`` rather than ``7 x 2``.

    Raises:
        PlanError: the arguments are not positive integers, or no even plan exists; the message names
            the nearest feasible global batches.
    """
    b = _check_positive_int("global_batch_size", global_batch_size)
    w = _check_positive_int("world_size", world_size)
    m = _check_positive_int("max_micro_batch_per_gpu", max_micro_batch_per_gpu)

    if allow_uneven:
        steps = math.ceil(b / (w * m))
        return BatchPlan(b, w, steps, m)

    if b % w:
        near = ", ".join(str(n) for n in _nearest_multiples(b, w))
        raise PlanError(
            f"global batch {b} does not split evenly over {w} ranks; the nearest even global batches "
            f"are {near} (multiples of the world size), or set allow_uneven to split {b} unevenly"
        )
    per_rank = b // w
    steps = math.ceil(per_rank / m)
    while per_rank % steps:
        steps += 1
    return BatchPlan(b, w, steps, m)

"""What a loader hands the runtime for one optimizer step: this rank's passes (:class:`MicroBatch`) in a
:class:`StepBatch`. Shared by the sample and the token-budget loaders and their base."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_adabatch.plan import BatchPlan

    from .sampler import GlobalBatch

__all__ = ["MicroBatch", "StepBatch"]


# Identity equality: batches hold tensors, whose == is elementwise.
@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One forward/backward pass of one rank.

    Attributes:
        batch: The collated samples. For a pad: one real sample, to be weighted 0 (several pad slots of
            one step share this object; treat it as read-only).
        indices: Dataset indices of the real samples (empty for a pad). For an ``IterableDataset``: the
            ordinals of the samples in this rank's stream.
        num_samples: Real samples in the pass (0 for a pad); the loss weight is proportional to it.
    """

    batch: Any
    indices: tuple[int, ...]
    num_samples: int

    @property
    def is_pad(self) -> bool:
        """True for a zero-weight pad."""
        return self.num_samples == 0


# Identity equality: batches hold tensors, whose == is elementwise.
@dataclass(frozen=True, eq=False)
class StepBatch:
    """This rank's micro-batches for one optimizer step.

    Attributes:
        micro_batches: One per accumulation step, in order (pads included).
        plan: The plan actually used (the epoch tail's replan where it differs from the requested one);
            the runtime configures the engine with it.
        rank: The rank these micro-batches belong to.
        epoch: Epoch of the samples (for an ``IterableDataset``: passes completed when the step was drawn).
        global_batch: The whole global batch over all ranks (``None`` for an ``IterableDataset``).
    """

    micro_batches: tuple[MicroBatch, ...]
    plan: BatchPlan
    rank: int
    epoch: int
    global_batch: GlobalBatch | None

    @property
    def num_samples(self) -> int:
        """Real samples of this rank in the step."""
        return sum(m.num_samples for m in self.micro_batches)

    @property
    def global_batch_size(self) -> int:
        """Real samples of the step over all ranks."""
        return self.plan.global_batch_size

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.micro_batches)

    def __getitem__(self, step: int) -> MicroBatch:
        return self.micro_batches[step]

"""The draw of an optimizer step: its global batch taken from the loader for the decided plan.

:meth:`StepCore.draw <ds_adabatch.runtime.core.step_core.StepCore.draw>` calls :func:`draw_step`; every
entry point draws through it (``train_batch``, the forward / backward / step loop, the pipeline engine,
the Trainer's step loader). What the draw settles beyond the decided plan, the holder applies its own way
(:class:`Drawn`):

    tail      the epoch's last global batch is smaller: the loader re-planned it (``tail``, a plan change
              to apply and record, "last batch of the epoch")
    split     a noise measurement on a step of one pass in total (one rank, one accumulation step, two
              samples or more): the same samples cut into two half passes (``split``, applied without a
              record), so a pass's gradient can be compared with the step's; ``restore`` is the plan to
              go back to after the step (``runtime/noise/probe.py``, ``NoiseCadence``)

:meth:`StepCore.recut <ds_adabatch.runtime.core.step_core.StepCore.recut>` cuts a drawn step anew for
another plan through the same loader (the same samples; nothing is consumed), as the split above does: an
out-of-memory retry at a smaller micro-batch (``runtime/memory/recovery.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...plan import BatchPlan, plan_batch

if TYPE_CHECKING:
    from ...data.step_batch import StepBatch

__all__ = ["Drawn", "StepSource", "draw_step"]


class StepSource(Protocol):
    """A loader that hands out optimizer steps (``data.loader.ElasticDataLoader``,
    ``data.token_loader.TokenBudgetLoader``)."""

    def next_step(self, plan: BatchPlan, *, load: bool = True) -> StepBatch:
        """The next global batch for ``plan``, this rank's micro-batches (``load=False``: not read)."""
        ...

    def reload(self, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """``step``'s samples again, cut for ``plan``; consumes nothing."""
        ...


@dataclass(frozen=True)
class Drawn:
    """What :func:`draw_step` drew, and the plans the holder applies around it."""

    step: StepBatch
    """This rank's micro-batches of the step, cut for the plan the step runs at."""
    tail: BatchPlan | None = None
    """The epoch tail's plan (the last global batch of an epoch is smaller): apply it with a record
    before the step runs; None when the step runs at the decided plan."""
    split: BatchPlan | None = None
    """Two half passes for a noise measurement: apply it (no record) before the step runs; None when
    the step is not split."""
    restore: BatchPlan | None = None
    """With ``split``: the plan to go back to after the step (no record); None otherwise."""

    @property
    def plan(self) -> BatchPlan:
        """The plan the step runs at."""
        return self.step.plan


def draw_step(
    source: StepSource, plan: BatchPlan, *, world_size: int, split: bool = False, load: bool = True
) -> Drawn:
    """The next optimizer step of ``source`` for the decided ``plan``.

    Args:
        source: the holder's loader.
        plan: the decided plan of the step.
        world_size: the data-parallel ranks the plans are made for.
        split: a noise measurement is due; a step of one pass in total (``world_size`` x GAS == 1, two
            samples or more) is cut into two half passes.
        load: False: advance past the step without reading its samples (a pipeline stage that feeds
            nothing).
    """
    step = source.next_step(plan, load=load)
    runs = step.plan
    tail = runs if runs != plan else None
    size = step.global_batch.size if step.global_batch is not None else 0
    if not (split and world_size * runs.gradient_accumulation_steps == 1 and size >= 2):
        return Drawn(step, tail)
    halves = plan_batch(size, world_size, -(-size // 2), allow_uneven=True)
    return Drawn(source.reload(step, halves), tail, split=halves, restore=runs)

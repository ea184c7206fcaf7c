"""What the Trainer's loop iterates: one item per optimizer step, holding this rank's micro-batches.

The Hugging Face loop (transformers 5.23 ``Trainer._run_epoch``) pulls items from the training
dataloader and groups ``gradient_accumulation_steps`` of them into one optimizer step. Here the
Trainer runs with ``gradient_accumulation_steps=1`` and every item is a :class:`StepInputs`: the whole
step, cut for the plan the schedule chose just before the item was drawn. Nothing is prefetched past
a decision (the :class:`~ds_adabatch.data.ElasticDataLoader` drops a speculative load whose plan
turned out different), so no micro-batch of a stale size is ever served.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from ds_adabatch.data import MicroBatch, StepBatch

from .state import AdaptiveBatchState

__all__ = ["StepInputs", "StepLoader"]


class StepInputs:
    """One optimizer step of this rank, as the Trainer's loop hands it to ``training_step``."""

    __slots__ = ("started", "step")

    def __init__(self, step: StepBatch, started: float | None = None) -> None:
        self.step = step
        self.started = started
        """When the step began (``time.perf_counter``): before its decision and its data, as the
        engine's ``train_batch`` times a step; None: when ``training_step`` begins."""

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """One collated micro-batch per accumulation step (zero-weight pads included)."""
        return self.step.micro_batches

    def __repr__(self) -> str:
        sizes = [m.num_samples for m in self.step.micro_batches]
        return f"StepInputs({self.step.plan.describe()}, rank {self.step.rank} samples {sizes})"


class StepLoader:
    """The Trainer's training "dataloader": yields :class:`StepInputs` until the epoch's samples run out.

    An epoch of the Trainer is an epoch of the sample stream: iteration stops when the next global
    batch would come from the following epoch, however many steps that took.

    Args:
        state: the run's batch state (schedule, sampler, this rank's loader).
        completed_steps: returns the optimizer steps completed so far (the Trainer's ``global_step``).
    """

    def __init__(self, state: AdaptiveBatchState, completed_steps: Callable[[], int]) -> None:
        self.state = state
        self._completed_steps = completed_steps
        self._epoch = 0
        self.len_is_bound = False
        """``len()`` is the dataset's samples, a bound on any epoch's steps (transformers 4.57's loop
        runs that many updates per epoch, read at its start; ``hf.compat``)."""

    @property
    def dataset(self) -> Any:
        """The training dataset (read by callbacks that report its size)."""
        return self.state.dataset

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer before each epoch: the sample-stream epoch this pass covers."""
        self._epoch = int(epoch)

    def __len__(self) -> int:
        """Optimizer steps one epoch takes at the current global batch (an estimate when it changes)."""
        if self.len_is_bound:
            return self.state.sampler.num_samples
        return math.ceil(self.state.sampler.num_samples / self.state.samples_per_step)

    def __iter__(self) -> Iterator[StepInputs]:
        state, epoch = self.state, self._epoch
        while True:
            # The step's time (goodput's throughput model) includes its decision (made by
            # next_batch_epoch) and its data.
            started = time.perf_counter()
            state.step_times.step_started()
            step = self._completed_steps()
            upcoming = state.next_batch_epoch(step)
            if upcoming > epoch:
                return
            if upcoming < epoch:  # the Trainer skipped an epoch the stream has not finished
                raise RuntimeError(
                    f"the Trainer started epoch {epoch} but the sample stream is still in epoch {upcoming}"
                )
            # The core draws the step (state.last_step); an epoch's smaller tail needs nothing here:
            # the Trainer's step applies each step's own plan as it starts (hf/step.py, apply_plan).
            yield StepInputs(state.core.draw(state.loader, state.plan_for_step(step)).step, started)

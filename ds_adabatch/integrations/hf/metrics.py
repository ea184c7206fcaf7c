"""Per-step records of an ``AdaptiveBatchSizeTrainer`` run: ``adabatch.log`` as the runtime writes it.

Every optimizer step makes one :class:`~ds_adabatch.runtime.core.metrics.StepMetrics` record (global batch,
micro-batch, GAS, LR, loss, samples, tokens, coverage, epoch, LR multiplier, step time, grad norm, noise
scale). Rank 0 appends it to the JSONL file of ``adabatch.log.jsonl`` and to DeepSpeed's monitor (where
the DeepSpeed config enables one), once the step's loss is known: each step's loss sum stays on the
device and is summed over ranks with the next all-reduce the run issues anyway, or every
``log.every_steps`` steps in one small all-reduce of its own (``runtime.step_sync``), as in the
runtime. Without a JSONL file, a monitor, or a schedule that reads the loss, nothing is deferred and a
steady step issues no collective of its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_adabatch.config import LogConfig
from ds_adabatch.plan import BatchPlan
from ds_adabatch.runtime.core.metrics import MetricsWriter, StepMetrics, schedule_rating

from .state import AdaptiveBatchState

if TYPE_CHECKING:  # pragma: no cover
    from deepspeed.monitor.monitor import MonitorMaster

__all__ = ["TrainerStepLog"]


class TrainerStepLog:
    """Defers each step's loss sum and writes its record when the sums arrive (identical calls on every rank).

    Args:
        state: the run's batch state (its :class:`~ds_adabatch.runtime.core.sync.StepSync`).
        log: the section's ``log`` settings.
        monitor: DeepSpeed's ``engine.monitor`` under DeepSpeed, else None.
    """

    def __init__(
        self, state: AdaptiveBatchState, log: LogConfig, monitor: MonitorMaster | None = None
    ) -> None:
        self.state = state
        self.every_steps = log.every_steps
        self.writer = MetricsWriter(log.jsonl, monitor, is_rank0=state.rank == 0)
        # The same on every rank (the section and DeepSpeed's monitor config are), so every rank defers
        # and reduces alike.
        self.active = log.jsonl is not None or self.writer.monitor is not None
        self._tokens = state.tokens
        self._last: dict[str, Any] | None = None
        self._next_step_reduces = False

    def step_done(
        self,
        *,
        completed: int,
        plan: BatchPlan,
        lr: float | None,
        lr_multiplier: float,
        started: float,
        logged: torch.Tensor,
        step_tokens: int | torch.Tensor | None,
    ) -> None:
        """After the backward of a step: defer its loss sum (this rank's share of the global mean).

        ``completed`` counts this step; ``step_tokens`` is the step's token count over all ranks (an int,
        or a device tensor already summed), None where tokens are not counted.
        """
        state = self.state
        # A step that all-reduced its token count will do so again next step, carrying what is queued.
        self._next_step_reduces = isinstance(step_tokens, torch.Tensor)
        if not (self.active or state.needs_loss):
            return
        record = None
        if self.active:
            record = StepMetrics(
                step=completed,
                samples=state.samples_consumed,
                tokens=None,
                global_batch=plan.global_batch_size,
                micro_batch_per_gpu=state.micro_batch_size,
                gradient_accumulation_steps=plan.gradient_accumulation_steps,
                lr=float("nan") if lr is None else lr,
                loss=float("nan"),
                train_coverage=state.train_coverage,
                epoch=state.sampler.fractional_epoch,
                lr_multiplier=lr_multiplier,
                step_time_s=time.perf_counter() - started,
                extra=schedule_rating(state.controller.schedule),
            )
            self._last = {"record": record, "grad_norm": None}
        state.sync.defer([logged], self._resolver(record, self._last, step_tokens))

    def end_of_step(self, completed: int, grad_norm: float | torch.Tensor | None) -> None:
        """After the optimizer step: the step's gradient norm as the Trainer computed it (a tensor is read
        when the record is written). Every ``log.every_steps`` steps the pending records are resolved in
        one all-reduce, unless the steps all-reduce their token counts anyway: then the next step's
        carries them (and :meth:`close` the last ones)."""
        if self._last is not None and self._last["grad_norm"] is None:
            if isinstance(grad_norm, torch.Tensor):
                grad_norm = grad_norm.detach().clone()
            self._last["grad_norm"] = grad_norm
        if self.active and completed % self.every_steps == 0 and not self._next_step_reduces:
            self.state.sync.reduce()

    def _resolver(
        self,
        record: StepMetrics | None,
        slot: dict[str, Any] | None,
        step_tokens: int | torch.Tensor | None,
    ) -> Callable[[list[torch.Tensor]], None]:
        state = self.state

        def resolved(sums: list[torch.Tensor]) -> None:
            # Each rank's sum is its share of the global mean times the world size (loss x count x W / total).
            mean = float(sums[0]) / state.world_size
            state.last_loss = mean
            state.loss_ema.update(mean)
            if record is None or slot is None:
                return
            record.loss = mean
            if step_tokens is not None:
                self._tokens += int(round(float(step_tokens)))
                record.tokens = self._tokens
            norm = slot["grad_norm"]
            norm = None if norm is None else float(norm)
            record.grad_norm = norm if norm is None or math.isfinite(norm) else None
            record.noise_scale = None if state.noise is None else state.noise.noise_scale
            self.writer.write(record)

        return resolved

    def close(self) -> None:
        """Resolve every pending step (a collective: call on every rank) and close the file."""
        self.state.sync.reduce()
        self.writer.close()

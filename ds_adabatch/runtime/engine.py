"""``AdaptiveBatchEngine``: one ``train_batch()`` = one optimizer step, at whatever batch the schedule wants.

The loop of one optimizer step (every rank runs it in lockstep)::

    decide    schedule(context) -> desired batch -> bounds/granularity -> plan_batch  (rank 0 broadcasts)
    apply     new plan? -> DeepSpeed batch keys, ZeRO optimizer GAS, throughput timer, LR multiplier
    fetch     the sampler's next global batch, cut for this rank (pads where a rank has nothing)
    for each micro-batch:
              set_gradient_accumulation_boundary(last)   # DeepSpeed's micro_steps counter is not used
              loss = loss_fn(engine, batch)               # mean over the micro-batch
              backward(loss * count * W / total, scale_wrt_gas=False)
              step()                                      # DeepSpeed updates only on the boundary
    account   one all-reduce: loss sum (and noise-scale sums); exact samples / tokens; metrics

Everything not defined here is delegated to the wrapped ``deepspeed.DeepSpeedEngine``
(``engine.module``, ``engine.eval()``, ``engine.global_rank``, ...), which is also ``engine.deepspeed``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..plan import BatchPlan, plan_batch
from ..schedules import BatchSizeController, ScheduleContext
from ..signals import EmaLoss, GradientNoiseEstimator
from . import comm
from .batch_shape import apply_plan_to_engine
from .checkpoint import CheckpointMixin
from .lr import BatchCoupledLR
from .metrics import MetricsWriter, PlanChange, StepMetrics, format_plan_change
from .noise_probe import NoiseCadence, NoiseProbe, update_estimator
from .weights import loss_weight

__all__ = ["AdaptiveBatchEngine"]

logger = logging.getLogger("ds_adabatch")


class AdaptiveBatchEngine(CheckpointMixin):
    """A DeepSpeed engine whose global batch follows the ``"adabatch"`` schedule.

    Build it with :func:`ds_adabatch.initialize`. Call :meth:`train_batch` once per optimizer step.
    """

    def __init__(
        self,
        ds_engine: Any,
        *,
        loaded_config: Any,
        controller: BatchSizeController,
        lr: BatchCoupledLR,
        dataloader: Any = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        token_count_fn: Callable[[Any], int] | None = None,
    ) -> None:
        cfg = loaded_config.adabatch
        # Attribute names are set through __dict__ so __getattr__ (delegation) never sees them missing.
        self.__dict__["deepspeed"] = ds_engine
        self.config = cfg
        self.loaded_config = loaded_config
        self.controller = controller
        self.lr_coupling = lr
        self.dataloader = dataloader
        self.loss_fn = loss_fn
        self.token_count_fn = token_count_fn
        # Tokens are counted when the loss is normalised by them or a schedule is keyed on them.
        self.counts_tokens = cfg.loss_normalization == "token" or "tokens" in controller.schedule.requires
        self.world_size = ds_engine.dp_world_size
        self.rank = ds_engine.global_rank
        self.plan: BatchPlan = loaded_config.plan
        self.global_steps = 0
        self.global_samples = 0
        self.global_tokens = 0
        self.history: list[PlanChange] = []
        self._override: tuple[int, str] | None = None
        self._decided_step: int | None = None  # the step whose plan next_plan() already applied
        self._scheduled_batch = self.plan.global_batch_size
        self.last_step_batch: Any = None
        self.last_metrics: StepMetrics | None = None
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        self.loss_ema = EmaLoss(beta=0.9)
        self.noise = GradientNoiseEstimator(**self._noise_kwargs())
        self._noise_cadence = NoiseCadence(self.config.schedule)
        self.metrics = MetricsWriter(cfg.log.jsonl, ds_engine.monitor, is_rank0=self.rank == 0)
        self._apply_plan(self.plan, reason="initial plan", record=False)

    # ---------------------------------------------------------------------------------------------
    # Delegation
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["deepspeed"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.deepspeed(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AdaptiveBatchEngine({self.plan.describe()}, step {self.global_steps})"

    # ---------------------------------------------------------------------------------------------
    # Public state
    @property
    def epoch(self) -> float:
        """Fractional epoch: completed epochs plus the coverage of the current one.

        With an ``IterableDataset`` (no known length) it counts completed passes over the iterator.
        """
        sampler = self._sampler()
        if sampler is not None:
            return sampler.fractional_epoch
        return float(getattr(self.dataloader, "epoch", 0))

    @property
    def train_coverage(self) -> float:
        """Fraction of the current epoch's samples consumed (1.0 right after an epoch's last batch).

        0.0 with an ``IterableDataset`` or without training data (the epoch's size is unknown).
        """
        sampler = self._sampler()
        return sampler.train_coverage if sampler is not None else 0.0

    @property
    def lr_multiplier(self) -> float:
        return self.lr_coupling.multiplier

    def set_global_batch_size(self, n: int | None, reason: str = "manual") -> None:
        """Override the schedule: from the next step on the global batch is ``n``.

        ``None`` hands control back to the schedule. ``n`` must be plannable on this world size
        (a multiple of it, unless ``allow_uneven``); it is not rounded or bounded. Call it on every
        rank with the same value (rank 0's value is the one applied).

        Raises:
            PlanError: ``n`` cannot be split over this world size.
        """
        self._decided_step = None
        if n is None:
            self._override = None
            return
        plan_batch(
            n, self.world_size, self.config.max_micro_batch_per_gpu, allow_uneven=self.config.allow_uneven
        )
        self._override = (int(n), reason)

    # ---------------------------------------------------------------------------------------------
    # One optimizer step
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run exactly one optimizer step; return the mean loss over the global batch (same on all ranks).

        Without ``data_iter`` the step takes the sampler's next global batch of exactly
        ``plan.global_batch_size`` samples (fewer only for the last batch of an epoch). With
        ``data_iter``, ``plan.gradient_accumulation_steps`` micro-batches are drawn from it; their real
        sizes (the first dimension) are all-reduced and weighted, so the update is still the exact mean.
        """
        started = time.perf_counter()
        self.next_plan()
        measure = self._should_measure_noise()
        lr_used = self.lr_coupling.get_lr()[0]

        if data_iter is None:
            if self.dataloader is None:
                raise ValueError(
                    "train_batch() needs data: pass training_data to ds_adabatch.initialize, or call "
                    "train_batch(data_iter) with an iterator of micro-batches"
                )
            step_batch = self.dataloader.next_step(self.plan)
            self.last_step_batch = step_batch
            if step_batch.plan != self.plan:
                self._apply_plan(step_batch.plan, reason="last batch of the epoch", record=True)
                lr_used = self.lr_coupling.get_lr()[0]
            micro = [(m.batch, m.num_samples) for m in step_batch.micro_batches]
            # An iterable dataset has no global view: the all-reduce below counts its samples.
            total_samples = step_batch.global_batch.size if step_batch.global_batch is not None else None
        else:
            micro = [next(data_iter) for _ in range(self.plan.gradient_accumulation_steps)]
            micro = [(b, _leading_dim(b)) for b in micro]
            total_samples = None

        loss_sum, tokens, total_samples, total = self._forward_backward(micro, total_samples, measure)

        self.global_steps += 1
        self.global_samples += total_samples
        self.global_tokens += tokens
        mean_loss = loss_sum / total
        self.last_loss = float(mean_loss)
        self.loss_ema.update(self.last_loss)
        self.last_grad_norm = self._grad_norm()
        self._after_step()
        self._emit(started, lr_used)
        return mean_loss

    def _forward_backward(
        self, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool
    ) -> tuple[torch.Tensor, int, int, int]:
        ds = self.deepspeed
        device = ds.device
        by_token = self.config.loss_normalization == "token"
        batches = [_to_device(b, device) for b, _ in micro]
        samples = [n for _, n in micro]
        tokens = (
            [self._count_tokens(b) if n else 0 for b, n in zip(batches, samples)]
            if self.counts_tokens
            else []
        )
        counts = tokens if by_token else samples

        # One small all-reduce gives every rank the totals the weights need (tokens are only known
        # once this rank's batches are loaded; samples are known, except with a user data_iter).
        totals = comm.all_reduce_sum([float(sum(samples)), float(sum(counts)), float(sum(tokens))], device)
        total_samples = int(totals[0]) if total_samples is None else total_samples
        total = int(totals[1])
        total_tokens = int(totals[2])
        if total <= 0:
            raise ValueError("the global batch has no samples (or no target tokens) to train on")
        # DeepSpeed steps the LR scheduler inside the boundary step(); in "samples" mode it must
        # already see the samples this step consumes.
        self.lr_coupling.set_samples(self.global_samples + total_samples)

        probe = NoiseProbe.for_deepspeed(ds) if measure else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        last = len(batches) - 1
        try:
            for i, (batch, count) in enumerate(zip(batches, counts)):
                # DeepSpeed 0.19.8 decides the boundary from micro_steps % GAS unless it is set
                # explicitly; a GAS change with micro_steps not a multiple of the new GAS would fire
                # early and mix micro-batches of two steps. Setting it on every micro-batch avoids that.
                ds.set_gradient_accumulation_boundary(i == last)
                loss = self._micro_loss(batch)
                weight = loss_weight(count, self.world_size, total)
                if probe is not None:
                    probe.begin(weight, samples[i])
                ds.backward(loss * weight, scale_wrt_gas=False)
                if probe is not None:
                    probe.end()
                    if i == last:
                        probe.read_reduced_norm()
                ds.step()
                if count:
                    loss_sum = loss_sum + loss.detach().to(torch.float64) * count
        finally:
            if probe is not None:
                probe.close()
            ds.set_gradient_accumulation_boundary(None)

        extra = probe.local_sums() if probe is not None else [0.0, 0.0, 0.0]
        reduced = comm.all_reduce_sum([loss_sum, *extra], device)
        if probe is not None:
            self._update_noise(reduced[1:], total_samples, probe)
        return reduced[0], total_tokens, total_samples, total

    def _micro_loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            out = self.loss_fn(self, batch)
            if isinstance(out, tuple):  # (mean loss, num_tokens) — the count was taken already
                out = out[0]
        else:
            if not isinstance(batch, dict):
                raise TypeError(
                    f"without loss_fn a batch must be a dict for model(**batch).loss, got {type(batch).__name__}; "
                    "pass loss_fn=lambda model, batch: ... to ds_adabatch.initialize"
                )
            out = self(**batch).loss
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor: the mean loss over the micro-batch")
        return out

    def _count_tokens(self, batch: Any) -> int:
        if self.token_count_fn is None:
            raise ValueError(
                'counting tokens (loss_normalization "token" or a tokens-keyed schedule) needs '
                "token_count_fn passed to ds_adabatch.initialize"
            )
        return int(self.token_count_fn(batch))

    # ---------------------------------------------------------------------------------------------
    # Batch-size decisions
    def _context(self) -> ScheduleContext:
        noise = self.noise.noise_scale
        return ScheduleContext(
            step=self.global_steps,
            samples=self.global_samples,
            tokens=self.global_tokens if self.counts_tokens else None,
            epoch=self.epoch,
            # The scheduled batch, not a one-off epoch-tail remainder, is what the schedule steers.
            global_batch=self._scheduled_batch,
            world_size=self.world_size,
            loss=self.last_loss,
            loss_ema=self.loss_ema.value,
            grad_norm=self.last_grad_norm,
            noise_scale=noise,
            noise_scale_error=self.noise.relative_error,
            lr=self.lr_coupling.get_lr()[0] if self.lr_coupling.get_lr() else None,
        )

    def next_plan(self) -> BatchPlan:
        """Decide (once) and apply the plan of the next optimizer step, and return it.

        ``train_batch`` calls it itself. Call it first when you feed ``train_batch(data_iter)`` your
        own micro-batches: the plan's ``gradient_accumulation_steps`` and ``micro_batch_sizes(rank)``
        say how many micro-batches of which sizes this rank must supply. Call it on every rank.
        """
        if self._decided_step != self.global_steps:
            self._decide_plan()
            self._decided_step = self.global_steps
        return self.plan

    def _decide_plan(self) -> None:
        if self._override is not None:
            batch, reason = self._override
        else:
            decision = self.controller.next_global_batch(self._context())
            batch, reason = decision.global_batch, decision.reason
        # Batch shape must be identical on every rank: rank 0's decision is the one applied.
        batch = comm.broadcast_int(batch, self.deepspeed.device)
        self._scheduled_batch = batch
        plan = self._plan_for(batch)
        if plan != self.plan:
            self._apply_plan(plan, reason=reason, record=True)

    def _plan_for(self, batch: int) -> BatchPlan:
        return plan_batch(
            batch, self.world_size, self.config.max_micro_batch_per_gpu, allow_uneven=self.config.allow_uneven
        )

    def _apply_plan(self, plan: BatchPlan, *, reason: str, record: bool) -> None:
        """Make DeepSpeed's view of the batch match ``plan`` (between optimizer steps only)."""
        old = self.plan
        apply_plan_to_engine(self.deepspeed, plan)
        old_mult = self.lr_coupling.multiplier
        new_mult = self.lr_coupling.set_global_batch(plan.global_batch_size)
        self.plan = plan
        if not record:
            return
        event = PlanChange(
            step=self.global_steps,
            samples=self.global_samples,
            old_global_batch=old.global_batch_size,
            new_global_batch=plan.global_batch_size,
            old_micro_batch_per_gpu=old.micro_batch_per_gpu,
            new_micro_batch_per_gpu=plan.micro_batch_per_gpu,
            old_gradient_accumulation_steps=old.gradient_accumulation_steps,
            new_gradient_accumulation_steps=plan.gradient_accumulation_steps,
            world_size=plan.world_size,
            lr_multiplier=new_mult,
            reason=reason,
        )
        self.history.append(event)
        if self.rank == 0:
            logger.info(format_plan_change(old, plan, self.global_steps, new_mult / old_mult, reason))

    # ---------------------------------------------------------------------------------------------
    # Gradient-noise scale
    def _noise_kwargs(self) -> dict[str, Any]:
        schedule = self.config.schedule
        return schedule.estimator_settings() if schedule.type == "gradient_noise" else {}

    def _should_measure_noise(self) -> bool:
        return self._noise_cadence.due(
            self.global_steps, self.world_size, self.plan.gradient_accumulation_steps
        )

    def _update_noise(self, sums: list[torch.Tensor], total_samples: int, probe: NoiseProbe) -> None:
        update_estimator(self.noise, sums, total_samples, probe.reduced_sq_norm())

    def _grad_norm(self) -> float | None:
        norm = self.deepspeed.get_global_grad_norm()
        if norm is None:
            return None
        norm = float(norm)
        return norm if math.isfinite(norm) else None

    # ---------------------------------------------------------------------------------------------
    # Bookkeeping
    def _after_step(self) -> None:
        ds = self.deepspeed
        # DeepSpeed adds train_batch_size (the padded nominal shape) per step; keep the exact count.
        ds.global_samples = self.global_samples
        self.lr_coupling.set_samples(self.global_samples)

    def _emit(self, started: float, lr_used: float) -> None:
        plan = self.plan
        record = StepMetrics(
            step=self.global_steps,
            samples=self.global_samples,
            tokens=self.global_tokens if self.counts_tokens else None,
            global_batch=plan.global_batch_size,
            micro_batch_per_gpu=plan.micro_batch_per_gpu,
            gradient_accumulation_steps=plan.gradient_accumulation_steps,
            lr=lr_used,
            loss=self.last_loss if self.last_loss is not None else float("nan"),
            train_coverage=self.train_coverage,
            epoch=self.epoch,
            lr_multiplier=self.lr_coupling.multiplier,
            step_time_s=time.perf_counter() - started,
            grad_norm=self.last_grad_norm,
            noise_scale=self.noise.noise_scale,
        )
        self.last_metrics = record
        self.metrics.write(record)

    def _sampler(self) -> Any:
        return getattr(self.dataloader, "sampler", None)

    def close(self) -> None:
        """Stop data workers and close the metrics file."""
        self.metrics.close()
        if self.dataloader is not None and hasattr(self.dataloader, "close"):
            self.dataloader.close()


def _leading_dim(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _leading_dim(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _leading_dim(batch[0])
    raise TypeError(f"cannot tell the number of samples in a micro-batch of type {type(batch).__name__}")


def _to_device(batch: Any, device: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch

"""``AdaptiveBatchEngine``: one ``train_batch()`` = one optimizer step, at whatever batch the schedule wants.

The loop of one optimizer step (every rank runs it in lockstep)::

    decide    schedule(context) -> desired batch -> bounds/granularity -> plan_batch
              (identical everywhere from global values; a user function's answer is agreed)
    apply     new plan? -> DeepSpeed batch keys, ZeRO optimizer GAS, throughput timer, LR multiplier
    fetch     the sampler's next global batch, cut for this rank (pads where a rank has nothing)
    totals    the global batch's samples come from the sampler; token counts (or a user iterator's
              sizes) are summed over ranks in the step's one collective
    for each micro-batch:
              set_gradient_accumulation_boundary(last)   # DeepSpeed's micro_steps counter is not used
              loss = loss_fn(engine, batch)               # mean over the micro-batch
              backward(loss * count * W / total, scale_wrt_gas=False)
              step()                                      # DeepSpeed updates only on the boundary
    account   exact samples / tokens; the step's loss sum stays on the device until the next
              collective or every log.every_steps steps (StepSync), then metrics are written

A steady step (map-style data, sample normalisation, no change of batch, no noise measurement) issues no
collective and no host synchronisation beyond DeepSpeed's own.

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
from .adam_geometry import measured_geometry
from .batch_shape import apply_plan_to_engine
from .checkpoint import CheckpointMixin
from .lr import BatchCoupledLR
from .metrics import MetricsWriter, PlanChange, StepMetrics, format_plan_change
from .noise_probe import NoiseCadence, NoiseProbe, update_estimator
from .recovery import OomRecovery, replan_after_oom, replan_token_step_after_oom, resplit_micro_batches
from .step_loss import StepLoss
from .step_sync import StepSync
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
        # Tokens are counted when the loss is normalised by them or a schedule is keyed on them. With
        # token-budget steps (micro_batch_tokens) every rank knows the step's tokens from the lengths.
        self.token_budget = cfg.token_budget
        keyed_on_tokens = "tokens" in controller.schedule.requires and not self.token_budget
        self.counts_tokens = cfg.loss_normalization == "token" or keyed_on_tokens
        self.world_size = ds_engine.dp_world_size
        self.rank = ds_engine.global_rank
        self.plan: BatchPlan = loaded_config.plan
        self.global_steps = 0
        self.global_samples = 0
        self.global_tokens = 0
        self.history: list[PlanChange] = []
        self._override: tuple[int, str] | None = None
        self._override_agreed = False
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
        self._sync = StepSync(ds_engine.device)
        self._probe: NoiseProbe | None = None
        # The learned micro-batch limit, and the out-of-memory recovery when armed (recovery.py).
        self.memory_recovery = OomRecovery(ds_engine, cfg, rank=self.rank, world_size=self.world_size)
        self._memory_reason: str | None = None
        self._step_ooms = 0
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

    @property
    def micro_batch_limit(self) -> int:
        """The largest micro-batch per GPU the next step may plan (samples): the integer
        ``max_micro_batch_per_gpu``, lowered by out-of-memory errors and grown back; with ``"auto"``
        the learned limit. With ``micro_batch_tokens`` it counts tokens per pass instead (padding
        included): the budget the next step is cut with, ``micro_batch_tokens`` or lower after an
        out-of-memory error."""
        return self.memory_recovery.memory.limit

    def set_memory_key(self, key: int | str | None) -> None:
        """Plan from the next step with the micro-batch limit learned for ``key`` (e.g. the sequence
        length of a length curriculum); a new key starts at the initial limit. Limits of every key
        are kept in checkpoints. Call it on every rank with the same value."""
        self.memory_recovery.memory.set_key(key)
        self._decided_step = None

    def set_global_batch_size(self, n: int | None, reason: str = "manual") -> None:
        """Override the schedule: from the next step on the global batch is ``n``.

        ``None`` hands control back to the schedule. ``n`` must be plannable on this world size
        (a multiple of it, unless ``allow_uneven``); it is not rounded or bounded. Call it on every
        rank (the next step agrees on it in one small collective; rank 0's value is the one applied).

        Raises:
            PlanError: ``n`` cannot be split over this world size.
        """
        self._decided_step = None
        if n is None:
            self._override = None
            return
        if not self.token_budget:  # a token target is formed into a step, not split by plan_batch
            plan_batch(
                n, self.world_size, self.config.micro_batch_limit, allow_uneven=self.config.allow_uneven
            )
        self._override = (int(n), reason)
        self._override_agreed = False

    # ---------------------------------------------------------------------------------------------
    # One optimizer step
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> StepLoss:
        """Run exactly one optimizer step; return its mean loss over the global batch.

        Without ``data_iter`` the step takes the sampler's next global batch of exactly
        ``plan.global_batch_size`` samples (fewer only for the last batch of an epoch). With
        ``data_iter``, ``plan.gradient_accumulation_steps`` micro-batches are drawn from it; their real
        sizes (the first dimension) are summed over ranks and weighted, so the update is still the exact
        mean.

        The returned :class:`~ds_adabatch.runtime.StepLoss` is the same on every rank. It is resolved
        every ``adabatch.log.every_steps`` steps without extra cost; reading it sooner (``float(loss)``)
        resolves it at once, which is a collective: read it on every rank.
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
            # An iterable dataset has no global view: the step's collective counts its samples.
            total_samples = step_batch.global_batch.size if step_batch.global_batch is not None else None
        else:
            if self.token_budget:
                raise ValueError(
                    "token-budget steps (adabatch.micro_batch_tokens) form micro-batches from the "
                    "training data: pass training_data and lengths to ds_adabatch.initialize and call "
                    "train_batch() without data_iter"
                )
            micro = [next(data_iter) for _ in range(self.plan.gradient_accumulation_steps)]
            micro = [(b, _leading_dim(b)) for b in micro]
            total_samples = None

        step = self.global_steps
        # Out-of-memory recovery (recovery.py): an agreed OOM discards the partial step, lowers the
        # micro-batch limit and re-runs the same samples, cut for the new plan.
        current = {"micro": micro, "step": self.last_step_batch if data_iter is None else None}
        self._step_ooms = 0

        def replan(ranks: list[int]) -> None:
            plan = self._replan_after_oom(ranks)
            if current["step"] is not None:
                batch = self.dataloader.reload(current["step"], plan)
                self.last_step_batch = current["step"] = batch
                current["micro"] = [(m.batch, m.num_samples) for m in batch.micro_batches]
            else:
                current["micro"] = resplit_micro_batches(current["micro"], plan.gradient_accumulation_steps)

        loss_sum, tokens, total_samples, total, probe_sums = self.memory_recovery.run(
            lambda: self._forward_backward(current["micro"], total_samples, measure), replan
        )
        if self.token_budget:  # the step's tokens (lengths), known on every rank
            tokens = self.last_step_batch.global_batch.tokens
        self.global_steps += 1
        self.global_samples += total_samples
        self.global_tokens += tokens
        self._after_step()
        # The previous step's measurement: its all-reduce (issued below, one step ago) has overlapped
        # this step's work, and it reaches the schedule before the next decision.
        self._sync.complete()
        if probe_sums is not None:
            self._sync.defer(probe_sums[0], self._noise_callback(total_samples, probe_sums[1]))
        loss = self._record_step(step, started, lr_used, loss_sum, total)
        if self.global_steps % self.config.log.every_steps == 0:
            self._sync.reduce()
        elif probe_sums is not None and not self.counts_tokens:
            # Measured noise sums ride the next step's collective when every step has one (token
            # counts); otherwise their all-reduce (with the pending losses) is issued now and waited
            # for at the end of the next step, so a measurement reaches the schedule one step later.
            self._sync.reduce_later()
        return loss

    def resolve_losses(self) -> None:
        """Sum every pending step's loss (and queued measurements) over ranks now; call on every rank.

        Afterwards every :class:`StepLoss` returned so far reads without a collective, and the JSONL and
        monitor records of those steps are written.
        """
        self._sync.reduce()

    def _forward_backward(
        self, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool
    ) -> tuple[torch.Tensor, int, int, int, tuple[list[Any], Callable[[], float | None]] | None]:
        ds = self.deepspeed
        device = ds.device
        by_token = self.config.loss_normalization == "token"
        samples = [n for _, n in micro]
        # Tokens are counted on the loader's host tensors: no device read.
        tokens = [self._count_tokens(b) if n else 0 for b, n in micro] if self.counts_tokens else []
        counts = tokens if by_token else samples
        batches = [_to_device(b, device) for b, _ in micro]

        if total_samples is not None and not self.counts_tokens:
            # The sampler gave every rank the global batch's size: nothing to agree on.
            total, total_tokens = total_samples, 0
        else:
            # Per-rank counts: one collective, which also carries whatever StepSync has queued.
            totals = self._sync.reduce([float(sum(samples)), float(sum(counts)), float(sum(tokens))])
            total_samples = int(totals[0]) if total_samples is None else total_samples
            total, total_tokens = int(totals[1]), int(totals[2])
        if total <= 0:
            raise ValueError("the global batch has no samples (or no target tokens) to train on")
        # DeepSpeed steps the LR scheduler inside the boundary step(); in "samples" mode it must
        # already see the samples this step consumes.
        self.lr_coupling.set_samples(self.global_samples + total_samples)

        probe = self._noise_probe() if measure else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        last = len(batches) - 1
        try:
            recovery = self.memory_recovery
            for i, (batch, count) in enumerate(zip(batches, counts)):
                recovery.begin_pass(f"in micro-batch {i} of step {self.global_steps}", index=i)
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
                if i == last:
                    recovery.where = f"in the optimizer step of step {self.global_steps}"
                    recovery.pass_index = None
                ds.step()
                if count:
                    loss_sum = loss_sum + loss.detach().to(torch.float64) * count
        finally:
            if probe is not None:
                probe.stop()
            ds.set_gradient_accumulation_boundary(None)

        measured = (probe.local_sums(), probe.reduced_sq_norm_later()) if probe is not None else None
        return loss_sum, total_tokens, total_samples, total, measured

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
            tokens=self.global_tokens if self.counts_tokens or self.token_budget else None,
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
        # Batch shape must be identical on every rank. Schedules fed only global values (step,
        # samples, tokens, all-reduced signals) decide identically everywhere with no collective;
        # inputs that can differ between ranks (a user's function, set_global_batch_size) are agreed
        # in one small collective: rank 0's value is the one applied.
        step = self.global_steps
        if self._override is not None:
            batch, reason = self._override
            if not self._override_agreed:
                batch = self._agree([batch])[0]
                self._override, self._override_agreed = (batch, reason), True
        else:
            controller = self.controller
            evaluates = controller.evaluates_at(step)
            if evaluates and "loss" in controller.schedule.requires:
                self.resolve_losses()  # the rule reads the latest loss: it must be all-reduced
            decision = controller.next_global_batch(self._context())
            batch, reason = decision.global_batch, decision.reason
            if evaluates and getattr(controller.schedule, "needs_agreement", False):
                batch = self._agree_schedule(batch)
        # A token-budget step's shape changes with its samples: only a new target is a plan change.
        record = not self.token_budget or batch != self._scheduled_batch
        self._scheduled_batch = batch
        plan = self._plan_for(batch)
        if plan != self.plan:
            if self._memory_reason is not None and batch == self.plan.global_batch_size:
                reason = self._memory_reason
            self._apply_plan(plan, reason=reason, record=record)
        self._memory_reason = None

    def _agree(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank, in one collective (with whatever StepSync has queued)."""
        mine = [float(v) if self.rank == 0 else 0.0 for v in values]
        return [int(round(float(v))) for v in self._sync.reduce(mine)]

    def _agree_schedule(self, batch: int) -> int:
        """Agree on a rank-dependent schedule's answer and on the state it keeps (rank 0's)."""
        schedule = self.controller.schedule
        state = list(schedule.shared_state())
        agreed = self._agree([batch, *state])
        schedule.load_shared_state(agreed[1:])
        return agreed[0]

    def _plan_for(self, batch: int) -> BatchPlan:
        if self.token_budget:  # batch is a token target; the loader forms the step (data/tokens.py)
            if self.dataloader is None:
                raise ValueError(
                    "token-budget steps need training_data and lengths in ds_adabatch.initialize"
                )
            # Cut with the learned token budget (micro_batch_tokens until an OOM lowers it).
            self.dataloader.sampler.pass_budget = self.micro_batch_limit
            return self.dataloader.plan_for_tokens(batch)
        return plan_batch(
            batch, self.world_size, self.micro_batch_limit, allow_uneven=self.config.allow_uneven
        )

    def _replan_after_oom(self, ranks: list[int]) -> BatchPlan:
        """Every rank agreed that ``ranks`` ran out of memory: the same global batch, smaller micro-batches."""
        if self.token_budget:  # the same samples, cut with a lower token budget (data/tokens.py)
            step, reason, line = replan_token_step_after_oom(
                self.memory_recovery.memory,
                self.dataloader.sampler,
                self.last_step_batch.global_batch,
                self.memory_recovery.failed_passes(ranks),
                self.global_steps,
            )
            plan = step.plan(self.dataloader.sampler.max_micro_batch)
        else:
            plan, reason, line = replan_after_oom(
                self.memory_recovery.memory, self.plan, ranks, self.global_steps, self.config.allow_uneven
            )
        self._step_ooms += 1
        self._apply_plan(plan, reason=reason, record=True, line=line)
        return plan

    def _apply_plan(self, plan: BatchPlan, *, reason: str, record: bool, line: str | None = None) -> None:
        """Make DeepSpeed's view of the batch match ``plan`` (between optimizer steps only)."""
        old = self.plan
        apply_plan_to_engine(self.deepspeed, plan)
        old_mult = self.lr_coupling.multiplier
        # With token-budget steps the LR follows the token target, not the step's varying sample count.
        lr_batch = self._scheduled_batch if self.token_budget else plan.global_batch_size
        new_mult = self.lr_coupling.set_global_batch(lr_batch)
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
            logger.info(line or format_plan_change(old, plan, self.global_steps, new_mult / old_mult, reason))

    # ---------------------------------------------------------------------------------------------
    # Gradient-noise scale
    def _noise_kwargs(self) -> dict[str, Any]:
        schedule = self.config.schedule
        if schedule.type != "gradient_noise":
            return {}
        # The geometry is resolved against the optimizer now (a ConfigError for "adam" without a second
        # moment), and an unset scale takes that geometry's default.
        self._noise_geometry = measured_geometry(self.deepspeed, schedule.geometry)
        use_geometry = getattr(self.controller.schedule, "use_geometry", None)
        if use_geometry is not None:
            use_geometry(self._noise_geometry)
        return schedule.estimator_settings()

    def _noise_probe(self) -> NoiseProbe:
        """The run's probe, in the resolved geometry, started for one measured step (its hooks are
        registered once and stay, idle between measured steps)."""
        if self._probe is None:
            self._probe = NoiseProbe.for_deepspeed(self.deepspeed, geometry=self._noise_geometry)
        else:
            self._probe.start()
        return self._probe

    def _should_measure_noise(self) -> bool:
        return self._noise_cadence.due(
            self.global_steps, self.world_size, self.plan.gradient_accumulation_steps
        )

    def _noise_callback(
        self, total_samples: int, sq_big: Callable[[], float | None]
    ) -> Callable[[list[torch.Tensor]], None]:
        def fold(sums: list[torch.Tensor]) -> None:
            update_estimator(self.noise, sums, total_samples, sq_big())

        return fold

    # ---------------------------------------------------------------------------------------------
    # Bookkeeping
    def _after_step(self) -> None:
        ds = self.deepspeed
        # DeepSpeed adds train_batch_size (the padded nominal shape) per step; keep the exact count.
        ds.global_samples = self.global_samples
        self.lr_coupling.set_samples(self.global_samples)
        # The learned limit counts samples per pass, or tokens per pass with a token budget.
        largest = (
            self.last_step_batch.global_batch.largest_pass
            if self.token_budget
            else self.plan.micro_batch_per_gpu
        )
        decision = self.memory_recovery.memory.on_clean_step(largest)
        if decision is not None:
            # Logged once, with the plan change it causes at the next decision.
            self._memory_reason = (
                f"micro-batch limit {decision.old_limit} -> {decision.new_limit} ({decision.reason})"
            )

    def _record_step(
        self, step: int, started: float, lr_used: float, loss_sum: torch.Tensor, total: int
    ) -> StepLoss:
        """The step's record and loss, completed when its loss sum has been summed over ranks."""
        plan = self.plan
        record = StepMetrics(
            step=self.global_steps,
            samples=self.global_samples,
            tokens=self.global_tokens if self.counts_tokens or self.token_budget else None,
            global_batch=plan.global_batch_size,
            micro_batch_per_gpu=plan.micro_batch_per_gpu,
            gradient_accumulation_steps=plan.gradient_accumulation_steps,
            lr=lr_used,
            loss=float("nan"),
            train_coverage=self.train_coverage,
            epoch=self.epoch,
            lr_multiplier=self.lr_coupling.multiplier,
            step_time_s=time.perf_counter() - started,
            extra={"micro_batch_limit": float(self.micro_batch_limit), "oom_retries": float(self._step_ooms)},
        )
        loss = StepLoss(step, self.resolve_losses)
        # The norm DeepSpeed computed in this step (a device tensor under ZeRO 1-3): read it later.
        norm = self.deepspeed.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().clone()

        def resolved(sums: list[torch.Tensor]) -> None:
            mean = float(sums[0]) / total
            loss.set_value(mean)
            grad_norm = None if norm is None else float(norm)
            record.loss = mean
            record.grad_norm = grad_norm if grad_norm is None or math.isfinite(grad_norm) else None
            record.noise_scale = self.noise.noise_scale
            self.last_loss, self.last_grad_norm = mean, record.grad_norm
            self.loss_ema.update(mean)
            self.metrics.write(record)

        # The step's record now; its loss and grad norm are filled in when resolved.
        self.last_metrics = record
        self._sync.defer([loss_sum], resolved)
        return loss

    def _sampler(self) -> Any:
        return getattr(self.dataloader, "sampler", None)

    def close(self) -> None:
        """Resolve pending losses (a collective: call on every rank), stop data workers, close the metrics file."""
        self.resolve_losses()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
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

"""The optimizer step both adaptive engines share: decide, apply, account, record, checkpoint state.

:class:`AdaptiveBatchEngine` (data parallelism, ZeRO 0-3, optional tensor parallelism through an
``mpu``) and :class:`AdaptivePipelineEngine` (DeepSpeed's ``PipelineEngine``) are small classes over
:class:`AdaptiveEngineBase`. Each runs the passes of one step its own way; everything around them is
here::

    decide    next_plan(): schedule(context) -> desired batch -> bounds/granularity -> plan
              (identical everywhere from global values; a user function's answer is agreed)
    apply     new plan? -> DeepSpeed batch keys, ZeRO optimizer GAS, throughput timer, LR multiplier
    run       the engine's own passes (train_batch of the subclass)
    account   _finish_step(): exact samples / tokens, DeepSpeed's sample count, the learned
              micro-batch limit, the step's record and its StepLoss

Per-rank sums (a step's loss, token counts) are counted once per data-parallel replica: a rank whose
values repeat another's (tensor ranks other than 0; pipeline stages other than the last) contributes
zeros to the step's all-reduce (``counts_here``).

Everything not defined here is delegated to the wrapped DeepSpeed engine (``engine.module``,
``engine.eval()``, ``engine.global_rank``, ...), which is also ``engine.deepspeed``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...data.step_batch import StepBatch
from ...plan import BatchPlan, PlanError, plan_batch
from ...schedules import BatchSizeController
from ...signals import EmaLoss
from ..checkpoint.save_load import EngineCheckpoints, HostSnapshots
from ..core.batch_shape import apply_plan_to_engine
from ..core.loss import StepLoss
from ..core.lr import BatchCoupledLR
from ..core.metrics import MetricsWriter, PlanChange, StepMetrics, format_plan_change, schedule_rating
from ..core.step_core import Progress, StepAttachments, StepCore, in_core, plan_change
from ..core.step_times import step_times_for
from ..core.sync import StepSync
from ..memory.recovery import engine_oom_recovery
from ..noise.probe import NoiseCadence, noise_estimator

if TYPE_CHECKING:
    from ...config.loader import LoadedConfig
    from ...data.loader import ElasticDataLoader
    from ...data.token_loader import TokenBudgetLoader

__all__ = ["AdaptiveEngineBase", "LiveStepRecovery"]

logger = logging.getLogger("ds_adabatch")


class LiveStepRecovery(HostSnapshots, Protocol):
    """Live recovery as an engine holds it (``live.recovery.LiveRecovery``, a layer above)."""

    events: list[dict[str, Any]]
    """The recoveries of this process so far (``engine.live_events``)."""

    @property
    def snapshot_every(self) -> int | None: ...

    def run_step(self, step: Callable[[], StepLoss]) -> StepLoss: ...

    def close(self) -> None: ...


class AdaptiveEngineBase:
    """The state and step machinery of an adaptive-batch engine (see the module docstring).

    Subclasses run the passes of a step (``train_batch``), extend :meth:`_bind` (what is derived from the
    DeepSpeed engine and the world; :meth:`rebind` swaps it after a live recovery) and may override
    :meth:`_apply_shape`.
    Checkpoints are written and read by the engine's :class:`EngineCheckpoints` (``checkpoints``).

    Args:
        ds_engine: the DeepSpeed engine to drive.
        lr, loss_fn: the LR coupling installed on ``ds_engine`` (a rebuild rebinds it) and the loss
            function of :func:`ds_adabatch.initialize`; they last the run. The rest is :meth:`_bind`'s:
        loaded_config: the validated config, planned for ``world_size``.
        controller: the batch-size controller.
        dataloader: the loader of this rank's data-parallel replica (None: no training data).
        token_count_fn: as given to :func:`ds_adabatch.initialize` (or the default counter).
        world_size: data-parallel ranks (replicas); plans are made for this many.
        counts_here: whether this rank's per-rank sums count (one rank per replica).
        agreement_world: processes joining the out-of-memory agreement (every process).
        recovers_from_oom: False where the passes cannot be recovered (the pipeline's): no agreement
            is installed, whatever ``memory.recover_from_oom`` says.
    """

    _plan_unit = "rank"  # what a plan's world size counts, in log lines
    # Live elasticity (live/recovery.py): the recovery armed on this engine, or why it is off; the extra
    # fields the next step writes into its record (extend_next_record).
    _live_recovery: LiveStepRecovery | None = None
    _live_off: str = "off:config"
    _record_extra: dict[str, float] | None = None

    def __init__(
        self,
        ds_engine: Any,
        *,
        lr: BatchCoupledLR,
        loss_fn: Callable[..., Any] | None = None,
        **world: Any,
    ) -> None:
        # What lasts the run, whatever DeepSpeed engine drives it: this object (the script holds it),
        # the LR wrapper (the script's scheduler; a rebuild rebinds it in place), the loss function, the
        # counts and the history (a live recovery loads them from its snapshot), the checkpoints.
        self.lr_coupling = lr
        self.loss_fn = loss_fn
        self.global_steps = 0
        self.global_samples = 0
        self.global_tokens = 0
        self.history: list[PlanChange] = []
        self.last_metrics: StepMetrics | None = None
        self.checkpoints = EngineCheckpoints(self, data_state=self._data_state)
        """save_checkpoint / load_checkpoint and the adabatch section they carry (checkpoint/)."""
        self._bind(ds_engine, **world)

    def _bind(
        self,
        ds_engine: Any,
        *,
        loaded_config: LoadedConfig,
        controller: BatchSizeController,
        dataloader: ElasticDataLoader | TokenBudgetLoader | None = None,
        token_count_fn: Callable[[Any], int] | None = None,
        world_size: int,
        counts_here: bool = True,
        agreement_world: int | None = None,
        recovers_from_oom: bool = True,
        model_communicates: bool = False,
    ) -> None:
        """Drive ``ds_engine`` in its world: everything derived from the DeepSpeed engine and the world
        (the config planned for it, the controller, the loader, the step core and what rides on it),
        from the world's initial plan. Called by ``__init__`` and by :meth:`rebind`; the subclasses
        extend it with their own."""
        cfg = loaded_config.adabatch
        self.deepspeed = ds_engine
        self.config = cfg
        self.loaded_config = loaded_config
        self.controller = controller
        self.dataloader = dataloader
        self.token_count_fn = token_count_fn
        # Tokens are counted when the loss is normalised by them or a schedule is keyed on them. With
        # token-budget steps (micro_batch_tokens) every rank knows the step's tokens from the lengths.
        self.token_budget = cfg.token_budget
        keyed_on_tokens = "tokens" in controller.schedule.requires and not self.token_budget
        self.counts_tokens = cfg.loss_normalization == "token" or keyed_on_tokens
        self.world_size = world_size
        self.rank = ds_engine.global_rank
        self.counts_here = counts_here
        self.plan: BatchPlan = loaded_config.plan
        self._decided_step: int | None = None  # the step whose plan next_plan() already applied
        # The noise-scale estimate, in the geometry resolved against this engine's optimizer.
        self.noise, self._noise_geometry = noise_estimator(ds_engine, cfg.schedule, controller.schedule)
        self.metrics = MetricsWriter(cfg.log.jsonl, ds_engine.monitor, is_rank0=self.rank == 0)
        self._every_steps = cfg.log.every_steps
        self.step_sync = StepSync(ds_engine.device)
        """The step's one collective (counts, losses, step times; core/sync.py)."""
        # The goodput schedule's step times (step_times.py); a no-op object for every other schedule.
        self._step_times = step_times_for(
            controller.schedule, getattr(controller.schedule, "throughput", None), ds_engine.device
        )
        # The learned micro-batch limit, and the out-of-memory recovery when armed (recovery.py).
        # Every process joins the agreement (a tensor rank that fails leaves its peers waiting too).
        self.memory_recovery, self._oom_off = engine_oom_recovery(
            ds_engine,
            cfg,
            rank=self.rank,
            agreement_world=agreement_world or world_size,
            model_communicates=model_communicates,
            recovers_from_oom=recovers_from_oom,
        )
        # The decision of every step (step_core.py), with the features that ride on it attached.
        self.core = StepCore(
            controller,
            sync=self.step_sync,
            attach=StepAttachments(
                self.memory_recovery.memory, self.noise, self._step_times, NoiseCadence(cfg.schedule)
            ),
            progress=self._progress,
            rank=self.rank,
            world_size=world_size,
            allow_uneven=cfg.allow_uneven,
            scheduled_batch=self.plan.global_batch_size,
            token_loader=dataloader if self.token_budget else None,
            token_budget=bool(self.token_budget),
            resolve_losses=self.resolve_losses,  # overridden by the pipeline engine (its own losses)
        )
        self._step_ooms = 0
        self._apply_plan(self.plan, reason="initial plan", record=False)

    # ---------------------------------------------------------------------------------------------
    # Delegation
    def __getattr__(self, name: str) -> Any:
        # Only names this class does not define reach here; object.__getattribute__ does not fall back to
        # __getattr__, so a missing ``deepspeed`` (before __init__ set it) raises instead of recursing.
        return getattr(object.__getattribute__(self, "deepspeed"), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.deepspeed(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plan.describe()}, step {self.global_steps})"

    # ---------------------------------------------------------------------------------------------
    # The DeepSpeed engine this engine drives, and its replacement after a live recovery
    def attach_live(self, recovery: LiveStepRecovery | None, off: str | None) -> None:
        """Arm live recovery (``recovery``), or record why it is off (``off``: ``"off:<why>"``)."""
        self._live_recovery = recovery
        self._live_off = "off:config" if off is None else off
        self.checkpoints.live = recovery  # a checkpoint load never goes back behind its snapshots

    def extend_next_record(self, extra: dict[str, float]) -> None:
        """Fields the next step writes into its metrics record (``extra``), with any noted before."""
        self._record_extra = {**(self._record_extra or {}), **extra}

    def release_deepspeed(self) -> None:
        """Let go of the DeepSpeed engine and of what is bound to its process groups (their world failed
        and is torn down next): the metrics file, the memory hooks, the data workers, the LR wrapper's
        optimizer. :meth:`rebind` gives this engine the rebuilt one."""
        for close in (
            self.metrics.close,
            self.memory_recovery.close,
            getattr(self.dataloader, "close", None),
        ):
            if close is None:
                continue
            try:
                close()
            except Exception as err:  # noqa: BLE001 - an object of a broken world may fail to close
                logger.debug("closing what the failed engine held: %s", err)
        self.lr_coupling.release()
        self.deepspeed = None
        self.memory_recovery = None

    def rebind(self, ds_engine: Any, **world: Any) -> None:
        """Drive ``ds_engine``, a DeepSpeed engine rebuilt on another world (a live recovery).

        The engine is not built again over itself: :meth:`_bind` swaps in what is derived from the
        DeepSpeed engine and the world (``world``: its keywords for the new world), and what lasts the
        run stays — this object, which the script holds, its LR wrapper (rebound by the builder), the
        loss function, the checkpoints, the forward / backward / step loop and live recovery. The run's
        counts, schedule, sampler cursor, LR and signals are then loaded from the snapshot by the caller.
        """
        self._bind(ds_engine, **world)

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

    # The signals the schedule reads live in the step core; these names are the engine's public view.
    last_loss = in_core[float | None]("The global mean loss of the latest resolved step.")
    last_grad_norm = in_core[float | None](
        "The gradient norm of the latest resolved step (None where none was computed)."
    )
    loss_ema = in_core[EmaLoss]("The smoothed loss the schedule reads (an ``EmaLoss``).")
    last_step_batch = in_core[StepBatch | None](
        "This rank's micro-batches of the latest step drawn (``StepCore.draw``).", name="last_step"
    )

    @property
    def oom_recovery(self) -> str:
        """What an out-of-memory error in a step leads to now (also in every JSONL step record):

        ``"in_step"``: agreed by every rank, the step re-planned with smaller micro-batches and re-run
        on the same samples; ``"restart"``: under tensor parallelism (or after a pass's agreement
        point) recorded next to the checkpoints, the process exits 75 and the next start plans below
        it; ``"off:pipeline"``: not recovered under pipeline parallelism (the error ends the job);
        ``"off:config"``: ``memory.recover_from_oom`` is false; ``"off:no_accelerator"``: nothing can
        raise one here (DeepSpeed's CPU accelerator allocates host memory, whose exhaustion ends the
        process instead of raising).
        """
        return self.memory_recovery.mode(self._oom_off)

    @property
    def live_elastic(self) -> str:
        """What a lost peer leads to: ``"on"`` (the survivors recover in their processes,
        ``adabatch.live_elastic``), or ``"off:<why>"`` (``off:config`` when not enabled; otherwise what
        this job uses that it does not cover): the restart path."""
        return "on" if self._live_recovery is not None else self._live_off

    @property
    def live_events(self) -> list[dict[str, Any]]:
        """The live recoveries of this process so far: per shrink the failed step, the step rolled back
        to, the steps trained again, the lost processes (ranks of the first world), the world sizes
        and the phase times in seconds (teardown, reform, assemble, rebuild, restore, recovery,
        first_step)."""
        live = self._live_recovery
        return list(live.events) if live is not None else []

    @property
    def live_snapshot_every(self) -> int | None:
        """Steps between host-memory snapshots with live recovery on: ``live_elastic.snapshot_every``, or
        the interval ``"auto"`` chose in this world (None while it is still measuring, or when live
        recovery is off). A lost peer rolls training back by at most this many steps."""
        live = self._live_recovery
        return live.snapshot_every if live is not None else None

    def max_memory_allocated(self) -> int:
        """This process's peak allocated accelerator memory since it started, in bytes.

        Read it instead of ``torch.cuda.max_memory_allocated()`` while ``memory.predict_peak`` measures:
        the predictor resets the allocator's peak counter before every pass (it reads each pass's own
        peak) and folds every reading into this value; see :mod:`ds_adabatch.runtime.memory.predictor`.
        Each step's own peak is ``peak_memory_bytes`` in its metrics record.
        """
        return self.memory_recovery.max_memory_allocated()

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
        if n is not None and not self.token_budget:  # a token target is formed into a step, not split
            plan_batch(
                n, self.world_size, self.config.micro_batch_limit, allow_uneven=self.config.allow_uneven
            )
        self.core.set_override(n, reason)

    def resolve_losses(self) -> None:
        """Sum every pending step's loss (and queued measurements) over ranks now; call on every rank.

        Afterwards every :class:`StepLoss` returned so far reads without a collective, and the JSONL and
        monitor records of those steps are written.
        """
        self.step_sync.reduce()

    # ---------------------------------------------------------------------------------------------
    # Checkpoints (checkpoint/save_load.py writes and reads them; checkpoint/run_state.py the section)
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        *,
        keep_last: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """DeepSpeed's ``save_checkpoint`` plus the adabatch state and each rank's RNG state.

        Call on every rank, as with DeepSpeed. The checkpoint becomes visible to ``load_checkpoint``
        (and DeepSpeed's ``latest``) only after every rank finished writing: a rank that dies mid-save
        leaves the previous checkpoint as the one a resume loads; a save over an existing tag replaces
        it whole (its old files and universal copy go first). ``keep_last=K`` then deletes all but the
        newest K complete checkpoints (and their converted copies). Each rank records the size and
        CRC-32 of every file it wrote in the completion record (its manifest): a load tells a damaged file.
        """
        return self.checkpoints.save(save_dir, tag, client_state, keep_last=keep_last, **kwargs)

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, *, elastic: bool = True, **kwargs: Any
    ) -> tuple[str | None, dict]:
        """DeepSpeed's ``load_checkpoint``, then the adabatch state; returns ``(path, client_state)``.

        Without ``tag`` the newest *complete* checkpoint in ``load_dir`` is loaded (``(None, {})``
        when there is none). On another data-parallel size the sample stream continues where it
        stopped and the global batch is re-planned; for ZeRO 1-3 the checkpoint is first converted to
        DeepSpeed's universal format (once, on rank 0; cached as ``<tag>_universal`` and reused) unless
        ``elastic=False``, which raises instead. The client state returned excludes the adabatch entry.

        Before DeepSpeed reads anything, the ranks check the checkpoint's files against its manifest
        (sizes everywhere, each file's CRC-32 on one rank). Without ``tag``, a damaged newest checkpoint
        is skipped for the newest one that verifies (one warning on rank 0 names the file and the step
        resumed from; the path returned is that checkpoint's); when none verifies, or the ``tag`` named
        does not, :class:`~ds_adabatch.CheckpointCorrupt` is raised on every rank and nothing is loaded.
        A checkpoint saved before manifests existed loads unverified (said once).
        """
        self._before_load()
        return self.checkpoints.load(load_dir, tag, elastic=elastic, **kwargs)

    def adabatch_state_dict(self) -> dict[str, Any]:
        """The adabatch part of a checkpoint (global counts only, so a resume can re-shard)."""
        return self.checkpoints.run_state.state_dict()

    def load_adabatch_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`adabatch_state_dict`'s output: counts, schedule, loader cursor, signals;
        the global batch re-planned for this world size."""
        batch = self.checkpoints.run_state.load_state_dict(state)
        try:
            plan = self.core.plan_for(batch)
        except PlanError as err:  # pragma: no cover - rounding above guarantees a plan
            raise ValueError(f"cannot resume: {err}") from err
        self.core.scheduled_batch = batch
        self._decided_step = None
        self._apply_plan(plan, reason="resume", record=False)
        self.deepspeed.global_samples = self.global_samples
        self.lr_coupling.set_samples(self.global_samples)

    def _before_load(self) -> None:
        """What must happen before a checkpoint is loaded (the data-parallel engine's loop)."""

    def _data_state(self) -> Any:
        """The loader's state a checkpoint saves."""
        return None if self.dataloader is None else self.dataloader.state_dict()

    # ---------------------------------------------------------------------------------------------
    # Batch-size decisions (step_core.py decides; the engine applies)
    def _progress(self) -> Progress:
        lrs = self.lr_coupling.get_lr()
        return Progress(
            samples=self.global_samples,
            tokens=self.global_tokens if self.counts_tokens or self.token_budget else None,
            epoch=self.epoch,
            lr=lrs[0] if lrs else None,
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
        decision = self.core.decide(self.global_steps)
        # A token-budget step's shape changes with its samples: only a new target is a plan change.
        record = not self.token_budget or decision.batch != decision.previous
        memory_reason = self.core.take_memory_reason()
        plan = decision.plan
        self.lr_coupling.observe_noise(self.noise.noise_scale_or_inf)  # "adascale" reads it each step
        if plan != self.plan or (self.token_budget and record):  # a new token target: its LR, its line
            reason = decision.reason
            if memory_reason is not None and decision.batch == self.plan.global_batch_size:
                reason = memory_reason
            self._apply_plan(plan, reason=reason, record=record, said=decision.said)
        elif self.lr_coupling.follows_noise:
            self.lr_coupling.set_global_batch(self.core.lr_batch(plan))

    def _apply_plan(
        self, plan: BatchPlan, *, reason: str, record: bool, line: str | None = None, said: Any = None
    ) -> None:
        """Make DeepSpeed's view of the batch match ``plan`` (between optimizer steps only); ``said``:
        the batches the plan-change line says (``Decision.said``)."""
        old = self.plan
        self._apply_shape(plan)
        old_mult = self.lr_coupling.multiplier
        new_mult = self.lr_coupling.set_global_batch(self.core.lr_batch(plan))
        ratio, self.plan = new_mult / old_mult, plan
        if not record:
            return
        self.history.append(
            plan_change(
                old,
                plan,
                step=self.global_steps,
                samples=self.global_samples,
                lr_multiplier=new_mult,
                reason=reason,
            )
        )
        if self.rank == 0:
            logger.info(
                line
                or format_plan_change(
                    old, plan, self.global_steps, ratio, reason, unit=self._plan_unit, scheduled=said
                )
            )

    def _apply_shape(self, plan: BatchPlan) -> None:
        """DeepSpeed's batch keys and what caches them (the pipeline engine adds its activation shapes)."""
        apply_plan_to_engine(self.deepspeed, plan)

    # ---------------------------------------------------------------------------------------------
    # Bookkeeping
    def _finish_step(self, total_samples: int, tokens: int, *, count_memory: bool = True) -> None:
        """Count a completed step: exact samples and tokens, DeepSpeed's count, the learned limit
        (not for a step run below its plan's micro-batch, ``count_memory`` False: a step split for a
        noise measurement says nothing about the plan's micro-batch)."""
        if self.token_budget:  # the step's tokens (lengths), known on every rank
            tokens = self.last_step_batch.global_batch.tokens
        self.global_steps += 1
        self.global_samples += total_samples
        self.global_tokens += tokens
        # DeepSpeed adds train_batch_size (the padded nominal shape) per step; keep the exact count.
        self.deepspeed.global_samples = self.global_samples
        self.lr_coupling.set_samples(self.global_samples)
        largest = self.plan.micro_batch_per_gpu  # the learned limit's unit: samples per pass,
        if self.token_budget:  # or tokens per pass with a token budget
            largest = self.last_step_batch.global_batch.largest_pass
        if count_memory:  # a limit that grows back is logged with the plan change it causes
            self.core.clean_step(largest)

    def _record_step(
        self, step: int, started: float, lr_used: float
    ) -> tuple[StepLoss, Callable[[float, float | None], None], Any]:
        """The step's record and loss, and the norm DeepSpeed computed in it (a device tensor under ZeRO
        1-3, None or a number otherwise): the returned function completes record and loss with the
        global mean loss and that norm once both have been read."""
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
            oom_recovery=self.oom_recovery,
        )
        predictor = self.memory_recovery.predictor
        peak = predictor.take_step_peak() if predictor is not None else None
        if peak is not None:
            record.extra["peak_memory_bytes"] = float(peak)
        # The first step after a live recovery carries its phase times (live_recovery.py).
        if self._record_extra:
            record.extra.update(self._record_extra)
            self._record_extra = None
        # The goodput schedule's latest rating of the batch it chose (docs/metrics.md).
        record.extra.update(schedule_rating(self.controller.schedule))
        loss = StepLoss(step, self.resolve_losses)
        norm = self.deepspeed.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().clone()  # DeepSpeed reuses its buffer: keep this step's value

        def resolved(mean: float, grad_norm: float | None) -> None:
            loss.set_value(mean)
            record.loss = mean
            record.grad_norm = grad_norm if grad_norm is None or math.isfinite(grad_norm) else None
            record.noise_scale = self.noise.noise_scale
            self.core.signals_resolved(mean, record.grad_norm)
            self.metrics.write(record)

        # The step's record now; its loss and grad norm are filled in when resolved.
        self.last_metrics = record
        return loss, resolved, norm

    def _sampler(self) -> Any:
        return getattr(self.dataloader, "sampler", None)

    def close(self) -> None:
        """Resolve pending losses (a collective: call on every rank), stop data workers, close the metrics
        file, remove the memory predictor's module hook."""
        self.resolve_losses()
        if self._live_recovery is not None:
            self._live_recovery.close()
        self.metrics.close()
        self.memory_recovery.close()
        if self.dataloader is not None and hasattr(self.dataloader, "close"):
            self.dataloader.close()

"""The batch side of an ``AdaptiveBatchSizeTrainer`` run: schedule, plan, sample stream, checkpoint state.

:class:`AdaptiveBatchState` owns what the Hugging Face ``Trainer`` does not know about: the
:class:`~ds_adabatch.schedules.BatchSizeController` that picks each optimizer step's global batch, the
:class:`~ds_adabatch.data.ElasticSampler` cursor (every sample once per epoch whatever the batch), this
rank's :class:`~ds_adabatch.data.ElasticDataLoader`, and the JSON state a checkpoint needs to continue
the same sample stream. It does not import transformers; the Trainer subclass drives it.

With ``adabatch.micro_batch_tokens`` (token-budget steps) the sampler is a
:class:`~ds_adabatch.data.tokens.TokenBudgetSampler` and the loader a
:class:`~ds_adabatch.data.token_loader.TokenBudgetLoader`: the schedule's batch is then a token target
(``unit: "tokens"``) or a sample count cut into passes of bounded tokens, each step's plan is the one its
samples were laid out with, and the learned out-of-memory limit counts tokens per pass.

How long the run is (epochs, optimizer steps, the LR schedule's length) is its :attr:`progress`, a
:class:`~ds_adabatch.integrations.hf.progress.StreamProgress` that reads this state through
``ProgressHost``. It is built by ``hf.prepare.build_batch_state``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.config.schedules import measures_noise
from ds_adabatch.data import ElasticDataLoader, ElasticSampler, GlobalBatch, StepBatch
from ds_adabatch.data.token_loader import TokenBudgetLoader
from ds_adabatch.data.tokens import TokenBudgetSampler, TokenStep
from ds_adabatch.plan import BatchPlan, plan_batch
from ds_adabatch.runtime.core.step_core import Progress, StepAttachments, StepCore, in_core
from ds_adabatch.runtime.core.step_times import step_times_for
from ds_adabatch.runtime.core.sync import StepSync
from ds_adabatch.runtime.memory.limit import MicroBatchMemory
from ds_adabatch.runtime.memory.recovery import memory_for
from ds_adabatch.runtime.noise.probe import NoiseCadence
from ds_adabatch.schedules import BatchSizeController
from ds_adabatch.signals import EmaLoss, GradientNoiseEstimator

from .progress import RunEstimate, StreamProgress

__all__ = ["STATE_FILE", "AdaptiveBatchState", "LrSettings"]

logger = logging.getLogger("ds_adabatch")

STATE_FILE = "adabatch_state.json"
"""Name of the JSON file an ``AdaptiveBatchSizeTrainer`` checkpoint holds next to ``trainer_state.json``."""

_STATE_VERSION = 1
_STATE_KIND = "AdaptiveBatchSizeTrainer"
_SUPPORTED_SIGNALS = frozenset({"loss", "loss_ema", "tokens", "lr", "noise_scale", "step_time"})


@dataclass(frozen=True)
class LrSettings:
    """How the learning-rate schedule follows the batch (see ``ds_adabatch.runtime.core.lr.BatchCoupledLR``)."""

    unit: str
    """``"samples"``: the scheduler advances once per ``reference_batch`` samples; ``"steps"``: once per
    optimizer step."""
    reference_batch: int
    """Samples per scheduler tick in ``"samples"`` mode, and the batch at which the LR multiplier is 1."""
    rule: str
    """LR multiplier rule as the global batch changes: ``"none"``, ``"linear"``, ``"sqrt"`` or
    ``"adascale"`` (AdaScale's gain at the measured noise scale, applied before every step)."""
    target_reference: int | None = None
    """With a schedule counted in tokens (``unit: "tokens"``): the token target at which the multiplier
    is 1 (``reference_batch`` then only sizes the samples clock's tick); None otherwise."""
    gain_power: float = 0.5
    """The power of AdaScale's gain under ``"adascale"``."""


class AdaptiveBatchState:
    """Schedule, plan and sample stream of one training run; every rank holds an identical copy.

    Decisions are taken on every rank from the same global values (steps, samples, lengths, and
    signals summed over ranks), so every rank decides the same plan without a collective. Only a
    schedule whose answer may differ between ranks (a user's function) is agreed, at its evaluations,
    in one small all-reduce (rank 0's answer), as ``ds_adabatch.runtime`` does.
    """

    def __init__(
        self,
        config: AdaBatchConfig,
        controller: BatchSizeController,
        loader: ElasticDataLoader | TokenBudgetLoader,
        *,
        dataset: Any,
        device: torch.device,
        num_train_epochs: float,
        max_steps: int,
        lr: LrSettings,
        loss_normalization: str | None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.loader = loader
        self.dataset = dataset
        """The training dataset (columns the model does not take already removed)."""
        self.sampler: ElasticSampler | TokenBudgetSampler = loader.sampler
        self.token_budget = isinstance(loader, TokenBudgetLoader)
        """True with ``adabatch.micro_batch_tokens``: steps are formed by the token-budget sampler."""
        self.world_size = loader.world_size
        self.rank = loader.rank
        self.device = device
        self.num_train_epochs = float(num_train_epochs)
        self.max_steps = int(max_steps)
        self.lr = lr
        self.loss_normalization = loss_normalization
        """``"sample"`` or ``"token"`` when the config says so; ``None``: as the Trainer would normalise."""
        self.sync = StepSync(device)
        """Sums per-rank values over ranks in as few all-reduces as possible (``runtime.step_sync``)."""
        self.memory: MicroBatchMemory = memory_for(config)
        """The micro-batch limit (samples per pass, or with a token budget tokens per pass), lowered by
        out-of-memory errors and grown back (``"adabatch".memory``)."""
        self.last_lr: float | None = None
        self._tokens = 0
        self._pending_tokens: list[torch.Tensor] = []
        schedule = config.schedule
        self.noise: GradientNoiseEstimator | None = (
            GradientNoiseEstimator(**schedule.estimator_settings()) if measures_noise(schedule) else None
        )
        """The gradient-noise-scale estimate the ``gradient_noise`` and ``goodput`` schedules read (else
        None)."""
        rule = controller.schedule
        self.step_times = step_times_for(rule, getattr(rule, "throughput", None), device)
        """Each step's time for the ``goodput`` schedule's model, agreed in the step's collective
        (``runtime.step_times``); a no-op object for every other schedule."""
        self.core = StepCore(
            controller,
            sync=self.sync,
            attach=StepAttachments(
                self.memory, self.noise, self.step_times, NoiseCadence(schedule, splits=False)
            ),
            progress=self._progress,
            rank=self.rank,
            world_size=self.world_size,
            allow_uneven=config.allow_uneven,
            scheduled_batch=controller.initial_global_batch(),
            token_loader=loader if self.token_budget else None,
            token_budget=self.token_budget,
        )
        """Decides each step's batch and plan, as ``ds_adabatch.runtime`` does (``runtime.step_core``)."""
        self.initial_plan = self.plan_for(self.scheduled_batch)
        self.plan: BatchPlan = self.initial_plan
        """The plan of the latest step run (an epoch's smaller tail batch included)."""
        self.progress = StreamProgress(self)
        """How long the run is: epochs, optimizer steps, the LR schedule's length (``hf.progress``)."""
        self._decided: tuple[int, BatchPlan] | None = None
        self._peeked: tuple[tuple, GlobalBatch | TokenStep] | None = None
        self._warned_micro_one: set[int] = set()
        self._notes: tuple[int, list[tuple[int, str, int | None]]] = (0, [])
        """What the decision of a step has to say (rank 0): logged when that step starts."""
        self._warn_if_micro_one(0, self.initial_plan)
        missing = controller.schedule.requires - _SUPPORTED_SIGNALS
        if missing:
            raise ValueError(
                f"the {controller.schedule.name} schedule needs {', '.join(sorted(missing))}, which "
                "AdaptiveBatchSizeTrainer does not measure; use ds_adabatch.initialize (the DeepSpeed "
                "runtime) for it, or pick another schedule"
            )

    # -- the step core's state -----------------------------------------------------------------------
    scheduled_batch = in_core[int](
        "The global batch the schedule chose for the latest decided step (before any epoch-tail replan): "
        "samples, or a token target with a schedule counted in tokens."
    )
    last_loss = in_core[float | None]("The global mean loss of the latest logged step.")
    loss_ema = in_core[EmaLoss]("The smoothed loss the schedule reads (an ``EmaLoss``).")
    last_step = in_core[StepBatch | None](
        "This rank's micro-batches of the latest step drawn (indices, sizes, pads; ``StepCore.draw``)."
    )

    def _progress(self) -> Progress:
        return Progress(
            samples=self.sampler.samples_consumed,
            tokens=self.tokens if self.needs_tokens or self.token_budget else None,
            epoch=self.sampler.fractional_epoch,
            lr=self.last_lr,
        )

    # -- progress ------------------------------------------------------------------------------------
    @property
    def train_coverage(self) -> float:
        """Fraction of the current epoch's samples trained (1.0 right after an epoch's last batch)."""
        return self.sampler.train_coverage

    @property
    def epoch(self) -> float:
        """Fractional epoch: completed epochs plus the current one's coverage.

        With ``drop_last``, an epoch whose untrained tail is smaller than the next step's batch (the
        tail will be skipped) reads as complete: the last epoch of a run ends at a whole number, as it
        does without ``drop_last``.
        """
        nxt = self._next_batch()
        if nxt is not None and nxt.epoch > self.sampler.epoch:
            return float(nxt.epoch)
        return self.sampler.fractional_epoch

    @property
    def stream_samples(self) -> int:
        """Samples of the stream passed: trained ones, plus the epoch tails ``drop_last`` skipped.

        The tail of the current epoch counts once it is smaller than the current plan's batch (it can
        no longer be trained at that batch). This is the clock of a samples-based LR schedule, so the
        schedule ends with the epochs whatever tails the batch sizes left out.
        """
        s = self.sampler
        passed = s.samples_consumed + s.samples_skipped
        if s.drop_last:
            left = s.num_samples - s.position
            if self.token_budget:
                # A token step skips the tail when it holds less than the target: ask the sampler.
                if left > 0 and self.loader.peek_step(self.scheduled_batch).skipped:
                    passed += left
            elif 0 < left < self.plan.global_batch_size:
                passed += left
        return passed

    def _next_batch(self) -> GlobalBatch | TokenStep | None:
        """The next step's global batch if that step's plan is already decided, else None."""
        if self._decided is None:
            return None
        return self._peek(self._decided[1])

    def _peek(self, plan: BatchPlan) -> GlobalBatch | TokenStep:
        """The global batch the next step draws under ``plan`` (a token step: the scheduled target's).

        Between two steps the epoch, the progress bar and the end-of-training check all ask for the same
        batch; it is computed once (a peek derives the batch's sample order) while the cursor stands.
        """
        s = self.sampler
        key = (s.epoch, s.position, s.samples_consumed, plan, self.scheduled_batch, self.memory.limit)
        if self._peeked is None or self._peeked[0] != key:
            found = self.loader.peek_step(self.scheduled_batch) if self.token_budget else s.peek_batch(plan)
            self._peeked = (key, found)
        return self._peeked[1]

    @property
    def samples_consumed(self) -> int:
        """Samples trained over all epochs and ranks."""
        return self.sampler.samples_consumed

    @property
    def needs_loss(self) -> bool:
        return bool({"loss", "loss_ema"} & self.controller.schedule.requires)

    @property
    def tokens(self) -> int:
        """Tokens trained, all ranks together: each step's target tokens where they are counted, or with
        a token budget the samples' lengths (0 where neither is counted).

        Steps add their count as a device tensor (summed over ranks) without reading it; reading this
        property reads them (a host synchronisation on a GPU), so it is read only where needed: by a
        tokens-keyed schedule, a token-budget log, a checkpoint.
        """
        if self._pending_tokens:
            self._tokens += int(round(float(torch.stack(self._pending_tokens).sum())))
            self._pending_tokens = []
        return self._tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self._tokens, self._pending_tokens = int(value), []

    def add_tokens(self, count: int | torch.Tensor) -> None:
        """Count a step's tokens (an int, or a device tensor summed over ranks, read when needed)."""
        if isinstance(count, torch.Tensor):
            self._pending_tokens.append(count.detach().reshape(()).double())
        else:
            self._tokens += int(count)

    @property
    def needs_tokens(self) -> bool:
        """Whether the schedule reads the tokens trained (with a token budget: the samples' lengths)."""
        return "tokens" in self.controller.schedule.requires

    @property
    def counts_label_tokens(self) -> bool:
        """Whether a tokens-keyed schedule needs each step's target tokens counted and all-reduced; with
        a token budget every rank knows the step's tokens from the lengths instead."""
        return self.needs_tokens and not self.token_budget

    @property
    def micro_batch_size(self) -> int:
        """Samples of the latest step's largest pass (without a token budget: the plan's micro-batch)."""
        step = self.last_step
        if not self.token_budget or step is None:
            return self.plan.micro_batch_per_gpu
        return max(len(m) for layout in step.global_batch.layouts for m in layout.micro_batches)

    @property
    def samples_per_step(self) -> int:
        """Samples of one step at the current batch (with a token budget: the latest step's, an estimate)."""
        return self.plan.global_batch_size if self.token_budget else self.scheduled_batch

    def lr_batch(self, plan: BatchPlan) -> float:
        """What ``BatchCoupledLR.set_global_batch`` is given for a step of ``plan``.

        The step's samples; with a token budget the scheduled target instead (the sample count of a
        token step varies with its lengths), and with a schedule counted in tokens that target on the
        scale of ``reference_batch``, so the multiplier is ``rule(target / target_reference)``.
        """
        if not self.token_budget:
            return plan.global_batch_size
        if self.lr.target_reference is None:
            return self.scheduled_batch
        return self.scheduled_batch * self.lr.reference_batch / self.lr.target_reference

    def should_measure_noise(self, step: int, plan: BatchPlan) -> bool:
        """Whether optimizer step ``step`` (completed steps before it) measures the noise scale
        (see :class:`~ds_adabatch.runtime.noise.probe.NoiseCadence`)."""
        return self.core.attach.noise_cadence.due(step, self.world_size, plan.gradient_accumulation_steps)

    # -- decisions -----------------------------------------------------------------------------------
    def plan_for(self, global_batch: int) -> BatchPlan:
        """The plan of the next step for the schedule's ``global_batch`` (a token step: as laid out)."""
        return self.core.plan_for(global_batch)

    def after_clean_step(self, step: StepBatch) -> None:
        """A step completed without an out-of-memory error: the learned limit may grow back."""
        largest = step.global_batch.largest_pass if self.token_budget else step.plan.micro_batch_per_gpu
        self.core.clean_step(largest)

    def recut_after_oom(self, step: StepBatch, failed: dict[int, int | None], number: int) -> BatchPlan:
        """Every rank agreed that the ranks in ``failed`` ran out of memory in a token step (``failed``
        maps each to the pass it failed in): the same samples, cut with a lower token budget; returns
        the plan to reload ``step`` with (logged once on rank 0).

        Raises:
            UnrecoverableOutOfMemory: every failed pass held a single sample.
        """
        from ds_adabatch.runtime.memory.recovery import replan_token_step_after_oom

        sampler = self.loader.sampler
        new, _, line = replan_token_step_after_oom(self.memory, sampler, step.global_batch, failed, number)
        if self.rank == 0:
            logger.info("%s", line)
        return new.plan(sampler.max_micro_batch)

    def replan_after_oom(self, plan: BatchPlan, ranks: list[int], step: int) -> BatchPlan:
        """Every rank agreed that ``ranks`` ran out of memory at ``plan``: the same samples, smaller
        micro-batches (logged once on rank 0).

        Raises:
            UnrecoverableOutOfMemory: the failed micro-batch was 1 sample.
        """
        from ds_adabatch.runtime.memory.recovery import replan_after_oom

        new, _, line = replan_after_oom(self.memory, plan, ranks, step, self.config.allow_uneven)
        if self.rank == 0:
            logger.info("%s", line)
        return new

    def plan_for_step(self, step: int) -> BatchPlan:
        """The plan of optimizer step ``step`` (completed steps before it); decided once, then cached.

        Call it on every rank at the same point: a schedule that reads the loss resolves the pending
        losses first, and a user's function has its answer agreed (both are collectives).
        """
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        decision = self.core.decide(step)
        plan = decision.plan
        self._notes = (step, [])
        if decision.batch != decision.previous:
            line = f"step {step}: global batch {decision.previous} -> {plan.describe()} ({decision.reason})"
            self._notes[1].append((logging.INFO, line, None))
        self._warn_if_micro_one(step, plan)
        self._decided = (step, plan)
        return plan

    def _warn_if_micro_one(self, step: int, plan: BatchPlan) -> None:
        """Warn (rank 0, once per global batch) before a step runs one sample per pass where an uneven
        split would run larger passes."""
        per_rank = plan.micro_batch_per_gpu * plan.gradient_accumulation_steps
        limit = self.memory.limit
        if (
            self.token_budget
            or plan.micro_batch_per_gpu != 1
            or per_rank < 2
            or limit < 2
            or plan.global_batch_size in self._warned_micro_one
        ):
            return
        uneven = plan_batch(plan.global_batch_size, self.world_size, limit, allow_uneven=True)
        line = (
            f"step {step}: global batch {plan.global_batch_size} runs as micro-batches of 1 sample x "
            f"{plan.gradient_accumulation_steps} accumulation steps on {self.world_size} rank(s): {per_rank} "
            f"samples per rank do not split evenly into micro-batches of at most {limit}. Set "
            f'"allow_uneven": true in the adabatch section (micro-batches of {uneven.micro_batch_per_gpu}, '
            f"{uneven.gradient_accumulation_steps} passes), or choose global batches that split evenly "
            "(granularity)"
        )
        self._notes[1].append((logging.WARNING, line, plan.global_batch_size))

    def step_started(self, step: int) -> None:
        """Log (rank 0) what the decision of step ``step`` has to say, as the step starts: a plan change,
        a warning. A decision taken for a step that never runs (training ended) says nothing."""
        noted_step, notes = self._notes
        if noted_step != step or not notes:
            return
        self._notes = (step, [])
        for level, line, warned in notes:
            if warned is not None:
                if warned in self._warned_micro_one:
                    continue
                self._warned_micro_one.add(warned)
            if self.rank == 0:
                logger.log(level, "%s", line)

    def upcoming_batch(self, step: int) -> GlobalBatch | TokenStep:
        """The global batch step ``step`` will draw under its plan (peeked: the cursor stays)."""
        return self._peek(self.plan_for_step(step))

    def next_batch_epoch(self, step: int) -> int:
        """The epoch the next global batch (of step ``step``) is drawn from."""
        return self.upcoming_batch(step).epoch

    # -- how long the run is (``self.progress``) ------------------------------------------------------
    @property
    def epoch_based(self) -> bool:
        """True when ``num_train_epochs`` (not ``max_steps``) ends training."""
        return self.progress.epoch_based

    def finished(self, step: int) -> bool:
        """True when ``num_train_epochs`` are trained (see :meth:`StreamProgress.finished`)."""
        return self.progress.finished(step)

    def steps_left(self, step: int) -> int:
        """Optimizer steps still to run at the batch of step ``step`` (:meth:`StreamProgress.steps_left`)."""
        return self.progress.steps_left(step)

    def step_budget(self, step: int) -> int:
        """The Trainer's ``state.max_steps`` at step ``step`` (:meth:`StreamProgress.step_budget`)."""
        return self.progress.step_budget(step)

    def planned_samples(self) -> int:
        """Samples ``num_train_epochs`` hold at the initial batch (:meth:`StreamProgress.planned_samples`)."""
        return self.progress.planned_samples()

    def scheduler_steps(self) -> int:
        """Length of the LR schedule in its own unit (:meth:`StreamProgress.scheduler_steps`)."""
        return self.progress.scheduler_steps()

    def estimate(self, step: int) -> RunEstimate:
        """The run's optimizer steps from step ``step`` on (:meth:`StreamProgress.estimate`)."""
        return self.progress.estimate(step)

    @property
    def run_estimate(self) -> RunEstimate:
        """The latest :meth:`estimate`."""
        return self.progress.run_estimate

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self, global_step: int) -> dict[str, Any]:
        """Global counts only, so a resume on another world size continues the same stream."""
        nxt = None
        if self._decided is not None and self._decided[0] == global_step:
            # A token step's plan holds its samples; the decision is the target they were taken for.
            batch = self.scheduled_batch if self.token_budget else self._decided[1].global_batch_size
            nxt = {"step": global_step, "global_batch": batch}
        return {
            "kind": _STATE_KIND,
            "version": _STATE_VERSION,
            "world_size": self.world_size,
            "global_step": global_step,
            "scheduled_batch": self.scheduled_batch,
            "next": nxt,
            "controller": self.controller.state_dict(),
            "data": self.loader.state_dict(),
            "last_loss": self.last_loss,
            "loss_ema": self.loss_ema.state_dict(),
            "tokens": self.tokens,
            "last_lr": self.last_lr,
            "noise": None if self.noise is None else self.noise.state_dict(),
            "memory": self.memory.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], global_step: int) -> None:
        """Continue from :meth:`state_dict`'s output at ``global_step`` completed optimizer steps.

        Raises:
            ValueError: the state is of another kind or version, or of another step than the Trainer's.
        """
        if state.get("kind") != _STATE_KIND or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"{STATE_FILE} holds {state.get('kind')!r} state version {state.get('version')!r}; this "
                f"AdaptiveBatchSizeTrainer reads {_STATE_KIND!r} version {_STATE_VERSION}"
            )
        if state["global_step"] != global_step:
            raise ValueError(
                f"{STATE_FILE} was written at step {state['global_step']} but trainer_state.json says "
                f"{global_step}; the checkpoint folder mixes two saves"
            )
        saved_tokens = isinstance(state.get("data"), Mapping) and state["data"].get("kind") == "tokens"
        if saved_tokens != self.token_budget:
            written, now = ("with", "without") if saved_tokens else ("without", "with")
            raise ValueError(
                f"{STATE_FILE} was written {written} adabatch.micro_batch_tokens but this run is {now} "
                "it: its sample stream cannot continue; resume with the DeepSpeed config the checkpoint "
                "was written with"
            )
        self.controller.load_state_dict(state["controller"])
        self.loader.load_state_dict(state["data"])
        self.last_loss = state["last_loss"]
        self.loss_ema.load_state_dict(state["loss_ema"])
        self.tokens = int(state["tokens"])
        self.last_lr = state["last_lr"]
        if state.get("memory") is not None:  # absent from states written before OOM recovery
            self.memory.load_state_dict(state["memory"])
        noise = state.get("noise")  # absent from states written before the Trainer measured it
        if self.noise is not None and noise is not None:
            self.noise.load_state_dict(noise)
        self.scheduled_batch = self.controller.resume_batch(state["scheduled_batch"], state["world_size"])
        self._decided = None
        nxt = state.get("next")
        if nxt is not None and nxt["step"] == global_step:
            # The schedule was already asked for this step before the save; asking again would advance
            # a stateful rule (a user's batch_size_scheduler) twice.
            batch = self.controller.resume_batch(nxt["global_batch"], state["world_size"])
            self.scheduled_batch = batch
            self._decided = (global_step, self.plan_for(batch))

    def save(self, folder: str, global_step: int) -> None:
        """Write :data:`STATE_FILE` into ``folder`` (one rank is enough: the state is global)."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.state_dict(global_step), f, indent=1)
        os.replace(path + ".tmp", path)

    def load(self, folder: str, global_step: int) -> None:
        """Read :data:`STATE_FILE` from a checkpoint folder.

        Raises:
            ValueError: the folder has no such file (it was not saved by an AdaptiveBatchSizeTrainer).
        """
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{folder} has no {STATE_FILE}: it was not saved by AdaptiveBatchSizeTrainer, so the "
                "sample cursor and batch schedule cannot be restored; resume from one of its checkpoints"
            )
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f), global_step)

    def close(self) -> None:
        """Stop the data workers."""
        self.loader.close()

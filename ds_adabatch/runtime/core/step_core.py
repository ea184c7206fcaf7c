"""The cycle of an optimizer step, written once: decide -> plan -> draw -> account -> state.

Every entry point holds one :class:`StepCore`: the DeepSpeed engines (``train_batch``, the forward /
backward / step loop, the pipeline engine, through :class:`~ds_adabatch.runtime.engine.base.AdaptiveEngineBase`)
and the Hugging Face Trainer (through ``integrations.hf.state.AdaptiveBatchState``). It imports neither
DeepSpeed nor transformers; the holder runs the passes and applies the plans its own way::

    decide    decide(step): an override (agreed once) or the schedule's answer for ScheduleContext,
              losses resolved first where the rule reads them, a user function's answer agreed
    plan      plan_for(batch): the plan of a global batch under the learned micro-batch limit (a token
              target: the step the loader lays out); the steady case is answered from a cache
    draw      draw(loader, plan): the step's global batch from the holder's loader, with the plans the
              holder applies around it (an epoch's smaller tail, two half passes for a noise
              measurement; draw.py); recut(loader, step, plan): the same samples cut anew (an
              out-of-memory retry); last_step is this rank's share of the latest step
    account   clean_step(largest): the learned limit may grow back; signals_resolved(loss, norm): the
              step's global loss reaches the signals the next decision reads
    state     state_dict() / load_state_dict(): what the next decisions depend on, in checkpoints

What rides on a step attaches at named points (:class:`StepAttachments`), each a no-op object when off:
``memory`` (out-of-memory recovery and the memory predictor read and lower it), ``noise`` (the noise
probe's estimate; None when no schedule reads it) and ``step_times`` (the goodput schedule's throughput
measurements).

A decision is identical on every rank: the context holds only global values, and inputs that may differ
between ranks (``set_global_batch_size``, a user's function) are agreed in one small collective in which
rank 0's value wins (:class:`~ds_adabatch.runtime.core.sync.StepSync` carries it with what is queued).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ...plan import BatchPlan, plan_batch
from ...schedules import BatchSizeController, ScheduleContext
from ...signals import EmaLoss, GradientNoiseEstimator
from ..memory.limit import MicroBatchMemory
from .draw import Drawn, StepSource, draw_step
from .metrics import PlanChange
from .step_times import NoStepTimes
from .sync import StepSync

if TYPE_CHECKING:
    from ...data.step_batch import StepBatch
    from ..noise.probe import NoiseCadence

logger = logging.getLogger("ds_adabatch")

__all__ = [
    "CoreHolder",
    "Decision",
    "Progress",
    "StepAttachments",
    "StepCore",
    "TokenStepLoader",
    "in_core",
    "plan_change",
]

_LOSS_SIGNALS = frozenset({"loss", "loss_ema"})
T = TypeVar("T")


@dataclass(frozen=True)
class Progress:
    """Where the run stands as a step is decided: global values, identical on every rank."""

    samples: int
    """Samples trained over all ranks and epochs."""
    tokens: int | None
    """Tokens trained over all ranks (None where they are not counted)."""
    epoch: float
    """Fractional epoch: completed epochs plus the current one's coverage."""
    lr: float | None
    """Learning rate of the latest step (None before the first)."""


@dataclass(frozen=True)
class Decision:
    """What :meth:`StepCore.decide` settled for one optimizer step."""

    step: int
    """Optimizer steps completed before the decided one."""
    batch: int
    """The global batch the schedule (or an override) chose: samples, or a token target."""
    previous: int
    """The scheduled batch before this decision."""
    reason: str
    """Why: the schedule's reason, ``"hold until step N"``, or the override's reason."""
    plan: BatchPlan
    """The plan of ``batch`` (a token target: the step the loader laid out)."""
    said: tuple[int, int, str] | None = None
    """With token budgets: ``(previous, batch, unit)`` for the plan-change line, which then says the
    schedule's batches rather than two steps' samples (the step before may be an epoch's tail)."""


class TokenStepLoader(Protocol):
    """A loader that forms token-budget steps (``data.token_loader.TokenBudgetLoader``)."""

    @property
    def sampler(self) -> _TokenSampler: ...

    def plan_for_tokens(self, target: int) -> BatchPlan: ...


class _TokenSampler(Protocol):
    pass_budget: int

    bucket_window: int

    def passes_of(self, lengths: Any, world_size: int, budget: int) -> int: ...


@dataclass
class StepAttachments:
    """The features that ride on a step, at their named points (each a no-op object when off)."""

    memory: MicroBatchMemory
    """The learned micro-batch limit: out-of-memory recovery lowers it, the memory predictor caps it,
    clean steps grow it back (samples per pass, or tokens per pass with a token budget)."""
    noise: GradientNoiseEstimator | None = None
    """The gradient-noise-scale estimate the noise probe feeds (None: nothing measures it)."""
    step_times: NoStepTimes | None = None
    """The goodput schedule's step times (``NoStepTimes`` for every other schedule)."""
    noise_cadence: NoiseCadence | None = None
    """Which steps measure the noise scale; its state (the latest step split in two for a measurement)
    is part of the step core's."""


class StepCore:
    """Decides, plans, draws and accounts optimizer steps for one holder (see the module docstring).

    Args:
        controller: the batch-size controller (schedule, bounds, granularity).
        sync: the holder's step sync; agreements and loss resolution ride its collectives.
        attach: the features attached to the step.
        progress: the holder's global counts, read as a step is decided.
        rank, world_size: this process and the data-parallel ranks plans are made for.
        allow_uneven: ``adabatch.allow_uneven``.
        scheduled_batch: the global batch of step 0.
        token_loader: with a token budget, the loader that lays out each step (None otherwise).
        token_budget: whether steps are token-budget steps (``adabatch.micro_batch_tokens``).
        resolve_losses: how the holder makes every pending step's loss known (the pipeline engine reads
            DeepSpeed's aggregated loss as well); None: ``sync.reduce()``.
    """

    def __init__(
        self,
        controller: BatchSizeController,
        *,
        sync: StepSync,
        attach: StepAttachments,
        progress: Callable[[], Progress],
        rank: int,
        world_size: int,
        allow_uneven: bool,
        scheduled_batch: int,
        token_loader: TokenStepLoader | None = None,
        token_budget: bool = False,
        resolve_losses: Callable[[], None] | None = None,
    ) -> None:
        self.controller = controller
        self.sync = sync
        self._resolve_losses = resolve_losses or sync.reduce
        self.attach = attach
        self._progress = progress
        self.rank = rank
        self.world_size = world_size
        self.allow_uneven = allow_uneven
        self.token_budget = token_budget
        self.token_loader = token_loader
        model = getattr(attach.step_times, "model", None)
        if token_loader is not None and model is not None:
            # goodput rates a batch by the passes its samples pack into: packed as this loader packs
            sampler = token_loader.sampler
            model.bind_packer(sampler.passes_of, min_lengths=sampler.bucket_window)
        self.scheduled_batch = scheduled_batch
        """The global batch the schedule chose for the latest decided step (before an epoch-tail or
        out-of-memory re-plan): samples, or a token target."""
        self.override: tuple[int, str] | None = None
        """``set_global_batch_size``'s batch and reason (None: the schedule decides)."""
        self.override_agreed = False
        self.last_step: StepBatch | None = None
        """This rank's micro-batches of the latest step drawn (as cut for its latest attempt)."""
        self.memory_reason: str | None = None
        """Why the learned limit moved at the latest clean step (said with the plan change it causes)."""
        # Signals the next decision reads, completed as each step's loss is resolved.
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        self.loss_ema = EmaLoss(beta=0.9)
        schedule = controller.schedule
        self._reads_loss = bool(_LOSS_SIGNALS & schedule.requires)
        self._reads_times = "step_time" in schedule.requires
        self._agrees = bool(getattr(schedule, "needs_agreement", False))
        self._planned: tuple[int, int, BatchPlan] | None = None  # (batch, limit, plan): the steady case
        self.split_said = False  # a poor even split was warned of (_say_if_split_poorly)
        self.tail_drawn = False  # the latest step drawn was an epoch's smaller tail (said at the return)

    # -- decide --------------------------------------------------------------------------------------
    def context(self, step: int) -> ScheduleContext:
        """What the schedule sees for optimizer step ``step`` (completed steps before it)."""
        progress = self._progress()
        noise = self.attach.noise
        return ScheduleContext(
            step=step,
            samples=progress.samples,
            tokens=progress.tokens,
            epoch=progress.epoch,
            # The scheduled batch, not a one-off epoch-tail remainder, is what the schedule steers.
            global_batch=self.scheduled_batch,
            world_size=self.world_size,
            loss=self.last_loss,
            loss_ema=self.loss_ema.value,
            grad_norm=self.last_grad_norm,
            noise_scale=None if noise is None else noise.noise_scale_now,
            noise_scale_error=None if noise is None else noise.relative_error_now,
            lr=progress.lr,
            micro_batch_limit=None if self.token_budget else self.attach.memory.limit,
            pass_budget=self.attach.memory.limit if self.token_budget else None,
        )

    def decide(self, step: int) -> Decision:
        """Decide optimizer step ``step``: its global batch (agreed where it may differ by rank) and plan.

        Call it on every rank at the same point: it may resolve pending losses and agree a value,
        both collectives. ``scheduled_batch`` is the decided batch afterwards.
        """
        if self.override is not None:
            batch, reason = self.override
            if not self.override_agreed:
                batch = self.agree([batch])[0]
                self.override, self.override_agreed = (batch, reason), True
        else:
            controller = self.controller
            evaluates = controller.evaluates_at(step)
            if evaluates and (
                self._reads_loss or (self._reads_times and controller.schedule.decides_at(step))
            ):
                # The rule reads the latest loss (or the step times of a goodput decision): every
                # pending step's, summed over ranks. A goodput decision costs this every decide_every.
                self._resolve_losses()
            decision = controller.next_global_batch(self.context(step))
            batch, reason = decision.global_batch, decision.reason
            if evaluates and self._agrees:
                batch = self.agree_schedule(batch)
        previous, self.scheduled_batch = self.scheduled_batch, batch
        if self.tail_drawn and batch == previous:  # the plan changes back, not by the schedule's reason
            reason = "the scheduled batch again after the epoch's last batch"
        self.tail_drawn = False
        said = (previous, batch, self.controller.config.schedule.batch_unit) if self.token_budget else None
        return Decision(step, batch, previous, reason, self.plan_for(batch), said)

    def set_override(self, batch: int | None, reason: str = "manual") -> None:
        """From the next decision on the global batch is ``batch`` (agreed once); None: the schedule."""
        self.override = None if batch is None else (int(batch), reason)
        self.override_agreed = False

    def agree(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank, in one collective (with whatever the sync has queued)."""
        mine = [float(v) if self.rank == 0 else 0.0 for v in values]
        return [int(round(float(v))) for v in self.sync.reduce(mine)]

    def agree_schedule(self, batch: int) -> int:
        """Rank 0's answer and remembered state of a schedule that may answer differently by rank."""
        schedule = self.controller.schedule
        agreed = self.agree([batch, *schedule.shared_state()])
        schedule.load_shared_state(agreed[1:])
        return agreed[0]

    # -- plan ----------------------------------------------------------------------------------------
    def lr_batch(self, plan: BatchPlan) -> int:
        """The batch the LR multiplier is given for a step of ``plan``: its samples; with token-budget
        steps the scheduled token target (a step's sample count varies with its lengths)."""
        return self.scheduled_batch if self.token_budget else plan.global_batch_size

    def plan_for(self, batch: int) -> BatchPlan:
        """The plan of global batch ``batch`` under the learned limit (a token target: as laid out).

        Raises:
            ValueError: token-budget steps without a loader to form them.
            PlanError: ``batch`` cannot be split over this world size.
        """
        limit = self.attach.memory.limit
        if self.token_budget:
            if self.token_loader is None:
                raise ValueError(
                    "token-budget steps need training_data and lengths in ds_adabatch.initialize"
                )
            # Cut with the learned token budget (micro_batch_tokens until an out-of-memory error lowers it).
            self.token_loader.sampler.pass_budget = limit
            return self.token_loader.plan_for_tokens(batch)
        planned = self._planned
        if planned is not None and planned[0] == batch and planned[1] == limit:
            return planned[2]  # the steady case: nothing to solve
        plan = plan_batch(batch, self.world_size, limit, allow_uneven=self.allow_uneven)
        self._planned = (batch, limit, plan)
        self._say_if_split_poorly(plan, limit)
        return plan

    def _say_if_split_poorly(self, plan: BatchPlan, limit: int) -> None:
        """Once per run (rank 0): an even split of at least twice the passes an uneven one needs (a
        ramp through 29 samples with micro-batches of at most 16 runs micro 1 x GAS 29)."""
        if self.split_said or self.allow_uneven:  # an uneven split already holds it in the fewest passes
            return
        per_rank = -(-plan.global_batch_size // plan.world_size)
        fewest = -(-per_rank // limit)
        if plan.gradient_accumulation_steps < 2 * fewest:
            return
        self.split_said = True
        if self.rank == 0:
            logger.warning(
                "global batch %d on %d rank(s) splits evenly only as micro %d x gas %d under the micro-batch "
                "limit %d (%d passes where %d would hold it), and a pass costs its overhead whatever its "
                'size: set "allow_uneven": true (passes differ by one sample, the step stays exact) or a '
                '"granularity" whose multiples split well (e.g. %d); said once',
                plan.global_batch_size,
                plan.world_size,
                plan.micro_batch_per_gpu,
                plan.gradient_accumulation_steps,
                limit,
                plan.gradient_accumulation_steps,
                fewest,
                limit * plan.world_size,
            )

    # -- draw ----------------------------------------------------------------------------------------
    def draw(self, source: StepSource, plan: BatchPlan, *, split: bool = False, load: bool = True) -> Drawn:
        """Draw the step of the decided ``plan`` from the holder's loader (``draw.draw_step``): this
        rank's micro-batches, and the plans to apply around them (an epoch's tail, a noise
        measurement's two half passes when ``split``). ``load=False``: advance without reading."""
        drawn = draw_step(source, plan, world_size=self.world_size, split=split, load=load)
        self.last_step, self.tail_drawn = drawn.step, drawn.tail is not None
        return drawn

    def recut(self, source: StepSource, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """``step``'s samples cut anew for ``plan`` by the loader that drew them (an out-of-memory
        retry at smaller passes: the same global batch; nothing is consumed)."""
        self.last_step = source.reload(step, plan)
        return self.last_step

    # -- account -------------------------------------------------------------------------------------
    def clean_step(self, largest_pass: int) -> None:
        """A step ran without an out-of-memory error at passes of at most ``largest_pass`` (samples, or
        tokens with a token budget): the learned limit may grow back, said with the next plan change."""
        memory = self.attach.memory
        capped = memory.take_capped()  # the prediction's bound, agreed in this step's passes
        moved = memory.on_clean_step(largest_pass) or capped
        if moved is not None:
            self.memory_reason = f"micro-batch limit {moved.old_limit} -> {moved.new_limit} ({moved.reason})"

    def take_memory_reason(self) -> str | None:
        """Why the limit moved since the last decision (once), or None."""
        reason, self.memory_reason = self.memory_reason, None
        return reason

    def signals_resolved(self, mean_loss: float, grad_norm: float | None) -> None:
        """A step's global mean loss (and gradient norm) was resolved: the next decision reads them."""
        self.last_loss, self.last_grad_norm = mean_loss, grad_norm
        self.loss_ema.update(mean_loss)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the next decisions depend on: the scheduled batch, the override, the schedule's state,
        the signals it reads and the learned micro-batch limit (global values, so a resume can
        re-shard). The keys are those of the engine's checkpoint section (``checkpoint/run_state.py``)."""
        noise, cadence = self.attach.noise, self.attach.noise_cadence
        return {
            "scheduled_batch": self.scheduled_batch,
            "override": self.override,
            "controller": self.controller.state_dict(),
            "loss_ema": self.loss_ema.state_dict(),
            "noise": None if noise is None else noise.state_dict(),
            "noise_cadence": None if cadence is None else cadence.state_dict(),
            "last_loss": self.last_loss,
            "last_grad_norm": self.last_grad_norm,
            "memory": self.attach.memory.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output. ``scheduled_batch`` is left to the holder, which
        re-plans a resume for its world size (``BatchSizeController.resume_batch``)."""
        override = state["override"]
        self.override = (int(override[0]), str(override[1])) if override else None
        self.controller.load_state_dict(state["controller"])
        self.loss_ema.load_state_dict(state["loss_ema"])
        noise = self.attach.noise
        if noise is not None and state.get("noise") is not None:
            noise.load_state_dict(state["noise"])
        cadence = self.attach.noise_cadence  # absent from states written before it was kept
        if cadence is not None and state.get("noise_cadence") is not None:
            cadence.load_state_dict(state["noise_cadence"])
        self.last_loss = state["last_loss"]
        self.last_grad_norm = state["last_grad_norm"]
        if state.get("memory") is not None:  # checkpoints written before the memory section have none
            self.attach.memory.load_state_dict(state["memory"])


def plan_change(
    old: BatchPlan, new: BatchPlan, *, step: int, samples: int, lr_multiplier: float, reason: str
) -> PlanChange:
    """The ``engine.history`` event of a change from plan ``old`` to ``new`` before step ``step``."""
    return PlanChange(
        step=step,
        samples=samples,
        old_global_batch=old.global_batch_size,
        new_global_batch=new.global_batch_size,
        old_micro_batch_per_gpu=old.micro_batch_per_gpu,
        new_micro_batch_per_gpu=new.micro_batch_per_gpu,
        old_gradient_accumulation_steps=old.gradient_accumulation_steps,
        new_gradient_accumulation_steps=new.gradient_accumulation_steps,
        world_size=new.world_size,
        lr_multiplier=lr_multiplier,
        reason=reason,
    )


class CoreHolder(Protocol):
    """What holds a step core (an engine, the Trainer's batch state)."""

    core: StepCore


class in_core(Generic[T]):  # noqa: N801 - used like ``property``
    """An attribute of a step core's holder that lives in its core (``holder.core.<same name>``):
    ``last_loss = in_core[float | None]("The global mean loss of the latest resolved step.")``;
    ``name``: the core's attribute where the holder calls it otherwise."""

    def __init__(self, doc: str, *, name: str = "") -> None:
        self.__doc__ = doc
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, holder: CoreHolder | None, owner: type | None = None) -> T:
        if holder is None:
            return self  # type: ignore[return-value]  # the descriptor itself, on the class
        return getattr(holder.core, self.name)

    def __set__(self, holder: CoreHolder, value: T) -> None:
        setattr(holder.core, self.name, value)

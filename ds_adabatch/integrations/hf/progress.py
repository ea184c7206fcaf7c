"""How long an ``AdaptiveBatchSizeTrainer`` run is: epochs, optimizer steps, the LR schedule's length.

The Hugging Face Trainer sizes a run once, from a constant batch: steps per epoch = dataset / batch,
and prints it in its training banner and ``trainer_state.json``. With a changing batch:

* a schedule of the training clock alone (``constant``, ``linear``, ``step``, ``piecewise``) is
  replayed over the sample stream before training (:meth:`StreamProgress.estimate`): the steps of
  every epoch and of the run are known exactly (epoch tails and ``drop_last`` included);
* a schedule that follows measurements or a user's function (``loss_plateau``, ``gradient_noise``,
  ``goodput``, ``seesaw``, ``callable``, ``batch_size_scheduler``) and token-budget steps change with the run: the
  numbers are given at the initial batch and said to change with the batch.

:class:`StreamProgress` is held by ``AdaptiveBatchState`` (``state.progress``) and reads it through
:class:`ProgressHost`, the public names it needs (the stream's cursor, the run's end, the schedule, the
next step's plan and batch); the Trainer's step budget (``state.max_steps``, the progress bar) follows
:meth:`StreamProgress.step_budget` at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ds_adabatch.schedules import BatchSizeController, ScheduleContext

if TYPE_CHECKING:  # pragma: no cover
    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.data import ElasticSampler, GlobalBatch
    from ds_adabatch.data.tokens import TokenBudgetSampler, TokenStep
    from ds_adabatch.plan import BatchPlan

__all__ = [
    "LrClock",
    "ProgressHost",
    "ProgressOwner",
    "RunEstimate",
    "ShownInt",
    "StreamProgress",
    "describe_run",
]

_MAX_REPLAYED_STEPS = 200_000
"""Steps replayed at most before training; a longer run is estimated at its initial batch instead."""


class ShownInt(int):
    """An ``int`` the Trainer's loop uses as a bound, printed in its training banner as ``text()``.

    transformers 5.23 ``Trainer._inner_training_loop`` prints the values ``set_initial_training_values``
    returns (``f"{value:,}"``) and also loops over them: the epoch count and the steps per epoch must stay
    upper bounds for the loop (the batch may shrink), while the banner says what will happen. The text
    is made when printed, after a resumed run's state is loaded.
    """

    text: Callable[[], str]

    def __new__(cls, value: int, text: str | Callable[[], str]) -> ShownInt:
        shown = super().__new__(cls, value)
        shown.text = text if callable(text) else (lambda: text)
        return shown

    def __format__(self, spec: str) -> str:
        return self.text()

    def __str__(self) -> str:
        return self.text()

    def __reduce__(self) -> tuple:
        # Saved (transformers 4.57 pickles TrainingArguments, whose DeepSpeed config holds the LR
        # schedule's length, into every checkpoint) or copied, it is the plain number.
        return (int, (int(self),))


@dataclass(frozen=True)
class RunEstimate:
    """Optimizer steps of a run, from the current step on."""

    steps_per_epoch: tuple[int, ...]
    """Steps that draw from each epoch the run touches, the current one first (a whole epoch each, also
    where the run stops inside it)."""
    total_steps: int
    """Steps the whole run takes, counting those already done."""
    epochs: int
    """Epochs the run touches (the number ``trainer_state.json`` saves as ``num_train_epochs``)."""
    exact: bool
    """True when replayed from the schedule; False: at the current batch (it changes with the batch)."""
    positions: tuple[tuple[int, int], ...] = ()
    """Replayed only: the stream's (epoch, position) after each step from the first replayed one."""
    first_step: int = 0
    """The step the replay started at."""

    def describe_steps_per_epoch(self, batch: int) -> str:
        """For the training banner: ``"65"``, ``"65 in epoch 1, then 33"``, or ``"changes with ..."``."""
        counts = self.steps_per_epoch
        first = "in the first epoch" if self.first_step == 0 else "left in the current epoch"
        if not self.exact:
            return f"changes with the batch ({counts[0]:,} at the global batch of {batch:,})"
        if len(set(counts)) <= 1 and self.first_step == 0:
            return f"{counts[0]:,}" if counts else "0"
        if len(counts) == 1:
            return f"{counts[0]:,} {first} (estimated from the schedule)"
        later = sorted(set(counts[1:]))
        rest = f"{later[0]:,}" if len(later) == 1 else f"{later[0]:,} to {later[-1]:,}"
        return f"{counts[0]:,} {first}, then {rest} (estimated from the schedule)"


class LrClock(Protocol):
    """The unit the LR schedule counts in (``hf.state.LrSettings``)."""

    unit: str
    reference_batch: int


class ProgressHost(Protocol):
    """What :class:`StreamProgress` reads from the state that holds it (``hf.state.AdaptiveBatchState``),
    at every use: the sample stream's cursor (``sampler``), the run's end (``num_train_epochs``, or
    ``max_steps`` when above 0), the first step's plan, the LR schedule's unit, the schedule and its
    latest batch, and the plan and global batch of a step about to run."""

    sampler: ElasticSampler | TokenBudgetSampler
    num_train_epochs: float
    max_steps: int
    initial_plan: BatchPlan
    config: AdaBatchConfig
    world_size: int
    token_budget: bool
    scheduled_batch: int
    controller: BatchSizeController

    @property
    def lr(self) -> LrClock:
        """Read-only: the host's own settings type stands in for the protocol (``hf.state.LrSettings``)."""

    def plan_for_step(self, step: int) -> BatchPlan:
        """The plan of optimizer step ``step`` (decided once, on every rank at the same point)."""

    def upcoming_batch(self, step: int) -> GlobalBatch | TokenStep:
        """The global batch step ``step`` will draw under its plan (peeked: the cursor stays)."""


class ProgressOwner(ProgressHost, Protocol):
    """A host that holds its :class:`StreamProgress` (what :func:`describe_run` is given)."""

    @property
    def progress(self) -> StreamProgress: ...


class StreamProgress:
    """Progress of the sample stream against ``num_train_epochs`` / ``max_steps``, read from ``host``."""

    def __init__(self, host: ProgressHost) -> None:
        self.host = host
        self._estimate: RunEstimate | None = None

    @property
    def epoch_based(self) -> bool:
        """True when ``num_train_epochs`` (not ``max_steps``) ends training."""
        return self.host.max_steps <= 0

    def finished(self, step: int) -> bool:
        """True when ``num_train_epochs`` are trained (the next batch would start at or past it)."""
        if not self.epoch_based:
            return False
        host = self.host
        nxt = host.upcoming_batch(step)
        start = nxt.epoch + nxt.start / host.sampler.num_samples
        return nxt.epoch >= math.ceil(host.num_train_epochs) or start >= host.num_train_epochs - 1e-9

    def steps_left(self, step: int) -> int:
        """Optimizer steps still to run if the batch of step ``step`` were kept (for the progress bar; with
        a token budget, as if every step held as many samples as that one)."""
        host = self.host
        sampler = host.sampler
        n, drop = sampler.num_samples, sampler.drop_last
        batch = host.plan_for_step(step).global_batch_size
        epoch, pos = sampler.epoch, sampler.position
        if pos >= n:
            epoch, pos = epoch + 1, 0
        target = host.num_train_epochs

        def part(start: int, stop: int) -> int:
            left = max(0, stop - start)
            return left // batch if drop and stop == n else -(-left // batch)

        def epoch_stop(e: int) -> int:
            return n if e + 1 <= target else math.ceil((target - e) * n)

        if epoch >= target:
            return 0
        steps = part(pos, epoch_stop(epoch))
        epoch += 1
        full = max(0, math.floor(target) - epoch)
        steps += full * part(0, n)
        epoch += full
        if epoch < target:
            steps += part(0, epoch_stop(epoch))
        return steps

    def step_budget(self, step: int) -> int:
        """``step`` when the epochs are trained; else the replayed run's length while the run follows the
        replay, or ``step`` plus the steps left at the current batch (at least one more)."""
        if self.finished(step):
            return step
        est = self._estimate
        if est is not None and est.exact and est.first_step <= step < est.first_step + len(est.positions) + 1:
            k = step - est.first_step
            here = (self.host.sampler.epoch, self.host.sampler.position)
            if k == 0 or est.positions[k - 1] == here:
                return max(est.total_steps, step + 1)
        return step + max(1, self.steps_left(step))

    def planned_samples(self) -> int:
        """Samples ``num_train_epochs`` hold at the initial batch (an epoch tail dropped with drop_last)."""
        host = self.host
        n, b = host.sampler.num_samples, host.initial_plan.global_batch_size
        per_epoch = n - (n % b if host.sampler.drop_last else 0)
        return math.ceil(host.num_train_epochs * per_epoch)

    def scheduler_steps(self) -> int:
        """Length of the LR schedule in its own unit (``TrainingArguments.max_steps`` when it is set).

        In samples: the stream's ``num_train_epochs x dataset size`` (the state's ``stream_samples``
        advances it, skipped tails included, so it ends with the last epoch however large the tails
        were). In steps: the steps of the initial batch.
        """
        host = self.host
        if not self.epoch_based:
            return host.max_steps
        if host.lr.unit == "samples":
            stream = math.ceil(host.num_train_epochs * host.sampler.num_samples)
            return max(1, math.ceil(stream / host.lr.reference_batch))
        return max(1, math.ceil(self.planned_samples() / host.initial_plan.global_batch_size))

    # -- estimates -----------------------------------------------------------------------------------
    @property
    def run_estimate(self) -> RunEstimate:
        """The latest :meth:`estimate`."""
        if self._estimate is None:
            raise RuntimeError("estimate() has not run yet")
        return self._estimate

    def estimate(self, step: int) -> RunEstimate:
        """The run's steps from step ``step`` on: replayed from the schedule where it depends on the
        training clock only, else at the batch of step ``step``. Cached for :meth:`step_budget`."""
        replayed = self._replay(step) if self._replayable() else None
        if replayed is None:
            replayed = self._at_current_batch(step)
        self._estimate = replayed
        return replayed

    def _replayable(self) -> bool:
        schedule = self.host.controller.schedule
        return not (
            self.host.token_budget or schedule.requires or getattr(schedule, "needs_agreement", False)
        )

    def _at_current_batch(self, step: int) -> RunEstimate:
        host = self.host
        n = host.sampler.num_samples
        batch = host.plan_for_step(step).global_batch_size
        per_epoch = n // batch if host.sampler.drop_last else -(-n // batch)
        per_epoch = max(per_epoch, 1)
        if self.epoch_based:
            total = step + self.steps_left(step)
            epochs = math.ceil(host.num_train_epochs)
        else:
            total = host.max_steps
            epochs = host.sampler.epoch + math.ceil(max(0, host.max_steps - step) / per_epoch)
        return RunEstimate((per_epoch,), total, max(1, epochs), exact=False, first_step=step)

    def _replay(self, step: int) -> RunEstimate | None:
        """The stream walked step by step with a fresh controller (the schedule is a function of the
        clock, so the replay is the run); None if it would take too long."""
        host = self.host
        controller = BatchSizeController(host.config, host.world_size)
        sampler, epoch_based, target = host.sampler, self.epoch_based, host.num_train_epochs
        n, drop = sampler.num_samples, sampler.drop_last
        epoch, pos, consumed = sampler.epoch, sampler.position, sampler.samples_consumed
        batch, k = host.scheduled_batch, step
        per_epoch: dict[int, int] = {}
        positions: list[tuple[int, int]] = []
        total: int | None = None  # set where the run stops; the replay goes on to that epoch's end
        while len(positions) < _MAX_REPLAYED_STEPS:
            if total is None and not epoch_based and k >= host.max_steps:
                total = k
            ctx = ScheduleContext(
                step=k,
                samples=consumed,
                global_batch=batch,
                world_size=host.world_size,
                epoch=epoch + pos / n,
            )
            batch = controller.next_global_batch(ctx).global_batch
            if pos == n:
                if total is not None:
                    break
                epoch, pos = epoch + 1, 0
            if batch > n - pos and drop:
                if batch > n:
                    return None  # the sampler refuses this; training reports it
                if total is not None:
                    break
                epoch, pos = epoch + 1, 0
            if (
                total is None
                and epoch_based
                and (epoch >= math.ceil(target) or epoch + pos / n >= target - 1e-9)
            ):
                total = k
                if pos in (0, n):
                    break
            take = min(batch, n - pos)
            pos, consumed, k = pos + take, consumed + take, k + 1
            per_epoch[epoch] = per_epoch.get(epoch, 0) + 1
            if total is None:
                positions.append((epoch, pos))
        else:
            return None
        counts = tuple(per_epoch[e] for e in sorted(per_epoch)) or (0,)
        epochs = (positions[-1][0] + 1) if positions else sampler.epoch + 1
        return RunEstimate(
            counts,
            k if total is None else total,
            epochs,
            exact=True,
            positions=tuple(positions),
            first_step=step,
        )


def describe_run(state: ProgressOwner, step: int, plan: BatchPlan) -> list[str]:
    """Lines (rank 0, INFO) that say what the run will do from step ``step``, whose plan is ``plan``."""
    schedule = state.controller.schedule
    if getattr(schedule, "needs_agreement", False) and hasattr(schedule, "path"):
        rule = f"batch_size_scheduler {schedule.path} (samples per device) sets it before every step"
    elif state.config.schedule.type == "constant" and not state.token_budget:
        rule = "it stays constant"
    else:
        rule = f"the schedule {state.config.schedule.model_dump(exclude_defaults=True)} sets it"
    where = "the first step trains" if step == 0 else f"step {step} trains"
    lines = [f"AdaptiveBatchSizeTrainer: {where} the global batch {plan.describe()}; {rule}"]
    est = state.progress.run_estimate
    per_epoch = est.describe_steps_per_epoch(plan.global_batch_size)
    if est.exact:
        lines.append(
            f"optimizer steps per epoch: {per_epoch}; {est.total_steps:,} steps over {est.epochs:,} epoch(s)"
        )
    else:
        lines.append(f"optimizer steps per epoch: {per_epoch}")
    return lines

"""The callback that keeps the Trainer's epoch, step budget and progress bar true to the sample stream.

It runs first among the Trainer's callbacks. At ``on_train_begin`` it says, right below transformers'
training banner, what the run will do (first batch, schedule, steps); on every ``on_step_end``:

* ``state.epoch`` is the fractional epoch of samples trained (not steps / steps-per-epoch);
* the next step's plan is decided (a checkpoint saved at this step then holds that decision);
* with ``num_train_epochs`` ending training, ``state.max_steps`` is the steps done plus an estimate of
  those left at the current batch, and equals the steps done once the epochs are trained, which is
  where transformers' ``DefaultFlowCallback`` stops training (and saves / evaluates at the end);
* the progress bar's total follows that estimate.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from .progress import describe_run

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    from .state import AdaptiveBatchState

__all__ = ["AdaptiveBatchCallback"]

logger = logging.getLogger("ds_adabatch")


class DrivenTrainer(Protocol):
    """What the callback reads and calls on its trainer (an ``AdaptiveBatchSizeTrainer``).

    Typed by its use rather than by the class, so this module needs nothing from ``hf.trainer`` (which
    imports it).
    """

    batch_state: AdaptiveBatchState | None
    args: TrainingArguments
    callback_handler: CallbackHandler

    def _finish_run(self) -> None: ...

    def _train_begins(self) -> None: ...


class AdaptiveBatchCallback(TrainerCallback):
    """Placed first in ``trainer.callback_handler.callbacks`` by ``AdaptiveBatchSizeTrainer``."""

    def __init__(self, trainer: DrivenTrainer) -> None:
        self.trainer = trainer

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        batch_state = self.trainer.batch_state
        if batch_state is None:
            return
        step = state.global_step
        # The next step's plan first: whether drop_last skips the epoch's tail depends on its batch.
        batch_state.plan_for_step(step)
        state.epoch = batch_state.epoch
        if batch_state.progress.epoch_based:
            state.max_steps = batch_state.progress.step_budget(step)
            self._set_bar_total(state.max_steps)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.trainer._train_begins()
        # The banner has printed the first step's accumulation steps; the loop runs with 1 (one loader
        # item is one optimizer step), and callbacks after this one (trackers saving the arguments) see 1.
        self.trainer.args.gradient_accumulation_steps = 1
        batch_state = self.trainer.batch_state
        if batch_state is None:
            return
        plan = batch_state.plan_for_step(state.global_step)  # decided already, on every rank
        if batch_state.rank == 0:
            for line in describe_run(batch_state, state.global_step, plan):
                logger.info("%s", line)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        bar = self._bar()
        if bar is not None:
            self._set_bar_total(bar.n)
        self.trainer._finish_run()
        if self.trainer.batch_state is not None:
            self.trainer.batch_state.close()

    def _bar(self) -> Any:
        # transformers 5.23 ProgressCallback.training_bar: a tqdm bar created on rank 0 with
        # total=state.max_steps at on_train_begin and never resized by the Trainer.
        for callback in self.trainer.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback):
                return getattr(callback, "training_bar", None)
        return None

    def _set_bar_total(self, total: int) -> None:
        bar = self._bar()
        if bar is not None and bar.total != total:
            bar.total = total
            bar.refresh()

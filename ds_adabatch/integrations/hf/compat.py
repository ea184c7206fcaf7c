"""transformers 4.57.6 and 5.0-5.17: where ``AdaptiveBatchSizeTrainer`` plugs into older loops.

From 5.3 the Trainer's loop calls the methods the integration overrides (``hf.versions`` lists them):
``_init_training_state`` and ``_prepare_for_training`` exist, ``set_initial_training_values`` takes
``(args, dataloader)``, ``_track_num_input_tokens`` counts the tokens. transformers 4.57.6 (the last
4.x) and 5.0-5.2 run the same steps inline in ``Trainer._inner_training_loop``. The trainer holds a
loop adapter chosen for the installed release (:func:`loop_for`): :class:`SplitLoop` (5.3+) adds
nothing, :class:`OneFunctionLoop` reaches each step where the one-function loop offers a way in; the
trainer's overrides of those ways in are one-line calls to it (the rows say 4.57; 5.0-5.2 are the same
but where a row names 5.1):

=====================================  ===============================================================
5.3+ (``hf.trainer``)                  4.57.6, 5.0-5.2 (this module)
=====================================  ===============================================================
``set_initial_training_values``        same name, ``(args, dataloader, total_train_batch_size)``,
(the run's bounds)                     returning ``(epochs, steps per epoch, examples, samples,
                                       epoch_based, batches per epoch, LR length)``
``_prepare_for_training`` (GAS)        ``create_optimizer``, which 4.57 calls right after
                                       ``deepspeed_init`` (inside ``create_optimizer_and_scheduler``;
                                       5.1+ directly): the banner's GAS (the loop reads
                                       ``args.gradient_accumulation_steps`` at every update and must
                                       see 1: one loader item is one step)
``_init_training_state`` (resume)      ``_load_callback_state``, which 4.57 calls right after it
                                       loads ``trainer_state.json``; the loop then computes the epoch
                                       to resume in as ``global_step // steps_per_epoch`` and the
                                       batches to skip as ``global_step % steps_per_epoch``:
                                       :class:`StepsPerEpoch` answers the stream's epoch and 0
``_init_training_state`` (the state)   the callback's ``on_train_begin`` (``_train_begins``): 4.57
                                       sets ``state.max_steps`` just before it
``_prepare_for_training`` (LR, log)    the ``deepspeed`` attribute, which 4.57 assigns right after
                                       ``accelerator.prepare`` builds the engine and before a resumed
                                       engine loads its checkpoint: the scheduler is coupled there,
                                       as 5.3+ does in ``create_scheduler`` after ``prepare`` (5.1+
                                       makes it there too; it is made again on the same optimizer)
``_track_num_input_tokens``            4.57 counts inline ``inputs[main_input_name]`` /
                                       ``inputs["attention_mask"]`` of each loop item:
                                       :class:`CountedStepInputs` shows it the step's real
                                       micro-batches, flattened (zero-weight pads left out)
``get_total_train_batch_size``         the banner's total batch: the first step's global batch
DeepSpeed's input dtype (4.57 only)    :func:`adapt_arguments`: fp32 unless the config enables fp16
                                       or bf16, as 5.x and DeepSpeed itself decide
``get_cp_size`` / ``get_sp_size``      added (4.57 has ``get_tp_size`` only), from accelerate's
                                       ``parallelism_config`` as 5.x reads them (5.0-5.2 have both,
                                       computed the same way)
=====================================  ===============================================================

The loop iterates ``len(train_dataloader)`` updates per epoch, read once at the epoch's start: the
step loader reports an upper bound there (the dataset's samples), and ends the epoch itself where the
stream does, as on 5.3+. :class:`PlainTrainerFixes` is held in place of :class:`TrainerFixes` on every
release before 5.18 (both loops, :func:`fixes_for`): the ``"auto"`` warmup DeepSpeed refuses and the
CPU optimizer resume torch refuses, each fixed as 5.18 fixes it. ``include_tokens_per_second`` (4.x only; 5.x removed it) iterates the
training dataloader once before training, which would draw from the sample stream: it is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .data import StepInputs, StepLoader
from .progress import ShownInt
from .versions import legacy_loop, plain_trainer_faults, transformers_4

if TYPE_CHECKING:  # pragma: no cover
    from deepspeed import DeepSpeedEngine

    from .host import TrainerHost

_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"  # transformers 4.57 OPTIMIZER_NAME, SCHEDULER_NAME

__all__ = [
    "CountedStepInputs",
    "OneFunctionLoop",
    "PlainTrainerFixes",
    "SplitLoop",
    "StepsPerEpoch",
    "TrainerFixes",
    "adapt_arguments",
    "auto_warmup",
    "check_arguments",
    "fixes_for",
    "loop_for",
]


class StepsPerEpoch(ShownInt):
    """The steps-per-epoch bound transformers 4.57 divides the resumed ``global_step`` by.

    4.57 ``Trainer._inner_training_loop`` resumes in epoch ``global_step // steps_per_epoch`` after
    skipping ``global_step % steps_per_epoch`` batches; the sample stream knows its own epoch and
    skips nothing (its cursor is in the checkpoint). ``int // StepsPerEpoch`` asks ``epoch_of(step)``
    (Python tries the right operand's reflected method first when it is a subclass of the left's type),
    and ``int % StepsPerEpoch`` is 0, as 5.3+ ``_init_training_state`` returns ``(epoch, 0)``.
    """

    epoch_of: Callable[[int], int]

    def __new__(cls, value: int, text: Callable[[], str], epoch_of: Callable[[int], int]) -> StepsPerEpoch:
        bound = super().__new__(cls, value, text)
        bound.epoch_of = epoch_of
        return bound

    def __rfloordiv__(self, step: int) -> int:
        return self.epoch_of(int(step))

    def __rmod__(self, step: int) -> int:
        return 0


class CountedStepInputs(StepInputs):
    """A step as transformers 4.57's loop reads it to count ``num_input_tokens_seen``.

    ``key in inputs`` and ``inputs[key]`` see the step's real micro-batches (pads excluded) as one
    flat tensor per key: ``.numel()`` is their tokens, ``.sum()`` of the attention mask their real
    tokens, and ``!= pad_token_id`` compares each; 4.57 gathers the count over ranks once per item,
    which is once per optimizer step here.
    """

    __slots__ = ()

    def _real(self) -> list[Any]:
        return [m.batch for m in self.step.micro_batches if not m.is_pad]

    def __contains__(self, key: object) -> bool:
        real = self._real()
        batches = real or [m.batch for m in self.step.micro_batches]
        return all(isinstance(b, dict) and key in b for b in batches)

    def __getitem__(self, key: str) -> torch.Tensor:
        parts = [torch.as_tensor(b[key]).reshape(-1) for b in self._real()]
        if not parts:  # a step of pads only on this rank: no tokens
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(parts)


class TrainerFixes:
    """Where the plain ``Trainer`` needs no fix (5.18+): each hook leaves the Trainer's behaviour as it is.

    ``AdaptiveBatchSizeTrainer`` holds one (``trainer.release_fixes``, chosen by :func:`fixes_for`) and
    calls it from its ``create_optimizer`` and ``_load_optimizer_and_scheduler``.
    """

    def __init__(self, trainer: TrainerHost) -> None:
        self.trainer = trainer

    def optimizer_created(self) -> None:
        """Called right after the Trainer's ``create_optimizer``."""

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> bool:
        """Load the optimizer and scheduler of ``checkpoint`` if the Trainer's own load would fail;
        False: the Trainer's own load runs."""
        return False


class PlainTrainerFixes(TrainerFixes):
    """Two faults of the plain ``Trainer`` before 5.18 (4.57.6 and 5.0-5.17), each stopping a run on
    these machines, fixed as 5.18 fixes them; held by the trainer on those releases (:func:`fixes_for`).

    * ``deepspeed_init`` (``HfTrainerDeepSpeedConfig.trainer_config_finalize``) fills an ``"auto"``
      ``scheduler.params.warmup_num_steps`` with ``args.get_warmup_steps()``, 0 without a warmup, and
      deepspeed 0.19.8's ``WarmupLR`` refuses 0 when ``accelerator.prepare`` builds the engine. 5.18 fills
      ``max(1, steps)``; so does :meth:`optimizer_created`, after ``create_optimizer``, which every
      release calls right after ``deepspeed_init`` and before ``prepare`` (4.57-5.1 through
      ``create_optimizer_and_scheduler``).
    * A multi-process run's ``optimizer.pt`` is loaded with ``map_location=args.device``, which is
      ``cpu:0`` on CPU ranks under accelerate 1.15, and torch cannot restore storages tagged ``cpu:0``.
      5.18 loads it on ``"cpu"``; so does :meth:`load_optimizer_and_scheduler`, for that case only.
    """

    def optimizer_created(self) -> None:
        trainer = self.trainer
        config = getattr(trainer.args, "hf_deepspeed_config", None)
        if trainer.is_deepspeed_enabled and config is not None and trainer._auto_warmup:
            node, key = config.find_config_node("scheduler.params.warmup_num_steps")
            if node is not None and node.get(key) == 0:
                node[key] = 1

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> bool:
        # Trainer._load_optimizer_and_scheduler before 5.18 loads a multi-process run's optimizer.pt with
        # map_location=args.device, torch.device("cpu:0") on CPU ranks under accelerate 1.15, and torch
        # cannot restore storages tagged "cpu:0". 5.18 loads it on "cpu"; so does this, for that case
        # only (no DeepSpeed or FSDP, which load their own state).
        trainer = self.trainer
        if (
            checkpoint is None
            or trainer.is_deepspeed_enabled
            or getattr(trainer, "is_fsdp_enabled", False)
            or trainer.args.world_size <= 1
            or trainer.args.device.type != "cpu"
            or not os.path.isfile(os.path.join(checkpoint, _OPTIMIZER))
            or not os.path.isfile(os.path.join(checkpoint, _SCHEDULER))
        ):
            return False
        optimizer = torch.load(os.path.join(checkpoint, _OPTIMIZER), map_location="cpu", weights_only=True)
        trainer.optimizer.load_state_dict(optimizer)
        scheduler = torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True)
        trainer.lr_scheduler.load_state_dict(scheduler)
        return True


class SplitLoop:
    """transformers 5.3+: the loop calls ``hf.trainer``'s overrides itself, so each hook here leaves the
    Trainer as it is. ``AdaptiveBatchSizeTrainer`` holds one (``trainer.release_loop``, chosen by
    :func:`loop_for`) and calls it from the overrides that :class:`OneFunctionLoop` needs."""

    def __init__(self, trainer: TrainerHost) -> None:
        self.trainer = trainer

    def loader_made(self, loader: StepLoader) -> None:
        """Called with the step loader ``get_train_dataloader`` returns."""

    def cp_size(self, parent: Any) -> int:
        """``get_cp_size``; ``parent`` is the Trainer's ``super()``."""
        return int(parent.get_cp_size())

    def sp_size(self, parent: Any) -> int:
        """``get_sp_size``; ``parent`` is the Trainer's ``super()``."""
        return int(parent.get_sp_size())

    def total_train_batch_size(self, parent: Any, args: Any) -> int:
        """``get_total_train_batch_size``; ``parent`` is the Trainer's ``super()``."""
        return int(parent.get_total_train_batch_size(args))

    def training_values(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """What ``set_initial_training_values`` returns, from the trainer's 5.3+ tuple."""
        return values

    def callback_state_loaded(self) -> None:
        """Called after the Trainer's ``_load_callback_state``."""

    def train_begins(self) -> None:
        """Called by the callback at ``on_train_begin``."""

    def engine_assigned(self, engine: DeepSpeedEngine) -> None:
        """Called when the Trainer assigns its ``deepspeed`` attribute a DeepSpeed engine."""

    def optimizer_created(self) -> None:
        """Called right after the Trainer's ``create_optimizer`` (and the release fixes')."""

    def step_items(self, items: list[StepInputs]) -> list[StepInputs]:
        """The loop items ``get_batch_samples`` returns."""
        return items


class OneFunctionLoop(SplitLoop):
    """The ways :class:`~ds_adabatch.integrations.hf.trainer.AdaptiveBatchSizeTrainer` reaches the
    one-function loop of transformers 4.57.6 and 5.0-5.2 (see the module docstring for where each
    reaches it); held by the trainer on those releases (:func:`loop_for`)."""

    def loader_made(self, loader: StepLoader) -> None:
        loader.len_is_bound = True  # 4.57 runs len(loader) updates per epoch, read at its start

    def cp_size(self, parent: Any) -> int:
        # Context-parallel degree (5.x Trainer method; 4.57 keeps it in accelerate's config only).
        config = getattr(self.trainer.accelerator, "parallelism_config", None)
        return 1 if config is None else int(config.cp_size)

    def sp_size(self, parent: Any) -> int:
        # Sequence-parallel degree (as cp_size).
        config = getattr(self.trainer.accelerator, "parallelism_config", None)
        return 1 if config is None else int(getattr(config, "sp_size", 1))

    def total_train_batch_size(self, parent: Any, args: Any) -> int:
        # The first step's global batch (4.57 prints it in the banner as the total train batch).
        return self.trainer._require_state().initial_plan.global_batch_size

    def training_values(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        epochs, per_epoch, n, samples, _first, batches, lr_length = values
        state = self.trainer._require_state()
        per_epoch = StepsPerEpoch(int(per_epoch), per_epoch.text, state.next_batch_epoch)
        return epochs, per_epoch, n, samples, state.progress.epoch_based, batches, lr_length

    def callback_state_loaded(self) -> None:
        # 4.57 calls _load_callback_state only when resuming, right after loading trainer_state.json
        # (global_step).
        self.trainer._resume_batch_state(self.trainer._resume_path)

    def train_begins(self) -> None:
        # 4.57 has set state.max_steps / num_train_epochs to the loop's bounds just before.
        self.trainer._align_trainer_state(int(self.trainer.state.max_steps))
        self.trainer._start_step_log()

    def engine_assigned(self, engine: DeepSpeedEngine) -> None:
        # 4.57 Trainer._inner_training_loop assigns the engine accelerate built, before a resumed run
        # loads its DeepSpeed checkpoint: the LR scheduler is coupled to the engine now, so the
        # checkpoint's scheduler state loads into the coupled scheduler (5.3+ does this in
        # create_scheduler, which its loop calls after accelerator.prepare).
        trainer = self.trainer
        if not trainer.is_in_train or trainer.batch_state is None:
            return
        wrapped = type(trainer.lr_scheduler).__name__ == "DeepSpeedSchedulerWrapper"
        if trainer._lr_coupling is not None and not wrapped:
            # The Trainer's own scheduler, made by 4.57 deepspeed_init on the optimizer DeepSpeed was
            # about to take (DeepSpeed 0.19.8 may drop its empty parameter groups): made again on the
            # prepared optimizer, as 5.18 makes it after accelerator.prepare.
            trainer.lr_scheduler = None
            trainer._lr_coupling = None
        if trainer._lr_coupling is None:
            trainer.create_scheduler(trainer.batch_state.progress.scheduler_steps())

    def optimizer_created(self) -> None:
        # 4.57-5.1 call create_optimizer (inside create_optimizer_and_scheduler) and 5.2 directly, right
        # after deepspeed_init, which checked the DeepSpeed config's accumulation steps against the
        # arguments': the banner's GAS and the loop's 1 (as 5.3+ sets them after it, in
        # _prepare_for_training). deepspeed_init may itself call it (a config without an optimizer),
        # after that check too.
        if self.trainer.is_in_train and self.trainer.batch_state is not None:
            self.trainer._show_first_gas()

    def step_items(self, items: list[StepInputs]) -> list[StepInputs]:
        return [CountedStepInputs(item.step, item.started) for item in items]


def loop_for(transformers_version: str | None = None) -> type[SplitLoop]:
    """The loop adapter for transformers (the installed release unless given): :class:`OneFunctionLoop`
    on 4.57.6 and 5.0-5.2, else :class:`SplitLoop`."""
    return OneFunctionLoop if legacy_loop(transformers_version) else SplitLoop


def fixes_for(transformers_version: str | None = None) -> type[TrainerFixes]:
    """The plain Trainer's fixes for transformers (the installed release unless given):
    :class:`PlainTrainerFixes` before 5.18, else :class:`TrainerFixes` (none)."""
    return PlainTrainerFixes if plain_trainer_faults(transformers_version) else TrainerFixes


def check_arguments(args: Any) -> None:
    """Refuse, with a sentence, what the 4.57 loop would do wrong with a step loader."""
    if legacy_loop() and getattr(args, "include_tokens_per_second", False):
        raise ValueError(
            "TrainingArguments(include_tokens_per_second=True) makes transformers 4.57 iterate the "
            "training dataloader once before training, which would draw from AdaptiveBatchSizeTrainer's "
            "sample stream; leave it False (train_tokens_per_second is logged with a token budget) or "
            "use include_num_input_tokens_seen"
        )


def adapt_arguments(args: Any) -> None:
    """Make transformers 4.57 feed a DeepSpeed config without an ``"fp16"`` section fp32 inputs.

    4.57 ``HfTrainerDeepSpeedConfig.trainer_config_process`` takes the input dtype as fp16 unless the
    config says ``"fp16": {"enabled": false}`` (its comment: DeepSpeed's default is fp16), while
    DeepSpeed 0.19.8 and accelerate 1.15 build an fp32 engine: the plain 4.57 ``Trainer`` fails its first
    forward (``mat1 and mat2 must have the same dtype``). 5.x takes fp32 there. The section is written
    as DeepSpeed already reads it, and the input dtype set to match.
    """
    config = getattr(args, "hf_deepspeed_config", None)
    if not transformers_4() or config is None:
        return
    if config.get_value("fp16.enabled") is None and not config.is_true("bf16.enabled"):
        config.config.setdefault("fp16", {})["enabled"] = False
        # What 4.57 trainer_config_process sets from that section (HfTrainerDeepSpeedConfig._dtype,
        # read by its dtype()); running it again would check the arguments' GAS, 1 here, against the
        # config's.
        config._dtype = torch.float32


def auto_warmup(args: Any) -> bool:
    """Whether the run's DeepSpeed config leaves ``scheduler.params.warmup_num_steps`` to the Trainer
    (``"auto"``), read before ``deepspeed_init`` fills it."""
    config = getattr(args, "hf_deepspeed_config", None)
    return config is not None and config.get_value("scheduler.params.warmup_num_steps") == "auto"

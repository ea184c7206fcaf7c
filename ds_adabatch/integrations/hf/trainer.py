"""``AdaptiveBatchSizeTrainer``: a Hugging Face ``Trainer`` whose batch size changes while it trains.

Usage: ``AdaptiveBatchSizeTrainer(model=..., args=..., train_dataset=..., adabatch_config={...})`` with an
``"adabatch"`` section (a schedule such as ``{"type": "linear", "start": 8, "end": 32, "ramp_samples":
4096}``, bounds, ``allow_uneven``, ``granularity``, ``log``, ...), or ``batch_size_scheduler=fn`` with
``fn(step, batch_size) -> batch_size`` in samples per device (``runners/hf_trainer_example.py``: a demo).

Where the global batch comes from: the scheduler (asked for step 0 too; largest forward pass
``per_device_train_batch_size`` unless ``max_micro_batch_per_gpu`` says otherwise), else the section
(``adabatch_config=``, or the DeepSpeed config in ``TrainingArguments(deepspeed=...)``), else a constant
``per_device_train_batch_size x gradient_accumulation_steps x world size``. ``hf.config`` says
what every key of the section does under the Trainer.

Design (written against transformers 5.23 and accelerate 1.15; runs on transformers 4.57.6 to 5.x and
accelerate 1.15+, checked at construction: ``hf.versions``; on 4.57.6 and 5.0-5.2 ``hf.compat`` reaches
the same steps of their one-function loop, and fixes two faults of the plain Trainer before 5.18). The Trainer's outer loop is kept, so
callbacks, logging, evaluation, checkpoint rotation and hub pushes behave as usual; only the data and
the inside of one optimizer step change:

* ``get_train_dataloader`` returns a :class:`~ds_adabatch.integrations.hf.data.StepLoader`: one
  item per optimizer step, holding this rank's micro-batches for the plan the schedule chose just
  before the item was drawn. The Trainer runs with ``gradient_accumulation_steps=1`` (its loop groups
  that many items into a step); the real accumulation steps are the plan's. The loader is never
  passed to ``accelerator.prepare``, so accelerate prefetches nothing of a stale size.
* ``training_step`` runs the step's micro-batches exactly weighted (``hf.step``), with no
  collective or device read beyond the plain Trainer's in a steady step.
* The Trainer's epochs are the sample stream's epochs; ``state.epoch`` is the fractional epoch of
  samples seen, and with ``num_train_epochs`` the step budget (``state.max_steps``, progress bar)
  follows the schedule and closes exactly when the epochs are trained. The training banner and
  ``trainer_state.json`` give the steps per epoch and of the run replayed from the schedule where it
  depends on the training clock only (``hf.progress``), and the first step's real batch and GAS.
* The LR scheduler is wrapped in ``ds_adabatch.runtime.core.lr.BatchCoupledLR``: with ``num_train_epochs``
  it advances once per initial-global-batch of samples (so its length is right whatever the batch
  does); with ``max_steps`` once per optimizer step. The section's ``lr_schedule_unit`` and
  ``lr_scaling`` override both.
* Checkpoints hold ``adabatch_state.json`` (schedule, sampler cursor, next decision) next to
  ``trainer_state.json``; ``resume_from_checkpoint`` continues the same sample stream, also on another
  world size, where a ZeRO 1-3 checkpoint is converted to DeepSpeed's universal format (``hf.resume``).
  A save into a checkpoint folder saved before (a resumed run reaching the same step) first clears the
  earlier save's DeepSpeed shards. ``adabatch.log`` writes one JSONL record per step on rank 0
  (``hf.metrics``); plan changes and the ``ds_adabatch`` logger's warnings go through transformers'.
* Token budgets (``"adabatch".micro_batch_tokens``, for variable-length data): every step is formed by
  ``ds_adabatch.data.tokens.TokenBudgetSampler`` from the same seeded order, cut into passes of at most
  that many tokens as the data collator pads them (``padding``), and collated by the Trainer's data
  collator. The lengths come from ``lengths=`` / ``length_fn=``, else the ``length_column_name``
  column, else ``len(input_ids)`` (``hf.lengths``).
* On a machine without GPUs, ``torchrun`` with the default ``use_cpu=False`` would give every rank a
  world of one (N-fold duplicate training); the arguments are rebuilt with ``use_cpu=True`` so the
  ranks train as one gloo data-parallel group (a warning says so), and elsewhere a clear error is raised.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_datasets_available

from ds_adabatch.config import ConfigError
from ds_adabatch.data.lengths import SampleLengths
from ds_adabatch.runtime.core.lr import BatchCoupledLR, CurrentBaseLR
from ds_adabatch.runtime.distributed.op_builds import guard_jit_builds
from ds_adabatch.runtime.memory.recovery import OomRecovery

from .callback import AdaptiveBatchCallback
from .compat import adapt_arguments, auto_warmup, check_arguments, fixes_for, loop_for
from .config import TrainerSection, deepspeed_build_problems, read_trainer_section
from .data import StepInputs, StepLoader
from .dist import trainer_arguments
from .engine import couple_scheduler, deepspeed_engine, seed_deepspeed_batch_keys
from .logs import follow_transformers_logging
from .metrics import TrainerStepLog
from .prepare import build_batch_state, token_lengths
from .progress import ShownInt
from .resume import UniversalResume, clear_earlier_save
from .state import STATE_FILE, AdaptiveBatchState
from .step import TrainerStep
from .versions import check_versions

__all__ = ["STATE_FILE", "AdaptiveBatchSizeTrainer", "AdaptiveBatchState", "BatchSizeScheduler"]

# TrainingArguments forms DeepSpeed's process group (and loads its JIT-built ops) before the Trainer
# exists: the guard against a dead process's build lock (runtime/distributed/op_builds.py) is installed on import.
guard_jit_builds()

BatchSizeScheduler = Callable[[int, int], int]
"""``fn(step: int, batch_size: int) -> int``, every number in **samples per device** (per data-parallel
rank) **per optimizer step**: ``step`` is the optimizer steps completed, ``batch_size`` the function's
previous answer (at step 0: ``per_device_train_batch_size x gradient_accumulation_steps``); the answer
is the next step's per-device batch, and the global batch is it x the number of ranks."""

_TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


class AdaptiveBatchSizeTrainer(Trainer):
    """A ``transformers.Trainer`` whose global batch follows a schedule, exactly and sample by sample.

    Args:
        batch_size_scheduler: ``fn(step: int, batch_size: int) -> int`` in samples per device (per
            data-parallel rank) per optimizer step (:data:`BatchSizeScheduler`). Called before every
            optimizer step with the steps completed and its own previous answer, the first time at step
            0 with ``per_device_train_batch_size x gradient_accumulation_steps``; its step-0 answer is the
            first step's batch (return another number there to start elsewhere). Rank 0's answer is
            applied on every rank. ``None``: the ``"adabatch"`` section drives the global batch, or
            without one the batch is constant.
        adabatch_config: the ``"adabatch"`` section (the same keys and checks as in a DeepSpeed config:
            ``ds-adabatch schema``), as a dict or the path of a JSON file holding it (or holding a
            ds_config with one); with or without DeepSpeed. Its ``schedule`` may be left out when
            ``batch_size_scheduler`` is given. Default: the section of the DeepSpeed config in
            ``TrainingArguments(deepspeed=...)``, if any; giving both is an error.
        max_micro_batch_per_gpu: the largest forward pass, in samples; larger batches add accumulation
            steps. Default: the section's, else ``per_device_train_batch_size``. With
            ``micro_batch_tokens`` it is an optional cap on the samples of a pass.
        lengths: with ``"adabatch".micro_batch_tokens``: every training sample's length in tokens (one
            integer per sample of ``train_dataset``, before padding). Default: the dataset's
            ``TrainingArguments.length_column_name`` column (``"length"``, as for ``group_by_length``;
            a ``datasets.Dataset`` column is read once), else each sample's ``length`` key or
            ``len(sample["input_ids"])`` (the model's main input), measured when a step first reaches it.
        length_fn: instead of ``lengths``, ``length_fn(sample) -> int``, called the first time a step
            reaches the sample and cached.
        **trainer_kwargs: ``transformers.Trainer`` arguments (``model``, ``args``, ``train_dataset``,
            ``data_collator``, ``callbacks``, ...), by keyword.

    Every sample is trained once per epoch whatever the schedule (``dataloader_drop_last`` skips an
    epoch's tail smaller than the requested batch); the order follows ``data_seed`` (else ``seed``).
    Each update is the mean gradient over the global batch's samples, or over its target tokens when
    the Trainer would normalise by ``num_items_in_batch``. Without a section, a rank's samples are split
    unevenly where an even split would need smaller passes (5 samples at most 4 per pass: 3 + 2); with
    a section its ``allow_uneven`` applies, and a step that would run one sample per pass although a
    larger pass fits is warned about. Training logs add ``train_coverage``, ``global_batch_size``,
    ``micro_batch_size`` and ``gradient_accumulation_steps`` (and ``noise_scale`` under the
    ``gradient_noise`` schedule); ``epoch`` is fractional (samples seen / dataset size). Plan changes
    are logged at INFO (``[ds_adabatch] step N: global batch ...``) where transformers' own INFO lines
    show. ``trainer.batch_state`` exposes the run's plan and sample cursor, and
    ``trainer.args.gradient_accumulation_steps`` reads 1 (the plan's steps are in
    ``trainer.batch_state.plan``).

    With ``micro_batch_tokens`` in the section, a step's samples are cut into passes of bounded
    tokens: ``global_batch_size`` logs the step's real samples, ``micro_batch_size`` the most samples of
    one pass, ``gradient_accumulation_steps`` the passes of every rank, and ``global_batch_tokens`` /
    ``train_tokens`` the step's and the run's real tokens (the samples' lengths); a schedule with
    ``unit: "tokens"`` sets each step's token target.

    Raises:
        RuntimeError: transformers or accelerate outside the releases it runs on (transformers
            >= 4.57.6, < 6; accelerate >= 1.15, < 2: ``hf.versions`` says why), before anything else.
        ValueError: on transformers 4.57, ``include_tokens_per_second=True`` (``hf.compat``).
        TypeError: ``batch_size_scheduler`` is not callable.
        ConfigError: the section is invalid, or holds what cannot apply here (a ``schedule`` next to
            ``batch_size_scheduler``; out-of-memory settings or ``gradient_noise`` without DeepSpeed),
            or a ``TORCH_CUDA_ARCH_LIST`` DeepSpeed could not build the config's optimizer with (an
            entry such as ``9.0a``), before any process group starts.
        ValueError: the section given twice, an unsupported setting (``auto_find_batch_size``,
            ``DataParallel``), ranks that cannot form one data-parallel group, or (before any process
            group starts) lengths that do not fit ``train_dataset``, a sample longer than
            ``micro_batch_tokens`` (named with its index and length), or ``lengths`` / ``length_fn``
            without ``micro_batch_tokens``.
    """

    _deepspeed: Any = None  # the ``deepspeed`` property's value, until the Trainer assigns one

    def __init__(
        self,
        batch_size_scheduler: BatchSizeScheduler | None = None,
        *,
        adabatch_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        max_micro_batch_per_gpu: int | None = None,
        lengths: Any = None,
        length_fn: Callable[[Any], int] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        check_versions()  # transformers / accelerate outside the range it runs on: one sentence, now
        if isinstance(batch_size_scheduler, torch.nn.Module) or (
            batch_size_scheduler is not None and not callable(batch_size_scheduler)
        ):
            raise TypeError(
                f"batch_size_scheduler must be callable as fn(step, batch_size), got "
                f"{type(batch_size_scheduler).__name__}; pass the Trainer's own arguments by keyword"
            )
        # Without args, the Trainer's own default.
        args = trainer_kwargs.pop("args", None) or TrainingArguments(output_dir="tmp_trainer")
        self.user_gradient_accumulation_steps = args.gradient_accumulation_steps
        # The section and the token-budget lengths are checked before trainer_arguments sets up the
        # process group.
        self.adabatch_section: TrainerSection | None = read_trainer_section(
            adabatch_config, args.deepspeed, has_scheduler=batch_size_scheduler is not None
        )
        """The run's validated ``"adabatch"`` section (None without one)."""
        if problems := deepspeed_build_problems(args.deepspeed):
            raise ConfigError(problems, source="the DeepSpeed config of TrainingArguments(deepspeed=...)")
        train_dataset = trainer_kwargs.get("train_dataset")
        self._lengths_args = (lengths, length_fn)
        self._lengths_of: tuple[Any, SampleLengths | None] = (
            train_dataset,
            token_lengths(
                args,
                train_dataset,
                lengths=lengths,
                length_fn=length_fn,
                input_name=_main_input_name(trainer_kwargs.get("processing_class")),
                section=self.adabatch_section,
            ),
        )
        check_arguments(args)
        args = trainer_arguments(args)
        adapt_arguments(args)
        # What the overrides below hand the work to (Trainer.__init__ assigns self.deepspeed): hf.step, hf.compat.
        self._trainer_step = TrainerStep(self)
        self._release_loop = loop_for()(self)
        self._release_fixes = fixes_for()(self)
        super().__init__(args=args, **trainer_kwargs)
        self.batch_size_scheduler = batch_size_scheduler
        self.max_micro_batch_per_gpu = max_micro_batch_per_gpu
        self.batch_state: AdaptiveBatchState | None = None
        """The run's schedule, plan and sample cursor; built when training starts."""
        self._lr_coupling: BatchCoupledLR | None = None
        self._samples_at_start = 0
        self._tokens_at_start = 0
        self._step_log: TrainerStepLog | None = None
        self._resuming = False
        self._resume_path: str | None = None
        self._universal = UniversalResume()
        # Read before deepspeed_init fills it (transformers before 5.18 fills 0: hf.compat).
        self._auto_warmup = auto_warmup(self.args)
        # First, so state.epoch / state.max_steps are set before DefaultFlowCallback and the progress bar.
        self.callback_handler.callbacks.insert(0, AdaptiveBatchCallback(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resumed run takes its schedule's state from the checkpoint, and the
        ``ds_adabatch`` logger prints through transformers' logging meanwhile (``hf.logs``)."""
        self._resuming = bool(resume_from_checkpoint)
        try:
            with follow_transformers_logging():
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._trainer_step.close_recovery()  # its memory predictor's hook on the model goes with the run

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer.train's resolved checkpoint folder (4.57 reads it back: hf.compat; converted: hf.resume).
        self._resume_path = kwargs.get("resume_from_checkpoint")
        self._universal.expect(self._resume_path)
        return super()._inner_training_loop(*args, **kwargs)

    @property
    def _recovery(self) -> OomRecovery | None:
        """The step's out-of-memory recovery (None before the first step under DeepSpeed)."""
        return self._trainer_step.recovery

    # -- data ----------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> StepLoader:
        """A loader of whole optimizer steps for the current plan (see the module docstring)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if max(self.get_tp_size(), self.get_cp_size(), self.get_sp_size()) > 1:
            raise ValueError("AdaptiveBatchSizeTrainer supports data parallelism only (no TP, CP or SP)")
        dataset, collator = self.train_dataset, self.data_collator
        # As transformers 5.23 Trainer._get_dataloader: drop the columns the model does not take.
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if self.batch_state is not None:
            self.batch_state.close()
        self.batch_state = build_batch_state(
            self.args,
            dataset,
            collator,
            batch_size_scheduler=self.batch_size_scheduler,
            gradient_accumulation_steps=self.user_gradient_accumulation_steps,
            max_micro_batch_per_gpu=self.max_micro_batch_per_gpu,
            lengths=self._sample_lengths(),
            section=self.adabatch_section,
            resuming=self._resuming,
        )
        self._trainer_step.new_run(
            self.batch_state, deepspeed=self.is_deepspeed_enabled, output_dir=self.args.output_dir
        )
        if self.is_deepspeed_enabled:
            seed_deepspeed_batch_keys(
                self.accelerator.state.deepspeed_plugin.deepspeed_config,
                self.batch_state.initial_plan,
            )
        loader = StepLoader(self.batch_state, lambda: self.state.global_step)
        self._release_loop.loader_made(loader)
        return loader

    def _sample_lengths(self) -> SampleLengths | None:
        """The train dataset's lengths (token budgets only), measured again if the dataset was replaced."""
        dataset, found = self._lengths_of
        if dataset is not self.train_dataset:
            lengths, length_fn = self._lengths_args
            found = token_lengths(
                self.args,
                self.train_dataset,
                lengths=lengths,
                length_fn=length_fn,
                input_name=_main_input_name(self.processing_class),
                section=self.adabatch_section,
            )
            self._lengths_of = (self.train_dataset, found)
        return found

    # -- the run's length, for the Trainer's loop and its banner --------------------------------------
    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: Any, total_train_batch_size: int | None = None
    ) -> tuple[int, ...]:
        """Epoch count, steps per epoch and schedule length in samples, not in dataloader batches.

        Returns the tuple transformers 5.23 ``Trainer._inner_training_loop`` unpacks: ``(epochs, update
        steps per epoch, examples, train samples, initial global batch, batches per epoch, LR schedule
        length)``. The loop uses the epochs and steps per epoch as bounds (the stream says where an
        epoch ends), so they are upper bounds that its banner prints as the estimate
        (:class:`~ds_adabatch.integrations.hf.progress.ShownInt`). transformers 4.57.6 and 5.0-5.2 pass
        ``total_train_batch_size`` and read another tuple (``hf.compat``).
        """
        return self._release_loop.training_values(self._training_values(args))

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The Trainer's total batch (4.57.6-5.2: the first step's global batch, ``hf.compat``)."""
        return self._release_loop.total_train_batch_size(super(), args)

    def get_cp_size(self) -> int:
        """Context-parallel degree (the Trainer's; 4.57 has none: ``hf.compat``)."""
        return self._release_loop.cp_size(super())

    def get_sp_size(self) -> int:
        """Sequence-parallel degree (as :meth:`get_cp_size`)."""
        return self._release_loop.sp_size(super())

    def _training_values(self, args: TrainingArguments) -> tuple[Any, ...]:
        state = self._require_state()
        n = state.sampler.num_samples
        first = state.initial_plan.global_batch_size
        progress = state.progress
        progress.estimate(0)

        # The banner is printed after _init_training_state, which estimates again from a resumed state.
        def steps_per_epoch() -> str:
            return progress.run_estimate.describe_steps_per_epoch(state.scheduled_batch)

        def how() -> str:
            return (
                "estimated from the schedule"
                if progress.run_estimate.exact
                else "at the current batch; it changes with the batch"
            )

        per_epoch = ShownInt(n, steps_per_epoch)
        if progress.epoch_based:
            epochs, samples = math.ceil(args.num_train_epochs), progress.planned_samples()
            lr_length = ShownInt(
                progress.scheduler_steps(), lambda: f"{progress.run_estimate.total_steps:,} ({how()})"
            )
        else:
            # max_steps ends training; the loop walks epochs until then (one step at least per epoch).
            epochs = ShownInt(args.max_steps + 1, lambda: f"{progress.run_estimate.epochs:,} ({how()})")
            samples, lr_length = args.max_steps * first, progress.scheduler_steps()
        return epochs, per_epoch, n, samples, first, n, lr_length

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint,
        trial,
    ) -> tuple[int, int]:
        # transformers 5.23: returns (epochs trained, batches to skip in that epoch). The sample stream
        # resumes from its own cursor, so nothing is skipped and the epoch is the stream's.
        super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        epoch = self._resume_batch_state(resume_from_checkpoint)
        self._align_trainer_state(int(max_steps))
        return epoch, 0

    def _load_callback_state(self) -> None:
        super()._load_callback_state()
        self._release_loop.callback_state_loaded()  # 4.57.6-5.2 resume the batch state here (hf.compat)

    def _resume_batch_state(self, resume_from_checkpoint: Any) -> int:
        """Load a resumed run's batch state at the Trainer's ``global_step``; the stream's epoch."""
        state = self._require_state()
        step = self.state.global_step
        if resume_from_checkpoint is not None and os.path.isfile(
            os.path.join(resume_from_checkpoint, _TRAINER_STATE)
        ):
            state.load(resume_from_checkpoint, step)
            return state.next_batch_epoch(step)
        return 0

    def _align_trainer_state(self, max_steps: int) -> None:
        """``trainer_state.json``'s epochs and steps: the run's, not the loop's bounds."""
        state = self._require_state()
        step = self.state.global_step
        self._samples_at_start = state.samples_consumed
        self._tokens_at_start = state.tokens
        progress = state.progress
        estimate = progress.estimate(step)
        self.state.num_train_epochs = (
            math.ceil(self.args.num_train_epochs) if progress.epoch_based else estimate.epochs
        )
        self.state.max_steps = progress.step_budget(step) if progress.epoch_based else int(max_steps)

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        # The LR schedule's length reaches DeepSpeed's config and the scheduler as a plain int.
        prepared = super()._prepare_for_training(int(max_steps), train_dataloader, resume_from_checkpoint)
        self._start_step_log()
        self._show_first_gas()
        return prepared

    def _start_step_log(self) -> None:
        # Once the DeepSpeed engine exists (its monitor).
        state = self._require_state()
        self._step_log = TrainerStepLog(
            state, state.config.log, getattr(deepspeed_engine(self.accelerator), "monitor", None)
        )

    def _show_first_gas(self) -> None:
        # transformers 5.23 prints args.gradient_accumulation_steps in its banner right after
        # _prepare_for_training and loops with it (as 1: one item is one step); on_train_begin puts back 1.
        state = self._require_state()
        plan = state.plan_for_step(self.state.global_step)
        gas = f"{plan.gradient_accumulation_steps}"
        if state.config.schedule.type != "constant" or state.token_budget:
            gas += " at the first step (it follows the batch)"
        self.args.gradient_accumulation_steps = ShownInt(1, gas)

    def _train_begins(self) -> None:
        """Called by the callback at ``on_train_begin`` (transformers 4.57 does more here: ``hf.compat``)."""
        self._release_loop.train_begins()

    def get_batch_samples(
        self, epoch_iterator: Iterator[StepInputs], num_batches: int, device: torch.device
    ) -> tuple[list[StepInputs], None]:
        """The next optimizer step's :class:`StepInputs` (token counts are taken in ``training_step``)."""
        try:
            item = next(epoch_iterator)
        except StopIteration:
            # transformers 5.23's _run_epoch counts update steps up to a bound; the stream ends the epoch.
            self.control.should_epoch_stop = True
            return [], None
        return self._release_loop.step_items([item]), None

    # -- where transformers' releases differ (hf.compat) ---------------------------------------------
    @property
    def deepspeed(self) -> Any:
        """The DeepSpeed engine the Trainer assigned (the attribute ``transformers.Trainer`` keeps)."""
        return self._deepspeed

    @deepspeed.setter
    def deepspeed(self, engine: Any) -> None:
        self._deepspeed = engine
        if engine is not None:  # 4.57.6-5.2 couple the LR scheduler here (hf.compat); a resume loads next
            self._release_loop.engine_assigned(engine)
            self._universal.engine_assigned(engine, self.args.world_size, self.args.process_index)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        self._release_fixes.optimizer_created()  # before 5.18: the "auto" warmup DeepSpeed refuses
        self._release_loop.optimizer_created()  # 4.57.6-5.2: the banner's GAS
        return optimizer

    def _load_best_model(self) -> None:  # written on another world size before a resume: converted
        with self._universal.loading(self.state.best_model_checkpoint, self.deepspeed, self.args):
            super()._load_best_model()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._universal.loaded()  # DeepSpeed loaded its checkpoint just before; hf.compat: before 5.18
        if not self._release_fixes.load_optimizer_and_scheduler(checkpoint):  # a CPU run's optimizer
            super()._load_optimizer_and_scheduler(checkpoint)

    # -- one optimizer step --------------------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; returns the loss to log.

        The returned value averaged over ranks is the step's mean loss over the global batch. Under
        DeepSpeed with ``memory.recover_from_oom`` (the default), an out-of-memory error on any rank
        re-runs the same samples with a smaller micro-batch (``ds_adabatch.runtime.memory.recovery``); with a
        token budget, cut into passes of a lower token budget.
        """
        if not isinstance(inputs, StepInputs):
            return super().training_step(model, inputs, num_items_in_batch)
        return self._trainer_step.run(model, inputs)

    def floating_point_ops(self, inputs: Any) -> int:
        """FLOPs of the step's real micro-batches (pads excluded)."""
        if not isinstance(inputs, StepInputs):
            return super().floating_point_ops(inputs)
        count = super().floating_point_ops  # (a bare super() fails in a generator)
        return sum(count(m.batch) for m in inputs.micro_batches if not m.is_pad)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if not isinstance(inputs, StepInputs):
            return super()._track_num_input_tokens(inputs)
        # transformers 5.23 gathers the count once per call: every rank calls once per micro-batch
        # (the same number everywhere), a pad with its tensors emptied so it counts 0.
        for m in inputs.micro_batches:
            batch = m.batch
            if m.is_pad and isinstance(batch, Mapping):
                batch = {k: v[:0] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            super()._track_num_input_tokens(batch)
        return None

    # -- learning rate -------------------------------------------------------------------------------
    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The Trainer's scheduler, advanced by samples (or steps) and scaled with the batch."""
        scheduler = super().create_scheduler(int(num_training_steps), optimizer)
        if self.batch_state is None:
            return scheduler
        kept, coupling = couple_scheduler(
            scheduler,
            optimizer=optimizer if optimizer is not None else self.optimizer,
            engine=deepspeed_engine(self.accelerator),
            lr=self.batch_state.lr,
        )
        self.lr_scheduler = kept
        self._lr_coupling = coupling
        bind = getattr(self.batch_state.controller.schedule, "bind_base_lr", None)
        if coupling is not None and callable(bind):  # LR-aware schedules (seesaw) read the unscaled LR
            bind(CurrentBaseLR(coupling))
        return kept

    # -- checkpoints and logs ------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        # Before the Trainer's files (5.23 writes trainer_state.json, the completion marker, last), in its
        # folder; every rank resolves the pending records, so the checkpoint holds the latest loss.
        step = self.state.global_step
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.is_deepspeed_enabled:  # a save over this step's earlier one: its shards go first
            clear_earlier_save(folder, self.args.local_process_index)
        if self.batch_state is not None:
            self.batch_state.sync.reduce()
            if self.args.should_save:
                self.batch_state.save(folder, step)
        super()._save_checkpoint(model, trial)
        if self._recovery is not None:  # the checkpoint holds the limits the records taught
            self._recovery.checkpoint_saved(self.args.output_dir)

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        # transformers 5.23 calls this after every optimizer step with the step's gradient norm.
        if self._step_log is not None:
            self._step_log.end_of_step(self.state.global_step, grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs gain the batch shape and ``train_coverage``; throughput counts real samples."""
        state = self.batch_state
        if state is not None and self.is_in_train and "loss" in logs:
            logs["train_coverage"] = state.train_coverage
            logs["global_batch_size"] = state.plan.global_batch_size
            logs["micro_batch_size"] = state.micro_batch_size
            logs["gradient_accumulation_steps"] = state.plan.gradient_accumulation_steps
            if state.token_budget and state.last_step is not None:
                logs["global_batch_tokens"] = state.last_step.global_batch.tokens
                logs["train_tokens"] = state.tokens
            if state.noise is not None and state.noise.noise_scale is not None:
                logs["noise_scale"] = state.noise.noise_scale
        if state is not None and logs.get("train_runtime"):
            samples = state.samples_consumed - self._samples_at_start
            logs["train_samples_per_second"] = round(samples / logs["train_runtime"], 3)
            if state.token_budget:
                tokens = state.tokens - self._tokens_at_start
                logs["train_tokens_per_second"] = round(tokens / logs["train_runtime"], 3)
        super().log(logs, start_time)

    # -- helpers -------------------------------------------------------------------------------------
    def _require_state(self) -> AdaptiveBatchState:
        if self.batch_state is None:
            raise RuntimeError("the batch state is built by get_train_dataloader(); call trainer.train()")
        return self.batch_state

    def _finish_run(self) -> None:
        """At the end of training (every rank): the pending step records are resolved and written."""
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None


def _main_input_name(processing_class: Any) -> str:
    """The sample key whose length a sample's tokens are, as transformers 5.23 ``group_by_length`` reads
    it: the processing class's first model input, else ``"input_ids"``."""
    names = getattr(processing_class, "model_input_names", None)
    return names[0] if isinstance(names, (list, tuple)) and names else "input_ids"

"""``AdaptiveBatchSizeTrainer``: a Hugging Face ``Trainer`` whose batch size changes while it trains.

Usage: ``AdaptiveBatchSizeTrainer(batch_size_scheduler=fn, model=..., args=..., train_dataset=...)`` with
``fn(step, batch_size) -> batch_size``; ``runners/hf_trainer_example.py`` is a complete demo.

Where the global batch comes from: the scheduler (samples per device per optimizer step, started at
``per_device_train_batch_size x gradient_accumulation_steps``, largest forward pass
``per_device_train_batch_size`` unless ``max_micro_batch_per_gpu`` says otherwise), else the
``"adabatch"`` section of the DeepSpeed config in ``TrainingArguments(deepspeed=...)``, else a constant
``per_device_train_batch_size x gradient_accumulation_steps x world size``. A section next to a scheduler
still sets bounds, granularity, the largest micro-batch, LR coupling and loss normalisation.

Design (written against transformers 5.23 and accelerate 1.15). The Trainer's outer loop is kept, so
callbacks, logging, evaluation, checkpoint rotation and hub pushes behave as usual; only the data and
the inside of one optimizer step change:

* ``get_train_dataloader`` returns a :class:`~ds_adabatch.integrations._trainer_data.StepLoader`: one
  item per optimizer step, holding this rank's micro-batches for the plan the schedule chose just
  before the item was drawn. The Trainer runs with ``gradient_accumulation_steps=1`` (its loop groups
  that many items into a step); the real accumulation steps are the plan's. The loader is never
  passed to ``accelerator.prepare``, so accelerate prefetches nothing of a stale size.
* ``training_step`` runs the step's micro-batches: the accumulation boundary (DeepSpeed) or gradient
  sync (DDP) on the last one only, each loss scaled so the update is the exact mean over the global
  batch: ``loss x count x world / total``, with ``count`` and ``total`` the micro-batch's and the
  global batch's samples, or target tokens (``labels != -100``) where the Trainer would normalise by
  ``num_items_in_batch``. The model is handed the micro-batch's *own* token count as
  ``num_items_in_batch``, so its loss is that micro-batch's mean whether it honours the argument (a
  causal LM divides its summed loss by it) or ignores it (``BertForSequenceClassification`` returns its
  own mean regardless): the normalisation never depends on the model. Zero-weight pads keep every
  rank running the same number of passes.
* The Trainer's epochs are the sample stream's epochs; ``state.epoch`` is the fractional epoch of
  samples seen, and with ``num_train_epochs`` the step budget (``state.max_steps``, progress bar) is
  re-estimated every step and closes exactly when the epochs are trained.
* The LR scheduler is wrapped in ``ds_adabatch.runtime.lr.BatchCoupledLR``: with ``num_train_epochs``
  it advances once per initial-global-batch of samples (so its length is right whatever the batch
  does); with ``max_steps`` once per optimizer step. An ``"adabatch"`` section's ``lr_schedule_unit``
  and ``lr_scaling`` override both.
* Checkpoints hold ``adabatch_state.json`` (schedule, sampler cursor, next decision) next to
  ``trainer_state.json``; ``resume_from_checkpoint`` continues the same sample stream, also on another
  world size (whether DeepSpeed reloads its own state there depends on its ZeRO stage).
* Token budgets (``"adabatch".micro_batch_tokens``, for variable-length data): every step is formed by
  ``ds_adabatch.data.tokens.TokenBudgetSampler`` from the same seeded order, cut into passes of at most
  that many tokens as the data collator pads them (``padding``), and collated by the Trainer's data
  collator. The weights above are unchanged (a pass holds ``num_samples`` real samples, a pad 0), so the
  update is still the exact mean over the step's samples or target tokens. The lengths come from
  ``lengths=`` / ``length_fn=``, else the ``length_column_name`` column, else ``len(input_ids)``
  (``_trainer_lengths``). The LR multiplier follows the scheduled target, not the varying sample count.
* On a machine without GPUs, ``torchrun`` with the default ``use_cpu=False`` would give every rank a
  world of one (N-fold duplicate training); the arguments are rebuilt with ``use_cpu=True`` so the
  ranks train as one gloo data-parallel group (a warning says so), and elsewhere a clear error is raised.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_datasets_available

from ds_adabatch.data.lengths import SampleLengths
from ds_adabatch.plan import BatchPlan
from ds_adabatch.runtime.adam_geometry import configured_geometry, measured_geometry
from ds_adabatch.runtime.comm import all_reduce_sum
from ds_adabatch.runtime.lr import BatchCoupledLR, CurrentBaseLR
from ds_adabatch.runtime.noise_probe import NoiseProbe, update_estimator
from ds_adabatch.runtime.recovery import OomRecovery
from ds_adabatch.runtime.weights import loss_weight

from ._trainer_callback import AdaptiveBatchCallback
from ._trainer_data import StepInputs, StepLoader
from ._trainer_dist import trainer_arguments
from ._trainer_engine import (
    apply_plan_to_engine,
    count_target_tokens,
    couple_scheduler,
    loss_shifts_labels,
    seed_deepspeed_batch_keys,
)
from ._trainer_setup import build_batch_state, token_lengths
from ._trainer_state import STATE_FILE, AdaptiveBatchState

__all__ = ["STATE_FILE", "AdaptiveBatchSizeTrainer", "AdaptiveBatchState", "BatchSizeScheduler"]

BatchSizeScheduler = Callable[[int, int], int]
"""``fn(step, batch_size) -> batch_size``: samples per device per optimizer step; ``step`` = steps done."""

_TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


class AdaptiveBatchSizeTrainer(Trainer):
    """A ``transformers.Trainer`` whose global batch follows a schedule, exactly and sample by sample.

    Args:
        batch_size_scheduler: ``fn(step, batch_size) -> int``, called before every optimizer step after
            the first with the steps completed and its own previous answer; both are samples per device
            per optimizer step (the first ``batch_size`` is ``per_device_train_batch_size x
            gradient_accumulation_steps``). ``None``: the ``"adabatch"`` section of the DeepSpeed config
            (``TrainingArguments(deepspeed=...)``) drives the global batch, or without one the batch is
            constant.
        max_micro_batch_per_gpu: the largest forward pass, in samples; larger batches add accumulation
            steps. Default: the ``"adabatch"`` section's, else ``per_device_train_batch_size``. With
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
    the Trainer would normalise by ``num_items_in_batch``. Training logs add ``train_coverage``,
    ``global_batch_size``, ``micro_batch_size`` and ``gradient_accumulation_steps`` (and
    ``noise_scale`` under the ``gradient_noise`` schedule); ``epoch`` is
    fractional (samples seen / dataset size). ``trainer.batch_state`` exposes the run's plan and sample
    cursor, and ``trainer.args.gradient_accumulation_steps`` reads 1 (the plan's steps are in
    ``trainer.batch_state.plan``).

    With ``micro_batch_tokens`` in the ``"adabatch"`` section, a step's samples are cut into passes of
    bounded tokens: ``global_batch_size`` logs the step's real samples, ``micro_batch_size`` the most
    samples of one pass, ``gradient_accumulation_steps`` the passes of every rank, and
    ``global_batch_tokens`` / ``train_tokens`` the step's and the run's real tokens (the samples'
    lengths); a schedule with ``unit: "tokens"`` sets each step's token target.

    Raises:
        TypeError: ``batch_size_scheduler`` is not callable.
        ValueError: an unsupported setting (``auto_find_batch_size``, ``DataParallel``), ranks that
            cannot form one data-parallel group, or (before any process group starts) lengths that do not
            fit ``train_dataset``, a sample longer than ``micro_batch_tokens`` (named with its index and
            length), or ``lengths`` / ``length_fn`` without ``micro_batch_tokens``.
        ConfigError: the ``"adabatch"`` section is invalid.
    """

    def __init__(
        self,
        batch_size_scheduler: BatchSizeScheduler | None = None,
        *,
        max_micro_batch_per_gpu: int | None = None,
        lengths: Any = None,
        length_fn: Callable[[Any], int] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if isinstance(batch_size_scheduler, torch.nn.Module) or (
            batch_size_scheduler is not None and not callable(batch_size_scheduler)
        ):
            raise TypeError(
                f"batch_size_scheduler must be callable as fn(step, batch_size), got "
                f"{type(batch_size_scheduler).__name__}; pass the Trainer's own arguments by keyword"
            )
        args = trainer_kwargs.pop("args", None)
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")  # the Trainer's own default
        self.user_gradient_accumulation_steps = args.gradient_accumulation_steps
        # Token-budget lengths are checked before trainer_arguments sets up the process group.
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
            ),
        )
        args = trainer_arguments(args)
        super().__init__(args=args, **trainer_kwargs)
        self.batch_size_scheduler = batch_size_scheduler
        self.max_micro_batch_per_gpu = max_micro_batch_per_gpu
        self.batch_state: AdaptiveBatchState | None = None
        """The run's schedule, plan and sample cursor; built when training starts."""
        self._applied_plan: BatchPlan | None = None
        self._lr_coupling: BatchCoupledLR | None = None
        self._samples_at_start = 0
        self._tokens_at_start = 0
        self._shifts_labels: bool | None = None
        self._recovery: OomRecovery | None = None
        # First, so state.epoch / state.max_steps are set before DefaultFlowCallback and the progress bar.
        self.callback_handler.callbacks.insert(0, AdaptiveBatchCallback(self))

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
        )
        self._applied_plan = None
        if self.is_deepspeed_enabled:
            seed_deepspeed_batch_keys(
                self.accelerator.state.deepspeed_plugin.deepspeed_config,
                self.batch_state.initial_plan,
            )
        return StepLoader(self.batch_state, lambda: self.state.global_step)

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
            )
            self._lengths_of = (self.train_dataset, found)
        return found

    def set_initial_training_values(self, args: TrainingArguments, dataloader: Any) -> tuple[int, ...]:
        """Epoch count, steps per epoch and schedule length in samples, not in dataloader batches.

        Returns the tuple transformers 5.23 ``Trainer._inner_training_loop`` unpacks: ``(epochs, update
        steps per epoch (an upper bound), examples, train samples, initial global batch, batches per
        epoch, LR schedule length)``.
        """
        state = self._require_state()
        n = state.sampler.num_samples
        first = state.initial_plan.global_batch_size
        if state.epoch_based:
            epochs, samples = math.ceil(args.num_train_epochs), state.planned_samples()
        else:
            # max_steps ends training; the Trainer walks epochs until then.
            epochs, samples = sys.maxsize, args.max_steps * first
        return epochs, n, n, samples, first, n, state.scheduler_steps()

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
        state = self._require_state()
        step = self.state.global_step
        epoch = 0
        if resume_from_checkpoint is not None and os.path.isfile(
            os.path.join(resume_from_checkpoint, _TRAINER_STATE)
        ):
            state.load(resume_from_checkpoint, step)
            epoch = state.next_batch_epoch(step)
        self._samples_at_start = state.samples_consumed
        self._tokens_at_start = state.tokens
        if state.epoch_based:
            self.state.max_steps = state.step_budget(step)
        return epoch, 0

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, None]:
        """The next optimizer step's :class:`StepInputs` (token counts are taken in ``training_step``)."""
        try:
            item = next(epoch_iterator)
        except StopIteration:
            # transformers 5.23 Trainer._run_epoch counts update steps up to a bound; the sample stream
            # says where the epoch ends.
            self.control.should_epoch_stop = True
            return [], None
        return [item], None

    # -- one optimizer step --------------------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; returns the loss to log.

        The returned value averaged over ranks is the step's mean loss over the global batch. Under
        DeepSpeed with ``memory.recover_from_oom`` (the default), an out-of-memory error on any rank
        re-runs the same samples with a smaller micro-batch (``ds_adabatch.runtime.recovery``); with a
        token budget, cut into passes of a lower token budget.
        """
        if not isinstance(inputs, StepInputs):
            return super().training_step(model, inputs, num_items_in_batch)
        state = self._require_state()
        recovery = self._oom_recovery()
        if recovery is None:
            return self._adaptive_step(model, inputs)

        def replan(ranks: list[int]) -> None:
            number = self.state.global_step
            if state.token_budget:  # the same samples, cut with a lower token budget
                plan = state.recut_after_oom(inputs.step, recovery.failed_passes(ranks), number)
            else:
                plan = state.replan_after_oom(inputs.step.plan, ranks, number)
            inputs.step = state.loader.reload(inputs.step, plan)
            state.last_step = inputs.step

        logged = recovery.run(lambda: self._adaptive_step(model, inputs), replan)
        state.after_clean_step(inputs.step)
        return logged

    def _oom_recovery(self) -> OomRecovery | None:
        """Out-of-memory recovery on the DeepSpeed engine (built once it exists), or None."""
        state = self._require_state()
        engine = self._deepspeed_engine()
        if engine is None and state.config.auto_micro_batch:
            raise ValueError(
                "max_micro_batch_per_gpu 'auto' learns the micro-batch from out-of-memory errors, which "
                "AdaptiveBatchSizeTrainer recovers under DeepSpeed only: pass TrainingArguments(deepspeed=...) "
                "or give max_micro_batch_per_gpu an integer"
            )
        if engine is None or not state.config.memory.recover_from_oom:
            return None
        if self._recovery is None or self._recovery.deepspeed is not engine:
            self._recovery = OomRecovery(
                engine, state.config, rank=state.rank, world_size=state.world_size, memory=state.memory
            )
        return self._recovery

    def _adaptive_step(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor:
        """One attempt at the step's micro-batches (``training_step`` without recovery)."""
        state = self._require_state()
        step = inputs.step
        self._apply_plan(step.plan)
        micro = step.micro_batches
        world, device = state.world_size, self.args.device
        by_token = self._normalizes_by_tokens(micro[0].batch)
        total = step.global_batch_size
        tokens = 0
        own: list[int] = []
        counts: list[int] = []
        if by_token or state.counts_label_tokens:
            own = [self._count_items(m.batch) for m in micro]
            counts = [0 if m.is_pad else c for m, c in zip(micro, own)]
            tokens = int(all_reduce_sum([sum(counts)], device)[0])
            if by_token:
                total = tokens
                if total <= 0:
                    raise ValueError("the global batch has no target tokens (labels != -100) to average over")
        if self._lr_coupling is not None:
            # DeepSpeed steps its scheduler inside the boundary backward below; it must already count
            # this step's samples (and the epoch tails drop_last skips: the schedule runs with the
            # stream, so it ends with the epochs).
            self._lr_coupling.set_samples(state.stream_samples)
        passes_items = by_token and self._passes_num_items()
        logged = torch.zeros((), device=device)
        measure = state.should_measure_noise(self.state.global_step, step.plan)
        probe = self._noise_probe() if measure else None
        try:
            for i, mb in enumerate(micro):
                if self._recovery is not None:  # a new pass: its own out-of-memory agreement point
                    self._recovery.begin_pass(f"in micro-batch {i} of step {self.state.global_step}", index=i)
                items = None
                if by_token:
                    # Whatever the model does with num_items_in_batch, its loss is this micro-batch's own
                    # mean over its target tokens (see _micro_backward); the weight makes it the mean
                    # over the global batch's tokens.
                    weight = loss_weight(counts[i], world, total)
                    factor = weight / (self._token_loss_scale() if passes_items else 1)
                    if passes_items:
                        items = torch.tensor(max(own[i], 1), device=device)
                else:
                    factor = weight = loss_weight(mb.num_samples, world, total)
                if probe is not None:
                    # The backward differentiates the micro-batch's own mean loss times this weight.
                    probe.begin(weight, 0 if mb.is_pad else mb.num_samples)
                sync = i == len(micro) - 1
                loss = self._micro_backward(model, mb.batch, factor, items, sync=sync, probe=probe)
                if weight != 0.0:  # a micro-batch without targets may have a NaN mean
                    logged = logged + loss
        finally:
            if probe is not None:
                probe.close()
        if probe is not None and state.noise is not None:
            sums = all_reduce_sum(probe.local_sums(), device)
            update_estimator(state.noise, sums, step.global_batch_size, probe.reduced_sq_norm())
        # With a token budget the step's tokens are its samples' lengths, known on every rank.
        state.tokens += step.global_batch.tokens if state.token_budget else tokens
        if state.needs_loss:
            state.last_loss = float(all_reduce_sum([logged], device)[0]) / world
            state.loss_ema.update(state.last_loss)
        if self._lr_coupling is not None:
            state.last_lr = self._lr_coupling.get_lr()[0]
        return logged

    def _micro_backward(
        self,
        model: torch.nn.Module,
        batch: Any,
        factor: float,
        items: torch.Tensor | None,
        *,
        sync: bool,
        probe: NoiseProbe | None = None,
    ) -> torch.Tensor:
        # accelerate 1.15: DeepSpeedEngineWrapper.backward sets DeepSpeed's accumulation boundary from
        # gradient_state.sync_gradients (and steps the engine only then); AcceleratedOptimizer.step
        # skips while it is False. transformers 5.23 sets it the same way in Trainer._run_epoch.
        self.accelerator.gradient_state._set_sync_gradients(sync)
        defer = not (
            sync
            or self.is_deepspeed_enabled
            or self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        )
        with self.accelerator.no_sync(model) if defer else contextlib.nullcontext():
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = self._prepare_inputs(batch)
            with self.compute_loss_context_manager():
                if items is None:
                    loss = self.compute_loss(model, inputs)
                else:
                    loss = self.compute_loss(model, inputs, num_items_in_batch=items)
            loss = loss * factor
            # transformers >= 4.46 calls DeepSpeed's backward with scale_wrt_gas=False: the factor
            # already holds the whole normalisation.
            kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}
            engine = self._deepspeed_engine()
            if probe is not None and sync and probe.read_grads and engine is not None:
                # DeepSpeed ZeRO 0: the reduced gradients exist only between the boundary backward and
                # the step that clears them, and accelerate 1.15 DeepSpeedEngineWrapper.backward runs
                # the two back to back; its calls are made here with the noise probe's read between.
                engine.set_gradient_accumulation_boundary(is_boundary=True)
                engine.backward(loss, **kwargs)
                probe.end()
                probe.read_reduced_norm()
                engine.step()
            else:
                self.accelerator.backward(loss, **kwargs)
                if probe is not None:
                    probe.end()
        return loss.detach()

    def _apply_plan(self, plan: BatchPlan) -> None:
        """Make DeepSpeed's view of the batch and the LR multiplier match ``plan`` (between steps only)."""
        state = self._require_state()
        state.plan = plan
        if plan != self._applied_plan:
            engine = self._deepspeed_engine()
            if engine is not None:
                apply_plan_to_engine(engine, plan)
            self._applied_plan = plan
        if self._lr_coupling is not None:
            # Every step: a token step's multiplier follows its target, which a plan does not show.
            self._lr_coupling.set_global_batch(state.lr_batch(plan))

    def _normalizes_by_tokens(self, batch: Any) -> bool:
        """Whether the step's mean is over target tokens (``labels != -100``) rather than samples.

        By default as the Trainer decides (transformers 5.23 ``Trainer._get_num_items_in_batch`` counts
        items when the batch has labels and the model takes loss kwargs or a ``compute_loss_func`` is
        set); ``adabatch.loss_normalization`` overrides it.
        """
        labelled = isinstance(batch, Mapping) and "labels" in batch
        mode = self._require_state().loss_normalization
        if mode == "token" and not labelled:
            raise ValueError(
                'adabatch.loss_normalization "token" needs batches that are dicts with a "labels" tensor '
                '(the targets are counted as labels != -100); use "sample" for other batches'
            )
        if mode is not None:
            return mode == "token"
        return labelled and self._passes_num_items()

    def _passes_num_items(self) -> bool:
        # transformers 5.23 Trainer.compute_loss hands num_items_in_batch to the model's forward when
        # model_accepts_loss_kwargs, and to compute_loss_func.
        return bool(self.model_accepts_loss_kwargs or self.compute_loss_func is not None)

    def _count_items(self, batch: Mapping[str, Any]) -> int:
        if self._shifts_labels is None:
            model = self.accelerator.unwrap_model(self.model)
            # transformers 5.23 Trainer._loss_shifts_labels (see loss_shifts_labels for what it misses).
            self._shifts_labels = loss_shifts_labels(model, getattr(self, "_loss_shifts_labels", False))
        return count_target_tokens(batch, self._shifts_labels)

    def _token_loss_scale(self) -> int:
        # transformers 5.23 Trainer.compute_loss multiplies a loss computed with num_items_in_batch by
        # the number of data-parallel processes when average_tokens_across_devices (whether or not the
        # model used the count); that factor is divided out again.
        if self.args.average_tokens_across_devices and self._passes_num_items():
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    def floating_point_ops(self, inputs: Any) -> int:
        """FLOPs of the step's real micro-batches (pads excluded)."""
        if not isinstance(inputs, StepInputs):
            return super().floating_point_ops(inputs)
        return sum(
            super(AdaptiveBatchSizeTrainer, self).floating_point_ops(m.batch)
            for m in inputs.micro_batches
            if not m.is_pad
        )

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
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.batch_state is None:
            return scheduler
        kept, coupling = couple_scheduler(
            scheduler,
            optimizer=optimizer if optimizer is not None else self.optimizer,
            engine=self._deepspeed_engine(),
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
        # Written before the Trainer's files: transformers 5.23 writes trainer_state.json last, the
        # marker of a complete checkpoint. The folder name follows its Trainer._save_checkpoint.
        if self.batch_state is not None and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            self.batch_state.save(folder, self.state.global_step)
        super()._save_checkpoint(model, trial)

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

    def _noise_probe(self) -> NoiseProbe:
        """Hooks for one measured step on DeepSpeed's engine.

        Only the DeepSpeed config's ``"adabatch"`` section can ask for the ``gradient_noise`` schedule,
        so a measured step always runs under DeepSpeed.
        """
        engine = self._deepspeed_engine()
        if engine is None:
            raise RuntimeError("the gradient-noise scale is measured under DeepSpeed only")
        # The geometry the optimizer allows ("auto": Adam's when it keeps a second moment); an unset
        # scale takes that geometry's default, as with ds_adabatch.initialize.
        geometry = measured_geometry(engine, configured_geometry(engine))
        schedule = self._require_state().controller.schedule
        if hasattr(schedule, "use_geometry"):
            schedule.use_geometry(geometry)
        return NoiseProbe.for_deepspeed(engine, geometry=geometry)

    def _deepspeed_engine(self) -> Any:
        # accelerate 1.15 keeps the engine it built in accelerator.deepspeed_engine_wrapped.engine.
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapped is None else wrapped.engine


def _main_input_name(processing_class: Any) -> str:
    """The sample key whose length a sample's tokens are, as transformers 5.23 ``group_by_length`` reads
    it: the processing class's first model input, else ``"input_ids"``."""
    names = getattr(processing_class, "model_input_names", None)
    return names[0] if isinstance(names, (list, tuple)) and names else "input_ids"

"""One optimizer step of ``AdaptiveBatchSizeTrainer``: every micro-batch of this rank, weighted exactly.

:class:`TrainerStep` is held by the Trainer subclass (``trainer.adaptive_step``), whose
``training_step`` hands it each step; it replaces what transformers 5.23 does inside
``Trainer._run_epoch`` for one update step. The step was decided when the Trainer's loop drew it
from the step loader: ``hf.data.StepLoader`` asks ``AdaptiveBatchState.plan_for_step``, which asks
the run's step core (``StepCore.decide``, ``ds_adabatch.runtime.core.step_core``, the same core the
DeepSpeed entry points hold), and the core draws the step (``StepCore.draw``). :meth:`TrainerStep.run`
logs what that decision said, runs the passes (retried with smaller ones after an out-of-memory error,
the same samples cut anew by ``StepCore.recut``) and accounts a clean step to the core
(``StepCore.clean_step``, through ``AdaptiveBatchState.after_clean_step``); the step's loss reaches
the core's signals when the step sync resolves it (``hf.metrics``). The micro-batches run with the
accumulation boundary (DeepSpeed) or
gradient sync (DDP) on the last one only, each loss scaled so the update is the exact mean over the
global batch: ``loss x count x world / total``, with ``count`` and ``total`` the micro-batch's and the
global batch's samples, or target tokens (``labels != -100``) where the Trainer would normalise by
``num_items_in_batch``.

A steady step issues no collective and reads no device value beyond the plain Trainer's: sample counts
come from the sampler (known on every rank); token counts are taken from the collated host tensors
and summed over ranks in one all-reduce per step (where the plain Trainer gathers
``num_items_in_batch`` once per step), which also carries whatever the step sync has queued; the
total stays on the device and the weights are device tensors. The loss of each step stays on the
device too (``hf.metrics``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ds_adabatch.runtime.core.weights import loss_weight
from ds_adabatch.runtime.memory.recovery import OomRecovery
from ds_adabatch.runtime.memory.restart_record import RestartRecords
from ds_adabatch.runtime.noise.adam_geometry import configured_geometry, measured_geometry
from ds_adabatch.runtime.noise.probe import NoiseProbe, update_estimator

from .data import StepInputs
from .engine import apply_plan_to_engine, count_target_tokens, deepspeed_engine, loss_shifts_labels

if TYPE_CHECKING:  # pragma: no cover
    from ds_adabatch.plan import BatchPlan

    from .host import TrainerHost
    from .state import AdaptiveBatchState

__all__ = ["TrainerStep"]


@dataclass
class _StepWeights:
    """How one step's micro-batches are weighted (see the module docstring)."""

    by_token: bool
    """The mean is over target tokens (else over samples)."""
    total: float | torch.Tensor
    """The global batch's samples, or its target tokens (a device tensor unless the noise probe runs)."""
    passes_items: bool
    """``num_items_in_batch`` is handed to the loss."""
    own: list[int] = field(default_factory=list)
    """Each micro-batch's target tokens as collated (pads included)."""
    counts: list[int] = field(default_factory=list)
    """Each micro-batch's target tokens that count (pads: 0)."""
    step_tokens: int | torch.Tensor | None = None
    """The step's tokens over all ranks (None where they are not counted)."""


class TrainerStep:
    """The adaptive step of one ``AdaptiveBatchSizeTrainer`` (see the module docstring).

    Args:
        trainer: the Trainer it runs for (its model, accelerator, loss and the run's batch state).

    It owns what the step needs between steps: the plan last applied to DeepSpeed, out-of-memory
    recovery on the DeepSpeed engine and its restart records.
    """

    def __init__(self, trainer: TrainerHost) -> None:
        self.trainer = trainer
        self.applied_plan: BatchPlan | None = None
        """The plan DeepSpeed's batch keys were last set for (None: set them at the next step)."""
        self.recovery: OomRecovery | None = None
        """Out-of-memory recovery on the DeepSpeed engine (built with the first step under it)."""
        self.recovery_closed = False
        self.retried = False
        """Whether the step in progress was re-run after an out-of-memory error."""
        self.restart_records: RestartRecords | None = None
        """Records of exited processes that bound this run's plans (``runtime/memory/restart_record.py``)."""
        self._shifts_labels: bool | None = None

    # -- one step, with and without recovery ----------------------------------------------------------
    def run(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor:
        """The step's micro-batches, retried with smaller passes after an out-of-memory error."""
        state = self._state()
        state.step_started(self.trainer.state.global_step)  # the core's decision: plan change, warnings
        recovery = self.oom_recovery()
        self.retried = False
        if recovery is None:
            return self.attempt(model, inputs)

        def replan(ranks: list[int]) -> None:
            self.retried = True  # its time covers the failed attempt: not a step time of its shape
            number = self.trainer.state.global_step
            if state.token_budget:  # the same samples, cut with a lower token budget
                plan = state.recut_after_oom(inputs.step, recovery.failed_passes(ranks), number)
            else:
                plan = state.replan_after_oom(inputs.step.plan, ranks, number)
            inputs.step = state.core.recut(state.loader, inputs.step, plan)  # the same samples

        logged = recovery.run(lambda: self.attempt(model, inputs), replan)
        state.after_clean_step(inputs.step)
        return logged

    def attempt(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor:
        """One attempt at the step's micro-batches (``training_step`` without recovery)."""
        state = self._state()
        started = inputs.started  # when the loader began the step (its decision and data included)
        if started is None:
            started = time.perf_counter()
            state.step_times.step_started()
        step = inputs.step
        self.apply_plan(step.plan)
        measure = state.should_measure_noise(self.trainer.state.global_step, step.plan)
        weights = self._weights(inputs, measure)
        lr_used = self._couple_lr(state)
        probe = self._noise_probe() if measure else None
        try:
            logged = self._passes(model, inputs, weights, probe)
        finally:
            if probe is not None:
                probe.close()
        if probe is not None and state.noise is not None:
            noise, batch, sq_big = state.noise, step.global_batch_size, probe.reduced_sq_norm()
            # The measured sums ride one all-reduce with whatever is queued (pending losses).
            state.sync.defer(probe.local_sums(), lambda sums: update_estimator(noise, sums, batch, sq_big))
            state.sync.reduce()
        self._record(inputs, started, lr_used, logged, weights.step_tokens)
        return logged

    def _weights(self, inputs: StepInputs, measure: bool) -> _StepWeights:
        """The step's normaliser, and its tokens counted where they are (one all-reduce at most)."""
        state, step = self._state(), inputs.step
        micro = step.micro_batches
        by_token = self.normalizes_by_tokens(micro[0].batch)
        weights = _StepWeights(by_token, step.global_batch_size, by_token and self.passes_num_items())
        if by_token or state.counts_label_tokens:
            weights.own = [self._count_items(m.batch) for m in micro]
            weights.counts = [0 if m.is_pad else c for m, c in zip(micro, weights.own)]
            # The step's one collective, as the Trainer's own gather of num_items_in_batch.
            weights.step_tokens = state.sync.reduce([float(sum(weights.counts))])[0]
            if by_token:
                # A global batch without targets updates nothing rather than dividing by zero.
                weights.total = weights.step_tokens.clamp(min=1.0)
                if measure:
                    weights.total = float(weights.total)  # the noise probe weighs on the host
        if state.token_budget:  # the step's tokens are its samples' lengths, known on every rank
            weights.step_tokens = step.global_batch.tokens
        if weights.step_tokens is not None:
            state.add_tokens(weights.step_tokens)
        return weights

    def _couple_lr(self, state: AdaptiveBatchState) -> float | None:
        """The LR this step uses, its scheduler told the samples it counts (None without coupling)."""
        coupling = self.trainer._lr_coupling
        if coupling is None:
            return None
        # DeepSpeed steps its scheduler inside the boundary backward below; it must already count
        # this step's samples (and the epoch tails drop_last skips: the schedule runs with the
        # stream, so it ends with the epochs).
        coupling.set_samples(state.stream_samples)
        return coupling.get_lr()[0]

    def _passes(
        self, model: torch.nn.Module, inputs: StepInputs, weights: _StepWeights, probe: NoiseProbe | None
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; the sum of the counted passes' weighted losses."""
        trainer, micro = self.trainer, inputs.micro_batches
        world, device = self._state().world_size, trainer.args.device
        logged = torch.zeros((), device=device)
        for i, mb in enumerate(micro):
            if self.recovery is not None:  # a new pass: its own out-of-memory agreement point
                self.recovery.begin_pass(f"in micro-batch {i} of step {trainer.state.global_step}", index=i)
            items = None
            count = weights.counts[i] if weights.by_token else mb.num_samples
            if weights.by_token:
                # Whatever the model does with num_items_in_batch, its loss is this micro-batch's own
                # mean over its target tokens (see _micro_backward); the weight makes it the mean
                # over the global batch's tokens.
                weight: float | torch.Tensor = count * world / weights.total
                factor = weight / (self._token_loss_scale() if weights.passes_items else 1)
                if weights.passes_items:
                    items = torch.full((), max(weights.own[i], 1), dtype=torch.long, device=device)
            else:
                factor = weight = loss_weight(count, world, int(weights.total))
            if probe is not None:
                # The backward differentiates the micro-batch's own mean loss times this weight.
                probe.begin(float(weight), 0 if mb.is_pad else mb.num_samples)
            sync = i == len(micro) - 1
            loss = self._micro_backward(model, mb.batch, factor, items, sync=sync, probe=probe)
            if count != 0:  # a micro-batch without targets may have a NaN mean
                logged = logged + loss
        return logged

    def _record(
        self,
        inputs: StepInputs,
        started: float,
        lr_used: float | None,
        logged: torch.Tensor,
        step_tokens: int | torch.Tensor | None,
    ) -> None:
        """The step's throughput point and its log record."""
        state, trainer, plan = self._state(), self.trainer, inputs.step.plan
        coupling = trainer._lr_coupling
        if coupling is not None:
            state.last_lr = lr_used
        # Throughput point: the step's time with its shape, for the goodput schedule (runtime.step_times).
        state.step_times.step_finished(plan, started, state.sync, retried=self.retried, step=inputs.step)
        if trainer._step_log is not None:  # made when training starts (_prepare_for_training)
            trainer._step_log.step_done(
                completed=trainer.state.global_step + 1,
                plan=plan,
                lr=lr_used,
                lr_multiplier=1.0 if coupling is None else coupling.multiplier,
                started=started,
                logged=logged,
                step_tokens=step_tokens,
            )

    def _micro_backward(
        self,
        model: torch.nn.Module,
        batch: Any,
        factor: float | torch.Tensor,
        items: torch.Tensor | None,
        *,
        sync: bool,
        probe: NoiseProbe | None = None,
    ) -> torch.Tensor:
        trainer = self.trainer
        accelerator = trainer.accelerator
        # accelerate 1.15: DeepSpeedEngineWrapper.backward sets DeepSpeed's accumulation boundary from
        # gradient_state.sync_gradients (and steps the engine only then); AcceleratedOptimizer.step
        # skips while it is False. transformers 5.23 sets it the same way in Trainer._run_epoch.
        accelerator.gradient_state._set_sync_gradients(sync)
        defer = not (
            sync
            or trainer.is_deepspeed_enabled
            or accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        )
        with accelerator.no_sync(model) if defer else contextlib.nullcontext():
            model.train()
            if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
                trainer.optimizer.train()
            inputs = trainer._prepare_inputs(batch)
            with trainer.compute_loss_context_manager():
                if items is None:
                    loss = trainer.compute_loss(model, inputs)
                else:
                    loss = trainer.compute_loss(model, inputs, num_items_in_batch=items)
            if isinstance(factor, torch.Tensor):
                # A device weight: at least float32, so a low-precision loss keeps the weight exact.
                factor = factor.to(torch.promote_types(loss.dtype, torch.float32))
            loss = loss * factor
            self._backward(loss, sync=sync, probe=probe)
        return loss.detach()

    def _backward(self, loss: torch.Tensor, *, sync: bool, probe: NoiseProbe | None) -> None:
        # transformers >= 4.46 calls DeepSpeed's backward with scale_wrt_gas=False: the factor
        # already holds the whole normalisation.
        kwargs = {"scale_wrt_gas": False} if self.trainer.is_deepspeed_enabled else {}
        engine = self.deepspeed_engine()
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
            self.trainer.accelerator.backward(loss, **kwargs)
            if probe is not None:
                probe.end()

    # -- how the step's mean is taken ----------------------------------------------------------------
    def normalizes_by_tokens(self, batch: Any) -> bool:
        """Whether the step's mean is over target tokens (``labels != -100``) rather than samples.

        By default as the Trainer decides (transformers 5.23 ``Trainer._get_num_items_in_batch`` counts
        items when the batch has labels and the model takes loss kwargs or a ``compute_loss_func`` is
        set); ``adabatch.loss_normalization`` overrides it.
        """
        labelled = isinstance(batch, Mapping) and "labels" in batch
        mode = self._state().loss_normalization
        if mode == "token" and not labelled:
            raise ValueError(
                'adabatch.loss_normalization "token" needs batches that are dicts with a "labels" tensor '
                '(the targets are counted as labels != -100); use "sample" for other batches'
            )
        if mode is not None:
            return mode == "token"
        return labelled and self.passes_num_items()

    def passes_num_items(self) -> bool:
        # transformers 5.23 Trainer.compute_loss hands num_items_in_batch to the model's forward when
        # model_accepts_loss_kwargs, and to compute_loss_func.
        return bool(self.trainer.model_accepts_loss_kwargs or self.trainer.compute_loss_func is not None)

    def _count_items(self, batch: Mapping[str, Any]) -> int:
        if self._shifts_labels is None:
            trainer = self.trainer
            model = trainer.accelerator.unwrap_model(trainer.model)
            # transformers 5.23 Trainer._loss_shifts_labels (see loss_shifts_labels for what it misses).
            self._shifts_labels = loss_shifts_labels(model, getattr(trainer, "_loss_shifts_labels", False))
        return count_target_tokens(batch, self._shifts_labels)

    def _token_loss_scale(self) -> int:
        # transformers 5.23 Trainer.compute_loss multiplies a loss computed with num_items_in_batch by
        # the number of data-parallel processes when average_tokens_across_devices (whether or not the
        # model used the count); that factor is divided out again.
        trainer = self.trainer
        if trainer.args.average_tokens_across_devices and self.passes_num_items():
            return trainer.accelerator.num_processes // trainer.get_tp_size()
        return 1

    # -- DeepSpeed: the plan, the noise probe, out-of-memory recovery ---------------------------------
    def deepspeed_engine(self) -> Any:
        """The DeepSpeed engine accelerate built (None before it exists, or without DeepSpeed)."""
        return deepspeed_engine(self.trainer.accelerator)

    def apply_plan(self, plan: BatchPlan) -> None:
        """Make DeepSpeed's view of the batch and the LR multiplier match ``plan`` (between steps only)."""
        state = self._state()
        state.plan = plan
        if plan != self.applied_plan:
            engine = self.deepspeed_engine()
            if engine is not None:
                apply_plan_to_engine(engine, plan)
            self.applied_plan = plan
        coupling = self.trainer._lr_coupling
        if coupling is not None:
            if coupling.follows_noise and state.noise is not None:  # adascale: the estimate now
                coupling.observe_noise(state.noise.noise_scale_or_inf)
            # Every step: a token step's multiplier follows its target, which a plan does not show.
            coupling.set_global_batch(state.lr_batch(plan))

    def _noise_probe(self) -> NoiseProbe:
        """Hooks for one measured step on DeepSpeed's engine.

        Only an ``"adabatch"`` section can ask for the ``gradient_noise`` or ``goodput`` schedule, and the
        probe reads DeepSpeed's reduced gradients, so a measured step runs under DeepSpeed.
        """
        engine = self.deepspeed_engine()
        if engine is None:
            raise RuntimeError("the gradient-noise scale is measured under DeepSpeed only")
        # The geometry the optimizer allows ("auto": Adam's when it keeps a second moment); an unset
        # scale takes that geometry's default, as with ds_adabatch.initialize.
        geometry = measured_geometry(engine, configured_geometry(engine))
        schedule = self._state().controller.schedule
        if hasattr(schedule, "use_geometry"):
            schedule.use_geometry(geometry)
        return NoiseProbe.for_deepspeed(engine, geometry=geometry)

    def oom_recovery(self) -> OomRecovery | None:
        """Out-of-memory recovery on the DeepSpeed engine (built once it exists), or None."""
        state = self._state()
        engine = self.deepspeed_engine()
        if engine is None or not state.config.memory.recover_from_oom:
            return None
        if self.recovery is None or self.recovery_closed or self.recovery.deepspeed is not engine:
            self.close_recovery()
            self.recovery_closed = False
            # An unrecoverable error of this run is recorded in output_dir; the records imposed when the
            # batch state was built are deleted once a checkpoint holds them (runtime/memory/restart_record.py).
            records = self.restart_records
            if records is None:
                records = self.restart_records = RestartRecords(state.rank, state.config.memory.record_dir)
            self.recovery = OomRecovery(
                engine, state.config, rank=state.rank, world_size=state.world_size, memory=state.memory,
                records=records,
            )  # fmt: skip
            records.folder = self.trainer.args.output_dir
        return self.recovery

    def close_recovery(self) -> None:
        """Release the recovery's hooks; kept for inspection (its counts), the next step builds anew."""
        if self.recovery is not None and not self.recovery_closed:
            self.recovery.close()
        self.recovery_closed = True

    def new_run(self, state: AdaptiveBatchState, *, deepspeed: bool, output_dir: str) -> None:
        """A new batch state: the plan is applied afresh, and under DeepSpeed the restart records an
        exited process left in ``output_dir`` bound the first step's plan already (the recovery itself
        needs the engine, built later; ``runtime/memory/restart_record.py``)."""
        self.applied_plan = None
        self.restart_records = None
        if deepspeed and state.config.memory.recover_from_oom:
            records = self.restart_records = RestartRecords(state.rank, state.config.memory.record_dir)
            unit = "tokens" if state.token_budget else "samples"
            if records.record_dir is not None:
                records.start(state.memory, unit)
            records.impose(output_dir, state.memory, unit)

    def _state(self) -> AdaptiveBatchState:
        return self.trainer._require_state()

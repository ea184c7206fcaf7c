"""One optimizer step of ``AdaptiveBatchSizeTrainer``: every micro-batch of this rank, weighted exactly.

:class:`StepMixin` is mixed into the Trainer subclass and replaces what transformers 5.23 does inside
``Trainer._run_epoch`` for one update step. The step's micro-batches run with the accumulation boundary
(DeepSpeed) or gradient sync (DDP) on the last one only, each loss scaled so the update is the exact mean
over the global batch: ``loss x count x world / total``, with ``count`` and ``total`` the micro-batch's
and the global batch's samples, or target tokens (``labels != -100``) where the Trainer would normalise
by ``num_items_in_batch``.

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
from typing import Any

import torch

from ds_adabatch.runtime.initialize.weights import loss_weight
from ds_adabatch.runtime.memory.recovery import OomRecovery
from ds_adabatch.runtime.noise.adam_geometry import configured_geometry, measured_geometry
from ds_adabatch.runtime.noise.probe import NoiseProbe, update_estimator

from .data import StepInputs
from .engine import count_target_tokens, loss_shifts_labels

__all__ = ["StepMixin"]


class StepMixin:
    """The step of ``AdaptiveBatchSizeTrainer`` (see the module docstring); mixed into the Trainer."""

    # Provided by AdaptiveBatchSizeTrainer / transformers.Trainer.
    accelerator: Any
    args: Any
    state: Any
    model: Any
    optimizer: Any
    model_accepts_loss_kwargs: bool
    compute_loss_func: Any
    is_deepspeed_enabled: bool
    _lr_coupling: Any
    _recovery: OomRecovery | None
    _shifts_labels: bool | None
    _step_log: Any

    def _adaptive_step(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor:
        """One attempt at the step's micro-batches (``training_step`` without recovery)."""
        state = self._require_state()  # type: ignore[attr-defined]
        started = time.perf_counter()
        state.step_times.step_started()
        step = inputs.step
        self._apply_plan(step.plan)  # type: ignore[attr-defined]
        micro = step.micro_batches
        world, device = state.world_size, self.args.device
        by_token = self._normalizes_by_tokens(micro[0].batch)
        measure = state.should_measure_noise(self.state.global_step, step.plan)
        total: float | torch.Tensor = step.global_batch_size
        own: list[int] = []
        counts: list[int] = []
        step_tokens: int | torch.Tensor | None = None
        if by_token or state.counts_label_tokens:
            own = [self._count_items(m.batch) for m in micro]
            counts = [0 if m.is_pad else c for m, c in zip(micro, own)]
            # The step's one collective, as the Trainer's own gather of num_items_in_batch.
            step_tokens = state.sync.reduce([float(sum(counts))])[0]
            if by_token:
                # A global batch without targets updates nothing rather than dividing by zero.
                total = step_tokens.clamp(min=1.0)
                if measure:
                    total = float(total)  # the noise probe weighs on the host
        if state.token_budget:  # the step's tokens are its samples' lengths, known on every rank
            step_tokens = step.global_batch.tokens
        if step_tokens is not None:
            state.add_tokens(step_tokens)
        lr_used = None
        if self._lr_coupling is not None:
            # DeepSpeed steps its scheduler inside the boundary backward below; it must already count
            # this step's samples (and the epoch tails drop_last skips: the schedule runs with the
            # stream, so it ends with the epochs).
            self._lr_coupling.set_samples(state.stream_samples)
            lr_used = self._lr_coupling.get_lr()[0]
        passes_items = by_token and self._passes_num_items()
        logged = torch.zeros((), device=device)
        probe = self._noise_probe() if measure else None
        try:
            for i, mb in enumerate(micro):
                if self._recovery is not None:  # a new pass: its own out-of-memory agreement point
                    self._recovery.begin_pass(f"in micro-batch {i} of step {self.state.global_step}", index=i)
                items = None
                count = counts[i] if by_token else mb.num_samples
                if by_token:
                    # Whatever the model does with num_items_in_batch, its loss is this micro-batch's own
                    # mean over its target tokens (see _micro_backward); the weight makes it the mean
                    # over the global batch's tokens.
                    weight: float | torch.Tensor = count * world / total
                    factor = weight / (self._token_loss_scale() if passes_items else 1)
                    if passes_items:
                        items = torch.full((), max(own[i], 1), dtype=torch.long, device=device)
                else:
                    factor = weight = loss_weight(count, world, int(total))
                if probe is not None:
                    # The backward differentiates the micro-batch's own mean loss times this weight.
                    probe.begin(float(weight), 0 if mb.is_pad else mb.num_samples)
                sync = i == len(micro) - 1
                loss = self._micro_backward(model, mb.batch, factor, items, sync=sync, probe=probe)
                if count != 0:  # a micro-batch without targets may have a NaN mean
                    logged = logged + loss
        finally:
            if probe is not None:
                probe.close()
        if probe is not None and state.noise is not None:
            noise, batch, sq_big = state.noise, step.global_batch_size, probe.reduced_sq_norm()
            # The measured sums ride one all-reduce with whatever is queued (pending losses).
            state.sync.defer(probe.local_sums(), lambda sums: update_estimator(noise, sums, batch, sq_big))
            state.sync.reduce()
        if self._lr_coupling is not None:
            state.last_lr = lr_used
        # Throughput point: the step's time with its shape, for the goodput schedule (runtime.step_times).
        state.step_times.step_finished(step.plan, started, state.sync, retried=False)
        if self._step_log is not None:  # made when training starts (_prepare_for_training)
            self._step_log.step_done(
                completed=self.state.global_step + 1,
                plan=step.plan,
                lr=lr_used,
                lr_multiplier=1.0 if self._lr_coupling is None else self._lr_coupling.multiplier,
                started=started,
                logged=logged,
                step_tokens=step_tokens,
            )
        return logged

    def floating_point_ops(self, inputs: Any) -> int:
        """FLOPs of the step's real micro-batches (pads excluded)."""
        if not isinstance(inputs, StepInputs):
            return super().floating_point_ops(inputs)  # type: ignore[misc]
        count = super().floating_point_ops  # type: ignore[misc]  (a bare super() fails in a generator)
        return sum(count(m.batch) for m in inputs.micro_batches if not m.is_pad)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if not isinstance(inputs, StepInputs):
            return super()._track_num_input_tokens(inputs)  # type: ignore[misc]
        # transformers 5.23 gathers the count once per call: every rank calls once per micro-batch
        # (the same number everywhere), a pad with its tensors emptied so it counts 0.
        for m in inputs.micro_batches:
            batch = m.batch
            if m.is_pad and isinstance(batch, Mapping):
                batch = {k: v[:0] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            super()._track_num_input_tokens(batch)  # type: ignore[misc]
        return None

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
            inputs = self._prepare_inputs(batch)  # type: ignore[attr-defined]
            with self.compute_loss_context_manager():  # type: ignore[attr-defined]
                if items is None:
                    loss = self.compute_loss(model, inputs)  # type: ignore[attr-defined]
                else:
                    loss = self.compute_loss(model, inputs, num_items_in_batch=items)  # type: ignore[attr-defined]
            if isinstance(factor, torch.Tensor):
                # A device weight: at least float32, so a low-precision loss keeps the weight exact.
                factor = factor.to(torch.promote_types(loss.dtype, torch.float32))
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

    def _normalizes_by_tokens(self, batch: Any) -> bool:
        """Whether the step's mean is over target tokens (``labels != -100``) rather than samples.

        By default as the Trainer decides (transformers 5.23 ``Trainer._get_num_items_in_batch`` counts
        items when the batch has labels and the model takes loss kwargs or a ``compute_loss_func`` is
        set); ``adabatch.loss_normalization`` overrides it.
        """
        labelled = isinstance(batch, Mapping) and "labels" in batch
        mode = self._require_state().loss_normalization  # type: ignore[attr-defined]
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
            return self.accelerator.num_processes // self.get_tp_size()  # type: ignore[attr-defined]
        return 1

    def _noise_probe(self) -> NoiseProbe:
        """Hooks for one measured step on DeepSpeed's engine.

        Only an ``"adabatch"`` section can ask for the ``gradient_noise`` or ``goodput`` schedule, and the
        probe reads DeepSpeed's reduced gradients, so a measured step runs under DeepSpeed.
        """
        engine = self._deepspeed_engine()
        if engine is None:
            raise RuntimeError("the gradient-noise scale is measured under DeepSpeed only")
        # The geometry the optimizer allows ("auto": Adam's when it keeps a second moment); an unset
        # scale takes that geometry's default, as with ds_adabatch.initialize.
        geometry = measured_geometry(engine, configured_geometry(engine))
        schedule = self._require_state().controller.schedule  # type: ignore[attr-defined]
        if hasattr(schedule, "use_geometry"):
            schedule.use_geometry(geometry)
        return NoiseProbe.for_deepspeed(engine, geometry=geometry)

    def _deepspeed_engine(self) -> Any:
        # accelerate 1.15 keeps the engine it built in accelerator.deepspeed_engine_wrapped.engine.
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapped is None else wrapped.engine

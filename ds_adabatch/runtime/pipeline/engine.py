"""``AdaptivePipelineEngine``: DeepSpeed's ``PipelineEngine.train_batch`` at whatever batch the schedule wants.

One ``train_batch()`` is one optimizer step of the plan's global batch, planned on the data-parallel
size (world / (stages x tensor ranks)). Deciding, drawing and accounting a step is the step core's
(``runtime/core/step_core.py``), applying its plans is shared with the data-parallel engine
(``runtime/engine/base.py``); this class feeds the pipeline::

    draw      StepCore.draw: the sampler's next global batch, cut for this replica's data-parallel
              rank; the first and the last stage (every tensor rank of them) load the same
              micro-batches, the stages between only advance their sampler
    shape     a new micro-batch size -> reset_activation_shape() on every rank, before the same step
              (nothing with PipelineModule(dynamic_shape=True), which sends shapes per micro-batch)
    weights   each pass's (real rows, count x GAS x dp / total) queued for the wrapped loss_fn
    run       PipelineEngine.train_batch(iter(micro-batches)): GAS passes, reduce, optimizer step
    account   exact samples / tokens; the loss is DeepSpeed's aggregated loss (already the global
              mean on every stage), read every log.every_steps steps

A steady step issues nothing beyond DeepSpeed's own ``train_batch`` (with ``loss_normalization:
"token"`` one all-reduce of the step's token count).

Not available under pipelining (refused by :func:`ds_adabatch.initialize` with the reason): ZeRO 2/3
(DeepSpeed's), ``gradient_noise`` (a micro-batch's gradient is spread over the stages and only exists
reduced), out-of-memory recovery and ``max_micro_batch_per_gpu: "auto"`` (a stage that fails mid-schedule
leaves its neighbours blocked in point-to-point transfers), an ``IterableDataset`` and
``train_batch(data_iter)`` (the first and the last stage must see identical micro-batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...plan import BatchPlan
from ..core.loss import StepLoss
from ..engine.base import AdaptiveEngineBase
from .feed import WeightedPipelineLoss, check_pipeline_batch, pad_rows

__all__ = ["AdaptivePipelineEngine"]


class AdaptivePipelineEngine(AdaptiveEngineBase):
    """A DeepSpeed ``PipelineEngine`` whose global batch follows the ``"adabatch"`` schedule.

    Build it with :func:`ds_adabatch.initialize` from a ``PipelineModule``. Call :meth:`train_batch`
    once per optimizer step on every rank of every stage.
    """

    _plan_unit = "replica"  # plans count data-parallel replicas, each spread over the stages

    def __init__(self, ds_engine: Any, *, loss_fn: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(ds_engine, loss_fn=loss_fn, **kwargs)

    def _bind(self, ds_engine: Any, **world: Any) -> None:
        """The base's binding (``AdaptiveEngineBase._bind``) for the pipeline's data-parallel size, with
        the user's loss wrapped on the last stage and the shapes the stages exchange."""
        grid = ds_engine.grid
        last = ds_engine.is_last_stage()
        self._weighted_loss = WeightedPipelineLoss(
            self.loss_fn, by_token=world["loaded_config"].adabatch.loss_normalization == "token"
        )
        # DeepSpeed 0.19.8 calls module.loss_fn(outputs, labels) in _exec_forward_pass on the last stage.
        ds_engine.module.loss_fn = self._weighted_loss
        self._rows: int | None = None  # the micro-batch DeepSpeed's cached activation shapes hold
        self._dynamic = bool(ds_engine.dynamic_shape)
        super()._bind(
            ds_engine,
            world_size=grid.data_parallel_size,
            # One rank per replica counts: the last stage (it has the labels), tensor rank 0.
            counts_here=last and grid.get_slice_parallel_rank() == 0,
            recovers_from_oom=False,
            **world,
        )
        self._first, self._last = ds_engine.is_first_stage(), last
        self._feeds = self._first or self._last
        self.by_token = self.config.loss_normalization == "token"
        self._input_dtype = _compute_dtype(ds_engine)
        self._input_shapes: tuple | None = None
        self._pending: list[tuple[torch.Tensor, Any, Any]] = []  # (loss, grad norm, resolve)

    # ---------------------------------------------------------------------------------------------
    # Layout
    @property
    def num_stages(self) -> int:
        return self.deepspeed.num_stages

    @property
    def stage_id(self) -> int:
        return self.deepspeed.stage_id

    def _apply_shape(self, plan: BatchPlan) -> None:
        super()._apply_shape(plan)  # PipelineEngine.set_train_batch_size re-caches micro_batches
        ds = self.deepspeed
        rows = plan.micro_batch_per_gpu
        # PipelineEngine caches these at construction only (0.19.8).
        ds.micro_batch_size = rows
        ds.batch_timer.batch_size = plan.global_batch_size
        if not self._dynamic and rows != self._rows:
            # The stages exchanged activation and gradient shapes once; every rank of the pipe resets
            # them before the same step (the plan is the same everywhere), so the next step exchanges
            # the new shapes. Without it a larger micro-batch aborts in the transport and a smaller one
            # computes on a stale row of the old buffer.
            if self._rows is not None:
                ds.reset_activation_shape()
            self._rows = rows

    # ---------------------------------------------------------------------------------------------
    # One optimizer step
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> StepLoss:
        """Run exactly one optimizer step of the global batch on every stage; return its mean loss.

        Call it on every rank of every stage. The step takes the sampler's next global batch of exactly
        ``plan.global_batch_size`` samples (fewer only for the last batch of an epoch). The returned
        :class:`~ds_adabatch.runtime.StepLoss` is the same on every rank; it is DeepSpeed's aggregated
        loss, so reading it is a host read, not a collective.
        """
        if data_iter is not None:
            raise ValueError(
                "under pipeline parallelism the engine feeds the pipeline from training_data itself (the "
                "first and the last stage must load identical micro-batches): call train_batch() "
                "without data_iter"
            )
        started = time.perf_counter()
        self.next_plan()
        lr_used = self.lr_coupling.get_lr()[0]
        drawn = self.core.draw(self.dataloader, self.plan, load=self._feeds)  # the stages between: no load
        if drawn.tail is not None:  # the epoch's smaller last batch: its LR multiplier applies
            self._apply_plan(drawn.tail, reason="last batch of the epoch", record=True)
            lr_used = self.lr_coupling.get_lr()[0]
        step_batch = drawn.step
        plan = self.plan
        total_samples = plan.global_batch_size
        micro = step_batch.micro_batches
        counts = [m.num_samples for m in micro]
        tokens = 0
        total = total_samples
        if self.counts_tokens:
            # Target tokens are counted on the last stage's labels (real rows only); one collective
            # sums the replicas.
            mine = [self.count_tokens(m.batch) if m.num_samples else 0 for m in micro] if self._last else []
            summed = self.step_sync.reduce([float(sum(mine)) if self.counts_here else 0.0])
            tokens = int(summed[0])
            if self.by_token:
                counts, total = mine, tokens
        if total <= 0:
            raise ValueError("the global batch has no samples (or no target tokens) to train on")
        items = [self._prepare(m.batch, plan) for m in micro] if self._feeds else []
        if self._last:
            factor = plan.gradient_accumulation_steps * self.world_size / total
            self._weighted_loss.expect([(m.num_samples, c, c * factor) for m, c in zip(micro, counts)])
        # DeepSpeed steps the LR scheduler inside the optimizer step: in "samples" mode it must
        # already see the samples this step consumes.
        self.lr_coupling.set_samples(self.global_samples + total_samples)
        step = self.global_steps
        agg = self.deepspeed.train_batch(data_iter=iter(items) if self._feeds else None)
        self._finish_step(total_samples, tokens)
        loss, resolved, norm = self._record_step(step, started, lr_used)
        self._pending.append((agg, norm, resolved))
        if self.global_steps % self._every_steps == 0:
            self.resolve_losses()
        return loss

    def _prepare(self, batch: Any, plan: BatchPlan) -> Any:
        check_pipeline_batch(batch)
        if not self._dynamic:
            batch = pad_rows(batch, plan.micro_batch_per_gpu)
        if self._first:
            inputs = batch[0]
            if self._input_dtype is not None:
                inputs = _cast_floating(inputs, self._input_dtype)
            if not self._dynamic:
                self._check_shapes(inputs)
            batch = (inputs, batch[1])
        return batch

    def _check_shapes(self, inputs: Any) -> None:
        # Dimensions other than the batch's must stay what the stages exchanged (DeepSpeed sends shapes
        # once per micro-batch size without dynamic_shape).
        shapes = tuple(t.shape[1:] for t in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        if self._input_shapes is None:
            self._input_shapes = shapes
        elif shapes != self._input_shapes:
            raise ValueError(
                f"the pipeline's input shapes changed from {self._input_shapes} to {shapes} (beyond the "
                "batch dimension): build the PipelineModule with dynamic_shape=True so DeepSpeed sends "
                "activation shapes with every micro-batch"
            )

    def count_tokens(self, batch: Any) -> int:
        check_pipeline_batch(batch)
        return int(self.token_count_fn(batch))

    def resolve_losses(self) -> None:
        """Read every pending step's loss now (DeepSpeed's aggregated loss: one host read, no collective).

        Afterwards every :class:`StepLoss` returned so far reads without waiting, and the JSONL and
        monitor records of those steps are written. Call it on every rank, as with the other engine.
        """
        self.step_sync.reduce()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # Every pending loss and grad norm in one host read.
        tensors = [t for loss, norm, _ in pending for t in (loss, norm) if isinstance(t, torch.Tensor)]
        values = iter(torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist())
        for _, norm, resolved in pending:
            mean = next(values)
            grad_norm = (
                next(values) if isinstance(norm, torch.Tensor) else None if norm is None else float(norm)
            )
            resolved(mean, grad_norm)


def _compute_dtype(ds_engine: Any) -> torch.dtype | None:
    """The dtype the first stage's floating inputs must have (DeepSpeed does not cast them)."""
    if ds_engine.bfloat16_enabled():
        return torch.bfloat16
    if ds_engine.fp16_enabled():
        return torch.float16
    return None


def _cast_floating(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    return type(inputs)(_cast_floating(t, dtype) for t in inputs)

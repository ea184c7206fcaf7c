"""``AdaptiveBatchEngine``: one ``train_batch()`` = one optimizer step, at whatever batch the schedule wants.

The data-parallel engine (ZeRO 0-3; with DeepSpeed's ``mpu``, tensor parallelism inside each replica).
Deciding, drawing and accounting a step is the step core's (``runtime/core/step_core.py``), applying
its plans is shared with the pipeline engine (:mod:`.base`); this class runs the passes (every rank in
lockstep)::

    draw      StepCore.draw: the sampler's next global batch, cut for this rank (pads where a rank has
              nothing); an epoch's tail re-planned, a noise-measured single pass split in two
    totals    the global batch's samples come from the sampler; token counts (or a user iterator's
              sizes) are summed over replicas in the step's one collective
    for each micro-batch:
              set_gradient_accumulation_boundary(last)   # DeepSpeed's micro_steps counter is not used
              loss = loss_fn(engine, batch)               # mean over the micro-batch
              backward(loss * count * W / total, scale_wrt_gas=False)
              step()                                      # DeepSpeed updates only on the boundary
    account   the step's loss sum stays on the device until the next collective or every
              log.every_steps steps (StepSync), then metrics are written; under the goodput schedule
              the step's time is queued there too (step_times.py: started at fetch, finished here)

A steady step (map-style data, sample normalisation, no change of batch, no noise measurement) issues no
collective and no host synchronisation beyond DeepSpeed's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...plan import BatchPlan
from ..core.loss import StepLoss
from ..core.passes import StepPasses
from ..core.weights import loss_of
from ..memory.recovery import replan_after_oom, replan_token_step_after_oom, resplit_micro_batches
from ..noise.probe import NoiseProbe, update_estimator
from .base import AdaptiveEngineBase
from .loop import ForwardBackwardLoop, LoopStepHooks

if TYPE_CHECKING:
    from ...data.loader import StepBatch

__all__ = ["AdaptiveBatchEngine"]


class AdaptiveBatchEngine(AdaptiveEngineBase):
    """A DeepSpeed engine whose global batch follows the ``"adabatch"`` schedule.

    Build it with :func:`ds_adabatch.initialize`. Call :meth:`train_batch` once per optimizer step, or
    run DeepSpeed's forward / backward / step loop over the loader ``initialize`` returns (the engine's
    :class:`~ds_adabatch.runtime.engine.loop.ForwardBackwardLoop`, ``loop``).
    """

    def __init__(self, ds_engine: Any, **kwargs: Any) -> None:
        kwargs.setdefault("world_size", ds_engine.dp_world_size)
        super().__init__(ds_engine, **kwargs)
        # The forward / backward / step loop (loop.py): its step in progress; our parts of its steps. It
        # lasts the run (the loader initialize returned hands out its micro-batches).
        self.loop = ForwardBackwardLoop(
            self,
            LoopStepHooks(open=self._open_loop_step, passes=self._loop_passes, complete=self._complete_step),
        )

    def _bind(self, ds_engine: Any, **world: Any) -> None:
        """The base's binding (``AdaptiveEngineBase._bind``), and the noise probe of this DeepSpeed engine."""
        super()._bind(ds_engine, **world)
        self._probe: NoiseProbe | None = None  # its hooks go on this DeepSpeed engine's parameters
        self._unsplit_plan: BatchPlan | None = None  # the plan a noise-measured step was split from
        self.by_token = self.config.loss_normalization == "token"

    # ---------------------------------------------------------------------------------------------
    # The forward / backward / step loop (loop.py runs it; these are DeepSpeed's names for it)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped engine's forward; inside a loop step an out-of-memory error is recorded for the
        restart (``loop.py``)."""
        return self.loop.forward(*args, **kwargs)

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """DeepSpeed's ``backward`` for the micro-batch the loader handed out last, weighted so the step's
        update is the exact mean over its global batch (``scale_wrt_gas`` is ignored: the weight
        replaces DeepSpeed's ``1 / GAS``). ``loss`` is the mean over the micro-batch (a criterion's
        default ``reduction="mean"``); for a pad it is weighted 0."""
        return self.loop.backward(loss, retain_graph=retain_graph)

    def step(self, lr_kwargs: Any = None) -> None:
        """DeepSpeed's ``step`` for the micro-batch handed out last: the optimizer step after the plan's
        last micro-batch, a micro-step otherwise. After the optimizer step the step is counted and
        recorded, and the next plan takes effect at the loader's next micro-batch."""
        self.loop.step(lr_kwargs=lr_kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch handed out last (or, between micro-batches, the next one) ends the
        optimizer step. Between optimizer steps the next plan is not decided yet: True when the current
        plan has one micro-batch per step."""
        return self.loop.is_boundary()

    def _before_load(self) -> None:
        self.loop.before_load()  # refused inside a loop step (its partial gradients)

    def _data_state(self) -> Any:
        """The loader's state; inside a step of the loop, as it was before that step (a resume trains the
        step again from its start; partial gradients are not saved)."""
        if self.loop.in_progress is not None:
            return self.loop.data_state()
        return super()._data_state()

    def _open_loop_step(self) -> tuple[StepBatch, dict[str, Any], bool]:
        """A loop step begins: its plan decided, the loader's state before it, its global batch taken."""
        self._step_times.step_started()
        self.next_plan()
        data_state = self.dataloader.state_dict()
        measure = self._should_measure_noise(from_loader=True)
        return self._take_step_batch(split=measure), data_state, measure

    def _loop_passes(
        self, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool
    ) -> StepPasses:
        """The passes of a loop step, at its first micro-batch."""
        self._step_ooms = 0
        return StepPasses(self, micro, total_samples, measure)

    # ---------------------------------------------------------------------------------------------
    # One optimizer step
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> StepLoss:
        """Run exactly one optimizer step; return its mean loss over the global batch.

        Without ``data_iter`` the step takes the sampler's next global batch of exactly
        ``plan.global_batch_size`` samples (fewer only for the last batch of an epoch). With
        ``data_iter``, ``plan.gradient_accumulation_steps`` micro-batches are drawn from it; their real
        sizes (the first dimension) are summed over ranks and weighted, so the update is still the exact
        mean.

        The returned :class:`~ds_adabatch.runtime.StepLoss` is the same on every rank. It is resolved
        every ``adabatch.log.every_steps`` steps without extra cost; reading it sooner (``float(loss)``)
        resolves it at once, which is a collective: read it on every rank.

        With ``adabatch.live_elastic`` on, a step in which a peer is lost is trained again on the
        survivors (after rolling back to the newest snapshot) before this returns: drive the training
        loop by ``engine.global_steps`` / ``global_samples``, which may go back by up to
        ``snapshot_every`` steps across such a call.
        """
        if self.loop.in_progress is not None:
            raise RuntimeError(
                "train_batch() while the forward / backward / step loop is inside an optimizer step: "
                "finish that step (engine.step() after its last micro-batch) or use one way of stepping"
            )
        live = self._live_recovery
        if live is not None and data_iter is None:
            # A lost peer is recovered inside: the step runs again on the survivors (live_recovery.py).
            return live.run_step(self._train_one_batch)
        return self._train_one_batch(data_iter)

    def _train_one_batch(self, data_iter: Iterator[Any] | None = None) -> StepLoss:
        started = time.perf_counter()
        self._step_times.step_started()
        self.next_plan()
        measure = self._should_measure_noise(from_loader=data_iter is None)
        lr_used = self.lr_coupling.get_lr()[0]

        if data_iter is None:
            if self.dataloader is None:
                raise ValueError(
                    "train_batch() needs data: pass training_data to ds_adabatch.initialize, or call "
                    "train_batch(data_iter) with an iterator of micro-batches"
                )
            planned = self.plan
            step_batch = self._take_step_batch(split=measure)
            if self.plan is not planned:  # the epoch tail was re-planned: its LR multiplier applies
                lr_used = self.lr_coupling.get_lr()[0]
            micro = [(m.batch, m.num_samples) for m in step_batch.micro_batches]
            # An iterable dataset has no global view: the step's collective counts its samples.
            total_samples = step_batch.global_batch.size if step_batch.global_batch is not None else None
        else:
            if self.token_budget:
                raise ValueError(
                    "token-budget steps (adabatch.micro_batch_tokens) form micro-batches from the "
                    "training data: pass training_data and lengths to ds_adabatch.initialize and call "
                    "train_batch() without data_iter"
                )
            micro = [next(data_iter) for _ in range(self.plan.gradient_accumulation_steps)]
            micro = [(b, _leading_dim(b)) for b in micro]
            total_samples = None

        step = self.global_steps
        self._step_ooms = 0
        if self.memory_recovery.armed:
            results = self._recovering_step(micro, total_samples, measure, data_iter is None)
        else:
            results = self._forward_backward(micro, total_samples, measure)
        return self._complete_step(step, started, lr_used, results)

    def _take_step_batch(self, split: bool = False) -> StepBatch:
        """The core's draw of the step (``StepCore.draw``), its plans applied: an epoch's tail re-planned;
        with ``split`` (a noise measurement is due) a step of one pass in total runs as two half passes
        (the same samples and update) so a pass's gradient can be compared with the step's
        (noise/probe.py, NoiseCadence); the plan is restored after the step (_complete_step)."""
        drawn = self.core.draw(self.dataloader, self.plan, split=split)
        if drawn.tail is not None:
            self._apply_plan(drawn.tail, reason="last batch of the epoch", record=True)
        if drawn.split is not None:
            self._unsplit_plan = drawn.restore
            self._apply_plan(drawn.split, reason="noise measurement", record=False)
        return drawn.step

    def _complete_step(self, step: int, started: float, lr_used: float, results: tuple[Any, ...]) -> StepLoss:
        """Account a step whose passes ran (``StepPasses.result()``): counts, signals, its record, its loss."""
        loss_sum, tokens, total_samples, total, probe_sums = results
        sync = self.step_sync
        # Throughput point: the step's time, with the shape it ran (before the next plan), is queued
        # for the step's collective and reaches the goodput schedule's model (step_times.py).
        split, self._unsplit_plan = self._unsplit_plan, None
        self._step_times.step_finished(
            self.plan,
            started,
            sync,
            retried=self._step_ooms > 0,
            measuring=split is not None,
            step=self.last_step_batch,
        )
        if split is not None and not self._step_ooms:  # back to the plan the step was split from
            self._apply_plan(split, reason="noise measurement", record=False)
        self._finish_step(total_samples, tokens, count_memory=split is None)
        if split is not None:
            self.extend_next_record({"noise_split_passes": 2.0})
        # The previous step's measurement: its all-reduce (issued below, one step ago) has overlapped
        # this step's work, and it reaches the schedule before the next decision.
        sync.complete()
        if probe_sums is not None:
            sync.defer(probe_sums[0], self._noise_callback(total_samples, probe_sums[1]))
        loss, resolved, norm = self._record_step(step, started, lr_used)
        sync.defer(
            [loss_sum], lambda sums: resolved(float(sums[0]) / total, None if norm is None else float(norm))
        )
        if self.global_steps % self._every_steps == 0:
            sync.reduce()
        elif probe_sums is not None and not self.counts_tokens:
            # Measured noise sums ride the next step's collective when every step has one (token
            # counts); otherwise their all-reduce (with the pending losses) is issued now and waited
            # for at the end of the next step, so a measurement reaches the schedule one step later.
            sync.reduce_later()
        return loss

    def _recovering_step(
        self, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool, from_loader: bool
    ) -> tuple[torch.Tensor, int, int, int, Any]:
        """The step's passes under armed out-of-memory recovery (recovery.py): an agreed OOM discards
        the partial step, lowers the micro-batch limit and re-runs the same samples, cut anew."""
        current = {"micro": micro, "step": self.last_step_batch if from_loader else None}

        def replan(ranks: list[int]) -> None:
            plan = self._replan_after_oom(ranks)
            if current["step"] is not None:  # the same samples, cut anew by the core
                batch = current["step"] = self.core.recut(self.dataloader, current["step"], plan)
                current["micro"] = [(m.batch, m.num_samples) for m in batch.micro_batches]
            else:
                current["micro"] = resplit_micro_batches(current["micro"], plan.gradient_accumulation_steps)

        return self.memory_recovery.run(
            lambda: self._forward_backward(current["micro"], total_samples, measure), replan
        )

    def _forward_backward(
        self, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool
    ) -> tuple[torch.Tensor, int, int, int, Any]:
        ds = self.deepspeed
        device = ds.device
        passes = StepPasses(self, micro, total_samples, measure)
        recovery = self.memory_recovery
        armed = recovery.armed
        try:
            for i, (batch, _) in enumerate(micro):
                if armed:
                    recovery.begin_pass(f"in micro-batch {i} of step {self.global_steps}", index=i)
                passes.set_boundary(i)
                counted = passes.counts[i] if self.by_token and passes.counts[i] else None
                passes.backward(i, self._micro_loss(_to_device(batch, device), counted))
                if i == passes.last and armed:
                    recovery.begin_optimizer_step(self.global_steps)
                passes.step(i)  # DeepSpeed updates only on the boundary
        finally:
            passes.close()
        return passes.result()

    def _micro_loss(self, batch: Any, counted: int | None) -> torch.Tensor:
        if self.loss_fn is not None:
            # (mean loss, num_tokens): the count is checked against the one the weights were built from
            out = loss_of(self.loss_fn(self, batch), counted, "loss_fn")
        else:
            if not isinstance(batch, dict):
                raise TypeError(
                    f"without loss_fn a batch must be a dict for model(**batch).loss, got {type(batch).__name__}; "
                    "pass loss_fn=lambda model, batch: ... to ds_adabatch.initialize"
                )
            out = self(**batch).loss
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor: the mean loss over the micro-batch")
        return out

    def count_tokens(self, batch: Any) -> int:
        if self.token_count_fn is None:
            raise ValueError(
                'counting tokens (loss_normalization "token" or a tokens-keyed schedule) needs '
                "token_count_fn passed to ds_adabatch.initialize"
            )
        return int(self.token_count_fn(batch))

    def _replan_after_oom(self, ranks: list[int]) -> BatchPlan:
        """Every rank agreed that ``ranks`` ran out of memory: the same global batch, smaller micro-batches."""
        if self.token_budget:  # the same samples, cut with a lower token budget (data/tokens.py)
            step, reason, line = replan_token_step_after_oom(
                self.memory_recovery.memory,
                self.dataloader.sampler,
                self.last_step_batch.global_batch,
                self.memory_recovery.failed_passes(ranks),
                self.global_steps,
            )
            plan = step.plan(self.dataloader.sampler.max_micro_batch)
        else:
            plan, reason, line = replan_after_oom(
                self.memory_recovery.memory, self.plan, ranks, self.global_steps, self.config.allow_uneven
            )
        self._step_ooms += 1
        self._apply_plan(plan, reason=reason, record=True, line=line)
        return plan

    # ---------------------------------------------------------------------------------------------
    # Gradient-noise scale
    def start_noise_probe(self) -> NoiseProbe:
        """The run's probe, in the resolved geometry, started for one measured step (its hooks are
        registered once and stay, idle between measured steps)."""
        if self._probe is None:
            self._probe = NoiseProbe.for_deepspeed(self.deepspeed, geometry=self._noise_geometry)
        else:
            self._probe.start()
        return self._probe

    def _should_measure_noise(self, from_loader: bool = False) -> bool:
        """Whether this step measures the noise scale; ``from_loader``: its samples come from the
        sampler, so a single-pass step can be split in two for it (_take_step_batch)."""
        can_split = from_loader and self.dataloader is not None and self.plan.global_batch_size >= 2
        return self.core.attach.noise_cadence.due(
            self.global_steps,
            self.world_size,
            self.plan.gradient_accumulation_steps,
            can_split=can_split,
            split_cost=self._split_cost,
        )

    def _split_cost(self) -> float | None:
        """What a step split in two half passes costs more than the whole step (a fraction), as the
        goodput schedule's throughput model predicts it; None without one (or before it measured)."""
        model = self._step_times.model
        if model is None:
            return None
        size = self.plan.global_batch_size
        # The shapes the model keys them by (step_times.step_shape): a token-budget step's is its budget.
        micro, half = (self.micro_batch_limit,) * 2 if self.token_budget else (size, -(-size // 2))
        whole = model.predict(micro, 1, 1)
        split = model.predict_measuring(half, 2, 1)
        if whole is None or split is None or not whole > 0:
            return None
        return max(0.0, split / whole - 1.0)

    def _noise_callback(
        self, total_samples: int, sq_big: Callable[[], float | None]
    ) -> Callable[[list[torch.Tensor]], None]:
        def fold(sums: list[torch.Tensor]) -> None:
            update_estimator(self.noise, sums, total_samples, sq_big())

        return fold

    def release_deepspeed(self) -> None:
        if self._probe is not None:
            self._probe.close()  # its hooks are on the failed engine's parameters
            self._probe = None
        super().release_deepspeed()

    def close(self) -> None:
        """Resolve pending losses (a collective: call on every rank), stop data workers, close the metrics file."""
        super().close()
        if self._probe is not None:
            self._probe.close()
            self._probe = None


def _leading_dim(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _leading_dim(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _leading_dim(batch[0])
    raise TypeError(f"cannot tell the number of samples in a micro-batch of type {type(batch).__name__}")


def _to_device(batch: Any, device: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch

"""DeepSpeed's forward / backward / step loop, at whatever batch the schedule wants.

The loop of DeepSpeed's getting-started tutorial runs unchanged over the loader that
:func:`ds_adabatch.initialize` returns for ``training_data``::

    for inputs, labels in loader:          # this rank's micro-batches of the current plan
        loss = criterion(engine(inputs), labels)   # the mean over the micro-batch
        engine.backward(loss)              # weighted: count x W / total of the global batch
        engine.step()                      # the optimizer step after the plan's last micro-batch

How it stays exact. The loader and the engine share one step in progress (:class:`LoopStep`). When the
loader needs a new step it decides the plan (``engine.next_plan()``), takes the sampler's next global
batch cut for this rank, and hands out its micro-batches one by one; before each it sets DeepSpeed's
accumulation boundary explicitly (DeepSpeed's own ``micro_steps % GAS`` rule breaks when GAS changes).
``engine.backward(loss)`` weights the micro-batch exactly as ``train_batch`` does (:mod:`.passes`); the
``engine.step()`` after the last micro-batch is DeepSpeed's optimizer step, then the step is counted,
recorded and the next plan takes effect at the loader's next micro-batch. Pads (a rank without a sample
in a step) are handed out too and weighted 0, so every rank runs the same passes.

One ``for`` over the loader is one epoch: it ends after the step that completes the epoch's sample
stream (a batch never spans two epochs). Leaving the loop early and iterating again continues the step in
progress. ``len(loader)`` counts the micro-batches left in the epoch at the current plan (an estimate
while the schedule changes the batch).

Out of memory. The loop's forward runs in the caller's code, between our calls, so a pass that runs out
of memory cannot be re-planned inside the step as ``train_batch`` does: an out-of-memory error raised in
``engine(x)``, ``engine.backward`` or ``engine.step`` becomes :class:`UnrecoverableOutOfMemory`, with the
failed pass's size recorded next to the checkpoints (exit code 75, :mod:`.restart_record`) so a restart
(``torchrun --max-restarts``) resumes from the last checkpoint below it.

Batches that did not come from this loader (your own ``DataLoader``, ``engine.deepspeed_io``) cannot be
weighted for a plan DeepSpeed's loader does not follow: ``engine.backward`` refuses them with the way out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from ..core.passes import StepPasses
from ..memory.oom import UnrecoverableOutOfMemory, is_out_of_memory
from ..memory.recovery import optimizer_step_oom

__all__ = ["LoopDataLoader", "LoopMixin", "LoopStep"]


class LoopStep:
    """The optimizer step the forward / backward / step loop is in (one per step)."""

    def __init__(self, step_batch: Any, data_state: Any, started: float, step: int) -> None:
        self.step_batch = step_batch
        self.micro = [(m.batch, m.num_samples) for m in step_batch.micro_batches]
        self.epoch = step_batch.epoch
        self.data_state = data_state  # the loader's state before this step: a checkpoint resumes here
        self.started = started
        self.step = step
        self.passes: StepPasses | None = None
        self.measure = False  # whether the step measures the noise scale (decided with its batch)
        self.lr_used = 0.0
        self.next_index = 0  # the next micro-batch to hand out
        self.current: int | None = None  # handed out, not yet stepped
        self.backward_done = False

    @property
    def last(self) -> int:
        return len(self.micro) - 1


class LoopDataLoader:
    """The loader ``initialize(..., training_data=...)`` returns: iterate it for the forward / backward /
    step loop (see the module docstring). Everything else is the engine's current
    :class:`~ds_adabatch.data.ElasticDataLoader` (``next_step``, ``sampler``, ``state_dict``, ...): after a
    live recovery rebuilt it for the smaller world, this object reads the new one."""

    engine: Any = None  # a class default, so __getattr__ never runs for it

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def loader(self) -> Any:
        """The engine's loader for this rank of the current world."""
        return self.engine.dataloader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        return _EpochIterator(self.engine)

    def __len__(self) -> int:
        """Micro-batches this rank is handed in the rest of the epoch if the current plan held."""
        engine, loader = self.engine, self.loader
        sampler = getattr(loader, "sampler", None)
        if sampler is None or not hasattr(sampler, "position"):
            raise TypeError("the length of an IterableDataset's stream is unknown")
        loop = engine._loop
        left = sampler.num_samples - sampler.position
        if left == 0 or sampler.train_coverage >= 1.0:
            left = sampler.num_samples
        plan = engine.plan
        steps = (
            left // plan.global_batch_size if sampler.drop_last else math.ceil(left / plan.global_batch_size)
        )
        in_progress = len(loop.micro) - loop.next_index if loop is not None else 0
        return steps * plan.gradient_accumulation_steps + in_progress

    def __repr__(self) -> str:
        return f"LoopDataLoader({self.loader!r})"


class _EpochIterator:
    """One epoch of this rank's micro-batches (one ``for`` over :class:`LoopDataLoader`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.epoch: int | None = None  # the epoch this iteration hands out

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        engine = self.engine
        loop = engine._loop
        if loop is not None and loop.current is not None:
            raise RuntimeError(
                "the loader's next micro-batch was asked for before engine.step() of the previous one: "
                "run engine(x), engine.backward(loss) and engine.step() for every micro-batch it hands out"
            )
        if loop is None or loop.next_index > loop.last:
            if self.epoch is not None and _epoch_complete(engine.dataloader):
                raise StopIteration
            loop = engine._begin_loop_step()
        if self.epoch is None:
            self.epoch = loop.epoch
        elif loop.epoch != self.epoch and loop.next_index == 0:
            # A batch of the next epoch (after a drop_last remainder): it opens the next iteration.
            raise StopIteration
        return engine._hand_out(loop)


def _epoch_complete(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    coverage = getattr(sampler, "train_coverage", None)
    return coverage is not None and coverage >= 1.0


class LoopMixin:
    """``backward``, ``step`` and ``is_gradient_accumulation_boundary`` of the loop (mixed into the
    data-parallel engine); see the module docstring."""

    _loop: LoopStep | None = None

    # -- the loader's side ---------------------------------------------------------------------------
    def _begin_loop_step(self) -> LoopStep:
        """Decide the next plan, take its global batch and make it the step in progress."""
        started = time.perf_counter()
        self._step_times.step_started()
        self.next_plan()
        data_state = self.dataloader.state_dict()
        measure = self._should_measure_noise(from_loader=True)
        step_batch = self._take_step_batch(split=measure)
        loop = LoopStep(step_batch, data_state, started, self.global_steps)
        loop.measure = measure
        self._loop = loop
        return loop

    def _hand_out(self, loop: LoopStep) -> Any:
        index = loop.next_index
        if loop.passes is None:  # the step's totals, its LR samples and its probe, at its first pass
            self._step_ooms = 0
            measure = loop.measure
            loop.lr_used = self.lr_coupling.get_lr()[0]
            global_batch = loop.step_batch.global_batch
            total = global_batch.size if global_batch is not None else None
            loop.passes = StepPasses(self, loop.micro, total, measure)
        recovery = self.memory_recovery
        if recovery.armed:
            recovery.begin_pass(f"in micro-batch {index} of step {self.global_steps}", index=index)
        loop.passes.set_boundary(index)
        loop.current, loop.next_index, loop.backward_done = index, index + 1, False
        return loop.micro[index][0]

    # -- the engine's side ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped engine's forward; inside a loop step an out-of-memory error is recorded for the
        restart (module docstring)."""
        loop = self._loop
        if loop is None or loop.current is None:
            return self.deepspeed(*args, **kwargs)
        try:
            return self.deepspeed(*args, **kwargs)
        except Exception as exc:
            self._loop_out_of_memory(loop, exc, "forward")
            raise

    def _loop_out_of_memory(self, loop: LoopStep, exc: Exception, phase: str) -> None:
        """Raise :class:`UnrecoverableOutOfMemory` for an out-of-memory ``exc`` in the loop, recorded."""
        if not is_out_of_memory(exc) or isinstance(exc, UnrecoverableOutOfMemory):
            return
        index = loop.current if loop.current is not None else loop.last
        if phase == "optimizer step":
            where = f"in the optimizer step of step {self.global_steps}"
            raise optimizer_step_oom(self.deepspeed, self.global_rank, where) from exc
        where = f"in the {phase} of micro-batch {index} of step {self.global_steps}"
        error = UnrecoverableOutOfMemory(
            f"out of memory on rank {self.global_rank} {where} (forward / backward / step loop): the loop's "
            "passes run in your code, so the step cannot be re-planned in place as engine.train_batch() "
            "does"
        )
        recovery = self.memory_recovery
        recovery.where = where
        predictor = recovery.predictor
        size = predictor.pass_size if predictor is not None else None  # the limit's unit
        if not size and not self.token_budget:
            size = loop.micro[index][1]
        recovery.records.record(error, recovery.memory.key, size or recovery.memory.limit, where=where)
        raise error from exc

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """DeepSpeed's ``backward`` for the micro-batch the loader handed out last, weighted so the step's
        update is the exact mean over its global batch (``scale_wrt_gas`` is ignored: the weight
        replaces DeepSpeed's ``1 / GAS``). ``loss`` is the mean over the micro-batch (a criterion's
        default ``reduction="mean"``); for a pad it is weighted 0."""
        loop = self._current_loop("backward")
        if loop.backward_done:
            raise RuntimeError(
                "engine.backward() was called twice for one micro-batch: call engine.step() after it"
            )
        try:
            out = loop.passes.backward(loop.current, loss, retain_graph=retain_graph)
        except Exception as exc:
            self._loop_out_of_memory(loop, exc, "backward")
            raise
        loop.backward_done = True
        return out

    def step(self, lr_kwargs: Any = None) -> None:
        """DeepSpeed's ``step`` for the micro-batch handed out last: the optimizer step after the plan's
        last micro-batch, a micro-step otherwise. After the optimizer step the step is counted and
        recorded, and the next plan takes effect at the loader's next micro-batch."""
        loop = self._current_loop("step")
        if not loop.backward_done:
            raise RuntimeError(
                "engine.step() before engine.backward() of the micro-batch: call backward first"
            )
        last = loop.current == loop.last
        recovery = self.memory_recovery
        if last and recovery.armed:
            recovery.begin_optimizer_step(self.global_steps)
        try:
            loop.passes.step(loop.current, lr_kwargs)
        except Exception as exc:
            self._loop_out_of_memory(loop, exc, "optimizer step" if last else "step")
            raise
        loop.current = None
        if not last:
            return
        passes = loop.passes
        passes.close()
        self._loop = None
        self._complete_step(loop.step, loop.started, loop.lr_used, passes.result())

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch handed out last (or, between micro-batches, the next one) ends the
        optimizer step. Between optimizer steps the next plan is not decided yet: True when the current
        plan has one micro-batch per step."""
        loop = self._loop
        if loop is None:
            return self.plan.gradient_accumulation_steps == 1
        index = loop.current if loop.current is not None else loop.next_index
        return index == loop.last

    def _current_loop(self, verb: str) -> LoopStep:
        loop = self._loop
        if loop is None or loop.current is None:
            raise RuntimeError(
                f"engine.{verb}() needs a micro-batch from the loader ds_adabatch.initialize returned: "
                "a batch of your own DataLoader (or of engine.deepspeed_io) has the size of one plan, "
                "and this engine changes the plan between optimizer steps. Iterate the loader returned by "
                "initialize(..., training_data=dataset) — `for batch in loader: loss = ...; "
                "engine.backward(loss); engine.step()` — or call engine.train_batch() once per step"
            )
        return loop

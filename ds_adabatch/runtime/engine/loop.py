"""DeepSpeed's forward / backward / step loop, at whatever batch the schedule wants.

The loop of DeepSpeed's getting-started tutorial runs unchanged over the loader that
:func:`ds_adabatch.initialize` returns for ``training_data``::

    for inputs, labels in loader:          # this rank's micro-batches of the current plan
        loss = criterion(engine(inputs), labels)   # the mean over the micro-batch
        engine.backward(loss)              # weighted: count x W / total of the global batch
        engine.step()                      # the optimizer step after the plan's last micro-batch

How it stays exact. The loader and the engine share one step in progress (:class:`LoopStep`, held by the
engine's :class:`ForwardBackwardLoop`, ``engine.loop``). When the
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

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...plan import plan_batch
from ..core.passes import StepPasses
from ..memory.oom import UnrecoverableOutOfMemory, is_out_of_memory
from ..memory.recovery import optimizer_step_oom

if TYPE_CHECKING:
    from ...data.loader import StepBatch
    from ...plan import BatchPlan
    from ..core.loss import StepLoss
    from ..core.lr import BatchCoupledLR
    from ..core.step_core import StepCore
    from ..memory.recovery import OomRecovery

__all__ = ["ForwardBackwardLoop", "LoopDataLoader", "LoopEngine", "LoopHolder", "LoopStep", "LoopStepHooks"]


class LoopStep:
    """The optimizer step the forward / backward / step loop is in (one per step)."""

    def __init__(self, step_batch: StepBatch, data_state: dict[str, Any], started: float, step: int) -> None:
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


class LoopHolder(Protocol):
    """The engine a :class:`LoopDataLoader` hands micro-batches for: its loop and its current loader
    (both rebuilt after a live recovery, so they are read at every use)."""

    loop: ForwardBackwardLoop
    dataloader: Any
    plan: BatchPlan
    core: StepCore


class LoopDataLoader:
    """The loader ``initialize(..., training_data=...)`` returns: iterate it for the forward / backward /
    step loop (see the module docstring). Everything else is the engine's current
    :class:`~ds_adabatch.data.ElasticDataLoader` (``next_step``, ``sampler``, ``state_dict``, ...): after a
    live recovery rebuilt it for the smaller world, this object reads the new one."""

    engine: LoopHolder | None = None  # a class default, so __getattr__ never runs for it

    def __init__(self, engine: LoopHolder) -> None:
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
        """Micro-batches this rank is handed in the rest of the epoch (the next epoch where this one is
        done) if the scheduled batch held: its steps, the epoch's smaller last one (or none with
        ``drop_last``), and what is left of a step in progress; token-budget steps are laid out as the
        sampler would cut them."""
        engine, loader = self.engine, self.loader
        sampler = getattr(loader, "sampler", None)
        if sampler is None or not hasattr(sampler, "position"):
            raise TypeError("the length of an IterableDataset's stream is unknown")
        loop = engine.loop.in_progress
        in_progress = len(loop.micro) - loop.next_index if loop is not None else 0
        n, position = sampler.num_samples, sampler.position
        batch, world = engine.core.scheduled_batch, engine.plan.world_size
        if hasattr(sampler, "peek_step"):  # token budgets: the steps as the sampler cuts them
            epoch = sampler.epoch + (1 if position == n else 0)
            step, passes = None, 0
            while True:
                step = sampler.peek_step(batch, world, after=step)
                if step.epoch != epoch:
                    break
                passes += step.passes
                if step.stop >= n:
                    break
            return passes + in_progress
        left = n - position if position < n else n
        plan = engine.core.plan_for(batch)
        steps, tail = divmod(left, plan.global_batch_size)
        passes = steps * plan.gradient_accumulation_steps
        if tail and not sampler.drop_last:
            last = plan_batch(tail, world, plan.max_micro_batch_per_gpu, allow_uneven=True)
            passes += last.gradient_accumulation_steps
        return passes + in_progress

    def __repr__(self) -> str:
        return f"LoopDataLoader({self.loader!r})"


class _EpochIterator:
    """One epoch of this rank's micro-batches (one ``for`` over :class:`LoopDataLoader`)."""

    def __init__(self, engine: LoopHolder) -> None:
        self.engine = engine
        self.epoch: int | None = None  # the epoch this iteration hands out

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        engine = self.engine
        steps = engine.loop
        loop = steps.in_progress
        if loop is not None and loop.current is not None:
            raise RuntimeError(
                "the loader's next micro-batch was asked for before engine.step() of the previous one: "
                "run engine(x), engine.backward(loss) and engine.step() for every micro-batch it hands out"
            )
        if loop is None or loop.next_index > loop.last:
            if self.epoch is not None and _epoch_complete(engine.dataloader):
                raise StopIteration
            loop = steps.begin_step()
        if self.epoch is None:
            self.epoch = loop.epoch
        elif loop.epoch != self.epoch and loop.next_index == 0:
            # A batch of the next epoch (after a drop_last remainder): it opens the next iteration.
            raise StopIteration
        return steps.hand_out(loop)


def _epoch_complete(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    coverage = getattr(sampler, "train_coverage", None)
    return coverage is not None and coverage >= 1.0


class LoopEngine(Protocol):
    """What the loop reads from the data-parallel engine it runs in (its public state)."""

    deepspeed: Any
    """The DeepSpeed engine: its forward, ``step``, ``global_rank``."""
    plan: BatchPlan
    global_steps: int
    token_budget: bool
    memory_recovery: OomRecovery
    lr_coupling: BatchCoupledLR


@dataclass(frozen=True)
class LoopStepHooks:
    """The engine's parts of a loop step, in the order the loop reaches them."""

    open: Callable[[], tuple[StepBatch, dict[str, Any], bool]]
    """Start a step: decide its plan, take its global batch; returns ``(step batch, the loader's state
    before it, whether it measures the noise scale)``."""
    passes: Callable[[list[tuple[Any, int]], int | None, bool], StepPasses]
    """The step's passes (``StepPasses``), at its first micro-batch: ``(micro-batches, total samples,
    measure)``."""
    complete: Callable[[int, float, float, tuple[Any, ...]], StepLoss]
    """Account the step whose optimizer step ran: ``(step, started, LR used, StepPasses.result())``."""


class ForwardBackwardLoop:
    """The forward / backward / step loop of one data-parallel engine (see the module docstring): the
    step in progress, and ``forward``, ``backward``, ``step`` and the boundary as the engine's methods
    of the same names call them."""

    def __init__(self, engine: LoopEngine, hooks: LoopStepHooks) -> None:
        self.engine = engine
        self.hooks = hooks
        self.in_progress: LoopStep | None = None
        """The optimizer step the loop is in (None between steps)."""

    # -- the loader's side ---------------------------------------------------------------------------
    def begin_step(self) -> LoopStep:
        """Decide the next plan, take its global batch and make it the step in progress."""
        started = time.perf_counter()
        step_batch, data_state, measure = self.hooks.open()
        loop = LoopStep(step_batch, data_state, started, self.engine.global_steps)
        loop.measure = measure
        self.in_progress = loop
        return loop

    def hand_out(self, loop: LoopStep) -> Any:
        """Micro-batch ``loop.next_index`` of the step, its boundary set."""
        engine = self.engine
        index = loop.next_index
        if loop.passes is None:  # the step's totals, its LR samples and its probe, at its first pass
            loop.lr_used = engine.lr_coupling.get_lr()[0]
            global_batch = loop.step_batch.global_batch
            total = global_batch.size if global_batch is not None else None
            loop.passes = self.hooks.passes(loop.micro, total, loop.measure)
        recovery = engine.memory_recovery
        if recovery.armed:
            recovery.begin_pass(f"in micro-batch {index} of step {engine.global_steps}", index=index)
        loop.passes.set_boundary(index)
        loop.current, loop.next_index, loop.backward_done = index, index + 1, False
        return loop.micro[index][0]

    def data_state(self) -> dict[str, Any] | None:
        """The loader's state before the step in progress (a resume trains it again), or None
        between steps."""
        return None if self.in_progress is None else self.in_progress.data_state

    def before_load(self) -> None:
        """A checkpoint is about to be loaded: refused inside a step; a step taken but not started is
        dropped (the loaded cursor replaces it)."""
        loop = self.in_progress
        if loop is None:
            return
        if loop.passes is not None:
            raise RuntimeError(
                "load_checkpoint() inside an optimizer step of the forward / backward / step loop: "
                "its partial gradients would be mixed into the loaded state; load before the loop or "
                "after the engine.step() that ends a step (engine.is_gradient_accumulation_boundary())"
            )
        self.in_progress = None

    # -- the engine's side ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped engine's forward; inside a loop step an out-of-memory error is recorded."""
        ds = self.engine.deepspeed
        loop = self.in_progress
        if loop is None or loop.current is None:
            return ds(*args, **kwargs)
        try:
            return ds(*args, **kwargs)
        except Exception as exc:
            self._out_of_memory(loop, exc, "forward")
            raise

    def _out_of_memory(self, loop: LoopStep, exc: Exception, phase: str) -> None:
        """Raise :class:`UnrecoverableOutOfMemory` for an out-of-memory ``exc`` in the loop, recorded."""
        if not is_out_of_memory(exc) or isinstance(exc, UnrecoverableOutOfMemory):
            return
        engine = self.engine
        rank = engine.deepspeed.global_rank
        index = loop.current if loop.current is not None else loop.last
        if phase == "optimizer step":
            where = f"in the optimizer step of step {engine.global_steps}"
            raise optimizer_step_oom(engine.deepspeed, rank, where) from exc
        where = f"in the {phase} of micro-batch {index} of step {engine.global_steps}"
        error = UnrecoverableOutOfMemory(
            f"out of memory on rank {rank} {where} (forward / backward / step loop): the loop's "
            "passes run in your code, so the step cannot be re-planned in place as engine.train_batch() "
            "does"
        )
        recovery = engine.memory_recovery
        recovery.where = where
        predictor = recovery.predictor
        size = predictor.pass_size if predictor is not None else None  # the limit's unit
        if not size and not engine.token_budget:
            size = loop.micro[index][1]
        recovery.records.record(error, recovery.memory.key, size or recovery.memory.limit, where=where)
        raise error from exc

    def backward(self, loss: Any, retain_graph: bool = False) -> Any:
        """The engine's ``backward`` (its docstring): the handed-out micro-batch's weighted backward."""
        loop = self._current("backward")
        if loop.backward_done:
            raise RuntimeError(
                "engine.backward() was called twice for one micro-batch: call engine.step() after it"
            )
        try:
            out = loop.passes.backward(loop.current, loss, retain_graph=retain_graph)
        except Exception as exc:
            self._out_of_memory(loop, exc, "backward")
            raise
        loop.backward_done = True
        return out

    def step(self, lr_kwargs: Any = None) -> None:
        """The engine's ``step`` (its docstring): DeepSpeed's step; after the last micro-batch the
        optimizer step, counted and recorded."""
        engine = self.engine
        loop = self._current("step")
        if not loop.backward_done:
            raise RuntimeError(
                "engine.step() before engine.backward() of the micro-batch: call backward first"
            )
        last = loop.current == loop.last
        recovery = engine.memory_recovery
        if last and recovery.armed:
            recovery.begin_optimizer_step(engine.global_steps)
        try:
            loop.passes.step(loop.current, lr_kwargs)
        except Exception as exc:
            self._out_of_memory(loop, exc, "optimizer step" if last else "step")
            raise
        loop.current = None
        if not last:
            return
        passes = loop.passes
        passes.close()
        recovery.take_verdict()  # as train_batch: the agreed prediction bounds the next plans
        self.in_progress = None
        self.hooks.complete(loop.step, loop.started, loop.lr_used, passes.result())

    def is_boundary(self) -> bool:
        """The engine's ``is_gradient_accumulation_boundary`` (its docstring)."""
        loop = self.in_progress
        if loop is None:
            return self.engine.plan.gradient_accumulation_steps == 1
        index = loop.current if loop.current is not None else loop.next_index
        return index == loop.last

    def _current(self, verb: str) -> LoopStep:
        loop = self.in_progress
        if loop is None or loop.current is None:
            raise RuntimeError(
                f"engine.{verb}() needs a micro-batch from the loader ds_adabatch.initialize returned: "
                "a batch of your own DataLoader (or of engine.deepspeed_io) has the size of one plan, "
                "and this engine changes the plan between optimizer steps. Iterate the loader returned by "
                "initialize(..., training_data=dataset) — `for batch in loader: loss = ...; "
                "engine.backward(loss); engine.step()` — or call engine.train_batch() once per step"
            )
        return loop

"""Per-rank torch adapter: turns the elastic sample stream into this rank's collated micro-batches.

:meth:`ElasticDataLoader.next_step` is called once per optimizer step with that step's plan and returns
a :class:`StepBatch`: one :class:`MicroBatch` per accumulation step. Where the plan gives this rank an
empty slot (an uneven epoch tail, or a global batch smaller than ``world_size x steps``), the micro-batch
is a *pad*: one real sample (the first of the global batch) collated as usual, with ``num_samples=0``, so
the rank still runs its forward/backward pass (every rank must run the same number, which ZeRO-3's
collectives need) and the runtime weights its loss by 0.

Worker processes (``num_workers >= 1``). Samples are consumed only by committing a batch to the
sampler, and the loader commits a step only once all of its micro-batches are loaded, so a failure while
loading consumes nothing. Each micro-batch is one task for the worker pool. After queuing the tasks of
step ``k`` the loader speculatively queues step ``k + 1`` under the same plan, using
:meth:`ElasticSampler.peek_batch` with ``after=`` (the sampler does not move). When step ``k + 1`` is asked
for, the loader peeks the batch for the plan it is given: if it equals the prefetched one (same samples,
same plan), the prefetched micro-batches are used; otherwise (the plan changed, or the epoch tail was
replanned) they are dropped and the step is loaded afresh, so a micro-batch of a stale size is never
served. A dropped prefetch consumed nothing; at worst a worker loaded samples that are loaded again later.

``IterableDataset``: each rank draws as many samples from its own iterator as its plan says; sharding
the stream over ranks (and readers) is the dataset's job, as in PyTorch, and the exactly-once guarantee of
the sampler does not apply. When the iterator is exhausted, the loader counts an epoch, calls
``dataset.set_epoch(epoch)`` if the dataset has it, and starts a new iterator, so a micro-batch can span
two passes. A pad reuses the last sample drawn (or peeks one and keeps it for the next draw). Such a
stream cannot resume exactly from :meth:`ElasticDataLoader.state_dict` unless the dataset itself has
``state_dict``/``load_state_dict`` (then they are called). Iterable datasets are read in the training
process (``num_workers=0``).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import IterableDataset

from ds_adabatch.plan import BatchPlan

from ._workers import WorkerOptions
from .rank_loader import RankLoader, check_collate_fn
from .sampler import ElasticSampler, GlobalBatch
from .step_batch import MicroBatch, StepBatch

__all__ = ["LOADER_STATE_VERSION", "ElasticDataLoader", "MicroBatch", "StepBatch"]

LOADER_STATE_VERSION = 1
"""Version of :meth:`ElasticDataLoader.state_dict`."""


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class ElasticDataLoader(RankLoader):
    """Collated micro-batches of one rank, for whatever plan each optimizer step brings.

    Args:
        dataset: A map-style dataset (``dataset[i]``; ``__getitems__`` is used when present) or an
            ``IterableDataset``.
        sampler: The :class:`ElasticSampler` over ``dataset`` (required for a map-style dataset, which
            must then have ``len(dataset) == sampler.num_samples``; not allowed for an iterable one).
        rank: This process's data-parallel rank.
        world_size: Data-parallel ranks; every plan passed to :meth:`next_step` must have it.
        collate_fn: Turns a list of samples into a batch (default ``torch.utils.data.default_collate``).
        num_workers: Worker processes loading micro-batches in parallel (0: load in this process).
        multiprocessing_context: Start method name (``"fork"``, ``"spawn"``, ``"forkserver"``) or a
            context object for the workers; default is torch's default for the platform.
        worker_init_fn: Called in each worker with its id (0-based) after seeding, before any load.
        timeout: Seconds to wait for one micro-batch from the workers before failing (0: no limit).
        prefetch: With workers, load the next step (under the current plan) while this one trains.

    The worker pool starts at the first :meth:`next_step` and lives until :meth:`close` (or the end of a
    ``with`` block, or garbage collection).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: ElasticSampler | None = None,
        *,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        multiprocessing_context: str | Any | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout: float = 0.0,
        prefetch: bool = True,
    ) -> None:
        self._world_size = _check_int("world_size", world_size, 1)
        self._rank = _check_int("rank", rank, 0)
        if self._rank >= self._world_size:
            raise ValueError(
                f"rank must be in 0..{self._world_size - 1} for world_size {world_size}, got {rank}"
            )
        options = WorkerOptions.checked(
            num_workers, multiprocessing_context, worker_init_fn, timeout, prefetch
        )
        check_collate_fn(collate_fn)
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable:
            if sampler is not None:
                raise ValueError("an IterableDataset is read in its own order; pass sampler=None")
            if num_workers:
                raise ValueError(
                    "an IterableDataset is read in the training process; set num_workers=0 (shard or "
                    "parallelise the stream inside the dataset)"
                )
        else:
            if not isinstance(sampler, ElasticSampler):
                raise ValueError(
                    f"a map-style dataset needs sampler=ElasticSampler(len(dataset)), got {sampler!r}"
                )
            length = len(dataset) if hasattr(dataset, "__len__") else None
            if length is not None and length != sampler.num_samples:
                raise ValueError(
                    f"the sampler covers {sampler.num_samples} samples but the dataset has {length}; "
                    f"build the sampler with num_samples=len(dataset)"
                )
        self._dataset = dataset
        self._sampler = sampler
        self._start_loading(dataset, collate_fn, options, seed=0 if sampler is None else sampler.seed)
        # IterableDataset stream state.
        self._iterator: Iterator[Any] | None = None
        self._pushback: deque[Any] = deque()
        self._last_sample: Any = None
        self._step_samples: dict[int, list[Any]] = {}  # this step's raw samples (reload)
        self._stream_epoch = 0
        self._drawn = 0

    # -- properties ----------------------------------------------------------------------------------

    @property
    def sampler(self) -> ElasticSampler | None:
        """The sampler (``None`` for an ``IterableDataset``)."""
        return self._sampler

    @property
    def epoch(self) -> int:
        """The sampler's epoch, or the passes completed over an ``IterableDataset``."""
        return self._stream_epoch if self._sampler is None else self._sampler.epoch

    @property
    def samples_drawn(self) -> int:
        """Samples this rank drew from an ``IterableDataset`` (0 for a map-style dataset)."""
        return self._drawn

    # -- steps ---------------------------------------------------------------------------------------

    def peek_plan(self, plan: BatchPlan) -> BatchPlan:
        """The plan :meth:`next_step` would use for ``plan`` (differs at an epoch tail); consumes nothing."""
        self._check_plan(plan)
        return plan if self._sampler is None else self._sampler.peek_plan(plan)

    def next_step(self, plan: BatchPlan, *, load: bool = True) -> StepBatch:
        """Take the next global batch for ``plan`` and return this rank's collated micro-batches.

        ``load=False`` (map-style datasets only) advances past the batch without reading a sample: the
        micro-batches carry their indices and sizes and ``batch=None`` (a pipeline stage that feeds
        nothing keeps its cursor, epoch and checkpoint state in step with the stages that load).

        Raises:
            ValueError: the plan's world size is not the loader's, or the sampler refuses the plan.
            RuntimeError: the loader is closed, or a worker failed (nothing is consumed then).
        """
        self._check_plan(plan)
        if self._closed:
            raise RuntimeError("this ElasticDataLoader is closed; build a new one to keep loading")
        if self._sampler is None:
            if not load:
                raise ValueError("an IterableDataset cannot be advanced without reading it (load=False)")
            return self._next_from_stream(plan)
        batch = self._sampler.peek_batch(plan)
        if not load:
            self._sampler.commit(batch)
            return StepBatch(
                tuple(self._micro_batches(batch, [None] * batch.gradient_accumulation_steps)),
                batch.plan,
                self._rank,
                batch.epoch,
                batch,
            )
        sampler = self._sampler
        collated = self._steps.load(
            *self._work(batch), ahead=lambda: self._work(sampler.peek_batch(plan, after=batch))
        )
        micro = self._micro_batches(batch, collated)
        self._sampler.commit(batch)
        return StepBatch(tuple(micro), batch.plan, self._rank, batch.epoch, batch)

    def reload(self, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """``step``'s samples again, cut for ``plan`` (same global batch size); consumes nothing.

        An out-of-memory retry uses it to re-run the same samples with a smaller micro-batch. With an
        ``IterableDataset`` this rank's own samples are re-split into ``plan``'s accumulation steps.
        """
        self._check_plan(plan)
        if step.global_batch is not None:
            batch = step.global_batch.with_plan(plan)
            micro = self._micro_batches(batch, self._steps.load_inline(*self._work(batch)[1:]))
            return StepBatch(tuple(micro), plan, self._rank, step.epoch, batch)
        samples = [s for m in step.micro_batches if m.num_samples for s in self._step_samples.get(id(m), [])]
        ordinals = [o for m in step.micro_batches for o in m.indices]
        gas = plan.gradient_accumulation_steps
        micro = []
        for k in range(gas):
            lo, hi = len(samples) * k // gas, len(samples) * (k + 1) // gas
            if hi > lo:
                micro.append(MicroBatch(self._collate(samples[lo:hi]), tuple(ordinals[lo:hi]), hi - lo))
            else:
                micro.append(MicroBatch(self._collate(samples[:1] or [self._last_sample]), (), 0))
        self._step_samples = {}
        for k, m in enumerate(micro):
            lo, hi = len(samples) * k // gas, len(samples) * (k + 1) // gas
            self._step_samples[id(m)] = samples[lo:hi] if m.num_samples else []
        return StepBatch(tuple(micro), plan, self._rank, step.epoch, None)

    def _check_plan(self, plan: BatchPlan) -> None:
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan (see ds_adabatch.plan.plan_batch), got {plan!r}")
        if plan.world_size != self._world_size:
            raise ValueError(
                f"the plan is for {plan.world_size} ranks but this loader serves rank {self._rank} of "
                f"{self._world_size}; plan with world_size={self._world_size}"
            )

    def _work(self, batch: GlobalBatch) -> tuple[GlobalBatch, list[list[int]], int]:
        """``batch`` as the step loader takes it: key, this rank's slots, and the pad sample (the first of
        the global batch). A prefetched batch is used only when it equals ``batch`` (same samples, same
        plan), so a micro-batch of a stale size is never served."""
        return batch, batch.indices(self._rank), int(batch.as_array()[0])

    def _micro_batches(self, batch: GlobalBatch, collated: list[Any]) -> list[MicroBatch]:
        return [
            MicroBatch(value, tuple(indices), len(indices))
            for indices, value in zip(batch.indices(self._rank), collated)
        ]

    # -- IterableDataset -----------------------------------------------------------------------------

    def _draw(self) -> Any:
        if self._pushback:
            return self._pushback.popleft()
        if self._iterator is None:
            self._iterator = iter(self._dataset)
        try:
            return next(self._iterator)
        except StopIteration:
            pass
        self._stream_epoch += 1
        set_epoch = getattr(self._dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._stream_epoch)
        self._iterator = iter(self._dataset)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError("the IterableDataset yielded no samples after a restart; it is empty") from None

    def _next_from_stream(self, plan: BatchPlan) -> StepBatch:
        sizes = plan.micro_batch_sizes(self._rank)
        drawn: list[tuple[list[Any], tuple[int, ...]]] = []
        for size in sizes:
            samples = [self._draw() for _ in range(size)]
            drawn.append((samples, tuple(range(self._drawn, self._drawn + size))))
            self._drawn += size
            if samples:
                self._last_sample = samples[-1]
        pad_value: Any = None
        micro = []
        self._step_samples = {}
        for samples, ordinals in drawn:
            if samples:
                micro.append(MicroBatch(self._collate(samples), ordinals, len(samples)))
                # Kept until the next step: an out-of-memory retry re-cuts them (reload).
                self._step_samples[id(micro[-1])] = samples
                continue
            if pad_value is None:
                if self._last_sample is None:  # nothing drawn yet: peek one and give it back
                    self._last_sample = self._draw()
                    self._pushback.append(self._last_sample)
                pad_value = self._collate([self._last_sample])
            micro.append(MicroBatch(pad_value, (), 0))
        return StepBatch(tuple(micro), plan, self._rank, self._stream_epoch, None)

    # -- checkpointing -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (global counts); for an ``IterableDataset``, counters and the dataset's own."""
        if self._sampler is not None:
            return {"version": LOADER_STATE_VERSION, "kind": "map", "sampler": self._sampler.state_dict()}
        state: dict[str, Any] = {
            "version": LOADER_STATE_VERSION,
            "kind": "iterable",
            "epoch": self._stream_epoch,
            "samples_drawn": self._drawn,
        }
        if callable(getattr(self._dataset, "state_dict", None)):
            state["dataset"] = self._dataset.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``.

        For a map-style dataset this is exact on any world size (the sampler's global counts). For an
        ``IterableDataset`` only the counters are restored and the stream restarts, unless the dataset
        has ``load_state_dict``; a warning says so.

        Raises:
            ValueError: the state is of another version or kind, or the sampler refuses it.
        """
        if not isinstance(state, Mapping) or state.get("version") != LOADER_STATE_VERSION:
            found = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"loader state version {found!r} is not supported; this loader reads version "
                f"{LOADER_STATE_VERSION}"
            )
        kind = "map" if self._sampler is not None else "iterable"
        if state.get("kind") != kind:
            raise ValueError(
                f"the state is of a {state.get('kind')!r} loader but this one reads a {kind} dataset"
            )
        if self._sampler is not None:
            self._steps.drop_queued()
            self._sampler.load_state_dict(state["sampler"])
            return
        self._stream_epoch = _check_int("state['epoch']", state.get("epoch"), 0)
        self._drawn = _check_int("state['samples_drawn']", state.get("samples_drawn"), 0)
        self._iterator, self._last_sample = None, None
        self._pushback.clear()
        if "dataset" in state and callable(getattr(self._dataset, "load_state_dict", None)):
            self._dataset.load_state_dict(state["dataset"])
        else:
            warnings.warn(
                "an IterableDataset without load_state_dict cannot resume exactly: the counters are "
                "restored but the stream starts again from the dataset's beginning",
                stacklevel=2,
            )

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            "an ElasticDataLoader hands out whole optimizer steps with next_step(plan), not micro-batches: "
            "iterate the loader ds_adabatch.initialize returns (it follows the engine's plan), or call "
            "engine.train_batch()"
        )

    def __repr__(self) -> str:
        source = "IterableDataset" if self._sampler is None else repr(self._sampler)
        return (
            f"ElasticDataLoader(rank {self._rank} of {self._world_size}, num_workers={self.num_workers}, "
            f"{source})"
        )

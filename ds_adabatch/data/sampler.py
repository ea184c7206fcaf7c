"""The elastic sample stream: one global order per epoch, cut into global batches, sharded per plan.

:class:`ElasticSampler` keeps one cursor into the global order (epoch, position). Each call to
:meth:`ElasticSampler.next_batch` takes the next ``plan.global_batch_size`` positions of that order and
lays them out in the plan's slots (``BatchPlan.slot_offsets``: accumulation step 0 of every rank first).
The contents and order of every global batch therefore depend only on the seed and the sequence of global
batch sizes, never on the world size or on how a batch is split into micro-batches, and a resumed run on
a different number of ranks continues the same stream.

Epoch tail: when fewer than ``global_batch_size`` samples are left in the epoch, ``drop_last=True`` skips
them (counted in :attr:`ElasticSampler.samples_skipped`) and the batch comes from the next epoch;
``drop_last=False`` returns the remainder as a smaller batch, replanned with
``plan_batch(remainder, world_size, max_micro_batch_per_gpu, allow_uneven=True)`` so that a rank with no
sample gets an empty slot (a zero-weight pad). A batch never spans two epochs.

The epoch counter rolls over lazily, at the first batch of the next epoch: right after the last batch of an
epoch, :attr:`~ElasticSampler.epoch` still names that epoch and :attr:`~ElasticSampler.train_coverage`
reads 1.0.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ds_adabatch.plan import BatchPlan, plan_batch

from .order import MAX_NUM_SAMPLES, EpochOrder, epoch_order

__all__ = ["STATE_VERSION", "ElasticSampler", "GlobalBatch"]

STATE_VERSION = 1
"""Version of :meth:`ElasticSampler.state_dict`; loading refuses any other."""

_CONFIG_KEYS = ("num_samples", "seed", "shuffle")


def stream_mismatch(name: str, saved: object, current: object) -> str:
    """Why a checkpoint's sample stream cannot continue here, and what to set (``name``: a sampler's
    ``num_samples``, ``seed``, ``shuffle`` or ``bucket_window``)."""
    fix = {
        "num_samples": f"train on the same dataset ({saved} samples), or start the run afresh",
        "seed": f"set adabatch.data.seed (with the Trainer: data_seed, else seed) to {saved!r}",
        "shuffle": f"set adabatch.data.shuffle to {str(saved).lower()}",
        "bucket_window": f"set adabatch.bucket_window to {saved!r}",
    }.get(name, f"use {name}={saved!r}")
    return (
        f"the checkpoint's sample stream was drawn with {name}={saved!r}, this run's with {name}={current!r}: "
        f"the stream would not continue where it stopped; {fix}"
    )


_STATE_KEYS = ("epoch", "position", "samples_consumed", "samples_skipped")


class GlobalBatch:
    """The samples of one optimizer step over all ranks, laid out in the slots of :attr:`plan`.

    Built by :class:`ElasticSampler`; every rank builds the same one and reads its own shard with
    :meth:`indices`. Two batches compare equal when they hold the same positions of the same stream
    under the same plan.

    Attributes:
        plan: The plan actually used: ``requested_plan``, or the uneven replan of an epoch's remainder.
        requested_plan: The plan passed to :meth:`ElasticSampler.next_batch`.
        epoch: Epoch (0-based) the samples come from.
        start: Position in the epoch's global order of the first sample.
        skipped: Samples of the previous epoch's tail dropped (``drop_last``) just before this batch.
    """

    __slots__ = (
        "_key",
        "_offsets",
        "_order",
        "_origin",
        "epoch",
        "plan",
        "requested_plan",
        "skipped",
        "start",
    )

    def __init__(
        self,
        *,
        plan: BatchPlan,
        requested_plan: BatchPlan,
        epoch: int,
        start: int,
        skipped: int,
        order: np.ndarray,
        key: tuple,
        origin: tuple[int, int],
    ) -> None:
        self.plan = plan
        self.requested_plan = requested_plan
        self.epoch = epoch
        self.start = start
        self.skipped = skipped
        self._order = order
        # (num_samples, seed, shuffle, epoch, start): which stream and where in it.
        self._key = key
        # The sampler cursor (epoch, position) the batch was peeked at; commit() checks it.
        self._origin = origin
        self._offsets: list[list[tuple[int, int]]] | None = None

    @property
    def size(self) -> int:
        """Real samples in the batch (over all ranks and accumulation steps)."""
        return self.plan.global_batch_size

    @property
    def stop(self) -> int:
        """Position in the epoch's order just past the last sample."""
        return self.start + self.size

    @property
    def world_size(self) -> int:
        """Data-parallel ranks of :attr:`plan`."""
        return self.plan.world_size

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches every rank runs (pads included)."""
        return self.plan.gradient_accumulation_steps

    @property
    def is_tail(self) -> bool:
        """True when this is an epoch's smaller remainder batch (its plan differs from the requested one)."""
        return self.plan.global_batch_size != self.requested_plan.global_batch_size

    def _slot_offsets(self) -> list[list[tuple[int, int]]]:
        if self._offsets is None:
            self._offsets = self.plan.slot_offsets()
        return self._offsets

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.plan.world_size:
            raise ValueError(f"rank must be an integer in 0..{self.plan.world_size - 1}, got {rank!r}")

    def micro_batch_sizes(self, rank: int) -> tuple[int, ...]:
        """Real samples of ``rank`` in each accumulation step (0 where the rank runs a pad)."""
        self._check_rank(rank)
        return self.plan.micro_batch_sizes(rank)

    def indices(self, rank: int) -> list[list[int]]:
        """Sample indices of ``rank``, one list per accumulation step (``[]`` where the rank runs a pad)."""
        self._check_rank(rank)
        return [self._order[row[rank][0] : row[rank][1]].tolist() for row in self._slot_offsets()]

    def rank_indices(self) -> list[list[list[int]]]:
        """``[rank][step]`` sample indices of every rank (what each rank's :meth:`indices` returns)."""
        return [self.indices(rank) for rank in range(self.plan.world_size)]

    def all_indices(self) -> list[int]:
        """All sample indices in slot order (step-major), which is the global order from :attr:`start`."""
        return self._order.tolist()

    def with_plan(self, plan: BatchPlan) -> GlobalBatch:
        """The same samples cut for another plan of the same global batch size (an out-of-memory
        retry re-runs them with a smaller micro-batch); consumes nothing."""
        if plan.global_batch_size != self.size or plan.world_size != self.world_size:
            raise ValueError(
                f"a batch of {self.size} samples on {self.world_size} ranks cannot be re-cut for "
                f"{plan.describe()}: the global batch size and world size must stay the same"
            )
        return GlobalBatch(
            plan=plan,
            requested_plan=self.requested_plan,
            epoch=self.epoch,
            start=self.start,
            skipped=self.skipped,
            order=self._order,
            key=self._key,
            origin=self._origin,
        )

    def as_array(self) -> np.ndarray:
        """All sample indices in slot order as a read-only ``int64`` array (no copy)."""
        view = self._order.view()
        view.flags.writeable = False
        return view

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GlobalBatch):
            return NotImplemented
        return self._key == other._key and self.plan == other.plan and self.skipped == other.skipped

    def __hash__(self) -> int:
        return hash((self._key, self.plan))

    def __repr__(self) -> str:
        tail = ", tail" if self.is_tail else ""
        return (
            f"GlobalBatch(epoch={self.epoch}, positions {self.start}..{self.stop - 1}, "
            f"{self.plan.describe()}{tail})"
        )


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_count(name: str, value: object, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


class ElasticSampler:
    """Exactly-once global batches of sample indices for any sequence of batch plans.

    Args:
        num_samples: Samples in the dataset (``1 .. 2**62``).
        shuffle: Visit the samples of each epoch in a keyed pseudo-random order (else ``0 .. N-1``).
        seed: Run seed (``0 .. 2**64 - 1``); with the epoch it selects the order.
        drop_last: Skip an epoch's remainder that is smaller than the requested global batch instead
            of returning it as a smaller, unevenly planned batch.

    Every rank holds its own sampler with the same arguments and calls :meth:`next_batch` with the same
    plans; they then agree on every batch without communicating.
    """

    def __init__(
        self, num_samples: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        self._num_samples = _check_count("num_samples", num_samples, 1, MAX_NUM_SAMPLES)
        self._shuffle = _check_flag("shuffle", shuffle)
        self._seed = _check_count("seed", seed, 0, 2**64 - 1)
        self._drop_last = _check_flag("drop_last", drop_last)
        self._epoch = 0
        self._position = 0
        self._consumed = 0
        self._skipped = 0
        self._order: EpochOrder | None = None

    # -- configuration -------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples per epoch."""
        return self._num_samples

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is visited in a keyed pseudo-random order."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """Run seed of the order."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """Whether an epoch's remainder smaller than the requested batch is skipped."""
        return self._drop_last

    # -- progress ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the last batch handed out (0 before the first); advances at the next epoch's first batch."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch handed out so far (its position in the global order)."""
        return self._position

    @property
    def train_coverage(self) -> float:
        """Fraction of the current epoch handed out, 0.0 .. 1.0 (1.0 right after an epoch's last batch)."""
        return self._position / self._num_samples

    @property
    def fractional_epoch(self) -> float:
        """``epoch + train_coverage``: 1.0 at the end of the first epoch, 1.4 at 40 % of the second."""
        return self._epoch + self.train_coverage

    @property
    def samples_consumed(self) -> int:
        """Real samples handed out over all epochs (skipped ones excluded)."""
        return self._consumed

    @property
    def samples_skipped(self) -> int:
        """Samples skipped at epoch ends because of ``drop_last``, over all epochs."""
        return self._skipped

    def order(self, epoch: int | None = None) -> EpochOrder:
        """The global order of ``epoch`` (default: the current one)."""
        epoch = self._epoch if epoch is None else _check_count("epoch", epoch)
        if self._order is None or self._order.epoch != epoch:
            self._order = epoch_order(self._num_samples, seed=self._seed, epoch=epoch, shuffle=self._shuffle)
        return self._order

    # -- batches -------------------------------------------------------------------------------------

    def _cursor_after(self, after: GlobalBatch | None) -> tuple[int, int]:
        if after is None:
            return self._epoch, self._position
        if not isinstance(after, GlobalBatch):
            raise TypeError(f"after must be a GlobalBatch, got {after!r}")
        if after._key[:3] != (self._num_samples, self._seed, self._shuffle):
            raise ValueError(f"{after!r} comes from a sampler with another num_samples, seed or shuffle")
        return after.epoch, after.stop

    def _locate(self, plan: BatchPlan, cursor: tuple[int, int]) -> tuple[int, int, int, BatchPlan]:
        """Where the next batch for ``plan`` starts: ``(epoch, position, skipped, plan used)``."""
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan (see ds_adabatch.plan.plan_batch), got {plan!r}")
        n, want = self._num_samples, plan.global_batch_size
        epoch, position = cursor
        if position == n:  # the previous batch ended the epoch; roll over now, not then
            epoch, position = epoch + 1, 0
        remaining = n - position
        if want <= remaining:
            return epoch, position, 0, plan
        if self._drop_last:
            if want > n:
                raise ValueError(
                    f"global batch {want} is larger than the dataset ({n} samples) and drop_last=True "
                    f"would skip every sample; request at most {n} samples (adabatch.max_global_batch bounds "
                    "what a schedule asks for) or use drop_last=False (adabatch.data.drop_last)"
                )
            return epoch + 1, 0, remaining, plan
        tail = plan_batch(remaining, plan.world_size, plan.max_micro_batch_per_gpu, allow_uneven=True)
        return epoch, position, 0, tail

    def peek_plan(self, plan: BatchPlan, *, after: GlobalBatch | None = None) -> BatchPlan:
        """The plan :meth:`next_batch` would use for ``plan`` (its tail replan at an epoch's end), cheaply.

        With ``after``, as if that batch (peeked earlier, not yet committed) had been taken first.
        """
        return self._locate(plan, self._cursor_after(after))[3]

    def peek_batch(self, plan: BatchPlan, *, after: GlobalBatch | None = None) -> GlobalBatch:
        """The batch :meth:`next_batch` would return for ``plan``, without advancing the sampler.

        With ``after``, the batch that would follow ``after`` (peeked earlier, not yet committed): a
        loader prefetches the next step this way while the current one is still loading.
        """
        cursor = self._cursor_after(after)
        epoch, start, skipped, used = self._locate(plan, cursor)
        order = self.order(epoch).take(start, start + used.global_batch_size)
        return GlobalBatch(
            plan=used,
            requested_plan=plan,
            epoch=epoch,
            start=start,
            skipped=skipped,
            order=order,
            key=(self._num_samples, self._seed, self._shuffle, epoch, start),
            origin=cursor,
        )

    def commit(self, batch: GlobalBatch) -> None:
        """Advance past ``batch``, which :meth:`peek_batch` returned at the sampler's current position.

        Raises:
            ValueError: ``batch`` was peeked from another sampler or before the sampler last moved.
        """
        if not isinstance(batch, GlobalBatch):
            raise TypeError(f"batch must be a GlobalBatch, got {batch!r}")
        same_stream = batch._key[:3] == (self._num_samples, self._seed, self._shuffle)
        if not same_stream or batch._origin != (self._epoch, self._position):
            raise ValueError(
                f"{batch!r} was not peeked at this sampler's current position (epoch {self._epoch}, "
                f"position {self._position}); peek again and commit the fresh batch"
            )
        self._epoch = batch.epoch
        self._position = batch.stop
        self._consumed += batch.size
        self._skipped += batch.skipped

    def next_batch(self, plan: BatchPlan) -> GlobalBatch:
        """Take the next global batch for ``plan`` and advance the sampler past it.

        Raises:
            ValueError: ``drop_last=True`` and the global batch is larger than the dataset.
        """
        batch = self.peek_batch(plan)
        self.commit(batch)
        return batch

    # -- checkpointing -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Global counts only (no per-rank offsets), so a resume on any world size continues the stream."""
        return {
            "version": STATE_VERSION,
            "num_samples": self._num_samples,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "epoch": self._epoch,
            "position": self._position,
            "samples_consumed": self._consumed,
            "samples_skipped": self._skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses state of another dataset size, seed or shuffle setting.

        A different ``drop_last`` is accepted (the stream so far is the same) and this sampler's own
        setting applies from now on, with a warning.

        Raises:
            ValueError: the state is of another version, incomplete, inconsistent, or was written by a
                sampler with another ``num_samples``, ``seed`` or ``shuffle``.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"sampler state must be a mapping, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"sampler state version {state.get('version')!r} is not supported; this ElasticSampler "
                f"reads version {STATE_VERSION}"
            )
        missing = [k for k in (*_CONFIG_KEYS, "drop_last", *_STATE_KEYS) if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(missing)}")
        for name in _CONFIG_KEYS:
            if state[name] != getattr(self, name):
                raise ValueError(stream_mismatch(name, state[name], getattr(self, name)))
        epoch = _check_count("state['epoch']", state["epoch"])
        position = _check_count("state['position']", state["position"], 0, self._num_samples)
        consumed = _check_count("state['samples_consumed']", state["samples_consumed"])
        skipped = _check_count("state['samples_skipped']", state["samples_skipped"])
        if bool(state["drop_last"]) != self._drop_last:
            warnings.warn(
                f"the checkpoint used drop_last={bool(state['drop_last'])}; continuing with "
                f"drop_last={self._drop_last}, which changes how later epoch tails are handled",
                stacklevel=2,
            )
        self._epoch, self._position = epoch, position
        self._consumed, self._skipped = consumed, skipped

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(num_samples={self._num_samples}, shuffle={self._shuffle}, seed={self._seed}, "
            f"drop_last={self._drop_last}; epoch {self._epoch}, position {self._position})"
        )

"""Token-budget steps: a global batch counted in tokens, cut into micro-batches of bounded tokens.

:class:`~ds_adabatch.data.lengths.SampleLengths` holds every sample's length in tokens, given once.

:class:`TokenBudgetSampler` walks the same world-size-independent global order as
:class:`~ds_adabatch.data.ElasticSampler` (the keyed permutation of :mod:`ds_adabatch.data.order`). For a
target of ``T`` tokens it takes samples from its cursor until their lengths sum to at least ``T`` (at
least one sample; never across an epoch's end), then lays them out with
:func:`~ds_adabatch.data.packing.pack_step` into micro-batches of at most ``micro_batch_tokens`` for every
rank. Which samples a step holds depends only on the seed and the sequence of targets, never on the
world size, so a run resumed on another number of ranks continues the same stream.

Bucketing (``bucket_window > 0``): each consecutive block of ``bucket_window`` positions of an epoch's
order (blocks start at position 0) is sorted by length, stably, before steps are taken from it. That is
still one permutation per epoch, independent of the world size, so every sample trains exactly once;
steps then hold samples of similar length and pad less. The price: within a block, steps go from short
to long samples, so a window much larger than a step correlates the length with the position in
training. A window of a few steps is the usual compromise.

Epoch tail: fewer tokens left than the target -> ``drop_last`` skips them (counted in
``samples_skipped``), otherwise they form a smaller last step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ds_adabatch.plan import BatchPlan

from .lengths import SampleLengths
from .order import MAX_NUM_SAMPLES, EpochOrder, epoch_order
from .packing import PADDING_MODES, RankLayout, count_passes, micro_batch_cost, pack_step
from .sampler import stream_mismatch

__all__ = ["TOKEN_STATE_VERSION", "SampleLengths", "TokenBudgetSampler", "TokenStep"]

TOKEN_STATE_VERSION = 1
"""Version of :meth:`TokenBudgetSampler.state_dict`."""


class TokenStep:
    """The samples of one token-budget optimizer step over all ranks, and their layout.

    Attributes:
        epoch, start, stop: Epoch and positions ``start .. stop - 1`` of the (bucketed) order it holds.
        indices: Dataset indices of its samples, in order.
        lengths: Their lengths in tokens (capped at the budget with truncation).
        layouts: One :class:`~ds_adabatch.data.packing.RankLayout` per rank.
        skipped: Samples of the previous epoch's tail dropped (``drop_last``) just before this step.
        target_tokens: The token target the step was formed for.
        budget: The token budget its micro-batches were cut with: ``micro_batch_tokens``, or the lower
            one learned after an out-of-memory error (:attr:`TokenBudgetSampler.pass_budget`).
    """

    def __init__(self, *, epoch: int, start: int, indices: np.ndarray, lengths: np.ndarray,
                 layouts: list[RankLayout], skipped: int, target_tokens: int, origin: tuple[int, int],
                 key: tuple, budget: int) -> None:  # fmt: skip
        self.epoch, self.start, self.budget = epoch, start, budget
        self.indices, self.lengths = indices, lengths
        self.layouts, self.skipped, self.target_tokens = layouts, skipped, target_tokens
        self._origin, self._key = origin, key

    @property
    def size(self) -> int:
        """Real samples of the step over all ranks."""
        return int(len(self.indices))

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def tokens(self) -> int:
        """Real tokens of the step (sum of its samples' lengths)."""
        return int(self.lengths.sum())

    @property
    def world_size(self) -> int:
        return len(self.layouts)

    @property
    def passes(self) -> int:
        """Forward/backward passes every rank runs (pads included)."""
        return len(self.layouts[0].micro_batches)

    @property
    def padded_tokens(self) -> int:
        """Tokens processed over all ranks, padding and pads included."""
        return sum(layout.padded_tokens for layout in self.layouts)

    def micro_batches(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """Dataset indices of ``rank``'s passes (``()`` for a zero-weight pad)."""
        return self.layouts[rank].micro_batches

    @property
    def largest_pass(self) -> int:
        """Padded tokens of the step's most expensive pass on any rank."""
        return max(max(layout.costs) for layout in self.layouts)

    def pass_cost(self, rank: int, index: int) -> tuple[int, int]:
        """``(padded tokens, real samples)`` of ``rank``'s pass ``index`` (a pad holds 0 samples)."""
        layout = self.layouts[rank]
        return layout.costs[index], len(layout.micro_batches[index])

    @property
    def pad_index(self) -> int:
        """The sample a pad pass runs (the step's shortest), weighted 0."""
        return int(self.indices[int(np.argmin(self.lengths))])

    def plan(self, max_micro_batch_per_gpu: int | None = None) -> BatchPlan:
        """A :class:`BatchPlan` with the step's samples, world size and passes, for DeepSpeed's batch keys."""
        largest = max(len(m) for layout in self.layouts for m in layout.micro_batches)
        nominal = -(-self.size // (self.world_size * self.passes))
        return BatchPlan(
            self.size, self.world_size, self.passes, max(largest, nominal, max_micro_batch_per_gpu or 1)
        )

    def __repr__(self) -> str:
        return (
            f"TokenStep(epoch={self.epoch}, positions {self.start}..{self.stop - 1}, {self.size} samples, "
            f"{self.tokens} tokens, {self.passes} passes x {self.world_size} ranks, budget {self.budget})"
        )


def _count(name: str, value: object, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in {low}..{high if high is not None else 'inf'}, got {value}")
    return int(value)


class TokenBudgetSampler:
    """Exactly-once token-budget steps from the world-size-independent global order.

    Args:
        lengths: The samples' :class:`SampleLengths` (its ``num_samples`` is the dataset size).
        micro_batch_tokens: Largest cost of one forward pass, in tokens (see ``padding``).
        padding: ``"pad_to_longest"`` (cost n x longest) or ``"packed"`` (cost = sum of lengths).
        max_micro_batch: Optional cap on samples per forward pass as well.
        bucket_window: Sort blocks of this many positions of the order by length (0: off).
        truncate: Count a sample longer than the budget as ``micro_batch_tokens`` (the collate must
            cut it) instead of raising an error naming it.
        shuffle, seed, drop_last: As for :class:`~ds_adabatch.data.ElasticSampler`.
        step_unit: What a step's target counts: ``"tokens"`` (samples are taken until their lengths
            reach it) or ``"samples"`` (exactly that many samples, fewer at an epoch's end).
    """

    def __init__(
        self,
        lengths: SampleLengths,
        *,
        micro_batch_tokens: int,
        padding: str = "pad_to_longest",
        max_micro_batch: int | None = None,
        bucket_window: int = 0,
        truncate: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        step_unit: str = "tokens",
    ) -> None:
        if step_unit not in ("tokens", "samples"):
            raise ValueError(f"step_unit must be 'tokens' or 'samples', got {step_unit!r}")
        self.step_unit = step_unit
        if not isinstance(lengths, SampleLengths):
            raise TypeError(f"lengths must be a SampleLengths, got {type(lengths).__name__}")
        if padding not in PADDING_MODES:
            raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
        self.lengths = lengths
        self.num_samples = _count("num_samples", lengths.num_samples, 1, MAX_NUM_SAMPLES)
        self.budget = _count("micro_batch_tokens", micro_batch_tokens, 1)
        self.padding = padding
        self.max_micro_batch = (
            None if max_micro_batch is None else _count("max_micro_batch", max_micro_batch, 1)
        )
        self.bucket_window = _count("bucket_window", bucket_window, 0)
        self.truncate = bool(truncate)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), _count("seed", seed, 0), bool(drop_last)
        self._pass_budget = self.budget
        self._epoch = self._position = 0
        self._consumed = self._tokens = self._skipped = 0
        self._order: EpochOrder | None = None
        self._block: tuple[int, int, np.ndarray] | None = None  # (epoch, block start, indices)
        if not self.truncate and lengths.complete:
            self._check_lengths()

    # -- budget --------------------------------------------------------------------------------------
    @property
    def pass_budget(self) -> int:
        """The token budget steps are cut with now: ``micro_batch_tokens``, or lower after an
        out-of-memory error (the runtime sets it from its learned limit). Samples above it but within
        ``micro_batch_tokens`` run alone in their pass; ``micro_batch_tokens`` still decides which samples
        are too long (error or truncation)."""
        return self._pass_budget

    @pass_budget.setter
    def pass_budget(self, tokens: int) -> None:
        self._pass_budget = _count("pass_budget", tokens, 1, self.budget)

    def repack(self, step: TokenStep, budget: int | None = None) -> TokenStep:
        """The same samples as ``step``, cut into micro-batches with ``budget`` (default: :attr:`pass_budget`).

        An out-of-memory retry runs it: the step's samples, order, counts and weights are unchanged, only
        the passes differ.
        """
        budget = self._pass_budget if budget is None else _count("budget", budget, 1, self.budget)
        layouts = self._pack(step.indices, step.lengths, step.world_size, budget)
        return TokenStep(
            epoch=step.epoch, start=step.start, indices=step.indices, lengths=step.lengths,
            layouts=layouts, skipped=step.skipped, target_tokens=step.target_tokens,
            origin=step._origin, key=step._key, budget=budget,
        )  # fmt: skip

    def halve(self, step: TokenStep) -> TokenStep:
        """The same samples as ``step``, a single pass on a single rank, cut into two passes: its first
        half (rounded up) and the rest, each within the budget as any part of a pass is. A noise
        measurement compares the two passes' gradients with the step's; the samples, their order, the
        counts and the weights are the step's.

        Raises:
            ValueError: ``step`` is not one pass of two samples or more on one rank.
        """
        passes = step.layouts[0].micro_batches if step.world_size == 1 else ()
        if len(passes) != 1 or len(passes[0]) < 2:
            raise ValueError(f"only a single pass of 2 samples or more on 1 rank is halved, not {step!r}")
        samples = passes[0]
        cut = -(-len(samples) // 2)
        parts = (samples[:cut], samples[cut:])
        length_of = dict(zip(step.indices.tolist(), step.lengths.tolist()))
        costs = tuple(micro_batch_cost([length_of[i] for i in part], self.padding) for part in parts)
        return TokenStep(
            epoch=step.epoch, start=step.start, indices=step.indices, lengths=step.lengths,
            layouts=[RankLayout(parts, costs)], skipped=step.skipped, target_tokens=step.target_tokens,
            origin=step._origin, key=step._key, budget=step.budget,
        )  # fmt: skip

    def passes_of(self, lengths: np.ndarray, world_size: int, budget: int) -> int:
        """Passes per rank a step of samples of ``lengths`` takes on ``world_size`` ranks, cut with
        ``budget`` as this sampler cuts its steps (padding, samples cap); the goodput schedule's
        throughput model packs recent lengths with it to predict other batches' passes."""
        return count_passes(
            lengths, world_size=world_size, budget=min(int(budget), self.budget), padding=self.padding,
            max_samples=self.max_micro_batch,
        )  # fmt: skip

    def _pack(
        self, indices: np.ndarray, lengths: np.ndarray, world_size: int, budget: int
    ) -> list[RankLayout]:
        return pack_step(
            indices, lengths, world_size=world_size, budget=budget, padding=self.padding,
            max_samples=self.max_micro_batch, oversize_alone=budget < self.budget,
        )  # fmt: skip

    # -- progress ----------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def train_coverage(self) -> float:
        return self._position / self.num_samples

    @property
    def fractional_epoch(self) -> float:
        return self._epoch + self.train_coverage

    @property
    def samples_consumed(self) -> int:
        return self._consumed

    @property
    def tokens_consumed(self) -> int:
        """Real tokens (lengths, capped with truncation) of the samples handed out."""
        return self._tokens

    @property
    def samples_skipped(self) -> int:
        return self._skipped

    # -- order ---------------------------------------------------------------------------------------
    def _check_lengths(self) -> None:
        # Lengths given as an array are all checked before training starts.
        found = self.lengths.max_known()
        if found is not None and found[1] > self.budget:
            raise ValueError(
                f"sample {found[0]} has length {found[1]} tokens, above micro_batch_tokens "
                f"{self.budget}: raise micro_batch_tokens, drop or split the sample, or set "
                f"truncate_long_samples to cut it to the budget"
            )

    def _epoch_order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:
            self._order = epoch_order(self.num_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return self._order

    def take(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Indices at positions ``start .. stop - 1`` of ``epoch``'s (bucketed) order."""
        order = self._epoch_order(epoch)
        w = self.bucket_window
        if w == 0:
            return order.take(start, stop)
        parts = []
        block = (start // w) * w
        while block < stop:
            if self._block is None or self._block[:2] != (epoch, block):
                idx = order.take(block, min(block + w, self.num_samples))
                idx = idx[np.argsort(self._capped(idx), kind="stable")]
                self._block = (epoch, block, idx)
            idx = self._block[2]
            parts.append(idx[max(start, block) - block : min(stop, block + w) - block])
            block += w
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _capped(self, indices: np.ndarray) -> np.ndarray:
        lengths = self.lengths.get(indices)
        if self.truncate:
            return np.minimum(lengths, self.budget)
        too_long = np.flatnonzero(lengths > self.budget)
        if too_long.size:
            k = int(too_long[0])
            raise ValueError(
                f"sample {int(indices[k])} has length {int(lengths[k])} tokens, above micro_batch_tokens "
                f"{self.budget}: raise micro_batch_tokens, drop or split the sample, or set "
                f"truncate_long_samples to cut it to the budget"
            )
        return lengths

    # -- steps ---------------------------------------------------------------------------------------
    def _cursor(self, after: TokenStep | None) -> tuple[int, int]:
        return (self._epoch, self._position) if after is None else (after.epoch, after.stop)

    def peek_step(self, target_tokens: int, world_size: int, *, after: TokenStep | None = None) -> TokenStep:
        """The step :meth:`next_step` would return, without advancing (``after``: as if it was taken)."""
        target = _count("target_tokens", target_tokens, 1)
        world_size = _count("world_size", world_size, 1)
        origin = self._cursor(after)
        epoch, position = origin
        if position == self.num_samples:
            epoch, position = epoch + 1, 0
        skipped = 0
        indices, lengths = self._gather(epoch, position, target)
        reached = lengths.sum() if self.step_unit == "tokens" else len(lengths)
        if reached < target and self.drop_last and position > 0:
            skipped = self.num_samples - position
            epoch, position = epoch + 1, 0
            indices, lengths = self._gather(epoch, 0, target)
        layouts = self._pack(indices, lengths, world_size, self._pass_budget)
        key = (self.num_samples, self.seed, self.shuffle, self.bucket_window, epoch, position)
        return TokenStep(
            epoch=epoch, start=position, indices=indices, lengths=lengths, layouts=layouts,
            skipped=skipped, target_tokens=target, origin=origin, key=key, budget=self._pass_budget,
        )  # fmt: skip

    def _gather(self, epoch: int, position: int, target: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples from ``position`` until their lengths (or their number) reach ``target``, or the epoch ends."""
        if self.step_unit == "samples":
            idx = self.take(epoch, position, min(self.num_samples, position + target))
            return idx, self._capped(idx)
        got_idx: list[np.ndarray] = []
        got_len: list[np.ndarray] = []
        total, pos = 0, position
        chunk = 64
        while pos < self.num_samples and total < target:
            stop = min(self.num_samples, pos + chunk)
            idx = self.take(epoch, pos, stop)
            lens = self._capped(idx)
            cum = np.cumsum(lens) + total
            k = int(np.searchsorted(cum, target))  # first position where the target is reached
            if k < len(idx):
                got_idx.append(idx[: k + 1])
                got_len.append(lens[: k + 1])
                total = int(cum[k])
                break
            got_idx.append(idx)
            got_len.append(lens)
            total = int(cum[-1])
            pos = stop
            chunk *= 2
        return np.concatenate(got_idx), np.concatenate(got_len)

    def commit(self, step: TokenStep) -> None:
        """Advance past ``step``, peeked at the current position."""
        if step._origin != (self._epoch, self._position) or step._key[:4] != (
            self.num_samples, self.seed, self.shuffle, self.bucket_window,
        ):  # fmt: skip
            raise ValueError(f"{step!r} was not peeked at this sampler's current position; peek again")
        self._epoch, self._position = step.epoch, step.stop
        self._consumed += step.size
        self._tokens += step.tokens
        self._skipped += step.skipped

    def next_step(self, target_tokens: int, world_size: int) -> TokenStep:
        """Take the next step of about ``target_tokens`` tokens laid out on ``world_size`` ranks."""
        step = self.peek_step(target_tokens, world_size)
        self.commit(step)
        return step

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global counts only: resumable on any world size."""
        return {
            "version": TOKEN_STATE_VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "bucket_window": self.bucket_window,
            "epoch": self._epoch,
            "position": self._position,
            "samples_consumed": self._consumed,
            "tokens_consumed": self._tokens,
            "samples_skipped": self._skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses another version, dataset size, seed, shuffle or window."""
        if not isinstance(state, Mapping) or state.get("version") != TOKEN_STATE_VERSION:
            found = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"token sampler state version {found!r} is not supported (reads {TOKEN_STATE_VERSION})"
            )
        for name in ("num_samples", "seed", "shuffle", "bucket_window"):
            if state.get(name) != getattr(self, name):
                raise ValueError(stream_mismatch(name, state.get(name), getattr(self, name)))
        self._epoch = _count("state['epoch']", state.get("epoch"))
        self._position = _count("state['position']", state.get("position"), 0, self.num_samples)
        self._consumed = _count("state['samples_consumed']", state.get("samples_consumed"))
        self._tokens = _count("state['tokens_consumed']", state.get("tokens_consumed"))
        self._skipped = _count("state['samples_skipped']", state.get("samples_skipped"))

    def __repr__(self) -> str:
        return (
            f"TokenBudgetSampler(num_samples={self.num_samples}, micro_batch_tokens={self.budget}, "
            f"padding={self.padding!r}, bucket_window={self.bucket_window}; epoch {self._epoch}, "
            f"position {self._position})"
        )

"""Per-rank torch adapter for token-budget steps: this rank's collated micro-batches of a :class:`TokenStep`.

The runtime asks :meth:`TokenBudgetLoader.plan_for_tokens` for the step of a token target (every rank
forms the same step from the global order, without communicating) and configures DeepSpeed with its
:class:`~ds_adabatch.plan.BatchPlan` (samples, ranks, passes); :meth:`TokenBudgetLoader.next_step` then
collates this rank's micro-batches and commits the step. Ranks hold different numbers of samples per pass
(a pass holds as many as fit the token budget) but run the same number of passes; a rank with fewer
micro-batches runs zero-weight pads (the step's shortest sample, ``num_samples=0``).

Samples are loaded in the training process (``adabatch.data.num_workers`` does not apply).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import default_collate

from ds_adabatch.plan import BatchPlan

from ._workers import fetch_samples
from .loader import MicroBatch, StepBatch
from .tokens import TokenBudgetSampler, TokenStep

__all__ = ["TOKEN_LOADER_STATE_VERSION", "TokenBudgetLoader"]

TOKEN_LOADER_STATE_VERSION = 1
"""Version of :meth:`TokenBudgetLoader.state_dict`."""


class TokenBudgetLoader:
    """Collated token-budget micro-batches of one rank.

    Args:
        dataset: A map-style dataset (``len(dataset) == sampler.num_samples``).
        sampler: The :class:`~ds_adabatch.data.tokens.TokenBudgetSampler` over it.
        rank, world_size: This process's data-parallel rank and the number of ranks.
        collate_fn: Turns a list of samples into a micro-batch, padding as ``sampler.padding`` counts
            (default ``torch.utils.data.default_collate``).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: TokenBudgetSampler,
        *,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if not isinstance(sampler, TokenBudgetSampler):
            raise TypeError(f"sampler must be a TokenBudgetSampler, got {type(sampler).__name__}")
        if len(dataset) != sampler.num_samples:
            raise ValueError(
                f"the lengths cover {sampler.num_samples} samples but the dataset has {len(dataset)}; "
                "give one length per sample"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self._dataset = dataset
        self._sampler = sampler
        self._rank, self._world_size = rank, world_size
        self._collate = collate_fn if collate_fn is not None else default_collate
        self._peeked: TokenStep | None = None

    @property
    def sampler(self) -> TokenBudgetSampler:
        return self._sampler

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def peek_step(self, target_tokens: int) -> TokenStep:
        """The step of ``target_tokens`` at the current position (formed once, then reused)."""
        cursor = (self._sampler.epoch, self._sampler.position)
        step = self._peeked
        if step is None or step.target_tokens != target_tokens or step._origin != cursor:
            step = self._peeked = self._sampler.peek_step(target_tokens, self._world_size)
        return step

    def plan_for_tokens(self, target_tokens: int) -> BatchPlan:
        """The :class:`BatchPlan` (samples, ranks, passes) of the next step of ``target_tokens``."""
        return self.peek_step(target_tokens).plan(self._sampler.max_micro_batch)

    def peek_plan(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` itself: a token step's plan already is the one :meth:`next_step` uses."""
        return plan

    def next_step(self, plan: BatchPlan) -> StepBatch:
        """Collate this rank's micro-batches of the step :meth:`plan_for_tokens` formed, and commit it.

        Raises:
            RuntimeError: no step was formed for ``plan`` at the current position.
        """
        step = self._peeked
        cursor = (self._sampler.epoch, self._sampler.position)
        if step is None or step._origin != cursor or step.plan(self._sampler.max_micro_batch) != plan:
            raise RuntimeError(
                "no token-budget step was formed for this plan at the current position: call "
                "plan_for_tokens(target) first (the engine's next_plan() does)"
            )
        pad: Any = None
        micro = []
        for indices in step.micro_batches(self._rank):
            if indices:
                batch = self._collate(fetch_samples(self._dataset, list(indices)))
                micro.append(MicroBatch(batch, indices, len(indices)))
                continue
            if pad is None:  # every pad pass of the step shares one collated sample
                pad = self._collate(fetch_samples(self._dataset, [step.pad_index]))
            micro.append(MicroBatch(pad, (), 0))
        self._sampler.commit(step)
        self._peeked = None
        return StepBatch(tuple(micro), plan, self._rank, step.epoch, step)  # type: ignore[arg-type]

    def reload(self, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """Not available: a token-budget step cannot be re-cut after an out-of-memory error."""
        raise RuntimeError(
            "a token-budget step cannot be re-run with smaller micro-batches after an out-of-memory "
            "error; lower adabatch.micro_batch_tokens"
        )

    def state_dict(self) -> dict[str, Any]:
        """The sampler's global counts (resumable on any world size)."""
        return {
            "version": TOKEN_LOADER_STATE_VERSION,
            "kind": "tokens",
            "sampler": self._sampler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses another version or the state of a samples-cut loader."""
        if not isinstance(state, Mapping) or state.get("version") != TOKEN_LOADER_STATE_VERSION:
            raise ValueError(
                f"token loader state {state!r:.80} is not of version {TOKEN_LOADER_STATE_VERSION}"
            )
        if state.get("kind") != "tokens":
            raise ValueError(
                f"the checkpoint holds a {state.get('kind')!r} loader's state but this run cuts steps by "
                "tokens (adabatch.micro_batch_tokens); resume with the config the checkpoint was written with"
            )
        self._sampler.load_state_dict(state["sampler"])
        self._peeked = None

    def close(self) -> None:
        """Nothing to stop (samples are loaded in the training process)."""

    def __repr__(self) -> str:
        return f"TokenBudgetLoader(rank {self._rank} of {self._world_size}, {self._sampler!r})"

"""Per-rank torch adapter for token-budget steps: this rank's collated micro-batches of a :class:`TokenStep`.

The runtime asks :meth:`TokenBudgetLoader.plan_for_tokens` for the step of a token target (every rank
forms the same step from the global order, without communicating) and configures DeepSpeed with its
:class:`~ds_adabatch.plan.BatchPlan` (samples, ranks, passes); :meth:`TokenBudgetLoader.next_step` then
collates this rank's micro-batches and commits the step. Ranks hold different numbers of samples per pass
(a pass holds as many as fit the token budget) but run the same number of passes; a rank with fewer
micro-batches runs zero-weight pads (the step's shortest sample, ``num_samples=0``).

Worker processes (``num_workers >= 1``, ``adabatch.data.num_workers`` in a ds_config) are those of
:class:`~ds_adabatch.data.ElasticDataLoader`: each of this rank's micro-batches of a step is one task
(the pads of a step share one), and the step is committed only once all of them are loaded, so a failure
consumes nothing. Once a step's tasks are queued, the step after it under the same token target is formed
(:meth:`TokenBudgetSampler.peek_step` with ``after=``; the sampler does not move) and queued too. The next
step is always formed afresh at :meth:`TokenBudgetLoader.plan_for_tokens`; the queued tasks serve it when
this rank's micro-batches are the same samples (same target, nothing else changed) and are dropped
otherwise, or as soon as another target is asked for. The stream is the same with or without workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ds_adabatch.plan import BatchPlan

from ._workers import WorkerOptions
from .loader import MicroBatch, StepBatch
from .rank_loader import RankLoader, check_collate_fn
from .tokens import TokenBudgetSampler, TokenStep

__all__ = ["TOKEN_LOADER_STATE_VERSION", "TokenBudgetLoader"]

TOKEN_LOADER_STATE_VERSION = 1
"""Version of :meth:`TokenBudgetLoader.state_dict`."""


class TokenBudgetLoader(RankLoader):
    """Collated token-budget micro-batches of one rank.

    Args:
        dataset: A map-style dataset (``len(dataset) == sampler.num_samples``).
        sampler: The :class:`~ds_adabatch.data.tokens.TokenBudgetSampler` over it.
        rank, world_size: This process's data-parallel rank and the number of ranks.
        collate_fn: Turns a list of samples into a micro-batch, padding as ``sampler.padding`` counts
            (default ``torch.utils.data.default_collate``).
        num_workers: Worker processes loading micro-batches in parallel (0: load in this process).
        multiprocessing_context: Start method name (``"fork"``, ``"spawn"``, ``"forkserver"``) or a
            context object for the workers; default is torch's default for the platform.
        worker_init_fn: Called in each worker with its id (0-based) after seeding, before any load.
        timeout: Seconds to wait for one micro-batch from the workers before failing (0: no limit).
        prefetch: With workers, load the next step (under the same token target) while this one trains.

    The worker pool starts at the first :meth:`next_step` and lives until :meth:`close` (or the end of a
    ``with`` block, or garbage collection).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: TokenBudgetSampler,
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
        if not isinstance(sampler, TokenBudgetSampler):
            raise TypeError(f"sampler must be a TokenBudgetSampler, got {type(sampler).__name__}")
        if len(dataset) != sampler.num_samples:
            raise ValueError(
                f"the lengths cover {sampler.num_samples} samples but the dataset has {len(dataset)}; "
                "give one length per sample"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        check_collate_fn(collate_fn)
        options = WorkerOptions.checked(
            num_workers, multiprocessing_context, worker_init_fn, timeout, prefetch
        )
        self._dataset = dataset
        self._sampler = sampler
        self._rank, self._world_size = rank, world_size
        self._peeked: TokenStep | None = None
        self._ahead: TokenStep | None = None  # the step whose micro-batches the workers load ahead
        self._start_loading(dataset, collate_fn, options, seed=sampler.seed)

    @property
    def sampler(self) -> TokenBudgetSampler:
        return self._sampler

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def peek_step(self, target_tokens: int) -> TokenStep:
        """The step of ``target_tokens`` at the current position (formed once, then reused)."""
        cursor = (self._sampler.epoch, self._sampler.position)
        ahead = self._ahead
        if ahead is not None and (ahead.target_tokens != target_tokens or ahead._origin != cursor):
            self._drop_ahead()  # another target: the step loading ahead will not be asked for
        step = self._peeked
        if (
            step is None
            or step.target_tokens != target_tokens
            or step._origin != cursor
            or step.budget != self._sampler.pass_budget  # the learned budget changed (OOM, growth)
        ):
            step = self._peeked = self._sampler.peek_step(target_tokens, self._world_size)
        return step

    def plan_for_tokens(self, target_tokens: int) -> BatchPlan:
        """The :class:`BatchPlan` (samples, ranks, passes) of the next step of ``target_tokens``."""
        return self.peek_step(target_tokens).plan(self._sampler.max_micro_batch)

    def peek_plan(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` itself: a token step's plan already is the one :meth:`next_step` uses."""
        return plan

    def next_step(self, plan: BatchPlan, *, load: bool = True) -> StepBatch:
        """Collate this rank's micro-batches of the step :meth:`plan_for_tokens` formed, and commit it.

        ``load=False`` commits the step without reading a sample (micro-batches with ``batch=None``).

        Raises:
            RuntimeError: the loader is closed, no step was formed for ``plan`` at the current position,
                or a worker failed (the message names the samples; nothing is consumed then).
        """
        if self._closed:
            raise RuntimeError("this TokenBudgetLoader is closed; build a new one to keep loading")
        step = self._peeked
        cursor = (self._sampler.epoch, self._sampler.position)
        if step is None or step._origin != cursor or step.plan(self._sampler.max_micro_batch) != plan:
            raise RuntimeError(
                "no token-budget step was formed for this plan at the current position: call "
                "plan_for_tokens(target) first (the engine's next_plan() does)"
            )
        self._ahead = None
        if not load:
            self._sampler.commit(step)
            self._peeked = None
            micro = tuple(
                MicroBatch(None, indices, len(indices)) for indices in step.micro_batches(self._rank)
            )
            return StepBatch(micro, plan, self._rank, step.epoch, step)  # type: ignore[arg-type]
        try:
            collated = self._steps.load(*self._work(step), ahead=lambda: self._form_ahead(step))
        except BaseException:
            self._ahead = None  # the step loader forgot its queued tasks
            raise
        micro = [
            MicroBatch(value, indices, len(indices))
            for indices, value in zip(step.micro_batches(self._rank), collated)
        ]
        self._sampler.commit(step)
        self._peeked = None
        return StepBatch(tuple(micro), plan, self._rank, step.epoch, step)  # type: ignore[arg-type]

    def _work(self, step: TokenStep) -> tuple[Any, tuple[tuple[int, ...], ...], int]:
        """``step`` as the step loader takes it: key, this rank's passes, the pad sample.

        The key is what the collated passes depend on (this rank's samples per pass and the pad sample),
        so a step loaded ahead serves the step asked for exactly when their passes are the same samples.
        """
        slots = step.micro_batches(self._rank)
        pad = step.pad_index
        return (slots, pad if any(not s for s in slots) else None), slots, pad

    def _form_ahead(self, step: TokenStep) -> tuple[Any, tuple[tuple[int, ...], ...], int] | None:
        """The step after ``step`` under the same target, for the workers to load ahead (``None``: none)."""
        try:
            ahead = self._sampler.peek_step(step.target_tokens, self._world_size, after=step)
        except Exception:
            # Forming it failed (say, an over-long sample): nothing is loaded ahead, and the error is
            # raised where that step is really formed, if it ever is.
            return None
        self._ahead = ahead
        return self._work(ahead)

    def _drop_ahead(self) -> None:
        self._steps.drop_queued()
        self._ahead = None

    def reload(self, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """The same samples as ``step`` (already handed out by :meth:`next_step`), re-cut with the sampler's
        current :attr:`~ds_adabatch.data.tokens.TokenBudgetSampler.pass_budget` and collated again: an
        out-of-memory retry lowers that budget and runs the step's samples in smaller passes. Nothing is
        committed again. Where the budget gives one pass on one rank and ``plan`` asks for two passes of
        the same samples (a noise measurement's half passes, ``runtime/core/draw.py``), the pass is
        halved (:meth:`~ds_adabatch.data.tokens.TokenBudgetSampler.halve`).

        Raises:
            RuntimeError: the re-cut step's plan is not ``plan``.
        """
        token_step = self._sampler.repack(step.global_batch)  # type: ignore[arg-type]
        if token_step.plan(self._sampler.max_micro_batch) != plan:
            halves = (
                token_step.world_size == 1
                and token_step.passes == 1
                and token_step.size >= 2
                and (plan.global_batch_size, plan.gradient_accumulation_steps) == (token_step.size, 2)
            )
            if not halves:
                raise RuntimeError(
                    f"the step re-cut with a token budget of {token_step.budget} has plan "
                    f"{token_step.plan(self._sampler.max_micro_batch)}, not {plan}"
                )
            token_step = self._sampler.halve(token_step)
        # Loaded here, not by the workers: the step loading ahead stays queued for the next step.
        _, slots, pad = self._work(token_step)
        collated = self._steps.load_inline(slots, pad)
        micro = tuple(MicroBatch(value, indices, len(indices)) for indices, value in zip(slots, collated))
        return StepBatch(micro, plan, self._rank, token_step.epoch, token_step)  # type: ignore[arg-type]

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
        self._drop_ahead()  # loaded for the old position: never counted, and not wanted now
        self._sampler.load_state_dict(state["sampler"])
        self._peeked = None

    def close(self) -> None:
        """Stop the worker processes (idempotent). The loader cannot load afterwards."""
        self._ahead = None
        super().close()

    def __repr__(self) -> str:
        return (
            f"TokenBudgetLoader(rank {self._rank} of {self._world_size}, num_workers={self.num_workers}, "
            f"{self._sampler!r})"
        )

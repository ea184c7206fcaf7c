"""Out-of-memory recovery inside one optimizer step: agree, discard, re-plan, re-run the same samples.

The engine wraps one step's forward/backward passes in :meth:`OomRecovery.run`::

    snapshot RNG state and DeepSpeed's micro-step counter
    loop:
        attempt()                                  # the step's micro-batches; begin_pass() before each
        ok -> return
        OOM on some rank, agreed by every rank     # see ds_adabatch.runtime.oom
        discard_partial_step(ds); free cached memory; restore the snapshot
        replan(failed ranks)                        # smaller limit -> new plan -> same samples re-cut

Nothing else moves during a retry: the optimizer, the LR scheduler, the step and sample counters
and the data cursor advance once, when the step finally completes. With recovery off (``memory.
recover_from_oom: false`` and an integer ``max_micro_batch_per_gpu``) :meth:`run` calls the attempt
once and an OOM propagates untouched.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .memory import MicroBatchMemory
from .oom import OomAgreement, PeerOutOfMemory, discard_partial_step, is_out_of_memory

__all__ = ["OomRecovery", "memory_for"]

logger = logging.getLogger("ds_adabatch")
T = TypeVar("T")


class OomRecovery:
    """The learned micro-batch limit plus, when armed, the per-pass agreement and the retry loop."""

    def __init__(
        self,
        ds_engine: Any,
        config: Any,
        *,
        rank: int,
        world_size: int,
        memory: MicroBatchMemory | None = None,
    ) -> None:
        self.deepspeed = ds_engine
        self.memory = memory if memory is not None else memory_for(config)
        self.agreement: OomAgreement | None = None
        if config.memory.recover_from_oom:
            self.agreement = OomAgreement(
                ds_engine, rank=rank, world_size=world_size, device=ds_engine.device
            )
            self.agreement.armed = True
        self.where = ""
        self.ooms = 0  # out-of-memory events recovered so far (global, identical on every rank)

    @property
    def armed(self) -> bool:
        return self.agreement is not None

    def begin_pass(self, where: str) -> None:
        """Called before each micro-batch: a new pass, with its own agreement point."""
        if self.agreement is not None:
            self.where = where
            self.agreement.begin_pass()

    def run(self, attempt: Callable[[], T], replan: Callable[[list[int]], None]) -> T:
        """``attempt()`` until it completes; after an agreed OOM, clean up and call ``replan(ranks)``."""
        if self.agreement is None:
            return attempt()
        snapshot = self._snapshot()
        while True:
            ok, value, ranks = self._try(attempt)
            if ok:
                return value  # type: ignore[return-value]
            self.ooms += 1
            # Outside the except block: the exception's traceback (and the activations its frames
            # hold) is gone, so the cache can really be freed.
            discard_partial_step(self.deepspeed)
            gc.collect()
            _empty_cache()
            self._restore(snapshot)
            replan(ranks)

    def _try(self, attempt: Callable[[], T]) -> tuple[bool, T | None, list[int]]:
        assert self.agreement is not None
        try:
            return True, attempt(), []
        except PeerOutOfMemory as exc:
            return False, None, exc.ranks
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # Raises UnrecoverableOutOfMemory (chained to exc) when this pass already agreed.
            try:
                ranks = self.agreement.report_oom(self.where)
            except Exception as unrecoverable:
                raise unrecoverable from exc
            return False, None, ranks

    def _snapshot(self) -> dict[str, Any]:
        state: dict[str, Any] = {"micro_steps": self.deepspeed.micro_steps, "cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        # The retry draws the same random numbers (dropout) as a first attempt would have, and
        # DeepSpeed's micro-step counter counts each micro-batch of the completed step once.
        self.deepspeed.micro_steps = state["micro_steps"]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


def memory_for(config: Any) -> MicroBatchMemory:
    """The learned micro-batch limit an ``"adabatch"`` section (:class:`AdaBatchConfig`) asks for."""
    return MicroBatchMemory(
        config.initial_micro_batch_limit,
        config.micro_batch_limit,
        grow_after_steps=config.memory.grow_after_steps,
        backoff_factor=config.memory.backoff_factor,
    )


def _empty_cache() -> None:
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().empty_cache()
    except Exception:  # pragma: no cover - a CPU accelerator without a cache
        pass

"""What the ranks must agree on, gathered into as few collectives as possible.

A steady optimizer step needs no collective of ours: the sampler gives every rank the global batch's
size, and a deterministic schedule fed only global values decides the same batch everywhere. Values that
*are* per-rank (a step's loss sum, noise-scale sums, token counts, a user function's answer) are summed
over ranks, and :class:`StepSync` packs everything that is due into one all-reduce:

* :meth:`StepSync.defer` queues values whose sum is not needed yet (the loss of a step, read later);
  they ride along with the next collective the step issues anyway, or with an explicit flush.
* :meth:`StepSync.reduce` issues one all-reduce of the given values plus everything queued, and hands
  the queued values' sums to their callbacks, in the order they were queued.
* :meth:`StepSync.reduce_later` issues that all-reduce of everything queued without waiting for it;
  its callbacks run at the next :meth:`StepSync.complete` or :meth:`StepSync.reduce` (the engine
  completes it at the end of the next step, after the collective has overlapped that step's work).

Every rank must make the same sequence of ``defer`` and ``reduce`` calls; the runtime calls them only at
points that depend on global state (step counts, the config), never on one rank's view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..distributed import comm

__all__ = ["StepSync"]

Values = Sequence[float | torch.Tensor]


class StepSync:
    """Queues per-rank values and sums them over ranks in one all-reduce when one is due.

    Args:
        device: where the packed tensor lives (the engine's device; NCCL needs the GPU).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self._queued: list[tuple[list[float | torch.Tensor], Callable[[list[torch.Tensor]], Any]]] = []
        self._in_flight: tuple[Callable[[], list[torch.Tensor]], list] | None = None
        self.collectives = 0
        """All-reduces issued so far (for metrics and tests)."""

    @property
    def pending(self) -> bool:
        """Whether values are queued for the next collective or an all-reduce of them is in flight."""
        return bool(self._queued) or self._in_flight is not None

    def defer(self, values: Values, on_result: Callable[[list[torch.Tensor]], Any]) -> None:
        """Queue ``values``; ``on_result`` receives their sums (float64 scalars) at the next reduce."""
        self._queued.append((list(values), on_result))

    def reduce_later(self) -> None:
        """Issue the all-reduce of everything queued now, without waiting for it; its callbacks run at
        the next :meth:`complete` (or :meth:`reduce`). With nothing queued it issues nothing."""
        self.complete()
        if not self._queued:
            return
        spans, flat = self._take_queued([])
        self._in_flight = (comm.all_reduce_sum_async(flat, self.device), spans)
        self.collectives += 1

    def complete(self) -> None:
        """Wait for the all-reduce :meth:`reduce_later` issued, if any, and run its callbacks."""
        if self._in_flight is None:
            return
        wait, spans = self._in_flight
        self._in_flight = None
        self._dispatch(wait(), spans)

    def reduce(self, values: Values = ()) -> list[torch.Tensor]:
        """Sum ``values`` and everything queued over all ranks in one collective; return ``values``' sums.

        An all-reduce in flight is completed first. Queued callbacks run before this returns, oldest
        first. With nothing to sum it issues nothing.
        """
        self.complete()
        spans, flat = self._take_queued(list(values))
        if not flat:
            return []
        summed = comm.all_reduce_sum(flat, self.device)
        self.collectives += 1
        self._dispatch(summed, spans)
        return summed[: len(values)]

    def _take_queued(self, flat: list[float | torch.Tensor]) -> tuple[list, list[float | torch.Tensor]]:
        spans = []
        for queued, callback in self._queued:
            spans.append((len(flat), len(queued), callback))
            flat.extend(queued)
        self._queued = []
        return spans, flat

    @staticmethod
    def _dispatch(summed: list[torch.Tensor], spans: list) -> None:
        for start, n, callback in spans:
            callback(summed[start : start + n])

"""Cut one step's samples into micro-batches under a token budget and deal them to ranks.

Pure functions of the step's ``(indices, lengths)`` and the world size, so every rank computes the same
layout on its own. Costs are counted the way the collate lays a micro-batch out:

- ``"pad_to_longest"``: ``n x longest`` tokens (every row padded to the longest sample),
- ``"packed"``: ``sum of lengths`` (samples concatenated into one row).

Micro-batches are formed longest first: with ``pad_to_longest`` a run of samples of similar lengths
shares a micro-batch until the next one would exceed the budget (first fit over lengths sorted in
descending order); with ``packed`` each sample goes into the first micro-batch with room (first-fit
decreasing). Micro-batches are then dealt, most expensive first, to the rank with the fewest padded
tokens among the ranks that still have fewer than ``ceil(micro-batches / world_size)`` of them, so every
rank runs the minimal number of passes and the largest rank's padded tokens stay close to the mean.
Ranks left with fewer micro-batches run zero-weight pads: the step's shortest sample, weighted 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PADDING_MODES", "RankLayout", "count_passes", "micro_batch_cost", "pack_step"]

PADDING_MODES = ("pad_to_longest", "packed")


def micro_batch_cost(lengths: np.ndarray | list[int], padding: str) -> int:
    """Tokens a micro-batch of samples of ``lengths`` occupies under ``padding`` (0 when empty)."""
    if len(lengths) == 0:
        return 0
    if padding == "pad_to_longest":
        return int(len(lengths) * max(lengths))
    if padding == "packed":
        return int(sum(lengths))
    raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")


@dataclass(frozen=True)
class RankLayout:
    """One rank's micro-batches of a step: sample indices per pass, ``()`` for a zero-weight pad.

    Attributes:
        micro_batches: Dataset indices of each pass, in order (pads last, as ``()``).
        costs: Padded tokens of each pass (the pad's cost is that of the pad sample).
    """

    micro_batches: tuple[tuple[int, ...], ...]
    costs: tuple[int, ...]

    @property
    def padded_tokens(self) -> int:
        """Tokens this rank processes in the step, pads and padding included."""
        return sum(self.costs)


def _form_micro_batches(
    lengths: np.ndarray, budget: int, padding: str, max_samples: int | None
) -> list[list[int]]:
    """Positions (into ``lengths``) of each micro-batch, longest samples first."""
    # Stable sort: equal lengths keep their order in the step, so the layout is deterministic.
    order = np.argsort(-lengths, kind="stable")
    cap = max_samples if max_samples is not None else len(lengths)
    bins: list[list[int]] = []
    if padding == "pad_to_longest":
        # Descending lengths: a bin's first sample is its longest, so it holds budget // longest.
        current: list[int] = []
        longest = 0
        for pos in order.tolist():
            length = int(lengths[pos])
            if current and ((len(current) + 1) * longest > budget or len(current) >= cap):
                bins.append(current)
                current = []
            if not current:
                longest = length
            current.append(pos)
        if current:
            bins.append(current)
        return bins
    loads: list[int] = []
    for pos in order.tolist():
        length = int(lengths[pos])
        for b, load in enumerate(loads):
            if load + length <= budget and len(bins[b]) < cap:
                bins[b].append(pos)
                loads[b] += length
                break
        else:
            bins.append([pos])
            loads.append(length)
    return bins


def count_passes(
    lengths: np.ndarray,
    *,
    world_size: int,
    budget: int,
    padding: str = "pad_to_longest",
    max_samples: int | None = None,
) -> int:
    """Passes per rank :func:`pack_step` gives a step of samples of ``lengths`` (a sample longer than
    ``budget`` counted alone in its pass), without laying it out: the micro-batches it forms dealt to
    ``world_size`` ranks."""
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0
    return -(-len(_form_micro_batches(lengths, budget, padding, max_samples)) // world_size)


def pack_step(
    indices: np.ndarray,
    lengths: np.ndarray,
    *,
    world_size: int,
    budget: int,
    padding: str = "pad_to_longest",
    max_samples: int | None = None,
    oversize_alone: bool = False,
) -> list[RankLayout]:
    """Lay out one step's samples as micro-batches of at most ``budget`` tokens on ``world_size`` ranks.

    Args:
        indices: Dataset indices of the step's samples (in the step's order).
        lengths: Their lengths in tokens (already capped at ``budget`` where truncation applies);
            each must be ``1 .. budget``.
        world_size: Data-parallel ranks.
        budget: Largest cost of one micro-batch, in tokens (see :func:`micro_batch_cost`).
        padding: ``"pad_to_longest"`` or ``"packed"``.
        max_samples: Optional cap on samples per micro-batch as well.
        oversize_alone: A sample longer than ``budget`` runs alone in its own micro-batch instead of
            being an error (the budget learned after an out-of-memory error can be below the longest
            sample, which still fits on its own).

    Returns:
        One :class:`RankLayout` per rank, all with the same number of passes.
    """
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(indices) != len(lengths) or len(indices) == 0:
        raise ValueError("a step needs at least one sample and one length per sample")
    too_long = np.flatnonzero(lengths > budget)
    if too_long.size and not oversize_alone:
        i = int(too_long[0])
        raise ValueError(
            f"sample {int(indices[i])} has length {int(lengths[i])}, above the token budget {budget}"
        )
    bins = _form_micro_batches(lengths, budget, padding, max_samples)
    costs = [micro_batch_cost(lengths[b], padding) for b in bins]
    passes = -(-len(bins) // world_size)
    loads = [0] * world_size
    counts = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    # Most expensive first onto the least-loaded rank with a free pass (ties: the lowest rank).
    for b in sorted(range(len(bins)), key=lambda k: (-costs[k], k)):
        rank = min((r for r in range(world_size) if counts[r] < passes), key=lambda r: (loads[r], r))
        assigned[rank].append(b)
        loads[rank] += costs[b]
        counts[rank] += 1
    pad_pos = int(np.argmin(lengths))
    pad_cost = micro_batch_cost([int(lengths[pad_pos])], padding)
    layouts = []
    for rank in range(world_size):
        own = assigned[rank]
        micro = [tuple(int(indices[p]) for p in bins[b]) for b in own]
        cost = [costs[b] for b in own]
        micro += [()] * (passes - len(own))
        cost += [pad_cost] * (passes - len(own))
        layouts.append(RankLayout(tuple(micro), tuple(cost)))
    return layouts

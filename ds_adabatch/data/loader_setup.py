"""One rank's loader for a run: samples cut by the plan, or steps cut by a token budget.

``ds_adabatch.initialize`` and the Hugging Face Trainer integration build their loader here, from the
sample order they settled (the config's ``data`` section, or ``TrainingArguments`` where the section
leaves a key out) and, with ``adabatch.micro_batch_tokens``, the token-budget sampler over the samples'
lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from .loader import ElasticDataLoader
from .sampler import ElasticSampler
from .token_loader import TokenBudgetLoader
from .tokens import TokenBudgetSampler

__all__ = ["DataOrder", "SampleOrder", "build_rank_loader"]


class SampleOrder(Protocol):
    """How the global sample order is drawn and loaded (``adabatch.data``, or :class:`DataOrder`)."""

    @property
    def shuffle(self) -> bool: ...

    @property
    def seed(self) -> int: ...

    @property
    def drop_last(self) -> bool: ...

    @property
    def num_workers(self) -> int: ...


@dataclass(frozen=True)
class DataOrder:
    """A :class:`SampleOrder` settled outside the config (the Trainer's arguments)."""

    shuffle: bool
    """Shuffle the order every epoch."""
    seed: int
    """The order's seed."""
    drop_last: bool
    """Skip an epoch's tail smaller than the requested batch."""
    num_workers: int
    """Worker processes loading micro-batches (0: loaded in the training process)."""


def build_rank_loader(
    dataset: Any,
    order: SampleOrder,
    *,
    token_sampler: TokenBudgetSampler | None = None,
    rank: int,
    world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    multiprocessing_context: str | Any | None = None,
) -> ElasticDataLoader | TokenBudgetLoader | None:
    """This data-parallel rank's loader over ``dataset`` (every process of a replica builds the same one).

    With ``token_sampler`` (``adabatch.micro_batch_tokens``) a :class:`TokenBudgetLoader` over it; else
    an :class:`ElasticDataLoader` with an :class:`ElasticSampler` drawn as ``order`` says (an
    ``IterableDataset`` is read in its own order, without one). None without a dataset.
    """
    common = {
        "rank": rank,
        "world_size": world_size,
        "collate_fn": collate_fn,
        "num_workers": order.num_workers,
        "multiprocessing_context": multiprocessing_context,
    }
    if token_sampler is not None:
        return TokenBudgetLoader(dataset, token_sampler, **common)
    if dataset is None:
        return None
    sampler = None
    if not isinstance(dataset, IterableDataset):
        sampler = ElasticSampler(
            len(dataset), shuffle=order.shuffle, seed=order.seed, drop_last=order.drop_last
        )
    return ElasticDataLoader(dataset, sampler, **common)

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

from ..config import ConfigProblem
from .loader import ElasticDataLoader
from .sampler import ElasticSampler
from .token_loader import TokenBudgetLoader
from .tokens import TokenBudgetSampler

__all__ = ["DataOrder", "SampleOrder", "build_rank_loader", "drop_last_problems"]

_FIXED_SCHEDULES = ("constant", "linear", "step", "piecewise")
"""Schedules whose every batch is written in the config (their endpoints bound them)."""


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


def drop_last_problems(
    config: Any, num_samples: int, *, drop_last: bool, drop_last_key: str = "adabatch.data.drop_last"
) -> list[ConfigProblem]:
    """What to change where ``drop_last`` meets a global batch larger than the dataset.

    Such a batch never fits an epoch, so ``drop_last`` would skip every sample of every epoch: the
    largest batch the run can ask for must be at most ``num_samples``. That is the endpoints of a
    schedule whose batches are all in the config (within ``max_global_batch``), else
    ``max_global_batch``; schedules that grow without a written bound (the adaptive rules and a callable
    without ``max_global_batch``) are not known here, and the sampler refuses such a batch when it is
    drawn. Token budgets are left out: their steps take what the epoch holds.
    """
    schedule = config.schedule
    if not drop_last or config.token_budget or schedule.batch_unit != "samples":
        return []
    if schedule.type in _FIXED_SCHEDULES:  # its endpoints (within max_global_batch, as the config checks)
        bounds = [(f"adabatch.schedule.{field}", batch) for field, batch in schedule.endpoint_batches()]
    elif config.max_global_batch is not None:
        bounds = [("adabatch.max_global_batch", config.max_global_batch)]
    else:
        return []
    return [
        ConfigProblem(
            path,
            f"is larger than the dataset ({num_samples} samples), and with {drop_last_key} true a batch "
            f"larger than the dataset skips every sample of every epoch: set it to at most {num_samples}, "
            f"or {drop_last_key} false (a batch then takes what is left of the epoch)",
            batch,
        )
        for path, batch in bounds
        if batch > num_samples
    ]


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

"""The global sample stream: one deterministic order per (seed, epoch), cut into global batches and
sharded to ranks for the current plan; resumable on any world size.

``ElasticSampler`` and the order functions are pure (numpy only). The torch adapter
(``ElasticDataLoader``, ``StepBatch``, ``MicroBatch``) imports torch on first use, so the sampler stays
usable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lengths import SampleLengths
from .order import MAX_NUM_SAMPLES, EpochOrder, epoch_order
from .packing import RankLayout, pack_step
from .sampler import ElasticSampler, GlobalBatch
from .tokens import TokenBudgetSampler, TokenStep

if TYPE_CHECKING:  # pragma: no cover
    from .loader import ElasticDataLoader, MicroBatch, StepBatch
    from .token_loader import TokenBudgetLoader

_LAZY = {"ElasticDataLoader", "MicroBatch", "StepBatch"}

__all__ = [
    "MAX_NUM_SAMPLES",
    "ElasticDataLoader",
    "ElasticSampler",
    "EpochOrder",
    "GlobalBatch",
    "MicroBatch",
    "RankLayout",
    "SampleLengths",
    "StepBatch",
    "TokenBudgetLoader",
    "TokenBudgetSampler",
    "TokenStep",
    "epoch_order",
    "pack_step",
]


def __getattr__(name: str):
    if name == "TokenBudgetLoader":
        from .token_loader import TokenBudgetLoader

        globals()[name] = TokenBudgetLoader
        return TokenBudgetLoader
    if name not in _LAZY:
        raise AttributeError(f"module 'ds_adabatch.data' has no attribute {name!r}")
    from . import loader

    value = getattr(loader, name)
    globals()[name] = value
    return value

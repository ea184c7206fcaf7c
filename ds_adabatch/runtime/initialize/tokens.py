"""Build the token-budget sampler of ``ds_adabatch.initialize`` from the config and the user's lengths."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...config import AdaBatchConfig
from ...data.lengths import SampleLengths
from ...data.token_config import sampler_for_config
from ...data.tokens import TokenBudgetSampler

if TYPE_CHECKING:
    import numpy as np

__all__ = ["sampler_for_config", "token_budget_sampler"]


def token_budget_sampler(
    cfg: AdaBatchConfig,
    training_data: torch.utils.data.Dataset | None,
    lengths: Sequence[int] | np.ndarray | None,
    length_fn: Callable[[Any], int] | None,
) -> TokenBudgetSampler | None:
    """The :class:`TokenBudgetSampler` of a ``micro_batch_tokens`` config (None without one).

    Raises:
        ValueError: lengths are missing, given without ``micro_batch_tokens``, do not match the dataset,
            or a sample is longer than the budget (named with its index and length).
    """
    given = lengths is not None or length_fn is not None
    if not cfg.token_budget:
        if given:
            raise ValueError(
                "lengths / length_fn only apply with adabatch.micro_batch_tokens (token-budget "
                "micro-batches): set micro_batch_tokens in the config, or drop the argument"
            )
        return None
    if training_data is None or isinstance(training_data, torch.utils.data.IterableDataset):
        raise ValueError(
            "adabatch.micro_batch_tokens needs a map-style training_data (with __len__ and __getitem__): "
            "steps are formed from the global sample order"
        )
    if lengths is not None and length_fn is not None:
        raise ValueError("give either lengths= or length_fn=, not both")
    if not given:
        raise ValueError(
            "adabatch.micro_batch_tokens needs every sample's length: pass lengths=[...] (tokens per "
            "sample) or length_fn=lambda sample: ... to ds_adabatch.initialize"
        )
    sample_lengths = SampleLengths(
        len(training_data), lengths=lengths, length_fn=length_fn, dataset=training_data
    )
    return sampler_for_config(
        cfg, sample_lengths, shuffle=cfg.data.shuffle, seed=cfg.data.seed, drop_last=cfg.data.drop_last
    )

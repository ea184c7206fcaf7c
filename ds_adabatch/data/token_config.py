"""The token-budget sampler a config's ``micro_batch_tokens`` keys describe, shared by every path that
forms token-budget steps: ``ds_adabatch.initialize``, the Hugging Face Trainer and ``ds-adabatch
simulate``."""

from __future__ import annotations

from ..config import AdaBatchConfig
from .lengths import SampleLengths
from .tokens import TokenBudgetSampler

__all__ = ["sampler_for_config"]


def sampler_for_config(
    cfg: AdaBatchConfig, lengths: SampleLengths, *, shuffle: bool, seed: int, drop_last: bool
) -> TokenBudgetSampler:
    """The :class:`TokenBudgetSampler` the token-budget keys of ``cfg`` describe, over ``lengths``
    (the sample order's ``shuffle``, ``seed`` and ``drop_last`` come from the caller: the ``data``
    section, or the Hugging Face ``TrainingArguments``)."""
    micro = cfg.max_micro_batch_per_gpu
    return TokenBudgetSampler(
        lengths,
        micro_batch_tokens=int(cfg.micro_batch_tokens),
        padding=cfg.padding,
        max_micro_batch=micro if isinstance(micro, int) else None,
        bucket_window=cfg.bucket_window,
        truncate=cfg.truncate_long_samples,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        step_unit=cfg.schedule.batch_unit,
    )

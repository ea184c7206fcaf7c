"""Adapters to training frameworks: the Hugging Face ``Trainer`` (install with the ``hf`` extra).

``from ds_adabatch.integrations import AdaptiveBatchSizeTrainer`` imports transformers only when the
name is first touched, so importing this package (or ``ds_adabatch``) stays free of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .transformers import AdaptiveBatchSizeTrainer, AdaptiveBatchState

_LAZY = {"AdaptiveBatchSizeTrainer", "AdaptiveBatchState"}

__all__ = ["AdaptiveBatchSizeTrainer", "AdaptiveBatchState"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ds_adabatch.integrations' has no attribute {name!r}")
    from . import transformers

    value = getattr(transformers, name)
    globals()[name] = value
    return value

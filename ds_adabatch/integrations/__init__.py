"""Adapters to training frameworks: the Hugging Face ``Trainer`` (install with the ``hf`` extra).

``from ds_adabatch.integrations import AdaptiveBatchSizeTrainer`` imports transformers only when the
name is first touched, so importing this package (or ``ds_adabatch``) stays free of it. The Trainer
integration is the package :mod:`ds_adabatch.integrations.hf` (its ``__init__`` says what each module
does); ``ds_adabatch.integrations.transformers`` re-exports it under its first published name.
Custom loops under Hugging Face accelerate use :func:`ds_adabatch.integrations.accelerate.prepare` (the
package :mod:`ds_adabatch.integrations.accelerate`, imported by name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .hf import AdaptiveBatchSizeTrainer, AdaptiveBatchState

_LAZY = {"AdaptiveBatchSizeTrainer", "AdaptiveBatchState"}

__all__ = ["AdaptiveBatchSizeTrainer", "AdaptiveBatchState"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ds_adabatch.integrations' has no attribute {name!r}")
    from . import hf

    value = getattr(hf, name)
    globals()[name] = value
    return value

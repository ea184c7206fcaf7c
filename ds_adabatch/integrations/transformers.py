"""Where ``AdaptiveBatchSizeTrainer`` was first published; the code lives in :mod:`ds_adabatch.integrations.hf`.

``from ds_adabatch.integrations.transformers import AdaptiveBatchSizeTrainer`` keeps working: this module
re-exports the public names of :mod:`ds_adabatch.integrations.hf.trainer` (and imports transformers, as
that module does). New code can import from ``ds_adabatch.integrations`` or
``ds_adabatch.integrations.hf``.
"""

from __future__ import annotations

from .hf.trainer import STATE_FILE, AdaptiveBatchSizeTrainer, AdaptiveBatchState, BatchSizeScheduler

__all__ = ["STATE_FILE", "AdaptiveBatchSizeTrainer", "AdaptiveBatchState", "BatchSizeScheduler"]

"""ds_adabatch: change a DeepSpeed job's global batch size while it runs, exactly.

The light layers (config, planner, schedules, data) import without DeepSpeed; ``initialize``,
``AdaptiveBatchEngine`` and ``AdaptivePipelineEngine`` import DeepSpeed on first use, so ``import ds_adabatch`` stays fast and never
imports transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .config.errors import ConfigError
from .plan import (
    BatchPlan,
    CompatibleBatchSize,
    PlanError,
    compatible_batch_sizes,
    plan_batch,
    round_global_batch,
)

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint_manifest import CheckpointCorrupt
    from .config import AdaBatchConfig, LoadedConfig, load_ds_config
    from .data import SampleLengths, TokenBudgetSampler
    from .runtime import (
        AdaptiveBatchEngine,
        AdaptivePipelineEngine,
        LiveRecoveryFailed,
        UnrecoverableOutOfMemory,
    )
    from .runtime.distributed.comm import finish
    from .runtime.distributed.process_group import init_distributed
    from .runtime.initialize import initialize

_LAZY = {
    "AdaBatchConfig": "ds_adabatch.config",
    "LoadedConfig": "ds_adabatch.config",
    "load_ds_config": "ds_adabatch.config",
    "AdaptiveBatchEngine": "ds_adabatch.runtime",
    "AdaptivePipelineEngine": "ds_adabatch.runtime",
    "initialize": "ds_adabatch.runtime",
    "UnrecoverableOutOfMemory": "ds_adabatch.runtime",
    "LiveRecoveryFailed": "ds_adabatch.runtime",
    "SampleLengths": "ds_adabatch.data",
    "TokenBudgetSampler": "ds_adabatch.data",
    "CheckpointCorrupt": "ds_adabatch.checkpoint_manifest",
    "finish": "ds_adabatch.runtime.distributed.comm",
    "init_distributed": "ds_adabatch.runtime.distributed.process_group",
}

__all__ = [
    "AdaBatchConfig",
    "AdaptiveBatchEngine",
    "AdaptivePipelineEngine",
    "BatchPlan",
    "CheckpointCorrupt",
    "CompatibleBatchSize",
    "ConfigError",
    "LiveRecoveryFailed",
    "LoadedConfig",
    "PlanError",
    "SampleLengths",
    "TokenBudgetSampler",
    "UnrecoverableOutOfMemory",
    "__version__",
    "compatible_batch_sizes",
    "finish",
    "init_distributed",
    "initialize",
    "load_ds_config",
    "plan_batch",
    "round_global_batch",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_adabatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

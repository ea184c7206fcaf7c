"""Make a DeepSpeed engine's notion of the batch match a :class:`~ds_adabatch.plan.BatchPlan`.

Used between optimizer steps by :class:`~ds_adabatch.runtime.AdaptiveBatchEngine` and by the Hugging
Face Trainer integration. The accumulation boundary itself is not derived from these values: callers
set it explicitly on every micro-batch (DeepSpeed's ``micro_steps % GAS`` rule fires early after a GAS
change).
"""

from __future__ import annotations

from typing import Any

from ...plan import BatchPlan

__all__ = ["apply_plan_to_engine"]


def apply_plan_to_engine(engine: Any, plan: BatchPlan) -> None:
    """Write ``plan`` into a ``DeepSpeedEngine``: batch keys, ZeRO optimizer GAS, throughput timer."""
    keys = plan.deepspeed_batch_keys()
    # DeepSpeed 0.19.8: set_train_micro_batch_size / set_train_batch_size only overwrite
    # engine._config; micro first, then total (set_train_batch_size derives GAS from the micro).
    engine.set_train_micro_batch_size(keys["train_micro_batch_size_per_gpu"])
    engine.set_train_batch_size(keys["train_batch_size"])
    # ZeRO 1/2/3 optimizers copy GAS at construction; stage 1/2 reads it on the CPU-offload path.
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = plan.gradient_accumulation_steps
    # The throughput timer captured train_batch_size at construction.
    if getattr(engine, "tput_timer", None) is not None:
        engine.tput_timer.batch_size = plan.global_batch_size

"""What one optimizer step of the Trainer integration does to DeepSpeed, the LR scheduler and the loss.

Plain functions over the objects transformers and accelerate build, each naming the version of the
internals it relies on, so the Trainer subclass stays a thin list of overrides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ds_adabatch.plan import BatchPlan
from ds_adabatch.runtime.core.batch_shape import apply_plan_to_engine
from ds_adabatch.runtime.core.lr import BatchCoupledLR
from ds_adabatch.runtime.core.weights import IGNORE_INDEX

from .state import LrSettings

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator
    from deepspeed import DeepSpeedEngine

__all__ = [
    "apply_plan_to_engine",
    "count_target_tokens",
    "couple_scheduler",
    "deepspeed_engine",
    "loss_shifts_labels",
    "seed_deepspeed_batch_keys",
]


def deepspeed_engine(accelerator: Accelerator) -> DeepSpeedEngine | None:
    """The DeepSpeed engine ``accelerator`` built (None before it exists, or without DeepSpeed).

    accelerate 1.15 keeps it in ``Accelerator.deepspeed_engine_wrapped.engine`` once ``prepare`` ran.
    """
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


def seed_deepspeed_batch_keys(config: dict[str, Any], plan: BatchPlan) -> None:
    """Write the batch keys the DeepSpeed engine is built with (the plan's micro-batch, GAS 1).

    accelerate 1.15 ``Accelerator._prepare_deepspeed`` reads them from the plugin's config dict; with a
    GAS other than its own (1) it warns and takes DeepSpeed's, so the engine starts at GAS 1 and the
    first step sets the plan's real shape (:func:`apply_plan_to_engine`).
    """
    micro = plan.micro_batch_per_gpu
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = micro * plan.world_size


def couple_scheduler(
    scheduler: Any, *, optimizer: torch.optim.Optimizer | None, engine: DeepSpeedEngine | None, lr: LrSettings
) -> tuple[Any, BatchCoupledLR | None]:
    """Put a ``BatchCoupledLR`` where the scheduler is stepped; returns (the Trainer's scheduler, coupling).

    ``engine`` is the DeepSpeed engine once accelerate has built it, else None.
    """
    if isinstance(scheduler, BatchCoupledLR):
        return scheduler, scheduler
    if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return scheduler, None  # stepped with metrics by evaluate(), not a function of samples
    if type(scheduler).__name__ == "DummyScheduler":
        # accelerate 1.15's placeholder for DeepSpeed's config scheduler (or a callable building one),
        # replaced when the engine is built: the trainer couples the real one then (transformers 4.57
        # also asks create_scheduler before the engine exists).
        return scheduler, None
    settings = {
        "unit": lr.unit,
        "reference_batch": lr.reference_batch,
        "rule": lr.rule,
        "gain_power": lr.gain_power,
    }
    if engine is not None and type(scheduler).__name__ == "DeepSpeedSchedulerWrapper":
        # DeepSpeed 0.19.8 steps engine.lr_scheduler inside its boundary step() and checkpoints its
        # state_dict; accelerate 1.15's DeepSpeedSchedulerWrapper (step() a no-op) reads get_last_lr
        # and state_dict from .scheduler. The coupling takes both slots.
        if not isinstance(engine.lr_scheduler, BatchCoupledLR):
            engine.lr_scheduler = BatchCoupledLR(engine.optimizer, engine.lr_scheduler, **settings)
        scheduler.scheduler = engine.lr_scheduler
        return scheduler, engine.lr_scheduler
    # A scheduler the Trainer steps itself (no DeepSpeed, or DeepSpeed with the Trainer's scheduler):
    # transformers 5.23 saves and loads it as scheduler.pt through state_dict / load_state_dict.
    coupled = BatchCoupledLR(optimizer, scheduler, **settings)
    return coupled, coupled


def loss_shifts_labels(model: Any, trainer_flag: bool) -> bool:
    """Whether ``model``'s loss predicts ``labels[..., 1:]`` (a causal LM), so only those are counted.

    transformers 5.23 sets ``Trainer._loss_shifts_labels`` (``trainer_flag``) from
    ``LOSS_MAPPING[model.loss_type]``, which misses models whose ``loss_type`` is None (a
    ``GPT2LMHeadModel`` built from a config): their ``loss_function`` still falls back to the causal
    loss, which shifts.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = getattr(model, "config", None)
    causal = getattr(model, "loss_function", None) is ForCausalLMLoss
    return bool(trainer_flag or (causal and not getattr(config, "is_encoder_decoder", False)))


def count_target_tokens(batch: Mapping[str, Any], shifted: bool) -> int:
    """Target tokens of a micro-batch, as transformers 5.23 ``Trainer._get_num_items_in_batch`` counts.

    Counted on the host: a collated batch is still on the CPU here (the step loader is not accelerate's,
    whose batches are already on the device), so counting reads no device value.
    """
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    elif shifted:
        labels = batch["labels"][..., 1:]
    else:
        labels = batch["labels"]
    if isinstance(labels, torch.Tensor) and labels.device.type == "cpu":
        return int(np.count_nonzero(labels.numpy() != IGNORE_INDEX))
    return int((torch.as_tensor(labels) != IGNORE_INDEX).sum())

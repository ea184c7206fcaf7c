"""Process-group helpers of the Trainer integration: make the launched ranks one data-parallel group.

Hugging Face ``TrainingArguments`` decides the process layout when it is created. On a machine
without GPUs, a ``torchrun --nproc-per-node 2`` launch with the default ``use_cpu=False`` gives every
rank a world of one (transformers 5.23, ``TrainingArguments._setup_devices``): the launcher's
process group exists but the Trainer ignores it, both ranks act as the main process, and every sample
is trained once per rank. :func:`ensure_data_parallel_group` detects that and rebuilds the arguments
with ``use_cpu=True``, which makes the ranks one gloo data-parallel group (DeepSpeed included).

The step's collectives are ``ds_adabatch.runtime.distributed.comm``'s, on ``torch.distributed``'s default group,
which is the Trainer's with and without DeepSpeed.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

import torch

__all__ = [
    "ensure_data_parallel_group",
    "launcher_world_size",
    "trainer_arguments",
]

logger = logging.getLogger("ds_adabatch")


def launcher_world_size() -> int:
    """Ranks the launcher started (``WORLD_SIZE``, or the initialised default group's size), else 1."""
    try:
        from_env = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        from_env = 1
    from_group = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from_group = torch.distributed.get_world_size()
    return max(from_env, from_group)


def ensure_data_parallel_group(args: Any) -> Any:
    """``args`` when the Trainer sees every launched rank; otherwise arguments that make it see them.

    When the launcher started ``n > 1`` ranks but ``args.world_size`` is 1, each rank would train
    alone on the whole dataset. On a CPU device the arguments are rebuilt with ``use_cpu=True`` (a
    copy: the caller's object is left alone); on any other device a ``ValueError`` says what to set.

    Raises:
        ValueError: the duplicate-training layout on a non-CPU device, or a rebuilt layout that still
            does not match the launcher.
    """
    launched = launcher_world_size()
    if launched <= 1 or args.world_size == launched:
        return args
    problem = (
        f"the launcher started {launched} ranks but TrainingArguments set up a world of "
        f"{args.world_size}: every rank would train alone on the whole dataset ({launched}-fold duplicate "
        "training)"
    )
    if args.world_size != 1 or args.device.type != "cpu" or args.use_cpu:
        raise ValueError(
            f"AdaptiveBatchSizeTrainer: {problem}. Make the ranks one data-parallel group: on CPU pass "
            "TrainingArguments(use_cpu=True); on accelerators launch one process per device."
        )
    # transformers 5.23: use_cpu=True selects PartialState(cpu=True, backend=ddp_backend), which joins
    # the launcher's ranks in one gloo group; dataclasses.replace re-runs __post_init__, so the device
    # set-up and DeepSpeed's "auto" batch keys are derived again for the real world size.
    fixed = dataclasses.replace(args, use_cpu=True)
    if fixed.world_size != launched:
        raise ValueError(
            f"AdaptiveBatchSizeTrainer: {problem}, and use_cpu=True gave a world of {fixed.world_size}; "
            "launch with torchrun (or the deepspeed launcher) so RANK and WORLD_SIZE are set"
        )
    if fixed.process_index == 0:
        logger.warning(
            "AdaptiveBatchSizeTrainer: %s; continuing with use_cpu=True so the %d ranks train as one "
            "data-parallel group (pass use_cpu=True to TrainingArguments to silence this)",
            problem,
            launched,
        )
    return fixed


def trainer_arguments(args: Any) -> Any:
    """The arguments the Trainer runs with: one data-parallel group, and its own loop at GAS 1.

    transformers 5.23 ``Trainer._run_epoch`` groups ``gradient_accumulation_steps`` loader items into
    one optimizer step; every item of an ``AdaptiveBatchSizeTrainer`` is a whole step, so the loop must
    see 1 (the plan holds the real accumulation steps). A copy: the caller's object keeps its values.

    Raises:
        ValueError: ``auto_find_batch_size`` or ``DataParallel`` (several GPUs in one process), or ranks
            that cannot form one group (see :func:`ensure_data_parallel_group`).
    """
    args = ensure_data_parallel_group(args)
    if args.auto_find_batch_size:
        raise ValueError("AdaptiveBatchSizeTrainer chooses the batch itself: set auto_find_batch_size=False")
    if args.n_gpu > 1:
        raise ValueError(
            f"AdaptiveBatchSizeTrainer needs one process per device, but this process sees {args.n_gpu} "
            "GPUs (DataParallel): launch with torchrun --nproc-per-node N"
        )
    args = copy.copy(args)
    args.gradient_accumulation_steps = 1
    return args

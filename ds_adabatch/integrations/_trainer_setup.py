"""Building an ``AdaptiveBatchSizeTrainer`` run's batch state from its ``TrainingArguments``.

Where the global batch comes from:

* a ``batch_size_scheduler(step, batch_size)``: a ``callable`` schedule counted per device, started at
  ``per_device_train_batch_size x gradient_accumulation_steps``, with the largest micro-batch
  ``per_device_train_batch_size`` (a growing batch adds accumulation steps, not memory);
* else the ``"adabatch"`` section of the DeepSpeed config in ``TrainingArguments(deepspeed=...)``;
* else a constant ``per_device_train_batch_size x gradient_accumulation_steps x world size``.

An ``"adabatch"`` section next to a scheduler still sets the bounds, granularity, largest micro-batch,
LR coupling and loss normalisation. The sample order always follows ``TrainingArguments``
(``data_seed`` or ``seed``, ``dataloader_drop_last``, ``dataloader_num_workers``).

With ``micro_batch_tokens`` in the section, steps are token-budget steps (``padding``, ``bucket_window``,
``truncate_long_samples`` and a schedule with ``unit: "tokens"`` as for ``ds_adabatch.initialize``): the
:class:`~ds_adabatch.data.tokens.TokenBudgetSampler` walks the same seeded global order and cuts each
step into passes of at most that many tokens; the lengths come from ``_trainer_lengths``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_adabatch.config import AdaBatchConfig, load_ds_config
from ds_adabatch.data import ElasticDataLoader, ElasticSampler
from ds_adabatch.data.lengths import SampleLengths
from ds_adabatch.data.token_loader import TokenBudgetLoader
from ds_adabatch.data.tokens import TokenBudgetSampler
from ds_adabatch.runtime.token_setup import sampler_for_config
from ds_adabatch.schedules import BatchSizeController
from ds_adabatch.schedules.user import CallableSchedule

from ._trainer_lengths import check_length_arguments, sample_lengths
from ._trainer_state import AdaptiveBatchState, LrSettings

__all__ = ["build_batch_state", "keep_batch_size", "token_lengths"]

logger = logging.getLogger("ds_adabatch")


def keep_batch_size(step: int, batch_size: int) -> int:
    """The batch-size scheduler that never changes the batch; stands in until the user's is attached."""
    return batch_size


_PLACEHOLDER = f"{__name__}:keep_batch_size"


def _adabatch_section(deepspeed: Any, world_size: int | None) -> AdaBatchConfig | None:
    """The ``"adabatch"`` section of the Trainer's DeepSpeed config, validated; None without one."""
    if deepspeed is None or deepspeed is False:
        return None
    if isinstance(deepspeed, Mapping):
        has_section = "adabatch" in deepspeed
    else:
        try:
            with open(deepspeed, encoding="utf-8") as f:
                has_section = "adabatch" in json.load(f)
        except (OSError, ValueError, TypeError):
            return None  # not a readable JSON file: transformers reports its own error for it
    return load_ds_config(deepspeed, world_size=world_size).adabatch if has_section else None


def _require_map_style(train_dataset: Any) -> None:
    if isinstance(train_dataset, torch.utils.data.IterableDataset) or not hasattr(train_dataset, "__len__"):
        raise ValueError(
            "AdaptiveBatchSizeTrainer needs a map-style train_dataset (with __len__ and __getitem__): "
            "every sample is visited once per epoch in an order the trainer controls"
        )


def token_lengths(
    args: Any,
    train_dataset: Any,
    *,
    lengths: Any = None,
    length_fn: Callable[[Any], int] | None = None,
    input_name: str = "input_ids",
) -> SampleLengths | None:
    """Every training sample's length when the DeepSpeed config sets ``adabatch.micro_batch_tokens``.

    Needs no world size, so ``AdaptiveBatchSizeTrainer`` calls it before any process group starts; the
    lengths are checked (size, values, and with ``truncate_long_samples`` off the longest known sample
    against the budget) and returned for :func:`build_batch_state`. None without a token budget (or
    without a dataset yet).

    Raises:
        ConfigError: the ``"adabatch"`` section is invalid.
        ValueError: ``lengths`` / ``length_fn`` without a token budget or both at once, lengths that do
            not fit the dataset, or a sample longer than the budget (named with its index and length).
    """
    check_length_arguments(lengths, length_fn)
    section = _adabatch_section(args.deepspeed, None)
    if section is None or not section.token_budget:
        if lengths is not None or length_fn is not None:
            raise ValueError(
                "lengths= / length_fn= only apply with adabatch.micro_batch_tokens (token-budget "
                "micro-batches): set micro_batch_tokens in the DeepSpeed config's adabatch section, or "
                "drop the argument"
            )
        return None
    if train_dataset is None:
        return None
    _require_map_style(train_dataset)
    found = sample_lengths(
        train_dataset,
        lengths=lengths,
        length_fn=length_fn,
        column=args.length_column_name,
        input_name=input_name,
    )
    _token_sampler(section, found, seed=0, drop_last=False)  # checks the lengths against the budget
    return found


def _token_sampler(
    config: AdaBatchConfig, lengths: SampleLengths, *, seed: int, drop_last: bool
) -> TokenBudgetSampler:
    # The Trainer always shuffles (its seed and drop_last come from TrainingArguments).
    return sampler_for_config(config, lengths, shuffle=True, seed=seed, drop_last=drop_last)


def build_batch_state(
    args: Any,
    train_dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    *,
    batch_size_scheduler: Callable[[int, int], int] | None,
    gradient_accumulation_steps: int,
    max_micro_batch_per_gpu: int | None,
    lengths: SampleLengths | None = None,
) -> AdaptiveBatchState:
    """The batch state for a Trainer with ``args`` (a ``TrainingArguments``) on ``train_dataset``.

    Args:
        args: the Trainer's arguments; ``world_size``, ``process_index``, ``device``,
            ``per_device_train_batch_size``, ``deepspeed``, ``dataloader_*``, ``seed``/``data_seed``,
            ``num_train_epochs`` and ``max_steps`` are read.
        train_dataset: a map-style dataset.
        collate_fn: turns a list of samples into a micro-batch.
        batch_size_scheduler: ``fn(step, batch_size) -> int`` in samples per device per optimizer step.
        gradient_accumulation_steps: the user's ``gradient_accumulation_steps`` (the Trainer's own loop
            runs with 1).
        max_micro_batch_per_gpu: the largest micro-batch; default: the ``"adabatch"`` section's, else
            ``per_device_train_batch_size``. With ``micro_batch_tokens`` it caps the samples of a pass.
        lengths: every sample's length in tokens (:func:`token_lengths`); required with
            ``micro_batch_tokens``.

    Raises:
        ConfigError: the DeepSpeed config's ``"adabatch"`` section is invalid.
        ValueError: the dataset is not map-style, or a size is not a positive integer.
    """
    _require_map_style(train_dataset)
    if max_micro_batch_per_gpu is not None and (
        isinstance(max_micro_batch_per_gpu, bool)
        or not isinstance(max_micro_batch_per_gpu, int)
        or max_micro_batch_per_gpu < 1
    ):
        raise ValueError(f"max_micro_batch_per_gpu must be an integer >= 1, got {max_micro_batch_per_gpu!r}")
    world, rank = args.world_size, args.process_index
    per_device = args.per_device_train_batch_size * gradient_accumulation_steps
    section = _adabatch_section(args.deepspeed, world)
    fields: dict[str, Any] = {} if section is None else section.model_dump(exclude={"schedule"})
    if max_micro_batch_per_gpu is not None:
        fields["max_micro_batch_per_gpu"] = max_micro_batch_per_gpu
    elif section is None:
        # Without a config the user sized per_device_train_batch_size to fit memory: a growing batch
        # adds accumulation steps rather than larger forward passes.
        fields["max_micro_batch_per_gpu"] = args.per_device_train_batch_size
    if batch_size_scheduler is not None:
        schedule = {"type": "callable", "function": _PLACEHOLDER, "start": per_device, "per": "device"}
    elif section is not None:
        schedule = section.schedule.model_dump()
    else:
        schedule = {"type": "constant", "value": per_device * world}
    config = AdaBatchConfig.model_validate({**fields, "schedule": schedule})
    # transformers 5.23 reads train_sampling_strategy in Trainer._get_train_sampler, which the step
    # loader replaces; bucket_window (token budgets) is this trainer's grouping by length.
    grouped = getattr(args, "train_sampling_strategy", None) == "group_by_length"
    if grouped and config.bucket_window == 0 and rank == 0:
        logger.warning(
            "AdaptiveBatchSizeTrainer does not use train_sampling_strategy 'group_by_length'; to group "
            "steps by length set adabatch.micro_batch_tokens and adabatch.bucket_window (samples per "
            "length-sorted block of the order)"
        )
    if section is not None and "data" in section.model_fields_set and rank == 0:
        logger.warning(
            "AdaptiveBatchSizeTrainer reads the sample order from TrainingArguments (seed/data_seed, "
            "dataloader_drop_last, dataloader_num_workers); the adabatch.data section is not used"
        )
    controller = BatchSizeController(config, world)
    if batch_size_scheduler is not None:
        # BatchSizeController builds the callable schedule from an import path (the placeholder above);
        # the user's function object replaces it, with the same validation and checkpointed state.
        controller.schedule = CallableSchedule(config.schedule, function=batch_size_scheduler)

    seed = int(args.data_seed if args.data_seed is not None else args.seed)
    drop_last = bool(args.dataloader_drop_last)
    loader: ElasticDataLoader | TokenBudgetLoader
    if config.token_budget:
        if lengths is None:  # a caller other than the trainer: the lengths as the trainer finds them
            lengths = token_lengths(args, train_dataset)
        assert lengths is not None  # the section sets micro_batch_tokens
        if lengths.num_samples != len(train_dataset):
            raise ValueError(
                f"the lengths cover {lengths.num_samples} samples but the train_dataset has "
                f"{len(train_dataset)}; give one length per sample"
            )
        loader = TokenBudgetLoader(
            train_dataset,
            _token_sampler(config, lengths, seed=seed, drop_last=drop_last),
            rank=rank,
            world_size=world,
            collate_fn=collate_fn,
            num_workers=args.dataloader_num_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )
    else:
        loader = ElasticDataLoader(
            train_dataset,
            ElasticSampler(len(train_dataset), shuffle=True, seed=seed, drop_last=drop_last),
            rank=rank,
            world_size=world,
            collate_fn=collate_fn,
            num_workers=args.dataloader_num_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )
    explicit_unit = section is not None and "lr_schedule_unit" in section.model_fields_set
    unit = config.lr_schedule_unit if explicit_unit else ("steps" if args.max_steps > 0 else "samples")
    normalization = (
        config.loss_normalization
        if section is not None and "loss_normalization" in section.model_fields_set
        else None
    )
    reference = config.lr_scaling.reference_batch or controller.initial_global_batch()
    target_reference = None
    if config.schedule.batch_unit == "tokens":
        # The batch is a token target: the LR multiplier compares targets, while a samples-keyed LR
        # schedule ticks once per the first step's samples (the stream's clock stays in samples, so
        # the schedule still ends with the epochs).
        target_reference = reference
        assert isinstance(loader, TokenBudgetLoader)  # a tokens unit needs micro_batch_tokens
        reference = loader.plan_for_tokens(controller.initial_global_batch()).global_batch_size
    return AdaptiveBatchState(
        config,
        controller,
        loader,
        dataset=train_dataset,
        device=args.device,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        lr=LrSettings(
            unit=unit,
            reference_batch=reference,
            rule=config.lr_scaling.rule,
            target_reference=target_reference,
        ),
        loss_normalization=normalization,
    )

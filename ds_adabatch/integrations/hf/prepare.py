"""Building an ``AdaptiveBatchSizeTrainer`` run's batch state from its ``TrainingArguments``.

Where the global batch comes from:

* a ``batch_size_scheduler(step, batch_size)``: a ``callable`` schedule counted in samples per device
  (per data-parallel rank) per optimizer step. It is asked for step 0 too, with ``batch_size`` =
  ``per_device_train_batch_size x gradient_accumulation_steps``, and its answer is the first step's
  batch; the largest micro-batch is ``per_device_train_batch_size`` (a growing batch adds accumulation
  steps, not memory);
* else the ``"adabatch"`` section (``adabatch_config=`` or the DeepSpeed config, see ``hf.config``);
* else a constant ``per_device_train_batch_size x gradient_accumulation_steps x world size``.

A section next to a scheduler sets the bounds, granularity, largest micro-batch, LR coupling, loss
normalisation and logs. Without any section the trainer splits a rank's samples unevenly when an even
split would need smaller micro-batches (5 samples with ``per_device_train_batch_size`` 4 run as 3 + 2,
not 1 x 5); a section keeps its own ``allow_uneven`` (default false), and a step that would run at
micro-batch 1 although a larger one fits is warned about. The sample order follows
``TrainingArguments`` (``data_seed`` or ``seed``, ``dataloader_drop_last``, ``dataloader_num_workers``)
unless the section's ``data`` says otherwise.

With ``micro_batch_tokens`` in the section, steps are token-budget steps (``padding``, ``bucket_window``,
``truncate_long_samples`` and a schedule with ``unit: "tokens"`` as for ``ds_adabatch.initialize``): the
:class:`~ds_adabatch.data.tokens.TokenBudgetSampler` walks the same seeded global order and cuts each
step into passes of at most that many tokens; the lengths come from ``hf.lengths``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_adabatch.config import AdaBatchConfig, ConfigError
from ds_adabatch.data import ElasticDataLoader
from ds_adabatch.data.lengths import SampleLengths
from ds_adabatch.data.loader_setup import DataOrder, build_rank_loader, drop_last_problems
from ds_adabatch.data.token_config import sampler_for_config
from ds_adabatch.data.token_loader import TokenBudgetLoader
from ds_adabatch.data.tokens import TokenBudgetSampler
from ds_adabatch.runtime.distributed.comm import broadcast_int
from ds_adabatch.schedules import BatchSizeController, ScheduleContext
from ds_adabatch.schedules.user import CallableSchedule

from .config import FUNCTION_PLACEHOLDER, TrainerSection, read_trainer_section
from .lengths import check_length_arguments, sample_lengths
from .state import AdaptiveBatchState, LrSettings

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainingArguments

__all__ = ["build_batch_state", "function_name", "keep_batch_size", "token_lengths"]

logger = logging.getLogger("ds_adabatch")


def keep_batch_size(step: int, batch_size: int) -> int:
    """The batch-size scheduler that never changes the batch; stands in until the user's is attached."""
    return batch_size


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a user's function, as checkpoints and plan-change lines name it.

    A ``functools.partial`` is named by the function it wraps; a callable object by its class.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}:{getattr(target, '__qualname__', type(fn).__name__)}"


def _section_for(args: Any, section: TrainerSection | None) -> TrainerSection | None:
    # Callers other than the trainer (which reads adabatch_config= too) pass only the arguments.
    return section if section is not None else read_trainer_section(None, args.deepspeed, has_scheduler=False)


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
    section: TrainerSection | None = None,
) -> SampleLengths | None:
    """Every training sample's length when the section sets ``adabatch.micro_batch_tokens``.

    Needs no world size, so ``AdaptiveBatchSizeTrainer`` calls it before any process group starts; the
    lengths are checked (size, values, and with ``truncate_long_samples`` off the longest known sample
    against the budget) and returned for :func:`build_batch_state`. None without a token budget (or
    without a dataset yet). ``section``: the run's section (default: the DeepSpeed config's).

    Raises:
        ConfigError: the ``"adabatch"`` section is invalid.
        ValueError: ``lengths`` / ``length_fn`` without a token budget or both at once, lengths that do
            not fit the dataset, or a sample longer than the budget (named with its index and length).
    """
    check_length_arguments(lengths, length_fn)
    section = _section_for(args, section)
    if section is None or not section.config.token_budget:
        if lengths is not None or length_fn is not None:
            raise ValueError(
                "lengths= / length_fn= only apply with adabatch.micro_batch_tokens (token-budget "
                "micro-batches): set micro_batch_tokens in the adabatch section (adabatch_config= or the "
                "DeepSpeed config), or drop the argument"
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
    _token_sampler(section.config, found, seed=0, drop_last=False)  # checks the lengths against the budget
    return found


def _token_sampler(
    config: AdaBatchConfig, lengths: SampleLengths, *, seed: int, drop_last: bool, shuffle: bool = True
) -> TokenBudgetSampler:
    return sampler_for_config(config, lengths, shuffle=shuffle, seed=seed, drop_last=drop_last)


def _sample_order(args: TrainingArguments, section: TrainerSection | None, rank: int) -> DataOrder:
    """Shuffle, seed, drop_last and workers: ``TrainingArguments``', or the section's ``data`` keys."""
    order = {
        "shuffle": True,  # the Trainer's own sampler always shuffles the training set
        "seed": int(args.data_seed if args.data_seed is not None else args.seed),
        "drop_last": bool(args.dataloader_drop_last),
        "num_workers": int(args.dataloader_num_workers),
    }
    names = {
        "seed": "data_seed / seed",
        "drop_last": "dataloader_drop_last",
        "num_workers": "dataloader_num_workers",
    }
    if section is None:
        return DataOrder(**order)
    for key in order:
        if not section.data_given(key):
            continue
        value = getattr(section.config.data, key)
        if key in names and value != order[key] and rank == 0:
            logger.info(
                "adabatch.data.%s = %r is used in place of TrainingArguments' %s (%r)",
                key,
                value,
                names[key],
                order[key],
            )
        order[key] = value
    return DataOrder(**order)


def _callable_schedule(
    fn: Callable[..., Any], start: int, *, world: int, device: torch.device, ask_step_zero: bool
) -> CallableSchedule:
    """The user's function as a per-device ``callable`` schedule that has answered for step 0.

    ``start`` is what it is given as ``batch_size`` at step 0; its answer (rank 0's, agreed in one
    collective before training) is the first step's batch. A resumed run does not ask: the checkpoint
    holds the function's last answer.
    """
    kwargs: dict[str, Any] = {}
    if isinstance(fn, functools.partial) and not fn.args:
        # Called as the partial would call it; the checkpoint and the logs name the wrapped function.
        fn, kwargs = fn.func, dict(fn.keywords)
    stand_in = {"type": "callable", "function": FUNCTION_PLACEHOLDER, "start": start, "per": "device"}
    config = AdaBatchConfig.model_validate({"schedule": stand_in, "max_micro_batch_per_gpu": 1}).schedule
    schedule = CallableSchedule(
        config, function=fn, kwargs=kwargs, path=function_name(fn), given_as="batch_size_scheduler"
    )
    if ask_step_zero:
        schedule(ScheduleContext(step=0, samples=0, global_batch=start * world, world_size=world))
        schedule.load_shared_state([broadcast_int(schedule.current, device)])
    return schedule


def build_batch_state(
    args: Any,
    train_dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    *,
    batch_size_scheduler: Callable[[int, int], int] | None,
    gradient_accumulation_steps: int,
    max_micro_batch_per_gpu: int | None,
    lengths: SampleLengths | None = None,
    section: TrainerSection | None = None,
    resuming: bool = False,
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
        max_micro_batch_per_gpu: the largest micro-batch; default: the section's, else
            ``per_device_train_batch_size``. With ``micro_batch_tokens`` it caps the samples of a pass.
        lengths: every sample's length in tokens (:func:`token_lengths`); required with
            ``micro_batch_tokens``.
        section: the run's ``"adabatch"`` section (:func:`read_trainer_section`); default: the
            DeepSpeed config's.
        resuming: the run continues from a checkpoint (the scheduler is not asked for step 0).

    Raises:
        ConfigError: the section cannot be planned on this world size.
        ValueError: the dataset is not map-style, or a size is not a positive integer.
    """
    _require_map_style(train_dataset)
    _check_max_micro(max_micro_batch_per_gpu)
    world, rank = args.world_size, args.process_index
    per_device = args.per_device_train_batch_size * gradient_accumulation_steps
    section = _section_for(args, section)
    checked = None if section is None else section.with_world_size(world)
    fields = _config_fields(args, section, checked, max_micro_batch_per_gpu)
    user_schedule = None
    if batch_size_scheduler is not None:
        user_schedule = _callable_schedule(
            batch_size_scheduler, per_device, world=world, device=args.device, ask_step_zero=not resuming
        )
    schedule = _schedule_section(user_schedule, checked, per_device * world)
    config = AdaBatchConfig.model_validate({**fields, "schedule": schedule})
    _warn_if_grouped_by_length(args, config, rank)
    controller = BatchSizeController(config, world)
    if user_schedule is not None:
        # BatchSizeController builds the callable schedule from an import path (the stand-in above);
        # the user's function object replaces it, with the same validation and checkpointed state.
        controller.schedule = user_schedule
    order = _sample_order(args, section, rank)
    loader = _rank_loader(args, train_dataset, collate_fn, config, order, lengths=lengths, section=section)
    explicit = section.given if section is not None else (lambda key: False)
    return AdaptiveBatchState(
        config,
        controller,
        loader,
        dataset=train_dataset,
        device=args.device,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        lr=_lr_settings(args, config, controller, loader, explicit),
        loss_normalization=config.loss_normalization if explicit("loss_normalization") else None,
    )


def _schedule_section(
    user_schedule: CallableSchedule | None, checked: AdaBatchConfig | None, constant: int
) -> dict[str, Any]:
    """The run's ``schedule`` key: the user's function (a stand-in, replaced once the controller is
    built), the section's, else a constant global batch."""
    if user_schedule is not None:
        return {
            "type": "callable",
            "function": FUNCTION_PLACEHOLDER,
            "start": user_schedule.current,
            "per": "device",
        }
    if checked is not None:
        return checked.schedule.model_dump()
    return {"type": "constant", "value": constant}


def _check_max_micro(max_micro_batch_per_gpu: object) -> None:
    if max_micro_batch_per_gpu is not None and (
        isinstance(max_micro_batch_per_gpu, bool)
        or not isinstance(max_micro_batch_per_gpu, int)
        or max_micro_batch_per_gpu < 1
    ):
        raise ValueError(f"max_micro_batch_per_gpu must be an integer >= 1, got {max_micro_batch_per_gpu!r}")


def _config_fields(
    args: TrainingArguments,
    section: TrainerSection | None,
    checked: AdaBatchConfig | None,
    max_micro_batch_per_gpu: int | None,
) -> dict[str, Any]:
    """The run's config keys but the schedule: the section's, with the Trainer's defaults."""
    fields: dict[str, Any] = {} if checked is None else checked.model_dump(exclude={"schedule"})
    if max_micro_batch_per_gpu is not None:
        fields["max_micro_batch_per_gpu"] = max_micro_batch_per_gpu
    elif checked is None or (checked.max_micro_batch_per_gpu is None and not checked.token_budget):
        # Without a config the user sized per_device_train_batch_size to fit memory: a growing batch
        # adds accumulation steps rather than larger forward passes.
        fields["max_micro_batch_per_gpu"] = args.per_device_train_batch_size
    if section is None:
        # The trainer weights uneven micro-batches exactly: 5 samples at most 4 per pass run as 3 + 2.
        fields["allow_uneven"] = True
    return fields


def _warn_if_grouped_by_length(args: TrainingArguments, config: AdaBatchConfig, rank: int) -> None:
    # transformers 5.23 reads train_sampling_strategy in Trainer._get_train_sampler, which the step
    # loader replaces; bucket_window (token budgets) is this trainer's grouping by length.
    grouped = getattr(args, "train_sampling_strategy", None) == "group_by_length"
    if grouped and config.bucket_window == 0 and rank == 0:
        logger.warning(
            "AdaptiveBatchSizeTrainer does not use train_sampling_strategy 'group_by_length'; to group "
            "steps by length set adabatch.micro_batch_tokens and adabatch.bucket_window (samples per "
            "length-sorted block of the order)"
        )


def _rank_loader(
    args: TrainingArguments,
    train_dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    config: AdaBatchConfig,
    order: DataOrder,
    *,
    lengths: SampleLengths | None,
    section: TrainerSection | None,
) -> ElasticDataLoader | TokenBudgetLoader:
    """This rank's loader: samples cut by the plan, or token-budget steps over the samples' lengths."""
    given = section is not None and section.data_given("drop_last")
    key = "adabatch.data.drop_last" if given else "TrainingArguments.dataloader_drop_last"
    if problems := drop_last_problems(
        config, len(train_dataset), drop_last=order.drop_last, drop_last_key=key
    ):
        raise ConfigError(problems)
    token_sampler = None
    if config.token_budget:
        if lengths is None:  # a caller other than the trainer: the lengths as the trainer finds them
            lengths = token_lengths(args, train_dataset, section=section)
        assert lengths is not None  # the section sets micro_batch_tokens
        if lengths.num_samples != len(train_dataset):
            raise ValueError(
                f"the lengths cover {lengths.num_samples} samples but the train_dataset has "
                f"{len(train_dataset)}; give one length per sample"
            )
        token_sampler = _token_sampler(
            config, lengths, seed=order.seed, drop_last=order.drop_last, shuffle=order.shuffle
        )
    loader = build_rank_loader(
        train_dataset,
        order,
        token_sampler=token_sampler,
        rank=args.process_index,
        world_size=args.world_size,
        collate_fn=collate_fn,
        # TrainingArguments.dataloader_multiprocessing_context: transformers >= 5.x (absent in 5.0)
        multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
    )
    assert loader is not None  # a map-style dataset
    return loader


def _lr_settings(
    args: TrainingArguments,
    config: AdaBatchConfig,
    controller: BatchSizeController,
    loader: ElasticDataLoader | TokenBudgetLoader,
    explicit: Callable[[str], bool],
) -> LrSettings:
    """How the LR schedule is clocked and scaled: the section's keys where given, else the Trainer's."""
    unit = (
        config.lr_schedule_unit
        if explicit("lr_schedule_unit")
        else ("steps" if args.max_steps > 0 else "samples")
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
    return LrSettings(
        unit=unit,
        reference_batch=reference,
        rule=config.lr_scaling.rule,
        target_reference=target_reference,
        gain_power=config.lr_scaling.gain_power,
    )

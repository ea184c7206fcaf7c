"""The ``"adabatch"`` section of an ``AdaptiveBatchSizeTrainer`` run: where it comes from, what it may hold.

It comes from one place:

* ``adabatch_config=`` (the section as a dict, or the path of a JSON file holding it, or a ds_config
  holding it): with or without DeepSpeed;
* else the ``"adabatch"`` section of the DeepSpeed config in ``TrainingArguments(deepspeed=...)``.

Both may be given when they hold the same section (``adabatch_config=`` naming the DeepSpeed config
file itself, so one script runs with and without ``--deepspeed``); two different sections are refused.

It is validated as ``ds-adabatch validate`` validates it (the same models, messages and dotted paths),
before any process group starts; what needs the world size is checked again when training starts. Under
the Trainer every key is honoured, or refused with a sentence where it cannot be:

* ``schedule``: drives the batch, unless ``batch_size_scheduler=`` is given; then the function is the
  schedule and a ``schedule`` in the section is refused (the section then only sets bounds, micro-batch,
  LR coupling, ...).
* ``max_micro_batch_per_gpu``: ``"auto"`` is learned from out-of-memory errors, which the Trainer
  recovers under DeepSpeed only: refused without it, as is every key of ``memory`` and the
  ``gradient_noise`` and ``goodput`` schedules (they read DeepSpeed's reduced gradients).
* ``data``: keys written there win over ``TrainingArguments`` (``data_seed``/``seed``,
  ``dataloader_drop_last``, ``dataloader_num_workers``; ``shuffle`` has no Trainer equivalent).
* ``log``: ``jsonl`` (one record per optimizer step, rank 0) and ``every_steps``, as in the runtime.
* everything else (bounds, ``granularity``, ``allow_uneven``, ``update_interval``, ``max_change_factor``,
  ``lr_scaling``, ``lr_schedule_unit``, ``loss_normalization``, token budgets) as in the runtime.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ds_adabatch.config import AdaBatchConfig, ConfigError, ConfigProblem, LoadedConfig, load_adabatch_section
from ds_adabatch.runtime.distributed.op_builds import cuda_arch_list_problems

__all__ = ["FUNCTION_PLACEHOLDER", "TrainerSection", "deepspeed_build_problems", "read_trainer_section"]

FUNCTION_PLACEHOLDER = "ds_adabatch.integrations.hf.prepare:keep_batch_size"
"""Import path the section's stand-in ``callable`` schedule names while ``batch_size_scheduler=`` (a
Python object, not an import path) is the schedule; the trainer puts the user's function in its place."""

_STAND_IN = {"type": "callable", "function": FUNCTION_PLACEHOLDER, "start": 1, "per": "device"}


@dataclass(frozen=True)
class TrainerSection:
    """A validated ``"adabatch"`` section and what the user wrote in it."""

    loaded: LoadedConfig
    """The section as the loader validated it (without a world size)."""
    source: str
    """Where it came from, for messages: ``"adabatch_config="`` or ``"the DeepSpeed config"``."""
    from_function: bool
    """True when ``batch_size_scheduler=`` is the schedule (the section's is a stand-in)."""

    @property
    def config(self) -> AdaBatchConfig:
        return self.loaded.adabatch

    def given(self, key: str) -> bool:
        """Whether the user wrote ``key`` (a top-level key of the section)."""
        if key == "schedule" and self.from_function:
            return False
        return key in self.config.model_fields_set

    def data_given(self, key: str) -> bool:
        """Whether the user wrote ``data.<key>``."""
        return self.given("data") and key in self.config.data.model_fields_set

    def with_world_size(self, world_size: int) -> AdaBatchConfig:
        """The section checked again for ``world_size`` ranks (endpoints plannable, DeepSpeed's batch keys).

        With a function as the schedule its answers are rounded like any schedule's, so only the
        bounds are checked (when the controller is built).

        Raises:
            ConfigError: the schedule cannot be planned on ``world_size`` ranks.
        """
        if self.from_function:
            return self.config
        return self.loaded.with_world_size(world_size).adabatch


def deepspeed_build_problems(
    deepspeed: str | os.PathLike[str] | Mapping[str, Any] | bool | None, accelerator: str | None = None
) -> list[ConfigProblem]:
    """What in ``TrainingArguments(deepspeed=...)`` DeepSpeed would fail on only while it builds the
    optimizer's CUDA op, at the first ``train()``, with a raw error: a ``TORCH_CUDA_ARCH_LIST`` entry it
    cannot read (:func:`~ds_adabatch.runtime.distributed.op_builds.cuda_arch_list_problems`; the same
    check ``ds_adabatch.initialize`` makes). DeepSpeed builds the config's own ``optimizer``; without
    that section the Trainer hands it a torch optimizer, which needs no build. ``accelerator``: the
    device kind (None: DeepSpeed's accelerator's)."""
    config = _deepspeed_dict(deepspeed)
    if not config.get("optimizer"):
        return []
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
    return cuda_arch_list_problems(dict(config), accelerator, client_optimizer=False)


def _deepspeed_dict(deepspeed: str | os.PathLike[str] | Mapping[str, Any] | bool | None) -> Mapping[str, Any]:
    """The DeepSpeed config ``TrainingArguments(deepspeed=...)`` names; empty where there is none or it
    is not a readable JSON object (transformers reports its own error for it)."""
    if deepspeed is None or isinstance(deepspeed, bool):
        return {}
    if isinstance(deepspeed, Mapping):
        return deepspeed
    try:
        with open(deepspeed, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError, TypeError):
        return {}
    return loaded if isinstance(loaded, Mapping) else {}


def _has_section(deepspeed: str | os.PathLike[str] | Mapping[str, Any] | bool | None) -> bool:
    return "adabatch" in _deepspeed_dict(deepspeed)


def read_trainer_section(
    adabatch_config: str | os.PathLike[str] | Mapping[str, Any] | None,
    deepspeed: str | os.PathLike[str] | Mapping[str, Any] | bool | None,
    *,
    has_scheduler: bool,
) -> TrainerSection | None:
    """The run's ``"adabatch"`` section, validated without a world size; None when there is none.

    Args:
        adabatch_config: the trainer's ``adabatch_config=`` argument.
        deepspeed: ``TrainingArguments.deepspeed`` (a path, a dict, or None).
        has_scheduler: whether ``batch_size_scheduler=`` was given.

    Raises:
        ConfigError: the section is invalid, or holds a key the Trainer cannot honour here (each
            problem with its dotted path and what to change).
        ValueError: two different sections, in ``adabatch_config=`` and in the DeepSpeed config.
    """
    in_deepspeed = _has_section(deepspeed)
    if adabatch_config is None and not in_deepspeed:
        return None
    stand_in = _STAND_IN if has_scheduler else None
    if adabatch_config is not None:
        loaded, source = load_adabatch_section(adabatch_config, schedule=stand_in), "adabatch_config="
        if in_deepspeed and load_adabatch_section(deepspeed, schedule=stand_in).adabatch != loaded.adabatch:
            raise ValueError(
                "AdaptiveBatchSizeTrainer got two different adabatch sections: adabatch_config= and the "
                "one in the DeepSpeed config of TrainingArguments(deepspeed=...); keep one of them"
            )
    else:
        loaded, source = load_adabatch_section(deepspeed, schedule=stand_in), "the DeepSpeed config"
    schedule = loaded.adabatch.schedule
    is_stand_in = schedule.type == "callable" and schedule.function == FUNCTION_PLACEHOLDER
    section = TrainerSection(loaded, source, from_function=has_scheduler)
    problems = _problems(
        section, uses_deepspeed=bool(deepspeed), user_schedule=has_scheduler and not is_stand_in
    )
    if _deepspeed_dict(deepspeed).get("managed_gradient_accumulation") is False:
        # accelerate steps the DeepSpeed engine after every backward: with caller-owned accumulation
        # each micro-batch would be an update of its own (docs/deepspeed.md).
        problems.append(
            ConfigProblem(
                "managed_gradient_accumulation",
                "the Trainer steps DeepSpeed after every micro-batch, so caller-owned accumulation would "
                "make each micro-batch an optimizer step: remove the key from the DeepSpeed config",
                False,
            )
        )
    if problems:
        raise ConfigError(problems, source=f"the adabatch section ({source})")
    return section


def _problems(section: TrainerSection, *, uses_deepspeed: bool, user_schedule: bool) -> list[ConfigProblem]:
    config = section.config
    problems: list[ConfigProblem] = []
    if user_schedule:
        problems.append(
            ConfigProblem(
                "adabatch.schedule",
                f"batch_size_scheduler= is this run's schedule, so the section's {config.schedule.type!r} "
                "schedule would not be used: remove adabatch.schedule, or drop batch_size_scheduler= to "
                "let the section's schedule drive the batch",
            )
        )
    if uses_deepspeed:
        return problems
    if config.schedule.type in ("gradient_noise", "goodput"):
        problems.append(
            ConfigProblem(
                "adabatch.schedule.type",
                f"the {config.schedule.type} schedule measures the noise scale from DeepSpeed's reduced "
                "gradients: pass TrainingArguments(deepspeed=...), or pick another schedule",
                config.schedule.type,
            )
        )
    why = "AdaptiveBatchSizeTrainer recovers from out-of-memory errors under DeepSpeed only"
    if config.auto_micro_batch:
        problems.append(
            ConfigProblem(
                "adabatch.max_micro_batch_per_gpu",
                f"'auto' learns the micro-batch from out-of-memory errors and {why}: give an integer "
                "(samples per forward pass), or pass TrainingArguments(deepspeed=...)",
                "auto",
            )
        )
    for key in sorted(config.memory.model_fields_set):
        problems.append(
            ConfigProblem(
                f"adabatch.memory.{key}",
                f"is not used without DeepSpeed ({why}; without it an out-of-memory error propagates): "
                "remove it, or pass TrainingArguments(deepspeed=...)",
                getattr(config.memory, key),
            )
        )
    return problems

"""DeepSpeed's own sections of a ds_config, checked before any process group (and by ``ds-adabatch
validate``): what ``deepspeed.initialize`` would otherwise refuse with a raw error from inside it."""

from __future__ import annotations

from typing import Any

from ...config import BATCH_KEYS, ConfigError, ConfigProblem, LoadedConfig

__all__ = ["check_deepspeed_sections", "early_problems", "untested_optimizer_problems"]

# DeepSpeed 0.19.8 names its section models after the config keys they parse.
_DS_SECTIONS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedMonitorConfig": "monitor",
    "TensorBoardConfig": "tensorboard",
    "WandbConfig": "wandb",
    "CSVConfig": "csv_monitor",
    "CometConfig": "comet",
    "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
    "DeepSpeedFlopsProfilerConfig": "flops_profiler",
    "DeepSpeedCommsConfig": "comms_logger",
}

_ZERO_TESTED_TYPES = frozenset({"adam", "adamw", "adagrad", "lion", "muon"})
"""The ``optimizer.type`` values whose DeepSpeed 0.19.8 optimizer is in ZeRO's tested list
(``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS``: torch's or DeepSpeed's fused and CPU Adam,
AdamW, Adagrad and Lion, and Muon's MuonWithAuxAdam); SGD, Lamb, the 1-bit and the mu- optimizers are not."""


def check_deepspeed_sections(loaded: LoadedConfig) -> None:
    """Let DeepSpeed validate its own sections now, before a process group exists.

    ``deepspeed.runtime.config.DeepSpeedConfig`` (0.19.8) parses every section without a process group;
    it is given a batch of one here (micro 1 x GAS 1) because only the other sections are checked: the
    batch keys as written are checked against the plan once the world size is known.

    Raises:
        ConfigError: a section DeepSpeed refuses, with its dotted path.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    sections = {key: value for key, value in loaded.deepspeed.items() if key not in BATCH_KEYS}
    try:
        DeepSpeedConfig({**sections, **dict.fromkeys(BATCH_KEYS, 1)})
    except ValidationError as err:
        section = _DS_SECTIONS.get(err.title, err.title)
        problems = [
            ConfigProblem(
                ".".join([section, *(str(p) for p in e["loc"])]),
                f"{e['msg']} (DeepSpeed's {err.title})",
                e.get("input"),
            )
            for e in err.errors()
        ]
        raise ConfigError(problems, loaded.source) from None
    except (ValueError, AssertionError, KeyError, TypeError) as err:
        raise ConfigError(
            [ConfigProblem("<deepspeed>", f"DeepSpeed rejects the config: {err}")], loaded.source
        ) from None


def untested_optimizer_problems(config: dict[str, Any], client_optimizer: Any = None) -> list[ConfigProblem]:
    """ZeRO (stage 1-3) with an optimizer outside DeepSpeed's tested list, without
    ``zero_allow_untested_optimizer``: DeepSpeed 0.19.8 stops inside ``deepspeed.initialize`` with an
    ``AssertionError`` (``DeepSpeedEngine._do_optimizer_sanity_check``). ``config``: the ds_config as
    DeepSpeed gets it; ``client_optimizer``: the ``optimizer=`` given to initialize (an instance, a
    callable that builds one, or None)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if not isinstance(stage, int) or stage < 1 or config.get("zero_allow_untested_optimizer") is True:
        return []
    fix = (
        f"ZeRO stage {stage} runs only DeepSpeed's tested optimizers (Adam, AdamW, Adagrad, Lion, Muon) "
        'unless the ds_config sets "zero_allow_untested_optimizer": true; add it (ZeRO then partitions '
        "this optimizer's state as any other), or use one of those"
    )
    if client_optimizer is not None:
        import torch

        if not isinstance(client_optimizer, torch.optim.Optimizer):
            return []  # a callable: the optimizer it builds is checked by DeepSpeed
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

        if type(client_optimizer) in ZERO_SUPPORTED_OPTIMIZERS:
            return []
        return [ConfigProblem("optimizer=", f"{type(client_optimizer).__name__}: {fix}")]
    section = config.get("optimizer")
    kind = section.get("type") if isinstance(section, dict) else None
    if not isinstance(kind, str) or kind.lower() in _ZERO_TESTED_TYPES:
        return []
    return [ConfigProblem("optimizer.type", fix, kind)]


def early_problems(loaded: LoadedConfig) -> list[str]:
    """What ``ds_adabatch.initialize`` refuses before any process group besides the plan, as text
    (``ds-adabatch validate``): DeepSpeed's dataloader_drop_last against the section's, a callable
    schedule's function, DeepSpeed's own sections, ZeRO's tested optimizers."""
    from ...schedules.user import check_schedule_function

    try:
        loaded.honouring_deepspeed_drop_last()
        check_schedule_function(loaded.adabatch.schedule)
        check_deepspeed_sections(loaded)
    except ConfigError as err:
        return [str(err)]
    found = untested_optimizer_problems(loaded.deepspeed)
    return [str(ConfigError(found, loaded.source))] if found else []

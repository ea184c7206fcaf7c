"""Every schedule rule by its config ``type``, and :func:`build_schedule`, which turns a config into its rule.

This is the one module that imports the rule modules (``ramps``, ``noise``, ``plateau``, ``seesaw``,
``user``, ``goodput``). Within this package each of them imports only :mod:`~ds_adabatch.schedules.base`
(``seesaw`` also ``base_lr``, ``goodput`` also ``noise`` for its warm-up rule) and neither ``base`` nor
``noise`` imports a rule module, so the schedules form no import cycle. A new rule is added here and as
a member of ``ds_adabatch.config.schedules.ScheduleConfig``.
"""

from __future__ import annotations

from typing import Any

from .base import Schedule
from .goodput import GoodputSchedule
from .noise import GradientNoiseSchedule
from .plateau import LossPlateauSchedule
from .ramps import ConstantSchedule, LinearSchedule, PiecewiseSchedule, StepSchedule
from .seesaw import SeesawSchedule
from .user import CallableSchedule

__all__ = ["SCHEDULE_TYPES", "build_schedule"]

_FROM_CONFIG_ALONE: dict[str, Any] = {
    "constant": ConstantSchedule,
    "linear": LinearSchedule,
    "step": StepSchedule,
    "piecewise": PiecewiseSchedule,
    "gradient_noise": GradientNoiseSchedule,
    "callable": CallableSchedule,
}
"""The rules built from their config alone; ``loss_plateau`` and ``seesaw`` also take the bounds."""

SCHEDULE_TYPES: frozenset[str] = frozenset({*_FROM_CONFIG_ALONE, "loss_plateau", "seesaw", "goodput"})
"""The config ``type`` of every rule :func:`build_schedule` knows."""


def build_schedule(
    config: Any,
    *,
    world_size: int,
    min_global_batch: int | None = None,
    max_global_batch: int | None = None,
    granularity: int = 1,
    allow_uneven: bool = False,
    min_from_config: bool = True,
    lr_rule: str | None = None,
    max_change_factor: float | None = None,
) -> Schedule:
    """The rule for a schedule config model (one member of ``ScheduleConfig``).

    ``min_global_batch`` / ``max_global_batch`` are the plannable bounds; rules that keep their own
    batch (``loss_plateau``) stay inside them, as the controller's output does. ``goodput`` rates the
    plannable batches within them (``granularity``, ``allow_uneven``) at the context's world size,
    from its ``start`` where ``min_from_config`` is False (the section set no ``min_global_batch``), with
    the efficiency that ``lr_rule`` (the section's ``lr_scaling.rule``) implies where it says "auto",
    and only those within the section's ``max_change_factor`` of the current batch.

    Raises:
        ConfigError: a ``callable`` schedule's function cannot be imported or is not callable.
        ValueError: the config's ``type`` is unknown.
    """
    kind = getattr(config, "type", None)
    if kind == "loss_plateau":
        return LossPlateauSchedule(
            config, min_global_batch=min_global_batch, max_global_batch=max_global_batch
        )
    if kind == "goodput":
        return GoodputSchedule(
            config,
            granularity=granularity,
            min_global_batch=min_global_batch if min_from_config else None,
            max_global_batch=max_global_batch,
            allow_uneven=allow_uneven,
            lr_rule=lr_rule,
            max_change_factor=max_change_factor,
        )
    if kind == "seesaw":
        return SeesawSchedule(config, max_global_batch=max_global_batch)
    if kind not in _FROM_CONFIG_ALONE:
        known = ", ".join(sorted(SCHEDULE_TYPES))
        raise ValueError(f"unknown schedule type {kind!r}; known types: {known}")
    return _FROM_CONFIG_ALONE[kind](config)

"""The run's base learning rate as a function of samples: what LR-aware schedules (``seesaw``) read.

A schedule that follows the LR schedule cannot import DeepSpeed or hold the optimizer, so it reads the
LR through a :class:`BaseLRSource`: ``source.base_lr(samples)`` is the learning rate the run's own LR
schedule sets for the optimizer step that starts after ``samples`` samples, *before* any batch-size
multiplier (``lr_scaling``), for the first parameter group. Two implementations exist:

* the runtime's (``ds_adabatch.runtime.core.lr.CurrentBaseLR``): the LR the wrapped DeepSpeed or torch
  scheduler has just set, with the multiplier divided out. It is exact for any scheduler, and only
  answers for the samples count the run is at (that is the only one a schedule asks for).
* :class:`DeepSpeedSchedulerCurve`: DeepSpeed's ``scheduler`` section (``WarmupLR``, ``WarmupDecayLR``,
  ``WarmupCosineLR``) evaluated in closed form, for ``ds-adabatch simulate`` and for tests.

Under ``lr_schedule_unit: "samples"`` the runtime steps the scheduler to ``samples // reference_batch``
steps once a step's samples are consumed; DeepSpeed's schedulers start at iteration -1, so the step
starting after ``s`` samples runs at scheduler iteration ``s // reference_batch - 1``. The curve uses
the same index, so simulated and real runs see the same LR.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

__all__ = ["BaseLRSource", "DeepSpeedSchedulerCurve", "base_lr_from_ds_config"]


@runtime_checkable
class BaseLRSource(Protocol):
    """``base_lr(samples)``: the unscaled LR of the step that starts after ``samples`` samples."""

    def base_lr(self, samples: int) -> float: ...


_SUPPORTED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class DeepSpeedSchedulerCurve:
    """A DeepSpeed ``scheduler`` section in closed form, keyed on samples (DeepSpeed 0.19.8 formulas).

    Args:
        section: the ds_config's ``scheduler`` section (``{"type": ..., "params": {...}}``), or None
            for a constant LR.
        optimizer_lr: the optimizer section's ``lr`` (``WarmupCosineLR`` scales it; ``WarmupLR``'s
            ``warmup_max_lr`` defaults to it).
        reference_batch: samples per scheduler step (``lr_scaling.reference_batch``).

    Raises:
        ValueError: a scheduler type this module cannot evaluate, or a missing learning rate.
    """

    def __init__(self, section: dict[str, Any] | None, *, optimizer_lr: float | None, reference_batch: int):
        if reference_batch < 1:
            raise ValueError(f"reference_batch must be >= 1, got {reference_batch!r}")
        self.reference_batch = int(reference_batch)
        self.kind = None if section is None else section.get("type")
        params = dict((section or {}).get("params") or {})
        if self.kind is not None and self.kind not in _SUPPORTED:
            raise ValueError(
                f"scheduler type {self.kind!r} cannot be evaluated without running it; supported: "
                f"{', '.join(_SUPPORTED)} (a training run reads any scheduler from the optimizer)"
            )
        if self.kind == "WarmupCosineLR" or self.kind is None:
            if optimizer_lr is None:
                raise ValueError("the optimizer section gives no 'lr' to evaluate the LR schedule with")
            self.peak = float(optimizer_lr)
        else:
            top = params.get("warmup_max_lr", optimizer_lr)
            if top is None:
                raise ValueError("the scheduler gives no warmup_max_lr and the optimizer no 'lr'")
            self.peak = float(top)
        self.params = params
        self.warmup_steps = max(2, int(params.get("warmup_num_steps", 1000)))
        self.linear = params.get("warmup_type", "log") == "linear"
        self.total_steps = int(params.get("total_num_steps", 0) or 0)

    def iteration(self, samples: int) -> int:
        """The scheduler's ``last_batch_iteration`` during the step after ``samples`` samples."""
        return samples // self.reference_batch - 1

    def base_lr(self, samples: int) -> float:
        it = self.iteration(samples)
        if self.kind is None:
            return self.peak
        if self.kind == "WarmupCosineLR":
            return self.peak * self._cosine_ratio(it)
        low = float(self.params.get("warmup_min_lr", 0.0))
        if it < 0:
            return low
        return low + (self.peak - low) * self._gamma(it)

    def _warmup(self, it: int) -> float:
        if self.linear:
            return it / self.warmup_steps
        return math.log(it + 1) / math.log(self.warmup_steps)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_steps:
            return self._warmup(it)
        if self.kind == "WarmupDecayLR":
            return max(0.0, (self.total_steps - it) / max(1.0, self.total_steps - self.warmup_steps))
        return 1.0

    def _cosine_ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_steps:
            low = float(self.params.get("warmup_min_ratio", 0.0))
            return low + self._warmup(it) * (1.0 - low)
        floor = float(self.params.get("cos_min_ratio", 0.0001))
        progress = min(1.0, (it - self.warmup_steps + 1) / max(1, self.total_steps - self.warmup_steps))
        return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def base_lr_from_ds_config(ds_config: dict[str, Any], reference_batch: int) -> DeepSpeedSchedulerCurve:
    """The base-LR curve of a full ds_config (its ``scheduler`` and ``optimizer.params.lr``)."""
    optimizer = ds_config.get("optimizer") or {}
    lr = (optimizer.get("params") or {}).get("lr")
    return DeepSpeedSchedulerCurve(
        ds_config.get("scheduler"), optimizer_lr=lr, reference_batch=reference_batch
    )

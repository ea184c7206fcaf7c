"""Per-step metrics and plan-change events.

Every optimizer step produces one :class:`StepMetrics` record. Rank 0 writes it to the JSONL file of
``adabatch.log.jsonl`` (one JSON object per line) and to DeepSpeed's monitor (TensorBoard, CSV, W&B —
whatever the ds_config enables), with samples consumed on the x axis as DeepSpeed's own events use.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from ...plan import BatchPlan

__all__ = ["MetricsWriter", "PlanChange", "StepMetrics", "format_plan_change", "schedule_rating"]

logger = logging.getLogger("ds_adabatch")


@dataclass(frozen=True)
class PlanChange:
    """One change of batch shape, recorded in ``engine.history``."""

    step: int
    """Optimizer steps completed before the change (the new plan applies from this step)."""
    samples: int
    """Samples consumed before the change."""
    old_global_batch: int
    new_global_batch: int
    old_micro_batch_per_gpu: int
    new_micro_batch_per_gpu: int
    old_gradient_accumulation_steps: int
    new_gradient_accumulation_steps: int
    world_size: int
    lr_multiplier: float
    """LR multiplier in effect after the change (relative to ``lr_scaling.reference_batch``)."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepMetrics:
    """What one optimizer step did (identical on every rank).

    ``lr`` is the learning rate the step's update used (multiplier included); ``samples`` and
    ``tokens`` count everything consumed up to and including this step; ``tokens`` is ``None``
    unless tokens are counted (``loss_normalization: "token"`` or a tokens-keyed schedule).
    """

    step: int
    samples: int
    tokens: int | None
    global_batch: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    lr: float
    loss: float
    train_coverage: float
    epoch: float
    lr_multiplier: float
    step_time_s: float
    grad_norm: float | None = None
    noise_scale: float | None = None
    oom_recovery: str | None = None
    """What an out-of-memory error in this step would have led to (``engine.oom_recovery``)."""
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def schedule_rating(schedule: Any) -> dict[str, float]:
    """What a step record adds from its schedule: the ``goodput`` schedule's latest rating of the batch it
    chose or kept (``predicted_samples_per_s``, ``efficiency``, ``goodput``; docs/metrics.md), for
    ``train_batch``, DeepSpeed's loop and the Trainer alike; nothing for the other schedules."""
    return dict(getattr(schedule, "last_rating", None) or {})


def format_plan_change(
    old: BatchPlan,
    new: BatchPlan,
    step: int,
    lr_ratio: float,
    reason: str,
    *,
    unit: str = "rank",
    scheduled: tuple[int, int, str] | None = None,
) -> str:
    """``step 120: global batch 64 -> 128 (micro 8 x gas 4 -> micro 16 x gas 4 on 2 ranks), lr x1.41, ...``.

    ``unit`` names what the plan's world size counts (``"replica"`` for a pipeline's data-parallel replicas).
    ``scheduled``: with token budgets, the schedule's batch before and after and its unit (``"samples"``
    or ``"tokens"``), said in place of the two steps' sample counts (the step before may be an epoch's
    smaller tail; a step's samples vary with a token target).
    """
    ranks = unit if new.world_size == 1 else unit + "s"
    if scheduled is None:
        batches = f"{old.global_batch_size} -> {new.global_batch_size}"
    else:
        before, after, batch_unit = scheduled
        batches = f"{before} -> {after}" + (" tokens" if batch_unit == "tokens" else "")
    return (
        f"step {step}: global batch {batches} "
        f"(micro {old.micro_batch_per_gpu} x gas {old.gradient_accumulation_steps} -> "
        f"micro {new.micro_batch_per_gpu} x gas {new.gradient_accumulation_steps} on {new.world_size} "
        f"{ranks}), lr x{lr_ratio:.3g}, {reason}"
    )


class MetricsWriter:
    """Writes step records on rank 0: a JSONL file and DeepSpeed's monitor."""

    def __init__(self, jsonl_path: str | None, monitor: Any = None, *, is_rank0: bool = True) -> None:
        self.is_rank0 = is_rank0
        self.monitor = monitor if (monitor is not None and getattr(monitor, "enabled", False)) else None
        self._file: IO[str] | None = None
        self.path = jsonl_path
        if jsonl_path and is_rank0:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            # Append: a resumed run continues the same file.
            self._file = open(jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: StepMetrics) -> None:
        if not self.is_rank0:
            return
        if self._file is not None:
            self._file.write(json.dumps(record.to_dict(), allow_nan=True) + "\n")
            self._file.flush()
        if self.monitor is not None:
            x = record.samples
            events = [
                ("Train/adabatch/global_batch", record.global_batch, x),
                ("Train/adabatch/micro_batch_per_gpu", record.micro_batch_per_gpu, x),
                ("Train/adabatch/gradient_accumulation_steps", record.gradient_accumulation_steps, x),
                ("Train/adabatch/lr", record.lr, x),
                ("Train/adabatch/loss", record.loss, x),
                ("Train/adabatch/samples", record.samples, x),
                ("Train/adabatch/train_coverage", record.train_coverage, x),
                ("Train/adabatch/epoch", record.epoch, x),
            ]
            if record.tokens is not None:
                events.append(("Train/adabatch/tokens", record.tokens, x))
            if record.noise_scale is not None:
                events.append(("Train/adabatch/noise_scale", record.noise_scale, x))
            events += [(f"Train/adabatch/{key}", value, x) for key, value in record.extra.items()]
            self.monitor.write_events(events)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

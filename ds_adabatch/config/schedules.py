"""Config models of the batch-size schedules: the ``"adabatch".schedule`` section.

``ScheduleConfig`` is a discriminated union on ``type``. It is the single place where schedule types
register: add a model here or in ``adaptive_schedules.py`` (with ``type: Literal["name"]``) and to the union,
and implement its rule in
``ds_adabatch.schedules``.

Every model answers two questions the loader needs without running the schedule:
``initial_batch(world_size)`` (the first global batch) and ``endpoint_batches(world_size)`` (the
values that must lie inside ``min_global_batch`` / ``max_global_batch``, with the field each came from).
Models whose batch is per device answer ``None`` / ``[]`` when no world size is given.

Batch sizes are in samples (sequences, for a language model) per optimizer step over all data-parallel
ranks unless a field says otherwise.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from .adaptive_schedules import (
    DEFAULT_NOISE_SCALES,
    GoodputScheduleConfig,
    GradientNoiseScheduleConfig,
    LossPlateauScheduleConfig,
    SeesawScheduleConfig,
    measures_noise,
)
from .schedule_base import UNIT_DESCRIPTION, ScheduleConfigBase

__all__ = [
    "DEFAULT_NOISE_SCALES",
    "CallableScheduleConfig",
    "ConstantScheduleConfig",
    "GoodputScheduleConfig",
    "GradientNoiseScheduleConfig",
    "LinearScheduleConfig",
    "LossPlateauScheduleConfig",
    "PiecewiseScheduleConfig",
    "ScheduleConfig",
    "ScheduleConfigBase",
    "SeesawScheduleConfig",
    "StepScheduleConfig",
    "measures_noise",
]


class ConstantScheduleConfig(ScheduleConfigBase):
    """A fixed global batch."""

    type: Literal["constant"] = Field(description="Schedule type.")
    value: int = Field(ge=1, description="Global batch size, in `unit` per optimizer step.")
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=UNIT_DESCRIPTION,
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.value

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("value", self.value)]


class LinearScheduleConfig(ScheduleConfigBase):
    """Global batch moving linearly from ``start`` to ``end`` over the first ``ramp_samples`` samples."""

    type: Literal["linear"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at sample 0, in `unit` per optimizer step.")
    end: int = Field(
        ge=1, description="Global batch once ramp_samples samples have been consumed, in `unit`."
    )
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=UNIT_DESCRIPTION,
    )
    ramp_samples: int = Field(
        ge=0, description="Length of the ramp, in training samples consumed (all ranks together)."
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start), ("end", self.end)]

    @model_validator(mode="after")
    def _ramp_needs_length(self) -> LinearScheduleConfig:
        if self.ramp_samples == 0 and self.start != self.end:
            raise ValueError("ramp_samples must be > 0 when start differs from end")
        return self


class StepScheduleConfig(ScheduleConfigBase):
    """Megatron-LM's ``--rampup-batch-size start increment ramp_samples``: a staircase in samples.

    The batch moves from ``start`` to ``end`` in ``(end - start) / increment`` equal steps of
    ``increment`` samples, spread evenly over the first ``ramp_samples`` samples consumed, then holds
    ``end``. With ``n`` steps the batch after ``s`` samples is
    ``start + increment * min(n, floor(s * n / ramp_samples))`` (``end < start`` shrinks the same way).

    Example: ``{"type": "step", "start": 32, "end": 1536, "increment": 32,
    "ramp_samples": 6000000}`` adds 32 sequences every 127,659.6 samples.

    Where it can differ from Megatron-LM by one step: Megatron computes the number of increments as
    ``int(s / (ramp_samples / n))`` in floating point. When ``s * n / ramp_samples`` is exactly an
    integer (an exact change point), that quotient can come out just below it (``8992 / (8992 / 7) =
    6.999999999999999``) and Megatron moves to the next batch one optimizer step later. This schedule
    uses integer arithmetic and changes at the exact point; at every other sample count the two give
    the same batch (checked on random configurations, tests/test_schedules.py). Rounding: Megatron
    needs each batch to be a multiple of micro-batch x data-parallel size and, with
    ``--decrease-batch-size-if-needed``, rounds down to one; here a batch that is not plannable (not a
    multiple of ``granularity`` and, without ``allow_uneven``, of the world size) rounds to the nearest
    plannable batch (ties up), like every schedule's output. Choose ``increment`` and ``start`` as
    multiples of that grid to get the same batches as Megatron.
    """

    type: Literal["step"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at sample 0, in `unit` per optimizer step.")
    end: int = Field(
        ge=1, description="Global batch once ramp_samples samples have been consumed, in `unit` per step."
    )
    increment: int = Field(
        ge=1, description="Size of each step of the staircase, in `unit` per optimizer step."
    )
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=UNIT_DESCRIPTION,
    )
    ramp_samples: int = Field(
        ge=0, description="Length of the staircase, in training samples consumed (all ranks together)."
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start), ("end", self.end)]

    @model_validator(mode="after")
    def _steps_divide(self) -> StepScheduleConfig:
        span = abs(self.end - self.start)
        if span % self.increment:
            raise ValueError(
                f"|end - start| = {span} is not a multiple of increment {self.increment}; change "
                f"increment to a divisor of {span} or move end"
            )
        if self.ramp_samples == 0 and span:
            raise ValueError("ramp_samples must be > 0 when start differs from end")
        return self


_Point = tuple[
    Annotated[int, Field(ge=0, description="Position of the point, in the schedule's unit.")],
    Annotated[int, Field(ge=1, description="Global batch from this point on, in samples per step.")],
]


class PiecewiseScheduleConfig(ScheduleConfigBase):
    """A global batch given at points ``[[at, batch], ...]`` of a training clock.

    ``unit`` picks the clock: samples consumed, tokens consumed, or completed optimizer steps (the first
    step is step 0). Before the first point the first batch holds, after the last point the last one.
    Between points the batch holds each value until the next point, or, with ``interpolate``, moves
    linearly between them.

    Examples:
        DeepSeek-V2-style warm-up, 2304 -> 9216 sequences over the first 225B tokens::

            {"type": "piecewise", "unit": "tokens", "interpolate": true,
             "points": [[0, 2304], [225000000000, 9216]]}

        A GPT-3-style linear ramp from a small batch to the full 1536 sequences over 4B tokens::

            {"type": "piecewise", "unit": "tokens", "interpolate": true,
             "points": [[0, 16], [4000000000, 1536]]}

        A doubling plan by optimizer step (holds each value)::

            {"type": "piecewise", "unit": "steps", "points": [[0, 256], [1000, 512], [3000, 1024]]}

    The tokens clock needs the runtime (or ``simulate``) to count tokens.
    """

    type: Literal["piecewise"] = Field(description="Schedule type.")
    points: list[_Point] = Field(
        min_length=1,
        description="[[at, global batch], ...] with strictly increasing `at` (in `unit`); batches in "
        "samples per optimizer step. Start at 0 to set the first batch explicitly.",
    )
    unit: Literal["samples", "tokens", "steps"] = Field(
        default="samples",
        description="Clock of `at`: samples consumed, tokens consumed, or completed optimizer steps.",
    )
    interpolate: bool = Field(
        default=False,
        description="true: move linearly between points; false: hold each batch until the next point.",
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.points[0][1]

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [(f"points[{i}][1]", batch) for i, (_, batch) in enumerate(self.points)]

    @model_validator(mode="after")
    def _sorted(self) -> PiecewiseScheduleConfig:
        ats = [at for at, _ in self.points]
        for i in range(1, len(ats)):
            if ats[i] <= ats[i - 1]:
                raise ValueError(
                    f"points must have strictly increasing `at`: points[{i}] is at {ats[i]}, after "
                    f"points[{i - 1}] at {ats[i - 1]}; sort the points and drop duplicates"
                )
        return self


_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class CallableScheduleConfig(ScheduleConfigBase):
    """A user function ``fn(step, batch_size, **kwargs) -> int``, called at every evaluation.

    ``step`` is the number of completed optimizer steps, ``batch_size`` the function's previous result
    (``start`` the first time) in the function's unit, and the result becomes the next batch. With
    ``per: "device"`` the unit is samples per data-parallel rank per optimizer step (global / world
    size), the unit of a Hugging Face ``per_device_train_batch_size``.

    Example, +1 sample per device every 5 steps::

        {"type": "callable", "function": "my_pkg.schedules:grow", "start": 1, "per": "device",
         "kwargs": {"interval": 5, "increment": 1}}

    The function is imported by its dotted path when the schedule is built; it is never evaluated
    from text.
    """

    type: Literal["callable"] = Field(description="Schedule type.")
    function: str = Field(
        description="Import path 'package.module:name' of the function (name may be dotted, "
        "e.g. 'pkg.mod:Class.method')."
    )
    start: int = Field(ge=1, description="First batch, in the function's unit (see `per`).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function on every call."
    )
    per: Literal["global", "device"] = Field(
        default="global",
        description="Unit of `start` and of the function's batch: 'global' = samples per optimizer "
        "step over all ranks; 'device' = samples per rank per optimizer step.",
    )

    @field_validator("function")
    @classmethod
    def _path_shape(cls, value: str) -> str:
        if not _FUNCTION_PATH.match(value):
            raise ValueError(f"{value!r} is not an import path of the form 'package.module:function'")
        return value

    def initial_batch(self, world_size: int | None = None) -> int | None:
        if self.per == "global":
            return self.start
        return None if world_size is None else self.start * world_size

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        first = self.initial_batch(world_size)
        return [] if first is None else [("start", first)]


ScheduleConfig = Annotated[
    Union[  # noqa: UP007 - the registry of schedule types
        ConstantScheduleConfig,
        LinearScheduleConfig,
        StepScheduleConfig,
        PiecewiseScheduleConfig,
        CallableScheduleConfig,
        LossPlateauScheduleConfig,
        GradientNoiseScheduleConfig,
        GoodputScheduleConfig,
        SeesawScheduleConfig,
    ],
    Field(discriminator="type"),
]

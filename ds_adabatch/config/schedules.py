"""Config models of the batch-size schedules: the ``"adabatch".schedule`` section.

``ScheduleConfig`` is a discriminated union on ``type``. It is the single place where schedule types
register: add a model here (with ``type: Literal["name"]``) and to the union, and implement its rule in
``ds_adabatch.schedules``.

Every model answers two questions the loader needs without running the schedule:
``initial_batch(world_size)`` (the first global batch) and ``endpoint_batches(world_size)`` (the
values that must lie inside ``min_global_batch`` / ``max_global_batch``, with the field each came from).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ConstantScheduleConfig", "LinearScheduleConfig", "ScheduleConfig", "ScheduleConfigBase"]


class ScheduleConfigBase(BaseModel):
    """Common base: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def initial_batch(self, world_size: int | None = None) -> int | None:
        """The global batch (samples) of the first optimizer step; None if it depends on the world size."""
        raise NotImplementedError

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        """``(field, global batch)`` pairs that must lie inside the configured bounds."""
        raise NotImplementedError


class ConstantScheduleConfig(ScheduleConfigBase):
    """A fixed global batch."""

    type: Literal["constant"] = Field(description="Schedule type.")
    value: int = Field(ge=1, description="Global batch size, in samples per optimizer step.")

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.value

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("value", self.value)]


class LinearScheduleConfig(ScheduleConfigBase):
    """Global batch moving linearly from ``start`` to ``end`` over the first ``ramp_samples`` samples."""

    type: Literal["linear"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at sample 0, in samples per optimizer step.")
    end: int = Field(ge=1, description="Global batch once ramp_samples samples have been consumed.")
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


ScheduleConfig = Annotated[
    Union[ConstantScheduleConfig, LinearScheduleConfig],  # noqa: UP007 - the registry of schedule types
    Field(discriminator="type"),
]

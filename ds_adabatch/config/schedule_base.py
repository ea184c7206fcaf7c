"""The base of every schedule's config model (``"adabatch".schedule``): unknown keys are errors, and the
two questions the loader asks of every schedule without running it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["UNIT_DESCRIPTION", "ScheduleConfigBase"]

UNIT_DESCRIPTION = (
    "Unit of the global batch values: 'samples' per optimizer step, or 'tokens': the step takes samples "
    "of the global order until their lengths reach the value (needs adabatch.micro_batch_tokens and "
    "lengths given to ds_adabatch.initialize). The ramp is still measured in samples consumed."
)


class ScheduleConfigBase(BaseModel):
    """Common base: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def initial_batch(self, world_size: int | None = None) -> int | None:
        """The global batch (samples) of the first optimizer step; None if it depends on the world size."""
        raise NotImplementedError

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        """``(field, global batch)`` pairs that must lie inside the configured bounds."""
        raise NotImplementedError

    @property
    def batch_unit(self) -> str:
        """Unit of the schedule's global batch: ``"samples"``, or ``"tokens"`` where the model has
        ``unit: "tokens"`` (a token target per optimizer step)."""
        return (
            "tokens"
            if getattr(self, "unit", "samples") == "tokens" and self.type != "piecewise"
            else "samples"
        )

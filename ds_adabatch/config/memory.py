"""The ``memory`` sub-section of ``"adabatch"``: out-of-memory recovery and the learned micro-batch.

With ``"max_micro_batch_per_gpu": "auto"`` the runtime learns the largest micro-batch that fits: it
starts at ``initial_micro_batch_per_gpu`` (or the ceiling), halves on an out-of-memory error inside a
step, and tries a larger one again after ``grow_after_steps`` clean steps. With an integer
``max_micro_batch_per_gpu`` that integer is the ceiling and ``recover_from_oom`` still turns an
out-of-memory error into a smaller micro-batch for the same step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigProblem

__all__ = ["AUTO", "UNBOUNDED_MICRO_BATCH", "MemoryConfig", "memory_problems"]

AUTO = "auto"
"""The value of ``max_micro_batch_per_gpu`` that lets the runtime learn the micro-batch."""

UNBOUNDED_MICRO_BATCH = 1 << 30
"""The planning ceiling of ``"auto"`` without ``memory.micro_batch_ceiling``: no bound below the
samples a rank holds in one step (one micro-batch per rank, GAS 1, is the largest ever planned)."""


class MemoryConfig(BaseModel):
    """Out-of-memory recovery and how the micro-batch per GPU is learned."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    recover_from_oom: bool = Field(
        True,
        description=(
            "When a forward or backward pass raises an out-of-memory error on any rank, discard the "
            "step's partial gradients on every rank and re-run the same samples with a smaller "
            "micro-batch (more accumulation steps) in the same optimizer step. false: the error "
            "propagates. Required by max_micro_batch_per_gpu 'auto'."
        ),
    )
    initial_micro_batch_per_gpu: int | None = Field(
        None,
        ge=1,
        description=(
            "With max_micro_batch_per_gpu 'auto': the first micro-batch tried, in samples per forward "
            "pass. null: micro_batch_ceiling, or without one the whole first step's samples per rank "
            "(one accumulation step)."
        ),
    )
    micro_batch_ceiling: int | None = Field(
        None,
        ge=1,
        description=(
            "With max_micro_batch_per_gpu 'auto': the largest micro-batch ever tried, in samples per "
            "forward pass. null: no ceiling below one accumulation step."
        ),
    )
    grow_after_steps: int | None = Field(
        100,
        ge=1,
        description=(
            "Optimizer steps without an out-of-memory error before a larger micro-batch is tried "
            "again (up to the ceiling), in optimizer steps; null: never grow back."
        ),
    )
    backoff_factor: float = Field(
        2.0,
        ge=1.0,
        description=(
            "Each out-of-memory error at a micro-batch size multiplies the wait before that size is "
            "tried again by this factor (a dimensionless multiplier of grow_after_steps)."
        ),
    )


def memory_problems(max_micro: int | str, memory: MemoryConfig) -> list[ConfigProblem]:
    """Problems between ``max_micro_batch_per_gpu`` and the ``memory`` section (paths relative to it)."""
    problems: list[ConfigProblem] = []
    auto = max_micro == AUTO
    if not auto:
        for key in ("initial_micro_batch_per_gpu", "micro_batch_ceiling"):
            value = getattr(memory, key)
            if value is not None:
                problems.append(
                    ConfigProblem(
                        f"memory.{key}",
                        f"only applies with max_micro_batch_per_gpu 'auto' (it is {max_micro}): remove it, "
                        "or set max_micro_batch_per_gpu to 'auto'",
                        value,
                    )
                )
        return problems
    if not memory.recover_from_oom:
        problems.append(
            ConfigProblem(
                "memory.recover_from_oom",
                "must be true with max_micro_batch_per_gpu 'auto' (the micro-batch is learned from "
                "out-of-memory errors): set it to true, or give max_micro_batch_per_gpu an integer",
                False,
            )
        )
    first, ceiling = memory.initial_micro_batch_per_gpu, memory.micro_batch_ceiling
    if first is not None and ceiling is not None and first > ceiling:
        problems.append(
            ConfigProblem(
                "memory.initial_micro_batch_per_gpu",
                f"is larger than memory.micro_batch_ceiling ({ceiling}): make it <= {ceiling}",
                first,
            )
        )
    return problems

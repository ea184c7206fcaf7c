"""The ``memory`` sub-section of ``"adabatch"``: out-of-memory recovery and the learned micro-batch.

With ``"max_micro_batch_per_gpu": "auto"`` the runtime learns the largest micro-batch that fits: it
starts at ``initial_micro_batch_per_gpu`` (or the ceiling), halves on an out-of-memory error inside a
step, and tries a larger one again after ``grow_after_steps`` clean steps. With an integer
``max_micro_batch_per_gpu`` that integer is the ceiling and ``recover_from_oom`` still turns an
out-of-memory error into a smaller micro-batch for the same step. ``predict_peak`` keeps the limit below
the sizes each rank's allocator statistics predict not to fit, so growth never probes them.
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
    predict_peak: bool = Field(
        True,
        description=(
            "Learn each rank's peak memory per forward/backward pass against its size (samples per "
            "pass, or tokens per pass with micro_batch_tokens; one model per set_memory_key key) from "
            "the accelerator's allocator statistics, read on the host, and never plan or grow to a "
            "micro-batch whose predicted peak exceeds (1 - peak_margin) x device_memory_bytes. Agreed "
            "as the minimum over ranks inside the out-of-memory agreement (needs recover_from_oom); "
            "active where that agreement runs: on accelerators, or on the CPU under a simulated memory "
            "(ds_adabatch.testing.simulated_memory_limit(device_memory_bytes=...))."
        ),
    )
    peak_margin: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description=(
            "Fraction of device_memory_bytes kept free of predicted peaks (a dimensionless fraction: "
            "0.1 plans up to 90%), for what the allocator's statistics do not count: fragmentation of "
            "its cache, the CUDA context, other processes."
        ),
    )
    device_memory_bytes: int | None = Field(
        None,
        ge=1,
        description=(
            "Memory of one device that predicted peaks are compared against, in bytes; null: the "
            "accelerator's total memory (DeepSpeed's get_accelerator().total_memory())."
        ),
    )
    record_dir: str | None = Field(
        None,
        min_length=1,
        description=(
            "Folder (a path every node can read) for the records a process leaves when an out-of-memory "
            "error ends it (exit code 75), read by the next start when the engine is built. null: the "
            "checkpoint folder of the last save_checkpoint/load_checkpoint, read by the next start's "
            "load_checkpoint; before any, adabatch_oom_records in the working directory, read by the "
            "next start of the same torchrun launch."
        ),
    )


def memory_problems(max_micro: int | str, memory: MemoryConfig) -> list[ConfigProblem]:
    """Problems between ``max_micro_batch_per_gpu`` and the ``memory`` section (paths relative to it)."""
    problems: list[ConfigProblem] = []
    if "predict_peak" in memory.model_fields_set and memory.predict_peak and not memory.recover_from_oom:
        problems.append(
            ConfigProblem(
                "memory.predict_peak",
                "needs recover_from_oom true (the prediction is agreed inside the out-of-memory "
                "agreement): set recover_from_oom to true, or remove predict_peak",
                True,
            )
        )
    if not memory.predict_peak:
        for key in ("peak_margin", "device_memory_bytes"):
            if key in memory.model_fields_set:
                problems.append(
                    ConfigProblem(
                        f"memory.{key}",
                        "only applies with predict_peak true: remove it, or set predict_peak to true",
                        getattr(memory, key),
                    )
                )
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

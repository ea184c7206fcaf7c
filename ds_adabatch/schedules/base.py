"""The schedule protocol: a training context in, a desired global batch out.

A schedule is a callable ``schedule(ctx) -> float``. It returns the global batch it would like for
the optimizer step described by ``ctx`` (any positive real number); the
:class:`~ds_adabatch.schedules.BatchSizeController` applies bounds, granularity, the per-update change
cap and rounding, so schedules never deal with plannability. Rules that remember something between
calls (the callable's current batch, the plateau detector's history) expose a versioned
``state_dict()`` / ``load_state_dict()`` that the runtime checkpoints.

Every value in the context is global (summed or averaged over all ranks), so every rank that calls the
same schedule with the same context takes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Schedule",
    "ScheduleContext",
    "ScheduleError",
    "StatefulSchedule",
    "check_state",
]


class ScheduleError(ValueError):
    """A schedule produced something unusable (a user function's bad result, a missing signal)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleContext:
    """Where training stands before one optimizer step, as every rank sees it.

    Counters describe the past: ``step`` is the number of completed optimizer steps (the first
    ``train_batch()`` runs at step 0), ``samples`` and ``tokens`` what all ranks consumed before this
    step. Signals are the latest all-reduced measurements, ``None`` when not measured (yet).
    """

    step: int
    """Completed optimizer steps."""
    samples: int
    """Training samples consumed before this step, all ranks together."""
    global_batch: int
    """The global batch of the previous step (the initial batch at step 0), in samples."""
    world_size: int
    """Data-parallel ranks."""
    tokens: int | None = None
    """Tokens consumed before this step, all ranks together; None when the runtime does not count them."""
    epoch: float = 0.0
    """Fractional epochs consumed (samples / dataset size)."""
    loss: float | None = None
    """Latest global-mean training loss (all-reduced)."""
    loss_ema: float | None = None
    """Smoothed global-mean loss, if the runtime keeps one."""
    grad_norm: float | None = None
    """Latest global gradient norm (L2, after reduction, before clipping)."""
    noise_scale: float | None = None
    """Latest gradient-noise scale estimate B_simple, in samples."""
    noise_scale_error: float | None = None
    """Standard error of ``noise_scale`` relative to its value (unitless; ``inf`` while unknown, None
    where the caller does not measure it)."""
    lr: float | None = None
    """Learning rate of the latest step."""
    micro_batch_limit: int | None = None
    """The largest micro-batch per rank the next step may plan (samples; the learned limit where
    ``max_micro_batch_per_gpu`` is ``"auto"``); None: unbounded, or token-budget steps."""
    pass_budget: int | None = None
    """Token-budget steps (``micro_batch_tokens``): the token budget the next step's passes are cut
    with (the learned one after an out-of-memory error); None: steps of whole micro-batches."""


@runtime_checkable
class Schedule(Protocol):
    """A batch-size rule: ``schedule(ctx)`` is the desired global batch (samples, > 0).

    ``name`` is the config's ``type``; ``requires`` names the context signals (``"loss"``,
    ``"noise_scale"``, ``"tokens"``, ...) the rule reads, so callers know what to measure. A rule may
    set ``last_reason`` (one line saying why it returned what it did) for logging.

    A rule fed only the context decides identically on every rank, so the runtime needs no collective
    to agree on it. A rule whose answer may differ between ranks (a user's function) sets
    ``needs_agreement = True`` and offers ``shared_state()`` / ``load_shared_state(values)`` (a list of
    numbers): at each evaluation the runtime applies rank 0's answer and state everywhere.
    """

    name: str
    requires: frozenset[str]

    def __call__(self, ctx: ScheduleContext) -> float: ...


@runtime_checkable
class StatefulSchedule(Schedule, Protocol):
    """A schedule that remembers something between calls; the runtime checkpoints its state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_state(state: Any, *, kind: str, version: int) -> None:
    """Refuse a state dict that was not written by ``kind`` at ``version``, with a sentence."""
    if not isinstance(state, dict):
        raise ValueError(f"{kind} state must be a dict, got {type(state).__name__}")
    if state.get("kind") != kind:
        raise ValueError(f"this state was written by {state.get('kind')!r}, not by {kind!r}")
    if state.get("version") != version:
        raise ValueError(
            f"{kind} state has version {state.get('version')!r}; this ds_adabatch reads version {version}"
        )

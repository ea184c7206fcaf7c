"""The batch-size controller: schedule -> bounds, change cap, granularity -> an integer global batch.

The runtime asks it once before every optimizer step::

    controller = BatchSizeController(loaded.adabatch, world_size)
    batch = controller.initial_global_batch()           # plan the engine with this
    for each optimizer step:
        ctx = ScheduleContext(step=steps_done, samples=..., global_batch=batch, ...)
        batch = controller.next_global_batch(ctx).global_batch

The schedule is consulted at steps ``update_interval, 2 x update_interval, ...``; step 0 runs the
initial batch and the steps between evaluations keep the current one. Every answer is an integer that
``plan_batch`` can split. Asking twice for the same step returns the first answer without calling the
schedule again, so a stateful rule never advances twice for one step (e.g. around a checkpoint).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

from ..plan import batch_multiple, feasible_range, round_global_batch
from .base import Schedule, ScheduleContext, ScheduleError, check_state
from .registry import build_schedule

__all__ = ["BatchSizeController", "Decision", "batch_rule"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class Decision:
    """The global batch for one optimizer step and how it came about."""

    global_batch: int
    """Samples in the step, all ranks together; always plannable."""
    desired: float
    """What the schedule asked for (the held batch between evaluations)."""
    reason: str
    """One line for logs: the schedule's reason and every adjustment made."""
    rounded: bool
    """True when ``global_batch`` differs from ``desired`` (bounds, change cap or rounding)."""


class BatchSizeController:
    """Owns the schedule of an ``AdaBatchConfig`` and turns its wishes into plannable global batches.

    Args:
        config: the ``"adabatch"`` section (``AdaBatchConfig``): ``schedule``, ``min_global_batch``,
            ``max_global_batch``, ``granularity``, ``allow_uneven``, ``update_interval``,
            ``max_change_factor``.
        world_size: data-parallel ranks.

    Raises:
        PlanError: the bounds admit no plannable batch on this world size.
        ConfigError: a callable schedule's function cannot be imported.
    """

    def __init__(self, config: Any, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.config = config
        self.world_size = world_size
        self.schedule_config = config.schedule
        self.granularity = int(getattr(config, "granularity", 1) or 1)
        # Token-budget steps pack whatever samples a step holds into passes, so the global batch (a
        # token target, or a sample count) need not divide by the world size: no rounding to a multiple
        # of it, and a resume on another world size keeps the same targets (the same stream).
        self.allow_uneven = bool(
            getattr(config, "allow_uneven", False) or getattr(config, "token_budget", False)
        )
        self.min_global_batch = getattr(config, "min_global_batch", None)
        self.max_global_batch = getattr(config, "max_global_batch", None)
        self.update_interval = int(getattr(config, "update_interval", 1) or 1)
        factor = getattr(config, "max_change_factor", None)
        self.max_change_factor = None if factor is None else float(factor)
        self.multiple = batch_multiple(world_size, self.granularity, self.allow_uneven)
        self.lowest, self.highest = feasible_range(world_size, **self._bounds())
        self.schedule: Schedule = build_schedule(
            self.schedule_config,
            world_size=world_size,
            min_global_batch=self.lowest,
            max_global_batch=self.highest,
            granularity=self.granularity,
            allow_uneven=self.allow_uneven,
            min_from_config=self.min_global_batch is not None,
            lr_rule=batch_rule(getattr(config, "lr_scaling", None)),
            max_change_factor=self.max_change_factor,
        )
        self._last_step: int | None = None
        self._last_decision: Decision | None = None

    def _bounds(self) -> dict[str, Any]:
        return {
            "granularity": self.granularity,
            "min_global_batch": self.min_global_batch,
            "max_global_batch": self.max_global_batch,
            "allow_uneven": self.allow_uneven,
        }

    def _round(self, value: float) -> int:
        return round_global_batch(value, self.world_size, **self._bounds())

    def resume_batch(self, batch: int, saved_world_size: int) -> int:
        """The global batch to continue with after a resume from ``saved_world_size`` ranks.

        On the same world size the saved batch is kept. On another one a per-device ``callable``
        schedule keeps its per-device batch (global = per-device x new world size), and every batch is
        re-rounded to one plannable on this world size, inside the bounds.
        """
        if saved_world_size == self.world_size:
            return int(batch)
        from .user import CallableSchedule

        if isinstance(self.schedule, CallableSchedule) and self.schedule.per == "device":
            batch = self.schedule.current * self.world_size
        return self._round(batch)

    def evaluates_at(self, step: int) -> bool:
        """Whether the schedule itself is consulted for optimizer step ``step`` (else the batch holds)."""
        return step > 0 and step % self.update_interval == 0

    def initial_desired(self) -> float:
        """The schedule config's first batch, before rounding."""
        first = self.schedule_config.initial_batch(self.world_size)
        if first is None:  # only per-device configs without a world size; we always have one
            raise ScheduleError("the schedule's initial batch depends on a world size it was not given")
        return float(first)

    def initial_global_batch(self) -> int:
        """The global batch of step 0, rounded to a plannable value inside the bounds."""
        return self._round(self.initial_desired())

    def next_global_batch(self, ctx: ScheduleContext) -> Decision:
        """The global batch for the optimizer step ``ctx.step``."""
        if ctx.step == self._last_step and self._last_decision is not None:
            return self._last_decision
        if ctx.step <= 0:
            desired = self.initial_desired()
            decision = self._settle(desired, None, "initial batch")
        elif not self.evaluates_at(ctx.step):
            # Between evaluations: keep the batch, re-rounded only if it stopped being plannable
            # (a resume on another world size).
            held = float(ctx.global_batch)
            nxt = (ctx.step // self.update_interval + 1) * self.update_interval
            decision = self._settle(held, None, f"hold until step {nxt}")
        else:
            desired = self.schedule(ctx)
            if (
                isinstance(desired, bool)
                or not isinstance(desired, numbers.Real)
                or not math.isfinite(desired)
                or desired <= 0
            ):
                raise ScheduleError(
                    f"{self.schedule.name} schedule asked for global batch {desired!r} at step "
                    f"{ctx.step}; a schedule must return a finite number > 0"
                )
            reason = getattr(self.schedule, "last_reason", "") or self.schedule.name
            decision = self._settle(float(desired), ctx.global_batch, reason)
        self._last_step, self._last_decision = ctx.step, decision
        return decision

    def _cap_window(self, current: int) -> tuple[int, int] | None:
        """Plannable batches within ``max_change_factor`` of ``current``; None if there are none."""
        f = self.max_change_factor
        # The small tolerance keeps an exact product such as 64 x 1.25 = 80 inside the window.
        lo = math.ceil(current / f / self.multiple - 1e-9) * self.multiple
        hi = math.floor(current * f / self.multiple + 1e-9) * self.multiple
        lo = max(lo, self.lowest)
        if self.highest is not None:
            hi = min(hi, self.highest)
        return (lo, hi) if lo <= hi else None

    def _settle(self, desired: float, current: int | None, reason: str) -> Decision:
        notes = []
        target = desired
        if desired < self.lowest:
            notes.append(f"raised to the lowest plannable batch {self.lowest}")
        if self.highest is not None and desired > self.highest:
            notes.append(f"lowered to the highest plannable batch {self.highest}")
        window = None
        if self.max_change_factor is not None and current is not None and current > 0:
            window = self._cap_window(current)
            f = self.max_change_factor
            if window is not None and not current / f <= desired <= current * f:
                target = min(max(desired, current / f), current * f)
                notes.append(f"change capped by max_change_factor {f:g} from {current}")
        value = self._round(target)
        if window is not None:
            value = min(max(value, window[0]), window[1])
        if value != desired and not notes:
            notes.append(f"rounded {desired:.6g} -> {value} (multiple of {self.multiple})")
        full = "; ".join([reason, *notes]) if reason else "; ".join(notes)
        return Decision(global_batch=value, desired=desired, reason=full, rounded=value != desired)

    def state_dict(self) -> dict[str, Any]:
        """Versioned state: the schedule's own state and the last decision (global counts only)."""
        state_fn = getattr(self.schedule, "state_dict", None)
        return {
            "kind": "BatchSizeController",
            "version": _STATE_VERSION,
            "schedule_type": self.schedule.name,
            "world_size": self.world_size,
            "last_step": self._last_step,
            "last_decision": None if self._last_decision is None else asdict(self._last_decision),
            "schedule": state_fn() if callable(state_fn) else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the world size may differ (counts are global)."""
        check_state(state, kind="BatchSizeController", version=_STATE_VERSION)
        saved_type = state.get("schedule_type")
        schedule_state = state.get("schedule")
        if schedule_state is not None and saved_type != self.schedule.name:
            raise ValueError(
                f"the checkpoint holds the state of a {saved_type!r} schedule but the config now uses "
                f"{self.schedule.name!r}; resume with the same schedule type"
            )
        loader = getattr(self.schedule, "load_state_dict", None)
        if schedule_state is not None and callable(loader):
            loader(schedule_state)
        self._last_step, self._last_decision = None, None
        # The cached answer is only valid for the world size it was planned for.
        if state.get("world_size") == self.world_size and state.get("last_decision") is not None:
            self._last_step = state["last_step"]
            self._last_decision = Decision(**state["last_decision"])


def batch_rule(scaling: Any) -> str | None:
    """The batch-only LR rule the section's ``lr_scaling`` meets where the gradient is all noise (what
    ``goodput``'s "auto" efficiency pairs with): ``adascale``'s gain to the power 0.5 meets ``sqrt``, to
    the power 1 ``linear``; the others are their own."""
    rule = getattr(scaling, "rule", None)
    if rule == "adascale":
        return "sqrt" if float(getattr(scaling, "gain_power", 0.5)) < 1.0 else "linear"
    return rule

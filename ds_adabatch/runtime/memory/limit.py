"""The learned micro-batch limit: shrink on an out-of-memory error, grow back after clean steps.

:class:`MicroBatchMemory` is pure bookkeeping (no DeepSpeed, no collectives): the runtime feeds it
agreed facts (the same on every rank) and reads the integer limit the planner needs. One
:class:`_KeyState` is kept per shape key (``None`` unless the user names one, e.g. a sequence length),
so a run that alternates between short and long sequences remembers a limit for each.

Policy, per key:

- An OOM at micro-batch ``m`` sets the limit to the largest size a step ran clean below ``m`` when one
  is known and at least ``m // 2``, else ``m // 2``; ``m`` becomes the smallest known failing size and its failure count grows.
- After ``grow_after_steps`` clean steps at the current limit (times ``backoff_factor`` to the power of
  the failures recorded at the size to be tried) the limit grows: doubled (up to the ceiling) while no
  failure is known above it, else to the middle of the gap below the smallest failing size, and finally
  to that size itself; when a size that failed runs clean (memory was freed, or the budget rose) every
  recorded failure is forgotten and growth doubles again.
- A predicted bound (:meth:`MicroBatchMemory.set_cap`, the agreed verdict of the peak-memory predictor
  of :mod:`ds_adabatch.runtime.memory.predictor`) caps the limit the planner reads and every growth target:
  a size predicted not to fit is never tried. The bound itself is re-learned by every run; a checkpoint
  keeps the limit it bounded, so a resumed run plans no larger and grows back by the policy above.
- A limit learned by a process that then had to exit (:meth:`MicroBatchMemory.impose`, read from the
  records :mod:`ds_adabatch.runtime.memory.restart_record` leaves next to the checkpoints) lowers the limit
  and counts as a failure at the size that failed, also over a checkpoint loaded afterwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemoryDecision", "MicroBatchMemory"]

_VERSION = 1


@dataclass
class _KeyState:
    limit: int
    good: int | None = None  # largest micro-batch that completed a step without an OOM
    failures: dict[int, int] = field(default_factory=dict)  # micro-batch size -> OOMs there, not cleared
    clean_steps: int = 0  # steps completed at the current limit since it last changed
    cap: int | None = None  # the agreed predicted bound (re-learned by every run; folded into a saved limit)
    never_above: int | None = None  # below a size that ended an earlier process (see impose)

    @property
    def failed_at(self) -> int | None:
        """The smallest micro-batch that raised an OOM and has not run clean since."""
        return min(self.failures) if self.failures else None

    def to_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        cap = out.pop("cap")  # a resumed run plans below the bound it ran under till it agrees its own
        out["limit"] = self.limit if cap is None else max(1, min(self.limit, cap))
        out["failures"] = [[size, count] for size, count in sorted(self.failures.items())]
        return out


@dataclass(frozen=True)
class MemoryDecision:
    """A change of the micro-batch limit, for logs and ``engine.history``."""

    old_limit: int
    new_limit: int
    reason: str


class MicroBatchMemory:
    """The largest micro-batch per GPU to plan with, learned from out-of-memory errors.

    Args:
        initial: the first limit (samples per forward pass).
        ceiling: the largest limit ever planned.
        grow_after_steps: clean optimizer steps before a larger limit is tried; None: never grow.
        backoff_factor: multiplies that wait per recorded failure at the size to be tried.

    With an integer ``max_micro_batch_per_gpu`` the runtime builds it with that integer as both
    ``initial`` and ``ceiling``: an OOM lowers the limit, and it grows back to the integer at most.
    """

    def __init__(
        self,
        initial: int,
        ceiling: int,
        *,
        grow_after_steps: int | None = 100,
        backoff_factor: float = 2.0,
    ) -> None:
        if initial < 1 or ceiling < 1:
            raise ValueError(f"micro-batch limits must be >= 1, got initial {initial}, ceiling {ceiling}")
        self.initial = min(initial, ceiling)
        self.ceiling = ceiling
        self.grow_after_steps = grow_after_steps
        self.backoff_factor = backoff_factor
        self.key: Hashable = None
        self._states: dict[Hashable, _KeyState] = {}
        # (key, failing size, largest clean size) learned by an earlier process
        self._imposed: list[tuple[Hashable, int, int]] = []
        self._capped: MemoryDecision | None = None  # a move of the limit by the prediction, not yet said

    # -- reading --------------------------------------------------------------------------------
    def _state(self) -> _KeyState:
        state = self._states.get(self.key)
        if state is None:
            state = self._states[self.key] = _KeyState(limit=self.initial)
        return state

    @property
    def limit(self) -> int:
        """The micro-batch bound (samples per forward pass) to plan the next step with: the learned
        limit, capped by the agreed prediction."""
        state = self._state()
        bound = _bound(state)
        return state.limit if bound is None else max(1, min(state.limit, bound))

    def set_cap(self, cap: int | None) -> None:
        """The agreed predicted bound for the current key (None: none): sizes above it are not planned.
        Where it moves the limit the planner reads, :meth:`take_capped` says so once."""
        before = self.limit
        self._state().cap = None if cap is None else max(1, int(cap))
        if self.limit != before:
            self._capped = MemoryDecision(before, self.limit, "the predicted peak memory")

    def take_capped(self) -> MemoryDecision | None:
        """The latest move of the planned limit by the predicted bound since the last call, or None."""
        capped, self._capped = self._capped, None
        return capped

    def limits(self) -> dict[Hashable, int]:
        """The learned limit of every shape key seen so far."""
        return {key: state.limit for key, state in self._states.items()}

    def set_key(self, key: Hashable) -> None:
        """Switch to the limit learned for ``key`` (a new key starts at the initial limit)."""
        self.key = key

    # -- events ---------------------------------------------------------------------------------
    def on_oom(self, micro: int) -> MemoryDecision:
        """An OOM happened at micro-batch ``micro`` (the largest one the failed attempt ran).

        Raises:
            MemoryError: ``micro`` is 1: there is nothing smaller to try.
        """
        state = self._state()
        if micro <= 1:
            raise MemoryError("out of memory at a micro-batch of 1 sample: nothing smaller to try")
        old = state.limit
        state.failures[micro] = state.failures.get(micro, 0) + 1
        if state.good is not None and micro // 2 <= state.good < micro:
            new = state.good  # the largest size that ran clean, at least half the failing one
        else:
            new = max(1, micro // 2)
            if state.good is not None and state.good >= micro:
                state.good = None  # a size that ran before failed now: what ran clean is unknown again
        state.limit = min(new, micro - 1)
        state.clean_steps = 0
        return MemoryDecision(old, state.limit, f"out of memory at micro {micro}")

    def on_clean_step(self, micro: int) -> MemoryDecision | None:
        """A step finished without an OOM at (largest) micro-batch ``micro``; maybe grow the limit."""
        state = self._state()
        state.good = max(state.good or 0, micro)  # what ran, not the limit (a batch may run below it)
        if any(size <= micro for size in state.failures):
            # A size that failed ran clean: the budget rose or memory was freed, so every recorded
            # failure is stale and growth doubles again.
            state.failures = {}
        state.clean_steps += 1
        target = self._grow_target(state)
        if target is None:
            return None
        wait = self.grow_after_steps or 0
        failed_at = state.failed_at
        if failed_at is not None and target >= failed_at:
            wait = int(wait * self.backoff_factor ** max(state.failures[failed_at] - 1, 0))
        if state.clean_steps < wait:
            return None
        old = state.limit
        state.limit, state.clean_steps = target, 0
        why = "retry" if failed_at is not None and target >= failed_at else "grow"
        return MemoryDecision(old, target, f"{why} after {wait} clean steps")

    def _grow_target(self, state: _KeyState) -> int | None:
        target = self._policy_target(state)
        bound = _bound(state)
        if target is None or bound is None or target <= bound:
            return target
        # Predicted not to fit (or it ended a process): grow only as far as allowed, no probe above.
        return bound if bound > state.limit else None

    def _policy_target(self, state: _KeyState) -> int | None:
        if self.grow_after_steps is None or state.limit >= self.ceiling:
            return None
        if state.failed_at is None or state.failed_at > self.ceiling:
            return min(self.ceiling, state.limit * 2)
        if state.failed_at <= state.limit:
            return None
        if state.failed_at == state.limit + 1:
            return state.failed_at
        return (state.limit + state.failed_at + 1) // 2

    # -- limits learned by a process that had to exit -------------------------------------------
    def impose(self, key: Hashable, failed: int, good: int = 0) -> None:
        """An earlier process ran out of memory at size ``failed`` under ``key`` and could not recover:
        plan below it, as :meth:`on_oom` would have (from ``good``, the largest size that had run clean
        there, where it is at least half of ``failed``; 0: unknown), also over a checkpoint loaded later,
        and never try ``failed`` or more again under that key (a probe there would end the process again)."""
        self._imposed.append((key, int(failed), int(good)))
        self._apply_imposed([(key, int(failed), int(good))])

    def good_size(self) -> int:
        """The largest size that completed a step under the current key (0: none yet)."""
        return self._state().good or 0

    def _apply_imposed(self, imposed: list[tuple[Hashable, int, int]]) -> None:
        current = self.key
        for key, failed, good in imposed:
            self.key = key
            state = self._state()
            if 0 < good < failed:
                state.good = max(state.good or 0, good) if (state.good or 0) < failed else good
            if failed > 1 and state.limit >= failed:
                self.on_oom(failed)
            elif failed > 1:
                state.failures[failed] = state.failures.get(failed, 0) + 1
            state.never_above = max(1, min(failed - 1, state.never_above or failed))
        self.key = current

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Versioned state: every key's limit and history (keys are stored with their ``repr``)."""
        return {
            "version": _VERSION,
            "key": repr(self.key),
            "keys": {repr(key): state.to_dict() for key, state in self._states.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version = state.get("version")
        if version != _VERSION:
            raise ValueError(
                f"memory state version {version!r} is not supported (expected {_VERSION}); "
                "resume with the ds_adabatch version that wrote the checkpoint"
            )
        by_repr = {repr(key): key for key in self._states}
        restored: dict[Hashable, _KeyState] = {}
        for text, values in state["keys"].items():
            key = by_repr.get(text, parse_key(text))
            values = dict(values)
            values["limit"] = min(int(values["limit"]), self.ceiling)
            values["failures"] = {int(size): int(count) for size, count in values["failures"]}
            restored[key] = _KeyState(**values)
        self._states = restored
        self.key = parse_key(state["key"])
        self._apply_imposed(self._imposed)  # what an earlier process learned after this checkpoint


def _bound(state: _KeyState) -> int | None:
    """The tighter of the predicted bound and the bound below a size that ended a process."""
    bounds = [b for b in (state.cap, state.never_above) if b is not None]
    return min(bounds) if bounds else None


def parse_key(text: str) -> Hashable:
    """Keys are ``None``, ints or strings (what ``set_memory_key`` documents); others stay as text."""
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, Hashable) else text

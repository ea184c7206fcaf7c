"""Couple the learning rate to a changing global batch.

Two things change when the batch does:

* ``lr_scaling`` multiplies whatever LR the scheduler (or the optimizer, without one) sets by
  ``1``, ``B / reference``, ``sqrt(B / reference)`` or, with ``adascale``, AdaScale's gain at the
  measured noise scale raised to ``gain_power`` (:mod:`ds_adabatch.schedules.lr`).
* ``lr_schedule_unit: "samples"`` advances the wrapped scheduler once per ``reference_batch`` samples
  consumed instead of once per optimizer step, so a batch ramp neither stretches nor shrinks warmup
  and decay (the samples-based schedules Megatron-LM uses).

:class:`BatchCoupledLR` replaces ``engine.lr_scheduler`` on the DeepSpeed engine. DeepSpeed 0.19.8 calls
``lr_scheduler.step()`` once per applied optimizer step (``DeepSpeedEngine._take_model_step``) and saves
and loads ``lr_scheduler.state_dict()`` in its checkpoints, so this object sits where DeepSpeed already
looks and its state travels in DeepSpeed's checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from ...schedules.lr import NOISE_DRIVEN_RULES, lr_multiplier

__all__ = ["BatchCoupledLR", "CurrentBaseLR"]

_STATE_VERSION = 1


class BatchCoupledLR:
    """A scheduler wrapper that applies the batch-size LR multiplier and the schedule unit.

    The wrapped scheduler always sees unscaled learning rates: before it steps, the multiplier is
    divided out of every parameter group, and applied again afterwards. Schedulers that read the
    current LR (chainable torch schedulers) therefore never compound the multiplier.

    Args:
        optimizer: the optimizer whose ``param_groups`` carry the LR (DeepSpeed's wrapper is fine).
        scheduler: the user's or DeepSpeed's scheduler, or ``None``.
        unit: ``"steps"`` or ``"samples"``.
        reference_batch: samples per scheduler step in ``"samples"`` mode; also the batch at which
            the multiplier is 1.
        rule: ``"none"``, ``"linear"``, ``"sqrt"`` or ``"adascale"``.
        gain_power: the power of AdaScale's gain under ``"adascale"`` (0.5: Adam-type optimizers).
    """

    scheduler: Any = None  # a class default, so __getattr__ never runs for it

    def __init__(
        self,
        optimizer: Any,
        scheduler: Any,
        *,
        unit: str,
        reference_batch: int,
        rule: str,
        gain_power: float = 0.5,
    ):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.unit = unit
        self.reference_batch = reference_batch
        self.rule = rule
        self.gain_power = float(gain_power)
        self.noise_scale: float | None = None
        """The gradient-noise scale ``"adascale"`` reads, as last told by the runtime (None: none yet)."""
        self.multiplier = 1.0
        self.samples = 0  # samples consumed, as last told by the runtime
        self.inner_steps = 0  # times the wrapped scheduler has stepped

    # -- what the runtime calls -------------------------------------------------------------------
    @property
    def follows_noise(self) -> bool:
        """Whether the rule reads the noise scale, so the runtime applies it before every step (a held
        batch's multiplier moves with the estimate), not only when the plan changes."""
        return self.rule in NOISE_DRIVEN_RULES

    def observe_noise(self, noise_scale: float | None) -> None:
        """Tell the coupling the current gradient-noise estimate (read by ``"adascale"``)."""
        self.noise_scale = noise_scale

    def multiplier_for(self, global_batch: int) -> float:
        """The LR multiplier ``rule`` gives for ``global_batch`` (at the last observed noise scale)."""
        return lr_multiplier(
            self.rule,
            global_batch,
            self.reference_batch,
            noise_scale=self.noise_scale,
            gain_power=self.gain_power,
        )

    def set_global_batch(self, global_batch: int) -> float:
        """Apply the multiplier for ``global_batch`` to the optimizer now; returns it."""
        self._rescale(self.multiplier_for(global_batch))
        return self.multiplier

    def set_multiplier(self, multiplier: float) -> float:
        """Apply ``multiplier`` to the optimizer now in place of the rule's (a caller's own coupling, such
        as a gain read from the noise scale each step); returns it. Under ``ds_adabatch.initialize``'s
        engines it holds until the next plan change, which applies the rule's again
        (``AdaptiveBatchSizeTrainer`` applies the rule's before every step); it is saved with the LR
        state like the rule's.

        Raises:
            ValueError: a multiplier that is not a finite number > 0.
        """
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, (int, float))
            or not 0 < multiplier < math.inf
        ):
            raise ValueError(f"the LR multiplier must be a finite number > 0, got {multiplier!r}")
        self._rescale(float(multiplier))
        return self.multiplier

    def set_samples(self, samples: int) -> None:
        """Tell the wrapper how many samples have been consumed once this optimizer step completes."""
        self.samples = samples

    def rebind(self, optimizer: Any, scheduler: Any, *, reference_batch: int) -> None:
        """Wrap the optimizer and scheduler of a rebuilt DeepSpeed engine (a live recovery on another
        world): this object, the one ``initialize`` returned, stays the script's scheduler. The counts
        start afresh, as in a new wrapper; the caller then loads the saved state."""
        self.optimizer, self.scheduler = optimizer, scheduler
        self.reference_batch = reference_batch
        self.multiplier, self.samples, self.inner_steps = 1.0, 0, 0

    def release(self) -> None:
        """Let go of a failed world's optimizer and scheduler until :meth:`rebind`."""
        self.optimizer = self.scheduler = None

    # -- what DeepSpeed calls ---------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Called by DeepSpeed once per applied optimizer step."""
        if self.scheduler is None:
            return
        if self.unit == "samples":
            target = self.samples // self.reference_batch
            todo = target - self.inner_steps
        else:
            todo = 1
        if todo <= 0:
            return
        saved = self.multiplier
        self._rescale(1.0)
        for _ in range(todo):
            self.scheduler.step(*args, **kwargs)
        self.inner_steps += todo
        self._rescale(saved)

    def get_lr(self) -> list[float]:
        """The learning rates in effect (multiplier included), one per parameter group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "multiplier": self.multiplier,
            "samples": self.samples,
            "inner_steps": self.inner_steps,
            "unit": self.unit,
            "reference_batch": self.reference_batch,
            "rule": self.rule,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"learning-rate state has version {state.get('version')!r}; this ds_adabatch reads "
                f"version {_STATE_VERSION}"
            )
        # The optimizer's LRs were restored scaled by the saved multiplier; record it so the next
        # rescale divides the right factor out.
        self.multiplier = float(state["multiplier"])
        self.samples = int(state["samples"])
        self.inner_steps = int(state["inner_steps"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def __getattr__(self, name: str) -> Any:
        # Anything else (last_batch_iteration, warmup_num_steps, ...) is the wrapped scheduler's.
        if self.scheduler is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    # -- internals --------------------------------------------------------------------------------
    def _rescale(self, new: float) -> None:
        if new == self.multiplier:
            return
        factor = new / self.multiplier
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self.multiplier = new


class CurrentBaseLR:
    """The run's base LR for LR-aware schedules (``seesaw``): the wrapped scheduler's LR, unscaled.

    Implements ``ds_adabatch.schedules.BaseLRSource``. ``base_lr(samples)`` is the first parameter
    group's LR with the batch multiplier divided out, i.e. exactly what the user's DeepSpeed or torch
    scheduler set for the coming step. It only answers for the samples count the run is at: the
    scheduler has no way to tell its LR at another point without being stepped there.
    """

    def __init__(self, coupled: BatchCoupledLR) -> None:
        self.coupled = coupled

    def base_lr(self, samples: int) -> float:
        if samples != self.coupled.samples:
            raise ValueError(
                f"the run's LR scheduler is at sample {self.coupled.samples}, not {samples}; only the "
                "current base LR can be read from it"
            )
        groups = self.coupled.optimizer.param_groups
        return float(groups[0]["lr"]) / self.coupled.multiplier

"""A goodput trial's verdict where step times scatter: undone only on a clear one.

A move to a shape never measured is a trial (:mod:`~ds_adabatch.schedules.goodput`), judged once a few of
its step times are kept. Step times scatter, so a trial is undone only where going back gains by more
than two standard errors of the measured cost ratio
(:meth:`~ds_adabatch.signals.ThroughputModel.ratio_error`, from the scatter of both shapes' kept step
times). Otherwise it is measured again, one step at a time, until the verdict is clear or the model
keeps a full window of its step times (8), and then judged on them as any trial is. On a CPU, where a trial of 2x costs 50-90% more with a few percent of scatter, the verdict
is as clear at 3 step times as before; on one H200 (a host-bound step), 3 step times of a free batch
read +6% to +42% in 4 of 7 warm-up trials, and each undid it.
"""

from __future__ import annotations

import math
from typing import Any

from ..signals.throughput import ThroughputModel

__all__ = ["TRIAL_STEPS", "trial_of_state", "within_the_scatter"]

TRIAL_STEPS = 3
"""Kept step times of a shape never run before after which a move to it is judged again (a trial),
without waiting for the next ``decide_every`` step: a larger batch predicted from a flat fit costs, where
it is not free, every step it is kept (10 steps of 16 at the 2-core CPU benchmark's step 20 put the
validation loss about 100 samples behind batch 8's for the next thousands). Three, so that the median is
not one slow step's."""


def within_the_scatter(
    throughput: ThroughputModel,
    trial: tuple[int, int],
    left: tuple[int, int],
    world: int,
    gain: float,
    threshold: float,
) -> str | None:
    """None where the kept step times of the trial's shape and of the shape it left (``(micro, GAS)``
    at ``world`` ranks) tell going back's ``gain`` above ``threshold``: by more than two standard errors
    of their cost ratio (undo the trial). Else the reason's words for by how little it is above."""
    error = throughput.ratio_error(trial, left, world)
    if math.log(gain / threshold) > 2.0 * error:
        return None
    kept = next((n for m, g, _, n in throughput.measured(world) if (m, g) == trial), 0)
    return f"less than two standard errors ({math.expm1(2.0 * error):.1%}) of its {kept} step times"


def trial_of_state(
    state: dict[str, Any], warmup_steps: int
) -> tuple[tuple[int, int, int, int, int, int] | None, bool]:
    """A goodput schedule state's open trial ``(step, micro, GAS, world, batch it left, batch it moved
    to)`` and whether it was taken on step cost. States written before a trial kept its batch hold the
    first five (its batch: its shape's, split evenly); before it kept how it was taken, a trial opened
    in the warm-up was taken on step cost."""
    trial = state.get("trial")  # absent from states written before trials were judged early
    if trial is not None and len(trial) == 5:
        trial = [*trial, trial[1] * trial[2] * trial[3]]
    by_cost = state.get("trial_by_cost", trial is not None and trial[0] < warmup_steps)
    return (None if trial is None else tuple(int(v) for v in trial)), bool(by_cost)  # type: ignore[return-value]

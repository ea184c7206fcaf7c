"""Step times for the goodput schedule's throughput model, measured at two named points of a step.

``step_started()`` where the step begins (``train_batch``, or the loop loader's first micro-batch of a
step) and ``step_finished(plan, ...)`` after its optimizer step, from :meth:`_complete_step`. Between
them the step's whole cost: the decision, the data, every pass, the optimizer step.

* CPU (and any device without events): the host's ``perf_counter`` around the step, which is the step
  there.
* CUDA: an event recorded at each point; the step's device time is read one step later (the previous
  step's events), when its work has long finished, so reading it adds no host synchronisation to a
  steady step (``Event.synchronize()`` on a finished event returns at once).

A step that starts after a pause (a gap since the previous step's end longer than the step itself, than
:data:`PAUSE_FACTOR` times the recent gaps' median and than :data:`PAUSE_SECONDS`: an evaluation, a
checkpoint, the job waiting on something else) is flagged, in the same collective (flagged where any
rank paused), and the model keeps the slower times that follow out of its fit
(:data:`~ds_adabatch.signals.throughput.SETTLE_STEPS`).

Every rank queues one value per step, its time (0 where the step was re-run after an out-of-memory
error, or there is no time yet), in the step's :class:`~.step_sync.StepSync`: it rides the next
collective the step issues anyway, and the sum over processes divided by their number (the ranks' mean,
identical everywhere) is fed to :class:`~ds_adabatch.signals.ThroughputModel` with the step's shape:
``(micro, GAS, world)``, or for a token-budget step (``micro_batch_tokens``) ``(its token budget, its
passes per rank, world)`` with its samples and their lengths (which the model packs, with the token
sampler's packer bound by the step core, to predict other batches' passes).

A simulated curve (``DS_ADABATCH_SIMULATED_STEP_TIME``, read when the engine is built, in
:func:`~ds_adabatch.signals.parse_step_time_curve`'s syntax) replaces the measured time by the curve's
value for the step's shape (with its ``jitter``, a noisy measurement of that value, and its ``drift``, a
device whose speed changes): tests and
demonstrations make the cost flat (host-bound) or growing (compute-bound) on any machine.

When the schedule does not read step times the engine holds :class:`NoStepTimes`, which does nothing.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from ...signals import SimulatedDevice, StepTimeFit, ThroughputModel, parse_step_time_curve
from .sync import StepSync

__all__ = [
    "PAUSE_GAPS",
    "SIMULATED_STEP_TIME_ENV",
    "NoStepTimes",
    "StepTimes",
    "is_pause",
    "step_shape",
    "step_times_for",
]

logger = logging.getLogger("ds_adabatch")

SIMULATED_STEP_TIME_ENV = "DS_ADABATCH_SIMULATED_STEP_TIME"
PAUSE_FACTOR = 4.0
"""A gap between two steps is a pause where it is longer than the step after it, than this many times
the median of the last :data:`PAUSE_GAPS` gaps (what a loop does between its steps, however long, is its
normal) and than :data:`PAUSE_SECONDS`."""
PAUSE_GAPS = 16
"""The recent gaps between steps whose median is the loop's normal (:data:`PAUSE_FACTOR`)."""
PAUSE_SECONDS = 0.05
"""The shortest gap that is a pause: shorter ones are the host's own hiccups (steps of a few ms see them
at random)."""


class NoStepTimes:
    """The feature switched off: no measurement, nothing queued."""

    model: ThroughputModel | None = None

    def step_started(self) -> None:
        pass

    def step_finished(
        self,
        plan: Any,
        started: float,
        sync: StepSync,
        *,
        retried: bool,
        measuring: bool = False,
        step: Any = None,
    ) -> None:
        pass


class StepTimes(NoStepTimes):
    """Measures every step and feeds the agreed times to ``model`` (module docstring).

    Args:
        model: the throughput model the schedule reads.
        device: the engine's device (events on CUDA).
        processes: processes in the step's all-reduce (the mean divides by it).
        curve: a simulated step-time curve replacing the measurement; None: measure.
    """

    def __init__(
        self, model: ThroughputModel, device: Any, processes: int, curve: StepTimeFit | None = None
    ) -> None:
        self.model = model
        self.processes = max(1, int(processes))
        self.curve = curve
        # A simulated curve's jitter and drift: drawn from the run's torch seed, so a run repeats with it.
        self._device = None if curve is None else SimulatedDevice(curve, random.Random(torch.initial_seed()))
        self._cuda = curve is None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._start: Any = None
        # (start, end, shape, retried, measuring, paused)
        self._previous: tuple[Any, Any, tuple[int, int, int, int | None, Any], bool, bool, bool] | None = None
        self._ended: float | None = None  # when the previous step finished (perf_counter)
        self._gaps: deque[float] = deque(maxlen=PAUSE_GAPS)
        self.pauses = 0
        """Steps that started after a pause on this rank (:data:`PAUSE_FACTOR`)."""

    def step_started(self) -> None:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def step_finished(
        self,
        plan: Any,
        started: float,
        sync: StepSync,
        *,
        retried: bool,
        measuring: bool = False,
        step: Any = None,
    ) -> None:
        """Queue the step's time; ``measuring``: the step was split to measure the noise scale (its
        time prices that measurement and is not fitted as its shape's, ThroughputModel); ``step``: the
        step's :class:`~ds_adabatch.data.StepBatch` (a token-budget step is keyed by its budget)."""
        shape = step_shape(plan, step)
        paused = self.curve is None and self._after_pause(started)
        if self._device is not None:
            seconds = 0.0 if retried else self._device.measure(shape[0], shape[1])
        elif self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            previous, self._previous = self._previous, (self._start, end, shape, retried, measuring, paused)
            # The first step has no time yet, and its samples are counted with it a step later.
            shape, seconds = (
                (previous[2], _elapsed(previous)) if previous is not None else ((*shape[:3], None, None), 0.0)
            )
            measuring, paused = (previous[4], previous[5]) if previous is not None else (False, False)
        else:
            seconds = 0.0 if retried else time.perf_counter() - started
        model, processes = self.model, self.processes
        micro, gas, world, samples, lengths = shape

        def observe(sums: list[torch.Tensor]) -> None:
            seconds = float(sums[0]) / processes
            model.observe(
                micro,
                gas,
                world,
                seconds,
                measuring=measuring,
                samples=samples,
                lengths=lengths,
                paused=float(sums[1]) > 0,
            )

        sync.defer([float(seconds), float(paused)], observe)
        self._ended = time.perf_counter()

    def _after_pause(self, started: float) -> bool:
        """Whether the step that started at ``started`` (and has just finished) followed a pause."""
        if self._ended is None:
            return False
        gap = started - self._ended
        paused = is_pause(gap, time.perf_counter() - started, self._gaps)
        self._gaps.append(max(gap, 0.0))
        self.pauses += paused
        return paused


def is_pause(gap: float, step: float, recent_gaps: Iterable[float]) -> bool:
    """Whether ``gap`` seconds between a step's predecessor's end and its start, before a step of ``step``
    seconds, is a pause: longer than the step, than :data:`PAUSE_FACTOR` times the median of
    ``recent_gaps`` (the loop's normal between steps) and than :data:`PAUSE_SECONDS`."""
    recent = list(recent_gaps)
    usual = PAUSE_FACTOR * statistics.median(recent) if recent else 0.0
    return gap > max(step, usual, PAUSE_SECONDS)


def step_shape(plan: Any, step: Any = None) -> tuple[int, int, int, int | None, Any]:
    """``(micro, GAS, world, samples, lengths)`` the throughput model keys a step of ``plan`` by: the
    plan's micro-batch and GAS (samples and lengths None); for a token-budget step (``step.global_batch``
    a :class:`~ds_adabatch.data.tokens.TokenStep`) its token budget, its passes per rank, its samples
    and their lengths."""
    packed = getattr(step, "global_batch", None)
    budget = getattr(packed, "budget", None)
    if budget is None:
        return plan.micro_batch_per_gpu, plan.gradient_accumulation_steps, plan.world_size, None, None
    return int(budget), plan.gradient_accumulation_steps, plan.world_size, int(packed.size), packed.lengths


def _elapsed(measured: tuple[Any, ...]) -> float:
    """Seconds between a finished step's events (0 for a retried step or a missing start)."""
    start, end, _, retried = measured[:4]
    if retried or start is None:
        return 0.0
    end.synchronize()  # recorded a whole step ago: finished, so this does not wait
    return start.elapsed_time(end) / 1e3


def step_times_for(schedule: Any, model: ThroughputModel | None, device: Any) -> NoStepTimes:
    """:class:`StepTimes` where ``schedule`` reads ``"step_time"`` (with the simulated curve of
    ``DS_ADABATCH_SIMULATED_STEP_TIME`` if set), else :class:`NoStepTimes`.

    Raises:
        ValueError: the environment variable holds no valid curve.
    """
    if model is None or "step_time" not in getattr(schedule, "requires", ()):
        return NoStepTimes()
    text = os.environ.get(SIMULATED_STEP_TIME_ENV)
    curve = None
    if text:
        try:
            curve = parse_step_time_curve(text)
        except ValueError as exc:
            raise ValueError(f"{SIMULATED_STEP_TIME_ENV}: {exc}") from None
        logger.warning(
            "step times are simulated (%s=%s): %s", SIMULATED_STEP_TIME_ENV, text, curve.describe()
        )
    processes = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return StepTimes(model, device, processes, curve)

"""The time of an optimizer step as a function of its shape, learned from the steps the job runs.

A data-parallel step of ``W`` ranks, each running ``GAS`` passes (forward + backward) of ``m`` samples,
costs::

    step_time(m, GAS, W) = fixed + GAS x (per_pass + per_sample x m)

``fixed`` is what a step pays once (the gradient reduction, the optimizer step, the host's bookkeeping),
``per_pass`` what every pass pays whatever its size (kernel launches, Python, a pass's share of hooks),
``per_sample`` what grows with the samples in a pass (the arithmetic). A host-bound step (a small model
on a fast GPU) is nearly all ``fixed`` and ``per_pass``: a larger micro-batch is almost free. A
compute-bound one (a CPU) is nearly all ``per_sample``. With token budgets ``m`` counts tokens per pass.

:class:`ThroughputModel` fits the three non-negative coefficients by weighted least squares over the
distinct shapes it has seen, each represented by the median of its last ``window`` step times (robust
to a slow step now and then); the first step of a new shape is not kept (it pays one-off costs: the
allocator growing, kernels tuned for the new size). Residuals are relative (weights ``n / t^2``): a
10 ms error matters as much at 100 ms as 1 ms does at 10 ms.

What the data cannot tell apart is resolved the same way every time: among the fits with the smallest
residual, the one with fewest non-zero coefficients, then the one putting the cost in ``fixed`` rather
than ``per_pass``, and in ``per_pass`` rather than ``per_sample``. With one measured shape the model is
therefore flat: an untried larger micro-batch is predicted to cost what the tried one did. That is
optimistic on purpose: the goodput schedule explores at most a bounded factor beyond what it measured,
measures, and the next fit corrects the guess.

Measured step times scatter, and two shapes' medians of a few steps can differ where their costs do
not: on one H200 the medians of 3 early steps of a free batch read +6% to +42% against another's. The model reads the
scatter from the kept times (:meth:`ThroughputModel.log_spread`: the variance of a step's log time about
its shape's, from the median difference of two times of a shape, so one slow step does not widen it)
and keeps the flat fit wherever the best fit improves on it by no more than that scatter explains
(:func:`fit_step_time`'s ``spread``). Only the flat fit gets this benefit of the doubt, for the reason
above: it leads to a trial that measures, where a fit in proportion to the samples would rule out ever
trying a larger batch. With exact times (a simulated curve without ``jitter``) the spread is 0 and
nothing changes. On a simulated 40 ms host-bound step scattered by 0.25 in log, 89 of 100 runs of the
default warm-up climbed from 8 to 128 in its 20 steps, where 32 did when the slope between two noisy
medians was taken as real (``tests/test_goodput.py``). Two shapes a goodput trial's verdict told apart
stay so (:meth:`ThroughputModel.judged_apart`), and where the fitted line contradicts the measured
medians beyond their scatter the schedule rates with them (:meth:`ThroughputModel.rated_time`).

Steps that also measure the noise scale (a one-pass step run as two half passes, with the probe's
hooks working) are kept apart: their time is the shape's plus the measurement's, and fitted with the
ordinary steps it would read as a per-pass cost (on the 2-core CPU benchmark a split step of batch 8
cost 36 ms against 27 ms whole, which made the fit put 7 ms per pass and rate batch 8 at 241 samples/s
where it ran 290). They price the measurement (:meth:`ThroughputModel.predict_measuring`) and nothing
else.

Steps after a pause run slower for a while: on the 2-core CPU benchmark, whose policies train in turns,
the first step of batch 8 after another's turn cost 1.40x the steady one (median of 120 pauses; 1.70x at
the 90th percentile) and the next three 1.02-1.07x (1.27x); after a second of evaluation, other work or
idling (``benchmarks/pause_steps.py``) the first cost 1.23-1.31x and the next three up to 1.08x, and the
median of the kept times, read 4 or 8 steps after the pause, up to 1.19x the steady step. So the runtime
says which steps follow a pause (``observe(paused=True)``: an evaluation, a checkpoint, the job waiting
on something else), and from there times are not kept until one measures no slower than its shape's
median (the pause is over), or :data:`SETTLE_STEPS` have gone by (the device itself got slower: its
times are the news). Loading a state is such a pause.

The device's speed can change after a step time was kept (other work on the machine, a policy's turn
ending): every kept time is read at the speed now, corrected by how much the shapes run since slowed
down or sped up while each ran (:mod:`ds_adabatch.signals.drift`: only changes beyond their times'
scatter, so exact times are read as they are), and a shape's median is taken over its times so read.

A shape's times can go stale: a few unlucky steps (a pause, a neighbour on the machine, a GPU's first
steps at a new size) can rate a shape slower than it runs, and a shape left is never measured again.
With ``forget_after`` N, a shape that has not run for N steps (observations of other shapes) is
forgotten, its times, skip count and measuring times alike: the fit then rests on what ran recently,
a forgotten shape is predicted from it as an untried one (the goodput schedule's ``remeasure_after``),
and a move there is a trial again, judged on fresh step times.

Token budgets (``micro_batch_tokens``): a step's samples are packed into passes of at most the token
budget, so its shape is ``(budget, passes per rank)``: ``m`` is the budget in tokens (a pass is filled
up to it, so its cost is the budget's) and ``GAS`` the passes every rank ran, which the packing, not a
planner, decides. Such observations also carry the step's samples and their lengths, from which
:meth:`ThroughputModel.passes_for` predicts how many passes another batch takes. The runtime binds
the token sampler's packer (:meth:`ThroughputModel.bind_packer`): the latest :data:`LENGTHS_KEPT`
lengths, cut into runs of ``B`` consecutive samples (the data's order, so a bucketed order packs as it
will), are packed as a step would be and their passes averaged (at quarter-octave batches, linear
between). Measured after 40 steps on lengths 8-63 tokens, 2 ranks, at batches 8 to 1000: within 5% of
the passes taken with a budget of 256 (steps of 48 ran); with a budget of 2048, where the steps of 16
ran one pass that was never full, exact at 8 of the 10 batches and at most 16% off. Without a packer,
or before enough lengths were seen (:meth:`ThroughputModel.bind_packer`), a full pass holds ``q``
samples, measured over the recent steps with each rank's last pass counted half full (it holds what
is left), so ``B`` samples on ``W`` ranks take ``B / (W x q) + 1/2`` passes per rank (at least 1): up
to 7% too many in the first case (a larger batch packs better), and up to 3.2x too many in the second
(64 samples: 2.5 passes, where they take 1). The first steps not kept (``skip_first``) are those at a
new budget, not at a new pass count: a batch's steps take a varying number of passes, and keying
their first steps out would leave most of them unmeasured.

World size: observations carry it. A rank's passes cost the same on any number of ranks; only the
reduction's share of ``fixed`` differs. So the fit for a world size is: before any shape is measured
there, the fit over every world size's shapes; with one shape there, the other worlds' slope
(``per_pass``, ``per_sample``) with the ``fixed`` that shape gives (:func:`carry_slope`), where a fit on
that shape alone would be flat and call every larger batch free; with two or more, its own shapes'
fit, its pass's cost split between ``per_pass`` and ``per_sample`` as the other worlds split it where
its shapes all share one micro-batch (which cannot tell the two apart: on 1 rank batches 8 and 16 at
micro 8, then on 2 ranks batch 8 at micro 4, would otherwise be predicted at micro 8's cost a pass).
A job that shrinks or grows, or resumes on another world, so predicts from what it knows and corrects
itself within a few steps; the goodput schedule measures its current batch on the new world before it
decides from these predictions.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .drift import DeviceDrift, log_variance
from .step_time_fit import StepTimeFit, carry_slope, carry_split, fit_step_time, parse_step_time_curve

__all__ = ["SETTLE_STEPS", "StepTimeFit", "ThroughputModel", "fit_step_time", "parse_step_time_curve"]

_STATE_VERSION = 1
SETTLE_STEPS = 16
"""After a pause, step times are not kept until one measures no slower than its shape's median, or this
many steps have gone by (module docstring)."""
PACKED_STEPS = 32
"""Token-budget steps whose samples and passes :meth:`ThroughputModel.passes_for` reads without a packer:
the recent ones, so that a length distribution that drifts over the data is followed."""
LENGTHS_KEPT = 4096
"""Token-budget steps: the latest samples' lengths kept (in the order the steps took them), which
:meth:`ThroughputModel.passes_for` packs with a bound packer."""
PACKING_MIN = 64
"""Lengths known before :meth:`ThroughputModel.passes_for` packs them (fewer: the samples-per-pass rule)."""
PACKING_REFRESH = 512
"""The packed passes are read from the lengths up to the latest multiple of this many samples seen."""


class ThroughputModel:
    """Step times per shape ``(micro, gas, world)`` and the fit over them (module docstring).

    Feed it :meth:`observe` with a time every rank agrees on (the runtime sums the ranks' times in the
    step's collective and divides by their number); every rank then holds the same model and predicts
    the same.

    Args:
        window: step times kept per shape (their median represents it).
        skip_first: steps of a new shape not kept (one-off costs of the first).
        forget_after: a shape not run for this many steps (observations of other shapes) is forgotten
            (module docstring); None: never.
    """

    def __init__(self, window: int = 8, skip_first: int = 1, forget_after: int | None = None) -> None:
        if window < 1 or skip_first < 0:
            raise ValueError(f"window must be >= 1 and skip_first >= 0, got {window!r}, {skip_first!r}")
        if forget_after is not None and forget_after < 1:
            raise ValueError(f"forget_after must be >= 1 or None, got {forget_after!r}")
        self.window = int(window)
        self.skip_first = int(skip_first)
        self.forget_after = None if forget_after is None else int(forget_after)
        self._clock = 0  # observations so far
        self._settling = 0  # steps left after a pause whose slower times are not kept
        self.pauses = 0
        self.settled_out = 0
        """Steps observed as the first after a pause, and step times not kept for following one."""
        self._last: dict[tuple[int, int, int], int] = {}  # each shape's latest observation
        self.forgotten = 0
        """Shapes forgotten so far (``forget_after``)."""
        self._times: dict[tuple[int, int, int], deque[float]] = {}
        self._drift = DeviceDrift(self.window)  # the speed change since each kept time's run
        self._runs: dict[tuple[int, int, int], deque[int]] = {}  # each kept time's run, as _times
        self._seen: dict[tuple[int, int, int], int] = {}
        self._measuring: dict[tuple[int, int, int], deque[float]] = {}
        self._fits: dict[int, StepTimeFit | None] = {}
        self._apart: set[frozenset[tuple[int, int, int]]] = set()  # judged_apart
        self._misfit_memo: dict[int, tuple[dict[tuple[int, int], float], list[tuple[float, float]]]] = {}
        # Token-budget steps: (samples, passes per rank, ranks) of the recent ones, and the latest
        # samples' lengths with how many were ever seen (passes_for).
        self._packed: deque[tuple[int, int, int]] = deque(maxlen=PACKED_STEPS)
        self._lengths: deque[int] = deque(maxlen=LENGTHS_KEPT)
        self._lengths_seen = 0
        self._packer: Callable[[Any, int, int], int] | None = None
        self._packing_after = PACKING_MIN
        self._passes_memo: tuple[int, list[int], dict[tuple[int, int, int], float]] = (-1, [], {})

    def bind_packer(self, packer: Callable[[Any, int, int], int] | None, min_lengths: int = 0) -> None:
        """Token-budget steps: ``packer(lengths, world, budget)`` gives the passes per rank the runtime's
        packer cuts samples of ``lengths`` into (the sampler's
        :meth:`~ds_adabatch.data.tokens.TokenBudgetSampler.passes_of`); with it :meth:`passes_for`
        packs the recent lengths instead of assuming every batch packs as the recent steps did, once
        ``min_lengths`` lengths (at least :data:`PACKING_MIN`) were seen: with a ``bucket_window`` the
        order is sorted by length within each window, so the lengths of a window's first steps are its
        shortest and would rate any batch too cheap until a whole window went by."""
        self._packer = packer
        self._packing_after = max(PACKING_MIN, int(min_lengths))
        self._passes_memo = (-1, [], {})

    def observe(
        self,
        micro: int,
        gas: int,
        world: int,
        seconds: float,
        *,
        measuring: bool = False,
        samples: int | None = None,
        lengths: Iterable[int] | None = None,
        paused: bool = False,
    ) -> None:
        """One optimizer step of ``gas`` passes of ``micro`` samples on each of ``world`` ranks took
        ``seconds``; ``measuring``: it was split to measure the noise scale (kept apart, not fitted).
        ``samples``: a token-budget step's real samples (``micro`` is then its token budget), which
        :meth:`passes_for` counts whatever its time; ``lengths``: their lengths in tokens, in the
        step's order (kept for a bound packer). ``paused``: the step is the first after a pause (it and
        the slower ones that follow are not kept: the module docstring)."""
        if paused:
            self._settling, self.pauses = SETTLE_STEPS, self.pauses + 1
        if samples is not None and samples > 0 and gas >= 1 and world >= 1 and not measuring:
            self._packed.append((int(samples), int(gas), int(world)))
        if lengths is not None:
            taken = [int(n) for n in lengths]
            self._lengths.extend(taken)
            self._lengths_seen += len(taken)
        if not (math.isfinite(seconds) and seconds > 0) or micro < 1 or gas < 1 or world < 1:
            return  # a step with no time (a simulated zero, a clock that did not move) teaches nothing
        key = (int(micro), int(gas), int(world))
        self._clock += 1
        self._last[key] = self._clock
        self._forget_stale()
        if measuring:
            self._measuring.setdefault(key, deque(maxlen=self.window)).append(float(seconds))
            return
        # A token-budget step's pass count varies from step to step while its tensors change with the
        # lengths anyway: only the first steps at a budget pay one-off costs, not those of a new count.
        first = key if samples is None else (key[0], 0, key[2])
        seen = self._seen.get(first, 0)
        self._seen[first] = seen + 1
        if seen < self.skip_first:
            return
        kept = self._times.setdefault(key, deque(maxlen=self.window))
        if self._settling and kept:
            self._settling -= 1
            if seconds > statistics.median(kept):
                self.settled_out += 1
                return
            self._settling = 0  # no slower than before the pause: it is over
        kept.append(float(seconds))
        self._runs.setdefault(key, deque(maxlen=self.window)).append(self._drift.add(key, seconds))
        self._fits.clear()
        self._misfit_memo.clear()

    def _forget_stale(self) -> None:
        if self.forget_after is None:
            return
        stale = [key for key, last in self._last.items() if self._clock - last > self.forget_after]
        for key in stale:
            for table in (self._times, self._runs, self._seen, self._measuring, self._last):
                table.pop(key, None)
            self._apart = {pair for pair in self._apart if key not in pair}
        if stale:
            self.forgotten += len(stale)
            self._fits.clear()
            self._misfit_memo.clear()

    def measured(self, world: int | None = None) -> list[tuple[int, int, float, int]]:
        """``(micro, gas, median seconds, steps kept)`` per measured shape (of ``world`` if given)."""
        return [
            (m, g, self._median((m, g, w)), len(ts))
            for (m, g, w), ts in sorted(self._times.items())
            if ts and (world is None or w == world)
        ]

    def _read(self, key: tuple[int, int, int]) -> list[float]:
        """The shape's kept step times, each read at the device's speed now (:mod:`.drift`)."""
        runs = self._runs.get(key, ())
        return [t * self._drift.since(run) for t, run in zip(self._times.get(key, ()), runs)]

    def _median(self, key: tuple[int, int, int]) -> float:
        return statistics.median(self._read(key))

    def latest_world(self) -> int | None:
        """The world size of the latest step time observed; None before any."""
        return max(self._last, key=self._last.__getitem__)[2] if self._last else None

    def ratio_error(self, a: tuple[int, int], b: tuple[int, int], world: int) -> float:
        """The standard error of ``log(time of shape a / time of shape b)`` (shapes ``(micro, GAS)`` at
        ``world``) that their kept step times allow: the scatter of one step's log time pooled over both
        (:meth:`log_spread`), times ``sqrt(1/n_a + 1/n_b)``; 0 where either has no time."""
        keys = [(int(m), int(g), int(world)) for m, g in (a, b)]
        n_a, n_b = (len(self._times.get(key, ())) for key in keys)
        if not n_a or not n_b:
            return 0.0
        return math.sqrt(self.log_spread(keys) * (1.0 / n_a + 1.0 / n_b))

    def log_spread(self, keys: Iterable[tuple[int, int, int]] | None = None) -> float:
        """The variance of one step's log time about its shape's, pooled over the shapes ``keys``
        (``(micro, GAS, world)``; default: every measured one) from their kept times, read robustly: from
        the median of the differences between two log times of one shape (for normal scatter ``sigma``
        their magnitude has median ``0.6745 x sqrt(2) x sigma``), so a slow step now and then does not
        widen it; 0 with no shape of 2 or more times (no spread to read: the times are then taken as
        exact). Pairs need no centre: deviations from a shape's median would count its middle time as
        exact, and read the scatter of shapes of 3 times about half as large."""
        return log_variance(self._read(key) for key in (self._times if keys is None else keys))

    def fit(self, world: int) -> StepTimeFit | None:
        """The fit for ``world`` ranks; None before any step. Its own shapes once two are measured there;
        with one, the slope of the other world sizes' fit moved to it through that shape
        (:func:`~ds_adabatch.signals.step_time_fit.carry_slope`: a rank's passes cost the same on any
        number of ranks), and with several of one micro-batch, their fit with its pass's cost split as
        the other worlds split it (:func:`~ds_adabatch.signals.step_time_fit.carry_split`); with none,
        the fit over every world size's shapes."""
        if world not in self._fits:
            own = [key for key in self._times if key[2] == world and self._times[key]]
            others = [key for key in self._times if key[2] != world and self._times[key]]
            micros = {m for m, _, _ in own}
            theirs = self._fit_over(others) if others and len(micros) == 1 else None
            if theirs is not None and len(own) == 1:
                m, g, _ = own[0]
                fit = carry_slope(theirs, m, g, self._median(own[0]))
            else:
                fit = self._fit_over(own or others)
                if theirs is not None and fit is not None:
                    fit = carry_split(theirs, fit, micros.pop())
            self._fits[world] = fit
        return self._fits[world]

    def _fit_over(self, keys: list[tuple[int, int, int]]) -> StepTimeFit | None:
        """:func:`~ds_adabatch.signals.step_time_fit.fit_step_time` over the shapes ``keys`` (micro, GAS,
        world), the flat fit given the benefit of their scatter unless two of them clearly differ."""
        spread = self.log_spread(keys)
        if spread and self._a_clear_difference(keys, spread):
            spread = 0.0  # two shapes clearly differ in cost: no benefit of the doubt for the flat fit
        times = [(key, self._times[key]) for key in sorted(keys)]
        return fit_step_time([(key[0], key[1], self._median(key), len(ts)) for key, ts in times], spread)

    def _a_clear_difference(self, keys: list[tuple[int, int, int]], spread: float) -> bool:
        """Whether two of the shapes ``keys`` differ in median step time by more than two standard errors
        of their ratio (as a trial's verdict is read, :meth:`ratio_error`): then the measured times show a
        slope, however much they scatter, and the flat fit is not kept for the scatter's sake (on the CPU
        in turns, batch 8's times slowed after a pause, widened the scatter, and a fit kept flat against
        batch 16's clear +84% tried 32, which cost +202% a step)."""
        logs = {k: math.log(self._median(k)) for k in keys if self._times.get(k)}
        if any(pair <= logs.keys() for pair in self._apart):
            return True
        for a, b in itertools.combinations(logs, 2):
            error = math.sqrt(spread * (1.0 / len(self._times[a]) + 1.0 / len(self._times[b])))
            if abs(logs[a] - logs[b]) > 2.0 * error:
                return True
        return False

    def judged_apart(self, a: tuple[int, int], b: tuple[int, int], world: int) -> None:
        """Shapes ``a`` and ``b`` (``(micro, GAS)`` at ``world``) whose medians now differ by more than two
        standard errors of their ratio (:meth:`ratio_error`) stay told apart while both are kept: a goodput
        trial undone on that verdict is not called free again by a flat fit that more times' scatter
        would otherwise allow (2 ranks on the CPU: a trial of 16 undone at +100% a step, then a flat fit
        on the next step rated 32 at +0.0% and tried it)."""
        keys = [(int(m), int(g), int(world)) for m, g in (a, b)]
        if not all(self._times.get(key) for key in keys) or keys[0] == keys[1]:
            return
        gap = abs(math.log(self._median(keys[0]) / self._median(keys[1])))
        if gap > 2.0 * self.ratio_error(a, b, world):
            self._apart.add(frozenset(keys))
            self._fits.clear()
            self._misfit_memo.clear()

    def predict(self, micro: int, gas: float, world: int) -> float | None:
        """Predicted seconds of a step of that shape; None before any step was measured."""
        fit = self.fit(world)
        return None if fit is None else fit.predict(micro, gas)

    def rated_time(self, micro: int, gas: float, world: int) -> float | None:
        """Seconds a step of that shape is rated at: :meth:`predict`, corrected where the measured shapes
        contradict the fit. A shape measured at ``world`` whose median lies farther from the fit than
        three standard errors of the difference (the scatter of :meth:`log_spread`, at least 1%) is rated
        at its median; any other shape at the fit times the ratio median / fit of the measured shapes
        next to it in micro-batch (linear in the logarithms between two; the nearest one's beyond them;
        1 for a shape the fit matches; 1 for every shape where no two measured ones differ clearly, as
        the fit reads them). The affine form cannot follow every device: a step flat while
        the device is host-bound, then in proportion to the micro-batch once it saturates, was fitted
        at 57 ms for a measured micro 64 of 40 ms and at 131 ms for an untried 252 beside a measured 256
        of 160 ms; a goodput trial of 128 that lost to 64 was kept, and 252-255 were each tried after
        256 was undone. Only contradictions beyond the scatter correct the fit, so the benefit of the
        doubt the flat fit gets for scattered times stays (module docstring). ``gas`` may be a
        token-budget step's expected passes (not a whole number)."""
        seconds = self.predict(micro, gas, world)
        if seconds is None or not seconds > 0:
            return seconds
        own, by_micro = self._misfits(world)
        if not by_micro:  # the fit matches every measured shape
            return seconds
        if gas == int(gas) and (int(micro), int(gas)) in own:
            return seconds * math.exp(own[int(micro), int(gas)])
        x = math.log(micro)
        below = [(m, r) for m, r in by_micro if m <= x]
        above = [(m, r) for m, r in by_micro if m > x]
        if not below or not above:
            return seconds * math.exp((below or above)[-1 if below else 0][1])
        (x0, r0), (x1, r1) = below[-1], above[0]
        return seconds * math.exp(r0 + (r1 - r0) * (x - x0) / (x1 - x0))

    def _misfits(self, world: int) -> tuple[dict[tuple[int, int], float], list[tuple[float, float]]]:
        """For :meth:`rated_time`: ``log(median / fit)`` of each shape measured at ``world`` (0 where the
        fit is within the scatter of it), and their mean per micro-batch by ``log(micro)``, ascending
        (empty where all are 0). All 0 where no two of the shapes differ clearly (their scatter explains
        every difference, and the fit's flat curve has the benefit of the doubt: :meth:`_fit_over`).
        Read once per change of the kept times: a decision rates hundreds."""
        if world not in self._misfit_memo:
            keys = [key for key in self._times if key[2] == world and self._times[key]]
            fit, spread = self.fit(world), self.log_spread(keys)
            doubt = spread > 0 and not self._a_clear_difference(keys, spread)
            own: dict[tuple[int, int], float] = {}
            for m, g, median, n in self.measured(world) if fit is not None and not doubt else ():
                error = math.log(median / fit.predict(m, g)) if fit.predict(m, g) > 0 else 0.0
                own[m, g] = error if abs(error) > max(0.01, 3.0 * math.sqrt(2.0 * spread / n)) else 0.0
            by_micro: dict[int, list[float]] = {}
            for (m, _), error in own.items():
                by_micro.setdefault(m, []).append(error)
            means = [(math.log(m), statistics.fmean(es)) for m, es in sorted(by_micro.items())]
            self._misfit_memo[world] = (own, means if any(e for _, e in means) else [])
        return self._misfit_memo[world]

    def predict_measuring(self, micro: int, gas: int, world: int) -> float | None:
        """Seconds of a noise-measuring step of that shape: the median of those measured, else the
        ordinary prediction (None before any step)."""
        times = self._measuring.get((int(micro), int(gas), int(world)))
        return statistics.median(times) if times else self.predict(micro, gas, world)

    def samples_per_pass(self) -> float | None:
        """Token-budget steps: the real samples a full pass holds, over the last :data:`PACKED_STEPS`
        steps, each rank's last pass counted half full; None before any such step."""
        if not self._packed:
            return None
        return sum(n for n, _, _ in self._packed) / sum(w * (g - 0.5) for _, g, w in self._packed)

    def passes_for(self, batch: int, world: int, budget: int | None = None) -> float | None:
        """Token-budget steps: the passes per rank a step of ``batch`` samples on ``world`` ranks is
        expected to take with passes of ``budget`` tokens (module docstring; not an integer: the packing
        varies with the lengths); None before any token-budget step. With a bound packer, ``budget``
        given and enough lengths seen (:meth:`bind_packer`), the recent lengths are packed; else the
        samples-per-pass rule."""
        if self._packer is not None and budget is not None and self._lengths_seen >= self._packing_after:
            return self._packed_passes(int(batch), int(world), int(budget))
        per_pass = self.samples_per_pass()
        if per_pass is None:
            return None
        return max(1.0, batch / (world * per_pass) + 0.5)

    def _packed_passes(self, batch: int, world: int, budget: int) -> float:
        """The passes of ``batch`` packed from the recent lengths: exact (:meth:`_pack_recent`) at the
        grid of quarter octaves (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, ...) around it, linear between
        them, so that a decision rating hundreds of batches packs a few dozen."""
        if batch <= 8:
            return self._pack_recent(max(1, batch), world, budget)
        k = math.floor(4 * math.log2(batch))
        low, high = round(2 ** (k / 4)), round(2 ** ((k + 1) / 4))
        while low > batch:  # rounding can put a grid point past the batch
            k -= 1
            low, high = round(2 ** (k / 4)), low
        if low == batch or high == low:
            return self._pack_recent(batch, world, budget)
        a, b = self._pack_recent(low, world, budget), self._pack_recent(high, world, budget)
        return a + (b - a) * (batch - low) / (high - low)

    def _pack_recent(self, batch: int, world: int, budget: int) -> float:
        """The mean passes of the runs of ``batch`` consecutive lengths the kept ones hold (the data's
        order, so a sorted bucket packs as it will; the newest runs, as many as fit), or of the kept
        lengths repeated to ``batch`` where fewer are kept. The lengths read are the latest
        ``LENGTHS_KEPT - PACKING_REFRESH`` up to the latest multiple of :data:`PACKING_REFRESH` samples
        seen (all of them before the first): still kept until the next refresh, so the values are
        remembered across the steps in between and depend on the model's state alone."""
        seen = self._lengths_seen
        upto = seen if seen < PACKING_REFRESH else seen - seen % PACKING_REFRESH
        if self._passes_memo[0] != upto:
            # The lengths up to ``upto``, at most as many as stay kept until the next refresh: the same
            # list whenever in this refresh it is read (a resumed run reads what the first run did).
            kept = list(self._lengths)
            end = len(kept) - (seen - upto)
            self._passes_memo = (upto, kept[max(0, end - (LENGTHS_KEPT - PACKING_REFRESH)) : end], {})
        _, kept, memo = self._passes_memo
        key = (batch, world, budget)
        if key not in memo:
            chunks = len(kept) // batch
            if chunks == 0:
                runs = [(kept * (batch // len(kept) + 1))[:batch]]
            else:
                tail = kept[len(kept) - chunks * batch :]
                runs = [tail[i * batch : (i + 1) * batch] for i in range(chunks)]
            assert self._packer is not None
            memo[key] = max(1.0, sum(self._packer(run, world, budget) for run in runs) / len(runs))
        return memo[key]

    def largest_tried(self, world: int | None = None) -> tuple[int, int, int]:
        """The largest micro-batch, samples per rank per step (micro x GAS) and GAS measured (at
        ``world`` if given, else anywhere); (0, 0, 0) before any."""
        pts = self.measured(world) or ([] if world is None else self.measured())
        if not pts:
            return 0, 0, 0
        return (
            max(m for m, _, _, _ in pts),
            max(m * g for m, g, _, _ in pts),
            max(g for _, g, _, _ in pts),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "ThroughputModel",
            "version": _STATE_VERSION,
            "window": self.window,
            "skip_first": self.skip_first,
            "times": [[m, g, w, list(ts)] for (m, g, w), ts in sorted(self._times.items())],
            "seen": [[m, g, w, n] for (m, g, w), n in sorted(self._seen.items())],
            "measuring": [[m, g, w, list(ts)] for (m, g, w), ts in sorted(self._measuring.items())],
            "clock": self._clock,
            "last": [[m, g, w, n] for (m, g, w), n in sorted(self._last.items())],
            "forgotten": self.forgotten,
            "runs": [[m, g, w, list(rs)] for (m, g, w), rs in sorted(self._runs.items())],
            "drift": self._drift.state_dict(),
            "apart": sorted([*a, *b] for a, b in (sorted(pair) for pair in self._apart)),
            "packed": [list(p) for p in self._packed],
            "lengths": list(self._lengths),
            "lengths_seen": self._lengths_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != "ThroughputModel":
            raise ValueError("this state was not written by a ThroughputModel")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"ThroughputModel state has version {state.get('version')!r}; this ds_adabatch reads "
                f"version {_STATE_VERSION}"
            )
        self._times = {
            (int(m), int(g), int(w)): deque((float(t) for t in ts), maxlen=self.window)
            for m, g, w, ts in state["times"]
        }
        self._seen = {(int(m), int(g), int(w)): int(n) for m, g, w, n in state["seen"]}
        self._measuring = {  # absent from states written before measuring steps were kept apart
            (int(m), int(g), int(w)): deque((float(t) for t in ts), maxlen=self.window)
            for m, g, w, ts in state.get("measuring", [])
        }
        # Absent from states written before shapes could be forgotten: every shape counts as just run.
        self._clock = int(state.get("clock", 0))
        shapes = {*self._times, *self._seen, *self._measuring}
        last = {(int(m), int(g), int(w)): int(n) for m, g, w, n in state.get("last", [])}
        self._last = {key: last.get(key, self._clock) for key in shapes}
        self.forgotten = int(state.get("forgotten", 0))
        self._apart = {  # absent from states written before verdicts were kept
            frozenset({(int(p[0]), int(p[1]), int(p[2])), (int(p[3]), int(p[4]), int(p[5]))})
            for p in state.get("apart", [])
        }
        # Absent from states written before token-budget steps were modelled.
        self._packed = deque(
            ((int(n), int(g), int(w)) for n, g, w in state.get("packed", [])), maxlen=PACKED_STEPS
        )
        self._lengths = deque((int(n) for n in state.get("lengths", [])), maxlen=LENGTHS_KEPT)
        self._lengths_seen = int(state.get("lengths_seen", len(self._lengths)))
        self._passes_memo = (-1, [], {})
        # Absent from states written before speed changes were read: none known, every time of run 0.
        self._drift.load_state_dict(state.get("drift", {"serial": 0, "runs": []}))
        runs = {(int(m), int(g), int(w)): [int(r) for r in rs] for m, g, w, rs in state.get("runs", [])}
        self._runs = {  # one run per kept time, the newest last (a time of no known run: run 0)
            key: deque(([0] * len(times) + runs.get(key, []))[-len(times) :], maxlen=self.window)
            for key, times in self._times.items()
            if times
        }
        self._fits.clear()
        self._misfit_memo.clear()
        self._settling = SETTLE_STEPS  # a resumed job's first steps follow a pause

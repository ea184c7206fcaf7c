"""The ``goodput`` schedule: the global batch (and its split) that makes the most progress per second.

For every plannable global batch ``B`` (a multiple of the world size and granularity, within the
bounds) the rule takes the split the planner gives it under the current micro-batch limit, ``(micro,
GAS)``, and rates it::

    goodput(B) = B / step_time(micro, GAS, W) x ((B_noise + M0) / (B_noise + B)) ** p

samples per second times the statistical efficiency relative to ``M0`` = the schedule's ``start``
(:func:`~ds_adabatch.signals.statistical_efficiency`; ``p`` = 1, Pollux's, or 0.5 under square-root LR
scaling: the config's ``efficiency``); ``step_time`` is the fitted
:class:`~ds_adabatch.signals.ThroughputModel` the rule holds (:attr:`GoodputSchedule.throughput`, fed by
the runtime with every step's agreed time, and checkpointed with the rule). Per evaluation::

    if step < warmup:                                        the warm-up's rule (below)
    if no noise estimate, or its error is unknown or > 5:     by step cost alone, as the warm-up's
      rule (a trial's verdict, and with the default warm-up the decisions due); else hold
    if step is not a multiple of decide_every, or no step time measured:    hold
      (but a trial is judged, and after a change of world size the current batch decided on, as
       soon as 3 of its step times there are kept: held till then)
    candidates = plannable batches whose micro-batch and micro x GAS are at most
                 explore_factor x the largest measured (untried shapes are predicted, and explored
                 in bounded steps), and never a micro-batch above the limit (the planner's)
    gain(B) = goodput(B) / goodput(current) at B_noise, or, while the estimate is not yet
              confident (relative error e > max_relative_error) and B is farther from start than
              the current batch, the smaller of the gains at B_noise / exp(2e) and B_noise x exp(2e)
              where that is below 1: leaving start must lose nowhere B_noise may be and pay at the
              estimate (a nearly free larger batch never loses); a move back toward it (after an
              exploration that measured worse than its flat prediction) needs only the estimate
    best = the candidate of largest gain (the smaller batch on a tie)
    if gain(best) > 1 + hysteresis:                                          best
    else:                                                                   hold

The warm-up waits for the noise estimate, but only the decisions that need it. Whatever ``B_noise`` is,
``goodput(B) / goodput(current)`` lies between the two batches' steps/s ratio (``B_noise`` near 0: a
step's progress no longer grows with its samples) and their samples/s ratio (``B_noise`` far above both).
So with the default ``warmup_steps`` (null), from the step at which ``start`` has :data:`TRIAL_STEPS` kept
step times, each warm-up step moves to the candidate of most samples/s (if any) whose step costs at most
``hysteresis`` more than the current one's and that gives more than ``hysteresis`` more samples/s: at
no noise scale does it lose more than ``hysteresis``. Untried shapes are predicted flat, so on a
host-bound device this climbs in trials from the first steps; where the cost grows in proportion to
the batch, the one trial (2x ``start``) is measured slower and undone, and the decisions that need the
estimate come after the warm-up, with that cost known (where a step's fixed cost dominates, the batch
creeps up by steps that cost within ``hysteresis`` more). A ``warmup_steps`` given holds ``start``.

A move to a shape never measured is a trial (:data:`TRIAL_STEPS`, fewer where ``decide_every`` is
shorter): the schedule holds it until that many of its step times are kept, then (at once, not at the
next ``decide_every`` step) judges it: where going back to the batch it left gains more than the
hysteresis (as any move must; toward start at the estimate), the decision is taken from the batch it
left (usually a return to it), else from the trial's batch (on a flat cost, the next doubling at once).
A trial whose cost was measured as predicted is kept even where the estimate's interval has widened
meanwhile: what it tested was its cost. A verdict within the scatter of the step times is measured
again (:mod:`~ds_adabatch.schedules.goodput_verdict`).

With token budgets (``micro_batch_tokens``) a batch's split is not planned but packed: it is rated by
the passes per rank its packing is expected to take, at the token budget
(:mod:`~ds_adabatch.schedules.goodput_tokens`), and a trial is its batch's next steps.

Every input is global: the noise estimate is all-reduced, the step times are the ranks' mean (summed in
the step's collective), the limit is agreed; so every rank takes the same decision without a collective
of its own. Decisions come every ``decide_every`` steps (a trial's verdict, and the first decision on a
new world size, as soon as their step times are in), and a move needs a predicted gain
above the band, so the batch does not oscillate: a return to a batch it left needs the model to have
changed its mind by more than the band (a new measurement), not the jitter of one step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ..plan import PlanError, plan_batch
from ..signals.efficiency import efficiency_form, statistical_efficiency
from ..signals.throughput import ThroughputModel
from .base import ScheduleContext, check_state
from .goodput_rating import candidate_batches, cost_gains, rated, sped, step_cost, uncertainty_band
from .goodput_tokens import PackedShape, packed_shape
from .goodput_verdict import TRIAL_STEPS, trial_of_state, within_the_scatter
from .noise import auto_warmup_steps

__all__ = ["GoodputSchedule"]

_STATE_VERSION = 1


class GoodputSchedule:
    """The rule of ``GoodputScheduleConfig`` (see the module docstring).

    Args:
        config: the schedule's config.
        granularity, min_global_batch, max_global_batch, allow_uneven: the section's bounds; the
            candidates are the plannable batches within them at the context's world size; without a
            ``min_global_batch`` the smallest is ``start``.
        lr_rule: the section's ``lr_scaling.rule`` (``adascale`` as the batch rule its gain meets); with
            ``efficiency`` "auto", "sqrt" selects the square-root efficiency
            (:func:`~ds_adabatch.signals.statistical_efficiency`), anything else Pollux's.
    """

    name = "goodput"
    requires: frozenset[str] = frozenset({"noise_scale", "step_time"})

    def __init__(
        self,
        config: Any,
        *,
        granularity: int = 1,
        min_global_batch: int | None = None,
        max_global_batch: int | None = None,
        allow_uneven: bool = False,
        lr_rule: str | None = None,
        max_change_factor: float | None = None,
    ) -> None:
        self.reference_batch = int(config.start)
        self.efficiency_exponent = 0.5 if efficiency_form(config.efficiency, lr_rule) == "sqrt" else 1.0
        """The efficiency's form: 1 (Pollux's, ``efficiency`` "linear") or 0.5 (its square root, "sqrt";
        "auto" resolved from the section's ``lr_scaling.rule``)."""
        self.decide_every = int(config.decide_every)
        self.hysteresis = float(config.hysteresis)
        self.explore_factor = float(config.explore_factor)
        error = config.max_relative_error
        self.max_relative_error = None if error is None else float(error)
        self.warmup_steps = (
            int(config.warmup_steps)
            if config.warmup_steps is not None
            else auto_warmup_steps(int(config.measure_every), float(config.ema_beta))
        )
        self.by_cost_in_warmup = config.warmup_steps is None
        """The default warm-up (``warmup_steps`` null) waits for the noise estimate only where a move
        needs it: before it ends, a move that loses at most ``hysteresis`` at any noise scale is taken
        on the step times alone (:meth:`_by_cost`). A ``warmup_steps`` given holds ``start`` till then."""
        self.granularity = int(granularity)
        self.min_global_batch = self.reference_batch if min_global_batch is None else min_global_batch
        """The smallest batch considered: the section's ``min_global_batch`` where it is set, else
        ``start``. The LR was tuned at ``start`` and the efficiency is measured against it; as in Pollux,
        a batch below it is considered only where the user asks for one."""
        self.max_global_batch = max_global_batch
        self.allow_uneven = bool(allow_uneven)
        self.max_change_factor = max_change_factor
        """The section's: only batches within it of the current one are rated (and run as rated)."""
        self.last_reason = ""
        self.last_rating: dict[str, float] = {}
        """The latest decision's prediction: ``predicted_samples_per_s``, ``efficiency``,
        ``goodput`` of the batch it chose (held or moved to), for the step records."""
        self._rated_world: int | None = None  # the world size last_rating was made at
        self.rejoined: int | None = None
        """The step the world size changed at (a resume on another world, a live change) while the
        current batch's step time there is not yet measured (:meth:`_measured_anew`); else None."""
        self.moves = 0
        self.trial: tuple[int, int, int, int, int, int] | None = None
        """``(step, micro, gas, world, batch it left, batch it moved to)`` of a move to a shape not
        measured before, judged once :data:`TRIAL_STEPS` of its step times are kept; None: none open."""
        self._judging: tuple[int, int, int, int, int, int] | None = None  # the trial this step judges
        self.trial_by_cost = False
        """Whether the open trial was taken on step cost alone (:meth:`_by_cost`), and is judged so where
        the noise estimate cannot decide; a trial taken on the estimate waits for it."""
        self.throughput = ThroughputModel(forget_after=config.remeasure_after)
        """Step times by shape and their fit; the runtime feeds it (identical on every rank)."""

    def decides_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a goodput decision (the runtime resolves step times then):
        every ``decide_every`` steps, and every step from the earliest a trial can be judged (or the
        current batch is measured on a new world size)."""
        if self.rejoined is not None and step >= self.warmup_steps:
            return True
        if self.trial is not None and step >= self.trial[0] + self.throughput.skip_first + self._trial_steps:
            return True
        if step < self.warmup_steps:  # by cost alone, from the first kept step times of start
            return self.by_cost_in_warmup and step >= self.throughput.skip_first + self._trial_steps
        return step % self.decide_every == 0

    @property
    def _trial_steps(self) -> int:
        """Kept step times that judge a trial: :data:`TRIAL_STEPS`, fewer where ``decide_every`` is
        shorter (a cadence chosen to judge on fewer steps judges its trials so too)."""
        return max(1, min(TRIAL_STEPS, self.decide_every - self.throughput.skip_first))

    def _trial_judged(self, ctx: ScheduleContext) -> int | None:
        """The batch an open trial left, where this step judges it (its shape has :data:`TRIAL_STEPS`
        kept step times, or ``decide_every`` steps more have passed; the trial is then closed); None
        otherwise. A trial whose batch is split anew (the micro-batch limit lowered by an out-of-memory
        error, or grown) is judged on the split it runs, and on another world size (a resume there, a
        live change) is tried there anew; one the batch left (an override, a re-rounding) is closed."""
        self._judging = None
        if self.trial is None:
            return None
        step, micro, gas, world, left, moved = self.trial
        # Token budgets: the passes a batch takes vary with the lengths; the trial is its batch at its
        # budget, and every step of it is one of its step times (bar the first at a new budget).
        plan = None if ctx.pass_budget is not None else self._plan(ctx, int(ctx.global_batch))
        shape = (ctx.pass_budget, gas) if plan is None else _shape(plan)
        if int(ctx.global_batch) != moved or shape[0] is None:
            self.trial = None
            return None
        if ctx.world_size != world:  # its step times there are yet to come
            step, world = ctx.step, ctx.world_size
        micro, gas = shape  # judged from when it opened, however often its split changes
        self.trial = (step, micro, gas, world, left, moved)
        kept = ctx.step - step - self.throughput.skip_first if plan is None else self._kept(shape, world)
        if ctx.step <= step or (kept < self._trial_steps and not self._overdue(ctx, step)):
            return None
        self.trial, self._judging = None, self.trial
        return left

    def _measured_anew(self, ctx: ScheduleContext, current: int) -> str | bool:
        """After a change of world size, a hold (its reason) until the current batch's step time there is
        measured (:data:`TRIAL_STEPS` kept, or as long as a trial is bounded): the slope carried from the
        other world can misprice its new split, and a batch predicted too slow would never run to show
        it. Then True (decide now); False where nothing is pending."""
        if self.rejoined is None:
            return False
        plan = self._plan(ctx, current)
        if (
            plan is not None
            and self._kept_now(ctx, plan) < self._trial_steps
            and not self._overdue(ctx, self.rejoined)
        ):
            return (
                f"measuring batch {current}'s step time on {ctx.world_size} rank(s) after a change of world "
                f"size (decided after {self._trial_steps} step times)"
            )
        self.rejoined = None
        return True

    def _overdue(self, ctx: ScheduleContext, step: int) -> bool:
        """Whether a trial opened at ``step`` is judged now however few of its step times are kept:
        steps with no time (re-run after an out-of-memory error) judge it at the cadence."""
        return ctx.step >= step + self.throughput.skip_first + self._trial_steps + self.decide_every

    def _measure_again(self, ctx: ScheduleContext, gain: float, threshold: float) -> str | None:
        """Where the trial just judged would be undone (going back gains ``gain`` > ``threshold``) on
        step times whose scatter does not tell that gain from ``threshold``
        (:mod:`~ds_adabatch.schedules.goodput_verdict`): reopen it for more of them and say why. None: undo
        it now (a clear verdict, a full window of its step times, ``decide_every`` steps past its
        judgement, or token budgets, whose steps vary in passes)."""
        trial, self._judging = self._judging, None
        plan = None if trial is None or ctx.pass_budget is not None else self._plan(ctx, trial[4])
        if trial is None or plan is None:
            return None
        step, micro, gas, world, left, _ = trial
        said = None
        if self._kept((micro, gas), world) < self.throughput.window and not self._overdue(ctx, step):
            said = within_the_scatter(self.throughput, (micro, gas), _shape(plan), world, gain, threshold)
        if said is None:  # undone: where its cost is clearly not the left batch's, the fit keeps it so
            self.throughput.judged_apart((micro, gas), _shape(plan), world)
            return None
        self.trial = trial
        return f"{said} and batch {left}'s: measured again"

    def _kept(self, shape: tuple[int, int], world: int) -> int:
        """Step times kept of ``shape`` (micro, GAS) at ``world`` ranks."""
        return next((n for m, g, _, n in self.throughput.measured(world) if (m, g) == shape), 0)

    def _kept_now(self, ctx: ScheduleContext, plan: Any) -> int:
        """Step times kept of the shape ``plan`` runs; with token budgets, of every pass count at its
        budget (the passes a batch takes vary from step to step)."""
        if not isinstance(plan, PackedShape):
            return self._kept(_shape(plan), ctx.world_size)
        measured = self.throughput.measured(ctx.world_size)
        return sum(n for m, _, _, n in measured if m == plan.micro_batch_per_gpu)

    def _plan(self, ctx: ScheduleContext, batch: int) -> Any:
        if ctx.pass_budget is not None:  # token budgets: the passes the packing is expected to take
            return packed_shape(self.throughput, batch, ctx.world_size, ctx.pass_budget)
        try:
            return plan_batch(batch, ctx.world_size, ctx.micro_batch_limit, allow_uneven=self.allow_uneven)
        except PlanError:
            return None

    def speed(self, ctx: ScheduleContext, batch: int) -> tuple[float, Any] | None:
        """``(predicted samples/s, plan)`` of ``batch``; None if it cannot be planned or predicted."""
        plan = self._plan(ctx, batch)
        if plan is None:
            return None
        passes = plan.passes if isinstance(plan, PackedShape) else plan.gradient_accumulation_steps
        seconds = self.throughput.rated_time(plan.micro_batch_per_gpu, passes, ctx.world_size)
        if seconds is None or not seconds > 0:
            return None
        return batch / seconds, plan

    def rate(self, ctx: ScheduleContext, batch: int, noise: float) -> tuple[float, float, Any] | None:
        """``(predicted samples/s, efficiency, plan)`` of ``batch``; None if it cannot be planned or
        predicted."""
        speed = self.speed(ctx, batch)
        if speed is None:
            return None
        return speed[0], self._efficiency(batch, noise), speed[1]

    def _efficiency(self, batch: float, noise: float) -> float:
        return statistical_efficiency(batch, noise, self.reference_batch, self.efficiency_exponent)

    def _hold(self, current: float, why: str) -> float:
        self.last_reason = f"{why}: hold"
        return current

    def __call__(self, ctx: ScheduleContext) -> float:
        current = int(ctx.global_batch)
        if ctx.world_size != self._rated_world:  # another world's rating says nothing of this one's
            if self._rated_world is not None:
                self.rejoined = ctx.step
            self.last_rating, self._rated_world = {}, ctx.world_size
        ready = self._ready(ctx, current)
        if not isinstance(ready, tuple):  # held: the current batch
            return ready
        noise, band, unsure, judged, tried = ready
        now = self.rate(ctx, current, noise)
        if now is None:
            return self._hold(current, f"the current batch {current} cannot be rated")
        reference, said = current, ""
        if judged is not None and judged != current:
            # A trial is judged now that its shape's cost is measured: it is undone where the batch it
            # left rates higher (toward start at the estimate), and the decision is then taken from that
            # batch. Not by the hysteresis: the move was taken on a prediction, and a trial must beat
            # what it left once measured, else a shape predicted from too few others (one forgotten,
            # remeasure_after) could move the batch to one rated up to the hysteresis below it. Going
            # there again needs a gain above the hysteresis by the same fit, so the two cannot alternate.
            # A cost measured as predicted keeps it, however the noise estimate's interval moved meanwhile.
            before = self.rate(ctx, judged, noise)
            back = None if before is None else self._gain(judged, before, current, now, noise, band)
            if back is not None and back > 1.0:
                again = self._measure_again(ctx, back, 1.0)
                if again is not None:
                    why = f"going back to batch {judged} gains {back - 1:+.1%}, {again}"
                    return self._hold(current, f"goodput trial of batch {current}: {why}")
                reference, now = judged, before
                said = f"trial of batch {current} gains {1 / back - 1:+.1%} over batch {judged}, not kept; "
        best, best_rating, best_gain = self._best(ctx, current, reference, now, noise, band, tried)
        if band:
            said += f"{unsure}; within {band[0]:.4g}-{band[1]:.4g}, batch {reference}: {rated(now)}"
        else:
            said += f"B_noise {noise:.4g}; batch {reference}: {rated(now)}"
        if best == reference or best_gain <= 1.0 + self.hysteresis:
            return self._stay(current, reference, now, best, best_rating, best_gain, band, said)
        return self._move(ctx, reference, best, best_rating, best_gain, band, said)

    def _ready(
        self, ctx: ScheduleContext, current: int
    ) -> float | tuple[float, tuple[float, ...] | None, str, int | None, tuple[int, int, int]]:
        """The hold this step ends in (the current batch), or what a decision needs: ``(noise, band, the
        not-yet-confident sentence, the batch a judged trial left, the largest micro-batch, samples per
        rank and GAS tried)``. Judging a trial closes it."""
        warm = (
            f"goodput warm-up (step {ctx.step} < {self.warmup_steps})" if ctx.step < self.warmup_steps else ""
        )
        if warm and not self.by_cost_in_warmup:
            return self._hold(current, warm)
        judged = self._trial_judged(ctx)
        if warm:
            return self._by_cost(ctx, current, judged, warm)
        if self.trial is not None:  # still open: judged on its own step times, not before
            return self._hold(
                current, f"goodput trial of batch {current} (judged after {self._trial_steps} step times)"
            )
        measured = self._measured_anew(ctx, current)
        if isinstance(measured, str):
            return self._hold(current, measured)
        noise, error = ctx.noise_scale, ctx.noise_scale_error
        if noise is None or not math.isfinite(noise) or noise <= 0:
            return self._without_estimate(
                ctx, current, judged, measured, f"no usable noise-scale estimate ({noise!r})"
            )
        band = uncertainty_band(noise, error, self.max_relative_error)
        unsure = (
            ""
            if band is None
            # said only while the estimate is not yet confident
            else (
                f"B_noise {noise:.6g} not yet confident (relative error "
                f"{error if error is None else f'{error:.3g}'} > {self.max_relative_error})"
            )
        )
        if band == ():
            return self._without_estimate(ctx, current, judged, measured, unsure)
        if ctx.step % self.decide_every and judged is None and not measured:
            nxt = (ctx.step // self.decide_every + 1) * self.decide_every
            return self._hold(current, f"goodput decides every {self.decide_every} steps (next at {nxt})")
        tried = self.throughput.largest_tried(ctx.world_size)
        if tried[0] == 0:
            return self._hold(current, "no step time measured yet")
        return noise, band, unsure, judged, tried

    def _gain(
        self,
        batch: int,
        rating: tuple[float, float, Any],
        ref: int,
        ref_rating: tuple[float, float, Any],
        noise: float,
        band: tuple[float, ...] | None,
    ) -> float:
        """The goodput of ``batch`` over ``ref``'s at the estimate; while it is not yet confident and
        ``batch`` lies farther from ``start`` than ``ref``, the least across the estimate's interval
        where that is below 1 (leaving the configured start needs a move that loses nowhere B_noise may
        be, and pays at the estimate; coming back toward it, after an exploration measured worse than
        predicted, needs only the estimate)."""
        start = self.reference_batch
        speedup = rating[0] / ref_rating[0]
        at_estimate = speedup * rating[1] / ref_rating[1]  # both rated at the estimate
        if not (band and abs(math.log(batch / start)) > abs(math.log(ref / start))):
            return at_estimate
        worst = min(speedup * self._efficiency(batch, e) / self._efficiency(ref, e) for e in band)
        return at_estimate if worst >= 1.0 else worst

    def _best(
        self,
        ctx: ScheduleContext,
        current: int,
        reference: int,
        now: tuple[float, float, Any],
        noise: float,
        band: tuple[float, ...] | None,
        tried: tuple[int, int, int],
    ) -> tuple[int, tuple[float, float, Any], float]:
        """The candidate of largest gain over ``reference`` (itself, gain 1, where none beats it); shapes
        beyond ``explore_factor`` times the largest tried are left for later."""
        best, best_rating, best_gain = reference, now, 1.0
        for batch, (samples_per_s, plan) in self._reachable(ctx, current, reference, tried):
            rating = (samples_per_s, self._efficiency(batch, noise), plan)
            g = self._gain(batch, rating, reference, now, noise, band)
            if g > best_gain * (1 + 1e-12):
                best, best_rating, best_gain = batch, rating, g
        return best, best_rating, best_gain

    def _reachable(
        self, ctx: ScheduleContext, current: int, reference: int, tried: tuple[int, int, int]
    ) -> Iterator[tuple[int, tuple[float, Any]]]:
        """``(batch, speed)`` of every candidate a decision from ``reference`` may move to: predicted,
        not ``reference`` (nor ``current`` where a judged trial is undone), and no shape beyond
        ``explore_factor`` times the largest tried (``tried``: its micro-batch, samples per rank and
        GAS: micro 1 x GAS 19 is not predicted from one-pass steps), which is left for later."""
        f = self.explore_factor  # GAS: at least one more than measured (for a factor below 2)
        bounds = (self.min_global_batch, self.max_global_batch, self.max_change_factor)
        for batch in candidate_batches(
            ctx.world_size, reference, current, bounds, self.granularity, self.allow_uneven
        ):
            if batch == reference or (batch == current and reference != current):
                continue
            speed = self.speed(ctx, batch)
            if speed is None:
                continue
            micro, gas = _shape(speed[1])
            bounds = (f * tried[0], f * tried[1], max(f * tried[2], tried[2] + 1))
            if any(v > bound for v, bound in zip((micro, micro * gas, gas), bounds)):
                continue  # beyond what the measured shapes can predict: explored in bounded steps
            yield batch, speed

    def _stay(
        self,
        current: int,
        reference: int,
        now: tuple[float, float, Any],
        best: int,
        best_rating: tuple[float, float, Any],
        best_gain: float,
        band: tuple[float, ...] | None,
        said: str,
    ) -> float:
        """No candidate pays: hold ``current``, or return to the batch a judged trial left."""
        self._keep_rating(now)
        if best != reference:
            # A best other than the reference gains more than 1: it was rated at the estimate (_gain).
            said += f"; best {best}: {rated(best_rating)}, gain {best_gain - 1:+.1%}"
            said += f"{' at the estimate' if band else ''}, within {self.hysteresis:g}"
        if reference == current:
            return self._hold(current, f"goodput {said}")
        self.moves += 1  # a trial undone: back to the batch it left
        self.last_reason = f"goodput {said} -> back to batch {reference}"
        return float(reference)

    def _move(
        self,
        ctx: ScheduleContext,
        reference: int,
        best: int,
        best_rating: tuple[float, float, Any],
        best_gain: float,
        band: tuple[float, ...] | None,
        said: str,
    ) -> float:
        """Move to ``best``; a shape never measured is a trial, judged again on its own step times."""
        start = self.reference_batch
        if band:
            back = abs(math.log(best / start)) <= abs(math.log(reference / start))
            said += f"; batch {best} gains {best_gain - 1:+.1%} " + (
                "at the estimate (back toward start)"
                if back
                else "at the estimate, losing nowhere across that interval"
            )
        self._keep_rating(best_rating)
        trial = self._moved(ctx, best_rating[2], reference)
        self.last_reason = f"goodput {said} -> batch {best}: {rated(best_rating)}{trial}"
        return float(best)

    def _moved(self, ctx: ScheduleContext, plan: Any, reference: int, *, by_cost: bool = False) -> str:
        """Count a move from ``reference`` to ``plan``; a shape never measured opens a trial (what the
        reason then adds), ``by_cost``: on step cost alone."""
        self.moves += 1
        self.trial_by_cost = by_cost
        shape = (plan.micro_batch_per_gpu, plan.gradient_accumulation_steps)
        if shape in {(m, g) for m, g, _, _ in self.throughput.measured(ctx.world_size)}:
            return ""
        self.trial = (ctx.step, *shape, ctx.world_size, reference, int(plan.global_batch_size))
        return f" (a trial: judged again after {self._trial_steps} step times of it)"

    def _without_estimate(
        self, ctx: ScheduleContext, current: int, judged: int | None, measured: bool, why: str
    ) -> float:
        """No noise estimate to decide on (none yet, or too uncertain to bound) after the warm-up. A trial
        due now that was taken on step cost is judged so (:meth:`_by_cost`); one taken on the estimate
        (expected to cost more a step) waits for it, within a trial's bound, then stays as measured.
        With the default warm-up every decision due is by step cost, as in the warm-up; else hold."""
        if judged is not None and self._judging is not None and not self.trial_by_cost:
            trial, self._judging = self._judging, None
            keep = self._overdue(ctx, trial[0])
            self.trial = None if keep else trial
            said = f" kept: {why} to judge it" if keep else f": judged once the estimate can ({why})"
            return self._hold(current, f"goodput trial of batch {current}{said}")
        due = self.by_cost_in_warmup and (measured or ctx.step % self.decide_every == 0)
        if judged is None and not due:
            return self._hold(current, why)
        return self._by_cost(ctx, current, judged, why, moves=self.by_cost_in_warmup)

    def _by_cost(
        self, ctx: ScheduleContext, current: int, judged: int | None, why: str, *, moves: bool = True
    ) -> float:
        """A decision on the step times alone (``why``: the warm-up, or an estimate that cannot decide).
        Whatever B_noise is, a batch's goodput over another's lies between their steps/s ratio (B_noise
        near 0) and their samples/s ratio (B_noise far above both). A move must lose at most
        ``hysteresis`` at the first (its step costs at most that much more) and gain more than it at the
        second; a trial (the batch ``judged`` left, where one is judged) is undone where its step, once
        measured, costs more than that. ``moves`` False: only a trial's verdict."""
        if self.trial is not None:
            trial = f"trial of batch {current} (judged after {self._trial_steps} step times)"
            return self._hold(current, f"{why}: {trial}")
        now = self.speed(ctx, current)
        if now is None or (judged is None and self._kept_now(ctx, now[1]) < self._trial_steps):
            return self._hold(current, f"{why}: measuring batch {current}'s step time")
        reference, said, limit = current, f"{why}, by step cost alone: ", 1.0 + self.hysteresis
        before = self.speed(ctx, judged) if judged is not None and judged != current else None
        back = 0.0 if before is None else max(cost_gains(judged, before, current, now))
        if before is not None and back > limit:
            cost = f"trial of batch {current} costs {step_cost(current, now, judged, before)} a step"
            again = self._measure_again(ctx, back, limit)
            if again is not None:
                return self._hold(current, f"{why}: {cost}, over {self.hysteresis:g} more by {again}")
            said += f"{cost}, not kept; "
            reference, now = judged, before
        best, best_speed, best_gain = reference, now, 1.0
        tried = self.throughput.largest_tried(ctx.world_size)
        for batch, speed in self._reachable(ctx, current, reference, tried) if moves else ():
            steps_gain, samples_gain = cost_gains(batch, speed, reference, now)
            if steps_gain * limit >= 1.0 and samples_gain > max(limit, best_gain * (1 + 1e-12)):
                best, best_speed, best_gain = batch, speed, samples_gain
        said += f"batch {reference}: {sped(now)}"
        self.last_rating = {"predicted_samples_per_s": best_speed[0]}
        if best != reference:
            said += (
                f"; batch {best} costs {step_cost(best, best_speed, reference, now)} a step (at most "
                f"{self.hysteresis:g} more: at no noise scale does it lose more) for {best_gain - 1:+.1%} "
                "samples/s"
            )
            trial = self._moved(ctx, best_speed[1], reference, by_cost=True)
            self.last_reason = f"{said} -> batch {best}: {sped(best_speed)}{trial}"
            return float(best)
        if reference == current:
            return self._hold(current, said)
        self.moves += 1  # a trial undone: back to the batch it left
        self.last_reason = f"{said} -> back to batch {reference}"
        return float(reference)

    def _keep_rating(self, rating: tuple[float, float, Any]) -> None:
        speed, eff = rating[0], rating[1]
        self.last_rating = {"predicted_samples_per_s": speed, "efficiency": eff, "goodput": speed * eff}

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "GoodputSchedule",
            "version": _STATE_VERSION,
            "moves": self.moves,
            "trial": None if self.trial is None else list(self.trial),
            "trial_by_cost": self.trial_by_cost,
            "rating": self.last_rating,  # the step records carry it until the next decision
            "rating_world": self._rated_world,
            "rejoined": self.rejoined,
            "throughput": self.throughput.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, kind="GoodputSchedule", version=_STATE_VERSION)
        self.moves = int(state["moves"])
        self.trial, self.trial_by_cost = trial_of_state(state, self.warmup_steps)
        self.last_rating = dict(state.get("rating") or {})
        self.rejoined = state.get("rejoined")
        self.throughput.load_state_dict(state["throughput"])
        # Written before ratings kept their world: the world of the latest step time.
        self._rated_world = state.get("rating_world", self.throughput.latest_world())


def _shape(plan: Any) -> tuple[int, int]:
    return plan.micro_batch_per_gpu, plan.gradient_accumulation_steps

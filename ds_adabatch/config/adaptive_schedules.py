"""Config models of the adaptive schedules: ``loss_plateau``, ``gradient_noise``, ``seesaw``, ``goodput``.

They decide from what the run measures (the loss, the gradient-noise scale, the step time) rather than
from the samples seen alone; ``ds_adabatch.config.schedules`` registers them in the ``ScheduleConfig``
union with the ramps. Batch sizes are in samples per optimizer step over all data-parallel ranks unless
a field says otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .schedule_base import ScheduleConfigBase

__all__ = [
    "DEFAULT_NOISE_SCALES",
    "GoodputScheduleConfig",
    "GradientNoiseScheduleConfig",
    "LossPlateauScheduleConfig",
    "SeesawScheduleConfig",
    "measures_noise",
]


class LossPlateauScheduleConfig(ScheduleConfigBase):
    """Change the batch by ``factor`` when the smoothed training loss stops moving.

    At each evaluation the rule smooths the global-mean loss with a bias-corrected EMA (``ema_beta``),
    keeps the last ``window`` smoothed values, and measures their change: ``"net"`` =
    ``|newest - oldest|``, ``"mean_abs_step"`` = mean of ``|v[i] - v[i-1]|`` over the window; with
    ``relative`` it is divided by ``|oldest|``. A measure below ``threshold`` is a plateau evaluation.
    After ``patience`` consecutive plateau evaluations the batch is multiplied (``direction: "grow"``)
    or divided (``"shrink"``) by ``factor``, then ``cooldown`` evaluations pass without any change.
    Every other evaluation (including those before the window is full) multiplies the batch by
    ``otherwise_factor`` if it is set, and holds it if not. With ``hold_while_lr_rises``, evaluations
    whose learning rate rose since the previous one at the same batch (an LR warmup) hold the batch
    and count neither as plateau nor as progress. The rule keeps its own unrounded batch, clamped to
    ``min_global_batch`` / ``max_global_batch``, so small factors add up across the controller's
    rounding.

    "grow" is the "increase the batch instead of decaying the learning rate" rule: a plateau at the
    current batch means gradient noise dominates, and a larger batch reduces it.

    The defaults are meant for one evaluation per optimizer step (``update_interval`` 1). They compare
    losses ``window`` = 50 steps apart, smoothed over about 50 steps, so the window grows with the
    batch in samples: at batch B it spans 50 B samples. While a loss falls like samples^(-alpha), its
    relative drop over a window of W samples after t samples is about alpha W / t, so a fixed relative
    threshold fires once t reaches about alpha W / threshold: each doubling of the batch
    doubles W and with it the number of samples until the next plateau. The batch therefore grows
    roughly in proportion to the samples seen, at a pace the loss curve sets, not a clock.

    The seed rule (``AdaptiveBatchSize``: window of 5 raw losses, mean absolute change < 0.01 -> halve,
    otherwise x1.1, inside [8, 1024], called once per epoch) is, with ``min_global_batch: 8``,
    ``max_global_batch: 1024`` and ``update_interval`` = optimizer steps per epoch::

        {"type": "loss_plateau", "start": 32, "direction": "shrink", "factor": 2.0,
         "floor_on_shrink": true, "ema_beta": 0.0, "window": 5, "change": "mean_abs_step",
         "relative": false, "threshold": 0.01, "patience": 1, "cooldown": 0,
         "otherwise_factor": 1.1, "hold_while_lr_rises": false}
    """

    type: Literal["loss_plateau"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at step 0, in samples per optimizer step.")
    direction: Literal["grow", "shrink"] = Field(
        default="grow",
        description="On a plateau, 'grow' multiplies the batch by `factor`, 'shrink' divides it.",
    )
    factor: float = Field(
        default=2.0, gt=1.0, description="Multiplicative change on a plateau (unitless, > 1)."
    )
    ema_beta: float = Field(
        default=0.98,
        ge=0.0,
        lt=1.0,
        description="Smoothing of the loss per evaluation (unitless, 0 = raw loss; bias-corrected). "
        "0.98 averages about 50 evaluations: one step's loss at a small batch varies by several "
        "percent, far more than the 1% change the threshold looks for, so it must be averaged over "
        "about as many steps as the window spans.",
    )
    window: int = Field(
        default=50,
        ge=2,
        description="Number of latest smoothed losses compared, in evaluations. 50: the change is "
        "measured over 50 steps, i.e. 50 x batch samples, a span that doubles with each doubling of "
        "the batch (see the model's description); 10 steps of a small batch were so short that a "
        "falling loss looked flat between its drops.",
    )
    change: Literal["net", "mean_abs_step"] = Field(
        default="net",
        description="'net': |newest - oldest| over the window; 'mean_abs_step': mean absolute "
        "change between consecutive evaluations in the window.",
    )
    relative: bool = Field(
        default=True,
        description="Divide the change by |oldest loss in the window| (unitless); false: loss units.",
    )
    threshold: float = Field(
        default=0.01,
        gt=0.0,
        description="A change below this is a plateau (unit: see `relative`). 0.01: less than 1% "
        "relative improvement over the window.",
    )
    patience: int = Field(
        default=3,
        ge=1,
        description="Consecutive plateau evaluations before acting, in evaluations. A few, so a "
        "single evaluation that looks flat by chance does not act.",
    )
    cooldown: int = Field(
        default=50,
        ge=0,
        description="Evaluations after a plateau change during which nothing changes. 50 = the default "
        "window: the next decision compares only losses measured at the new batch, never the drop "
        "that the change itself causes against losses from before it.",
    )
    otherwise_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="Multiply the batch by this at every evaluation that is not a plateau (unitless); "
        "null: hold.",
    )
    floor_on_shrink: bool = Field(
        default=False,
        description="Round the batch down to a whole number after dividing it (the seed's `bs // 2`).",
    )
    hold_while_lr_rises: bool = Field(
        default=True,
        description="Hold the batch at evaluations whose learning rate is higher than at the previous "
        "evaluation with the same batch (an LR warmup). While the LR still rises the loss is not on a "
        "plateau of the current setting, and a batch grown then would be the warmup's doing. Needs the "
        "learning rate in the context (the runtime passes it); without it the option does nothing.",
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start)]


DEFAULT_NOISE_SCALES = {"sgd": 0.5, "adam": 0.2}
"""``gradient_noise.scale``'s default per measured geometry (see the field's description)."""


class _NoiseMeasuringConfig(ScheduleConfigBase):
    """What the schedules that measure the gradient-noise scale share: they start at ``start`` and feed
    ``ds_adabatch.signals.GradientNoiseEstimator`` (the subclasses declare ``start``, ``ema_beta`` and
    ``ema_reference_batch``)."""

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start  # type: ignore[attr-defined]

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start)]  # type: ignore[attr-defined]

    def estimator_settings(self) -> dict[str, float | bool]:
        """Keyword arguments of ``ds_adabatch.signals.GradientNoiseEstimator`` for this schedule."""
        reference = self.ema_reference_batch  # type: ignore[attr-defined]
        if reference is None:
            reference = max(self.start, 8)  # type: ignore[attr-defined]
        return {"ema_beta": self.ema_beta, "reference_batch": float(reference), "trend": False}  # type: ignore[attr-defined]


class GradientNoiseScheduleConfig(_NoiseMeasuringConfig):
    """Follow the gradient-noise scale: target global batch = ``scale`` x B_simple.

    B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of Large-Batch
    Training") is the batch at which the gradient's noise equals its signal. The runtime estimates it
    every ``measure_every`` optimizer steps from the squared gradient norms at two batch sizes, smoothing
    numerator and denominator with separate EMAs (``ema_beta``). The batch stays at ``start`` for the
    first ``warmup_steps`` steps and until an estimate exists, and changes only when the target leaves
    ``[current / (1 + hysteresis), current * (1 + hysteresis)]``; bounds, granularity and
    ``max_change_factor`` then apply as for every schedule.

    Safety against a runaway estimate (all on by default): the averages remember a fixed number of
    *samples* (``ema_reference_batch``), not of steps; the batch moves only while the estimate's
    relative standard error is at most ``max_relative_error``; and one update changes the batch by at
    most ``max_change_factor`` (this schedule's own, on top of the section's). With micro-batches far
    below B_noise single estimates scatter over orders of magnitude; without these a 20-measurement
    average at a start batch of 2 sent 51 of 200 closed-loop runs to more than 4x the right batch (up
    to 1,936 for a target of 8.5); with them no run from 2 exceeds 16 (tests/test_noise_closed_loop.py).
    The price is patience at tiny batches: the batch holds at ``start`` until enough samples have been
    measured to know where to go.

    Choosing ``scale``: in the same model, training at batch B costs about ``S_min (1 + B_simple / B)``
    optimizer steps and ``E_min (1 + B / B_simple)`` samples, so ``scale`` = k buys ``(1 + 1/k) S_min``
    steps for ``(1 + k) E_min`` samples. k = 1 is the knee (twice the minimum of both); a smaller k
    spends fewer samples and more steps. The default is set for "fewer steps without spending more
    samples than a small fixed batch" (see the field's description).

    Where that model is off: B_simple is the noise scale of plain SGD. Under Adam the step actually taken
    weighs each coordinate by Adam's preconditioner, and the noise scale of that step (``geometry``
    "adam", the default for Adam-type optimizers) is larger and grows faster: 2-6x B_simple over the
    convergence benchmark's run. With a constant learning rate, a larger batch late in training also
    lowers the step noise, like an LR decay, which the model does not count: on that benchmark a batch of
    64 late in the run cost 1.04-1.09x the samples of batch 8, where the model predicts 2x. The adam
    geometry follows that late growth better (fewer steps for the same samples); raise ``scale`` where
    optimizer steps cost more than samples, or use ``loss_plateau``, which grows on the plateau itself
    (BENCHMARKS.md).
    """

    type: Literal["gradient_noise"] = Field(description="Schedule type.")
    start: int = Field(
        ge=1, description="Global batch until the estimate is trusted, in samples per optimizer step."
    )
    scale: float | None = Field(
        default=None,
        gt=0.0,
        description="Target batch = scale x the measured noise scale (unitless multiplier). It is the "
        "sample overhead the schedule accepts over the minimum: at batch k x B_noise a run needs about "
        "(1 + k) times the fewest samples that reach its loss and (1 + 1/k) times the fewest optimizer "
        "steps. null: 0.5 when the noise scale is measured in the sgd geometry, 0.2 in the adam "
        "geometry (see geometry). 0.5 of B_simple leans to samples: it halves the sample overhead of "
        "the knee k = 1 (1.5x instead of 2x the minimum), because samples cost compute on any cluster "
        "while saved steps pay off only where data parallelism can absorb the larger batch. The adam "
        "geometry's noise scale reads 2-6x B_simple on the convergence benchmark (more the further "
        "training goes), so the same intent needs a smaller multiplier: 0.2 is the largest that kept "
        "that benchmark's samples at the sgd default's level (BENCHMARKS.md). With grow_only the batch "
        "follows the running maximum of a noisy estimate, so the batch actually trained with sits "
        "somewhat above scale x the mean estimate; that too argues against larger defaults.",
    )
    ema_beta: float = Field(
        default=0.95,
        ge=0.0,
        lt=1.0,
        description="EMA factor of the |G|^2 and tr(Sigma) estimates, per measurement of "
        "ema_reference_batch samples (unitless; a measurement of B samples decays by "
        "ema_beta^(B / ema_reference_batch)). 0.95 averages about 1 / (1 - 0.95) = 20 such "
        "measurements (about 39 effectively independent ones): enough to tame single estimates whose "
        "|G|^2 can even come out negative, short enough to follow a noise scale that grows several-fold "
        "early in training.",
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        description="Optimizer steps before the first change, in optimizer steps. null: one EMA time "
        "constant of measurements, ceil(measure_every / (1 - ema_beta)) steps (20 at the defaults), "
        "i.e. until the smoothed estimate rests on a full window of measurements rather than on its "
        "first few. A fixed step count would mean a different amount of evidence for every cadence.",
    )
    hysteresis: float = Field(
        default=0.2,
        ge=0.0,
        description="No change while target/current lies in [1/(1+h), 1+h] (unitless), nor a move that "
        "reverses the previous one while target/previous_target lies in that band. 0.2 ignores the "
        "estimate's step-to-step jitter (a 20-measurement EMA still moves by tens of percent) so the "
        "plan is not rebuilt on noise. The second test is measured against the target rather than the "
        "rounded batch because one rounding step can be wider than the band (granularity 8 at 16 -> 24 "
        "is +50%): a target hovering at a rounding midpoint would otherwise flip between the two "
        "neighbours on every jitter.",
    )
    grow_only: bool = Field(
        default=True,
        description="Never shrink the batch: only a target above current x (1 + hysteresis) moves it. "
        "The critical batch grows as the loss falls (a smaller gradient signal against a noise that "
        "falls more slowly), so during training a falling estimate is far more often noise in the "
        "estimate (a ratio of two noisy EMAs) than a real fall of the critical batch; shrinking on it "
        "buys back few samples and spends steps, and a later rise has to undo it. Set false to follow "
        "the estimate both ways, e.g. after a learning-rate drop or a change of data mixture, where the "
        "noise scale can legitimately fall.",
    )
    ema_reference_batch: int | None = Field(
        default=None,
        ge=1,
        description="Global batch (samples) whose measurement decays the EMAs by exactly ema_beta; a "
        "measurement of B samples decays them by ema_beta^(B / ema_reference_batch) and weighs "
        "accordingly more, so the averages remember about ema_reference_batch / (1 - ema_beta) samples "
        "whatever the batch (AdaptDL's smoothing). A measurement's information grows with the "
        "micro-batches it compares, so this keeps the average equally precise at every batch instead of "
        "trusting 20 steps of 2 samples as much as 20 steps of 64. null: the larger of start and 8: "
        "about 20 measurements at the start batch, as AdaptDL anchors its memory at the initial batch, "
        "and at least 8 / (1 - ema_beta) = 160 samples (at ema_beta 0.95) for a tiny start, whose "
        "single estimates are the noisiest. (16 held the convergence benchmark's first increase back "
        "by 30-200 steps; 8 leaves closed-loop runs from a start of 2 below 2x the target.)",
    )
    max_relative_error: float | None = Field(
        default=0.35,
        gt=0.0,
        description="The batch changes only while the smoothed B_simple's relative standard error "
        "(unitless, from the spread of the single estimates and the number the averages hold) is at "
        "most this; until then it holds. 0.35 puts the estimate within 2x of its mean with about 95% "
        "confidence (two standard errors on a log scale, exp(2 x 0.35) = 2.0), the precision a batch "
        "change needs to be worth its cost; smaller values wait longer. It replaces a fixed count of "
        "warm-up measurements by the count the noise level actually needs: at micro-batches near "
        "B_noise it is met after about as many steps as warmup_steps, at micro-batches far below it "
        "many more. null: no test.",
    )
    max_change_factor: float | None = Field(
        default=2.0,
        gt=1.0,
        description="One update moves the batch by at most this factor (unitless; 2.0: at most double "
        "or halve), on top of the section's own max_change_factor (the tighter applies). The estimate "
        "at the new batch is measured with more micro-batches and corrects an error before the next "
        "move, so one bad estimate costs at most one doubling; real noise scales grow over many "
        "steps, so following them in doublings costs little. null: no limit.",
    )
    measure_every: int = Field(
        default=1,
        ge=1,
        description="Measure the gradient-noise scale every this many optimizer steps. A measurement "
        "costs no extra forward or backward pass, only a squared norm per parameter and micro-batch, "
        "so the default measures every step: the EMA's memory is then 20 steps, not 200, and the "
        "estimate is usable within the first few hundred steps, when the noise scale changes fastest.",
    )
    geometry: Literal["auto", "sgd", "adam"] = Field(
        default="auto",
        description='The geometry the noise scale is measured in. "sgd": plain gradients, B_simple of '
        'McCandlish et al. "adam": every gradient coordinate divided by the denominator of the Adam '
        "step just taken, sqrt(v_hat) + eps (v_hat: the optimizer's bias-corrected exp_avg_sq after the "
        "measured step's update): the noise scale of the step an Adam-type optimizer actually takes, "
        "which grows faster during training than B_simple. It needs an optimizer that keeps exp_avg_sq "
        '(Adam, AdamW, DeepSpeed\'s FusedAdam and CPUAdam); any other is a config error. "auto": adam '
        "for such an optimizer, sgd for any other (SGD, Adagrad, Lion, ...). With adam a measured step "
        "holds one fp32 value per coordinate of the rank's share (its partition under ZeRO 1-3, "
        "1/world of the parameters under ZeRO 0) until its optimizer step and issues no extra "
        "collective: each share's small-batch norm comes from its own rank's micro-batches. The adam geometry "
        "starts measuring at the optimizer's 5th step: before it, v_hat averages too few squared gradients "
        "and a coordinate whose few gradients happened to be small weighs without bound.",
    )

    def scale_for(self, geometry: str) -> float:
        """``scale``, or its default for the geometry the noise scale is measured in (``sgd``/``adam``)."""
        if self.scale is not None:
            return self.scale
        return DEFAULT_NOISE_SCALES[geometry]


class SeesawScheduleConfig(ScheduleConfigBase):
    """Seesaw: grow the batch where the learning-rate schedule decays (Meterez, Morwani et al. 2025).

    The rule reads the run's own LR schedule (the ds_config's ``scheduler`` section or the torch
    scheduler given to ``initialize``), evaluated in samples. Where that base LR ``eta(s)`` has fallen
    by ``alpha(s) = peak / eta(s)`` below its peak, the batch is ``start x alpha`` and, with
    ``lr_scaling.rule: "sqrt"``, the applied LR is ``eta(s) x sqrt(B / start)`` = ``peak / sqrt(alpha)``:
    each halving of the base LR becomes a doubling of the batch and a 1/sqrt(2) LR cut. ``discrete``
    (the paper's form) changes the batch only in whole steps of ``factor``; by default it follows
    ``alpha`` continuously. Needs ``lr_schedule_unit: "samples"``; see
    ``ds_adabatch.schedules.seesaw`` for the full rule.
    """

    type: Literal["seesaw"] = Field(description="Schedule type.")
    start: int = Field(
        ge=1,
        description="Global batch while the base LR is at its peak (warmup included), in samples per "
        "optimizer step; also the LR's reference batch (lr_scaling.reference_batch, if set, must equal it).",
    )
    discrete: bool = Field(
        default=False,
        description="false: the batch is start x peak / base LR, continuously (the rule as stated); "
        "true: start x factor^k, k = floor(log_factor(peak / base LR)), the paper's staircase. The "
        "staircase rounds the decay down to a power of factor, so it trains at a smaller batch between "
        "steps: on the convergence benchmark's cosine setting it takes 0.71x the baseline's steps where "
        "the continuous form takes 0.62x, for the same schedule of the base LR.",
    )
    factor: float = Field(
        default=2.0,
        gt=1.0,
        description="Batch multiplier of one discrete step (unitless, > 1): 2 doubles the batch each "
        "time the base LR halves. Ignored when discrete is false.",
    )
    peak_lr: float | None = Field(
        default=None,
        gt=0.0,
        description="The base schedule's peak learning rate (LR units). null: the largest base LR "
        "seen so far, which is the peak once warmup is over.",
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start)]


_NOISE_FIELDS = ("ema_beta", "ema_reference_batch", "max_relative_error", "measure_every", "geometry")


class GoodputScheduleConfig(_NoiseMeasuringConfig):
    """Choose the global batch that trains fastest on this hardware: the largest goodput.

    Goodput (Pollux, Qiao et al. OSDI '21) is throughput x statistical efficiency: samples per second
    times the fraction of them that count, ``(B_noise + start) / (B_noise + batch)`` with ``B_noise`` the
    gradient-noise scale the runtime measures as for ``gradient_noise``. Throughput comes from a model of
    the step time, ``fixed + GAS x (per_pass + per_sample x micro)``, fitted from the steps the job runs.
    Every ``decide_every`` optimizer steps the schedule evaluates every plannable batch from ``start``
    (or the section's ``min_global_batch`` where it is set: below ``start`` only when asked) up to
    ``max_global_batch`` (required) with the split the planner gives it under the micro-batch limit,
    and moves to the best one when its predicted goodput beats the current batch's by more than
    ``hysteresis``. Micro-batches not yet measured are predicted to cost what the largest measured one
    did (the model is flat until it knows better; on a new world size with one shape measured, the old
    world's slope), are tried at most ``explore_factor`` beyond the largest measured micro-batch,
    samples per rank and GAS, and a move to one is a trial, judged again after 3 of its step times (and
    measured again, up to 8, where those scatter too much to tell). During the default warm-up, before
    the noise estimate is usable, it moves only to a batch whose step costs at most ``hysteresis`` more
    (at no noise scale does it lose more than that). Where a larger batch is nearly free (a host-bound step) it grows to the large end;
    where the step time grows with the batch it settles near the noise scale. The LR follows
    ``lr_scaling`` as for every schedule. With token budgets (``micro_batch_tokens``) the batch is still
    in samples, packed into passes of the budget: a step's shape is its passes per rank, predicted for
    every batch by packing the recent samples' lengths as the runtime's packer would (until enough were
    seen, from the samples a full pass held in the recent steps). The section's ``max_change_factor``
    bounds the batches rated (those within it of the current one); ``update_interval`` must be 1 (the
    schedule keeps its own cadence). See docs/schedules.md.
    """

    type: Literal["goodput"] = Field(description="Schedule type.")
    start: int = Field(
        ge=1,
        description="Global batch of the first steps, in samples per optimizer step; also the reference "
        "batch M0 of the statistical efficiency (efficiency 1 at start).",
    )
    decide_every: int = Field(
        default=10,
        ge=1,
        description="Optimizer steps between two goodput decisions. A move to a shape never run "
        "before is a trial, judged again after 3 of its step times (its first step is not kept; "
        "decide_every - 1 where fewer; measured again, up to 8, where their scatter does not tell) "
        "instead of at the next decision; shorter cadences judge the measured shapes on fewer steps "
        "and move more often.",
    )
    hysteresis: float = Field(
        default=0.05,
        ge=0.0,
        description="Move only when the best batch's predicted goodput exceeds the current batch's by "
        "more than this fraction (unitless). 0.05 is above the step-to-step spread of a median of a "
        "few step times, so the plan is not rebuilt for a gain that is noise, and a batch the model "
        "rates within 5% of the best stays.",
    )
    explore_factor: float = Field(
        default=2.0,
        gt=1.0,
        description="Batches whose micro-batch, samples per rank per step (micro x GAS) or GAS exceed "
        "this factor times the largest measured are not considered yet (unitless). 2 explores in "
        "doublings: each untried shape is measured before the next one beyond it is predicted from it "
        "(and a split of many small passes is not taken for as cheap as one pass before a pass's cost "
        "is measured).",
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        description="Optimizer steps before the first decision that reads the noise scale. null: one "
        "EMA time constant of noise measurements, ceil(measure_every / (1 - ema_beta)) steps (20 at the "
        "defaults), as for gradient_noise; before it the batch moves only where that needs no noise "
        "estimate: to a batch whose step costs at most hysteresis more than the current one's (so at no "
        "noise scale does it lose more than that) and that gives more than hysteresis more samples/s, "
        "tried and judged on its step times as any untried shape (a free larger batch on a host-bound "
        "GPU is reached in the first steps; where the cost grows in proportion to the batch, as on the "
        "2-core CPU benchmark, one trial of 2x start is measured slower and undone). A number: "
        "start is held that many steps, whatever the cost (for example the LR warm-up's length).",
    )
    remeasure_after: int | None = Field(
        default=500,
        ge=1,
        description="A shape (micro-batch, GAS, world size) the job has not run for this many optimizer "
        "steps is forgotten: its step times no longer rate it, it is predicted from the shapes that ran "
        "since, and a move there is a trial again, judged on fresh step times. A few unlucky steps (a "
        "pause, a busy neighbour, a GPU's first steps at a new size) can rate a shape slower than it runs, "
        "and a shape left is otherwise never measured again; a forgotten shape that is slower costs one "
        "trial (a few steps) per this many steps. null: measured shapes are kept for the whole run.",
    )
    ema_beta: float = GradientNoiseScheduleConfig.model_fields["ema_beta"]
    ema_reference_batch: int | None = GradientNoiseScheduleConfig.model_fields["ema_reference_batch"]
    max_relative_error: float | None = Field(
        default=0.35,
        gt=0.0,
        description="The noise estimate counts as confident once its relative standard error (as for "
        "gradient_noise) is at most this (unitless); a decision then rates every batch at the estimate. "
        "Before that, B_noise lies within B_noise / exp(2 x error) to B_noise x exp(2 x error) (about "
        "95%), and a move away from start must lose nowhere in it and gain more than hysteresis at the "
        "estimate: a nearly free larger batch never loses and moves from the first measurements, where the "
        "cost grows with the batch it waits for the estimate; a move back toward start needs only the estimate (an exploration "
        "measured slower than predicted is undone at once). An error above 5 (or none yet) holds. null: the estimate is always taken as is.",
    )
    measure_every: int = GradientNoiseScheduleConfig.model_fields["measure_every"]
    geometry: Literal["auto", "sgd", "adam"] = GradientNoiseScheduleConfig.model_fields["geometry"]
    noise_trend: bool = Field(
        default=False,
        description="Read the noise estimate at its trend's value now rather than at its measurements' "
        "mean age (about 1 / (1 - ema_beta) measurements ago: ~320 steps on one rank at GAS 1, where a "
        "step's noise is measured by splitting one step in ~17): a twin estimate of half the memory is "
        "fed the same measurements, and where the two differ by more than twice the standard error of "
        "their log ratio the long one is extrapolated along the trend they show (at most 4x either "
        "way), its relative error widened by the extrapolation's (ds_adabatch.signals.noise_trend). "
        "Off: the smoothed estimate as it is.",
    )
    efficiency: Literal["auto", "linear", "sqrt"] = Field(
        default="auto",
        description='The statistical efficiency of batch M relative to start M0, from B_noise. "linear": '
        "Pollux's (B_noise + M0) / (B_noise + M), for an LR scaled linearly (or not at all): beyond "
        'B_noise a step\'s progress stops growing with its samples. "sqrt": its square root, for an LR '
        "scaled as sqrt(M / M0): beyond B_noise a step's progress still grows with its LR, so a sample "
        'there counts 1 / sqrt(M / M0), not M0 / M; well below B_noise both are 1. "auto": "sqrt" '
        'where lr_scaling.rule is "sqrt" (or "adascale" with gain_power below 1), else "linear". On the 2-core CPU benchmark (AdamW, sqrt '
        "scaling) batches 16 and 32 measured an efficiency of 0.94-1.04 and 0.76-0.82 relative to 8, "
        "where Pollux's form rated them 0.80-0.91 and 0.58-0.77 and the square root 0.89-0.95 and "
        "0.76-0.88; goodput reached 24 of 33 targets within 1.05x the best fixed batch with the square "
        "root, 10 with Pollux's form, in the same runs (ds_adabatch.signals.efficiency, BENCHMARKS.md).",
    )

    def estimator_settings(self) -> dict[str, float | bool]:
        return {**super().estimator_settings(), "trend": self.noise_trend}

    def section_problems(self, section: Any) -> list[tuple[str, str, Any]]:
        """What the rest of the ``"adabatch"`` section must give this schedule: ``(path, problem, value)``."""
        problems = []
        if section.max_global_batch is None:
            problems.append(
                (
                    "max_global_batch",
                    "is required by the goodput schedule (where a larger batch costs nothing more, goodput "
                    "grows with the batch without end): set the largest global batch to consider",
                    None,
                )
            )
        if section.update_interval != 1:
            problems.append(
                (
                    "update_interval",
                    "must be 1 with the goodput schedule: it keeps its own cadence (decide_every) and "
                    "judges a trial as soon as 3 of its step times are in, which consulting it every "
                    "update_interval steps would delay; set schedule.decide_every instead",
                    section.update_interval,
                )
            )
        return problems


def measures_noise(schedule: Any) -> bool:
    """Whether a schedule config's rule reads the gradient-noise scale (``gradient_noise``, ``goodput``)."""
    return getattr(schedule, "type", None) in ("gradient_noise", "goodput")

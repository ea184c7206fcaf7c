"""Config models of the batch-size schedules: the ``"adabatch".schedule`` section.

``ScheduleConfig`` is a discriminated union on ``type``. It is the single place where schedule types
register: add a model here (with ``type: Literal["name"]``) and to the union, and implement its rule in
``ds_adabatch.schedules``.

Every model answers two questions the loader needs without running the schedule:
``initial_batch(world_size)`` (the first global batch) and ``endpoint_batches(world_size)`` (the
values that must lie inside ``min_global_batch`` / ``max_global_batch``, with the field each came from).
Models whose batch is per device answer ``None`` / ``[]`` when no world size is given.

Batch sizes are in samples (sequences, for a language model) per optimizer step over all data-parallel
ranks unless a field says otherwise.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CallableScheduleConfig",
    "ConstantScheduleConfig",
    "GoodputScheduleConfig",
    "GradientNoiseScheduleConfig",
    "LinearScheduleConfig",
    "LossPlateauScheduleConfig",
    "PiecewiseScheduleConfig",
    "ScheduleConfig",
    "ScheduleConfigBase",
    "SeesawScheduleConfig",
    "StepScheduleConfig",
    "measures_noise",
]


_UNIT_DESCRIPTION = (
    "Unit of the global batch values: 'samples' per optimizer step, or 'tokens': the step takes samples "
    "of the global order until their lengths reach the value (needs adabatch.micro_batch_tokens and "
    "lengths given to ds_adabatch.initialize). The ramp is still measured in samples consumed."
)


class ScheduleConfigBase(BaseModel):
    """Common base: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def initial_batch(self, world_size: int | None = None) -> int | None:
        """The global batch (samples) of the first optimizer step; None if it depends on the world size."""
        raise NotImplementedError

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        """``(field, global batch)`` pairs that must lie inside the configured bounds."""
        raise NotImplementedError

    @property
    def batch_unit(self) -> str:
        """Unit of the schedule's global batch: ``"samples"``, or ``"tokens"`` where the model has
        ``unit: "tokens"`` (a token target per optimizer step)."""
        return (
            "tokens"
            if getattr(self, "unit", "samples") == "tokens" and self.type != "piecewise"
            else "samples"
        )


class ConstantScheduleConfig(ScheduleConfigBase):
    """A fixed global batch."""

    type: Literal["constant"] = Field(description="Schedule type.")
    value: int = Field(ge=1, description="Global batch size, in `unit` per optimizer step.")
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=_UNIT_DESCRIPTION,
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.value

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("value", self.value)]


class LinearScheduleConfig(ScheduleConfigBase):
    """Global batch moving linearly from ``start`` to ``end`` over the first ``ramp_samples`` samples."""

    type: Literal["linear"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at sample 0, in `unit` per optimizer step.")
    end: int = Field(
        ge=1, description="Global batch once ramp_samples samples have been consumed, in `unit`."
    )
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=_UNIT_DESCRIPTION,
    )
    ramp_samples: int = Field(
        ge=0, description="Length of the ramp, in training samples consumed (all ranks together)."
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start), ("end", self.end)]

    @model_validator(mode="after")
    def _ramp_needs_length(self) -> LinearScheduleConfig:
        if self.ramp_samples == 0 and self.start != self.end:
            raise ValueError("ramp_samples must be > 0 when start differs from end")
        return self


class StepScheduleConfig(ScheduleConfigBase):
    """Megatron-LM's ``--rampup-batch-size start increment ramp_samples``: a staircase in samples.

    The batch moves from ``start`` to ``end`` in ``(end - start) / increment`` equal steps of
    ``increment`` samples, spread evenly over the first ``ramp_samples`` samples consumed, then holds
    ``end``. With ``n`` steps the batch after ``s`` samples is
    ``start + increment * min(n, floor(s * n / ramp_samples))`` (``end < start`` shrinks the same way).

    Example: ``{"type": "step", "start": 32, "end": 1536, "increment": 32,
    "ramp_samples": 6000000}`` adds 32 sequences every 127,659.6 samples.

    Where it can differ from Megatron-LM by one step: Megatron computes the number of increments as
    ``int(s / (ramp_samples / n))`` in floating point. When ``s * n / ramp_samples`` is exactly an
    integer (an exact change point), that quotient can come out just below it (``8992 / (8992 / 7) =
    6.999999999999999``) and Megatron moves to the next batch one optimizer step later. This schedule
    uses integer arithmetic and changes at the exact point; at every other sample count the two give
    the same batch (checked on random configurations, tests/test_schedules.py). Rounding: Megatron
    needs each batch to be a multiple of micro-batch x data-parallel size and, with
    ``--decrease-batch-size-if-needed``, rounds down to one; here a batch that is not plannable (not a
    multiple of ``granularity`` and, without ``allow_uneven``, of the world size) rounds to the nearest
    plannable batch (ties up), like every schedule's output. Choose ``increment`` and ``start`` as
    multiples of that grid to get the same batches as Megatron.
    """

    type: Literal["step"] = Field(description="Schedule type.")
    start: int = Field(ge=1, description="Global batch at sample 0, in `unit` per optimizer step.")
    end: int = Field(
        ge=1, description="Global batch once ramp_samples samples have been consumed, in `unit` per step."
    )
    increment: int = Field(
        ge=1, description="Size of each step of the staircase, in `unit` per optimizer step."
    )
    unit: Literal["samples", "tokens"] = Field(
        default="samples",
        description=_UNIT_DESCRIPTION,
    )
    ramp_samples: int = Field(
        ge=0, description="Length of the staircase, in training samples consumed (all ranks together)."
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start), ("end", self.end)]

    @model_validator(mode="after")
    def _steps_divide(self) -> StepScheduleConfig:
        span = abs(self.end - self.start)
        if span % self.increment:
            raise ValueError(
                f"|end - start| = {span} is not a multiple of increment {self.increment}; change "
                f"increment to a divisor of {span} or move end"
            )
        if self.ramp_samples == 0 and span:
            raise ValueError("ramp_samples must be > 0 when start differs from end")
        return self


_Point = tuple[
    Annotated[int, Field(ge=0, description="Position of the point, in the schedule's unit.")],
    Annotated[int, Field(ge=1, description="Global batch from this point on, in samples per step.")],
]


class PiecewiseScheduleConfig(ScheduleConfigBase):
    """A global batch given at points ``[[at, batch], ...]`` of a training clock.

    ``unit`` picks the clock: samples consumed, tokens consumed, or completed optimizer steps (the first
    step is step 0). Before the first point the first batch holds, after the last point the last one.
    Between points the batch holds each value until the next point, or, with ``interpolate``, moves
    linearly between them.

    Examples:
        DeepSeek-V2-style warm-up, 2304 -> 9216 sequences over the first 225B tokens::

            {"type": "piecewise", "unit": "tokens", "interpolate": true,
             "points": [[0, 2304], [225000000000, 9216]]}

        A GPT-3-style linear ramp from a small batch to the full 1536 sequences over 4B tokens::

            {"type": "piecewise", "unit": "tokens", "interpolate": true,
             "points": [[0, 16], [4000000000, 1536]]}

        A doubling plan by optimizer step (holds each value)::

            {"type": "piecewise", "unit": "steps", "points": [[0, 256], [1000, 512], [3000, 1024]]}

    The tokens clock needs the runtime (or ``simulate``) to count tokens.
    """

    type: Literal["piecewise"] = Field(description="Schedule type.")
    points: list[_Point] = Field(
        min_length=1,
        description="[[at, global batch], ...] with strictly increasing `at` (in `unit`); batches in "
        "samples per optimizer step. Start at 0 to set the first batch explicitly.",
    )
    unit: Literal["samples", "tokens", "steps"] = Field(
        default="samples",
        description="Clock of `at`: samples consumed, tokens consumed, or completed optimizer steps.",
    )
    interpolate: bool = Field(
        default=False,
        description="true: move linearly between points; false: hold each batch until the next point.",
    )

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.points[0][1]

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [(f"points[{i}][1]", batch) for i, (_, batch) in enumerate(self.points)]

    @model_validator(mode="after")
    def _sorted(self) -> PiecewiseScheduleConfig:
        ats = [at for at, _ in self.points]
        for i in range(1, len(ats)):
            if ats[i] <= ats[i - 1]:
                raise ValueError(
                    f"points must have strictly increasing `at`: points[{i}] is at {ats[i]}, after "
                    f"points[{i - 1}] at {ats[i - 1]}; sort the points and drop duplicates"
                )
        return self


_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class CallableScheduleConfig(ScheduleConfigBase):
    """A user function ``fn(step, batch_size, **kwargs) -> int``, called at every evaluation.

    ``step`` is the number of completed optimizer steps, ``batch_size`` the function's previous result
    (``start`` the first time) in the function's unit, and the result becomes the next batch. With
    ``per: "device"`` the unit is samples per data-parallel rank per optimizer step (global / world
    size), the unit of a Hugging Face ``per_device_train_batch_size``.

    Example, +1 sample per device every 5 steps::

        {"type": "callable", "function": "my_pkg.schedules:grow", "start": 1, "per": "device",
         "kwargs": {"interval": 5, "increment": 1}}

    The function is imported by its dotted path when the schedule is built; it is never evaluated
    from text.
    """

    type: Literal["callable"] = Field(description="Schedule type.")
    function: str = Field(
        description="Import path 'package.module:name' of the function (name may be dotted, "
        "e.g. 'pkg.mod:Class.method')."
    )
    start: int = Field(ge=1, description="First batch, in the function's unit (see `per`).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function on every call."
    )
    per: Literal["global", "device"] = Field(
        default="global",
        description="Unit of `start` and of the function's batch: 'global' = samples per optimizer "
        "step over all ranks; 'device' = samples per rank per optimizer step.",
    )

    @field_validator("function")
    @classmethod
    def _path_shape(cls, value: str) -> str:
        if not _FUNCTION_PATH.match(value):
            raise ValueError(f"{value!r} is not an import path of the form 'package.module:function'")
        return value

    def initial_batch(self, world_size: int | None = None) -> int | None:
        if self.per == "global":
            return self.start
        return None if world_size is None else self.start * world_size

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        first = self.initial_batch(world_size)
        return [] if first is None else [("start", first)]


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


class GradientNoiseScheduleConfig(ScheduleConfigBase):
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
        "collective: each share's small-batch norm comes from its own rank's micro-batches.",
    )

    def scale_for(self, geometry: str) -> float:
        """``scale``, or its default for the geometry the noise scale is measured in (``sgd``/``adam``)."""
        if self.scale is not None:
            return self.scale
        return DEFAULT_NOISE_SCALES[geometry]

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start)]

    def estimator_settings(self) -> dict[str, float]:
        """Keyword arguments of ``ds_adabatch.signals.GradientNoiseEstimator`` for this schedule."""
        reference = self.ema_reference_batch
        if reference is None:
            reference = max(self.start, 8)
        return {"ema_beta": self.ema_beta, "reference_batch": float(reference)}


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


class GoodputScheduleConfig(ScheduleConfigBase):
    """Choose the global batch that trains fastest on this hardware: the largest goodput.

    Goodput (Pollux, Qiao et al. OSDI '21) is throughput x statistical efficiency: samples per second
    times the fraction of them that count, ``(B_noise + start) / (B_noise + batch)`` with ``B_noise`` the
    gradient-noise scale the runtime measures as for ``gradient_noise``. Throughput comes from a model of
    the step time, ``fixed + GAS x (per_pass + per_sample x micro)``, fitted from the steps the job runs.
    Every ``decide_every`` optimizer steps the schedule evaluates every plannable batch up to
    ``max_global_batch`` (required) with the split the planner gives it under the micro-batch limit,
    and moves to the best one when its predicted goodput beats the current batch's by more than
    ``hysteresis``. Micro-batches not yet measured are predicted to cost what the largest measured one
    did (the model is flat until it knows better) and are tried at most ``explore_factor`` beyond the
    largest measured. Where a larger batch is nearly free (a host-bound step) it grows to the large end;
    where the step time grows with the batch it settles near the noise scale. The LR follows
    ``lr_scaling`` as for every schedule. See docs/schedules.md.
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
        description="Optimizer steps between two goodput decisions. A shape's first step is not "
        "measured and its time is the median of the steps since, so 10 gives a new shape about 9 "
        "measured steps before it is judged; shorter cadences judge on fewer steps and move more often.",
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
        description="Batches whose micro-batch, or samples per rank per step (micro x GAS), exceed this "
        "factor times the largest measured are not considered yet (unitless). 2 explores in doublings: "
        "each untried shape is measured before the next one beyond it is predicted from it.",
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        description="Optimizer steps held at start before the first decision. null: one EMA time "
        "constant of noise measurements, ceil(measure_every / (1 - ema_beta)) steps (20 at the "
        "defaults), as for gradient_noise.",
    )
    ema_beta: float = GradientNoiseScheduleConfig.model_fields["ema_beta"]
    ema_reference_batch: int | None = GradientNoiseScheduleConfig.model_fields["ema_reference_batch"]
    max_relative_error: float | None = GradientNoiseScheduleConfig.model_fields["max_relative_error"]
    measure_every: int = GradientNoiseScheduleConfig.model_fields["measure_every"]
    geometry: Literal["auto", "sgd", "adam"] = GradientNoiseScheduleConfig.model_fields["geometry"]

    def initial_batch(self, world_size: int | None = None) -> int:
        return self.start

    def endpoint_batches(self, world_size: int | None = None) -> list[tuple[str, int]]:
        return [("start", self.start)]

    def estimator_settings(self) -> dict[str, float]:
        """Keyword arguments of ``ds_adabatch.signals.GradientNoiseEstimator`` for this schedule."""
        reference = self.ema_reference_batch
        if reference is None:
            reference = max(self.start, 8)
        return {"ema_beta": self.ema_beta, "reference_batch": float(reference)}

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
        if section.token_budget:
            problems.append(
                (
                    "schedule.type",
                    "goodput does not support token-budget steps (micro_batch_tokens) yet: use "
                    "gradient_noise or a ramp with unit tokens, or drop micro_batch_tokens",
                    "goodput",
                )
            )
        return problems


def measures_noise(schedule: Any) -> bool:
    """Whether a schedule config's rule reads the gradient-noise scale (``gradient_noise``, ``goodput``)."""
    return getattr(schedule, "type", None) in ("gradient_noise", "goodput")


ScheduleConfig = Annotated[
    Union[  # noqa: UP007 - the registry of schedule types
        ConstantScheduleConfig,
        LinearScheduleConfig,
        StepScheduleConfig,
        PiecewiseScheduleConfig,
        CallableScheduleConfig,
        LossPlateauScheduleConfig,
        GradientNoiseScheduleConfig,
        GoodputScheduleConfig,
        SeesawScheduleConfig,
    ],
    Field(discriminator="type"),
]

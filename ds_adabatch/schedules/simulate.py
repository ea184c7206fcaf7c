"""Dry-run a config's schedule: the plan it would make at every optimizer step, as a CSV and a plot.

``ds-adabatch simulate CONFIG --world-size W --samples N --out plan.png`` calls :func:`simulate`. The
run is exact for schedules of the training clock (``constant``, ``linear``, ``step``, ``piecewise``,
``callable``). Schedules driven by measurements (``loss_plateau``, ``gradient_noise``) need the
measurements of a recorded run: ``--replay metrics.jsonl``, one JSON object per line with at least
``samples`` (samples consumed when the record was written) and any of ``loss``, ``loss_ema``,
``noise_scale``, ``grad_norm``, ``lr``, ``tokens``, ``epoch``. At each simulated step the context gets,
for every signal, the latest value recorded at or before the simulated sample count (held, not
interpolated: the simulated run has different batch sizes, so the recorded curve is only a proxy);
``tokens`` is interpolated linearly in samples. Lines without ``samples`` (other log events) and
values that are ``null`` or ``NaN`` are skipped.

The ``goodput`` schedule also needs what a step costs: ``step_time``, a curve in
:func:`~ds_adabatch.signals.parse_step_time_curve`'s syntax (``"fixed=0.03,per_sample=0.0004"`` or a
table ``"8:0.031,32:0.034"``), which stands in for the measured step times its throughput model learns
from (each simulated step is "measured" at the curve's value for its shape, within the curve's
``jitter``); and a noise scale, from
``--replay`` or fixed with ``noise_scale``.

With token budgets (``micro_batch_tokens``) a step's passes come from its samples' lengths, so the
run needs them: ``--lengths FILE`` (one length in tokens per sample, in dataset order; text, JSON or
``.npy``), read by :class:`~ds_adabatch.data.simulated_steps.PackedSteps`, which forms every step with
the runtime's own sampler and packer (the ``data`` section's order, the bucket window, padding and
truncation). A row then holds the step's real samples and tokens, its largest pass in samples
(``micro_batch_per_gpu``), its passes per rank (``gradient_accumulation_steps``) and the token budget
they were cut with (``pass_budget``); ``goodput`` learns from those passes as in a run.

The ``lr`` column is the learning rate the step would apply: the ds_config's ``scheduler`` section
(``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, or none: the optimizer's ``lr``) evaluated in
samples under ``lr_schedule_unit: "samples"`` (in steps otherwise), times the batch's LR multiplier;
empty when the config has neither. The ``seesaw`` schedule reads that base LR to decide the batch, so
simulating it needs the scheduler section (a torch scheduler only exists in a running job).
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..plan import plan_batch
from .base import Schedule, ScheduleContext
from .base_lr import DeepSpeedSchedulerCurve, base_lr_from_ds_config
from .controller import BatchSizeController
from .lr import lr_multiplier

if TYPE_CHECKING:  # pragma: no cover
    from ..signals.step_time_fit import StepTimeFit

__all__ = ["CSV_COLUMNS", "SimulatedStep", "StepSource", "simulate"]

CSV_COLUMNS = (
    "step",
    "samples",
    "tokens",
    "global_batch",
    "micro_batch_per_gpu",
    "gradient_accumulation_steps",
    "even",
    "pass_budget",
    "lr_multiplier",
    "lr",
    "desired",
    "reason",
)
"""Columns of the CSV and keys of each returned row; ``samples`` / ``tokens`` are counted before the step."""


@dataclass(frozen=True)
class SimulatedStep:
    """One optimizer step as a :class:`StepSource` forms it.

    Attributes:
        samples: Its real samples over all ranks (fewer than the global batch at an epoch's tail).
        micro_batch_per_gpu, gradient_accumulation_steps, even: Its plan (with token budgets: the
            largest pass in samples, the passes per rank, whether every rank holds the same samples).
        budget: The token budget its passes were cut with; None for steps of whole micro-batches.
        lengths: Its samples' lengths in tokens, in order (token budgets; None otherwise).
    """

    samples: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    even: bool
    budget: int | None = None
    lengths: Any = None


class StepSource(Protocol):
    """What forms the simulated steps in place of the planner: with token budgets,
    :class:`~ds_adabatch.data.simulated_steps.PackedSteps`."""

    bucket_window: int
    """Samples of the order sorted by length together (0: none)."""

    @property
    def pass_budget(self) -> int | None:
        """The token budget the next step is cut with (None: whole micro-batches)."""

    @property
    def tokens_consumed(self) -> int:
        """Real tokens of the steps taken so far."""

    @property
    def fractional_epoch(self) -> float:
        """Epochs completed, with the fraction of the current one."""

    def take(self, global_batch: int, world_size: int) -> SimulatedStep:
        """Form and take the next step of ``global_batch`` (samples, or tokens for a schedule in tokens)."""

    def passes_of(self, lengths: Any, world_size: int, budget: int) -> int:
        """Passes per rank samples of ``lengths`` pack into (what the runtime binds to the goodput
        schedule's throughput model)."""


_SIGNALS = ("loss", "loss_ema", "grad_norm", "noise_scale", "lr", "epoch")
_MEASURED = frozenset({"loss", "loss_ema", "grad_norm", "noise_scale", "lr"})


class _Replay:
    """Signals of a recorded run, looked up by samples consumed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        series: dict[str, list[tuple[float, float]]] = {key: [] for key in (*_SIGNALS, "tokens")}
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.path}:{number}: not a JSON object ({exc.msg})") from None
                if not isinstance(record, dict) or not _is_number(record.get("samples")):
                    continue
                for key, points in series.items():
                    value = record.get(key)
                    # null and NaN (a step that measured nothing) count as missing, not as errors.
                    if value is None or (isinstance(value, float) and math.isnan(value)):
                        continue
                    if not _is_number(value):
                        raise ValueError(f"{self.path}:{number}: {key!r} must be a number, got {value!r}")
                    points.append((float(record["samples"]), float(value)))
        if not any(series.values()):
            raise ValueError(f"{self.path} holds no record with a numeric 'samples' and a signal to replay")
        # Records are expected in order; sorting (stable) also accepts logs merged from several files.
        self.series = {key: sorted(points, key=lambda p: p[0]) for key, points in series.items()}
        self.keys = {key: [s for s, _ in points] for key, points in self.series.items()}

    def has(self, key: str) -> bool:
        return bool(self.series[key])

    def held(self, key: str, samples: int) -> float | None:
        """The latest value of ``key`` recorded at or before ``samples``."""
        i = bisect.bisect_right(self.keys[key], samples) - 1
        return None if i < 0 else self.series[key][i][1]

    def tokens(self, samples: int) -> float | None:
        """Tokens at ``samples``, interpolated between records (proportional outside them)."""
        points = self.series["tokens"]
        if not points:
            return None
        i = bisect.bisect_right(self.keys["tokens"], samples)
        if 0 < i < len(points):
            (s0, t0), (s1, t1) = points[i - 1], points[i]
            return t0 if s1 == s0 else t0 + (t1 - t0) * (samples - s0) / (s1 - s0)
        s_ref, t_ref = points[-1] if i else points[0]
        return t_ref * samples / s_ref if s_ref > 0 else t_ref


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def simulate(
    loaded_config: Any,
    *,
    world_size: int,
    samples: int,
    out_png: str | os.PathLike[str] | None,
    out_csv: str | os.PathLike[str] | None = None,
    replay: str | os.PathLike[str] | None = None,
    tokens_per_sample: int = 0,
    max_steps: int = 2_000_000,
    step_time: str | None = None,
    noise_scale: float | None = None,
    steps: StepSource | None = None,
) -> list[dict[str, Any]]:
    """Step the config's batch-size controller through ``samples`` samples and record every plan.

    Args:
        loaded_config: a ``LoadedConfig`` (anything with ``.adabatch``, an ``AdaBatchConfig``).
        world_size: data-parallel ranks to plan for.
        samples: training samples to simulate; the last step may run past it.
        out_png: where to draw global batch, micro-batch, GAS and LR multiplier against samples
            (None: no plot).
        out_csv: where to write the rows; default: ``out_png`` with a ``.csv`` suffix (no CSV when both
            are None).
        replay: JSONL of a recorded run whose signals feed measurement-driven schedules.
        tokens_per_sample: tokens per sample (e.g. the sequence length) for the ``tokens`` clock;
            0: take tokens from ``replay`` if it records them, else schedules keyed on tokens refuse.
        max_steps: refuse to simulate more optimizer steps than this.
        step_time: the step-time curve a schedule reading step times (``goodput``) learns from.
        noise_scale: a fixed gradient-noise scale (samples), in place of a replay's.
        steps: what forms the steps; required with token budgets (``micro_batch_tokens``), where it is a
            :class:`~ds_adabatch.data.simulated_steps.PackedSteps` over the dataset's lengths. None:
            the planner's split of every global batch.

    Returns:
        One dict per optimizer step with the keys of :data:`CSV_COLUMNS`.

    Raises:
        ValueError: a measurement-driven schedule without ``replay``, a token-keyed schedule without a
            token count, bad arguments, or a run longer than ``max_steps``.
    """
    _check_sizes(world_size=world_size, samples=samples, tokens_per_sample=tokens_per_sample)
    cfg = loaded_config.adabatch
    if cfg.token_budget and steps is None:
        raise ValueError(
            "adabatch.micro_batch_tokens forms each step from the samples' lengths: give them, "
            "--lengths FILE (one length in tokens per sample, in dataset order), or steps=PackedSteps(...)"
        )
    if steps is not None and tokens_per_sample:
        raise ValueError(
            "tokens_per_sample does not apply with sample lengths, which count the tokens: drop one"
        )
    if steps is not None and not cfg.token_budget:
        raise ValueError(
            "sample lengths only apply with adabatch.micro_batch_tokens (token-budget steps): set "
            "micro_batch_tokens in the config, or drop the lengths"
        )
    controller = BatchSizeController(cfg, world_size)
    schedule = controller.schedule
    data = _Replay(replay) if replay is not None else None
    curve_of_steps = _step_time_curve(schedule, step_time, noise_scale)
    count_tokens = _check_measurements(
        schedule,
        data,
        noise_scale=noise_scale,
        tokens_per_sample=tokens_per_sample,
        counted=steps is not None,
    )
    run = _Simulation(
        loaded_config,
        controller,
        world_size=world_size,
        data=data,
        tokens_per_sample=tokens_per_sample,
        count_tokens=count_tokens,
        noise_scale=noise_scale,
        step_times=curve_of_steps,
        steps=steps,
    )
    rows = run.rows(samples, max_steps)
    if out_csv is None and out_png is not None:
        out_csv = Path(out_png).with_suffix(".csv")
    if out_csv is not None:
        _write_csv(rows, Path(out_csv))
    if out_png is not None:
        title = f"{schedule.name} schedule on {world_size} rank{'s' if world_size != 1 else ''}"
        _plot(rows, Path(out_png), title)
    return rows


def _check_sizes(*, world_size: int, samples: int, tokens_per_sample: int) -> None:
    for name, value, low in (("world_size", world_size, 1), ("samples", samples, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(tokens_per_sample, bool) or not isinstance(tokens_per_sample, int) or tokens_per_sample < 0:
        raise ValueError(f"tokens_per_sample must be an integer >= 0, got {tokens_per_sample!r}")


def _step_time_curve(
    schedule: Schedule, step_time: str | None, noise_scale: float | None
) -> StepTimeFit | None:
    """The step-time curve a schedule reading step times learns from (None for the others); checks
    ``noise_scale`` first."""
    if noise_scale is not None and not (math.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale must be a number > 0 samples, got {noise_scale!r}")
    if "step_time" not in schedule.requires:
        return None
    if step_time is None:
        raise ValueError(
            f"the {schedule.name} schedule learns what a step costs from the steps it runs; simulating it "
            "needs a step-time curve: --step-time fixed=0.03,per_pass=0.002,per_sample=0.0004 (seconds) "
            "or a table of step times by shape (one pass, or MICROxGAS), e.g. --step-time 8:0.031,32:0.034,8x4:0.06"
        )
    from ..signals.step_time_fit import parse_step_time_curve

    return parse_step_time_curve(step_time)


def _check_measurements(
    schedule: Schedule,
    data: _Replay | None,
    *,
    noise_scale: float | None,
    tokens_per_sample: int,
    counted: bool = False,
) -> bool:
    """Refuse a schedule whose measurements nothing gives; whether the run counts tokens (``counted``:
    the step source counts them)."""
    measured = sorted(schedule.requires & _MEASURED - ({"noise_scale"} if noise_scale is not None else set()))
    if measured and data is None:
        fixed = " (or --noise-scale B, a fixed noise scale in samples)" if measured == ["noise_scale"] else ""
        raise ValueError(
            f"the {schedule.name} schedule is driven by measured {', '.join(measured)}; simulating it "
            f"needs a recorded run: pass --replay metrics.jsonl (one JSON object per optimizer step with "
            f"'samples' and {', '.join(repr(m) for m in measured)}){fixed}"
        )
    for key in measured:
        if data is not None and not data.has(key):
            raise ValueError(f"the {schedule.name} schedule reads {key!r}, which {data.path} never records")
    count_tokens = counted or tokens_per_sample > 0 or (data is not None and data.has("tokens"))
    if "tokens" in schedule.requires and not count_tokens:
        raise ValueError(
            f"the {schedule.name} schedule is keyed on tokens; give tokens_per_sample (`ds-adabatch simulate "
            "--tokens-per-sample N`, e.g. the sequence length), sample lengths (--lengths) or a replay that "
            "records 'tokens'"
        )
    return count_tokens


class _Simulation:
    """The controller stepped through a run: one row per optimizer step (see :func:`simulate`)."""

    def __init__(
        self,
        loaded_config: Any,
        controller: BatchSizeController,
        *,
        world_size: int,
        data: _Replay | None,
        tokens_per_sample: int,
        count_tokens: bool,
        noise_scale: float | None,
        step_times: StepTimeFit | None,
        steps: StepSource | None = None,
    ) -> None:
        cfg = loaded_config.adabatch
        self.steps = steps
        throughput = getattr(controller.schedule, "throughput", None)
        if steps is not None and throughput is not None:
            # as the runtime's step core binds its sampler's
            throughput.bind_packer(steps.passes_of, min_lengths=steps.bucket_window)
        self.cfg, self.controller, self.schedule = cfg, controller, controller.schedule
        self.world_size, self.data, self.step_times = world_size, data, step_times
        from ..signals.step_time_fit import SimulatedDevice

        # a curve's jitter and drift: the same draws in every simulation
        self._measured = None if step_times is None else SimulatedDevice(step_times, random.Random(0))
        self.tokens_per_sample, self.count_tokens, self.noise_scale = (
            tokens_per_sample,
            count_tokens,
            noise_scale,
        )
        scaling = getattr(cfg, "lr_scaling", None)
        self.rule = getattr(scaling, "rule", "none")
        self.gain_power = float(getattr(scaling, "gain_power", 0.5))
        self.batch = controller.initial_global_batch()
        self.reference = getattr(scaling, "reference_batch", None) or self.batch
        self.allow_uneven = bool(getattr(cfg, "allow_uneven", False))
        needs_lr = hasattr(self.schedule, "bind_base_lr")
        self.curve = _base_lr_curve(loaded_config, self.reference, needed=needs_lr)
        if self.curve is not None and needs_lr:
            self.schedule.bind_base_lr(self.curve)
        self.by_samples = getattr(cfg, "lr_schedule_unit", "steps") == "samples"

    def rows(self, samples: int, max_steps: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        step = consumed = 0
        while consumed < samples:
            if step >= max_steps:
                raise ValueError(
                    f"simulating {samples} samples takes more than {max_steps} optimizer steps; simulate "
                    f"fewer samples"
                )
            row, taken = self._step(step, consumed)
            rows.append(row)
            consumed += taken
            step += 1
        return rows

    def _tokens(self, consumed: int) -> int | None:
        if self.steps is not None:
            return self.steps.tokens_consumed
        if self.tokens_per_sample:
            return consumed * self.tokens_per_sample
        if self.data is not None and self.count_tokens:
            return round(self.data.tokens(consumed) or 0)
        return None

    def _context(self, step: int, consumed: int, tokens: int | None) -> ScheduleContext:
        data = self.data
        signals = {key: data.held(key, consumed) for key in _SIGNALS} if data is not None else {}
        if self.noise_scale is not None:
            signals["noise_scale"] = self.noise_scale
        epoch = signals.pop("epoch", None)
        if self.steps is not None:
            epoch = self.steps.fractional_epoch
        budget = None if self.steps is None else self.steps.pass_budget
        return ScheduleContext(
            step=step,
            samples=consumed,
            tokens=tokens,
            epoch=epoch or 0.0,
            global_batch=self.batch,
            world_size=self.world_size,
            micro_batch_limit=self.cfg.initial_micro_batch_limit if budget is None else None,
            pass_budget=budget,
            **signals,
        )

    def _take(self, batch: int) -> SimulatedStep:
        """The step of ``batch`` as it would run: from the step source, else the planner's split."""
        if self.steps is not None:
            return self.steps.take(batch, self.world_size)
        plan = plan_batch(
            batch, self.world_size, self.cfg.initial_micro_batch_limit, allow_uneven=self.allow_uneven
        )
        return SimulatedStep(batch, plan.micro_batch_per_gpu, plan.gradient_accumulation_steps, plan.is_even)

    def _step(self, step: int, consumed: int) -> tuple[dict[str, Any], int]:
        """Decide and plan one step; its row and the samples it took."""
        tokens = self._tokens(consumed)
        context = self._context(step, consumed, tokens)
        decision = self.controller.next_global_batch(context)
        batch = self.batch = decision.global_batch
        taken = self._take(batch)
        if self.step_times is not None:  # the step "runs" and its time is measured on the curve
            # keyed as the runtime keys it (runtime.core.step_times.step_shape): a token-budget step
            # by its budget and passes, with its samples
            gas = taken.gradient_accumulation_steps
            micro = taken.micro_batch_per_gpu if taken.budget is None else taken.budget
            seconds = self._measured.measure(micro, gas)
            samples = None if taken.budget is None else taken.samples
            self.schedule.throughput.observe(
                micro, gas, self.world_size, seconds, samples=samples, lengths=taken.lengths
            )
        multiplier = lr_multiplier(
            self.rule,
            batch,
            self.reference,
            noise_scale=context.noise_scale,
            gain_power=self.gain_power,
        )
        lr: float | None = None
        if self.curve is not None:
            # In "steps" mode the scheduler steps once per optimizer step: its clock is step x reference.
            clock = consumed if self.by_samples else step * self.reference
            lr = self.curve.base_lr(clock) * multiplier
        return {
            "step": step,
            "samples": consumed,
            "tokens": tokens,
            "global_batch": batch,
            "micro_batch_per_gpu": taken.micro_batch_per_gpu,
            "gradient_accumulation_steps": taken.gradient_accumulation_steps,
            "even": taken.even,
            "pass_budget": taken.budget,
            "lr_multiplier": multiplier,
            "lr": lr,
            "desired": decision.desired,
            "reason": decision.reason,
        }, taken.samples


def _base_lr_curve(loaded_config: Any, reference: int, *, needed: bool) -> DeepSpeedSchedulerCurve | None:
    """The config's LR schedule keyed on samples; None when it cannot be evaluated and is not needed."""
    original = getattr(loaded_config, "original", None)
    try:
        if not isinstance(original, dict):
            raise ValueError("the config carries no ds_config to read the LR schedule from")
        return base_lr_from_ds_config(original, reference)
    except ValueError as err:
        if needed:
            raise ValueError(
                f"this schedule follows the LR schedule, which cannot be simulated here: {err}"
            ) from None
        return None


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    # Imported here so that importing ds_adabatch.schedules never needs matplotlib. The Figure API
    # renders with Agg without touching pyplot's global backend.
    from matplotlib.figure import Figure

    x = [row["samples"] for row in rows]
    lr_known = all(row["lr"] is not None for row in rows)
    packed = rows[0]["pass_budget"] is not None  # token budgets: passes of the budget, packed
    panels = (
        ("global_batch", "global batch"),
        ("micro_batch_per_gpu", "largest pass (samples)" if packed else "micro-batch / GPU"),
        ("gradient_accumulation_steps", "passes per rank" if packed else "GAS"),
        ("lr", "applied learning rate") if lr_known else ("lr_multiplier", "LR multiplier"),
    )
    fig = Figure(figsize=(9, 9), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        ax.plot(x, [row[key] for row in rows], drawstyle="steps-post", linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("samples consumed")
    fig.savefig(path, dpi=110, format="png")

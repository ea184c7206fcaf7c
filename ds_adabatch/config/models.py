"""The ``"adabatch"`` section of a ds_config, as pydantic models.

Every model forbids unknown keys (a typo must not silently fall back to a default) and validates
strictly: ``true`` is not an integer and ``"16"`` is not a number. Checks that involve several fields
but not the world size live in :meth:`AdaBatchConfig._cross_checks`; they raise :class:`ConfigError`
with paths relative to the section (``schedule.start``), which the loader prefixes with ``adabatch.``.
Checks that need the world size or DeepSpeed's own keys live in :mod:`ds_adabatch.config.loader`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .adaptive_schedules import measures_noise
from .errors import ConfigError, ConfigProblem
from .live import LiveElasticConfig, live_elastic_problems
from .memory import AUTO, UNBOUNDED_MICRO_BATCH, MemoryConfig, memory_problems
from .schedules import ScheduleConfig

__all__ = [
    "AdaBatchConfig",
    "DataConfig",
    "LogConfig",
    "LrScalingConfig",
    "endpoint_problems",
    "token_budget_problems",
]


class _Section(BaseModel):
    # strict: JSON configs are typed by hand, and a coerced ``true`` -> 1 hides a mistake.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LrScalingConfig(_Section):
    """How the learning rate follows the global batch size."""

    rule: Literal["none", "linear", "sqrt", "adascale"] = Field(
        "none",
        description=(
            "LR multiplier as the global batch B changes: 'none' keeps the scheduler's LR, 'linear' "
            "multiplies it by B / reference_batch, 'sqrt' by sqrt(B / reference_batch), 'adascale' by "
            "AdaScale's gain raised to gain_power, gain = (B / B0) x (B_noise + B0) / (B_noise + B) with "
            "B0 = reference_batch and B_noise the measured gradient-noise scale (1 before the first "
            "estimate, B / B0 where the gradient is all noise), re-applied before every step. 'adascale' "
            "needs a schedule that measures the noise scale (gradient_noise, goodput). Applied on top of "
            "whatever LR the DeepSpeed or torch scheduler sets."
        ),
    )
    gain_power: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description=(
            "Power of AdaScale's gain under rule 'adascale': 0.5 for Adam-type optimizers (AdaptDL's "
            "form; it meets 'sqrt' where the gradient is all noise), 1 for plain SGD (AdaScale's rule). "
            "Used only by 'adascale' (another value with another rule is refused)."
        ),
    )
    reference_batch: int | None = Field(
        None,
        ge=1,
        description=(
            "Global batch (samples per optimizer step) at which the multiplier is 1, and the unit "
            "that converts samples to scheduler steps under lr_schedule_unit 'samples'. "
            "null: the schedule's initial global batch."
        ),
    )


class DataConfig(_Section):
    """The global sample stream that is cut into global batches."""

    shuffle: bool = Field(
        True,
        description="Shuffle the sample order once per epoch; the order depends only on (seed, epoch).",
    )
    seed: int = Field(0, ge=0, description="Seed of the shuffle (an integer >= 0), the same on every rank.")
    drop_last: bool = Field(
        False,
        description=(
            "Drop an epoch's final global batch when fewer samples remain than planned; otherwise it "
            "is trained as a smaller global batch. Unset, ds_adabatch.initialize takes DeepSpeed's own "
            "top-level dataloader_drop_last (as DeepSpeed's loader would; set, the two must agree) and the "
            "Trainer TrainingArguments.dataloader_drop_last."
        ),
    )
    num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes per rank (0: load in the training process)."
    )


class LogConfig(_Section):
    """Where plan changes and per-step metrics are written, and how often pending losses are resolved."""

    jsonl: str | None = Field(
        None,
        min_length=1,
        description=(
            "Path of a JSON Lines file (relative to the working directory) that rank 0 appends one "
            "record to per optimizer step and per plan change; null: no file."
        ),
    )
    every_steps: int = Field(
        10,
        ge=1,
        description=(
            "Optimizer steps between two resolutions of the per-step losses and gradient norms: one "
            "small all-reduce then carries every pending step's loss sum, and those steps' records are "
            "written. Between them a steady step issues no collective of its own. Reading a step's "
            "loss sooner (float(engine.train_batch())) resolves it at once, on every rank."
        ),
    )


class AdaBatchConfig(_Section):
    """The ``"adabatch"`` section of a ds_config: how the global batch size changes during training.

    A planned global batch ``B`` (samples per optimizer step) is split as ranks x micro-batch x
    gradient-accumulation steps by :func:`ds_adabatch.plan_batch`; the schedule proposes ``B``, and the
    bounds, ``granularity`` and ``max_change_factor`` restrict it.
    """

    schedule: ScheduleConfig = Field(
        description=(
            'How the global batch size (samples per optimizer step) evolves; chosen by "type", '
            'e.g. {"type": "linear", "start": 16, "end": 64, "ramp_samples": 100000}.'
        )
    )
    max_micro_batch_per_gpu: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None,
        description=(
            "Largest micro-batch one GPU runs in a forward/backward pass, in samples; larger global "
            "batches use more gradient-accumulation steps. 'auto': learned at run time as the largest "
            "micro-batch that fits in memory (see memory). May be omitted when micro_batch_tokens is "
            "set; with both, a micro-batch respects both."
        ),
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Token budget of one forward/backward pass on one GPU, in tokens counted the way the "
            "collate pads (see padding): micro-batches hold as many samples as fit, so short samples "
            "share a pass and long ones get their own. Needs lengths (or length_fn) passed to "
            "ds_adabatch.initialize. null: micro-batches are cut by max_micro_batch_per_gpu samples."
        ),
    )
    padding: Literal["pad_to_longest", "packed"] = Field(
        "pad_to_longest",
        description=(
            "How the collate lays out a micro-batch, i.e. what micro_batch_tokens counts: "
            "'pad_to_longest' costs n x the longest length (tokens, padding included), 'packed' the "
            "sum of the lengths (samples concatenated into one row)."
        ),
    )
    bucket_window: int = Field(
        0,
        ge=0,
        description=(
            "With micro_batch_tokens: sort each step's samples by length, within consecutive windows "
            "of this many samples of the global order, before packing them (less padding; each "
            "sample still trains exactly once, in the step the global order puts it in). 0: the "
            "step's samples are packed from the whole step, longest first, without windows (the "
            "default packing already groups similar lengths within a step). Counted in samples."
        ),
    )
    truncate_long_samples: bool = Field(
        False,
        description=(
            "With micro_batch_tokens: a sample longer than the budget is counted as micro_batch_tokens "
            "long and trained alone in its micro-batch, the collate being responsible for cutting it "
            "to that length; false: such a sample is an error naming its index and length."
        ),
    )
    min_global_batch: int | None = Field(
        None, ge=1, description="Smallest global batch ever planned, in samples per optimizer step; null: 1."
    )
    max_global_batch: int | None = Field(
        None,
        ge=1,
        description="Largest global batch ever planned, in samples per optimizer step; null: unbounded.",
    )
    granularity: int = Field(
        1,
        ge=1,
        description="Every planned global batch is a multiple of this many samples (e.g. 8 or 64).",
    )
    allow_uneven: bool = Field(
        False,
        description=(
            "Allow micro-batches that differ by one sample between ranks and steps, so any global "
            "batch is plannable; false: planned global batches are multiples of the world size."
        ),
    )
    update_interval: int = Field(
        1,
        ge=1,
        description="Optimizer steps between two evaluations of the schedule (1 with goodput, which keeps "
        "its own cadence, decide_every).",
    )
    max_change_factor: float | None = Field(
        None,
        gt=1,
        description=(
            "A planned global batch grows or shrinks by at most this factor per schedule update "
            "(e.g. 2.0: at most doubling or halving; goodput rates only the batches within it); null: no "
            "limit."
        ),
    )
    lr_scaling: LrScalingConfig = Field(
        default_factory=LrScalingConfig,
        description="How the learning rate follows the global batch size.",
    )
    lr_schedule_unit: Literal["steps", "samples"] = Field(
        "steps",
        description=(
            "What advances the LR scheduler: 'steps' one tick per optimizer step; 'samples' samples "
            "consumed / lr_scaling.reference_batch, so a batch ramp does not stretch warmup or decay."
        ),
    )
    loss_normalization: Literal["sample", "token"] = Field(
        "sample",
        description=(
            "The update is the mean gradient over the global batch's samples ('sample') or over its "
            "target tokens, labels != -100 ('token')."
        ),
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Order of the global sample stream and data loading."
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Metric and plan-change logs.")
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Out-of-memory recovery inside a step and how an 'auto' micro-batch is learned.",
    )
    live_elastic: LiveElasticConfig = Field(
        default_factory=LiveElasticConfig,
        description="Survive a lost node in the same processes, from snapshots in host memory.",
    )

    @property
    def token_budget(self) -> bool:
        """True when micro-batches are cut by ``micro_batch_tokens`` (token-budget steps)."""
        return self.micro_batch_tokens is not None

    @property
    def micro_batch_limit(self) -> int:
        """The largest micro-batch ever planned, in samples: the integer ``max_micro_batch_per_gpu``, or
        with ``"auto"`` ``memory.micro_batch_ceiling`` (a very large number without one, or when only
        ``micro_batch_tokens`` bounds the micro-batch)."""
        if self.max_micro_batch_per_gpu is None:
            return UNBOUNDED_MICRO_BATCH
        if self.max_micro_batch_per_gpu != AUTO:
            return int(self.max_micro_batch_per_gpu)
        return self.memory.micro_batch_ceiling or UNBOUNDED_MICRO_BATCH

    @property
    def initial_micro_batch_limit(self) -> int:
        """The micro-batch bound of the first step, in samples: ``micro_batch_limit``, or with ``"auto"``
        ``memory.initial_micro_batch_per_gpu`` when given."""
        if self.max_micro_batch_per_gpu == AUTO and self.memory.initial_micro_batch_per_gpu is not None:
            return self.memory.initial_micro_batch_per_gpu
        return self.micro_batch_limit

    @property
    def auto_micro_batch(self) -> bool:
        """True when the micro-batch per GPU is learned at run time (``"auto"``)."""
        return self.max_micro_batch_per_gpu == AUTO

    @model_validator(mode="after")
    def _cross_checks(self) -> AdaBatchConfig:
        problems = self.cross_field_problems()
        if problems:
            # ConfigError is a ValueError: pydantic keeps it in the error's ctx, and the loader
            # unpacks it back into one problem per dotted path.
            raise ConfigError(problems)
        return self

    def cross_field_problems(self) -> list[ConfigProblem]:
        """Problems between fields that do not depend on the world size (paths relative to the section)."""
        problems: list[ConfigProblem] = token_budget_problems(self)
        if self.max_micro_batch_per_gpu is not None:
            problems += memory_problems(self.max_micro_batch_per_gpu, self.memory)
        problems += live_elastic_problems(self.live_elastic)
        lo, hi, g = self.min_global_batch, self.max_global_batch, self.granularity
        bounds_ordered = lo is None or hi is None or lo <= hi
        if not bounds_ordered:
            problems.append(
                ConfigProblem(
                    "min_global_batch",
                    f"is larger than max_global_batch ({hi}): make min_global_batch <= max_global_batch",
                    lo,
                )
            )
        problems += endpoint_problems(self.schedule.endpoint_batches(None), lo, hi, g)
        if bounds_ordered and hi is not None and -(-(lo or 1) // g) * g > hi:
            # Only the granularity restricts the batch here; the loader repeats this check with the
            # world size (ds_adabatch.plan.feasible_range) once it is known.
            problems.append(
                ConfigProblem(
                    "max_global_batch",
                    f"no multiple of granularity ({g}) lies between min_global_batch ({lo}) and "
                    f"max_global_batch ({hi}): widen the bounds or change granularity",
                    hi,
                )
            )
        scaling = self.lr_scaling
        if (
            scaling.reference_batch is not None
            and scaling.rule == "none"
            and self.lr_schedule_unit == "steps"
        ):
            problems.append(
                ConfigProblem(
                    "lr_scaling.reference_batch",
                    "has no effect with lr_scaling.rule 'none' and lr_schedule_unit 'steps': set rule to "
                    "'linear' or 'sqrt', set lr_schedule_unit to 'samples', or remove reference_batch",
                    scaling.reference_batch,
                )
            )
        default_power = LrScalingConfig.model_fields["gain_power"].default
        if scaling.gain_power != default_power and scaling.rule != "adascale":
            problems.append(
                ConfigProblem(
                    "lr_scaling.gain_power",
                    f"has no effect with lr_scaling.rule {scaling.rule!r} (it is the power of AdaScale's "
                    "gain): set rule to 'adascale', or remove gain_power",
                    scaling.gain_power,
                )
            )
        if scaling.rule == "adascale" and not measures_noise(self.schedule):
            problems.append(
                ConfigProblem(
                    "lr_scaling.rule",
                    f"'adascale' reads the gradient-noise scale, which the {self.schedule.type!r} schedule "
                    "does not measure: use schedule type 'goodput' or 'gradient_noise', or rule 'sqrt' "
                    "(Adam-type optimizers) or 'linear' (SGD)",
                    scaling.rule,
                )
            )
        problems += _seesaw_problems(self)
        section_problems = getattr(self.schedule, "section_problems", None)  # e.g. goodput's
        if section_problems is not None:
            problems += [
                ConfigProblem(path, message, value) for path, message, value in section_problems(self)
            ]
        return problems


def _seesaw_problems(cfg: AdaBatchConfig) -> list[ConfigProblem]:
    """The LR settings the ``seesaw`` schedule needs (its rule is stated in LR and samples)."""
    schedule = cfg.schedule
    if schedule.type != "seesaw":
        return []
    problems = []
    if cfg.lr_schedule_unit != "samples":
        problems.append(
            ConfigProblem(
                "lr_schedule_unit",
                "must be 'samples' with the seesaw schedule: it reads the base LR as a function of "
                "samples consumed, which only a samples-keyed LR schedule is",
                cfg.lr_schedule_unit,
            )
        )
    if cfg.lr_scaling.rule == "none":
        problems.append(
            ConfigProblem(
                "lr_scaling.rule",
                "must be 'sqrt' (Adam-type optimizers, the seesaw rule) or 'linear' (plain SGD) with the "
                "seesaw schedule: with 'none' the LR would decay on top of the batch growth",
                cfg.lr_scaling.rule,
            )
        )
    ref = cfg.lr_scaling.reference_batch
    if ref is not None and ref != schedule.start:
        problems.append(
            ConfigProblem(
                "lr_scaling.reference_batch",
                f"must equal schedule.start ({schedule.start}) with the seesaw schedule (the base LR is "
                "the LR at the starting batch): set it to the start or remove it",
                ref,
            )
        )
    return problems


def token_budget_problems(cfg: AdaBatchConfig) -> list[ConfigProblem]:
    """Problems of the token-budget keys (paths relative to the ``"adabatch"`` section)."""
    problems: list[ConfigProblem] = []
    tokens = cfg.micro_batch_tokens
    if tokens is None and cfg.max_micro_batch_per_gpu is None:
        problems.append(
            ConfigProblem(
                "max_micro_batch_per_gpu",
                "is required: set it (samples per forward pass, or 'auto'), or set micro_batch_tokens "
                "(tokens per forward pass)",
                None,
            )
        )
    if tokens is not None and cfg.max_micro_batch_per_gpu == AUTO:
        problems.append(
            ConfigProblem(
                "max_micro_batch_per_gpu",
                "'auto' does not combine with micro_batch_tokens: the token budget bounds the "
                "micro-batch; remove max_micro_batch_per_gpu or give it an integer",
                AUTO,
            )
        )
    if cfg.schedule.batch_unit == "tokens" and cfg.lr_schedule_unit == "samples":
        problems.append(
            ConfigProblem(
                "lr_schedule_unit",
                "'samples' advances the LR scheduler per reference_batch samples, but this schedule's "
                "batch is in tokens: use 'steps'",
                "samples",
            )
        )
    if tokens is None:
        for key, default in (
            ("padding", "pad_to_longest"),
            ("bucket_window", 0),
            ("truncate_long_samples", False),
        ):
            if getattr(cfg, key) != default:
                problems.append(
                    ConfigProblem(
                        key,
                        "only applies with micro_batch_tokens: set micro_batch_tokens or remove it",
                        getattr(cfg, key),
                    )
                )
        if cfg.schedule.batch_unit == "tokens":
            problems.append(
                ConfigProblem(
                    "schedule.unit",
                    "'tokens' needs micro_batch_tokens (a token budget per forward pass): set "
                    "adabatch.micro_batch_tokens, or use unit 'samples'",
                    "tokens",
                )
            )
    return problems


def endpoint_problems(
    endpoints: list[tuple[str, int]], lo: int | None, hi: int | None, granularity: int
) -> list[ConfigProblem]:
    """Schedule values (``(field, global batch)`` pairs) outside the bounds or off the granularity.

    Paths are ``schedule.<field>``, relative to the ``"adabatch"`` section.
    """
    problems: list[ConfigProblem] = []
    for name, value in endpoints:
        path = f"schedule.{name}"
        if lo is not None and value < lo:
            problems.append(
                ConfigProblem(
                    path,
                    f"is below min_global_batch ({lo}): raise it to at least {lo} or lower min_global_batch",
                    value,
                )
            )
        if hi is not None and value > hi:
            problems.append(
                ConfigProblem(
                    path,
                    f"is above max_global_batch ({hi}): lower it to at most {hi} or raise max_global_batch",
                    value,
                )
            )
        if value % granularity:
            below, above = (value // granularity) * granularity, (value // granularity + 1) * granularity
            valid = f"{below} or {above}" if below else str(above)
            problems.append(
                ConfigProblem(path, f"is not a multiple of granularity ({granularity}): use {valid}", value)
            )
    return problems

"""Read a full ds_config, validate its ``"adabatch"`` section, and prepare the dict for DeepSpeed.

Every problem, from a missing file to a schedule that cannot be planned on the given world size, is
reported through one :class:`ConfigError` that lists all of them with dotted paths. Validation runs in
two stages because the runtime knows the world size only after the process group exists:
``load_ds_config(path)`` checks everything that does not depend on it, and
``LoadedConfig.with_world_size(n)`` adds the plan and the checks that do.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..plan import (
    BatchPlan,
    PlanError,
    batch_multiple,
    feasible_range,
    nearest_plannable,
    plan_batch,
    round_global_batch,
)
from ._pydantic import problems_from_validation_error
from .errors import ConfigError, ConfigProblem
from .models import AdaBatchConfig, endpoint_problems

__all__ = [
    "BATCH_KEYS",
    "SECTION",
    "LoadedConfig",
    "load_adabatch_section",
    "load_ds_config",
    "optimizer_geometry",
]

SECTION = "adabatch"
"""The top-level ds_config key that holds the :class:`AdaBatchConfig`."""

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed's batch keys; ds_adabatch owns them and fills them from the plan."""


@dataclass(frozen=True)
class LoadedConfig:
    """A validated ds_config, split into what DeepSpeed gets and what ds_adabatch uses."""

    deepspeed: dict[str, Any]
    """A new dict for ``deepspeed.initialize(config=...)``: the ds_config without ``"adabatch"``. With a
    world size its three batch keys hold the initial plan's shape (``BatchPlan.deepspeed_batch_keys``);
    without one they are left as written (possibly ``"auto"``, which DeepSpeed alone cannot resolve)."""
    adabatch: AdaBatchConfig
    """The parsed ``"adabatch"`` section."""
    plan: BatchPlan | None
    """The plan of the first optimizer step; None until a world size is given."""
    source: str
    """Where the config came from, for messages (a file path or ``"ds_config dict"``)."""
    original: dict[str, Any] = field(repr=False, compare=False)
    """The ds_config as read, ``"adabatch"`` and user-written batch keys included."""

    def honouring_deepspeed_drop_last(self) -> LoadedConfig:
        """The config with DeepSpeed's own top-level ``dataloader_drop_last`` applied to the sample stream,
        as it would apply to DeepSpeed's loader, where ``adabatch.data.drop_last`` is not set
        (``ds_adabatch.initialize``; the Trainer has ``TrainingArguments.dataloader_drop_last``).

        Raises:
            ConfigError: both are set and disagree.
        """
        value = self.original.get("dataloader_drop_last")
        data = self.original[SECTION].get("data")
        if not isinstance(value, bool):  # absent (DeepSpeed's default, False), or DeepSpeed refuses it
            return self
        if isinstance(data, Mapping) and "drop_last" in data:
            if data["drop_last"] == value:
                return self
            raise ConfigError.single(
                "dataloader_drop_last",
                f"disagrees with adabatch.data.drop_last ({data['drop_last']}): set one of them, or both alike",
                value,
                source=self.source,
            )
        original = copy.deepcopy(self.original)
        section = original[SECTION]
        section["data"] = {**(data if isinstance(data, Mapping) else {}), "drop_last": value}
        return _validate(original, self.source, self.world_size)

    @property
    def world_size(self) -> int | None:
        """Data-parallel ranks the plan was made for; None without a world size."""
        return None if self.plan is None else self.plan.world_size

    def with_world_size(self, world_size: int, *, rounds: bool = False) -> LoadedConfig:
        """The same config planned for ``world_size`` ranks (re-running every check that needs it).

        ``rounds``: the world is not one the config was chosen for (the survivors of a live recovery): a
        schedule batch that is not plannable on it is no error, the first one is rounded to the nearest
        plannable batch (as the controller rounds every later one) and DeepSpeed's batch keys, written
        for the first world, are replaced by the plan's.

        Raises:
            ConfigError: the schedule cannot be planned on ``world_size`` ranks, or DeepSpeed's batch
                keys disagree with the plan (without ``rounds``); the bounds admit no batch on it.
        """
        return _validate(self.original, self.source, world_size, rounds=rounds)


def load_ds_config(
    source: str | os.PathLike[str] | Mapping[str, Any], *, world_size: int | None = None
) -> LoadedConfig:
    """Load and validate a full ds_config that holds an ``"adabatch"`` section.

    Args:
        source: path of a JSON file, or the ds_config as a dict (not modified).
        world_size: data-parallel ranks. When given, the initial plan is made, every schedule endpoint
            must be plannable, and DeepSpeed's batch keys are filled in; when None, only the checks
            that do not need it run (call :meth:`LoadedConfig.with_world_size` later).

    DeepSpeed's ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
    ``gradient_accumulation_steps`` may be absent or ``"auto"``. A number must agree with the initial
    plan: ``train_batch_size`` may be the schedule's initial global batch (the real samples per step)
    or, for an uneven plan, the padded shape DeepSpeed sees (micro x GAS x world); the other two must
    equal the plan's. Without a world size only ``train_batch_size`` (even plans) and the
    micro-batch's upper bound can be checked.

    Raises:
        ConfigError: listing every problem found, each with its dotted path (``adabatch.schedule.start``).
    """
    _check_world_size(world_size)
    raw, name = _read(source)
    return _validate(raw, name, world_size)


def load_adabatch_section(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    world_size: int | None = None,
    schedule: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Load and validate an ``"adabatch"`` section given on its own (or a ds_config that holds one).

    For callers that take the section without a DeepSpeed config (the Hugging Face Trainer's
    ``adabatch_config=``). The checks, messages and dotted paths are those of :func:`load_ds_config`.

    Args:
        source: the section as a dict or the path of a JSON file holding it; a dict or file with a
            top-level ``"adabatch"`` key is read as a whole ds_config instead.
        world_size: as for :func:`load_ds_config`.
        schedule: a schedule to validate the section with when it has none (the caller supplies the
            schedule some other way, e.g. as a Python function); None: a missing schedule is a problem.

    Raises:
        ConfigError: listing every problem found, each with its dotted path.
    """
    _check_world_size(world_size)
    raw, name = _read(source)
    if isinstance(source, Mapping):
        name = "adabatch section dict"
    if isinstance(raw, Mapping) and SECTION not in raw:
        raw = {SECTION: dict(raw)}
    section = raw.get(SECTION) if isinstance(raw, Mapping) else None
    if schedule is not None and isinstance(section, Mapping) and "schedule" not in section:
        raw = {**raw, SECTION: {**section, "schedule": dict(schedule)}}
    return _validate(raw, name, world_size)


def _check_world_size(world_size: object) -> None:
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        raise ConfigError.single(
            "world_size", "must be an integer >= 1 (the number of data-parallel ranks)", world_size
        )


def _read(source: object) -> tuple[object, str]:
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), "ds_config dict"
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError.single(
            "", f"expected a path to a ds_config JSON file or a dict, got {type(source).__name__}"
        )
    path = Path(source)
    name = str(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError.single("", "file not found: check the path", source=name) from None
    except IsADirectoryError:
        raise ConfigError.single("", "is a directory, expected a ds_config JSON file", source=name) from None
    except UnicodeDecodeError as err:
        raise ConfigError.single("", f"is not UTF-8 text ({err.reason})", source=name) from None
    except OSError as err:
        raise ConfigError.single("", f"cannot be read: {err.strerror or err}", source=name) from None
    duplicates: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # DeepSpeed refuses duplicate keys too (dict_raise_error_on_duplicate_keys); report all of them.
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                duplicates.append(key)
            out[key] = value
        return out

    try:
        raw = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as err:
        # DeepSpeed 0.19.8 reads config files as hjson (comments, unquoted keys); accept what it accepts.
        raw = _read_hjson(text, no_duplicates)
        if raw is None:
            raise ConfigError.single(
                "", f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}", source=name
            ) from None
    if duplicates:
        raise ConfigError(
            [ConfigProblem("", f"duplicate key {key!r} in a JSON object: keep one") for key in duplicates],
            source=name,
        )
    return raw, name


def _read_hjson(text: str, hook: Any) -> object | None:
    try:
        import hjson  # a DeepSpeed dependency
    except ImportError:  # pragma: no cover
        return None
    try:
        # hjson returns its own ordered dicts; plain dicts keep the rest of the loader uniform.
        return json.loads(json.dumps(hjson.loads(text, object_pairs_hook=hook)))
    except (hjson.HjsonDecodeError, ValueError, TypeError):
        return None


def _validate(raw: object, name: str, world_size: int | None, *, rounds: bool = False) -> LoadedConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError.single(
            "", f"the top level must be a JSON object (a ds_config), got {_json_kind(raw)}", source=name
        )
    problems: list[ConfigProblem] = []
    if "elasticity" in raw:
        problems.append(
            ConfigProblem(
                "elasticity",
                "DeepSpeed 0.19.8 removed the elasticity section and rejects a config that has one: remove "
                "it. To find global batch sizes that split evenly on many GPU counts, run "
                "`ds-adabatch elastic --max-batch B --world-sizes 1-16 --max-micro M`",
            )
        )
    cfg: AdaBatchConfig | None = None
    if SECTION not in raw:
        problems.append(
            ConfigProblem(
                SECTION,
                'is missing: add an "adabatch" section, e.g. "adabatch": {"schedule": {"type": "constant", '
                '"value": 32}, "max_micro_batch_per_gpu": 8} (`ds-adabatch schema` lists every key)',
            )
        )
    else:
        cfg, section_problems = _validate_section(raw[SECTION])
        problems += section_problems
    problems += _batch_key_type_problems(raw)
    problems += [
        ConfigProblem(
            key,
            f'is a key of the "{SECTION}" section, not of DeepSpeed (which ignores it at the top level): '
            f'move it inside "{SECTION}"',
        )
        for key in raw
        if key in AdaBatchConfig.model_fields
    ]

    plan: BatchPlan | None = None
    if cfg is not None:
        if world_size is not None:
            plan, plan_problems = (
                _rounded_plan(cfg, world_size) if rounds else _plan_problems(cfg, world_size)
            )
            problems += plan_problems
        if not rounds:
            problems += _batch_key_agreement_problems(raw, cfg, plan)
        problems += _geometry_problems(raw, cfg)
    if problems:
        raise ConfigError(problems, source=name)
    assert cfg is not None  # invariant: a missing or invalid section added a problem above

    deepspeed = {key: copy.deepcopy(value) for key, value in raw.items() if key != SECTION}
    if plan is not None:
        deepspeed.update(plan.deepspeed_batch_keys())
    return LoadedConfig(deepspeed, cfg, plan, name, copy.deepcopy(dict(raw)))


_NO_SECOND_MOMENT = frozenset({"sgd", "musgd", "adagrad", "lion"})
"""DeepSpeed's optimizer types that keep no Adam second moment (no betas and eps in their groups)."""


def optimizer_geometry(raw: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(type, geometry)`` of the optimizer a ds_config names: ``"sgd"`` for one that keeps no Adam
    second moment, else ``"adam"`` (what ``geometry: "auto"`` resolves to); None where it names none
    (a client optimizer: resolved at run time)."""
    optimizer = raw.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, Mapping) else None
    if not isinstance(kind, str):
        return None
    return kind, "sgd" if kind.lower() in _NO_SECOND_MOMENT else "adam"


def _geometry_problems(raw: Mapping[str, Any], cfg: AdaBatchConfig) -> list[ConfigProblem]:
    """A noise scale asked in Adam's geometry of an optimizer the ds_config names and that keeps no
    second moment: refused here, before any process starts, as ``initialize`` would refuse it."""
    named = optimizer_geometry(raw)
    if getattr(cfg.schedule, "geometry", None) != "adam" or named is None or named[1] != "sgd":
        return []
    kind = named[0]
    message = (
        f"measures the noise scale with Adam's second moment, but the ds_config's optimizer {kind} keeps "
        'none: set it to "sgd" (or "auto") or train with an Adam-type optimizer'
    )
    return [ConfigProblem(f"{SECTION}.schedule.geometry", message, "adam")]


def _validate_section(section: object) -> tuple[AdaBatchConfig | None, list[ConfigProblem]]:
    try:
        return _model_validate(section), []
    except ValidationError as err:
        problems = problems_from_validation_error(err, section, SECTION, AdaBatchConfig)
        errors = err.errors(include_url=False)
    # pydantic runs the cross-field checks only when every field is valid. To still list them next to
    # field errors, validate again without the broken keys (optional ones fall back to defaults). A
    # broken schedule is replaced by a stand-in whose own findings are dropped, so that the checks
    # between the other fields (min <= max, lr_scaling) still run.
    broken = {e["loc"][0] for e in errors if e["loc"]}
    if not broken or not isinstance(section, Mapping):
        return None, problems
    probe = {key: value for key, value in section.items() if key not in broken}
    stand_in = "schedule" not in probe
    if stand_in:
        probe["schedule"] = {"type": "constant", "value": 1}
    probe.setdefault("max_micro_batch_per_gpu", 1)
    try:
        _model_validate(probe)
    except ValidationError as probe_err:
        seen = {(p.path, p.message) for p in problems}
        for extra in problems_from_validation_error(probe_err, probe, SECTION, AdaBatchConfig):
            about_stand_in = stand_in and extra.path.startswith(f"{SECTION}.schedule")
            # A key already reported broken is absent from the probe: what its absence says is not news.
            about_broken = any(f"{extra.path}.".startswith(f"{SECTION}.{key}.") for key in broken)
            if (extra.path, extra.message) not in seen and not about_stand_in and not about_broken:
                problems.append(extra)
    return None, problems


def _model_validate(section: object) -> AdaBatchConfig:
    # JSON mode: strict about numbers and booleans, yet accepts JSON arrays where a model wants a tuple.
    try:
        text = json.dumps(section)
    except (TypeError, ValueError):
        return AdaBatchConfig.model_validate(section, strict=True)
    return AdaBatchConfig.model_validate_json(text, strict=True)


def _plan_problems(cfg: AdaBatchConfig, world_size: int) -> tuple[BatchPlan | None, list[ConfigProblem]]:
    problems: list[ConfigProblem] = []
    try:
        feasible_range(
            world_size,
            granularity=cfg.granularity,
            min_global_batch=cfg.min_global_batch,
            max_global_batch=cfg.max_global_batch,
            allow_uneven=cfg.allow_uneven or cfg.token_budget,
        )
    except PlanError as err:
        problems.append(ConfigProblem(f"{SECTION}.max_global_batch", str(err), cfg.max_global_batch))
    endpoints = list(cfg.schedule.endpoint_batches(world_size))
    initial = cfg.schedule.initial_batch(world_size)
    if initial is None:
        problems.append(
            ConfigProblem(f"{SECTION}.schedule", f"gives no initial global batch for world size {world_size}")
        )
    elif all(value != initial for _, value in endpoints):
        endpoints.append(("", initial))
    # Values that only exist with a world size (per-device schedules) were not seen by the model checks.
    static = set(cfg.schedule.endpoint_batches(None))
    fresh = [(name, value) for name, value in endpoints if (name, value) not in static]
    for problem in endpoint_problems(fresh, cfg.min_global_batch, cfg.max_global_batch, cfg.granularity):
        path = f"{SECTION}.{problem.path}".rstrip(".")
        message = f"as a global batch on {world_size} ranks, {problem.message}"
        problems.append(dataclasses.replace(problem, path=path, message=message))

    plan: BatchPlan | None = None
    for name, value in endpoints:
        path = f"{SECTION}.schedule" + (f".{name}" if name else "")
        try:
            # With a token budget the step former packs a step's samples (a token target, or a sample
            # count) into passes, not plan_batch: its nominal plan only has to exist.
            uneven = cfg.allow_uneven or cfg.token_budget
            candidate = plan_batch(value, world_size, cfg.initial_micro_batch_limit, allow_uneven=uneven)
        except PlanError as err:
            message = f"cannot be planned on {world_size} ranks: {err}"
            if (
                value % world_size
                and not cfg.allow_uneven
                and (cfg.granularity > 1 or cfg.min_global_batch or cfg.max_global_batch)
            ):
                message = _uneven_message(value, world_size, cfg) or message
            problems.append(ConfigProblem(path, message, value))
            continue
        if value == initial and plan is None:
            plan = candidate
    return plan, problems


def _rounded_plan(cfg: AdaBatchConfig, world_size: int) -> tuple[BatchPlan | None, list[ConfigProblem]]:
    """The first plan on a world the config was not chosen for: the schedule's first batch rounded to the
    nearest plannable one there (a problem only where the bounds admit none)."""
    uneven = cfg.allow_uneven or cfg.token_budget
    bounds = {
        "granularity": cfg.granularity,
        "min_global_batch": cfg.min_global_batch,
        "max_global_batch": cfg.max_global_batch,
        "allow_uneven": uneven,
    }
    initial = cfg.schedule.initial_batch(world_size)
    try:
        if initial is None:
            raise PlanError(f"the schedule gives no initial global batch for world size {world_size}")
        batch = initial if cfg.token_budget else round_global_batch(initial, world_size, **bounds)
        return plan_batch(batch, world_size, cfg.initial_micro_batch_limit, allow_uneven=uneven), []
    except PlanError as err:
        return None, [ConfigProblem(f"{SECTION}.schedule", f"on {world_size} ranks: {err}", initial)]


def _uneven_message(value: int, world_size: int, cfg: AdaBatchConfig) -> str | None:
    """Why ``value`` cannot be split evenly, naming the plannable batches next to it under the section's
    granularity and bounds (None where the bounds admit none: that is reported on its own)."""
    try:
        near = nearest_plannable(
            value,
            world_size,
            granularity=cfg.granularity,
            min_global_batch=cfg.min_global_batch,
            max_global_batch=cfg.max_global_batch,
        )
    except PlanError:
        return None
    step = batch_multiple(world_size, cfg.granularity)
    return (
        f"cannot be planned on {world_size} ranks: global batch {value} does not split evenly over "
        f"{world_size} ranks; the nearest plannable global batches are {', '.join(map(str, near))} "
        f"(multiples of {step}, the least common multiple of granularity {cfg.granularity} and the world "
        f"size, within the bounds), or set allow_uneven to split {value} unevenly"
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _batch_key_type_problems(raw: Mapping[str, Any]) -> list[ConfigProblem]:
    return [
        ConfigProblem(
            key,
            'must be a positive integer or "auto"; ds_adabatch fills it from the plan, so it can also be removed',
            raw[key],
        )
        for key in BATCH_KEYS
        if key in raw and raw[key] != "auto" and not _is_count(raw[key])
    ]


def _batch_key_agreement_problems(
    raw: Mapping[str, Any], cfg: AdaBatchConfig, plan: BatchPlan | None
) -> list[ConfigProblem]:
    """DeepSpeed's batch keys, where the user wrote numbers, against the initial plan."""
    problems: list[ConfigProblem] = []
    given = {key: raw[key] for key in BATCH_KEYS if _is_count(raw.get(key))}
    if cfg.token_budget:
        # Every step is cut anew by its samples' lengths: no number of samples per pass or of passes holds.
        return [
            ConfigProblem(
                key,
                "cannot be a number with adabatch.micro_batch_tokens: each step's passes are cut by its "
                "samples' lengths, so ds_adabatch sets the batch keys at every step; remove it or set it "
                'to "auto" (the token target is the schedule\'s, the pass budget micro_batch_tokens)',
                value,
            )
            for key, value in given.items()
        ]
    if plan is None:
        initial = cfg.schedule.initial_batch(None)
        tbs = given.get("train_batch_size")
        # An uneven plan's padded train_batch_size depends on the world size: checked once it is known.
        if tbs is not None and initial is not None and not cfg.allow_uneven and tbs != initial:
            problems.append(
                _mismatch("train_batch_size", tbs, f"the adabatch schedule starts at {initial}", str(initial))
            )
        micro = given.get("train_micro_batch_size_per_gpu")
        if micro is not None and micro > cfg.micro_batch_limit:
            problems.append(
                _mismatch(
                    "train_micro_batch_size_per_gpu",
                    micro,
                    f"adabatch.max_micro_batch_per_gpu is {cfg.max_micro_batch_per_gpu} and ds_adabatch picks "
                    "the micro-batch",
                    None,
                )
            )
        return problems

    keys = plan.deepspeed_batch_keys()
    shape = plan.describe()
    tbs = given.get("train_batch_size")
    if tbs is not None and tbs not in (plan.global_batch_size, keys["train_batch_size"]):
        valid = str(plan.global_batch_size)
        if keys["train_batch_size"] != plan.global_batch_size:
            valid += f" (real samples) or {keys['train_batch_size']} (the padded shape DeepSpeed runs)"
        problems.append(
            _mismatch(
                "train_batch_size",
                tbs,
                f"the adabatch schedule starts at {plan.global_batch_size} ({shape})",
                valid,
            )
        )
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = given.get(key)
        if value is not None and value != keys[key]:
            hint = "; to cap the micro-batch set adabatch.max_micro_batch_per_gpu" if "micro" in key else ""
            problems.append(
                _mismatch(
                    key, value, f"the initial plan has {key} = {keys[key]} ({shape})", str(keys[key]), hint
                )
            )
    return problems


def _mismatch(key: str, value: int, reason: str, valid: str | None, hint: str = "") -> ConfigProblem:
    fix = f'remove it, set it to "auto", or set it to {valid}' if valid else 'remove it or set it to "auto"'
    return ConfigProblem(key, f"{reason}: {fix}{hint}", value)


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return type(value).__name__

"""Turn a pydantic ``ValidationError`` into :class:`ConfigProblem` s a user can act on.

pydantic's locations contain the tag of a discriminated union (``('schedule', 'linear', 'start')``)
and its messages speak of "inputs"; a ds_config user wants the path as written in the JSON
(``adabatch.schedule.start``), the value, and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, ConfigProblem

__all__ = ["dotted_path", "problems_from_validation_error"]

_NO_VALUE_TYPES = {"missing", "union_tag_not_found"}


def problems_from_validation_error(
    err: ValidationError, data: object, prefix: str, root: type[BaseModel]
) -> list[ConfigProblem]:
    """One problem per pydantic error of validating ``data`` as ``root``; paths start with ``prefix``."""
    problems: list[ConfigProblem] = []
    for error in err.errors(include_url=False):
        parts = _document_path(error["loc"], data)
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            # Raised by a model validator: its paths are relative to the model that raised it.
            base = dotted_path([prefix, *parts])
            for problem in cause.problems:
                path = f"{base}.{problem.path}" if problem.path else base
                problems.append(dataclasses.replace(problem, path=path))
            continue
        kind = error["type"]
        message = _message(error, parts, data, root)
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            parts = [*parts, _discriminator(error)]
        path = dotted_path([prefix, *parts])
        if kind in _NO_VALUE_TYPES:
            problems.append(ConfigProblem(path, message))
        else:
            value = error["input"]
            if kind in ("union_tag_invalid",):
                value = (error.get("ctx") or {}).get("tag", value)
            problems.append(ConfigProblem(path, message, value))
    return problems


def dotted_path(parts: Sequence[str | int]) -> str:
    """``['adabatch', 'schedule', 'points', 2]`` -> ``'adabatch.schedule.points[2]'``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "":
            out += f".{part}" if out else part
    return out


def _document_path(loc: tuple[str | int, ...], data: object) -> list[str | int]:
    """Drop the location entries pydantic adds that are not keys of the document (union tags)."""
    parts: list[str | int] = []
    node = data
    for elem in loc:
        if (
            isinstance(elem, str)
            and isinstance(node, Mapping)
            and elem not in node
            and node.get("type") == elem
        ):
            continue  # the tag of a discriminated union, e.g. 'linear' in ('schedule', 'linear', 'start')
        if isinstance(elem, str) and node is not None and not isinstance(node, Mapping):
            continue  # the member label of a plain union (e.g. 'int'), not a key of the document
        parts.append(elem)
        if isinstance(node, Mapping):
            node = node.get(elem)
        elif isinstance(node, list) and isinstance(elem, int) and 0 <= elem < len(node):
            node = node[elem]
        else:
            node = None
    return parts


_DEEPSPEED_KEYS = frozenset(
    {
        "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "checkpoint", "comms_logger",
        "communication_data_type", "compile", "csv_monitor", "data_types", "dataloader_drop_last", "fp16",
        "flops_profiler", "gradient_accumulation_steps", "gradient_clipping", "gradient_predivide_factor",
        "memory_breakdown", "optimizer", "pipeline", "prescale_gradients", "scheduler", "steps_per_print",
        "tensor_parallel", "tensorboard", "train_batch_size", "train_micro_batch_size_per_gpu",
        "wall_clock_breakdown", "wandb", "zero_allow_untested_optimizer", "zero_optimization",
    }
)  # fmt: skip
"""Top-level keys of DeepSpeed's ds_config (0.19.8): written inside the section, they are misplaced."""


def _message(error: Any, parts: list[str | int], data: object, root: type[BaseModel] | None) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "missing":
        model = _model_at(root, parts[:-1], data)
        described = _field_description(model, parts[-1]) if parts else None
        if not described:
            return "is required"
        if not described[1:2].isupper():  # keep acronyms such as "LR" intact
            described = described[:1].lower() + described[1:]
        return f"is required: {described}"
    if kind == "extra_forbidden":
        model = _model_at(root, parts[:-1], data)
        if model is None:
            return "is not a known key: remove it"
        valid = sorted(model.model_fields)
        if parts[-1] == "unit" and "type" in valid:  # a schedule whose batch counts samples only
            return (
                "is not a key of this schedule: it counts its global batch in samples (with "
                "micro_batch_tokens, each step's samples are packed into passes of the token budget); "
                "unit 'tokens' is for the constant, linear, step and piecewise schedules: remove it"
            )
        if len(parts) == 1 and parts[0] in _DEEPSPEED_KEYS:
            return "is a DeepSpeed key, not one of this section: move it to the top level of the ds_config"
        close = difflib.get_close_matches(str(parts[-1]), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"is not a known key: {hint}valid keys here are {', '.join(valid)}"
    if kind == "union_tag_invalid":
        return f"is not a known type: use one of {ctx.get('expected_tags', '')}"
    if kind == "union_tag_not_found":
        tags = _tags_at(root, parts, data)
        return "is required" + (f": one of {', '.join(repr(t) for t in tags)}" if tags else "")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a JSON object"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing"):
        return "must be a number"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind == "string_type":
        return "must be a string"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '')}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if kind == "less_than_equal":
        return f"must be <= {ctx.get('le')}"
    if kind == "less_than":
        return f"must be < {ctx.get('lt')}"
    message = str(error.get("msg", "is invalid"))
    message = message.removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def _discriminator(error: Any) -> str:
    return str((error.get("ctx") or {}).get("discriminator", "'type'")).strip("'\"")


def _members(annotation: Any) -> list[type[BaseModel]]:
    """The model classes an annotation admits (unwrapping Optional, Union and Annotated)."""
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return [m for arg in get_args(annotation) for m in _members(arg)]
    if origin is not None and get_args(annotation) and hasattr(annotation, "__metadata__"):
        return _members(get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _tags(model: type[BaseModel]) -> tuple[Any, ...]:
    info = model.model_fields.get("type")
    if info is None or get_origin(info.annotation) is not Literal:
        return ()
    return get_args(info.annotation)


def _pick(models: list[type[BaseModel]], node: object) -> type[BaseModel] | None:
    if len(models) == 1:
        return models[0]
    tag = node.get("type") if isinstance(node, Mapping) else None
    return next((m for m in models if tag in _tags(m)), None)


def _candidates(root: type[BaseModel] | None, parts: list[str | int], data: object) -> list[type[BaseModel]]:
    """The model classes that may describe the object at ``parts`` (several for a union)."""
    if root is None:
        return []
    models: list[type[BaseModel]] = [root]
    node = data
    for part in parts:
        model = _pick(models, node)
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        models = _members(model.model_fields[part].annotation)
        node = node.get(part) if isinstance(node, Mapping) else None
    return models


def _model_at(root: type[BaseModel] | None, parts: list[str | int], data: object) -> type[BaseModel] | None:
    node: object = data
    for part in parts:
        node = node.get(part) if isinstance(node, Mapping) else None
    return _pick(_candidates(root, parts, data), node)


def _tags_at(root: type[BaseModel] | None, parts: list[str | int], data: object) -> list[Any]:
    return [tag for model in _candidates(root, parts, data) for tag in _tags(model)]


def _field_description(model: type[BaseModel] | None, name: str | int) -> str | None:
    if model is None or not isinstance(name, str) or name not in model.model_fields:
        return None
    return model.model_fields[name].description

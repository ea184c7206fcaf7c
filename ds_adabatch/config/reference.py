"""Render the reference page of the ``"adabatch"`` section (``docs/config.md``) from its pydantic models.

The page lists every key of the section as a dotted path (``adabatch.memory.recover_from_oom``) with its
JSON type, default, allowed values (``Literal`` choices and the bounds of ``Field`` constraints) and the
field's description. Nested models get a section of their own; the schedule, a union discriminated by
``type``, gets one section per schedule type. The models are walked in declaration order, so a field
added to a model appears on the page the next time it is generated.

Write or check the page::

    ds-adabatch config-docs --output docs/config.md
    ds-adabatch config-docs --check docs/config.md        # exit 1 when the page is stale
    python -m ds_adabatch.config.reference --check docs/config.md

The output depends only on the models: no timestamps, no absolute paths.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import re
import sys
import textwrap
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from .loader import BATCH_KEYS, SECTION, load_ds_config
from .models import AdaBatchConfig

__all__ = [
    "DEFAULT_PATH",
    "EXAMPLE",
    "REGENERATE",
    "add_arguments",
    "check_reference",
    "main",
    "render_reference",
    "run",
    "stale_message",
    "write_reference",
]

DEFAULT_PATH = "docs/config.md"
"""Where the page lives, relative to the repository root."""

REGENERATE = "ds-adabatch config-docs --output {path}"
"""The command that rewrites the page at ``{path}``."""

EXAMPLE: dict[str, Any] = {
    SECTION: {
        "schedule": {"type": "linear", "start": 16, "end": 64, "ramp_samples": 100000},
        "max_micro_batch_per_gpu": 8,
    }
}
"""The minimal ds_config shown at the top of the page (validated by :func:`render_reference`)."""

# What the loader does with DeepSpeed's top-level batch keys (ds_adabatch.config.loader.load_ds_config).
_BATCH_KEY_DOCS = {
    "train_batch_size": (
        "Samples per optimizer step as DeepSpeed sees them. A number must equal the schedule's initial "
        "global batch or, for an uneven plan, the padded shape DeepSpeed runs (micro-batch x "
        "gradient-accumulation steps x world size). Without a world size it is checked only for even "
        "plans."
    ),
    "train_micro_batch_size_per_gpu": (
        "Micro-batch per GPU. A number must equal the initial plan's micro-batch; without a world size "
        "it must not exceed the micro-batch limit (adabatch.max_micro_batch_per_gpu). To cap the "
        "micro-batch, set adabatch.max_micro_batch_per_gpu instead."
    ),
    "gradient_accumulation_steps": (
        "Gradient-accumulation steps. A number must equal the initial plan's; it is checked once the "
        "world size is known."
    ),
}


@dataclass(frozen=True)
class _Section:
    """One object of the section: its dotted path, model, and how the parent field declares it."""

    path: str
    model: type[BaseModel]
    heading: str
    field: FieldInfo | None
    union_of: tuple[type[BaseModel], ...] = ()


def render_reference() -> str:
    """The Markdown reference page of the ``"adabatch"`` section (ends with one newline)."""
    _check_example()
    sections = list(_sections(AdaBatchConfig, SECTION, None))
    out: list[str] = [
        '# The `"adabatch"` section: configuration reference',
        "",
        "This page is generated from the pydantic models in `ds_adabatch/config/` by "
        f"`{REGENERATE.format(path=DEFAULT_PATH)}`; edit the field descriptions in those models, not "
        "this file (`ds-adabatch config-docs --check docs/config.md` exits 1 when the page is stale). "
        'Every key of the `"adabatch"` section of a DeepSpeed ds_config is listed below as a dotted '
        "path, with its JSON type, default, allowed values and meaning. Values are typed strictly "
        '(`true` is not an integer, `"16"` is not a number) and unknown keys are errors. '
        "`ds-adabatch validate CONFIG` checks a ds_config; `ds-adabatch schema` prints the same "
        "models as JSON Schema.",
        "",
        "A minimal ds_config (the other DeepSpeed keys are written as DeepSpeed documents them):",
        "",
        "```json",
        json.dumps(EXAMPLE, indent=2),
        "```",
        "",
        "## Contents",
        "",
    ]
    for section in sections:
        out.append(f"- [{section.heading}](#{_slug(section.heading)})")
    out.append(f"- [{_DEEPSPEED_HEADING}](#{_slug(_DEEPSPEED_HEADING)})")
    out.append("")
    for section in sections:
        out += _render_section(section)
    out += _render_deepspeed_keys()
    return "\n".join(out).rstrip("\n") + "\n"


def stale_message(path: str | Path) -> str:
    """The sentence printed when the page at ``path`` is missing or differs from the models."""
    return f"{path} is stale: run `{REGENERATE.format(path=path)}`"


def check_reference(path: str | Path) -> str | None:
    """None when the file at ``path`` equals :func:`render_reference`, else :func:`stale_message`."""
    try:
        current = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return stale_message(path)
    return None if current == render_reference() else stale_message(path)


def write_reference(path: str | Path) -> None:
    """Write the page to ``path`` (UTF-8, ``\\n`` line ends), creating its folder if needed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(render_reference().encode("utf-8"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ds_adabatch.config.reference [--output PATH | --check PATH]``: 0 ok, 1 stale."""
    parser = argparse.ArgumentParser(
        prog="python -m ds_adabatch.config.reference",
        description='Write or check the Markdown reference of the "adabatch" section.',
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--output`` / ``--check`` options (shared by ``ds-adabatch config-docs``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--output", metavar="PATH", default=None, help="write the page to PATH (default: print it)"
    )
    group.add_argument(
        "--check", metavar="PATH", default=None, help="exit 1 if PATH differs from the generated page"
    )


def run(args: argparse.Namespace) -> int:
    """Carry out parsed ``--output`` / ``--check`` options; returns the exit status."""
    if args.check is not None:
        problem = check_reference(args.check)
        if problem is not None:
            print(problem, file=sys.stderr)
            return 1
        print(f"{args.check} is up to date")
        return 0
    if args.output is not None:
        write_reference(args.output)
        print(f"wrote {args.output}")
        return 0
    sys.stdout.write(render_reference())
    return 0


# Walking the models.


def _sections(model: type[BaseModel], path: str, field: FieldInfo | None) -> Iterator[_Section]:
    """``model`` at ``path`` and, depth first in declaration order, every object nested in it."""
    yield _Section(path, model, f"`{path}`", field)
    for name, info in model.model_fields.items():
        members = _model_members(info.annotation)
        child = f"{path}.{name}"
        if len(members) == 1:
            yield from _sections(members[0], child, info)
        elif members:
            yield _Section(child, members[0], f"`{child}`", info, union_of=tuple(members))
            for member in members:
                yield _Section(child, member, _member_heading(child, member), None)
                yield from list(_sections(member, child, None))[1:]


def _model_members(annotation: Any) -> list[type[BaseModel]]:
    """The model classes an annotation is made of (empty for a leaf value)."""
    annotation = _strip_annotated(annotation)
    if _is_union(annotation):
        return [m for arg in get_args(annotation) for m in _model_members(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _tag(model: type[BaseModel]) -> str:
    """The ``type`` value that selects ``model`` in a discriminated union."""
    info = model.model_fields.get("type")
    tags = get_args(info.annotation) if info is not None else ()
    return str(tags[0]) if tags else model.__name__


def _member_heading(path: str, member: type[BaseModel]) -> str:
    return f"`{path}` (type `{_tag(member)}`)"


def _leaf_fields(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    return [(n, f) for n, f in model.model_fields.items() if not _model_members(f.annotation)]


def _strip_annotated(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


# Rendering.

_DEEPSPEED_HEADING = "DeepSpeed keys the loader reads"


def _render_section(section: _Section) -> list[str]:
    out = [f"## {section.heading}", ""]
    if section.union_of:
        choices = ", ".join(
            f"[`{_tag(m)}`](#{_slug(_member_heading(section.path, m))})" for m in section.union_of
        )
        out += [
            f"- Type: object, one of the types below, chosen by `{_discriminator(section)}`",
            f"- Default: {_default_text(section.field)}",
            "",
        ]
        out += _paragraphs(_description(section.field))
        out += [f"Types: {choices}.", ""]
        return out
    if section.field is not None:  # a nested object with a model of its own
        out += [
            "- Type: object",
            f"- Default: {_default_text(section.field)}",
            "",
        ]
        out += _paragraphs(_description(section.field))
    model_doc = _model_doc(section.model)
    if model_doc.strip() != _description(section.field).strip():
        out += _paragraphs(model_doc)
    for name, info in _leaf_fields(section.model):
        out += _render_key(f"{section.path}.{name}", info, section.model, name)
    return out


def _render_key(path: str, info: FieldInfo, model: type[BaseModel], name: str) -> list[str]:
    out = [f"### `{path}`", "", f"- Type: {_type_text(info.annotation)}", f"- Default: {_default_text(info)}"]
    allowed = _allowed_text(info)
    if allowed:
        out.append(f"- Allowed values: {allowed}")
    out.append("")
    text = _field_description(model, name)
    out += _paragraphs(text or "*No description yet: document this field in its model.*")
    return out


def _render_deepspeed_keys() -> list[str]:
    missing = set(BATCH_KEYS) ^ set(_BATCH_KEY_DOCS)
    if missing:  # the loader's keys changed: this page must say what it does with them
        raise RuntimeError(f"document the DeepSpeed batch keys {sorted(missing)} in {__name__}")
    out = [
        f"## {_DEEPSPEED_HEADING}",
        "",
        'Top-level ds_config keys, outside the `"adabatch"` section, that `load_ds_config` checks. '
        "ds_adabatch owns DeepSpeed's batch keys: it removes the section, fills these three keys from the "
        "plan of the first optimizer step and passes the rest of the ds_config to "
        '`deepspeed.initialize` unchanged. Each may be absent, `"auto"`, or an integer >= 1 that agrees '
        "with that plan.",
        "",
    ]
    for key in BATCH_KEYS:
        out += [
            f"### `{key}`",
            "",
            '- Type: integer or string (`"auto"`)',
            "- Default: absent (filled from the plan)",
            '- Allowed values: integer >= 1 or `"auto"`',
            "",
            _BATCH_KEY_DOCS[key],
            "",
        ]
    out += [
        "### `elasticity`",
        "",
        "- Allowed values: none: the key must be absent",
        "",
        "DeepSpeed 0.19.8 removed the elasticity section and rejects a config that has one; the loader "
        "reports it as an error. `ds-adabatch elastic --max-batch B --world-sizes 1-16 --max-micro M` "
        "finds global batch sizes that split evenly on many GPU counts.",
        "",
    ]
    return out


def _discriminator(section: _Section) -> str:
    disc = section.field.discriminator if section.field is not None else None
    return disc if isinstance(disc, str) else "type"


def _default_text(info: FieldInfo | None) -> str:
    if info is None or info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "`{}` (every key below at its default)"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def _json_type(annotation: Any) -> str:
    annotation = _strip_annotated(annotation)
    origin = get_origin(annotation)
    if annotation is type(None) or annotation is None:
        return "null"
    if annotation is bool:
        return "boolean"
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if annotation is str:
        return "string"
    if annotation is Any:
        return "any JSON value"
    if origin is Literal:
        kinds = _unique(_json_type(type(v)) for v in get_args(annotation))
        return _join(kinds, "or")
    if origin in (list, tuple) or annotation in (list, tuple):
        args = get_args(annotation)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"array [{', '.join(_json_type(a) for a in args)}]"
        if not args:
            return "array"
        inner = _json_type(args[0])
        return f"array of {inner.removeprefix('array ') if inner.startswith('array [') else inner}"
    if origin is dict or annotation is dict:
        return "object"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return str(annotation)


def _type_text(annotation: Any) -> str:
    annotation = _strip_annotated(annotation)
    members = get_args(annotation) if _is_union(annotation) else (annotation,)
    return _join(_unique(_json_type(m) for m in members), "or")


def _allowed_text(info: FieldInfo) -> str:
    """Literal choices and numeric / length bounds; empty where any value of the type is allowed."""
    annotation = info.annotation
    members = list(get_args(annotation)) if _is_union(annotation) else [annotation]
    valued = [m for m in members if m is not type(None) and get_origin(m) is not Literal]
    several = len(members) > 1
    parts: list[str] = []
    constrained = False
    for member in members:
        if member is type(None):
            parts.append("`null`")
            continue
        if get_origin(member) is Literal:
            parts += [f"`{json.dumps(v)}`" for v in get_args(member)]
            constrained = True
            continue
        metadata = _metadata(member)
        if len(valued) == 1:
            metadata = [*info.metadata, *metadata]
        bounds = _bounds(_strip_annotated(member), metadata)
        constrained = constrained or bool(bounds)
        kind = _json_type(member)
        if bounds:
            joiner = " of " if bounds.startswith("at ") else " "
            parts.append(f"{kind}{joiner}{bounds}" if several else bounds)
        else:
            parts.append(f"any {kind}")
    return _join(parts, "or") if constrained else ""


def _metadata(annotation: Any) -> list[Any]:
    """The constraints attached by ``Annotated[..., Field(...)]`` (outermost first)."""
    out: list[Any] = []
    while get_origin(annotation) is Annotated:
        for item in annotation.__metadata__:
            out += item.metadata if isinstance(item, FieldInfo) else [item]
        annotation = get_args(annotation)[0]
    return out


_NUMERIC_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.MultipleOf, "multiple_of", "a multiple of"),
)
_LENGTH_BOUNDS = (
    (annotated_types.MinLen, "min_length", "at least"),
    (annotated_types.MaxLen, "max_length", "at most"),
)


def _bounds(annotation: Any, metadata: list[Any]) -> str:
    """``>= 1 and < 10``, ``at least 1 item; ...``: what ``metadata`` restricts ``annotation`` to."""
    numeric: list[str] = []
    lengths: list[str] = []
    unit = "character" if annotation is str else "item"
    for item in metadata:
        for kind, attr, words in _NUMERIC_BOUNDS:
            if isinstance(item, kind):
                numeric.append(f"{words} {getattr(item, attr)}")
        for kind, attr, words in _LENGTH_BOUNDS:
            if isinstance(item, kind):
                n = getattr(item, attr)
                lengths.append(f"{words} {n} {unit}{'s' if n != 1 else ''}")
    text = " and ".join(numeric + lengths)
    items = _item_bounds(annotation)
    if items:
        text = f"{text}; {items}" if text else items
    return text


def _item_bounds(annotation: Any) -> str:
    """The constraints of a list's items (``each item: [integer >= 0, integer >= 1]``)."""
    origin = get_origin(annotation)
    if origin is not list:
        return ""
    (item,) = get_args(annotation) or (Any,)
    item = _strip_annotated(item)
    if get_origin(item) is tuple:
        cells = []
        for arg in get_args(item):
            bounds = _bounds(_strip_annotated(arg), _metadata(arg))
            description = next(
                (m.description for m in getattr(arg, "__metadata__", ()) if isinstance(m, FieldInfo)), None
            )
            cell = f"{_json_type(arg)} {bounds}".strip()
            cells.append(f"{cell} ({description.rstrip('.')})" if description else cell)
        return f"each item an array [{', '.join(cells)}]"
    bounds = _bounds(item, [])
    return f"each item {bounds}" if bounds else ""


# Descriptions.


def _description(info: FieldInfo | None) -> str:
    return (info.description or "") if info is not None else ""


def _field_description(model: type[BaseModel], name: str) -> str:
    """``Field(description=...)``, else the attribute docstring (a string literal after the field)."""
    described = model.model_fields[name].description
    if described:
        return described
    for klass in model.__mro__:
        if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
            text = _attribute_docstrings(klass).get(name)
            if text:
                return text
    return ""


@functools.cache
def _attribute_docstrings(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def _model_doc(model: type[BaseModel]) -> str:
    """The model's docstring up to its first example or literal block, as Markdown paragraphs."""
    doc = inspect.getdoc(model) or ""
    if model.__doc__ is None or doc == inspect.getdoc(BaseModel):
        return ""
    kept: list[str] = []
    for paragraph in re.split(r"\n\s*\n", doc.strip()):
        lines = paragraph.splitlines()
        literal = paragraph.rstrip().endswith(("::", ":")) or any(line[:1].isspace() for line in lines)
        if literal:
            break
        kept.append(" ".join(line.strip() for line in lines))
    text = "\n\n".join(kept)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)  # Sphinx roles -> code
    text = text.replace("``", "`")
    if len(kept) < len(re.split(r"\n\s*\n", doc.strip())):
        text += f"\n\nMore, with examples, in the docstring of `{model.__module__}.{model.__qualname__}`."
    return text


def _paragraphs(text: str) -> list[str]:
    """``text`` as Markdown lines followed by a blank line (nothing for empty text)."""
    text = text.strip()
    return [*text.splitlines(), ""] if text else []


# Small helpers.


def _check_example() -> None:
    load_ds_config(EXAMPLE)  # a ConfigError here means EXAMPLE no longer matches the models


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _unique(items: Iterator[str] | list[str]) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _join(items: Sequence[str], word: str) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {word} {items[-1]}"


if __name__ == "__main__":
    sys.exit(main())

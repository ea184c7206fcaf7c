"""``docs/config.md``: generated from the ``"adabatch"`` models, complete, and checked for staleness."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from ds_adabatch.config import AdaBatchConfig, load_ds_config
from ds_adabatch.config.reference import render_reference

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config.md"
REGENERATE = "ds-adabatch config-docs --output docs/config.md"


def page_text() -> str:
    assert PAGE.is_file(), f"docs/config.md is missing: run `{REGENERATE}`"
    return PAGE.read_bytes().decode("utf-8")


def models_of(annotation) -> list[type[BaseModel]]:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in models_of(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def leaf_fields(model: type[BaseModel], path: str, heading: str):
    """``(section heading, dotted path, model, field name)`` of every non-object key, recursively."""
    for name, info in model.model_fields.items():
        members = models_of(info.annotation)
        child = f"{path}.{name}"
        if not members:
            yield heading, child, model, name
        elif len(members) == 1:
            yield from leaf_fields(members[0], child, f"`{child}`")
        else:  # a discriminated union: one section per tag
            for member in members:
                (tag,) = get_args(member.model_fields["type"].annotation)
                yield from leaf_fields(member, child, f"`{child}` (type `{tag}`)")


def sections(text: str) -> dict[str, str]:
    """Level-2 heading -> the text under it."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def entry(section: str, path: str) -> str:
    """The text of the ``### `path``` entry within one section."""
    match = re.search(rf"^### `{re.escape(path)}`\n(.*?)(?=^### |\Z)", section, re.MULTILINE | re.DOTALL)
    assert match, f"no entry for {path}"
    return match.group(1)


def test_page_is_up_to_date() -> None:
    assert page_text() == render_reference(), (
        f"docs/config.md is stale (the adabatch models changed): run `{REGENERATE}`"
    )


def test_every_leaf_field_is_listed_with_its_default_and_description() -> None:
    by_heading = sections(page_text())
    fields = list(leaf_fields(AdaBatchConfig, "adabatch", "`adabatch`"))
    assert len(fields) > 40  # every schedule type's keys included
    for heading, path, model, name in fields:
        assert heading in by_heading, f"no section {heading!r} for {path}"
        text = entry(by_heading[heading], path)
        info = model.model_fields[name]
        if info.is_required():
            expected = "- Default: required"
        else:
            expected = f"- Default: `{json.dumps(info.get_default(call_default_factory=True))}`"
        assert expected in text.splitlines(), f"{path} ({heading}): expected {expected!r} in\n{text}"
        assert "No description yet" not in text, (
            f"{model.__name__}.{name} has no description: give it Field(description=...) and run "
            f"`{REGENERATE}`"
        )


def test_schedule_types_and_nested_objects_have_sections() -> None:
    headings = set(sections(page_text()))
    assert {"`adabatch`", "`adabatch.schedule`", "`adabatch.memory`", "`adabatch.lr_scaling`"} <= headings
    for tag in ("constant", "linear", "step", "piecewise", "callable", "loss_plateau", "gradient_noise"):
        assert f"`adabatch.schedule` (type `{tag}`)" in headings


def test_allowed_values_show_choices_and_bounds() -> None:
    by_heading = sections(page_text())
    root = by_heading["`adabatch`"]
    assert '- Allowed values: integer >= 1, `"auto"` or `null`' in entry(
        root, "adabatch.max_micro_batch_per_gpu"
    )
    assert '- Allowed values: `"pad_to_longest"` or `"packed"`' in entry(root, "adabatch.padding")
    memory = entry(by_heading["`adabatch.memory`"], "adabatch.memory.peak_margin")
    assert "- Allowed values: >= 0.0 and < 1.0" in memory


def test_output_is_deterministic_and_portable() -> None:
    text = render_reference()
    assert text == render_reference()
    assert str(ROOT) not in text
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_example_block_validates() -> None:
    blocks = re.findall(r"```json\n(.*?)```", page_text(), re.DOTALL)
    assert blocks, "the page shows no JSON example"
    example = json.loads(blocks[0])
    loaded = load_ds_config(example, world_size=2)
    assert loaded.adabatch.schedule.type
    assert loaded.plan is not None


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.mark.parametrize("module", ["ds_adabatch.cli", None])
def test_check_flags_a_stale_copy(tmp_path: Path, module: str | None) -> None:
    stale = tmp_path / "config.md"
    changed = page_text().replace("- Default: `10`", "- Default: `11`", 1)
    assert changed != page_text()
    stale.write_text(changed, encoding="utf-8")
    if module is None:
        args = ["-m", "ds_adabatch.config.reference", "--check", str(stale)]
    else:
        args = ["-m", module, "config-docs", "--check", str(stale)]
    result = run_check(*args)
    assert result.returncode == 1, result.stderr
    assert f"{stale} is stale: run `ds-adabatch config-docs --output {stale}`" in result.stderr
    missing = run_check(*args[:-1], str(tmp_path / "absent.md"))
    assert missing.returncode == 1


def test_check_passes_on_the_real_page() -> None:
    result = run_check("-m", "ds_adabatch.cli", "config-docs", "--check", "docs/config.md")
    assert result.returncode == 0, result.stderr
    result = run_check("-m", "ds_adabatch.config.reference", "--check", "docs/config.md")
    assert result.returncode == 0, result.stderr


def test_config_docs_prints_or_writes_the_page(tmp_path: Path) -> None:
    printed = run_check("-m", "ds_adabatch.cli", "config-docs")
    assert printed.returncode == 0 and printed.stdout == render_reference()
    target = tmp_path / "out" / "config.md"
    written = run_check("-m", "ds_adabatch.cli", "config-docs", "--output", str(target))
    assert written.returncode == 0, written.stderr
    assert target.read_bytes().decode("utf-8") == render_reference()
    both = run_check("-m", "ds_adabatch.cli", "config-docs", "--output", "a.md", "--check", "b.md")
    assert both.returncode == 2 and "not allowed with" in both.stderr

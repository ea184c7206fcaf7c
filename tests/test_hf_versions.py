"""The transformers / accelerate releases the Trainer integration runs on: refused outside, with a sentence.

The range itself is exercised by CI, which runs the Trainer tests on the floor (transformers 4.57.6) and on
the newest release (``scripts/test_hf_floor.sh``); here, the refusals and that ``setup.py`` says the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402

from ds_adabatch.integrations.hf import versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "found, hint",
    [
        ("4.46.0", "4.57.6,<5"),
        ("4.57.5", "4.57.6,<5"),
        ("5.0.0", "5.18.0,<6"),
        ("5.3.0", "5.18.0,<6"),
        ("5.17.1", "5.18.0,<6"),
        ("6.0.0", "5.18.0,<6"),
    ],
)
def test_transformers_outside_the_range_is_one_sentence(found, hint):
    with pytest.raises(RuntimeError) as err:
        versions.check_versions(found, "1.15.0")
    msg = str(err.value)
    assert f"transformers {found} is installed" in msg and ">= 4.57.6, < 5 or >= 5.18.0, < 6" in msg, msg
    assert f'pip install "transformers>={hint}"' in msg, msg


@pytest.mark.parametrize("found", ["4.57.6", "5.18.0", "5.22.2", "5.24.0"])
def test_transformers_inside_the_range_passes(found):
    versions.check_versions(found, "1.15.0")


def test_the_installed_releases_pass():
    assert versions.installed("transformers") == transformers.__version__
    versions.check_versions()


def test_accelerate_outside_the_range_is_named():
    with pytest.raises(RuntimeError, match=r"accelerate 1\.0\.1 is installed .* >= 1\.15\.0, < 2"):
        versions.check_versions("5.24.0", "1.0.1")


def test_the_trainer_refuses_an_unsupported_release_at_construction(monkeypatch):
    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda p: "5.17.1" if p == "transformers" else real(p))
    with pytest.raises(RuntimeError, match="transformers 5.17.1 is installed"):
        AdaptiveBatchSizeTrainer(model=None)


def test_the_requirement_is_the_ranges():
    from packaging.requirements import Requirement

    spec = Requirement(versions.REQUIREMENT).specifier
    for found in ["4.46.0", "4.57.5", "4.57.6", "5.0.0", "5.2.1", "5.17.1", "5.18.0", "5.24.0", "6.0.0"]:
        accepted = any(
            versions._version(low) <= versions._version(found) < versions._version(high)
            for low, high in versions.TRANSFORMERS
        )
        assert spec.contains(found) == accepted, (found, versions.REQUIREMENT)


def test_setup_states_the_range_the_integration_checks():
    setup = (ROOT / "setup.py").read_text()
    assert setup.count(f'"{versions.REQUIREMENT}"') == 2, "hf and dev extras state versions.REQUIREMENT"
    low, high = versions.ACCELERATE
    assert len(re.findall(rf'"accelerate>={re.escape(low)},<{high}"', setup)) == 2
    floor = (ROOT / "scripts" / "test_hf_floor.sh").read_text()
    assert f"transformers=={versions.TRANSFORMERS[0][0]}" in floor, "CI tests the floor it states"


def test_the_loop_is_told_apart_by_the_major_release():
    assert versions.legacy_loop("4.57.6") and not versions.legacy_loop("5.18.0")
    assert versions.legacy_loop() == transformers.__version__.startswith("4.")

"""The transformers / accelerate releases the Trainer integration runs on: refused outside, with a sentence.

The range itself is exercised by CI, which runs the whole suite on the newest release and the Trainer's
focused suite on each release ``scripts/test_hf_floor.sh`` names (4.57.6, 5.0.0, 5.2.0, 5.3.0, 5.17.0);
here, the refusals, the acceptance of the range and that ``setup.py`` and CI say the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402

from ds_adabatch.integrations.hf import versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("found", ["4.46.0", "4.57.5", "6.0.0", "6.1.2"])
def test_transformers_outside_the_range_is_one_sentence(found):
    with pytest.raises(RuntimeError) as err:
        versions.check_versions(found, "1.15.0")
    msg = str(err.value)
    assert f"transformers {found} is installed" in msg and "transformers >= 4.57.6, < 6 (" in msg, msg
    assert 'pip install "transformers>=4.57.6,<6"' in msg, msg


@pytest.mark.parametrize(
    "found",
    ["4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.8.1", "5.14.1", "5.15.0", "5.17.0", "5.18.0", "5.24.0"],
)
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
    monkeypatch.setattr(versions, "installed", lambda p: "4.57.5" if p == "transformers" else real(p))
    with pytest.raises(RuntimeError, match="transformers 4.57.5 is installed"):
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
    ci = (ROOT / "scripts" / "test_hf_floor.sh").read_text()
    releases = re.search(r"^DEFAULT_RELEASES=\(([^)]*)\)", ci, re.M)
    assert releases, "scripts/test_hf_floor.sh names its transformers releases in DEFAULT_RELEASES"
    tested = releases.group(1).split()
    assert versions.TRANSFORMERS[0][0] in tested, "CI tests the floor it states"
    # Each kind of loop and each side of the plain Trainer's fixes: its first and its last release.
    assert {"5.0.0", "5.2.0", "5.3.0", "5.17.0"} <= set(tested), tested
    for found in tested:
        versions.check_versions(found, versions.ACCELERATE[0])


def test_the_loop_and_the_fixes_are_told_apart_by_the_release():
    one_function = ["4.57.6", "5.0.0", "5.1.0", "5.2.0"]
    assert all(versions.legacy_loop(v) for v in one_function)
    assert not any(versions.legacy_loop(v) for v in ["5.3.0", "5.17.0", "5.18.0", "5.24.0"])
    assert all(versions.plain_trainer_faults(v) for v in [*one_function, "5.3.0", "5.14.1", "5.17.0"])
    assert not any(versions.plain_trainer_faults(v) for v in ["5.18.0", "5.24.0"])
    assert versions.transformers_4("4.57.6") and not versions.transformers_4("5.0.0")
    assert versions.legacy_loop() == (not hasattr(transformers.Trainer, "_prepare_for_training"))

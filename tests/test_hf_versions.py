"""The transformers / accelerate releases the Trainer integration runs on: refused outside, with a sentence.

The range itself is exercised by CI, which runs the Trainer tests on the floor (transformers 5.18.0) and on
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


@pytest.mark.parametrize("found", ["4.46.0", "4.57.6", "5.0.0", "5.3.0", "5.17.1", "6.0.0"])
def test_transformers_outside_the_range_is_one_sentence(found):
    with pytest.raises(RuntimeError) as err:
        versions.check_versions(found, "1.15.0")
    msg = str(err.value)
    assert f"transformers {found} is installed" in msg and ">= 5.18.0, < 6" in msg, msg
    assert 'pip install "transformers>=5.18.0,<6"' in msg, msg


@pytest.mark.parametrize("found", ["5.18.0", "5.22.2", "5.24.0"])
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
    monkeypatch.setattr(versions, "installed", lambda p: "4.57.6" if p == "transformers" else real(p))
    with pytest.raises(RuntimeError, match="transformers 4.57.6 is installed"):
        AdaptiveBatchSizeTrainer(model=None)


def test_setup_states_the_range_the_integration_checks():
    setup = (ROOT / "setup.py").read_text()
    low, high = versions.TRANSFORMERS
    assert len(re.findall(rf'"transformers>={re.escape(low)},<{high}"', setup)) == 2, "hf and dev extras"
    low, high = versions.ACCELERATE
    assert len(re.findall(rf'"accelerate>={re.escape(low)},<{high}"', setup)) == 2
    floor = (ROOT / "scripts" / "test_hf_floor.sh").read_text()
    assert f"transformers=={versions.TRANSFORMERS[0]}" in floor, "CI tests the floor it states"

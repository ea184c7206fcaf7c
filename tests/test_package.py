"""The package surface: a light import, and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ds_adabatch

pytestmark = pytest.mark.matrix


def test_import_does_not_pull_heavy_dependencies():
    code = (
        "import sys, ds_adabatch, ds_adabatch.data, ds_adabatch.schedules;"
        "heavy = [m for m in ('transformers', 'deepspeed', 'torch', 'matplotlib') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"import ds_adabatch imported {out}"


def test_public_names_resolve():
    for name in ds_adabatch.__all__:
        assert getattr(ds_adabatch, name) is not None, name
    assert ds_adabatch.initialize.__module__ == "ds_adabatch.runtime.initialize.build"
    assert issubclass(ds_adabatch.ConfigError, ValueError) and issubclass(ds_adabatch.PlanError, ValueError)

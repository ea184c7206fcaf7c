"""Shared test settings: hypothesis profiles sized for a 2-core machine, CPU DeepSpeed, and DeepSpeed's
ops JIT-built without debug information (``scripts/c++-without-debug-info``) unless ``CXX`` is set."""

import os
from pathlib import Path

from hypothesis import HealthCheck, settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every launch inherits it, so each op is built once, by the first launch that loads it (a build
# directory built with another compiler command would be rebuilt).
os.environ.setdefault("CXX", str(Path(__file__).resolve().parents[1] / "scripts" / "c++-without-debug-info"))

settings.register_profile(
    "default",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

"""Shared test settings: hypothesis profiles sized for a 2-core machine, CPU DeepSpeed."""

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

settings.register_profile(
    "default",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

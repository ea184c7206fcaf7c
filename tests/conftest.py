"""Shared test settings: hypothesis profiles sized for a 2-core machine, CPU DeepSpeed, DeepSpeed's ops
JIT-built without debug information (``scripts/c++-without-debug-info``) unless ``CXX`` is set, and each
test's CPU time recorded where ``TEST_CPU_PROFILE`` names a folder."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every launch inherits it, so each op is built once, by the first launch that loads it. The ops go to a
# build directory of their own: one built with another compiler command (scripts/train.sh's, say) would be
# rebuilt each time the two alternate.
if "CXX" not in os.environ:
    os.environ["CXX"] = str(Path(__file__).resolve().parents[1] / "scripts" / "c++-without-debug-info")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache / "torch_extensions-without-debug-info"))

settings.register_profile(
    "default",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# TEST_CPU_PROFILE=DIR: every test phase's wall time and CPU time (this pytest process's own, and that of
# the processes it launched and waited for: the ranks of a launch, its launcher) appended as a JSON line
# to DIR/cpu-<xdist worker>.jsonl; `python scripts/cpu_profile.py DIR` sums them per test module. On a
# machine the suite keeps busy, the CPU time, not the wall time, is what a test costs the run.
_CPU_PROFILE = os.environ.get("TEST_CPU_PROFILE")


def _cpu_seconds() -> tuple[float, float]:
    import resource

    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _profiled(item, phase: str):
    if not _CPU_PROFILE:
        yield
        return
    import json
    import time

    began, (own, children) = time.time(), _cpu_seconds()
    yield
    wall, (own_after, children_after) = time.time() - began, _cpu_seconds()
    record = {
        "test": item.nodeid,
        "phase": phase,
        "start": began,
        "wall_s": round(wall, 3),
        "own_cpu_s": round(own_after - own, 3),
        "launched_cpu_s": round(children_after - children, 3),
    }
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(_CPU_PROFILE).mkdir(parents=True, exist_ok=True)
    with open(Path(_CPU_PROFILE) / f"cpu-{worker}.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _profiled(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _profiled(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _profiled(item, "teardown")

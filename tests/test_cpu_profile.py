"""``TEST_CPU_PROFILE`` (tests/conftest.py) and its summary (scripts/cpu_profile.py): a pytest run in a
scratch folder with this suite's conftest, one test of which launches a process that spins the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SPIN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"
TESTS = f'''
import subprocess, sys

def test_launches_a_spinning_process():
    subprocess.run([sys.executable, "-c", "{SPIN}"], check=True)

def test_does_nothing():
    pass
'''


def test_each_phase_is_recorded_with_the_cpu_of_what_it_launched(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(TESTS)
    profile = tmp_path / "profile"
    env = dict(os.environ, TEST_CPU_PROFILE=str(profile))
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (profile / "cpu-main.jsonl").read_text().splitlines()]
    assert [(r["test"].split("::")[1], r["phase"]) for r in records] == [
        (name, phase)
        for name in ("test_launches_a_spinning_process", "test_does_nothing")
        for phase in ("setup", "call", "teardown")
    ]
    spin = records[1]
    assert spin["launched_cpu_s"] >= 0.5, spin
    assert spin["wall_s"] >= spin["launched_cpu_s"] * 0.9, spin
    assert all(r["launched_cpu_s"] < 0.05 for r in records if r is not spin), records
    summary = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cpu_profile.py"), str(profile), "--top", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    module = next(line for line in lines if line.endswith("  test_probe.py"))
    assert float(module.split()[0]) >= 0.5 and int(module.split()[2]) == 2, summary.stdout
    assert lines[-1].split()[2:] == ["call", spin["test"]], summary.stdout


def test_the_summary_names_the_variable_when_the_folder_is_empty(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cpu_profile.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and f"TEST_CPU_PROFILE={tmp_path}" in proc.stderr, proc.stderr

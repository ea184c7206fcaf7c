"""benchmarks/noise_geometry.py --quick end to end: both noise-scale geometries are measured and written.

Structure and sanity only (finite, positive estimates; one table row per measurement point), never a
value that depends on the machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_both_geometries(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "noise_geometry.py"), "--quick", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads((tmp_path / "noise_geometry.json").read_text())
    rows = doc["rows"]
    s = doc["settings"]
    # 400 samples at batch 8 = 50 steps, one measurement every 10 steps after step 0.
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert [r["samples"] for r in rows] == [r["step"] * s["batch"] for r in rows]
    for r in rows:
        for geometry in ("sgd", "adam"):
            value = r[f"{geometry}_noise_scale"]
            assert value is not None and math.isfinite(value) and value > 0, (geometry, r)
            assert math.isfinite(r[f"{geometry}_trace"]) and r[f"{geometry}_trace"] > 0, (geometry, r)
    assert doc["command"].endswith("--quick --out " + str(tmp_path))
    table = (tmp_path / "summary.md").read_text()
    data_rows = [line for line in table.splitlines() if line.startswith("| 0 |")]
    assert len(data_rows) == 1, table  # every reporting point past 400 samples reads the last measurement
    assert "B_adam" in table and "B_simple" in table

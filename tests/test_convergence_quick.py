"""The convergence benchmark's --quick mode end to end: every output exists and is well formed.

Only structure is checked, never a timing or a ratio: those depend on the machine and its load.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ["fixed-8", "fixed-64", "linear", "gradient-noise", "loss-plateau"]
CURVE_KEYS = [
    "step",
    "samples",
    "global_batch",
    "lr",
    "train_loss_ema",
    "noise_scale",
    "val_loss",
    "trailing_mean",
    "wall_s",
    "cpu_s",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--out", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"convergence.py --quick failed:\n{log[-4000:]}"
    assert "Traceback" not in log, log[-4000:]
    return out, json.loads((out / "results.json").read_text()), proc.stdout


@pytest.mark.slow
def test_results_json(quick_run):
    _, results, _ = quick_run
    settings = results["settings"]
    assert settings["seeds"] == [0], "--quick runs one seed"
    assert [r["run"] for r in results["summary"]] == RUNS, "one summary row per run, in order"
    assert set(results["ds_configs"]) == set(RUNS)
    assert results["meta"]["world_size"] == 1
    cap, every = settings["cap"], settings["validate_every"]
    for row in results["summary"]:
        assert isinstance(row["reached"], bool)
        if row["reached"]:
            assert 0 < row["steps"] <= row["samples"] <= cap, f"{row['run']}: bad counts {row}"
            assert row["wall_s"] >= 0 and row["cpu_s"] >= 0
        else:
            assert row["steps"] is None and row["final_samples"] >= cap, f"{row['run']} stopped early"
        for key in ("steps_ratio", "samples_ratio", "wall_s_ratio", "cpu_s_ratio"):
            assert row[key] is None or (isinstance(row[key], float) and row[key] > 0), (key, row)

    for run in results["runs"]:
        curve = run["curve"]
        name = run["run"]
        assert curve[0]["step"] == 0 and curve[0]["samples"] == 0, f"{name}: no validation at sample 0"
        assert all(set(p) == set(CURVE_KEYS) for p in curve), f"{name}: curve keys differ"
        for a, b in zip(curve, curve[1:]):
            assert b["step"] > a["step"] and b["samples"] > a["samples"], f"{name}: curve not increasing"
            # Each validation is the first at or after a new multiple of validate_every (or the cap).
            crossed = b["samples"] // every > a["samples"] // every or b["samples"] >= cap
            assert crossed, f"{name}: validated at {b['samples']} after {a['samples']}"
        for i, p in enumerate(curve):
            assert math.isfinite(p["val_loss"]) and p["val_loss"] > 0, f"{name}: bad loss {p}"
            window = [q["val_loss"] for q in curve[max(0, i - 2) : i + 1]]
            assert p["trailing_mean"] == pytest.approx(sum(window) / len(window))
            assert 8 <= p["global_batch"] <= settings["max_batch"] and p["global_batch"] % 8 == 0
        last = curve[-1]
        assert run["reached"] == (last["trailing_mean"] <= settings["target"] and len(curve) >= 3)
        assert run["final_samples"] == last["samples"] and run["final_steps"] == last["step"]

    runs = {r["run"]: r for r in results["runs"]}
    assert not runs["fixed-8"]["batch_changes"] and not runs["fixed-64"]["batch_changes"]
    assert {p["global_batch"] for p in runs["fixed-64"]["curve"]} == {64}
    ramp = [e["new_global_batch"] for e in runs["linear"]["batch_changes"]]
    assert ramp and ramp == sorted(ramp), "the linear run must ramp up"


@pytest.mark.slow
def test_runs_share_weights_and_data(quick_run):
    _, results, _ = quick_run
    runs = {r["run"]: r for r in results["runs"]}
    start = {r["curve"][0]["val_loss"] for r in results["runs"]}
    assert len(start) == 1, f"runs of one seed must start from the same weights: {start}"
    # gradient-noise holds batch 8 through its warm-up: until its first change it is the baseline.
    changes = runs["gradient-noise"]["batch_changes"]
    until = changes[0]["samples"] if changes else math.inf
    same = [p for p in runs["gradient-noise"]["curve"] if p["samples"] <= until]
    base = {p["samples"]: p["val_loss"] for p in runs["fixed-8"]["curve"]}
    pairs = [(p["val_loss"], base[p["samples"]]) for p in same if p["samples"] in base]
    assert len(pairs) >= 2, "too few shared validation points to compare"
    for mine, theirs in pairs:
        assert mine == pytest.approx(theirs, rel=1e-6), "same seed, same batch: the training stream differs"


@pytest.mark.slow
def test_csv_png_and_table(quick_run):
    out, results, stdout = quick_run
    with open(out / "curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["run", "seed", *CURVE_KEYS]
    assert len(rows) == sum(len(r["curve"]) for r in results["runs"])
    with open(out / "batch_changes.csv", newline="") as f:
        changes = list(csv.DictReader(f))
    assert len(changes) == sum(len(r["batch_changes"]) for r in results["runs"])
    assert list(changes[0]) == [
        "run",
        "seed",
        "step",
        "samples",
        "old_global_batch",
        "new_global_batch",
        "lr_multiplier",
    ]
    table = (out / "summary.md").read_text()
    for run in RUNS:
        assert f"| {run} | 0 |" in table, f"summary.md lacks the {run} row"
    assert table in stdout, "the table is printed too"
    png = (out / "convergence.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, "convergence.png is not a real plot"


@pytest.mark.slow
def test_cosine_setting_quick(tmp_path):
    # The decaying-LR setting: every run trains to exactly the sample budget; seesaw grows the batch
    # where the cosine decays, so it takes fewer steps than the baseline for the same samples.
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "convergence.py"),
        "--setting",
        "cosine",
        "--quick",
        "--runs",
        "fixed-8",
        "seesaw",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"convergence.py --setting cosine --quick failed:\n{proc.stderr[-4000:]}"
    results = json.loads((tmp_path / "results.json").read_text())
    cap = results["settings"]["cap"]
    rows = {r["run"]: r for r in results["summary"]}
    assert set(rows) == {"fixed-8", "seesaw"}
    for r in rows.values():
        assert r["samples"] == cap, f"{r['run']} did not stop at the budget: {r}"
        assert math.isfinite(r["final_val"]) and r["steps_ratio"] is not None
    assert rows["fixed-8"]["steps"] == cap // 8
    assert rows["seesaw"]["steps"] < rows["fixed-8"]["steps"], "seesaw never grew the batch"
    sched = results["ds_configs"]["seesaw"]["scheduler"]
    assert sched["type"] == "WarmupCosineLR" and sched["params"]["cos_min_ratio"] == 0.1
    assert (tmp_path / "convergence.png").stat().st_size > 0
    assert "Goal for `seesaw`" in (tmp_path / "summary.md").read_text()

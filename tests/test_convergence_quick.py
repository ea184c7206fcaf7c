"""The benchmarks' --quick modes end to end: every output exists and is well formed.

``benchmarks/convergence.py --quick`` (the default setting and the cosine setting) and
``benchmarks/noise_geometry.py --quick``. Only structure is checked, never a timing or a ratio: those
depend on the machine and its load.

Each run is one process with one thread (``--quick`` runs one rank, ``OMP_NUM_THREADS=1``): the module's
fixture starts the default setting and, beside it on the second core, the cosine setting and then the
noise-geometry run, and the tests read what each wrote.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _util import launches_for

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
TIMEOUT = 600


def _start(logs: Path, script: str, *args: str) -> subprocess.Popen:
    """Start ``benchmarks/<script> args`` (one thread), its stdout and stderr going to files in ``logs``."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with (logs / "stdout.txt").open("w") as stdout, (logs / "stderr.txt").open("w") as stderr:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)


def _wait(proc: subprocess.Popen, logs: Path, deadline: float) -> subprocess.CompletedProcess[str]:
    """The finished run :func:`_start` began (its process group killed and the test failed if it overruns)."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(
            f"{' '.join(proc.args[1:])} ran past {TIMEOUT} s:\n{(logs / 'stderr.txt').read_text()[-4000:]}"
        )
    stdout, stderr = ((logs / f"{name}.txt").read_text() for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# Which run each test reads (the fixture starts only the runs of the tests selected).
RUN_OF = {
    "test_results_json": "convergence",
    "test_runs_share_weights_and_data": "convergence",
    "test_csv_png_and_table": "convergence",
    "test_cosine_setting_quick": "cosine",
    "test_noise_geometry_quick_run_writes_both_geometries": "noise_geometry",
}


@pytest.fixture(scope="module")
def benchmark_runs(request, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """The --quick runs on two cores: the default setting on one; cosine, then noise geometry, on the other."""
    wanted = launches_for(request, __name__, {name: {run} for name, run in RUN_OF.items()})
    argv = {
        "convergence": ["convergence.py", "--quick"],
        "cosine": ["convergence.py", "--setting", "cosine", "--quick", "--runs", "fixed-8", "seesaw"],
        "noise_geometry": ["noise_geometry.py", "--quick"],
    }
    out = {name: tmp_path_factory.mktemp(name) for name in wanted}
    logs = {name: tmp_path_factory.mktemp(f"{name}_logs") for name in wanted}
    deadline = time.monotonic() + TIMEOUT
    started, done = {}, {}

    def start(name: str) -> None:
        started[name] = _start(logs[name], *argv[name], "--out", str(out[name]))

    try:
        if "convergence" in wanted:  # the longest run, alone on one core
            start("convergence")
        for name in ("cosine", "noise_geometry"):  # one after the other on the other core
            if name in wanted:
                start(name)
                done[name] = _wait(started[name], logs[name], deadline)
        if "convergence" in wanted:
            done["convergence"] = _wait(started["convergence"], logs["convergence"], deadline)
    finally:  # a failed wait leaves no run behind
        for proc in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {name: (out[name], done[name]) for name in wanted}


@pytest.fixture(scope="module")
def quick_run(benchmark_runs):
    out, proc = benchmark_runs["convergence"]
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
def test_cosine_setting_quick(benchmark_runs):
    # The decaying-LR setting: every run trains to exactly the sample budget; seesaw grows the batch
    # where the cosine decays, so it takes fewer steps than the baseline for the same samples.
    tmp_path, proc = benchmark_runs["cosine"]
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


# -- benchmarks/noise_geometry.py --quick: both noise-scale geometries are measured and written. Structure and
# sanity only (finite, positive estimates; one table row per measurement point), never a value that
# depends on the machine.
def test_noise_geometry_quick_run_writes_both_geometries(benchmark_runs):
    tmp_path, proc = benchmark_runs["noise_geometry"]
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

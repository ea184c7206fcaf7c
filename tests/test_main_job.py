"""The main job (runners/train_lm.py) end to end: 2 CPU ranks, a short ramp, metrics JSONL and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multirank
@pytest.mark.slow
def test_main_job_short_run(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "lm_ramp.json").read_text())
    config["adabatch"]["schedule"]["ramp_samples"] = 128  # reach 64 within the short run
    cfg_path = tmp_path / "lm_short.json"
    cfg_path.write_text(json.dumps(config))
    out = tmp_path / "run"
    proc = torchrun(
        ROOT / "runners" / "train_lm.py",
        "--config",
        str(cfg_path),
        "--samples",
        "320",
        "--max-bytes",
        "2000000",
        "--out",
        str(out),
        "--no-progress",
        cwd=ROOT,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train_lm.py failed:\n{log[-4000:]}"
    assert "Traceback" not in log

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows, "metrics.jsonl is empty"
    for key in (
        "step",
        "samples",
        "tokens",
        "global_batch",
        "micro_batch_per_gpu",
        "gradient_accumulation_steps",
        "lr",
        "loss",
        "train_coverage",
        "epoch",
    ):
        assert key in rows[0], f"metrics.jsonl lacks {key!r}"
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one line per optimizer step"
    assert rows[-1]["samples"] >= 320
    assert rows[0]["global_batch"] == 8 and rows[-1]["global_batch"] == 64, "the batch must ramp 8 -> 64"
    assert all(r["samples"] - p["samples"] == r["global_batch"] for p, r in zip(rows, rows[1:]))
    # Every window holds 64 target bytes of which the model predicts 63 (labels shift by one).
    assert rows[-1]["tokens"] == rows[-1]["samples"] * 63
    assert "global batch 8 -> 16" in log, "plan changes are logged on rank 0"

    png = (out / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, "metrics.png is not a real plot"

"""``simulate``: the plan a config would make, as rows, a CSV and a PNG."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.schedules import simulate
from ds_adabatch.schedules.simulate import CSV_COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def loaded(schedule: dict, **fields) -> SimpleNamespace:
    fields.setdefault("max_micro_batch_per_gpu", 8)
    return SimpleNamespace(adabatch=AdaBatchConfig.model_validate({"schedule": schedule, **fields}))


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_linear_ramp_writes_a_csv_and_a_png(tmp_path):
    cfg = loaded(
        {"type": "linear", "start": 16, "end": 64, "ramp_samples": 2000},
        granularity=16,
        lr_scaling={"rule": "sqrt"},
    )
    png = tmp_path / "plan.png"
    rows = simulate(cfg, world_size=2, samples=4000, out_png=png)

    assert png.read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "plan.csv", newline="") as handle:  # default: next to the PNG
        table = list(csv.DictReader(handle))
    assert tuple(table[0]) == CSV_COLUMNS
    assert len(table) == len(rows)
    assert [int(r["global_batch"]) for r in table] == [r["global_batch"] for r in rows]

    samples = [r["samples"] for r in rows]
    assert samples[0] == 0 and samples[-1] < 4000 <= samples[-1] + rows[-1]["global_batch"]
    for before, after in zip(rows, rows[1:]):
        assert after["samples"] == before["samples"] + before["global_batch"], "no sample lost or repeated"
    for r in rows:
        assert r["global_batch"] % 16 == 0
        assert r["micro_batch_per_gpu"] * r["gradient_accumulation_steps"] * 2 == r["global_batch"]
        assert r["lr_multiplier"] == pytest.approx((r["global_batch"] / 16) ** 0.5)
    assert rows[0]["global_batch"] == 16 and rows[-1]["global_batch"] == 64


def add_every(step: int, batch_size: int, interval: int, increment: int) -> int:
    return batch_size + increment if step % interval == 0 and step > 0 else batch_size


def test_callable_per_device_and_explicit_csv_path(tmp_path):
    cfg = loaded(
        {
            "type": "callable",
            "function": f"{__name__}:add_every",
            "start": 1,
            "per": "device",
            "kwargs": {"interval": 5, "increment": 1},
        }
    )
    out_csv = tmp_path / "elsewhere.csv"
    rows = simulate(cfg, world_size=2, samples=40, out_png=None, out_csv=out_csv)
    # 5 x 2 + 5 x 4 = 30 samples, then steps of 6 until 40 samples are reached.
    assert [r["global_batch"] for r in rows] == [2] * 5 + [4] * 5 + [6, 6]
    assert out_csv.read_text().startswith(",".join(CSV_COLUMNS))


def test_token_schedule_needs_a_token_count(tmp_path):
    cfg = loaded({"type": "piecewise", "unit": "tokens", "points": [[0, 8], [4096, 16]]})
    with pytest.raises(ValueError, match="tokens_per_sample"):
        simulate(cfg, world_size=1, samples=1000, out_png=None)
    rows = simulate(cfg, world_size=1, samples=1000, out_png=None, tokens_per_sample=512)
    # 8 samples x 512 tokens per step: the batch switches once 4096 tokens (8 samples) are consumed.
    assert [r["global_batch"] for r in rows[:3]] == [8, 16, 16]
    assert rows[1]["tokens"] == 4096


def test_loss_driven_schedule_refuses_without_replay():
    cfg = loaded({"type": "loss_plateau", "start": 16})
    with pytest.raises(ValueError, match=r"--replay metrics\.jsonl"):
        simulate(cfg, world_size=1, samples=1000, out_png=None)
    noise = loaded({"type": "gradient_noise", "start": 16})
    with pytest.raises(ValueError, match="noise_scale"):
        simulate(noise, world_size=1, samples=1000, out_png=None)


def test_replay_feeds_the_recorded_loss(tmp_path):
    # A recorded run: loss falls for 400 samples, then is flat.
    records = [{"samples": s, "loss": max(1.0, 3.0 - s / 200)} for s in range(16, 1600, 16)]
    records.insert(3, {"event": "plan_change", "global_batch": 16})  # non-step lines are skipped
    records.insert(5, {"samples": 60, "loss": math.nan})  # a step without a loss is skipped
    replay = write_jsonl(tmp_path / "metrics.jsonl", records)
    cfg = loaded(
        {"type": "loss_plateau", "start": 16, "window": 3, "patience": 2, "cooldown": 2, "ema_beta": 0.0},
        max_global_batch=64,
    )
    png = tmp_path / "replay.png"
    rows = simulate(cfg, world_size=1, samples=1600, out_png=png, replay=replay)
    batches = [r["global_batch"] for r in rows]
    first_growth = next(r for r in rows if r["global_batch"] > 16)
    assert first_growth["samples"] > 400, "the batch must hold while the recorded loss falls"
    assert max(batches) == 64
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_replay_feeds_the_noise_scale(tmp_path):
    records = [{"samples": s, "noise_scale": 50.0 if s < 500 else 200.0} for s in range(0, 3000, 50)]
    replay = write_jsonl(tmp_path / "metrics.jsonl", records)
    noise = {
        "type": "gradient_noise",
        "start": 32,
        "scale": 1.0,
        "warmup_steps": 2,
        "max_change_factor": None,
    }
    cfg = loaded(noise, granularity=8)
    rows = simulate(cfg, world_size=1, samples=3000, out_png=None, out_csv=None, replay=replay)
    # steps 0 and 1 warm up; at step 2 the recorded 50 is outside the band around 32 -> 48.
    assert [r["global_batch"] for r in rows[:4]] == [32, 32, 48, 48]
    assert rows[-1]["global_batch"] == 200


def test_replay_errors_are_clear(tmp_path):
    cfg = loaded({"type": "loss_plateau", "start": 16})
    no_loss = write_jsonl(tmp_path / "a.jsonl", [{"samples": 10, "noise_scale": 3.0}])
    with pytest.raises(ValueError, match="reads 'loss'"):
        simulate(cfg, world_size=1, samples=100, out_png=None, replay=no_loss)
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"samples": 1, "loss": 2.0}\n{not json\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:2"):
        simulate(cfg, world_size=1, samples=100, out_png=None, replay=str(broken))


def test_bad_arguments():
    cfg = loaded({"type": "constant", "value": 8})
    with pytest.raises(ValueError, match="samples must be an integer >= 1"):
        simulate(cfg, world_size=1, samples=0, out_png=None)
    with pytest.raises(ValueError, match="more than 10 optimizer steps"):
        simulate(cfg, world_size=1, samples=1000, out_png=None, max_steps=10)

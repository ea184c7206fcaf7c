"""``simulate`` with token budgets (``micro_batch_tokens``): steps packed from the dataset's lengths by the
runtime's own sampler and packer (``ds_adabatch.data.simulated_steps.PackedSteps``), and the CLI's
``--lengths``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ds_adabatch import cli
from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.data.lengths import SampleLengths
from ds_adabatch.data.simulated_steps import PackedSteps, read_lengths
from ds_adabatch.data.token_config import sampler_for_config
from ds_adabatch.schedules import simulate

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 1000
LENGTHS = np.random.default_rng(3).integers(8, 200, size=SAMPLES)
BUDGET = 512


def loaded(schedule: dict, **fields) -> SimpleNamespace:
    section = {"schedule": schedule, "micro_batch_tokens": BUDGET, **fields}
    return SimpleNamespace(adabatch=AdaBatchConfig.model_validate(section))


def test_token_budgets_need_the_lengths():
    cfg = loaded({"type": "linear", "start": 16, "end": 64, "ramp_samples": 2000})
    with pytest.raises(ValueError, match="--lengths FILE"):
        simulate(cfg, world_size=2, samples=100, out_png=None)
    plain = SimpleNamespace(
        adabatch=AdaBatchConfig.model_validate(
            {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 8}
        )
    )
    with pytest.raises(ValueError, match="only apply with adabatch.micro_batch_tokens"):
        PackedSteps(plain, LENGTHS)
    with pytest.raises(ValueError, match="only apply with adabatch.micro_batch_tokens"):
        simulate(plain, world_size=2, samples=100, out_png=None, steps=PackedSteps(cfg, LENGTHS))
    with pytest.raises(ValueError, match="tokens_per_sample does not apply with sample lengths"):
        simulate(
            cfg, world_size=2, samples=100, out_png=None, steps=PackedSteps(cfg, LENGTHS), tokens_per_sample=8
        )
    with pytest.raises(ValueError, match=r"sample \d+ has length \d+ tokens, above micro_batch_tokens 512"):
        PackedSteps(cfg, np.concatenate([LENGTHS, [600]]))


@pytest.mark.parametrize("padding", ["pad_to_longest", "packed"])
def test_the_rows_are_the_steps_a_run_takes(padding):
    cfg = loaded(
        {"type": "linear", "start": 16, "end": 64, "ramp_samples": 1200},
        padding=padding,
        bucket_window=64,
        data={"seed": 5},
    )
    rows = simulate(
        cfg, world_size=2, samples=2 * SAMPLES + 100, out_png=None, steps=PackedSteps(cfg, LENGTHS)
    )
    # The runtime's sampler, built from the same config, cut at the same batches.
    sampler = sampler_for_config(
        cfg.adabatch, SampleLengths(SAMPLES, lengths=LENGTHS), shuffle=True, seed=5, drop_last=False
    )
    consumed = tokens = 0
    tails = []
    for row in rows:
        assert (row["samples"], row["tokens"]) == (consumed, tokens)
        step = sampler.next_step(row["global_batch"], 2)
        assert row["gradient_accumulation_steps"] == step.passes
        assert row["pass_budget"] == BUDGET
        assert row["micro_batch_per_gpu"] == step.plan().micro_batch_per_gpu
        if step.size < row["global_batch"]:
            tails.append(consumed + step.size)
        consumed, tokens = consumed + step.size, tokens + int(step.tokens)
    # Every sample once per epoch: the two epoch tails end exactly at the dataset's size.
    assert tails[:2] == [SAMPLES, 2 * SAMPLES], tails
    assert max(r["gradient_accumulation_steps"] for r in rows) >= 3  # the ramp's large steps take passes
    assert rows[0]["global_batch"] == 16 and rows[-1]["global_batch"] == 64


def test_a_schedule_in_tokens_counts_the_real_tokens():
    cfg = loaded({"type": "linear", "unit": "tokens", "start": 2048, "end": 8192, "ramp_samples": 200_000})
    rows = simulate(cfg, world_size=2, samples=SAMPLES, out_png=None, steps=PackedSteps(cfg, LENGTHS))
    for before, after in zip(rows, rows[1:-1]):
        # a step takes samples until their lengths reach the batch (in tokens), at most one more
        assert before["global_batch"] <= after["tokens"] - before["tokens"] < before["global_batch"] + 200
    assert rows[-1]["tokens"] < int(LENGTHS.sum()) <= rows[-1]["tokens"] + rows[-1]["global_batch"] + 200
    assert rows[-1]["global_batch"] > rows[0]["global_batch"]


def goodput(**fields):
    return loaded(
        {"type": "goodput", "start": 16, "decide_every": 5, "warmup_steps": 10, "max_relative_error": None},
        max_global_batch=256,
        lr_scaling={"rule": "sqrt"},
        **fields,
    )


def test_goodput_learns_the_passes_a_batch_takes():
    # Flat in the passes (a host-bound device): the largest batch, in many passes.
    cfg = goodput()
    flat = simulate(
        cfg, world_size=2, samples=8000, out_png=None, steps=PackedSteps(cfg, LENGTHS),
        step_time="fixed=0.05", noise_scale=500.0,
    )  # fmt: skip
    assert flat[-1]["global_batch"] == 256
    assert flat[-1]["gradient_accumulation_steps"] >= 10
    assert any("passes of 512 tokens" in row["reason"] for row in flat)
    # A pass costs its tokens (a compute-bound device) and the noise scale is small: a batch that takes
    # more passes gains little samples/s and loses efficiency, so the batch stays within what start's
    # passes hold (16 samples, or a few more that the packed lengths say take as many passes).
    cfg = goodput()
    costly = simulate(
        cfg, world_size=2, samples=8000, out_png=None, steps=PackedSteps(cfg, LENGTHS),
        step_time="fixed=0.001,per_pass=0.001,per_sample=0.0001", noise_scale=20.0,
    )  # fmt: skip
    assert {row["global_batch"] for row in costly[:10]} == {16}
    assert max(row["global_batch"] for row in costly[20:]) <= 24
    passes = {row["gradient_accumulation_steps"] for row in costly}
    assert len(passes) > 1 and max(passes) <= 4, passes  # each step's samples packed by their lengths


def test_read_lengths_takes_text_json_and_npy(tmp_path):
    want = [12, 7, 300, 1]
    (tmp_path / "a.txt").write_text("12\n7\n300, 1\n")
    (tmp_path / "a.json").write_text(json.dumps(want))
    np.save(tmp_path / "a.npy", np.asarray(want, dtype=np.int32))
    for name in ("a.txt", "a.json", "a.npy"):
        assert read_lengths(tmp_path / name).tolist() == want, name
    (tmp_path / "bad.txt").write_text("12\nseven\n")
    (tmp_path / "bad.json").write_text(json.dumps([[1, 2], [3, 4]]))
    (tmp_path / "empty.txt").write_text("\n")
    np.save(tmp_path / "float.npy", np.asarray([1.5, 2.0]))
    for name in ("bad.txt", "bad.json", "empty.txt", "float.npy"):
        with pytest.raises(ValueError, match=name):
            read_lengths(tmp_path / name)


def test_the_command_line(tmp_path, capsys):
    config = json.loads((ROOT / "ds_configs" / "goodput.json").read_text())
    section = config["adabatch"]
    section.pop("max_micro_batch_per_gpu")
    section["micro_batch_tokens"] = BUDGET
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(config))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in LENGTHS))
    out = tmp_path / "plan.png"
    args = ["simulate", str(path), "--world-size", "2", "--samples", "3000", "--out", str(out)]
    args += ["--step-time", "fixed=0.02,per_pass=0.01", "--noise-scale", "100", "--lengths", str(lengths)]
    assert cli.main(args) == 0
    said = capsys.readouterr().out
    assert "optimizer steps over 3000 samples on 2 ranks: global batch 16 -> " in said, said
    assert " passes of 512 tokens per rank" in said, said
    with open(tmp_path / "plan.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert {row["pass_budget"] for row in table} == {str(BUDGET)}
    assert int(table[-1]["samples"]) < 3000 and int(table[-1]["tokens"]) > 0
    # In process: each bad input exits 2 with a message naming what to change.
    base = ["simulate", str(path), "--world-size", "2", "--samples", "100", "--out", str(out)]
    assert cli.main([*base, "--step-time", "fixed=0.02", "--noise-scale", "100"]) == 2  # no lengths
    assert cli.main([*base, "--lengths", str(tmp_path / "missing.txt")]) == 2
    (tmp_path / "long.txt").write_text("10\n900\n")
    assert cli.main([*base, "--lengths", str(tmp_path / "long.txt")]) == 2
    plain = str(ROOT / "ds_configs" / "zero0.json")
    assert (
        cli.main(
            [
                "simulate",
                plain,
                "--world-size",
                "2",
                "--samples",
                "100",
                "--out",
                str(out),
                "--lengths",
                str(lengths),
            ]
        )
        == 2
    )


def test_a_noise_driven_schedule_over_packed_steps():
    # gradient_noise keeps its batch in samples; the steps are still packed from the lengths.
    cfg = loaded(
        {"type": "gradient_noise", "start": 16, "warmup_steps": 5, "max_relative_error": None, "scale": 0.2},
        max_global_batch=256,
    )
    rows = simulate(
        cfg, world_size=2, samples=5000, out_png=None, steps=PackedSteps(cfg, LENGTHS), noise_scale=100.0
    )
    assert rows[-1]["global_batch"] == 20, rows[-1]  # scale x B_noise
    assert len({r["gradient_accumulation_steps"] for r in rows}) > 1 and {r["pass_budget"] for r in rows} == {
        BUDGET
    }

"""The DeepSpeed runtime on real gloo ranks: exactness, token weighting, noise scale, LR, checkpoints.

Three launches (``tests/engine_worker.py``) serve every test here: 2 ranks run all exactness cases and
save checkpoints; 2 fresh ranks resume them; 1 rank repeats the sequence, resumes a 2-rank checkpoint
and records an LR ramp. Each test reads what its case wrote and asserts on it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _util import read_result, torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
WORKER = HERE / "engine_worker.py"
STAGES = (0, 1, 2, 3)


def _launch(nproc: int, phase: str, out: Path) -> None:
    proc = torchrun(WORKER, phase, str(out), nproc=nproc, cwd=HERE, timeout=900)
    log = proc.stdout + proc.stderr
    (out / f"{phase}.log").write_text(log)
    if proc.returncode != 0:
        pytest.fail(
            f"engine worker phase {phase!r} on {nproc} ranks failed (exit {proc.returncode}):\n{log[-4000:]}"
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine")
    _launch(2, "exact", out)
    _launch(2, "resume", out)
    _launch(1, "single", out)
    return out


# The requested sequence of global batches and the plans it must produce on 2 ranks, max micro 4:
# growing, GAS 1 -> 4 -> 3, shrinking, uneven (13 = 4+3 | 3+3), padded (1 sample), odd (3), and a
# request for 16 when only 9 samples of the epoch remain (the smaller tail batch, planned unevenly).
EXPECTED_PLANS_2 = [[8, 4, 1], [32, 4, 4], [24, 4, 3], [6, 3, 1], [13, 4, 2], [1, 1, 1], [3, 2, 1], [9, 3, 2]]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_plan_changes_match_big_batch_reference(results, stage, dtype):
    r = read_result(results, f"exact_z{stage}_{dtype}")
    tol = 1e-5 if dtype == "fp32" else 2e-2
    assert r["max_rel_err"] <= tol, (
        f"ZeRO-{stage} {dtype}: final parameters differ from the plain-PyTorch big-batch reference by "
        f"{r['max_rel_err']:.2e} (allowed {tol:.0e})"
    )
    assert r["plans"] == EXPECTED_PLANS_2, f"plans actually used: {r['plans']}"
    assert sorted(i for b in r["batches"] for i in b) == list(range(96)), (
        "an epoch must use every sample once"
    )
    assert r["global_samples"] == 96 and r["ds_global_samples"] == 96, "sample counts must be exact"
    reasons = [e["reason"] for e in r["history"]]
    # 7 requested changes (8 -> 32 -> 24 -> 6 -> 13 -> 1 -> 3 -> 16) and the tail replan 16 -> 9.
    assert reasons == ["manual"] * 7 + ["last batch of the epoch"], reasons


@pytest.mark.parametrize("stage", STAGES)
def test_caller_owned_accumulation_is_exact(results, stage):
    # "managed_gradient_accumulation": false: no boundary is set, step() once per optimizer step.
    r = read_result(results, f"caller_z{stage}")
    assert r["max_rel_err"] <= 1e-5, (
        f"ZeRO-{stage} with caller-owned accumulation: off the big-batch reference by {r['max_rel_err']:.2e}"
    )
    assert r["plans"] == EXPECTED_PLANS_2, f"plans actually used: {r['plans']}"
    assert r["global_samples"] == 96 and r["ds_global_samples"] == 96, "sample counts must be exact"
    # The same update as the boundary set by hand, to rounding.
    caller = torch.load(results / f"caller_z{stage}_params.pt")
    managed = torch.load(results / f"exact_z{stage}_fp32_params.pt")
    err = float((caller - managed).abs().max() / managed.abs().max())
    assert err <= 1e-6, f"ZeRO-{stage}: caller-owned and hand-set boundary differ by {err:.2e}"


def test_loader_workers_inside_the_engine(results):
    r = read_result(results, "exact_z1_workers")
    assert r["max_rel_err"] <= 1e-5, f"with 2 loader workers per rank: off by {r['max_rel_err']:.2e}"
    assert r["batches"] == read_result(results, "exact_z1_fp32")["batches"], (
        "workers must not change the stream"
    )


def test_user_data_iter_is_weighted_by_real_sizes(results):
    r = read_result(results, "data_iter_z2")
    assert r["global_samples"] == r["want_samples"] == 25
    assert r["max_rel_err"] <= 1e-5, (
        f"train_batch(data_iter) with uneven micro-batches off by {r['max_rel_err']:.2e}"
    )


def test_iterable_dataset_draws_the_planned_counts(results):
    r = read_result(results, "iterable_z0")
    rank0, rank1 = r["seen"]
    assert r["global_samples"] == 8 + 6 + 12
    assert len(rank0) == len(rank1) == 13, "each rank draws half of every global batch"
    assert rank0 == list(range(0, 26, 2)) and rank1 == list(range(1, 26, 2)), "in its own stream's order"


def test_cpu_offload_matches_reference(results):
    r = read_result(results, "exact_z2_offload")
    assert r["max_rel_err"] <= 1e-5, f"ZeRO-2 CPU offload off by {r['max_rel_err']:.2e}"


@pytest.mark.parametrize("stage", (0, 2))
def test_one_rank_and_two_ranks_agree(results, stage):
    one = torch.load(results / f"single_z{stage}_fp32_params.pt")
    two = torch.load(results / f"exact_z{stage}_fp32_params.pt")
    err = float((one - two).abs().max() / two.abs().max())
    assert err <= 1e-5, f"ZeRO-{stage}: 1 rank and 2 ranks diverge by {err:.2e}"
    single = read_result(results, f"single_z{stage}_fp32")
    double = read_result(results, f"exact_z{stage}_fp32")
    assert single["batches"] == double["batches"], "the global batches must not depend on the world size"


def test_token_normalisation_is_mean_over_global_tokens(results):
    r = read_result(results, "tokens_z2")
    assert r["tokens"] == r["want_tokens"], "global token count"
    assert r["max_rel_err"] <= 1e-5, f"token-weighted update off by {r['max_rel_err']:.2e}"
    # loss_fn returned (loss, num_tokens) above; a num_tokens the weights were not built from is refused.
    assert r["refused"] and "num_tokens=" in r["refused"] and "token_count_fn" in r["refused"], r["refused"]


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_noise_scale_estimate_near_closed_form(results, stage):
    r = read_result(results, f"noise_z{stage}")
    assert r["estimate"] is not None, "no noise-scale estimate was produced"
    rel = abs(r["estimate"] - r["truth"]) / r["truth"]
    assert rel <= 0.2, f"ZeRO-{stage}: B_noise estimate {r['estimate']:.2f}, truth {r['truth']:.2f}"


def test_noise_scale_under_caller_owned_accumulation(results):
    # ZeRO 2: the same measurement as the hand-set boundary (ZeRO 0 refuses it: test_caller_accumulation).
    caller, managed = read_result(results, "noise_z2_caller"), read_result(results, "noise_z2")
    assert caller["estimate"] is not None and managed["estimate"] is not None
    assert math.isclose(caller["estimate"], managed["estimate"], rel_tol=1e-6), (caller, managed)


CKPT = [
    "linear_z0",
    "linear_z1",
    "linear_z2",
    "linear_z3",
    "callable_z0",
    "plateau_z0",
    "noise_z0",
    "seesaw_z0",
]


@pytest.mark.parametrize("case", CKPT)
def test_resume_is_bit_identical(results, case):
    full = read_result(results, f"ckpt_{case}_full")
    resumed = read_result(results, f"ckpt_{case}_resumed_w2")
    start = resumed["start"]
    assert start == 3, f"resumed at step {start}, saved at 3"
    want = full["steps"][start:]
    got = resumed["steps"]
    assert [s["plan"] for s in got] == [s["plan"] for s in want], "batch plans after resume"
    assert [s["indices"] for s in got] == [s["indices"] for s in want], "sample stream after resume"
    assert [s["loss"] for s in got] == [s["loss"] for s in want], "per-step losses must be bit-identical"
    assert [s["lr"] for s in got] == [s["lr"] for s in want], "learning rates after resume"


def test_stateful_schedules_changed_the_batch(results):
    # Otherwise the round trips above would prove nothing about the schedules' state.
    for case in ("callable_z0", "plateau_z0", "noise_z0", "seesaw_z0"):
        plans = [s["plan"][0] for s in read_result(results, f"ckpt_{case}_full")["steps"]]
        assert len(set(plans[3:])) > 1 or plans[3] != plans[0], f"{case}: batch never changed: {plans}"


@pytest.mark.parametrize("name", ["ckpt_linear_z0_resumed_w1", "ckpt_linear_z2_universal_w1"])
def test_resume_on_another_world_size_continues_the_stream(results, name):
    # ZeRO 0 reloads natively; ZeRO 2 through DeepSpeed's universal checkpoint conversion.
    full = read_result(results, name.split("_resumed")[0].split("_universal")[0] + "_full")
    resumed = read_result(results, name)
    assert full["world_size"] == 2 and resumed["start"] == 3
    want = [s["indices"] for s in full["steps"][resumed["start"] :]]
    assert [s["indices"] for s in resumed["steps"]] == want, "2 -> 1 ranks must continue the same samples"
    assert [s["plan"][0] for s in resumed["steps"]] == [s["plan"][0] for s in full["steps"][3:]]


def test_lr_multiplier_and_samples_based_schedule(results):
    # WarmupLR (0 -> 0.1 over 10 scheduler steps, DeepSpeed counts from iteration -1) advanced once per
    # 4 samples (the reference batch), times sqrt(B / 4) for the step's batch B.
    rows = read_result(results, "lr_ramp")["rows"]
    assert [r["batch"] for r in rows][:4] == [4, 4, 6, 8] or rows[-1]["batch"] == 16
    for r in rows:
        iteration = r["samples_before"] // 4 - 1
        base = 0.1 * min(1.0, max(0, iteration) / 10)
        want = base * math.sqrt(r["batch"] / 4)
        assert math.isclose(r["lr"], want, rel_tol=1e-9, abs_tol=1e-12), (
            f"at {r['samples_before']} samples, batch {r['batch']}: lr {r['lr']}, expected {want}"
        )
        assert math.isclose(r["multiplier"], math.sqrt(r["batch"] / 4), rel_tol=1e-12)
    assert rows[-1]["batch"] == 16, "the ramp must reach its end"


def test_metrics_reach_deepspeed_monitor(results):
    folder = results / "monitor" / "lr"
    files = {p.name for p in folder.glob("*.csv")} if folder.exists() else set()
    assert any("global_batch" in f for f in files), (
        f"no global-batch series in DeepSpeed's CSV monitor: {files}"
    )
    series = next(folder.glob("*adabatch_global_batch*.csv")).read_text().splitlines()
    values = [float(line.split(",")[1]) for line in series[1:]]
    assert len(values) == 10 and values[0] == 4 and values[-1] == 16, f"monitor global batch: {values}"


def test_seesaw_applied_lr_equals_the_rule(results):
    # 2 ranks, DeepSpeed's own WarmupCosineLR: the engine's batch sequence is the pure rule's (simulate
    # over the same config), and the LR the optimizer applied is base LR(samples) x sqrt(B / start).
    from ds_adabatch.config import load_ds_config
    from ds_adabatch.schedules import base_lr_from_ds_config, simulate

    record = read_result(results, "seesaw_lr")
    rows, cfg = record["rows"], record["config"]
    total = rows[-1]["samples_before"] + rows[-1]["batch"]
    plan = simulate(load_ds_config(cfg), world_size=2, samples=total, out_png=None)
    assert [(r["samples"], r["global_batch"]) for r in plan] == [
        (r["samples_before"], r["batch"]) for r in rows
    ], "engine batches differ from the pure rule"
    curve = base_lr_from_ds_config(cfg, reference_batch=4)
    peak = 0.0
    for r, p in zip(rows, plan):
        base = curve.base_lr(r["samples_before"])
        peak = max(peak, base)  # the rule's peak: the largest base LR seen so far
        want = base * math.sqrt(r["batch"] / 4)
        assert math.isclose(r["lr"], want, rel_tol=1e-9, abs_tol=1e-12), (r, want)
        assert math.isclose(p["lr"], want, rel_tol=1e-12, abs_tol=1e-15), "simulate's LR column"
        if 0 < base < peak and r["batch"] < 32:
            # The rule itself: the batch is the plannable neighbour of 4 x peak / base.
            assert abs(r["batch"] - 4 * peak / base) <= 2, (r, 4 * peak / base)
    batches = [r["batch"] for r in rows]
    assert batches[0] == 4 and max(batches) == 32, f"the ramp must run 4 -> 32: {batches}"
    held = [r for r in rows if r["batch"] == 32]
    assert len(held) >= 2 and held[-1]["lr"] < held[0]["lr"], "at max_global_batch the LR keeps decaying"

"""Pipeline and tensor parallelism on real gloo ranks: exact updates, the sample ledger, checkpoints, refusals.

Two launches (``tests/pipeline_worker.py``) serve every test here: 2 stages x 1 data-parallel (2
processes), then 4 processes running, one after the other, 2 tensor x 2 data-parallel with the
data-parallel engine and an mpu, 2 stages x 2 data-parallel (it also resumes the first launch's
checkpoints on the other data-parallel size), and 3D: 2 stages x 2 tensor ranks x 1 data-parallel. Each
test reads what its case wrote and asserts on it. One more launch, with a restart: an out-of-memory error
under tensor parallelism.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _util import free_port, read_result, run_killing_group, torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
WORKER = HERE / "pipeline_worker.py"
N_SAMPLES = 96

# Plans (global, micro, GAS) the requested sequences must produce, max micro 4, uneven allowed: the
# micro-batch grows and shrinks, GAS goes 1 -> 4 -> 3, 13 splits unevenly, 1 sample on 2 replicas pads
# one, and the last request is cut to the epoch's 9 remaining samples.
PLANS = {
    1: [[4, 4, 1], [16, 4, 4], [12, 4, 3], [6, 3, 2], [13, 4, 4], [1, 1, 1], [3, 3, 1], [16, 4, 4], [16, 4, 4], [9, 3, 3]],
    2: [[8, 4, 1], [32, 4, 4], [24, 4, 3], [6, 3, 1], [13, 4, 2], [1, 1, 1], [3, 2, 1], [9, 3, 2]],
}  # fmt: skip
# The launches: their layouts (one after the other in one launch) and process count. pipe2x2 resumes the
# checkpoints pipe2x1 wrote; the data-parallel engine's tensor2x2 runs before the 4-process pipelines.
LAYOUTS = (("pipe2x1", 2), ("tensor2x2,pipe2x2,pipe_tensor", 4))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    for layout, nproc in LAYOUTS:
        proc = torchrun(WORKER, layout, str(out), nproc=nproc, cwd=HERE, timeout=900)
        log = proc.stdout + proc.stderr
        (out / f"{layout.replace(',', '+')}.log").write_text(log)
        if proc.returncode != 0:
            pytest.fail(
                f"pipeline worker {layout} on {nproc} processes failed (exit {proc.returncode}):\n{log[-4000:]}"
            )
    return out


def _tolerance(name: str) -> float:
    return 2e-2 if "bf16" in name else 1e-5


def _check_exact(r: dict, name: str) -> None:
    tol = _tolerance(name)
    for rank in r["ranks"]:
        assert rank["err"] <= tol, (
            f"{name}: rank {rank['rank']}'s parameters differ from the plain-PyTorch big-batch reference by "
            f"{rank['err']:.2e} (allowed {tol:.0e}): the update is not the exact mean over the global batch"
        )
        loss_tol = 1e-5 if tol < 1e-3 else 2e-2
        for step, (got, want) in enumerate(zip(rank["losses"], r["ref_losses"])):
            assert abs(got - want) <= loss_tol * max(1.0, abs(want)), (
                f"{name}: rank {rank['rank']} returned loss {got} at step {step}; the global mean is {want}"
            )
    first = r["ranks"][0]["losses"]
    assert all(rank["losses"] == first for rank in r["ranks"]), f"{name}: ranks returned different losses"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("layout,dp", [("pipe2x1", 1), ("pipe2x2", 2), ("tensor2x2", 2)])
def test_plan_changes_match_big_batch_reference(results, layout, dp, zero, dtype):
    name = f"{layout}_z{zero}_{dtype}"
    r = read_result(results, name)
    assert r["plans"] == PLANS[dp], f"{name}: plans actually used: {r['plans']}"
    _check_exact(r, name)


@pytest.mark.parametrize("name", ["tensor2x2_z2_fp32", "tensor2x2_z3_fp32", "tensor2x2_z3_bf16"])
def test_tensor_parallelism_with_zero_2_and_3_matches_big_batch_reference(results, name):
    # ZeRO partitions each tensor rank's shard over its data-parallel group (the mpu's).
    r = read_result(results, name)
    assert r["plans"] == PLANS[2], f"{name}: plans actually used: {r['plans']}"
    _check_exact(r, name)


@pytest.mark.parametrize("name", ["pipe_tensor_z0_fp32", "pipe_tensor_z1_fp32", "pipe_tensor_z1_bf16"])
def test_3d_pipeline_x_tensor_x_data_matches_big_batch_reference(results, name):
    # 2 stages x 2 tensor ranks x 1 replica (4 processes): each stage's block split over the grid's
    # slice group, DeepSpeed partitioning the activations between stages over the tensor ranks.
    r = read_result(results, name)
    assert r["plans"] == PLANS[1], f"{name}: plans actually used: {r['plans']}"
    _check_exact(r, name)
    assert sorted((rank["stage"], rank["tp_rank"]) for rank in r["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize(
    "name", ["pipe2x1_z0_fp32", "pipe2x2_z1_fp32", "tensor2x2_z0_fp32", "pipe_tensor_z0_fp32"]
)
def test_every_sample_once_and_every_process_of_a_replica_trains_the_same(results, name):
    r = read_result(results, name)
    dp = 2 if "2x2" in name else 1
    assert sorted(i for b in r["batches"] for i in b) == list(range(N_SAMPLES)), "every sample once per epoch"
    by_replica: dict[int, list] = {}
    for rank in r["ranks"]:
        assert rank["samples"] == N_SAMPLES, f"rank {rank['rank']} counted {rank['samples']} samples"
        by_replica.setdefault(rank["dp_rank"], []).append(rank["micro_indices"])
    assert len(by_replica) == dp
    for replica, seen in by_replica.items():
        assert all(s == seen[0] for s in seen), (
            f"{name}: the processes of replica {replica} (stages or tensor ranks) trained different samples"
        )
    for step, batch in enumerate(r["batches"]):
        trained = sorted(i for seen in by_replica.values() for mb in seen[0][step] for i in mb)
        assert trained == sorted(batch), (
            f"{name}: step {step}'s replicas trained {trained}, not the global batch"
        )


def test_reasons_and_deepspeed_sample_count(results):
    r = read_result(results, "pipe2x2_z0_fp32")
    # 8 requested changes (the config's initial 4, then 8 -> 32 -> ... -> 16) and the tail replan 16 -> 9.
    assert r["reasons"] == ["manual"] * 8 + ["last batch of the epoch"], r["reasons"]
    assert all(rank["ds_samples"] == N_SAMPLES for rank in r["ranks"]), (
        "DeepSpeed's global_samples must be exact"
    )


@pytest.mark.parametrize("name", ["pipe2x1_z0_fp32", "pipe2x2_z1_fp32"])
def test_deepspeed_eval_batch_still_works(results, name):
    for rank in read_result(results, name)["ranks"]:
        assert rank["eval_loss"] == pytest.approx(rank["ref_eval_loss"], rel=1e-5), (
            f"{name}: eval_batch on rank {rank['rank']} gave {rank['eval_loss']}, the trained reference "
            f"{rank['ref_eval_loss']}"
        )


def test_per_sample_loss_fn(results):
    # The loss_fn returns one loss per row instead of the mean: the same exact update.
    _check_exact(read_result(results, "pipe2x1_per_sample"), "pipe2x1_per_sample")


@pytest.mark.parametrize("dp", [1, 2])
def test_token_normalisation_is_mean_over_global_tokens(results, dp):
    r = read_result(results, f"tokens_dp{dp}")
    assert r["tokens"] == r["want_tokens"], (
        f"target tokens counted {r['tokens']}, the batches hold {r['want_tokens']}"
    )
    _check_exact(r, f"tokens_dp{dp}")


def test_token_budget_with_dynamic_shape(results):
    r = read_result(results, "token_budget_dp1")
    assert all(rank["shapes"] > 3 for rank in r["ranks"]), "the passes should have had several shapes"
    _check_exact(r, "token_budget_dp1")


@pytest.mark.parametrize("zero", [0, 1])
def test_same_world_resume_is_bit_identical(results, zero):
    r = read_result(results, f"ckpt_z{zero}_dp1")
    assert r["start"] == 3
    want, got = r["full"][3:], r["resumed"]
    assert [s["plan"] for s in got] == [s["plan"] for s in want], "plans after resume"
    assert [s["indices"] for s in got] == [s["indices"] for s in want], "sample stream after resume"
    assert [s["loss"] for s in got] == [s["loss"] for s in want], "per-step losses must be bit-identical"
    assert [s["lr"] for s in got] == [s["lr"] for s in want], "learning rates after resume"
    assert len({s["plan"][0] for s in r["full"]}) > 2, "the ramp must have changed the batch"


def test_lr_scaling_and_samples_based_schedule(results):
    # WarmupLR (0 -> 0.01 over 8 scheduler steps, DeepSpeed counts from iteration -1) advanced once per
    # 4 samples (the reference batch: the ramp's start), times sqrt(B / 4) for the step's batch B.
    steps = read_result(results, "ckpt_z1_dp1")["full"]
    for s in steps:
        batch = s["plan"][0]
        base = 0.01 * min(1.0, max(0, s["samples_before"] // 4 - 1) / 8)
        assert s["multiplier"] == pytest.approx((batch / 4) ** 0.5, rel=1e-12)
        assert s["lr"] == pytest.approx(base * (batch / 4) ** 0.5, rel=1e-9, abs=1e-12), s


@pytest.mark.parametrize("zero", [0, 1])
def test_resume_on_another_data_parallel_size(results, zero):
    # 2 stages x 1 replica saved; 2 stages x 2 replicas resume (ZeRO 1 through DeepSpeed's universal
    # checkpoint, converted by load_checkpoint itself).
    full = read_result(results, f"ckpt_z{zero}_dp1")["full"][3:]
    r = read_result(results, f"ckpt_z{zero}_dp2")
    assert r["start"] == 3 and r["world_size"] == 2
    assert [s["indices"] for s in r["resumed"]] == [s["indices"] for s in full], "the same samples continue"
    assert [s["plan"][0] for s in r["resumed"]] == [s["plan"][0] for s in full]
    for got, want in zip(r["resumed"], full):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * max(1.0, abs(want["loss"])), (got, want)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    if zero == 1:
        assert (results / "ckpt_z1" / "step3_universal").is_dir(), (
            "ZeRO 1 must go through the universal format"
        )


def test_schedules_that_read_the_loss_or_agree(results):
    r = read_result(results, "schedules_dp1")
    for name in ("plateau", "callable"):
        plans = r[name]
        assert all(p == plans[0] for p in plans), f"{name}: ranks planned differently: {plans}"
        assert len(set(plans[0])) > 2, f"{name}: the batch never changed: {plans[0]}"
    assert r["callable"][0] == [2, 4, 6, 8, 10, 12], "rank 0's answer of a rank-dependent function is applied"
    lines = (results / "plateau_dp1.jsonl").read_text().splitlines()
    assert len(lines) == 6 and '"loss": NaN' not in "".join(lines), (
        "every step's record is written with its loss"
    )


def test_oom_recovery_is_off_under_pipelining_and_the_log_and_every_step_record_say_so(results):
    for name in ("pipe2x1_z0_fp32", "pipe2x2_z1_bf16"):
        for rank in read_result(results, name)["ranks"]:
            assert rank["oom_recovery"] == ["off:pipeline", "off:pipeline"], (name, rank["oom_recovery"])
    log = (results / "pipe2x1.log").read_text()
    warning = "out-of-memory recovery is off under pipeline parallelism"
    # Rank 0, once per engine that left recover_from_oom at its default (every case of the launch).
    assert log.count(warning) >= 5 and "set adabatch.memory.recover_from_oom to false" in log, log[-3000:]


def test_what_pipelining_cannot_do_is_refused_with_the_reason(results):
    r = read_result(results, "refusals")
    expect = {
        "zero2": "zero_optimization.stage",
        "gradient_noise": "gradient_noise cannot be measured",
        "auto_micro": "out-of-memory recovery is not available under pipeline parallelism",
        "iterable": "must be a map-style dataset",
    }
    for case, words in expect.items():
        assert r[case] is not None, f"{case}: initialize accepted it"
        assert words in r[case], f"{case}: {r[case]}"


def test_an_oom_under_tensor_parallelism_is_survived_through_a_restart(tmp_path):
    # 2 tensor ranks x 2 replicas; the last process fits 40 tokens per forward (budget 64).
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--master-port={free_port()}",
    ]
    cmd += ["--max-restarts=1", "--monitor-interval=1", str(WORKER), "tensor2x2_oom", str(tmp_path)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_killing_group(cmd, cwd=HERE, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the restarted launch failed:\n{log[-4000:]}"
    failed = [line for line in log.splitlines() if "incarnation 0" in line]
    assert failed and all(line.startswith("rank 3 incarnation 0") for line in failed), failed
    assert "under tensor parallelism every pass agrees when it begins" in failed[0]
    assert "Recorded in" in failed[0] and "plans below" in failed[0]
    r = read_result(tmp_path, "tensor2x2_token_oom")
    assert r["restart"] == 1, "the second incarnation finishes the run"
    first = r["ranks"][0]
    for rank in r["ranks"]:
        assert rank["err"] <= 1e-5, f"rank {rank['rank']}: off the token-mean reference by {rank['err']:.2e}"
        assert rank["steps"] == first["steps"] and rank["budgets"] == first["budgets"]
    assert max(first["budgets"]) <= 40 and sum(first["oom_retries"]) == 0, first
    assert all(rank["oom_recovery"] == "restart" for rank in r["ranks"]), r["ranks"]
    (path,) = (tmp_path / "tensor_oom_ckpt").glob("adabatch_oom_rank*.json")  # no checkpoint saved: kept
    record = json.loads(path.read_text())
    assert path.name == "adabatch_oom_rank3.json" and 40 < record["failed"] <= 64, record

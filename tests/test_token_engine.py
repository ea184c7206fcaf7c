"""Token-budget steps through the DeepSpeed engine on real gloo ranks (tests/token_worker.py).

Two launches: 2 ranks train every case (ZeRO 0, 2, 3 with a token-mean loss; ZeRO 0 with a sample mean;
a lazily measured length_fn with 2 loader workers per rank) and save a checkpoint; 1 rank resumes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import read_result, torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
WORKER = HERE / "token_worker.py"
N, BUDGET = 60, 64
TARGETS = [150, 300, 90, 40, 500, 64, 200, 120]  # token_worker.TARGETS: the targets it sets in turn


def _launch(nproc: int, phase: str, out: Path) -> None:
    proc = torchrun(WORKER, phase, str(out), nproc=nproc, cwd=HERE, timeout=900)
    log = proc.stdout + proc.stderr
    (out / f"{phase}.log").write_text(log)
    if proc.returncode != 0:
        pytest.fail(
            f"token worker {phase!r} on {nproc} ranks failed (exit {proc.returncode}):\n{log[-4000:]}"
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    _launch(2, "train", out)
    _launch(1, "resume", out)
    return out


@pytest.mark.parametrize("case", ["z0_token", "z1_token", "z2_token", "z3_token", "z0_sample"])
def test_token_budget_steps_are_exact_and_exactly_once(results, case):
    r = read_result(results, f"train_{case}")
    assert r["max_rel_err"] <= 1e-5, f"{case}: off the big-batch reference by {r['max_rel_err']:.2e}"
    assert r["max_cost"] <= BUDGET, f"a pass held {r['max_cost']} padded tokens, budget {BUDGET}"
    by_epoch: dict[int, list[int]] = {}
    for epoch, idx in zip(r["epochs"], r["steps"]):
        by_epoch.setdefault(epoch, []).extend(idx)
    assert len(by_epoch) >= 3, "the targets must cover more than two epochs"
    for epoch in sorted(by_epoch)[:-1]:
        assert sorted(by_epoch[epoch]) == list(range(N)), f"epoch {epoch} must use every sample once"
    # Real counts: samples handed out and the sum of their lengths, on the engine and DeepSpeed.
    lengths = r["lengths"]
    samples = sum(len(s) for s in r["steps"])
    assert r["global_samples"] == r["ds_global_samples"] == samples
    assert r["global_tokens"] == sum(lengths[i] for s in r["steps"] for i in s)
    # This rank ran as many passes as the plan's accumulation steps, the same on every rank.
    assert all(n == gas for n, gas in r["counts"]) and [c[0] for c in r["counts"]] == r["passes"]
    assert any(p > 1 for p in r["passes"]), "some step must need several passes"
    # Only target changes are recorded, not every step's varying sample count; the line says the
    # schedule's targets, in tokens (not the sample counts of the steps around the change).
    assert len(r["history"]) == 7
    said = [line.split("global batch ")[1].split(" (")[0] for line in r["plan_lines"]]
    assert said == [f"{a} -> {b} tokens" for a, b in zip(TARGETS, TARGETS[1:])], r["plan_lines"]


def test_the_lr_follows_every_token_target(results):
    r = read_result(results, "token_lr")
    targets = [t for t, *_ in r["rows"]]
    assert len(set(targets)) >= 4, targets
    for target, multiplier, *_ in r["rows"]:
        assert multiplier == pytest.approx(target / 60), r["rows"]
    # Each new target is a plan change (recorded), whether or not its packed shape changed.
    changes = sum(a != b for a, b in zip(targets, targets[1:]))
    assert len(r["history"]) == changes, (r["history"], r["rows"])


def test_same_stream_on_every_stage_and_with_length_fn(results):
    base = read_result(results, "train_z0_token")
    for case in ("z1_token", "z2_token", "z3_token", "z0_sample"):
        assert read_result(results, f"train_{case}")["steps"] == base["steps"]


def test_loader_workers_and_length_fn_train_the_same_steps(results):
    base = read_result(results, "train_z0_token")
    pooled = read_result(results, "train_length_fn_workers")
    assert pooled["workers"] == 2, f"{pooled['workers']} loader workers ran on rank 0, not 2"
    assert pooled["steps"] == base["steps"], "workers or a length_fn changed the sample stream"
    assert pooled["losses"] == base["losses"], (
        f"losses with workers {pooled['losses']} differ from in-process loading {base['losses']}"
    )
    assert pooled["params"] == base["params"], "the trained parameters differ with loader workers"
    # Read with a step prefetched: only the committed steps count.
    assert pooled["data_state"] == base["data_state"], "the loader state counted a prefetched step"


def test_resume_on_another_world_size(results):
    two = read_result(results, "train_z0_token")
    one = read_result(results, "resume_z0_token")
    assert one["steps"] == two["rest_steps"], "the resumed run must continue the same sample stream"
    assert (one["global_samples"], one["global_tokens"]) == (two["global_samples"], two["global_tokens"])
    worst = max(abs(a - b) for a, b in zip(one["params"], two["params"]))
    assert worst <= 1e-5, f"1-rank continuation differs from the 2-rank one by {worst:.2e}"

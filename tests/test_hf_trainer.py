"""``AdaptiveBatchSizeTrainer`` (Hugging Face Trainer integration).

Three torchrun launches of ``tests/hf_worker.py`` (2 CPU ranks each, default ``use_cpu=False``) serve
the multi-rank tests: DeepSpeed ZeRO-2, DeepSpeed ZeRO-3 and plain DDP. Each runs the seed's scheduler with a
checkpoint and a resume, one optimizer step split several ways against a big-batch reference, (ZeRO-2
and DDP) three kinds of model at GAS 1, 4 and changing against plain PyTorch and,
with DeepSpeed, a config-driven ramp and the gradient_noise schedule; ZeRO-2 also trains token-budget
steps (``micro_batch_tokens``) on variable-length data. The single-process tests train in this process
without DeepSpeed, and check the token-budget lengths, errors and resume without training.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _util import torchrun


@pytest.fixture(autouse=True)
def _deepspeed_flag_per_test(monkeypatch):
    # transformers 4.57's TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED=true in the
    # process environment for good, and every later TrainingArguments of the process then builds a
    # DeepSpeed plugin: each test starts without it, as its own process would (5.x sets nothing).
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)


HERE = Path(__file__).parent
WORKER = HERE / "hf_worker.py"

# The seed's logs (2 ranks, 10 samples, +1 sample per device every 5 steps, dataloader_drop_last False):
# per-device samples, train_coverage and fractional epoch after each optimizer step.
SEED_SIZES = [1, 1, 1, 1, 1, 2, 2, 1, 2, 2, 1, 3, 2]
SEED_COVERAGE = [0.2, 0.4, 0.6, 0.8, 1.0, 0.4, 0.8, 1.0, 0.4, 0.8, 1.0, 0.6, 1.0]
SEED_EPOCHS = [0.2, 0.4, 0.6, 0.8, 1.0, 1.4, 1.8, 2.0, 2.4, 2.8, 3.0, 3.6, 4.0]
TOL = 1e-5


def _launch(out: Path, backend: str, *scenarios: str) -> Path:
    proc = torchrun(WORKER, str(out), backend, *scenarios, cwd=HERE, timeout=600)
    (out / f"{backend}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        pytest.fail(
            f"hf_worker ({backend}: {', '.join(scenarios)}) failed with exit {proc.returncode}:\n"
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return out


@pytest.fixture(scope="module")
def ds_results(tmp_path_factory) -> Path:
    return _launch(
        tmp_path_factory.mktemp("hf_ds"), "ds", "seed", "exact", "models", "ramp", "noise", "tokens", "world"
    )


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("hf_zero3"), "zero3", "seed", "exact", "noise", "world")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("hf_ddp"), "ddp", "seed", "exact", "models")


def _read(out: Path, scenario: str, backend: str, rank: int) -> dict:
    path = out / f"{scenario}_{backend}_rank{rank}.json"
    assert path.exists(), f"the worker wrote no {path.name}; see {out / (backend + '.log')}"
    return json.loads(path.read_text())


def _results(request, backend: str) -> Path:
    return request.getfixturevalue(f"{backend}_results")


def _epochs_of(steps_by_rank: list[list[dict]]) -> list[list[int]]:
    """All ranks' trained indices, cut into epochs where train_coverage reaches 1.0."""
    epochs, current = [], []
    for per_rank in zip(*steps_by_rank):
        for step in per_rank:
            current += [i for micro in step["indices"] for i in micro]
        if per_rank[0]["coverage"] == 1.0:
            epochs.append(current)
            current = []
    assert not current, f"samples {current} were trained after the last complete epoch"
    return epochs


BACKENDS = [pytest.param(b, marks=pytest.mark.multirank) for b in ("ds", "zero3", "ddp")]
DEEPSPEED = [pytest.param(b, marks=pytest.mark.multirank) for b in ("ds", "zero3")]
WITH_AND_WITHOUT_DEEPSPEED = [pytest.param(b, marks=pytest.mark.multirank) for b in ("ds", "ddp")]


# -- the seed's scheduler on 2 ranks -----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_scheduler_grows_the_per_device_batch_as_in_the_seed_logs(request, backend):
    out = _results(request, backend)
    for rank in (0, 1):
        steps = _read(out, "seed", backend, rank)["first"]
        sizes = [sum(s["sizes"]) for s in steps]
        assert sizes == SEED_SIZES, (
            f"rank {rank}: per-device samples per step {sizes}, seed logs {SEED_SIZES}"
        )
        coverage = [round(s["coverage"], 6) for s in steps]
        assert coverage == SEED_COVERAGE, f"rank {rank}: train_coverage {coverage}, expected {SEED_COVERAGE}"
        epochs = [round(s["epoch"], 6) for s in steps]
        assert epochs == SEED_EPOCHS, f"rank {rank}: state.epoch {epochs}, expected {SEED_EPOCHS}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_sample_is_trained_once_per_epoch_across_ranks(request, backend):
    out = _results(request, backend)
    runs = [_read(out, "seed", backend, rank)["first"] for rank in (0, 1)]
    epochs = _epochs_of(runs)
    assert len(epochs) == 4, f"expected 4 epochs ending at train_coverage 1.0, got {len(epochs)}"
    for e, indices in enumerate(epochs):
        assert sorted(indices) == list(range(10)), (
            f"epoch {e}: trained {sorted(indices)}, not each of 0..9 once"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_logs_carry_coverage_epoch_and_batch_shape(request, backend):
    result = _read(_results(request, backend), "seed", backend, 0)
    logs = [entry for entry in result["first_logs"] if "loss" in entry]
    assert len(logs) == len(SEED_SIZES), f"expected one training log per step, got {len(logs)}"
    for entry, steps in zip(logs, result["first"]):
        missing = {
            "train_coverage",
            "epoch",
            "global_batch_size",
            "micro_batch_size",
            "gradient_accumulation_steps",
        }
        missing -= entry.keys()
        assert not missing, f"step {entry['step']}: log lacks {sorted(missing)}"
        shape = [entry["global_batch_size"], entry["micro_batch_size"], entry["gradient_accumulation_steps"]]
        assert shape == steps["plan"], (
            f"step {entry['step']}: logged batch shape {shape}, trained {steps['plan']}"
        )
    coverage = [round(e["train_coverage"], 6) for e in logs]
    assert coverage == SEED_COVERAGE, f"logged train_coverage {coverage}"
    assert result["max_steps"] == [13, 13], f"state.max_steps {result['max_steps']} != the 13 steps trained"


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_training_is_turned_into_one_data_parallel_group(request, backend):
    # The worker passes use_cpu=False on a CPU machine: without the fix each rank would train alone.
    out = _results(request, backend)
    first, second = (_read(out, "seed", backend, rank) for rank in (0, 1))
    assert first["world_size"] == second["world_size"] == 2, "the Trainer did not see both ranks"
    for a, b in zip(first["first"], second["first"]):
        left = {i for m in a["indices"] for i in m}
        right = {i for m in b["indices"] for i in m}
        assert not left & right, f"step {a['step']}: both ranks trained samples {sorted(left & right)}"


# -- checkpoints -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_mid_epoch_continues_the_same_samples_and_batch(request, backend):
    out = _results(request, backend)
    for rank in (0, 1):
        result = _read(out, "seed", backend, rank)
        assert "checkpoint-6" in result["checkpoints"], f"no checkpoint-6 saved: {result['checkpoints']}"
        expected = [(s["step"], s["indices"], s["plan"]) for s in result["first"][6:]]
        resumed = [(s["step"], s["indices"], s["plan"]) for s in result["second"]]
        assert resumed == expected, f"rank {rank}: resumed steps {resumed} differ from the run's {expected}"
        assert result["final_param_diff"] < 1e-6, (
            f"rank {rank}: final weights differ by {result['final_param_diff']}"
        )
    logs = _read(out, "seed", backend, 0)
    before = {e["step"]: (e["loss"], e["learning_rate"]) for e in logs["first_logs"] if "loss" in e}
    after = {
        e["step"]: (e["loss"], e["learning_rate"])
        for e in logs["second_logs"]
        if "loss" in e and e["step"] > 6
    }
    assert sorted(after) == list(range(7, 14)), f"resumed run logged steps {sorted(after)}"
    for step, (loss, lr) in after.items():
        assert loss == pytest.approx(before[step][0], rel=1e-5), (
            f"step {step}: loss {loss} vs {before[step][0]}"
        )
        assert lr == pytest.approx(before[step][1], rel=1e-9, abs=1e-12), (
            f"step {step}: lr {lr} vs {before[step][1]}"
        )


@pytest.mark.multirank
def test_a_two_rank_checkpoint_resumes_on_one_process_with_the_same_stream(ddp_results, tmp_path):
    from hf_worker import IndexRegression

    two = [_read(ddp_results, "seed", "ddp", rank)["first"] for rank in (0, 1)]

    def global_order(steps_by_rank):  # slot order: accumulation step k of every rank, then k + 1
        order = []
        for per_rank in zip(*steps_by_rank):
            for k in range(len(per_rank[0]["indices"])):
                order += [i for step in per_rank for i in step["indices"][k]]
        return order

    trainer, rec = _trainer(
        tmp_path,
        IndexRegression(),
        scheduler=_seed_scheduler(),
        num_train_epochs=4,
        learning_rate=0.05,
        warmup_steps=2,
        seed=11,
    )
    trainer.train(resume_from_checkpoint=str(ddp_results / "seed_ddp" / "first" / "checkpoint-6"))
    # The per-device batch (2) carries over, so one process takes 2 samples per step where 2 ranks took 4.
    assert [sum(s["sizes"]) for s in rec.steps[:3]] == [2, 2, 2], f"steps {rec.steps[:3]}"
    rest_of_epoch = global_order([steps[6:8] for steps in two])
    resumed = global_order([rec.steps[:3]])
    assert resumed == rest_of_epoch, f"after the resume: {resumed}; the 2-rank run trained {rest_of_epoch}"
    assert rec.steps[2]["coverage"] == 1.0 and rec.steps[2]["epoch"] == pytest.approx(2.0)
    for e, indices in enumerate(_epochs_of([rec.steps[3:]])):
        assert sorted(indices) == list(range(10)), f"epoch {e + 3} after the resume trained {indices}"


@pytest.mark.multirank
def test_a_zero_checkpoint_of_two_ranks_resumes_on_one_on_the_same_parameters(
    ds_results, zero3_results, tmp_path, monkeypatch
):
    # DeepSpeed 0.19.8 refuses ZeRO optimizer state partitioned over another number of ranks; the trainer
    # converts the checkpoint to the universal format. A constant global batch of 4 (2 ranks x 2, then
    # 1 x 4) trains the same samples either way, so the resumed run's steps 4-6 must give the 2-rank run's
    # parameters (Adam's moments and the LR schedule loaded too: weights alone would drift).
    two = {"2": _read(ds_results, "world", "ds", 0)["2"], "3": _read(zero3_results, "world", "zero3", 0)["3"]}
    assert all(run["world_size"] == 2 for run in two.values())
    monkeypatch.setenv("HF_RESUME_FROM", json.dumps({stage: run["checkpoint"] for stage, run in two.items()}))
    # The resumed run saves its step 6 into a folder holding the 2-rank run's checkpoint of that step (as
    # a run resumed from an older checkpoint in the same output folder does): the earlier save's shards
    # must go, so that no later resume reads a rank-1 shard beside the 1-rank save.
    for stage, run in two.items():
        earlier = Path(run["checkpoint"]).parent / "checkpoint-6"
        assert any(earlier.glob("global_step*/*rank_1_*_states.pt")), sorted(earlier.rglob("*"))
        shutil.copytree(earlier, tmp_path / "world_ds" / f"zero{stage}" / "checkpoint-6")
    proc = torchrun(WORKER, str(tmp_path), "ds", "world", nproc=1, cwd=HERE, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert log.count("to DeepSpeed's universal format") == 2, log[-4000:]
    for stage in two:
        saved = tmp_path / "world_ds" / f"zero{stage}" / "checkpoint-6"
        shards = sorted(p.name for p in saved.glob("global_step*/*_states.pt"))
        assert shards and all("rank_1_" not in name for name in shards), f"ZeRO {stage}: {shards}"
    one = _read(tmp_path, "world", "ds", 0)
    for stage, run in two.items():
        resumed = one[stage]
        assert resumed["world_size"] == 1 and sorted(resumed["params"], key=int) == ["4", "5", "6"]
        for step in ("4", "5", "6"):
            got, want = torch.tensor(resumed["params"][step]), torch.tensor(run["params"][step])
            moved = (want - torch.tensor(run["params"]["3"])).abs().max()
            assert moved > 1e-3 and (got - want).abs().max() < TOL * max(1.0, float(want.abs().max())), (
                f"ZeRO {stage}, step {step}: resumed on 1 rank {got.tolist()}, 2 ranks {want.tolist()}"
            )


# -- exactness ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_split_1x8_or_4x2_gives_the_same_parameters(request, backend):
    result = _read(_results(request, backend), "exact", backend, 0)
    assert result["1x8"]["plan"] == [16, 1, 8] and result["4x2"]["plan"] == [16, 4, 2], (
        f"plans {result['1x8']['plan']} / {result['4x2']['plan']}, expected micro 1 x GAS 8 and 4 x 2"
    )
    assert result["diff_1x8_vs_4x2"] < TOL, f"1x8 and 4x2 differ by {result['diff_1x8_vs_4x2']}"
    for name in ("1x8", "4x2"):
        case = result[name]
        assert case["update"] > 1e-3, f"{name}: the step barely moved the weights ({case['update']})"
        assert case["diff_vs_reference"] < TOL, (
            f"{name}: weights differ from the big-batch token-mean SGD step by {case['diff_vs_reference']}"
        )


@pytest.mark.parametrize("backend", WITH_AND_WITHOUT_DEEPSPEED)
def test_every_kind_of_model_steps_with_the_exact_mean_and_logs_the_true_loss(request, backend):
    # BERT's forward takes **kwargs (so the Trainer's num_items_in_batch path is taken) but its loss is
    # its own mean; GPT-2 divides by num_items_in_batch; the plain module takes no **kwargs. SGD with
    # lr 1: the update is minus the applied gradient, compared per step with plain PyTorch's gradient
    # of the mean loss over the step's global batch at the same parameters.
    plans = {
        "gas1": [[8, 4, 1]] * 2,
        "gas4": [[8, 1, 4]] * 2,
        "changing": [[2, 1, 1], [8, 1, 4], [4, 1, 2], [6, 1, 3]],
    }
    from ds_adabatch.integrations.hf.versions import transformers_4

    # transformers 4.57's BertForSequenceClassification.forward takes no **kwargs (5.x's does): there the
    # Trainer normalises BERT by samples, and the step must still be the exact mean.
    takes_kwargs = {"bert": not transformers_4(), "gpt2": True, "plain": False}
    out = _results(request, backend)
    for rank in (0, 1):
        result = _read(out, "models", backend, rank)
        assert sorted(result) == sorted(f"{m}_{s}" for m in takes_kwargs for s in plans), sorted(result)
        for name, case in result.items():
            model, split = name.split("_")
            assert case["accepts_loss_kwargs"] is takes_kwargs[model], f"{name}: model_accepts_loss_kwargs"
            assert [s["plan"] for s in case["steps"]] == plans[split], f"{name}: plans {case['steps']}"
            for k, s in enumerate(case["steps"]):
                assert s["grad_rel_err"] < 1e-4, (
                    f"{backend} {name} step {k + 1} (plan {s['plan']}): the applied gradient is "
                    f"{s['grad_ratio']:.6f}x the full-batch mean's norm, max rel. error {s['grad_rel_err']:.3g}"
                )
                # (transformers 4.57 logs the loss rounded to 4 decimals.)
                rounding = 5e-5 if transformers_4() else 0
                assert s["logged_loss"] == pytest.approx(s["true_loss"], rel=1e-5, abs=rounding), (
                    f"{backend} {name} step {k + 1}: logged loss {s['logged_loss']}, true mean {s['true_loss']}"
                )


@pytest.mark.parametrize("backend", DEEPSPEED)
def test_uneven_and_padded_splits_match_the_reference(request, backend):
    out = _results(request, backend)
    # 14 samples on 2 ranks, max micro 3: 3+2+2 on each rank; 3 samples, max micro 1: 1+1 | 1+pad.
    expected = {"uneven": ([14, 3, 3], [[3, 2, 2], [3, 2, 2]]), "padded": ([3, 1, 2], [[1, 1], [1, 0]])}
    expected["uneven_sample"] = expected["uneven"]
    for rank in (0, 1):
        result = _read(out, "exact", backend, rank)
        for name, (plan, sizes) in expected.items():
            case = result[name]
            assert case["plan"] == plan, f"{name}: plan {case['plan']}, expected {plan}"
            assert case["sizes"] == sizes[rank], f"{name} rank {rank}: micro-batches {case['sizes']}"
            assert case["update"] > 1e-3, f"{name}: the step barely moved the weights"
            assert case["diff_vs_reference"] < TOL, (
                f"{name}: off the reference by {case['diff_vs_reference']}"
            )


@pytest.mark.multirank
def test_config_section_drives_the_batch_without_a_scheduler(ds_results):
    from hf_worker import RAMP, RAMP_SAMPLES

    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.data import ElasticSampler
    from ds_adabatch.plan import plan_batch
    from ds_adabatch.schedules import BatchSizeController, ScheduleContext

    # The same schedule, planner and sample stream replayed in this process.
    config = AdaBatchConfig.model_validate(RAMP)
    controller = BatchSizeController(config, 2)
    sampler = ElasticSampler(RAMP_SAMPLES, seed=42)
    expected, batch, step = [], controller.initial_global_batch(), 0
    while sampler.fractional_epoch < 2:
        ctx = ScheduleContext(step=step, samples=sampler.samples_consumed, global_batch=batch, world_size=2)
        batch = controller.next_global_batch(ctx).global_batch
        taken = sampler.next_batch(plan_batch(batch, 2, config.max_micro_batch_per_gpu))
        expected.append(
            [
                taken.plan.global_batch_size,
                taken.plan.micro_batch_per_gpu,
                taken.plan.gradient_accumulation_steps,
            ]
        )
        step += 1
    steps = _read(ds_results, "ramp", "ds", 0)["steps"]
    assert [s["plan"] for s in steps] == expected, (
        f"trained plans {[s['plan'] for s in steps]}, expected {expected}"
    )
    assert len({tuple(p) for p in expected}) > 2, "the ramp should change the batch several times"


# -- the gradient_noise schedule (DeepSpeed config section) --------------------------------------------
@pytest.mark.parametrize("backend", DEEPSPEED)
def test_noise_scale_estimate_near_closed_form_under_every_stage(request, backend):
    from engine_worker import NOISE_TRUTH

    estimates = _read(_results(request, backend), "noise", backend, 0)["estimate"]
    assert sorted(estimates) == (["z0", "z2"] if backend == "ds" else ["z0", "z3"])
    for stage, r in estimates.items():
        assert r["measurements"] == 60, f"{stage}: {r['measurements']} measured steps, expected 60"
        assert r["plan"] == "global 64 = micro 8 x gas 4 on 2 ranks", f"{stage}: the batch moved: {r['plan']}"
        rel = abs(r["noise_scale"] - NOISE_TRUTH) / NOISE_TRUTH
        assert rel <= 0.2, f"{stage}: B_noise estimate {r['noise_scale']:.2f}, truth {NOISE_TRUTH:.2f}"
        assert r["logged"] and r["logged"][-1] == pytest.approx(r["noise_scale"], rel=1e-12), (
            f"{stage}: training logs carry no noise_scale or a stale one"
        )
    # ZeRO 0 reads the reduced .grad between backward and step, ZeRO 2/3 DeepSpeed's global norm: the
    # same measurement either way.
    z0, other = (r["noise_scale"] for r in estimates.values())
    assert z0 == pytest.approx(other, rel=1e-6)


@pytest.mark.parametrize("backend", DEEPSPEED)
def test_gradient_noise_schedule_moves_the_batch_and_resumes_its_estimate(request, backend):
    from hf_worker import NOISE_SAVE_AT, NOISE_STEPS

    r = _read(_results(request, backend), "noise", backend, 0)
    first, second = r["follow"]
    plans = first["plans"]
    assert len(plans) == NOISE_STEPS
    assert plans[:3] == [8, 8, 8], f"warm-up of 3 steps must hold the start batch: {plans}"
    # At step 3 the target is scale (1) x the estimate logged after step 3, rounded to granularity 4.
    estimate = first["noise"]["3"]
    assert plans[3] == 4 * round(estimate / 4) and plans[3] > 8, (
        f"step 3 trained {plans[3]} samples with an estimate of {estimate:.2f}"
    )
    assert all(p % 4 == 0 for p in plans)
    saved = r["saved_noise"]
    assert saved["kind"] == "GradientNoiseEstimator" and saved["count"] == NOISE_SAVE_AT
    assert second["plans"] == plans[NOISE_SAVE_AT:], f"resumed plans {second['plans']} vs {plans}"
    later = {k: v for k, v in second["noise"].items() if int(k) > NOISE_SAVE_AT}
    assert sorted(later, key=int) == [str(k) for k in range(NOISE_SAVE_AT + 1, NOISE_STEPS + 1)], later
    for step, value in later.items():
        assert value == pytest.approx(first["noise"][step], rel=1e-9), (
            f"step {step}: resumed estimate {value} vs {first['noise'][step]}"
        )


@pytest.mark.parametrize("backend", DEEPSPEED)
def test_goodput_schedule_climbs_where_a_bigger_batch_costs_nothing_more(request, backend):
    """The goodput schedule drives the Trainer too: with a simulated flat step time the batch climbs to
    max_global_batch, the step-time model learns the flat cost, every move says why."""
    from hf_worker import GOODPUT_STEPS

    r = _read(_results(request, backend), "noise", backend, 0)["goodput"]
    plans = r["plans"]
    assert len(plans) == GOODPUT_STEPS and plans[:3] == [8, 8, 8], plans
    assert plans[-1] == 32 and r["moves"] >= 1, f"a flat step time must end at max_global_batch 32: {plans}"
    assert all(p % 4 == 0 for p in plans)
    assert r["fit_fixed"] == pytest.approx(0.05, rel=1e-6), r
    assert "samples/s x efficiency" in r["reason"], r["reason"]
    # Its JSONL records carry the rating of the batch each decision chose, as the runtime's do.
    rated = [rec for rec in r["records"] if "goodput" in rec]
    assert rated and len(r["records"]) == GOODPUT_STEPS, r["records"][-1]
    for rec in rated:
        assert rec["goodput"] == pytest.approx(rec["predicted_samples_per_s"] * rec["efficiency"])
    # lr_scaling "adascale": AdaScale's gain ^ 0.5 at the estimate the coupling read, applied to the LR.
    ref = r["reference"]
    for plan, (noise, mult, applied) in zip(plans, r["coupling"]):
        if noise is None:  # no estimate yet
            gain = 1.0
        elif noise == math.inf:  # the gradient reads as all noise: the batch ratio
            gain = plan / ref
        else:
            gain = plan / ref * (noise + ref) / (noise + plan)
        assert mult == pytest.approx(gain**0.5, rel=1e-9), (plan, noise, mult)
        assert applied is None or applied == pytest.approx(mult, rel=1e-6), (plan, noise, mult, applied)
    assert any(noise is not None and mult > 1.0 and applied for noise, mult, applied in r["coupling"]), r[
        "coupling"
    ]


# -- token budgets (micro_batch_tokens) on 2 ranks, DeepSpeed ZeRO-2 -----------------------------------
def _token_runs(ds_results) -> list[dict]:
    return [_read(ds_results, "tokens", "ds", rank) for rank in (0, 1)]


@pytest.mark.multirank
def test_token_budget_bounds_every_forward_pass(ds_results):
    from hf_worker import SAMPLE_STEPS_SECTION, TOKEN_BUDGET

    for rank, run in enumerate(_token_runs(ds_results)):
        for key, budget in (
            ("first", TOKEN_BUDGET),
            ("sample_steps", SAMPLE_STEPS_SECTION["micro_batch_tokens"]),
        ):
            for s in run[key]:
                # One forward per pass, pads included; input_ids.numel() is the padded tokens of the pass.
                assert len(s["numels"]) == len(s["sizes"]), (
                    f"{key} rank {rank} step {s['step']}: {len(s['numels'])} forward passes for "
                    f"{len(s['sizes'])} micro-batches"
                )
                assert max(s["numels"]) <= budget, (
                    f"{key} rank {rank} step {s['step']}: a forward pass of {max(s['numels'])} tokens "
                    f"(padding included) over micro_batch_tokens {budget}: {s['numels']}"
                )
        assert max(s["sizes"][k] for s in run["sample_steps"] for k in range(len(s["sizes"]))) <= 3, (
            "max_micro_batch_per_gpu 3 must cap the samples of a pass"
        )


@pytest.mark.multirank
def test_token_steps_train_every_sample_once_per_epoch_across_ranks(ds_results):
    from hf_worker import TOKEN_SAMPLES

    zero, one = _token_runs(ds_results)
    epochs: dict[int, list[int]] = {}
    for a, b in zip(zero["first"], one["first"]):
        assert a["global"] == b["global"] and a["plan"] == b["plan"], f"step {a['step']}: ranks disagree"
        assert len(a["sizes"]) == len(b["sizes"]), f"step {a['step']}: ranks ran different numbers of passes"
        trained = [i for rank in (a, b) for m in rank["indices"] for i in m]
        assert sorted(trained) == sorted(a["global"]), (
            f"step {a['step']}: ranks trained {sorted(trained)}, the step holds {sorted(a['global'])}"
        )
        assert sum(a["sizes"]) + sum(b["sizes"]) == len(a["global"]) == a["plan"][0]
        epochs.setdefault(a["sample_epoch"], []).extend(trained)
    assert sorted(epochs) == [0, 1], f"epochs trained {sorted(epochs)}"
    for e, indices in epochs.items():
        assert sorted(indices) == list(range(TOKEN_SAMPLES)), f"epoch {e}: trained {sorted(indices)}"
    pads = sum(size == 0 for run in (zero, one) for s in run["first"] for size in s["sizes"])
    assert pads > 0, "the run should include zero-weight pad passes"


@pytest.mark.multirank
def test_token_steps_follow_the_tokens_unit_schedule_and_meet_each_target(ds_results):
    from hf_worker import TOKEN_SECTION, token_lengths_of

    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.data.lengths import SampleLengths
    from ds_adabatch.data.tokens import TokenBudgetSampler
    from ds_adabatch.schedules import BatchSizeController, ScheduleContext

    lengths = token_lengths_of()
    # The same schedule and token sampler replayed in this process (seed 5 as in the worker's args).
    config = AdaBatchConfig.model_validate(TOKEN_SECTION)
    controller = BatchSizeController(config, 2)
    sampler = TokenBudgetSampler(
        SampleLengths(len(lengths), lengths=lengths),
        micro_batch_tokens=config.micro_batch_tokens,
        bucket_window=config.bucket_window,
        seed=5,
        step_unit="tokens",
    )
    expected, target, step = [], controller.initial_global_batch(), 0
    while sampler.fractional_epoch < 2:
        ctx = ScheduleContext(
            step=step,
            samples=sampler.samples_consumed,
            global_batch=target,
            world_size=2,
            tokens=sampler.tokens_consumed,
            epoch=sampler.fractional_epoch,
        )
        target = controller.next_global_batch(ctx).global_batch
        expected.append((target, sampler.next_step(target, 2).indices.tolist()))
        step += 1
    steps = _token_runs(ds_results)[0]["first"]
    assert [(s["target"], s["global"]) for s in steps] == expected, (
        f"trained (target, samples) {[(s['target'], s['global']) for s in steps]}, expected {expected}"
    )
    targets = [s["target"] for s in steps]
    assert targets[0] == 60 and targets[-1] == 140 and targets == sorted(targets), f"targets {targets}"
    for k, s in enumerate(steps):
        ends_epoch = k + 1 == len(steps) or steps[k + 1]["sample_epoch"] != s["sample_epoch"]
        assert s["tokens"] == sum(lengths[i] for i in s["global"])
        assert s["tokens"] >= s["target"] or ends_epoch, (
            f"step {s['step']}: {s['tokens']} tokens for a target of {s['target']}"
        )
        assert s["tokens"] - lengths[s["global"][-1]] < s["target"], (
            f"step {s['step']}: took more samples than the target of {s['target']} needs"
        )


@pytest.mark.multirank
def test_token_steps_equal_a_plain_pytorch_big_batch_reference(ds_results):
    from hf_worker import TOKEN_LR, TOKEN_SECTION

    for rank, run in enumerate(_token_runs(ds_results)):
        for key in ("reference_errors", "sample_reference_errors"):
            errors = run[key]
            assert len(errors) >= 4, f"{key}: only {len(errors)} steps compared"
            for k, e in enumerate(errors):
                assert e["update"] > 1e-3, f"{key} step {k + 1}: the reference barely moved ({e['update']})"
                assert e["relative"] < 1e-5, (
                    f"rank {rank} {key} step {k + 1}: parameters off the big-batch reference by "
                    f"{e['relative']:.3g} of the update (max abs {e['max_abs']:.3g})"
                )
        # lr_scaling "linear" follows the token target, not the step's sample count.
        start = TOKEN_SECTION["schedule"]["start"]
        for s in run["first"]:
            assert s["lr"] == pytest.approx(TOKEN_LR * s["target"] / start, rel=1e-9), (
                f"step {s['step']}: LR {s['lr']} for target {s['target']}"
            )


@pytest.mark.multirank
def test_token_steps_recover_from_out_of_memory_with_the_same_samples(ds_results):
    from hf_worker import TOKEN_OOM_AT

    for rank, run in enumerate(_token_runs(ds_results)):
        oom = run["oom"]
        assert oom["recovered"] >= 1, "rank 1 never ran out of memory: the run did not test recovery"
        assert oom["learned_budget"] <= TOKEN_OOM_AT, f"learned token budget {oom['learned_budget']}"
        assert [s["global"] for s in oom["steps"]] == [s["global"] for s in run["first"]], (
            "an out-of-memory retry changed the samples of a step"
        )
        passes = [len(s["sizes"]) for s in oom["steps"]]
        assert sum(passes) > sum(len(s["sizes"]) for s in run["first"]), f"passes {passes}: never re-cut"
        for k, e in enumerate(oom["reference_errors"]):
            assert e["relative"] < 1e-5, (
                f"rank {rank} step {k + 1} after out-of-memory retries: off the reference by {e['relative']:.3g}"
            )


@pytest.mark.multirank
def test_token_sample_count_steps_hold_exactly_the_scheduled_samples(ds_results):
    from hf_worker import SAMPLE_STEPS_SECTION, TOKEN_SAMPLES

    value = SAMPLE_STEPS_SECTION["schedule"]["value"]
    steps = _token_runs(ds_results)[0]["sample_steps"]
    sizes = [len(s["global"]) for s in steps]
    assert sizes == [value] * (TOKEN_SAMPLES // value) + [TOKEN_SAMPLES % value], f"samples per step {sizes}"
    assert sorted(i for s in steps for i in s["global"]) == list(range(TOKEN_SAMPLES))


@pytest.mark.multirank
def test_goodput_over_token_budget_steps_climbs_by_passes_and_stays_exact(ds_results):
    """The goodput schedule in the Trainer with micro_batch_tokens: a step's shape is (its token budget,
    its passes per rank); with a flat step time the batch climbs from start to max_global_batch on step
    cost alone, every step equal to the big-batch reference, every sample once per epoch."""
    from hf_worker import GOODPUT_TOKENS_SECTION, TOKEN_SAMPLES

    section = GOODPUT_TOKENS_SECTION
    for rank, run in enumerate(_token_runs(ds_results)):
        r = run["goodput"]
        sizes = [len(s["global"]) for s in r["steps"]]
        assert sizes[0] == section["schedule"]["start"] and max(sizes) == section["max_global_batch"], sizes
        assert r["moves"] >= 1, f"rank {rank}: the batch never moved: {sizes}"
        assert {m for m, _ in r["shapes"]} == {section["micro_batch_tokens"]}, r["shapes"]
        assert any(g > 1 for _, g in r["shapes"]), f"some step must need several passes: {r['shapes']}"
        for k, e in enumerate(r["reference_errors"]):
            assert e["relative"] < 1e-5, f"rank {rank} step {k + 1}: off the reference by {e['relative']:.3g}"
        epochs: dict[int, list[int]] = {}
        for s in r["steps"]:
            assert max(s["numels"]) <= section["micro_batch_tokens"], s["numels"]
            epochs.setdefault(s["sample_epoch"], []).extend(s["global"])
        assert sorted(epochs) == [0, 1], sorted(epochs)
        for e, indices in epochs.items():
            assert sorted(indices) == list(range(TOKEN_SAMPLES)), f"epoch {e}: trained {sorted(indices)}"


@pytest.mark.multirank
def test_token_resume_continues_the_same_stream(ds_results):
    from hf_worker import TOKEN_SAVE_AT

    for rank, run in enumerate(_token_runs(ds_results)):
        keys = ("step", "indices", "plan", "target", "lr")
        expected = [[s[k] for k in keys] for s in run["first"][TOKEN_SAVE_AT:]]
        resumed = [[s[k] for k in keys] for s in run["second"]]
        assert resumed == expected, f"rank {rank}: resumed steps {resumed}, uninterrupted {expected}"
        assert run["resume_param_diff"] < 1e-6, (
            f"rank {rank}: final weights differ by {run['resume_param_diff']}"
        )


@pytest.mark.multirank
def test_token_logs_count_real_samples_and_tokens(ds_results):
    from hf_worker import TOKEN_SAMPLES, token_lengths_of

    run = _token_runs(ds_results)[0]
    logs, steps = run["logs"], run["first"]
    assert len(logs) == len(steps), f"{len(logs)} training logs for {len(steps)} steps"
    total = 0
    other = _token_runs(ds_results)[1]["first"]
    for entry, s, t in zip(logs, steps, other):
        total += s["tokens"]
        shape = [entry["global_batch_size"], entry["micro_batch_size"], entry["gradient_accumulation_steps"]]
        largest = max(len(m) for rank in (s, t) for m in rank["indices"])
        trained = [len(s["global"]), largest, len(s["sizes"])]
        assert shape == trained, (
            f"step {s['step']}: logged {shape}, trained (samples, largest pass, passes) {trained}"
        )
        assert entry["global_batch_tokens"] == s["tokens"] and entry["train_tokens"] == total, (
            f"step {s['step']}: logged {entry['global_batch_tokens']} / {entry['train_tokens']} tokens, "
            f"trained {s['tokens']} / {total}"
        )
    final = run["final"]
    assert final["tokens"] == 2 * sum(token_lengths_of()) and final["samples"] == 2 * TOKEN_SAMPLES, final
    assert final["epoch"] == pytest.approx(2.0) and final["max_steps"] == final["global_step"] == len(
        steps
    ), final


# -- token budgets in one process: lengths, errors, cross-world resume (no training) -------------------
def _token_args(**overrides):
    from hf_worker import TOKEN_SECTION, ds_config

    base = {
        "world_size": 1,
        "process_index": 0,
        "per_device_train_batch_size": 1,
        "deepspeed": ds_config(TOKEN_SECTION),
        "data_seed": None,
        "seed": 5,
        "dataloader_drop_last": False,
        "dataloader_num_workers": 0,
        "dataloader_multiprocessing_context": None,
        "max_steps": -1,
        "num_train_epochs": 2,
        "device": torch.device("cpu"),
        "length_column_name": "length",
        "train_sampling_strategy": "random",
    }
    return SimpleNamespace(**{**base, **overrides})


class _Columns(torch.utils.data.Dataset):
    """A map-style dataset with a ``datasets``-like column API; counts the samples it is asked for."""

    def __init__(self, lengths: list[int], column: str = "length") -> None:
        self.lengths, self.column, self.reads = lengths, column, 0
        self.column_names = ["input_ids", column]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, key):
        if isinstance(key, str):
            return {"input_ids": [[1] * k for k in self.lengths], self.column: list(self.lengths)}[key]
        self.reads += 1
        return {"input_ids": [1] * self.lengths[key], self.column: self.lengths[key]}


class _Samples(torch.utils.data.Dataset):
    """Samples as a list of dicts; counts reads."""

    def __init__(self, samples: list) -> None:
        self.samples, self.reads = samples, 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        self.reads += 1
        return self.samples[i]


def test_token_lengths_come_from_the_argument_the_column_or_each_sample():
    import numpy as np

    from ds_adabatch.integrations.hf.prepare import token_lengths

    lengths = [5, 3, 9, 4]
    everything = np.arange(len(lengths))

    def read(found):
        return found.get(everything).tolist()

    # The length column: read once as a whole, no sample is loaded (also with another column name).
    columns = _Columns(lengths, column="n_tokens")
    found = token_lengths(_token_args(length_column_name="n_tokens"), columns)
    assert found.complete and read(found) == lengths and columns.reads == 0, (
        f"{read(found)}, {columns.reads} reads"
    )
    # lengths= wins over the column; length_fn is lazy (no call before a step reaches a sample).
    assert read(token_lengths(_token_args(), _Columns(lengths), lengths=[7, 7, 7, 7])) == [7] * 4
    calls = []
    lazy = token_lengths(
        _token_args(), _Samples([{"x": k} for k in lengths]), length_fn=lambda s: calls.append(1) or s["x"]
    )
    assert not calls and not lazy.complete
    assert lazy.get(np.array([2])).tolist() == [9] and len(calls) == 1
    # Default, per sample: a "length" key, else len(input_ids) (or the processing class's main input).
    keyed = _Samples([{"input_ids": [1] * 20, "length": k} for k in lengths])
    found = token_lengths(_token_args(), keyed)
    assert keyed.reads == 1, f"{keyed.reads} samples read at start-up (only sample 0 is checked)"
    assert read(found) == lengths
    plain = _Samples([{"input_ids": list(range(k))} for k in lengths])
    assert read(token_lengths(_token_args(), plain)) == lengths
    audio = _Samples([{"input_values": [0.0] * k} for k in lengths])
    assert read(token_lengths(_token_args(), audio, input_name="input_values")) == lengths
    # Without micro_batch_tokens there is nothing to measure.
    assert token_lengths(_token_args(deepspeed=None), plain) is None


def test_token_lengths_read_a_datasets_column_once():
    datasets = pytest.importorskip("datasets")
    import numpy as np

    from ds_adabatch.integrations.hf.prepare import token_lengths

    lengths = [5, 3, 9, 4, 11, 2]
    table = datasets.Dataset.from_dict({"input_ids": [[1] * k for k in lengths], "length": lengths})
    view = table.select([4, 0, 2, 5])  # an indices mapping: the column must follow it
    found = token_lengths(_token_args(), view)
    assert found.complete and found.get(np.arange(4)).tolist() == [11, 5, 9, 2]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("wrong_size", r"one length per sample \(36\), got shape \(35,\)"),
        ("too_long", r"sample 3 has length 50 tokens, above micro_batch_tokens 40"),
        ("not_positive", r"sample 1 has length 0"),
        ("both", r"either lengths= or length_fn="),
        ("without_budget", r"only apply with adabatch.micro_batch_tokens"),
        ("unmeasurable", r"no 'length' or 'input_ids'.*sample 0: \['text'\]"),
    ],
)
def test_token_budget_errors_come_before_any_process_group(tmp_path, case, match):
    from hf_worker import TOKEN_SECTION, VariableLengthText, ds_config, token_gpt2, token_lengths_of
    from transformers import TrainingArguments

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    lengths = token_lengths_of()
    section = {k: v for k, v in TOKEN_SECTION.items() if k != "bucket_window"}
    kwargs: dict = {"train_dataset": VariableLengthText()}
    if case == "wrong_size":
        kwargs["lengths"] = lengths[:-1]
    elif case == "too_long":
        kwargs["lengths"] = lengths[:3] + [50] + lengths[4:]
    elif case == "not_positive":
        kwargs["lengths"] = [4, 0] + lengths[2:]
    elif case == "both":
        kwargs.update(lengths=lengths, length_fn=len)
    elif case == "without_budget":
        section = {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2}
        kwargs["lengths"] = lengths
    else:
        kwargs["train_dataset"] = _Samples([{"text": "no tokens"}] * 4)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed=ds_config(section)
    )
    with pytest.raises(ValueError, match=match):
        AdaptiveBatchSizeTrainer(model=token_gpt2(), args=args, **kwargs)
    assert not torch.distributed.is_initialized(), "the error came after a process group started"


def _token_state(world: int, rank: int, dataset, lengths=None, **section_overrides):
    from hf_worker import TOKEN_SECTION, ds_config

    from ds_adabatch.integrations.hf.prepare import build_batch_state, token_lengths

    args = _token_args(
        world_size=world, process_index=rank, deepspeed=ds_config({**TOKEN_SECTION, **section_overrides})
    )
    if lengths is None:
        lengths = token_lengths(args, dataset)
    return build_batch_state(
        args,
        dataset,
        list,
        batch_size_scheduler=None,
        gradient_accumulation_steps=1,
        max_micro_batch_per_gpu=None,
        lengths=lengths,
    )


def _drive(states, first: int, count: int) -> list[list[int]]:
    """Every rank's state through ``count`` steps as the Trainer drives it (loader, then the callback's
    next decision); returns each step's samples in order."""
    trained = []
    for step in range(first, first + count):
        batches = [s.loader.next_step(s.plan_for_step(step)) for s in states]
        for s, b in zip(states, batches):
            s.last_step, s.plan = b, b.plan
            s.tokens += b.global_batch.tokens  # as the Trainer's step does
            s.plan_for_step(step + 1)
        assert len({len(b.micro_batches) for b in batches}) == 1, "ranks must run the same passes"
        assert sorted(i for b in batches for m in b.micro_batches for i in m.indices) == sorted(
            batches[0].global_batch.indices.tolist()
        )
        trained.append(batches[0].global_batch.indices.tolist())
    return trained


def test_a_token_checkpoint_resumes_the_same_stream_on_another_world_size():
    import json

    from hf_worker import VariableLengthText

    data = VariableLengthText()
    two = [_token_state(2, rank, data) for rank in (0, 1)]
    before = _drive(two, 0, 3)
    saved = json.loads(json.dumps(two[0].state_dict(3)))
    uninterrupted = _drive(two, 3, 4)
    one = _token_state(1, 0, data)
    one.load_state_dict(saved, 3)
    resumed = _drive([one], 3, 4)
    assert resumed == uninterrupted, f"after the resume on 1 rank: {resumed}; on 2 ranks: {uninterrupted}"
    assert one.tokens == two[0].tokens and one.samples_consumed == two[0].samples_consumed
    assert len(before) == 3
    # The LR multiplier compares token targets (linear rule): target / the initial target.
    assert one.lr.target_reference == 60
    assert one.lr_batch(one.plan) / one.lr.reference_batch == pytest.approx(one.scheduled_batch / 60)
    # A sample-count checkpoint cannot continue a token stream (and the other way round).
    samples = _token_state(
        1,
        0,
        data,
        micro_batch_tokens=None,
        max_micro_batch_per_gpu=2,
        schedule={"type": "constant", "value": 4},
        bucket_window=0,
    )
    with pytest.raises(ValueError, match="written with adabatch.micro_batch_tokens"):
        samples.load_state_dict(saved, 3)


def test_a_lazily_measured_sample_over_the_budget_is_named_when_reached():
    from hf_worker import VariableLengthText

    from ds_adabatch.data.lengths import SampleLengths

    data, long_one = VariableLengthText(), 7

    def measure(sample):
        return 99 if sample["input_ids"] is data.ids[long_one] else len(sample["input_ids"])

    lengths = SampleLengths(len(data), length_fn=measure, dataset=data)
    with pytest.raises(
        ValueError, match=rf"sample {long_one} has length 99 tokens, above micro_batch_tokens 40"
    ):
        _drive([_token_state(1, 0, data, lengths=lengths)], 0, 10)


# -- one process, no DeepSpeed -----------------------------------------------------------------------
def _trainer(tmp_path, dataset, *, scheduler=None, model=None, max_micro=None, eval_dataset=None, **args):
    from hf_worker import Regressor, StepRecorder
    from hf_worker import _args as quiet_args

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=scheduler,
        model=model if model is not None else Regressor(),
        args=quiet_args(tmp_path, **{"per_device_train_batch_size": 1, "learning_rate": 0.05, **args}),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        max_micro_batch_per_gpu=max_micro,
    )
    recorder = StepRecorder(trainer)
    trainer.add_callback(recorder)
    return trainer, recorder


def _seed_scheduler():
    from functools import partial

    from hf_worker import custom_batch_size_scheduler

    return partial(custom_batch_size_scheduler, interval=5, increment=1)


def test_single_process_without_deepspeed_trains_every_sample_once_per_epoch(tmp_path):
    from hf_worker import IndexRegression

    trainer, rec = _trainer(
        tmp_path,
        IndexRegression(),
        scheduler=_seed_scheduler(),
        num_train_epochs=2,
        dataloader_num_workers=2,
        eval_strategy="epoch",
        eval_dataset=IndexRegression(4),
    )
    trainer.train()
    sizes = [sum(s["sizes"]) for s in rec.steps]
    assert sizes == [1, 1, 1, 1, 1, 2, 2, 1, 2, 2, 3, 3], f"samples per step {sizes}"
    epochs = _epochs_of([rec.steps])
    assert [sorted(e) for e in epochs] == [list(range(10))] * 2, f"epochs trained {epochs}"
    assert max(s["workers"] for s in rec.steps) == 2, "the 2 dataloader workers never ran"
    assert trainer.state.max_steps == trainer.state.global_step == 12, (
        f"max_steps {trainer.state.max_steps} / global_step {trainer.state.global_step}, expected 12"
    )
    # Linear decay over the 20 samples of 2 epochs (one scheduler tick per initial batch of 1 sample).
    assert trainer.lr_scheduler.inner_steps == 20, (
        f"LR schedule ticked {trainer.lr_scheduler.inner_steps} times"
    )
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12), (
        "LR did not reach 0 at the end"
    )
    evals = [e["epoch"] for e in trainer.state.log_history if "eval_loss" in e]
    assert evals == [1.0, 2.0], f"eval_strategy='epoch' evaluated at epochs {evals}"


def test_max_steps_ends_training_across_epoch_boundaries(tmp_path):
    from hf_worker import IndexRegression

    trainer, rec = _trainer(tmp_path, IndexRegression(6), scheduler=_seed_scheduler(), max_steps=8)
    trainer.train()
    assert trainer.state.global_step == 8, f"trained {trainer.state.global_step} steps, max_steps=8"
    sizes = [sum(s["sizes"]) for s in rec.steps]
    assert sizes == [1, 1, 1, 1, 1, 1, 2, 2], (
        f"samples per step {sizes} (step 6 is the epoch's 1-sample tail)"
    )
    first = [i for s in rec.steps[:6] for m in s["indices"] for i in m]
    assert sorted(first) == list(range(6)), f"first epoch trained {first}"
    assert trainer.lr_scheduler.inner_steps == 8, "with max_steps the LR schedule advances once per step"
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_dataloader_drop_last_skips_each_epoch_tail(tmp_path):
    from hf_worker import IndexRegression

    trainer, rec = _trainer(
        tmp_path,
        IndexRegression(7),
        per_device_train_batch_size=2,
        num_train_epochs=2,
        dataloader_drop_last=True,
    )
    trainer.train()
    assert [s["sizes"] for s in rec.steps] == [[2]] * 6, f"micro-batches {[s['sizes'] for s in rec.steps]}"
    for e in range(2):
        got = [i for s in rec.steps[3 * e : 3 * e + 3] for m in s["indices"] for i in m]
        assert len(set(got)) == 6, f"epoch {e}: trained {got}, expected 6 distinct of the 7 samples"
    assert rec.steps[2]["coverage"] == pytest.approx(6 / 7), "the dropped tail still counts as trained"
    assert trainer.state.global_step == trainer.state.max_steps == 6


def test_drop_last_epochs_end_whole_and_the_lr_schedule_ends_with_them(tmp_path):
    from hf_worker import IndexRegression

    # 10 samples, batch 3 for 3 steps, then 4: epoch tails of 1, 2 and 2 samples are skipped, so 25 of
    # the 30 samples of 3 epochs are trained.
    trainer, rec = _trainer(
        tmp_path,
        IndexRegression(10),
        scheduler=lambda step, batch: 3 if step < 3 else 4,
        per_device_train_batch_size=3,
        num_train_epochs=3,
        dataloader_drop_last=True,
    )
    trainer.train()
    assert [sum(s["sizes"]) for s in rec.steps] == [3, 3, 3, 4, 4, 4, 4], [s["sizes"] for s in rec.steps]
    epochs = [round(s["epoch"], 6) for s in rec.steps]
    assert epochs == [0.3, 0.6, 1.0, 1.4, 2.0, 2.4, 3.0], f"state.epoch per step {epochs}"
    assert trainer.state.epoch == pytest.approx(3.0), f"the run ended at epoch {trainer.state.epoch}"
    # Linear decay over the stream's 30 samples, one tick per 3 (the initial batch): it must reach 0.
    assert trainer.lr_scheduler.inner_steps == 10, f"LR ticked {trainer.lr_scheduler.inner_steps} of 10"
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12), (
        f"LR ended at {trainer.lr_scheduler.get_last_lr()[0]}, not at the schedule's end"
    )


def test_fractional_epochs_stop_by_samples_and_accumulation_comes_from_args(tmp_path):
    from hf_worker import IndexRegression

    trainer, rec = _trainer(
        tmp_path,
        IndexRegression(10),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        num_train_epochs=1.5,
    )
    trainer.train()
    assert [s["plan"] for s in rec.steps] == [[2, 1, 2]] * 8, f"plans {[s['plan'] for s in rec.steps]}"
    assert rec.steps[-1]["epoch"] == pytest.approx(1.6), (
        f"stopped at epoch {rec.steps[-1]['epoch']}, not past 1.5"
    )
    assert trainer.args.gradient_accumulation_steps == 1, "the Trainer's own loop must see one item per step"
    assert trainer.user_gradient_accumulation_steps == 2


def test_tokens_seen_count_every_real_token_once(tmp_path):
    from hf_worker import SEQ, TokenWindows, tiny_gpt2

    trainer, _ = _trainer(
        tmp_path,
        TokenWindows(8),
        model=tiny_gpt2(),
        per_device_train_batch_size=4,
        max_micro=2,
        num_train_epochs=1,
        include_num_input_tokens_seen="all",
    )
    trainer.train()
    assert trainer.state.num_input_tokens_seen == 8 * SEQ, (
        f"counted {trainer.state.num_input_tokens_seen} tokens"
    )


def test_a_bad_scheduler_answer_is_reported(tmp_path):
    from hf_worker import IndexRegression

    from ds_adabatch.schedules import ScheduleError

    trainer, _ = _trainer(tmp_path, IndexRegression(), scheduler=lambda step, bs: 0 if step == 2 else bs)
    with pytest.raises(ScheduleError, match="positive int"):
        trainer.train()


def test_resume_at_an_epoch_boundary_starts_the_next_epoch(tmp_path):
    from hf_worker import IndexRegression, flat

    common = {"per_device_train_batch_size": 2, "num_train_epochs": 2, "seed": 3}
    first, rec1 = _trainer(tmp_path / "a", IndexRegression(), save_strategy="steps", save_steps=5, **common)
    first.train()
    second, rec2 = _trainer(tmp_path / "b", IndexRegression(), **common)
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-5"))
    expected = [(s["step"], s["indices"], s["epoch"]) for s in rec1.steps[5:]]
    resumed = [(s["step"], s["indices"], s["epoch"]) for s in rec2.steps]
    assert resumed == expected, f"resumed {resumed}, uninterrupted {expected}"
    assert torch.equal(flat(first.model), flat(second.model)), "the resumed run ended with other weights"
    lr1, lr2 = first.lr_scheduler.state_dict(), second.lr_scheduler.state_dict()
    assert lr1["samples"] == lr2["samples"] == 20 and lr1["inner_steps"] == lr2["inner_steps"], (
        f"LR coupling state after the runs: {lr1} vs {lr2}"
    )


def test_resume_needs_the_adabatch_state_file(tmp_path):
    from hf_worker import IndexRegression

    from ds_adabatch.integrations.hf.state import STATE_FILE

    trainer, _ = _trainer(tmp_path, IndexRegression(), max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / STATE_FILE).is_file(), (
        f"no {STATE_FILE} in {sorted(p.name for p in checkpoint.iterdir())}"
    )
    (checkpoint / STATE_FILE).unlink()
    again, _ = _trainer(tmp_path, IndexRegression(), max_steps=4)
    with pytest.raises(ValueError, match=STATE_FILE):
        again.train(resume_from_checkpoint=str(checkpoint))


# -- the duplicate-training guard, without launching ---------------------------------------------------
def test_guard_raises_naming_use_cpu_where_it_cannot_fix(monkeypatch):
    from ds_adabatch.integrations.hf.dist import ensure_data_parallel_group

    args = SimpleNamespace(world_size=1, device=torch.device("mps"), use_cpu=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"use_cpu=True") as err:
        ensure_data_parallel_group(args)
    assert "2-fold duplicate training" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ensure_data_parallel_group(args) is args, "a world of one needs no fix"


def test_importing_the_package_does_not_import_transformers():
    code = (
        "import sys, ds_adabatch, ds_adabatch.integrations\n"
        "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)\n"
        "ds_adabatch.integrations.AdaptiveBatchSizeTrainer\n"
        "assert 'transformers' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"lazy import broken:\n{proc.stderr[-2000:]}"


def test_steps_left_estimate_is_exact_for_a_constant_batch():
    # A pure check of the progress estimate: 2 epochs of 10 samples at 4 per step, tails included.
    from ds_adabatch.integrations.hf.progress import StreamProgress
    from ds_adabatch.integrations.hf.state import AdaptiveBatchState

    fake = SimpleNamespace(
        sampler=SimpleNamespace(num_samples=10, drop_last=False, epoch=0, position=0),
        plan_for_step=lambda step: SimpleNamespace(global_batch_size=4),
        num_train_epochs=2.0,
    )
    fake.progress = StreamProgress(fake)  # the state's progress, reading the fake as its host
    assert AdaptiveBatchState.steps_left(fake, 0) == 2 * math.ceil(10 / 4)
    fake.sampler.drop_last = True
    assert AdaptiveBatchState.steps_left(fake, 0) == 2 * (10 // 4)
    fake.sampler.position, fake.num_train_epochs = 8, 1.0
    assert AdaptiveBatchState.steps_left(fake, 0) == 0, "an undersized tail with drop_last is no step"


def test_a_trainer_step_is_timed_from_before_its_decision_and_its_data():
    """goodput's step time in the Trainer includes the step's decision and drawing and collating its
    samples, as the engine's train_batch does: the loader marks each step's start before both."""
    import time

    from ds_adabatch.integrations.hf.data import StepLoader
    from ds_adabatch.integrations.hf.prepare import build_batch_state

    class Timed(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.read_at: list[float] = []

        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            self.read_at.append(time.perf_counter())
            return torch.tensor([float(i)])

    data = Timed()
    state = build_batch_state(
        _token_args(deepspeed=None, per_device_train_batch_size=4),
        data,
        torch.stack,
        batch_size_scheduler=lambda step, batch_size: 4,
        gradient_accumulation_steps=1,
        max_micro_batch_per_gpu=2,
    )
    decided_at: list[float] = []
    decide = state.core.decide

    def timed_decide(step):
        decided_at.append(time.perf_counter())
        return decide(step)

    state.core.decide = timed_decide
    completed = [0]
    items = iter(StepLoader(state, lambda: completed[0]))
    for _ in range(2):
        before, decisions = len(data.read_at), len(decided_at)
        item = next(items)
        reads, decided = data.read_at[before:], decided_at[decisions:]
        assert len(reads) == 4 and len(decided) == 1, (reads, decided)
        assert item.started is not None and item.started <= decided[0] <= min(reads), (item.started, decided)
        completed[0] += 1
    state.close()

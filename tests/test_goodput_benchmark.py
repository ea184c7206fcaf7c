"""``benchmarks/time_to_target.py --smoke`` end to end: each policy trains in its own process and every
output exists and is well formed, one policy after another and in turns (``--interleave``). Three of the five policies run (a fixed batch and the two that measure
the noise scale, on one rank at GAS 1): each costs a process start, and linear differs from fixed only
in its schedule config. Only structure is checked, never a timing or a ratio: those
depend on the machine and its load (the measurement itself is run by hand, on an idle machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _util import failure_excerpt

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["fixed-16", "gradient_noise", "goodput"]


def _smoke(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "time_to_target.py"), "--smoke", "--seconds", "2", *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"the smoke run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_time_to_target_smoke_one_policy_after_another(tmp_path):
    out = tmp_path / "ttt"
    _smoke(out, "--only", "fixed-4")
    curve = json.loads((out / "results.json").read_text())["results"]["fixed-4"]["curve"]
    assert len(curve) >= 2 and curve[-1]["train_s"] >= 2.0 and curve[-1]["steps"] > 0, curve


def test_time_to_target_smoke_in_turns(tmp_path):
    out = tmp_path / "ttt"
    proc = _smoke(out, "--interleave", "--only", *POLICIES)
    results = json.loads((out / "results.json").read_text())
    assert list(results["results"]) == POLICIES
    for name, run in results["results"].items():
        curve = run["curve"]
        assert len(curve) >= 2, f"{name}: no validation after training"
        assert curve[0]["train_s"] == 0.0 and curve[-1]["train_s"] >= 2.0, f"{name}: {curve}"
        assert all(p["val"] > 0 for p in curve) and curve[-1]["steps"] > 0, f"{name}: {curve}"
        # CPU seconds in training: the process ran while it trained, and not more than two cores' worth.
        assert 0 < curve[-1]["cpu_s"] <= 2 * curve[-1]["train_s"] + 1, f"{name}: {curve[-1]}"
        assert run["config"]["adabatch"]["max_global_batch"] == 16
        # Each slice's first steps are timed (what a pause costs), on the CPU's clock.
        assert all(0 < len(p["first_steps_s"]) <= 12 for p in curve[1:]), f"{name}: {curve}"
        assert all(t > 0 for p in curve[1:] for t in p["first_steps_s"]), f"{name}: {curve}"
    for target, row in results["summary"].items():
        assert set(row["times"]) == set(POLICIES), target
    assert (out / "time_to_target.png").stat().st_size > 0
    assert "to val" in proc.stdout
    # In turns: round k holds every policy's k-th slice, so each ends before any (k+1)-th (the order
    # within a round rotates).
    ends = {name: [p["ended_at"] for p in run["curve"][1:]] for name, run in results["results"].items()}
    rounds = min(len(e) for e in ends.values())
    assert rounds >= 2, ends
    for k in range(rounds - 1):
        assert max(e[k] for e in ends.values()) < min(e[k + 1] for e in ends.values()), (k, ends)
    firsts = [min(ends, key=lambda name: ends[name][k]) for k in range(rounds)]
    assert len(set(firsts)) > 1, f"every round began with the same policy: {firsts}"


def test_time_to_a_target_is_interpolated_between_validations():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import time_to

    curve = [
        {"train_s": 0.0, "val": 5.0},
        {"train_s": 4.0, "val": 2.2},
        {"train_s": 8.0, "val": 1.8},
        {"train_s": 12.0, "val": 1.9},
    ]
    assert time_to(curve, 2.0) == pytest.approx(6.0)  # halfway from 2.2 at 4 s to 1.8 at 8 s
    assert time_to(curve, 1.8) == pytest.approx(8.0)
    assert time_to(curve, 6.0) == 0.0
    assert time_to(curve, 1.7) is None


def test_the_measured_efficiency_is_the_start_batch_samples_over_each_fixed_batch_samples():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import efficiencies, time_to

    def curve(samples_at):  # validation 2.4 / 2.2 / 2.0 reached at these sample counts
        return [{"train_s": float(i), "samples": n, "val": v} for i, (n, v) in enumerate(samples_at)]

    results = {
        "fixed-8": {"curve": curve([(0, 3.0), (100, 2.4), (300, 2.2), (500, 2.0)])},
        "fixed-16": {"curve": curve([(0, 3.0), (160, 2.4), (360, 2.2), (760, 2.0)])},
        "fixed-32": {"curve": curve([(0, 3.0), (200, 2.4), (500, 2.2)])},  # never reaches 2.0
        "goodput": {"curve": curve([(0, 3.0), (100, 2.4), (200, 2.0)])},  # not a fixed batch: left out
    }
    assert time_to(results["fixed-16"]["curve"], 2.3, "samples") == pytest.approx(260)
    got = efficiencies(results, [2.4, 2.2, 2.0], 8)
    assert got["2.4-2.2"] == {"fixed-16": pytest.approx(1.0), "fixed-32": pytest.approx(200 / 300)}
    assert got["2.2-2.0"] == {"fixed-16": pytest.approx(0.5), "fixed-32": None}
    assert got["2.4-2.0"] == {"fixed-16": pytest.approx(400 / 600), "fixed-32": None}
    assert efficiencies(results, [2.4, 2.2], 4) == {}  # no fixed batch at start: nothing to compare


def test_a_fixed_batch_that_never_reaches_a_target_counts_as_later_than_every_one_that_does(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import main, summarise

    def curve(reached_at):  # validation 2.0 -> 1.0 at these training seconds (None: never)
        end = 30.0 if reached_at is None else reached_at
        return [
            {"train_s": 0.0, "samples": 0, "val": 2.0},
            {"train_s": end, "samples": 1, "val": 1.5 if reached_at is None else 1.0},
        ]

    results = {
        "fixed-32": {"curve": curve(27.7)},
        "fixed-64": {"curve": curve(20.6)},
        "fixed-128": {"curve": curve(22.5)},
        "fixed-256": {"curve": curve(None)},
        "goodput": {"curve": curve(18.0)},
    }
    row = summarise(results, [1.0])["1.0"]
    # The median of 20.6, 22.5, 27.7 and "later than the budget" lies between 22.5 and 27.7.
    assert row["best_fixed"] == pytest.approx(20.6) and row["median_fixed"] == pytest.approx(25.1)
    assert row["to_median_fixed"]["goodput"] == pytest.approx(18.0 / 25.1)
    # Two of four never get there: the median is beyond the budget, and no ratio to it is made up.
    results["fixed-128"] = {"curve": curve(None)}
    row = summarise(results, [1.0])["1.0"]
    assert row["median_fixed"] is None and row["median_fixed_beyond"] is True
    assert row["to_median_fixed"] == {} and row["to_best_fixed"]["goodput"] == pytest.approx(18.0 / 20.6)
    # --from-results reports an earlier run's curves with this summary, at other targets if asked.
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": {"targets": [1.0], "start": 32}, "results": results}))
    assert main(["--from-results", str(path)]) == 0
    assert "median fixed beyond the budget); goodput 0.87x best" in capsys.readouterr().out
    assert main(["--from-results", str(path), "--targets", "1.5"]) == 0
    assert "to val 1.5: fixed-32 " in capsys.readouterr().out


def test_a_repeated_policy_trains_as_its_original_and_is_never_the_sweeps(capsys):
    """``NAME+again`` runs NAME's config in its own process and is set against the sweep, not in it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import ds_config, efficiencies, main, parse, policies, summarise

    args = parse(["--smoke"])
    for name in ["fixed-16", "goodput", "goodput-adascale"]:
        again = ds_config(policies(args)[name], args, f"{name}+again")
        assert again == ds_config(policies(args)[name], args, name), name
    assert (
        ds_config(policies(args)["goodput"], args, "goodput-adascale+again")["adabatch"]["lr_scaling"]["rule"]
        == "adascale"
    )

    def curve(reached_at, samples):  # validation 2.0 -> 1.0 at these training seconds and samples
        return [
            {"train_s": 0.0, "samples": 0, "val": 2.0},
            {"train_s": reached_at, "samples": samples, "val": 1.0},
        ]

    results = {
        "fixed-4": {"curve": curve(30.0, 400)},
        "fixed-16": {"curve": curve(20.0, 800)},
        "fixed-16+again": {"curve": curve(19.0, 800)},  # sooner than every fixed batch: not the best
    }
    row = summarise(results, [2.0, 1.0])["1.0"]
    assert row["best_fixed"] == pytest.approx(20.0) and row["median_fixed"] == pytest.approx(25.0)
    assert row["to_best_fixed"] == {"fixed-16+again": pytest.approx(19.0 / 20.0)}
    assert set(efficiencies(results, [2.0, 1.0], 4)["2.0-1.0"]) == {"fixed-16"}
    # A name that is no policy, repeated or not, is refused before any process starts.
    assert main(["--smoke", "--only", "fixed-16+again", "fixed-5+again"]) == 2
    assert "--only names no policy fixed-5+again" in capsys.readouterr().out


def test_a_simulated_device_charges_each_pass_a_step_ran():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import _key_value, _step_cost

    from ds_adabatch.data.step_batch import MicroBatch, StepBatch

    def step(*sizes: int) -> StepBatch:
        micro = tuple(MicroBatch(batch=None, indices=tuple(range(n)), num_samples=n) for n in sizes)
        return StepBatch(micro_batches=micro, plan=None, rank=0, epoch=0, global_batch=None)

    cost = _step_cost("fixed=0.04,per_pass=0.01,per_sample=0.001")
    assert cost(step(8)) == pytest.approx(0.04 + 0.01 + 0.008)
    # A noise split runs the same 8 samples as two passes: one more pass's cost, as the device pays it.
    assert cost(step(4, 4)) == pytest.approx(0.04 + 2 * 0.01 + 0.008)
    assert _step_cost(None) is None  # the clock times the steps
    assert _key_value("warmup_steps=10") == ("warmup_steps", 10)


def test_adascales_gain_lies_between_one_and_the_batch_ratio():
    from ds_adabatch.schedules.lr import adascale_gain

    assert adascale_gain(64, 8, None) == 1.0  # no estimate yet: the LR of start
    assert adascale_gain(64, 8, math.inf) == 8.0  # |G|^2 read as <= 0: all noise
    assert adascale_gain(64, 8, 0.0) == pytest.approx(1.0)  # no noise: a larger batch gains nothing
    assert adascale_gain(64, 8, 8.0) == pytest.approx(8 * 16 / 72)
    assert adascale_gain(64, 8, 1e9) == pytest.approx(8.0, rel=1e-6)  # all noise: the linear rule
    assert adascale_gain(8, 8, 30.0) == pytest.approx(1.0)


def test_the_adascale_policy_sets_the_gains_multiplier_before_every_step(tmp_path):
    """``goodput-adascale`` trains ``goodput``'s schedule with ``lr_scaling`` "adascale": the LR multiplier
    AdaScale's gain ** 0.5 gives, never above ``sqrt``'s, and below it once the batch has left start with a
    noise estimate."""
    out = tmp_path / "ttt"
    # A host-bound simulated device: goodput climbs to the sweep's top (16) in its warm-up.
    _smoke(out, "--only", "goodput-adascale", "--simulate-step-time", "fixed=0.01")
    curve = json.loads((out / "results.json").read_text())["results"]["goodput-adascale"]["curve"]
    assert curve[-1]["batch"] > 4, curve[-1]
    for point in curve[1:]:
        ceiling = (point["batch"] / 4) ** 0.5
        assert 1.0 - 1e-9 <= point["lr_multiplier"] <= ceiling + 1e-9, point
    below = [p for p in curve[1:] if p["noise_scale"] and p["lr_multiplier"] < (p["batch"] / 4) ** 0.5 - 1e-6]
    assert below, curve


def test_the_short_memory_policy_is_goodput_with_a_five_measurement_estimate_taken_as_it_is():
    """``goodput-short-memory`` differs from ``goodput`` in the two estimator keys alone, and its
    ds_config validates with them (the schedule remembers ~5 measurements and has no confidence test)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import ON_REQUEST, ds_config, parse, policies

    from ds_adabatch.config import load_ds_config

    args = parse(["--only", "goodput", "goodput-short-memory"])
    schedules = policies(args)
    short, plain = schedules["goodput-short-memory"], schedules["goodput"]
    assert {k: v for k, v in short.items() if plain.get(k, object()) != v} == {
        "ema_beta": 0.8,
        "max_relative_error": None,
    }
    assert "goodput-short-memory" in ON_REQUEST
    loaded = load_ds_config(ds_config(short, args), world_size=1)
    schedule = loaded.adabatch.schedule
    assert (schedule.type, schedule.ema_beta, schedule.max_relative_error) == ("goodput", 0.8, None)


def test_token_budget_goodput_smoke(tmp_path):
    # benchmarks/token_budget.py goodput: 2 gloo ranks, goodput over token-budget steps on the stdlib's
    # paragraphs; every step's expected and taken passes and the plan changes come out well formed.
    out = tmp_path / "goodput.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "token_budget.py"), "goodput", "--steps", "6"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run(
        [*cmd, "--budget", "4096", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    # A rank that ended without ds_adabatch.finish() could abort in the interpreter's teardown (gloo,
    # SIGABRT, "<no Python frame>"), as this script's workers did now and then: a failure shows the
    # crash's stacks (the faulthandler's block), not only a tail.
    assert proc.returncode == 0, f"the smoke run failed:\n{failure_excerpt(proc)}"
    result = json.loads(out.read_text())
    rows = result["steps_run"]
    assert len(rows) == 6 and all(r["passes"] >= 1 and r["samples"] >= 1 for r in rows), rows
    assert all(r["expected"] is None or r["expected"] >= 1.0 for r in rows), rows
    assert rows[0]["samples"] == 16 and result["tokens_per_s"] > 0, result


def test_noise_cross_step_reports_each_estimate_against_the_every_step_reference():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from noise_cross_step import parse, ratios

    rows = [
        {"step": 100, "split": 10.0, "sparse": 1.0, "cross": 1.0, "calibrated": 1.0},  # before from_step
        {"step": 250, "split": 10.0, "sparse": 5.0, "cross": 15.0, "calibrated": None},
        {"step": 255, "split": 20.0, "sparse": 20.0, "cross": 26.0, "calibrated": 20.0},
        {"step": 260, "split": 40.0, "sparse": 80.0, "cross": 56.0, "calibrated": None},
    ]
    got = ratios(rows, 250)
    assert got["sparse_to_split"] == pytest.approx(1.0)  # 0.5, 1, 2
    assert got["sparse_spread"] == pytest.approx(2.0)  # factors 2, 1, 2: median 2
    assert got["cross_to_split"] == pytest.approx(1.4)  # 1.5, 1.3, 1.4
    assert got["calibrated_to_split"] == pytest.approx(1.0)  # only where it was known
    assert ratios(rows, 1000) == dict.fromkeys(got)  # no row from there: nothing to report
    with pytest.raises(SystemExit):
        parse(["--batch", "7"])  # each step runs as two halves


def test_a_switch_policy_is_the_batch_by_steps_that_its_name_says():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import parse, policies

    args = parse(["--only", "fixed-8", "switch-8-16-at-320", "switch-8-32-at-5+again"])
    got = policies(args)
    assert got["switch-8-16-at-320"] == {"type": "piecewise", "unit": "steps", "points": [[0, 8], [320, 16]]}
    assert got["switch-8-32-at-5"]["points"] == [[0, 8], [5, 32]]  # its repetition runs the same
    assert not any(name.startswith("switch-") for name in policies(parse([])))  # only where named


def test_a_goodput_setting_policy_is_goodput_with_the_keys_its_name_sets():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from time_to_target import parse, policies

    args = parse(
        ["--only", "goodput", "goodput@remeasure_after=150@hysteresis=0.02", "goodput@decide_every=5+again"]
    )
    got = policies(args)
    assert got["goodput@remeasure_after=150@hysteresis=0.02"] == {
        **got["goodput"],
        "remeasure_after": 150,
        "hysteresis": 0.02,
    }
    assert got["goodput@decide_every=5"]["decide_every"] == 5  # its repetition runs the same
    assert got["goodput"] == {"type": "goodput", "start": args.start}  # the default is untouched
    assert not any("@" in name for name in policies(parse([])))  # only where named
    with pytest.raises(SystemExit, match="VALUE in JSON"):
        policies(parse(["--only", "goodput@efficiency=sqrt"]))  # a string must be quoted


def test_shape_change_steps_profiles_first_runs_apart_from_returns():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from shape_change_steps import AFTER, profile, runs_of

    run = 14  # steady steps 10..13
    first8 = [2.0, 1.5] + [1.0] * (run - 2)
    first16 = [4.0] * run  # slow throughout: its steady step is 4, so every ratio is 1
    back8 = [1.2] + [1.0] * (run - 1)
    steps = [(8, t) for t in first8] + [(16, t) for t in first16] + [(8, t) for t in back8] + [(16, 9.0)]
    assert [(b, len(ts)) for b, ts in runs_of(steps)] == [(8, run), (16, run), (8, run), (16, 1)]
    got = profile(steps, run)
    assert got[8]["first"][:3] == pytest.approx([2.0, 1.5, 1.0])
    assert got[8]["returns"][:2] == pytest.approx([1.2, 1.0])
    assert got[16] == {"first": pytest.approx([1.0] * AFTER)}  # its last run (one step) is too short to count


def _efficiency_run(path: Path, noise: float, measured: dict[int, float], lr: float = 1e-3) -> None:
    """A results file whose fixed batches took samples from val 2.2 to 1.9 as ``measured`` says against
    fixed-8 (1000 samples), and whose goodput read ``noise`` there, trained at ``lr``."""

    def fixed(taken: float) -> dict:
        return {
            "curve": [
                {"val": 3.0, "samples": 0},
                {"val": 2.2, "samples": 500},
                {"val": 1.9, "samples": 500 + taken},
            ]
        }

    results = {f"fixed-{b}": fixed(1000 / e) for b, e in {8: 1.0, **measured}.items()}
    results["goodput"] = {"curve": [{"val": 2.5, "noise_scale": 1e6}, {"val": 2.1, "noise_scale": noise}]}
    path.write_text(json.dumps({"settings": {"lr": lr}, "results": results}))


def test_efficiency_forms_recovers_the_form_that_made_the_efficiencies(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from efficiency_forms import compare, estimate_over, form, main, observations, step_efficiency

    assert step_efficiency(8, 40.0, 8, 0.7) == pytest.approx(1.0)  # the reference itself
    assert step_efficiency(32, 40.0, 8, 0.0) == pytest.approx(0.5)  # a vanishing LR: 1 / sqrt(4)
    assert form("sqrt", 16, 40.0, 8) == pytest.approx(math.sqrt(48 / 56))
    # runs made by the step form at r 0.7, each at its own B_noise
    paths = []
    for i, noise in enumerate([30.0, 45.0, 60.0]):
        made = {b: step_efficiency(b, noise, 8, 0.7) for b in (16, 32)}
        _efficiency_run(tmp_path / f"run{i}.json", noise, made)
        paths.append(str(tmp_path / f"run{i}.json"))
    obs = observations(paths, 2.2, 1.9, 8)
    assert [o["noise"] for o in obs] == [30.0, 45.0, 60.0]  # only the validations within the span
    assert obs[0]["measured"][16] == pytest.approx(step_efficiency(16, 30.0, 8, 0.7))
    got = compare(obs, 8)
    assert got["at_estimate"]["step"]["r"] == pytest.approx(0.7)
    assert got["at_estimate"]["step"]["rms_log_error"] == pytest.approx(0.0, abs=1e-9)
    sqrt_bias = got["at_estimate"]["sqrt"]["mean_log_error"]
    assert sqrt_bias[16] > 0.02 and sqrt_bias[32] < 0  # the square root underrates 16, overrates 32
    assert estimate_over({"goodput": {"curve": []}}, 2.2, 1.9) is None
    # a run at another LR, made at another r, is compared apart, never pooled
    _efficiency_run(
        tmp_path / "half.json", 40.0, {b: step_efficiency(b, 40.0, 8, 0.3) for b in (16, 32)}, 5e-4
    )
    out = tmp_path / "forms.json"
    assert main([*paths, str(tmp_path / "half.json"), "--out", str(out)]) == 0
    by_lr = json.loads(out.read_text())["comparison_by_lr"]
    assert by_lr["0.001"]["at_estimate"]["step"]["r"] == pytest.approx(0.7)
    assert by_lr["0.0005"]["at_estimate"]["step"]["r"] == pytest.approx(0.3)
    assert main([str(tmp_path / "run0.json"), "--start", "4"]) == 1  # no fixed-4: nothing to compare
    with pytest.raises(SystemExit):
        main([paths[0], "--span", "1.9", "2.2"])

"""The peak-memory predictor avoids out-of-memory errors the same run pays without it (2 gloo ranks).

One launch of ``tests/oom_predict_worker.py``: the last rank has a simulated device memory (a fixed part
plus a part per sample, or per token); each case trains the same steps with ``memory.predict_peak`` off
and on and counts the recovered out-of-memory errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("oom_predict")
    proc = torchrun(HERE / "oom_predict_worker.py", str(out), nproc=2, cwd=HERE, timeout=600)
    if proc.returncode != 0:
        pytest.fail(
            f"predictor worker failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return {case: json.loads((out / f"{case}.json").read_text()) for case in ("samples", "tokens", "loop")}


@pytest.mark.parametrize("case", ["samples", "tokens"])
def test_the_predictor_avoids_out_of_memory_errors(results, case):
    without, with_ = results[case]["without"], results[case]["with"]
    # Counted twice: the recoveries the runtime agreed on, and the errors the simulated memory raised.
    assert with_["ooms"] < without["ooms"], (
        f"{case}: {with_['ooms']} OOMs with the predictor, {without['ooms']} without, for the same run"
    )
    assert with_["raised"] == [0, with_["ooms"]] and without["raised"] == [0, without["ooms"]]
    for run in (without, with_):
        assert run["max_rel_err"] <= 1e-5, f"{case}: off the big-batch reference by {run['max_rel_err']:.2e}"
    if case == "samples":  # close() takes the predictor's hook off the user's model
        opened, closed = with_["pre_hooks_open_closed"]
        assert opened >= 1 and closed == opened - 1, with_["pre_hooks_open_closed"]


def test_samples_the_predicted_bound_is_the_largest_size_that_fits(results):
    without, with_ = results["samples"]["without"], results["samples"]["with"]
    # 1000 B + 100 B per sample within 98% of 1650 B: 6 samples. 16 and 8 fail in step 0 (nothing is
    # known yet); from then on the agreed bound is 6 and no probe of 7 is ever made.
    assert with_["caps"][1:] == [6] * (len(with_["caps"]) - 1), with_["caps"]
    assert with_["ooms"] == 2 and max(with_["micro"][1:]) == 6 and with_["micro"][-1] == 6, with_
    assert without["caps"][0] == 1 << 62, "without the predictor no bound travels"
    for run in (without, with_):
        n = len(run["seen"])
        assert sorted(run["seen"]) == list(range(n)), "every sample exactly once"


def test_the_users_peak_memory_is_kept_per_step_and_for_the_process(results):
    # The predictor resets the allocator's peak counter before each pass; what it read is folded into
    # each step's peak_memory_bytes and engine.max_memory_allocated() (1000 B + 100 B per sample here).
    for name in ("with", "without"):
        run = results["samples"][name]
        peaks, (process_peak, counter) = run["last_rank"]["peaks"], run["last_rank"]["memory"]
        if name == "without":  # predict_peak false: nothing is measured, nothing reset
            assert peaks == [None] * len(peaks), peaks
            continue
        assert peaks == [1000 + 100 * m for m in run["micro"]], (peaks, run["micro"])
        assert process_peak == max(peaks) and counter <= process_peak, (process_peak, counter, peaks)


def test_tokens_the_bound_counts_tokens_per_pass(results):
    with_ = results["tokens"]["with"]
    # 1000 B + 10 B per token within 98% of 1400 B: 37 tokens per pass.
    assert max(with_["budgets"][2:]) <= 37, with_["budgets"]
    assert with_["budgets"][-1] == 37, f"the budget grows to the predicted bound: {with_['budgets']}"
    seen = with_["seen"]
    for start in range(0, len(seen), 60):  # epochs of 60 samples, never crossed by a step
        chunk = seen[start : start + 60]
        assert len(set(chunk)) == len(chunk), f"epoch at {start} repeats a sample"


def test_the_loop_plans_within_the_predicted_bound(results):
    """Through DeepSpeed's forward / backward / step loop (an out-of-memory error there ends the run),
    the limit grows from 4 toward 16 and stops at the predicted 6: the run completes with no error."""
    loop = results["loop"]
    assert loop["ooms"] == 0 and loop["raised"] == [0, 0], loop
    assert max(loop["micro"]) == 6 and loop["micro"][-1] == 6, loop["micro"]
    assert loop["max_rel_err"] <= 1e-5, f"off the big-batch reference by {loop['max_rel_err']:.2e}"
    assert sorted(loop["seen"]) == list(range(len(loop["seen"]))), "every sample exactly once"

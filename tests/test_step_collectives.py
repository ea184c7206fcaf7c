"""What one ``train_batch`` costs in collectives and host reads, against a hand-written DeepSpeed loop.

One 2-rank gloo launch (``tests/collectives_worker.py``) counts, per optimizer step, every ``c10d::`` op
(DeepSpeed's included) and every tensor -> host read, for the plain loop and for each case, and writes
each case's difference to the plain loop. A change that adds a collective or a host read to the steady
path fails here with the case's name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import torchrun_or_fail

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("collectives")
    torchrun_or_fail(
        HERE / "collectives_worker.py", str(out), what="collectives worker", nproc=2, cwd=HERE, timeout=600
    )
    return json.loads((out / "counts.json").read_text())


def _steps(counts: dict, case: str) -> list[tuple[int, int, bool]]:
    """(extra collectives, extra host reads, whether the step resolves pending losses) per measured step."""
    every, first = counts["every_steps"], counts["first_step"]
    return [(c, r, (first + i + 1) % every == 0) for i, (c, r) in enumerate(counts["cases"][case])]


def test_the_plain_loop_is_measured(counts):
    collectives = {c for c, _ in counts["plain"]}
    assert len(collectives) == 1 and collectives.pop() > 0, (
        f"the hand-written loop's steps should all issue the same positive number of collectives: {counts['plain']}"
    )


@pytest.mark.parametrize(
    "case", ["constant schedule, sample normalisation", "the forward/backward/step loop, constant schedule"]
)
def test_a_steady_step_adds_nothing(counts, case):
    for c, r, flush in _steps(counts, case):
        if flush:
            assert c == 1, f"{case}: a step that resolves the pending losses adds one all-reduce, got {c}"
        else:
            assert (c, r) == (0, 0), (
                f"{case}: a steady step must issue exactly what the hand-written loop does; it added {c} "
                f"collective(s) and {r} host read(s)"
            )


@pytest.mark.parametrize(
    "case",
    [
        'loss_normalization "token"',
        "gradient_noise measuring every step",
        'gradient_noise measuring every step with "token"',
        "goodput deciding every 3 steps",
        "a user's callable schedule",
    ],
)
def test_what_must_be_agreed_is_agreed_once(counts, case):
    for c, _, flush in _steps(counts, case):
        if flush:
            # The step whose loss is due (log.every_steps) may need its own small all-reduce for it.
            assert c in (1, 2), f"{case}: a step that resolves the pending losses added {c} collectives"
        else:
            assert c == 1, (
                f"{case}: a step must add exactly one collective (everything it needs fused into it), "
                f"got {c} more than the hand-written loop"
            )


def test_a_measured_step_carries_the_losses(counts):
    case = "gradient_noise measuring every step"
    extra = [c for c, _, _ in _steps(counts, case)]
    assert extra == [1] * len(extra), (
        f"{case}: the noise sums' all-reduce also carries the step's loss, so no step adds two: {extra}"
    )


def test_armed_oom_recovery_adds_one_agreement_per_reducing_pass(counts):
    # ZeRO-2 reduces gradients in every micro-batch's backward: armed recovery joins one agreement of
    # host integers (a gloo group of its own: no device sync) before each, GAS per step. On 2 ranks an
    # agreement is one round of recursive doubling: one send and one receive, and one host read of
    # the result; nothing else changes.
    armed = counts["cases"]["armed out-of-memory recovery (a GPU's default)"]
    steady = counts["cases"]["constant schedule, sample normalisation"]
    gas, messages = counts["gas"], counts["agreement_messages"]
    assert messages == 2, f"an agreement on 2 ranks is one send and one receive, got {messages} messages"
    extra = [(a[0] - s[0], a[1] - s[1]) for a, s in zip(armed, steady)]
    assert extra == [(gas * messages, gas)] * len(extra), (
        f"armed recovery must add exactly GAS ({gas}) agreements of {messages} messages and one host read "
        f"each per step: {extra}"
    )


def test_a_steady_pipeline_step_adds_nothing_to_pipeline_engine_train_batch(counts):
    # 2 stages x 1 replica, ZeRO 1: DeepSpeed's own step sends activations and gradients between the
    # stages, reduces and broadcasts the loss; ours must issue exactly that. A step that resolves the
    # pending losses reads DeepSpeed's aggregated loss (already the global mean): one host read, no
    # collective.
    plain = counts["pipeline_plain"]
    assert len({c for c, _ in plain}) == 1 and plain[0][0] > 0, f"the hand-written pipeline loop: {plain}"
    every, first = counts["every_steps"], counts["first_step"]
    for i, (c, r) in enumerate(counts["pipeline"]["pipeline, constant schedule"]):
        flush = (first + i + 1) % every == 0
        assert (c, r) == ((0, 1) if flush else (0, 0)), (
            f"pipeline step {first + i}: added {c} collective(s) and {r} host read(s) to PipelineEngine.train_batch"
        )


def test_a_pipeline_token_step_adds_one_all_reduce(counts):
    extra = [c for c, _ in counts["pipeline"]['pipeline, loss_normalization "token"']]
    assert extra == [1] * len(extra), f"the step's token count is one all-reduce per step: {extra}"

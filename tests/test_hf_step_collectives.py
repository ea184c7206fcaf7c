"""What one ``AdaptiveBatchSizeTrainer`` step costs in collectives and host reads, against ``Trainer``.

One 2-rank gloo launch (``tests/hf_collectives_worker.py``) trains the plain Trainer and ours on the same
model, data, micro-batch and accumulation steps, and counts every ``c10d::`` op and every tensor -> host
read from one optimizer step's end to the next (the Trainer's own logging every few steps included on
both sides). A change that adds a collective or a host read to the Trainer's steady step fails here.
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
    out = tmp_path_factory.mktemp("hf_collectives")
    torchrun_or_fail(
        HERE / "hf_collectives_worker.py",
        str(out),
        what="hf_collectives_worker",
        nproc=2,
        cwd=HERE,
        timeout=900,
    )
    return json.loads((out / "counts.json").read_text())


def _extra(counts: dict, backend: str, ours: str, plain: str) -> list[tuple[int, int, int]]:
    """(step, extra collectives, extra host reads) of ``ours`` over ``plain``, per measured step."""
    first = counts["warmup"] + 1
    pairs = zip(counts[backend][ours], counts[backend][plain])
    return [(first + i, o[0] - p[0], o[1] - p[1]) for i, (o, p) in enumerate(pairs)]


def test_the_plain_trainer_is_measured(counts):
    for backend, case in (("zero2", "plain token"), ("ddp", "plain sample")):
        steps = counts[backend][case]
        assert len(steps) >= 4 and all(c > 0 for c, _ in steps), f"{backend}: plain Trainer counts {steps}"
        # Its logging steps gather the loss: the count changes there, so logging is inside the windows.
        assert len({c for c, _ in steps}) == 2, f"{backend}: logging steps not measured: {steps}"


@pytest.mark.parametrize(("backend", "kind"), [("zero2", "token"), ("ddp", "sample")])
def test_a_steady_step_costs_no_more_than_the_plain_trainers(counts, backend, kind):
    # Token normalisation: the plain Trainer gathers num_items_in_batch once per step, we all-reduce
    # the step's token count once; sample normalisation needs nothing. Host reads: none of ours (the
    # plain Trainer checks each micro-batch's loss for NaN, we check the step's once).
    for step, c, r in _extra(counts, backend, f"ours {kind}", f"plain {kind}"):
        assert c <= 0 and r <= 0, (
            f"{backend}, {kind} normalisation, step {step}: AdaptiveBatchSizeTrainer issued {c} more "
            f"collective(s) and {r} more host read(s) than Trainer"
        )


def test_a_jsonl_log_resolves_its_losses_once_every_every_steps(counts):
    every = counts["every_steps"]
    for step, c, _ in _extra(counts, "ddp", "ours sample jsonl", "plain sample"):
        # The records of steps up to a multiple of every_steps are resolved right after its on_step_end
        # (once the Trainer has its gradient norm): in the next step's window.
        expected = 1 if (step - 1) % every == 0 else 0
        assert c == expected, (
            f"step {step}: with log.jsonl (every_steps {every}) a step adds {expected} all-reduce(s), got {c}"
        )


def test_a_jsonl_log_rides_on_the_token_count_at_no_extra_collective(counts):
    extra = [c for _, c, _ in _extra(counts, "zero2", "ours token jsonl", "plain token")]
    assert extra == [0] * len(extra), f"the losses should ride on each step's token all-reduce: {extra}"


def test_a_scheduler_function_is_agreed_in_one_collective_per_step(counts):
    # A user's function may answer differently on different ranks: rank 0's answer is agreed, in one
    # small all-reduce at each evaluation (every step here), as ds_adabatch.runtime does.
    extra = [c for _, c, _ in _extra(counts, "zero2", "ours token scheduler", "plain token")]
    assert extra == [1] * len(extra), f"a scheduler function's steps added {extra} collectives"

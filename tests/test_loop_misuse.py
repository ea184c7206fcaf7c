"""The forward / backward / step loop refuses what it cannot make exact, with a sentence (one process).

A world of one (plain ``python``), SGD, a ramp 4 -> 8: a batch from the user's own ``DataLoader`` or from
``engine.deepspeed_io`` is refused at ``engine.backward`` (never a silent constant batch); iterating the
``ElasticDataLoader`` itself, a second ``backward``, ``step`` before ``backward``, the next micro-batch
before ``step`` and ``train_batch`` inside a loop step are refused; the loop then still trains its
planned batches, ``is_gradient_accumulation_boundary`` follows the plan, and the JSONL log has one record per
optimizer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, torch, ds_adabatch
    data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "adabatch": {"schedule": {"type": "linear", "start": 4, "end": 8, "ramp_samples": 8},
                     "max_micro_batch_per_gpu": 2, "log": {"jsonl": "metrics.jsonl", "every_steps": 2}},
    }
    engine, _, loader, _ = ds_adabatch.initialize(
        args=None, model=torch.nn.Linear(3, 1), model_parameters=None, training_data=data, config=config)
    mse = lambda batch: ((engine(batch[0]) - batch[1]) ** 2).mean()
    out = {}

    def refused(name, fn):
        try:
            fn()
        except (RuntimeError, TypeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
        else:
            out[name] = "accepted"

    own = next(iter(torch.utils.data.DataLoader(data, batch_size=2)))
    refused("own DataLoader", lambda: engine.backward(mse(own)))
    io = next(iter(engine.deepspeed_io(data)))
    refused("deepspeed_io", lambda: engine.backward(mse(io)))
    refused("iterate ElasticDataLoader", lambda: iter(loader.loader))
    refused("step first", lambda: engine.step())

    it = iter(loader)
    batch = next(it)
    refused("step before backward", lambda: engine.step())
    engine.backward(mse(batch))
    refused("backward twice", lambda: engine.backward(mse(batch)))
    refused("next before step", lambda: next(it))
    refused("train_batch inside a step", lambda: engine.train_batch())
    engine.step()

    boundaries, steps = [], []
    for batch in it:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(mse(batch))
        before = engine.global_steps
        engine.step()
        if engine.global_steps > before:
            steps.append(engine.last_step_batch.global_batch.size)
    out["boundaries"] = boundaries
    out["steps"] = steps
    out["samples"] = engine.global_samples
    out["history"] = [e.new_global_batch for e in engine.history]
    engine.close()  # resolves the pending step records
    out["jsonl"] = [json.loads(line)["global_batch"] for line in open("metrics.jsonl")]
    print("RESULT " + json.dumps(out))
    ds_adabatch.finish()
    """
)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["DS_ACCELERATOR"] = "cpu"
    cwd = tmp_path_factory.mktemp("loop_misuse")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=cwd
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("source", ["own DataLoader", "deepspeed_io"])
def test_a_batch_from_another_loader_is_refused_with_the_way_out(result, source):
    msg = result[source]
    assert msg.startswith("RuntimeError") and "initialize(..., training_data=dataset)" in msg, msg
    assert "train_batch()" in msg, msg


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("iterate ElasticDataLoader", "iterate the loader ds_adabatch.initialize returns"),
        ("step first", "needs a micro-batch from the loader"),
        ("step before backward", "call backward first"),
        ("backward twice", "called twice for one micro-batch"),
        ("next before step", "before engine.step() of the previous one"),
        ("train_batch inside a step", "inside an optimizer step"),
    ],
)
def test_misuse_is_a_sentence(result, case, needle):
    assert needle in result[case], result[case]


def test_the_loop_still_trains_its_plans_after_refusals(result):
    # 40 samples: 4 (micro 2 x gas 2, begun before the loop), 6 on the ramp, 8 (micro 2 x gas 4), ...
    steps = result["steps"]
    assert sum(steps) == result["samples"] == 40, result
    assert steps[:3] == [4, 6, 8] and max(steps) == 8, steps
    # The boundary is the last micro-batch of every step: 1 of step 0 left, then GAS 3, then GAS 4.
    b = result["boundaries"]
    assert b.count(True) == len(steps), b
    assert b[:8] == [True, False, False, True, False, False, False, True], b


def test_the_loop_writes_a_metrics_record_per_step_and_its_plan_changes(result):
    assert result["jsonl"] == result["steps"], "one JSONL record per optimizer step, its global batch"
    assert result["history"][:2] == [6, 8], f"plan changes recorded: {result['history']}"

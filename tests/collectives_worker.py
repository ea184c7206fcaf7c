"""Counts the collectives and host reads of one optimizer step, ours against a hand-written DeepSpeed loop
(the data-parallel engine against forward/backward/step, the pipeline engine against
``PipelineEngine.train_batch``, 2 stages on the same 2 processes).

Usage: torchrun --nproc-per-node 2 tests/collectives_worker.py OUT_DIR  (run by tests/test_step_collectives.py)

Collectives are counted at the dispatcher (every ``c10d::*`` op the profiler records: all-reduce,
broadcast, reduce-scatter, barrier, ... whoever issues them, DeepSpeed included). Host reads are calls of
``Tensor.item`` / ``__float__`` / ``__int__`` / ``__bool__`` (on a GPU each is a synchronisation). Each case
writes, per measured step, its counts minus the plain loop's into OUT_DIR/counts.json (rank 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from engine_worker import Regression, make_model, mse_loss  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

STAGE = 2
MICRO, GAS = 4, 2
STEPS = 8  # measured steps per case, after 2 warm-up steps
EVERY = 4  # log.every_steps in the cases
AGREEMENT: dict[str, int] = {}  # messages one out-of-memory agreement sends and receives on this rank


class HostReads:
    """Counts tensor -> host reads while active (patched on torch.Tensor, restored on exit)."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> HostReads:
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *a, _orig=original, **k):
                self.count += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def measure(step, steps: int) -> list[tuple[int, int]]:
    """(collectives, host reads) issued by each of ``steps`` calls of ``step``.

    One profiler session spans every call (each call inside a ``record_function`` range), and the
    session ends only after a barrier: an all-reduce a step leaves in flight (``StepSync.reduce_later``)
    completes on gloo's worker thread, which records into the profiler too; a session torn down under
    it can crash the process. A collective is counted in the call whose range it started in."""
    reads = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            with torch.profiler.record_function(f"measured step {k}"), HostReads() as counted:
                step()
            reads.append(counted.count)
        dist.barrier()  # after every in-flight op of this rank's queue (gloo runs them in order)
    events = prof.events()
    ranges = sorted(
        (e.time_range.start, e.time_range.end, int(e.name.rsplit(" ", 1)[1]))
        for e in events
        if e.name.startswith("measured step ")
    )
    collectives = [0] * steps
    for e in events:
        if e.name.startswith("c10d::"):
            for start, end, k in ranges:
                if start <= e.time_range.start <= end:
                    collectives[k] += 1
                    break
    return list(zip(collectives, reads))


def base_config(adabatch: dict | None = None) -> dict:
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": STAGE},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "adabatch": adabatch or {},
    }


def plain_loop(world: int) -> list[tuple[int, int]]:
    """The loop users write: forward / backward / step per micro-batch, DeepSpeed's own GAS."""
    cfg = base_config()
    cfg.pop("adabatch")
    cfg.update(
        train_batch_size=MICRO * GAS * world,
        train_micro_batch_size_per_gpu=MICRO,
        gradient_accumulation_steps=GAS,
    )
    data = Regression(n=4096)
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = dist.get_rank()
    # Batches are prepared beforehand: the data loader's own reads are not the step's.
    batches = iter(
        [
            (data.x[i : i + MICRO], data.y[i : i + MICRO])
            for i in range(rank * MICRO, len(data), MICRO * world)
        ]
    )

    def step():
        for _ in range(GAS):
            engine.backward(mse_loss(engine, next(batches)))
            engine.step()

    return run(step)


def adaptive(adabatch: dict, *, token: bool = False, armed: bool = False) -> list[tuple[int, int]]:
    # Default settings: out-of-memory recovery is on, but on the CPU nothing can raise an
    # out-of-memory error, so it agrees on nothing unless a simulated limit is installed ("armed").
    section = {"max_micro_batch_per_gpu": MICRO, "log": {"every_steps": EVERY}, **adabatch}
    if token:
        section["loss_normalization"] = "token"
    engine, *_ = ds_adabatch.initialize(
        make_model(),
        base_config(section),
        Regression(n=4096),
        loss_fn=mse_loss,
        token_count_fn=(lambda b: int(b[0].shape[0]) * 3) if token else None,
    )
    if armed:  # a budget nothing exceeds: the agreement runs, nothing fails
        with simulated_memory_limit(10**9):
            counts = run(engine.train_batch)
        AGREEMENT["messages"] = engine.memory_recovery.agreement.host.messages
    else:
        counts = run(engine.train_batch)
    engine.close()
    return counts


def adaptive_loop(adabatch: dict) -> list[tuple[int, int]]:
    """The same loop as plain_loop, over the loader ds_adabatch.initialize returns (loop.py)."""
    section = {"max_micro_batch_per_gpu": MICRO, "log": {"every_steps": EVERY}, **adabatch}
    engine, _, loader, _ = ds_adabatch.initialize(make_model(), base_config(section), Regression(n=4096))
    batches = iter(loader)

    def step():
        for _ in range(GAS):
            engine.backward(mse_loss(engine, next(batches)))
            engine.step()

    counts = run(step)
    engine.close()
    return counts


def pipe_model():
    # The worker's model as 2 pipeline stages over the 2 processes (1 data-parallel replica).
    from deepspeed.pipe import PipelineModule

    layers = list(make_model().children())
    return PipelineModule(layers=layers, num_stages=2, loss_fn=mse_rows, partition_method="uniform")


def mse_rows(outputs, labels):
    return ((outputs - labels) ** 2).mean()


def plain_pipeline_loop() -> list[tuple[int, int]]:
    """The loop users write around DeepSpeed's PipelineEngine: train_batch(data_iter), GAS micro-batches."""
    cfg = base_config()
    cfg.pop("adabatch")
    cfg["zero_optimization"]["stage"] = 1
    cfg.update(
        train_batch_size=MICRO * GAS, train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=GAS
    )
    model = pipe_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = Regression(n=4096)
    batches = iter([(data.x[i : i + MICRO], data.y[i : i + MICRO]) for i in range(0, len(data), MICRO)])
    return run(lambda: engine.train_batch(batches))


def adaptive_pipeline(*, token: bool = False) -> list[tuple[int, int]]:
    section = {
        "schedule": {"type": "constant", "value": MICRO * GAS},
        "max_micro_batch_per_gpu": MICRO,
        "log": {"every_steps": EVERY},
    }
    if token:
        section["loss_normalization"] = "token"
    cfg = base_config(section)
    cfg["zero_optimization"]["stage"] = 1
    engine, *_ = ds_adabatch.initialize(
        pipe_model(),
        cfg,
        Regression(n=4096),
        token_count_fn=(lambda b: int(b[0].shape[0]) * 3) if token else None,
    )
    counts = run(engine.train_batch)
    engine.close()
    return counts


def run(step) -> list[tuple[int, int]]:
    for _ in range(2):
        step()
    return measure(step, STEPS)


def grow_every_step(step: int, batch_size: int) -> int:
    return batch_size  # asked every step; the answer must still be agreed


def main() -> None:
    out_dir = sys.argv[1]
    ds_adabatch.init_distributed()
    world = dist.get_world_size()
    batch = MICRO * GAS * world
    plain = plain_loop(world)
    cases = {
        "constant schedule, sample normalisation": adaptive(
            {"schedule": {"type": "constant", "value": batch}}
        ),
        'loss_normalization "token"': adaptive(
            {"schedule": {"type": "constant", "value": batch}}, token=True
        ),
        "gradient_noise measuring every step": adaptive(
            {"schedule": {"type": "gradient_noise", "start": batch, "measure_every": 1}}
        ),
        # Its step times ride the noise sums' all-reduce; a decision (every 3 steps) resolves them.
        "goodput deciding every 3 steps": adaptive(
            {
                "schedule": {"type": "goodput", "start": batch, "warmup_steps": 0, "decide_every": 3},
                "min_global_batch": batch,
                "max_global_batch": batch,
            }
        ),
        'gradient_noise measuring every step with "token"': adaptive(
            {"schedule": {"type": "gradient_noise", "start": batch, "measure_every": 1}}, token=True
        ),
        "the forward/backward/step loop, constant schedule": adaptive_loop(
            {"schedule": {"type": "constant", "value": batch}}
        ),
        "armed out-of-memory recovery (a GPU's default)": adaptive(
            {"schedule": {"type": "constant", "value": batch}}, armed=True
        ),
        "a user's callable schedule": adaptive(
            {
                "schedule": {
                    "type": "callable",
                    "function": "collectives_worker:grow_every_step",
                    "start": batch,
                }
            }
        ),
    }
    pipe_plain = plain_pipeline_loop()
    pipe_cases = {
        "pipeline, constant schedule": adaptive_pipeline(),
        'pipeline, loss_normalization "token"': adaptive_pipeline(token=True),
    }
    if dist.get_rank() == 0:
        result = {
            "plain": plain,
            "every_steps": EVERY,
            "first_step": 2,
            "gas": GAS,
            "agreement_messages": AGREEMENT["messages"],
            "cases": {
                name: [[c - p[0], r - p[1]] for (c, r), p in zip(counts, plain)]
                for name, counts in cases.items()
            },
            "pipeline_plain": pipe_plain,
            "pipeline": {
                name: [[c - p[0], r - p[1]] for (c, r), p in zip(counts, pipe_plain)]
                for name, counts in pipe_cases.items()
            },
        }
        with open(os.path.join(out_dir, "counts.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

"""The peak-memory predictor against the same run without it, on real gloo ranks (one launch).

Usage: torchrun --nproc-per-node 2 tests/oom_predict_worker.py OUT_DIR  (run by tests/test_oom_predict.py)
The last rank has a simulated device memory (ds_adabatch.testing.simulated_memory_limit with
device_memory_bytes): a pass needs a fixed part plus a part per sample (or per token). Each case trains
the same steps twice, with ``memory.predict_peak`` false and true, counts the out-of-memory errors each
run recovered from, and writes OUT_DIR/<case>.json (rank 0); then "loop": DeepSpeed's forward / backward /
step loop with the predictor, where an out-of-memory error would end the run.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm as dist  # noqa: E402
import token_worker as tw  # noqa: E402
from engine_worker import Regression, ds_config, full_params, make_model, mse_loss, reference, write  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

STEPS = 22
# The last rank's device: 1 kB resident plus 100 B per sample fits 6 samples in 1650 B.
SAMPLE_MEMORY = {"device_memory_bytes": 1650, "fixed_bytes": 1000, "bytes_per_sample": 100}
# Token steps: 1 kB plus 10 B per token (padding included) fits 40 tokens in 1400 B.
TOKEN_MEMORY = {"device_memory_bytes": 1400, "fixed_bytes": 1000, "bytes_per_token": 10}


def _prediction(on: bool) -> dict:
    # A 2% margin: the simulated memory has no fragmentation for the default 10% to cover.
    return {"predict_peak": True, "peak_margin": 0.02} if on else {"predict_peak": False}


def _gathered(engine) -> list[int]:
    mine = [i for m in engine.last_step_batch.micro_batches for i in m.indices]
    parts: list = [None] * engine.world_size
    dist.all_gather_object(parts, mine)
    return [i for part in parts for i in part]


def _samples_config(world: int, predict: bool, **memory: int) -> dict:
    """A constant 16 samples per rank, 'auto' up to 16 per pass growing after 2 clean steps, uneven."""
    cfg = ds_config(2)
    cfg["adabatch"].update(
        schedule={"type": "constant", "value": 16 * world},
        max_micro_batch_per_gpu="auto",
        allow_uneven=True,
        memory={"micro_batch_ceiling": 16, "grow_after_steps": 2, **memory, **_prediction(predict)},
    )
    return cfg


def run_samples(predict: bool) -> dict:
    """'auto' from 16 samples per pass, growing back after 2 clean steps, the same 22 steps."""
    world = dist.get_world_size()
    data = Regression(n=STEPS * 16 * world)
    engine, *_ = ds_adabatch.initialize(make_model(), _samples_config(world, predict), data, loss_fn=mse_loss)
    batches, seen, micro, caps, peaks = [], [], [], [], []
    with simulated_memory_limit(ranks=[world - 1], **SAMPLE_MEMORY) as limit:
        for _ in range(STEPS):
            engine.train_batch()
            batches.append(engine.last_step_batch.global_batch.all_indices())
            seen += _gathered(engine)
            micro.append(engine.plan.micro_batch_per_gpu)
            caps.append(engine.memory_recovery.agreement.agreed_verdict)
            peaks.append(engine.last_metrics.extra.get("peak_memory_bytes"))
        # The last rank's peak since it started, with the predictor's resets folded in.
        memory = [engine.max_memory_allocated(), limit.max_memory_allocated()]
    raised = [None] * world
    dist.all_gather_object(raised, limit.raised)
    last_rank = [None] * world
    dist.all_gather_object(last_rank, {"peaks": peaks, "memory": memory})
    got = full_params(engine)
    record = {
        "ooms": engine.memory_recovery.ooms,
        "raised": raised,
        "micro": micro,
        "changes": [[h.step, h.new_micro_batch_per_gpu, h.reason] for h in engine.history],
        "caps": caps,
        "seen": seen,
        "last_rank": last_rank[-1],
    }
    if engine.global_rank == 0:
        want = reference(batches, data)
        record["max_rel_err"] = float((got - want).abs().max() / want.abs().max())
    hooks = len(engine.module._forward_pre_hooks)
    engine.close()
    record["pre_hooks_open_closed"] = [hooks, len(engine.module._forward_pre_hooks)]
    return record


def run_loop() -> dict:
    """DeepSpeed's forward / backward / step loop, where an out-of-memory error cannot be recovered (it
    ends the process): 'auto' from 4 samples per pass, growing after 2 clean steps toward 16, the
    predictor on. Its agreed bound must stop the growth at 6, as in train_batch (8 would end the run)."""
    world = dist.get_world_size()
    cfg = _samples_config(world, True, initial_micro_batch_per_gpu=4)
    data = Regression(n=STEPS * 16 * world)
    engine, _, loader, _ = ds_adabatch.initialize(make_model(), cfg, data, loss_fn=mse_loss)
    batches, seen, micro = [], [], []
    with simulated_memory_limit(ranks=[world - 1], **SAMPLE_MEMORY) as limit:
        for batch in loader:
            before = engine.global_steps
            engine.backward(mse_loss(engine, batch))
            engine.step()
            if engine.global_steps > before:
                batches.append(engine.last_step_batch.global_batch.all_indices())
                seen += _gathered(engine)
                micro.append(engine.plan.micro_batch_per_gpu)
            if engine.global_steps >= STEPS:
                break
    raised = [None] * world
    dist.all_gather_object(raised, limit.raised)
    got = full_params(engine)
    record = {"ooms": engine.memory_recovery.ooms, "raised": raised, "micro": micro, "seen": seen}
    if engine.global_rank == 0:
        want = reference(batches, data)
        record["max_rel_err"] = float((got - want).abs().max() / want.abs().max())
    engine.close()
    return record


def run_tokens(predict: bool) -> dict:
    """Token-budget steps (64 tokens per pass), growing back after 2 clean steps, the same targets."""
    world = dist.get_world_size()
    data = tw.Sequences()
    memory = {"grow_after_steps": 2, **_prediction(predict)}
    engine, *_ = ds_adabatch.initialize(
        tw.make_model(), tw.config(2, "token", memory=memory), data, collate_fn=tw.collate,
        loss_fn=tw.token_mean_loss, token_count_fn=tw.count_tokens, lengths=data.lengths,
    )  # fmt: skip
    steps, seen, budgets = [], [], []
    with simulated_memory_limit(ranks=[world - 1], **TOKEN_MEMORY) as limit:
        for target in tw.TARGETS * 2:
            engine.set_global_batch_size(target)
            engine.train_batch()
            step = engine.last_step_batch.global_batch
            steps.append(step.indices.tolist())
            seen += _gathered(engine)
            budgets.append(step.budget)
    raised = [None] * world
    dist.all_gather_object(raised, limit.raised)
    got = tw.params(engine)
    want = tw.reference(steps, data, "token")
    record = {
        "ooms": engine.memory_recovery.ooms,
        "raised": raised,
        "budgets": budgets,
        "seen": seen,
        "max_rel_err": float((got - want).abs().max() / want.abs().max()),
    }
    engine.close()
    return record


def main() -> None:
    out_dir = sys.argv[1]
    ds_adabatch.init_distributed()
    for name, run in (("samples", run_samples), ("tokens", run_tokens)):
        result = {"without": run(False), "with": run(True)}
        if dist.get_rank() == 0:
            write(out_dir, name, result)
    loop = run_loop()
    if dist.get_rank() == 0:
        write(out_dir, "loop", loop)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

"""Pipeline overhead: ``engine.train_batch()`` against a hand-written ``PipelineEngine.train_batch`` loop.

The main job's byte-level GPT-2 as 2 pipeline stages (``runners/train_pipe.py``'s model), the same data,
the same fixed plan (global 32 = micro 8 x GAS 4 per replica), ZeRO 1, both loops interleaved in one
launch::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/pipeline_overhead.py

With 4 processes it runs 2 stages x 2 replicas. It prints the load average before and after (and a
warning when the machine was not idle), then one markdown row: median step time of each loop, their
ratio, and the cost of one plan change inside a run (a new micro-batch and GAS: the activation shapes
are exchanged again). ``--dynamic-shape`` builds both pipelines with ``dynamic_shape=True`` (shapes sent
with every micro-batch instead of a reset on a change).
"""

from __future__ import annotations

import argparse
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

import ds_adabatch
from runners.train_pipe import build_pipeline, shifted_windows

MICRO, GAS, STAGES = 8, 4, 2


def pipeline(spec, dynamic: bool) -> PipelineModule:
    model = build_pipeline(spec, STAGES, seed=0)
    model.dynamic_shape = dynamic  # read by PipelineEngine at construction (0.19.8)
    return model


def plain_loop(data, spec, dynamic: bool):
    """The loop users write: a DistributedSampler over the replicas, a DataLoader, train_batch(iterator)
    of the step's micro-batches."""
    model = pipeline(spec, dynamic)
    grid = model.mpu()
    replicas = grid.get_data_parallel_world_size()
    cfg = h.ds_config(1, {}, micro=MICRO, gas=GAS, world=replicas)
    cfg.pop("adabatch")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=replicas, rank=grid.get_data_parallel_rank(), shuffle=True, seed=0
    )
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, collate_fn=shifted_windows)
    batches = iter(deepspeed.utils.RepeatingLoader(loader))

    def step():
        # The step's micro-batches are loaded before the schedule runs, as train_batch() loads them:
        # loading inside the schedule would put it on the pipeline's critical path and time that instead.
        micro = [next(batches) for _ in range(GAS)]
        return engine.train_batch(iter(micro))

    return engine, step


def adaptive_loop(data, spec, dynamic: bool):
    model = pipeline(spec, dynamic)
    replicas = model.mpu().get_data_parallel_world_size()
    adabatch = {
        "schedule": {"type": "constant", "value": MICRO * GAS * replicas},
        "max_micro_batch_per_gpu": MICRO,
    }
    cfg = h.ds_config(1, adabatch, micro=MICRO, gas=GAS, world=replicas)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(model, cfg, data, collate_fn=shifted_windows)
    return engine, engine.train_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per loop per round")
    p.add_argument("--changes", type=int, default=6, help="plan changes to time")
    p.add_argument("--dynamic-shape", action="store_true", help="PipelineModule(dynamic_shape=True) for both")
    args = p.parse_args()

    before = h.idle_check("before")
    ds_adabatch.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = h.lm_data()
    spec = h.MODELS["small"]
    ada, ada_step = adaptive_loop(data, spec, args.dynamic_shape)
    plain, plain_step = plain_loop(data, spec, args.dynamic_shape)
    for step in (ada_step, plain_step):  # warm-up: allocator, first shape exchange
        h.time_steps(step, 3)

    t_ada, t_plain = [], []
    for r in range(args.rounds):
        order = [(ada_step, t_ada), (plain_step, t_plain)]
        for step, sink in order if r % 2 == 0 else reversed(order):
            dist.barrier()
            sink += h.time_steps(step, args.steps)

    # One plan change inside a run: a new micro-batch and GAS (micro 4 x gas 1 and back: the stages
    # exchange activation shapes again).
    base = MICRO * GAS * ada.world_size
    change = []
    for i in range(args.changes):
        ada.set_global_batch_size(4 * ada.world_size if i % 2 == 0 else base)
        dist.barrier()
        t0 = time.perf_counter()
        ada.next_plan()
        ada.train_batch()
        change.append(time.perf_counter() - t0)
        ada.set_global_batch_size(None)
    ada.close()
    after = h.idle_check("after", own_processes=world)

    if rank == 0:
        replicas = ada.world_size
        shapes = "dynamic_shape" if args.dynamic_shape else "shapes reset on a change"
        print(f"\n{before}\n{after}")
        print(
            f"{STAGES} stages x {replicas} replica(s), ZeRO-1, global {base} = micro {MICRO} x gas {GAS} per "
            f"replica, {shapes}, {args.rounds} interleaved rounds x {args.steps} steps per loop\n"
        )
        print(
            "| model | hand-written `PipelineEngine.train_batch` | `train_batch` | ratio | step after a plan change |"
        )
        print("|---|---:|---:|---:|---:|")
        params = sum(p.numel() for p in plain.module.parameters())
        print(
            f"| small (stage 0: {params / 1e6:.2f} M) | {h.median(t_plain) * 1e3:.1f} ms | {h.median(t_ada) * 1e3:.1f} ms "
            f"| {h.median(t_ada) / h.median(t_plain):.3f} | {h.median(change) * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

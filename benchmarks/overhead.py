"""Runtime overhead: ``engine.train_batch()`` against a hand-written DeepSpeed loop, and plan-change cost.

Same model (the main job's byte-level GPT-2), same data, same fixed plan (global 32 = micro 8 x GAS 2 on
2 ranks), ZeRO-2, interleaved in one launch::

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/overhead.py

It prints a markdown table: median step time of each loop and their ratio (goal <= 1.02), the cost of
one plan change inside a run, and the cost of the alternative — saving a checkpoint and restarting the
engine with the new batch (in-process: it leaves out the new process launch and imports, so the real
restart costs more).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import deepspeed
import torch
import torch.distributed as dist

import ds_adabatch

MICRO, GAS = 8, 2


def plain_loop(world: int, rank: int, data, rounds_hint: int):
    """The DeepSpeed loop users write: DistributedSampler, DataLoader, forward/backward/step per micro-batch."""
    model = h.lm_model()
    cfg = h.ds_config(2, {}, micro=MICRO, gas=GAS, world=world)
    cfg.pop("adabatch")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler))

    def step():
        for _ in range(GAS):
            batch = next(loader)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

    return engine, step


def adaptive_loop(world: int, data):
    adabatch = {
        "schedule": {"type": "constant", "value": MICRO * GAS * world},
        "max_micro_batch_per_gpu": MICRO,
    }
    cfg = h.ds_config(2, adabatch, micro=MICRO, gas=GAS, world=world)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(), cfg, data)
    return engine, engine.train_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per loop per round")
    p.add_argument("--changes", type=int, default=6, help="plan changes to time")
    args = p.parse_args()

    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = h.lm_data()
    ada, ada_step = adaptive_loop(world, data)
    plain, plain_step = plain_loop(world, rank, data, args.rounds)
    for s in (ada_step, plain_step):  # warm-up: allocator, first-step compilation of buckets
        h.time_steps(s, 3)

    t_ada, t_plain = [], []
    for r in range(args.rounds):
        order = [(ada_step, t_ada), (plain_step, t_plain)]
        for step, sink in order if r % 2 == 0 else reversed(order):
            dist.barrier()
            sink += h.time_steps(step, args.steps)

    # One plan change inside a run: the step that applies it minus a steady step of the new plan.
    base = MICRO * GAS * world
    change_cost = []
    for i in range(args.changes):
        target = base * 2 if i % 2 == 0 else base
        ada.set_global_batch_size(target)
        dist.barrier()
        t0 = time.perf_counter()
        ada._decide_plan()  # applying the plan is all a change adds to the step that follows
        change_cost.append(time.perf_counter() - t0)
        ada.set_global_batch_size(None)
        ada.train_batch()

    # The alternative to changing in place: checkpoint, rebuild the engine with the new batch, reload.
    restart = []
    with tempfile.TemporaryDirectory() as tmp:
        ckdir = os.path.join(tmp, "ck")
        ckdir = [ckdir]
        dist.broadcast_object_list(ckdir, src=0)
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            ada.save_checkpoint(ckdir[0])
            ada.close()
            ada, _ = adaptive_loop(world, data)
            ada.load_checkpoint(ckdir[0])
            dist.barrier()
            restart.append(time.perf_counter() - t0)

    if rank == 0:
        m_ada, m_plain = h.median(t_ada), h.median(t_plain)
        m_change, m_restart = h.median(change_cost), h.median(restart)
        print(
            f"\n{world} ranks, ZeRO-2, global {base} = micro {MICRO} x gas {GAS}, "
            f"{args.rounds} interleaved rounds x {args.steps} steps\n"
        )
        print("| measure | value |")
        print("|---|---|")
        print(f"| median step, hand-written DeepSpeed loop | {m_plain * 1e3:.1f} ms |")
        print(f"| median step, `engine.train_batch()` | {m_ada * 1e3:.1f} ms |")
        print(f"| ratio train_batch / hand-written | {m_ada / m_plain:.3f} |")
        print(f"| one plan change in place (median of {len(change_cost)}) | {m_change * 1e3:.2f} ms |")
        print(
            f"| checkpoint + rebuild engine + reload, in process (median of {len(restart)}) | {m_restart:.2f} s |"
        )
        print(f"| restart / in-place change | {m_restart / m_change:.0f}x |")
    ada.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

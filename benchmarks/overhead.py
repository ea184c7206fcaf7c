"""Runtime overhead: ``engine.train_batch()`` and the forward / backward / step loop over ds_adabatch's
loader against a hand-written DeepSpeed loop, and plan-change cost.

Same model, same data, same fixed plan (global 32 = micro 8 x GAS 2 on 2 ranks), ZeRO-2, interleaved in
one launch, for the main job's byte-level GPT-2 (``small``, 0.44 M parameters) and a larger one where
compute dominates (``large``, 4 layers x width 512)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/overhead.py

It prints the load average before and after (and a warning when the machine was not idle), then a
markdown table per model: median step time of each loop and their ratio, and the cost of one plan change
inside a run. ``benchmarks/relaunch.py`` measures the alternative users pay without an in-place change:
stopping the job and relaunching it from a checkpoint with the new batch.
"""

from __future__ import annotations

import argparse
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import deepspeed
import torch
import torch.distributed as dist

import ds_adabatch

MICRO, GAS = 8, 2


def plain_loop(world: int, rank: int, data, spec):
    """The DeepSpeed loop users write: DistributedSampler, DataLoader, forward/backward/step per micro-batch."""
    model = h.lm_model(spec=spec)
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


def _adaptive_engine(world: int, data, spec, extra: dict | None = None):
    """ds_adabatch's engine and loader for the same fixed plan as the hand-written loop."""
    adabatch = {
        "schedule": {"type": "constant", "value": MICRO * GAS * world},
        "max_micro_batch_per_gpu": MICRO,
        **(extra or {}),
    }
    cfg = h.ds_config(2, adabatch, micro=MICRO, gas=GAS, world=world)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, _, loader, _ = ds_adabatch.initialize(h.lm_model(spec=spec), cfg, data)
    return engine, loader


def adaptive_loop(world: int, data, spec, extra: dict | None = None):
    engine, _ = _adaptive_engine(world, data, spec, extra)
    return engine, engine.train_batch


def adaptive_user_loop(world: int, data, spec):
    """The plain loop's body unchanged, over the loader ds_adabatch.initialize returns (runtime/engine/loop.py)."""
    engine, loader = _adaptive_engine(world, data, spec)
    batches = iter(loader)

    def step():
        nonlocal batches
        for _ in range(GAS):
            try:
                batch = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                batch = next(batches)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

    return engine, step


def measure_model(name: str, args, world: int, rank: int, data) -> dict:
    spec = h.MODELS[name]
    ada, ada_step = adaptive_loop(world, data, spec)
    user, user_step = adaptive_user_loop(world, data, spec)
    plain, plain_step = plain_loop(world, rank, data, spec)
    for s in (ada_step, user_step, plain_step):  # warm-up: allocator, first-step compilation of buckets
        h.time_steps(s, 3)

    t_ada, t_user, t_plain = [], [], []
    steps = args.large_steps if name == "large" else args.steps
    for r in range(args.rounds):
        order = [(ada_step, t_ada), (user_step, t_user), (plain_step, t_plain)]
        for step, sink in order if r % 2 == 0 else reversed(order):
            dist.barrier()
            sink += h.time_steps(step, steps)
    user.close()

    # One plan change inside a run: what deciding and applying a new plan adds to the step.
    base = MICRO * GAS * world
    change_cost = []
    for i in range(args.changes):
        ada.set_global_batch_size(base * 2 if i % 2 == 0 else base)
        dist.barrier()
        t0 = time.perf_counter()
        ada.next_plan()
        change_cost.append(time.perf_counter() - t0)
        ada.train_batch()
        ada.set_global_batch_size(None)
    ada.close()
    params = sum(p.numel() for p in plain.module.parameters())
    return {
        "params": params,
        "plain": h.median(t_plain),
        "ada": h.median(t_ada),
        "user": h.median(t_user),
        "change": h.median(change_cost),
        "n_change": len(change_cost),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per loop per round (small model)")
    p.add_argument(
        "--large-steps", type=int, default=3, help="optimizer steps per loop per round (large model)"
    )
    p.add_argument("--changes", type=int, default=6, help="plan changes to time")
    p.add_argument("--models", default="small,large", help="comma-separated: small, large")
    args = p.parse_args()

    before = h.idle_check("before")
    ds_adabatch.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = h.lm_data()
    results = {name: measure_model(name, args, world, rank, data) for name in args.models.split(",")}
    after = h.idle_check("after", own_processes=world)

    if rank == 0:
        print(f"\n{before}\n{after}")
        print(
            f"{world} ranks, ZeRO-2, global {MICRO * GAS * world} = micro {MICRO} x gas {GAS}, "
            f"{args.rounds} interleaved rounds x {args.steps} (small) / {args.large_steps} (large) steps per loop\n"
        )
        print(
            "| model | parameters | hand-written step | `train_batch` step | ratio | forward/backward/step "
            "loop over our loader | ratio | plan change in place |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            print(
                f"| {name} | {r['params'] / 1e6:.2f} M | {r['plain'] * 1e3:.1f} ms | {r['ada'] * 1e3:.1f} ms "
                f"| {r['ada'] / r['plain']:.3f} | {r['user'] * 1e3:.1f} ms | {r['user'] / r['plain']:.3f} "
                f"| {r['change'] * 1e3:.2f} ms |"
            )


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

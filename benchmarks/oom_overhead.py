"""Cost of armed out-of-memory recovery when nothing fails: ``train_batch()`` armed vs disarmed.

Same model (the main job's byte-level GPT-2), data and fixed plan (micro 8 x GAS 2 per rank) for two
engines that differ only in ``"memory": {"recover_from_oom": ...}``, timed interleaved in one launch,
for each ZeRO stage given::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/oom_overhead.py
    torchrun --nproc-per-node 8 benchmarks/oom_overhead.py --stages 0,1,2,3     # GPUs

Armed, every pass that issues a DeepSpeed gradient collective first joins one agreement of host integers
(recursive doubling, log2(ranks) message rounds; ZeRO-0/1: once per step at the boundary; ZeRO-2/3: once
per micro-batch), and each step saves the RNG state. The table gives median step times, their ratio
(goal <= 1.01) and the agreements per step. On the CPU the armed engine is armed as on an accelerator
(``--with-simulated-limit`` arms it through ``ds_adabatch.testing.simulated_memory_limit`` instead, its
hooks counted); ``--control`` disarms both engines, so its ratio shows the benchmark's own bias between
two identical engines. ``--predictor`` compares two armed engines instead, ``memory.predict_peak`` on
against off, both under a simulated device memory nothing exceeds (on the CPU the predictor reads that
simulated allocator; on GPUs the accelerator's): the cost of the allocator reads per pass (reported per
step) and of the verdict riding in each agreement.
"""

from __future__ import annotations

import argparse

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch
import torch.distributed as dist

import ds_adabatch
from ds_adabatch.testing import simulated_memory_limit

MICRO, GAS = 8, 2


def make_engine(stage: int, world: int, data, armed: bool, spec, predict: bool | None = None):
    adabatch = {
        "schedule": {"type": "constant", "value": MICRO * GAS * world},
        "max_micro_batch_per_gpu": MICRO,
        "memory": {"recover_from_oom": armed},
    }
    if predict is not None:
        adabatch["memory"]["predict_peak"] = predict
    cfg = h.ds_config(stage, adabatch, micro=MICRO, gas=GAS, world=world)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(spec=spec), cfg, data)
    return engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="0,2", help="comma-separated ZeRO stages")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per engine per round")
    p.add_argument("--model", choices=sorted(h.MODELS), default="small", help="benchmarks/_harness.py MODELS")
    p.add_argument(
        "--with-simulated-limit",
        action="store_true",
        help="on the CPU, arm through ds_adabatch.testing.simulated_memory_limit (its hooks counted)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="disarm both engines (an A/A run: its ratio is the benchmark's own bias and noise)",
    )
    p.add_argument(
        "--predictor",
        action="store_true",
        help="compare memory.predict_peak on (the 'armed' column) against off, both armed",
    )
    args = p.parse_args()

    ds_adabatch.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = h.lm_data()
    spec = h.MODELS[args.model]
    on_cpu = not torch.cuda.is_available()
    before_load = h.idle_check("at start", own_processes=world)
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        if args.predictor:
            armed = make_engine(stage, world, data, True, spec, predict=True)
            disarmed = make_engine(stage, world, data, True, spec, predict=False)
        else:
            armed = make_engine(stage, world, data, True, spec)
            disarmed = make_engine(stage, world, data, False, spec)
        # On the CPU nothing raises a recoverable out-of-memory error, so the runtime arms the agreement
        # only while a simulated limit is installed. Here it is armed as on an accelerator instead, so
        # the armed side pays exactly what a GPU user pays (the flag all-reduce per pass, the RNG save)
        # and not the simulated limit's hooks; --with-simulated-limit measures those hooks too.
        limit = simulated_memory_limit(10**9)
        if args.predictor:
            # Both armed through a simulated memory nothing exceeds: only the predictor differs.
            limit = simulated_memory_limit(device_memory_bytes=1 << 50, fixed_bytes=1, bytes_per_sample=1)
            limit.install()
        elif args.control:
            armed.memory_recovery.agreement.enabled = False
        elif on_cpu and not args.with_simulated_limit:
            armed.memory_recovery.agreement._can_raise = True

        def armed_step(engine=armed, limit=limit):
            if args.predictor:
                engine.train_batch()
                return
            if on_cpu and args.with_simulated_limit and not args.control:
                limit.install()
            try:
                engine.train_batch()
            finally:
                limit.remove()

        steps = {id(armed): armed_step, id(disarmed): disarmed.train_batch}
        for e in (armed, disarmed):
            h.time_steps(steps[id(e)], 2)  # warm-up
        before = armed.memory_recovery.agreement.agreements
        reads_before = armed.memory_recovery.predictor.reads
        t_armed, t_disarmed = [], []
        for r in range(args.rounds):
            order = [(armed, t_armed), (disarmed, t_disarmed)]
            for engine, sink in order if r % 2 == 0 else reversed(order):
                dist.barrier()
                sink += h.time_steps(steps[id(engine)], args.steps)
        per_step = (armed.memory_recovery.agreement.agreements - before) / (args.rounds * args.steps)
        reads = (armed.memory_recovery.predictor.reads - reads_before) / (args.rounds * args.steps)
        rows.append((stage, h.median(t_disarmed), h.median(t_armed), per_step, reads))
        limit.remove()
        armed.close()
        disarmed.close()
    if rank == 0:
        print(
            f"\n{world} ranks, model {args.model}, micro {MICRO} x gas {GAS} per rank, {args.rounds} rounds x "
            f"{args.steps} steps\n{before_load}\n{h.idle_check('at end', own_processes=world)}\n"
        )
        a, b = ("predictor on", "predictor off") if args.predictor else ("armed", "disarmed")
        print(
            f"| ZeRO | median step, {b} | median step, {a} | {a} / {b} | agreements per step "
            f"| allocator reads per step ({a}) |"
        )
        print("|---|---|---|---|---|---|")
        for stage, off, on, per_step, reads in rows:
            print(
                f"| {stage} | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | {on / off:.3f} | {per_step:g} | {reads:g} |"
            )


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

"""Cost of measuring the gradient-noise scale, at the default cadence and per measured step.

Two engines on the main job's model and data, ZeRO-2, global 32 = micro 8 x GAS 2 on 2 ranks, stepped
interleaved in one launch: one with a constant schedule (no measurement), one with the
``gradient_noise`` schedule (measuring every ``measure_every`` steps, default 10; its warm-up is set
beyond the run so the batch never changes and both engines do the same work)::

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/noise_overhead.py

Goal: at most 5% of step time at the default cadence.
"""

from __future__ import annotations

import argparse

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import deepspeed
import torch.distributed as dist

import ds_adabatch
from ds_adabatch.config.schedules import GradientNoiseScheduleConfig

MICRO, GAS = 8, 2


def build(schedule: dict, world: int, data):
    adabatch = {"schedule": schedule, "max_micro_batch_per_gpu": MICRO}
    cfg = h.ds_config(2, adabatch, micro=MICRO, gas=GAS, world=world)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(), cfg, data)
    return engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per engine per round")
    args = p.parse_args()

    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = h.lm_data()
    batch = MICRO * GAS * world
    every = GradientNoiseScheduleConfig.model_fields["measure_every"].default
    plain = build({"type": "constant", "value": batch}, world, data)
    noisy = build({"type": "gradient_noise", "start": batch, "warmup_steps": 10**9}, world, data)
    h.time_steps(plain.train_batch, 3)
    h.time_steps(noisy.train_batch, 3)

    t_plain, t_noisy_all, t_measured, t_unmeasured = [], [], [], []
    for r in range(args.rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            dist.barrier()
            if which == 0:
                t_plain += h.time_steps(plain.train_batch, args.steps)
                continue
            for _ in range(args.steps):
                measured = noisy._should_measure_noise()
                dt = h.time_steps(noisy.train_batch, 1)[0]
                t_noisy_all.append(dt)
                (t_measured if measured else t_unmeasured).append(dt)

    if rank == 0:
        m_plain = h.median(t_plain)
        mean_plain = sum(t_plain) / len(t_plain)
        mean_noisy = sum(t_noisy_all) / len(t_noisy_all)
        print(
            f"\n{world} ranks, ZeRO-2, global {batch} = micro {MICRO} x gas {GAS}, measure_every={every}, "
            f"{args.rounds} interleaved rounds x {args.steps} steps\n"
        )
        print("| measure | value |")
        print("|---|---|")
        print(f"| median step, no measurement | {m_plain * 1e3:.1f} ms |")
        print(f"| median measured step | {h.median(t_measured) * 1e3:.1f} ms |")
        print(f"| median unmeasured step (gradient_noise schedule) | {h.median(t_unmeasured) * 1e3:.1f} ms |")
        print(f"| measured / plain step (median) | {h.median(t_measured) / m_plain:.3f} |")
        print(f"| mean step time at the default cadence / plain | {mean_noisy / mean_plain:.3f} |")
        print(f"| noise-scale estimate at the end | {noisy.noise.noise_scale} |")
    plain.close()
    noisy.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

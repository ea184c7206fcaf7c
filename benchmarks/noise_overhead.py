"""Cost of measuring the gradient-noise scale, per measured step and at the default cadence.

One engine on the main job's model and data (ZeRO-2 unless ``--stage``, global 32 = micro 8 x GAS 2 on 2 ranks) with the
``gradient_noise`` schedule, alternating blocks of ``--block`` steps that measure every step with blocks
that measure none, on the same engine, data stream and memory layout; the difference is the probe's
cost alone (its warm-up is set beyond the run, so the batch never changes). The first step of each
block is not timed: a measurement's all-reduce completes, and is folded into the estimate, at the end
of the step after it, so a step's time includes the previous step's measurement::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/noise_overhead.py
    ... benchmarks/noise_overhead.py --geometry sgd --stage 3     # plain gradients under ZeRO-3

``--geometry`` picks the noise-scale geometry (default: the schedule's, ``auto``, which is ``adam``
with this AdamW). In the adam geometry the hooks add each micro-batch's squared gradient into a
per-coordinate buffer over the rank's share of the coordinates instead of summing it, and the optimizer
step weighs that buffer and the reduced gradient with Adam's denominator (no collective). ``--stage``
picks the ZeRO stage (default 2). The cost at the default cadence is the per-measured-step cost times
the fraction of steps measured (1 / the default ``measure_every``). Goal: at most 5% of step time.
"""

from __future__ import annotations

import argparse

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch.distributed as dist

import ds_adabatch
from ds_adabatch.config.schedules import GradientNoiseScheduleConfig

MICRO, GAS = 8, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (half of them measured)")
    p.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    fields = GradientNoiseScheduleConfig.model_fields
    p.add_argument(
        "--geometry",
        choices=["auto", "sgd", "adam"],
        default=fields["geometry"].default,
        help="noise-scale geometry (default: the schedule's default, %(default)s)",
    )
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="ZeRO stage (default 2)")
    args = p.parse_args()

    ds_adabatch.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    load_before = h.idle_check("at launch", own_processes=world)
    batch = MICRO * GAS * world
    default_every = fields["measure_every"].default
    schedule = {
        "type": "gradient_noise",
        "start": batch,
        "warmup_steps": 10**9,
        "measure_every": 1,
        "geometry": args.geometry,
    }
    cfg = h.ds_config(
        args.stage,
        {"schedule": schedule, "max_micro_batch_per_gpu": MICRO},
        micro=MICRO,
        gas=GAS,
        world=world,
    )
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(), cfg, h.lm_data())
    h.time_steps(engine.train_batch, 4)

    measured, plain = [], []
    cadence = engine._noise_cadence
    for i in range(args.steps):
        block, first = divmod(i, args.block)
        cadence.every = 1 if block % 2 == 0 else 0  # measure every step, or none
        is_measured = engine._should_measure_noise()
        dist.barrier()
        took = h.time_steps(engine.train_batch, 1)[0]
        if first:
            (measured if is_measured else plain).append(took)

    if rank == 0:
        m_plain, m_measured = h.median(plain), h.median(measured)
        per_step = m_measured / m_plain - 1
        at_default = per_step / default_every
        print(
            f"\n{world} ranks, ZeRO-{args.stage}, geometry {engine._noise_geometry} ({args.geometry}), global {batch} = micro {MICRO} x "
            f"gas {GAS}; {len(measured)} measured and "
            f"{len(plain)} unmeasured steps timed, in alternating blocks of {args.block} on one engine; "
            f"default measure_every={default_every}\n"
        )
        print("| measure | value |")
        print("|---|---|")
        print(f"| median unmeasured step | {m_plain * 1e3:.1f} ms |")
        print(f"| median measured step | {m_measured * 1e3:.1f} ms |")
        print(f"| cost of one measured step | {per_step * 100:+.1f}% |")
        print(f"| cost at the default cadence (every {default_every}) | {at_default * 100:+.1f}% |")
        estimate = engine.noise.noise_scale
        print(f"| noise-scale estimate at the end | {'-' if estimate is None else f'{estimate:.1f}'} |")
        print(f"\n{load_before}\n{h.idle_check('at the end', own_processes=world)}")
    engine.close()


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

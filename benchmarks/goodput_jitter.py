"""How the goodput schedule's decisions hold up when the step times it measures scatter.

The schedule's own loop, as ``tests/test_goodput.py`` runs it: one rank, one pass per step (the CPU and
GPU benchmarks' layout), the default warm-up (20 steps without a noise estimate), then a confident
estimate at ``--noise-scale``. Every step is measured on a simulated curve with ``jitter`` (each time the
curve's value times a lognormal factor of mean 1, :meth:`~ds_adabatch.signals.StepTimeFit.measure`),
over ``--seeds`` draws of that scatter. No training runs: what is measured is the decisions, against
the truth the curve and the noise scale define. For each curve and jitter::

    reach     the mean step at which the batch first reaches the goodput optimum's batch (or the
              warm-up's end, where the optimum needs the noise estimate), over the seeds
    undone    trials undone, summed over the seeds
    goodput   the mean over steps and seeds of goodput(batch run) / goodput(optimum), the truth's
              (the curve's mean cost, the efficiency at the noise scale); and its lowest seed

Usage::

    python benchmarks/goodput_jitter.py                     # the three curves, jitter 0.1 / 0.25 / 0.4
    python benchmarks/goodput_jitter.py --seeds 100 --jitter 0.25

Deterministic: the same command prints the same figures on any machine. To compare two versions of
the schedule, run the same command in each checkout.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.plan import plan_batch
from ds_adabatch.schedules import BatchSizeController, ScheduleContext
from ds_adabatch.signals import SimulatedDevice, parse_step_time_curve, statistical_efficiency

# (name, curve, start, max batch, noise scale): the host-bound GPU (a 45 ms step at every batch),
# the 2-core CPU benchmark's curve, and a compute-bound one (a step in proportion to its samples).
CURVES = [
    ("host-bound GPU", "fixed=0.045", 32, 256, 40.0),
    ("the CPU benchmark's", "fixed=0.0093,per_sample=0.00276", 8, 64, 60.0),
    ("compute-bound", "fixed=0.001,per_sample=0.003", 8, 64, 40.0),
]
WARMUP = 20


def run(curve_text: str, start: int, top: int, noise: float, seed: int, steps: int) -> dict:
    curve = parse_step_time_curve(curve_text)
    section = AdaBatchConfig.model_validate(
        {
            "schedule": {"type": "goodput", "start": start},
            "max_micro_batch_per_gpu": top,
            "max_global_batch": top,
            "lr_scaling": {"rule": "sqrt"},
        }
    )
    controller = BatchSizeController(section, 1)
    schedule = controller.schedule
    device = SimulatedDevice(curve, random.Random(seed))

    def goodput(batch: int) -> float:
        return batch / curve.predict(batch, 1) * statistical_efficiency(batch, noise, start, 0.5)

    best = max(range(start, top + 1), key=goodput)
    batch, rates, undone, reached = controller.initial_global_batch(), [], 0, None
    for step in range(steps):
        known = step >= WARMUP
        ctx = ScheduleContext(
            step=step,
            samples=0,
            global_batch=batch,
            world_size=1,
            noise_scale=noise if known else None,
            noise_scale_error=0.1 if known else None,
            micro_batch_limit=top,
        )
        decision = controller.next_global_batch(ctx)
        batch = decision.global_batch
        undone += "not kept" in decision.reason
        plan = plan_batch(batch, 1, top)
        schedule.throughput.observe(
            plan.micro_batch_per_gpu,
            plan.gradient_accumulation_steps,
            1,
            device.measure(plan.micro_batch_per_gpu, plan.gradient_accumulation_steps),
        )
        rates.append(goodput(batch) / goodput(best))
        if reached is None and goodput(batch) >= 0.99 * goodput(best):
            reached = step
    return {
        "reach": steps if reached is None else reached,
        "undone": undone,
        "goodput": statistics.mean(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=40, help="draws of the scatter per curve and jitter")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--jitter", type=float, nargs="+", default=[0.1, 0.25, 0.4])
    parser.add_argument(
        "--drift",
        type=float,
        nargs="+",
        default=[0.0],
        help="the device's speed changes too: every --drift-steps steps on average its times are all "
        "multiplied by a lognormal factor whose log has this standard deviation (SimulatedDevice)",
    )
    parser.add_argument("--drift-steps", type=int, default=50, help="mean steps between two speed changes")
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"{args.seeds} seeds x {args.steps} steps per curve and jitter (deterministic)")
    for name, text, start, top, noise in CURVES:
        for jitter, drift in itertools.product(args.jitter, args.drift):
            moved = f",drift={drift},drift_steps={args.drift_steps}" if drift else ""
            runs = [
                run(f"{text},jitter={jitter}{moved}", start, top, noise, seed, args.steps)
                for seed in range(args.seeds)
            ]
            rates = [r["goodput"] for r in runs]
            print(
                f"{name:20s} {text:32s} start {start:3d} max {top:3d} B_noise {noise:g} jitter {jitter:<5g}"
                + (f" drift {drift:<5g}" if drift else "")
                + f" reach {statistics.mean(r['reach'] for r in runs):6.1f}"
                f"  undone {sum(r['undone'] for r in runs):3d}"
                f"  goodput {statistics.mean(rates):.3f} (lowest seed {min(rates):.3f})"
            )
    print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()

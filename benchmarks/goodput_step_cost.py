"""What a steady step costs under ``goodput`` against a constant batch of the same size, interleaved.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/goodput_step_cost.py      # CPU, tiny model
    python benchmarks/goodput_step_cost.py --device cuda --model gpu --batch 256      # one CUDA GPU

On one device (world 1, micro = batch, ZeRO 2; bf16 on a GPU), four engines on the same model size and
data, stepped in interleaved rounds (``--steps`` optimizer steps each per round, the order rotated every
round, so drift in the machine's speed falls on all alike):

* ``constant``: ``{"type": "constant", "value": B}``;
* ``goodput``: ``{"type": "goodput", "start": B}`` with ``max_global_batch`` B, so it can never move: its
  step times, its noise splits (a step run as two half passes now and then to measure the noise scale at
  one pass) and its decisions, at the constant batch's shape;
* ``goodput-nosplit``: the same with ``measure_every`` 10**6, so no step is split (and ``warmup_steps``
  20, the default's length, so that it decides at ``goodput``'s cadence once warm): the difference to
  ``goodput`` is what the noise measurement costs (its splits), the difference to ``constant`` what the
  rest costs (step times, decisions, the idle hooks);
* ``linear``: ``B/2 -> B`` over the whole run's steps (``--ramp-steps``): at B 256 a new batch (a new
  shape) every few steps, as the time-to-target runs' ramp; its mean batch is about 3B/4, so its step
  should cost no more than ``constant``'s where the step is bound by the host.

It prints each engine's median milliseconds per step (wall clock; the round timed as a whole, the device
synchronised at its ends) and process CPU milliseconds per step, each against ``constant``, and the
load average before and after. On the GPU that tells where ``goodput``'s steps go longer than a fixed
batch's (the H200 time-to-target runs: 7-10%, BENCHMARKS.md) without the time-to-target run around it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch
from time_to_target import MODELS  # the model sizes the time-to-target runs train

import ds_adabatch
from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model


def schedules(batch: int, ramp_steps: int) -> dict[str, dict[str, Any]]:
    half = max(1, batch // 2)
    return {
        "constant": {"type": "constant", "value": batch},
        "goodput": {"type": "goodput", "start": batch},
        # warmup_steps as goodput's default gives it (20): without it the warm-up would last as long as
        # the noise estimate's first 10**6-step time constant, deciding by step cost every step.
        "goodput-nosplit": {"type": "goodput", "start": batch, "measure_every": 10**6, "warmup_steps": 20},
        "linear": {
            "type": "linear",
            "start": half,
            "end": batch,
            "ramp_samples": ramp_steps * (half + batch) // 2,
        },
    }


def config(schedule: dict[str, Any], batch: int, gpu: bool) -> dict[str, Any]:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": gpu},
        "steps_per_print": 10**9,
        "adabatch": {
            "schedule": schedule,
            "max_micro_batch_per_gpu": batch,
            "max_global_batch": batch,
            "lr_scaling": {"rule": "sqrt", "reference_batch": batch},
            "data": {"shuffle": True, "seed": 0, "num_workers": 0},
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=sorted(MODELS), default="smoke")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per engine per round")
    p.add_argument("--warmup", type=int, default=40, help="steps of each engine before timing")
    p.add_argument(
        "--ramp-steps", type=int, default=None, help="the linear ramp's length in steps (default: the run's)"
    )
    args = p.parse_args()
    gpu = args.device == "cuda"
    if args.ramp_steps is None:
        args.ramp_steps = args.warmup + args.rounds * args.steps
    if not gpu:
        torch.set_num_threads(1)
    print(h.idle_check("before"), flush=True)
    spec = ModelSpec(**MODELS[args.model])
    data = ByteWindows(ByteCorpus(max_bytes=8_000_000).train, spec.context)
    engines = {
        name: ds_adabatch.initialize(build_model(spec, seed=0), config(sched, args.batch, gpu), data)[0]
        for name, sched in schedules(args.batch, args.ramp_steps).items()
    }

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    for engine in engines.values():
        for _ in range(args.warmup):
            engine.train_batch()
    sync()
    changes_before = {name: len(engine.history) for name, engine in engines.items()}
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            engine = engines[name]
            sync()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                engine.train_batch()
            sync()
            wall[name].append((time.perf_counter() - started) / args.steps)
            cpu[name].append((time.process_time() - cpu_started) / args.steps)
    print(
        f"{args.device}, model {args.model} ({sum(p.numel() for p in engines['constant'].module.parameters()) / 1e6:.1f} M), "
        f"batch {args.batch}, {args.rounds} rounds x {args.steps} steps per engine"
    )
    base_wall, base_cpu = statistics.median(wall["constant"]), statistics.median(cpu["constant"])
    for name, engine in engines.items():
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{name:>16}: {1e3 * w:7.2f} ms a step ({w / base_wall:.3f}x constant), CPU {1e3 * c:7.2f} ms "
            f"({c / base_cpu:.3f}x); batch now {engine.plan.global_batch_size}, "
            f"{len(engine.history) - changes_before[name]} plan changes while timed"
        )
    print(h.idle_check("after"), flush=True)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()

"""Whether the steps after a change of batch run slower than the same batch's steady steps.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/shape_change_steps.py

A goodput trial is judged on the first step times of its shape (the first step itself is not kept,
:class:`~ds_adabatch.signals.ThroughputModel`'s ``skip_first``), and a shape it leaves keeps those times.
If the steps after every change of batch ran slower for a while, each trial would be judged, and each
shape left rated, too slow. One engine (world 1, the time-to-target CPU model and its policies' setting:
AdamW, ZeRO 0, fp32, one pass per step; nothing else running: no turns, no validation) alternates ``--batches`` every ``--run`` optimizer steps
(a ``piecewise`` schedule by steps) for ``--steps`` steps. Printed, per batch:

* the median over its runs of the k-th step of a run (k = 0..9) divided by that run's steady step (the
  median of its steps 10 to ``--run`` - 1), for the first run of the batch and for the later ones
  (returns to a batch measured before);
* the process's first steps, each divided by the steady step of the whole job at that batch (the
  median of every run's steady steps).

The times are this machine's; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch
from time_to_target import MODELS, ds_config, parse  # the time-to-target CPU runs' model and setting

import ds_adabatch
from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model

AFTER = 10  # steps after a change profiled
STEADY_FROM = 10  # a run's steps from this one on are its steady ones


def runs_of(steps: list[tuple[int, float]]) -> list[tuple[int, list[float]]]:
    """``(batch, seconds of its consecutive steps)`` for each run of one batch, in order."""
    runs: list[tuple[int, list[float]]] = []
    for batch, seconds in steps:
        if runs and runs[-1][0] == batch:
            runs[-1][1].append(seconds)
        else:
            runs.append((batch, [seconds]))
    return runs


def profile(steps: list[tuple[int, float]], run: int) -> dict[int, dict[str, list[float]]]:
    """Per batch: ``"first"`` (its first run) and ``"returns"`` (the later ones), each the median over
    those runs of step k / the run's steady step, k = 0..AFTER-1; runs shorter than ``run`` are left
    out (the job's last one)."""
    ratios: dict[int, dict[str, list[list[float]]]] = {}
    for batch, times in runs_of(steps):
        if len(times) < run:
            continue
        steady = statistics.median(times[STEADY_FROM:run])
        which = "returns" if batch in ratios else "first"
        ratios.setdefault(batch, {"first": [], "returns": []})[which].append(
            [t / steady for t in times[:AFTER]]
        )
    return {
        batch: {
            which: [statistics.median(col) for col in zip(*rows)] for which, rows in kinds.items() if rows
        }
        for batch, kinds in ratios.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--run", type=int, default=30, help="optimizer steps of each batch before the next")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--save", default=None, help="write the steps (batch, seconds) to this JSON")
    args = p.parse_args()
    if args.run <= STEADY_FROM + 2:
        p.error(
            f"--run must be above {STEADY_FROM + 2}: a run's steps from {STEADY_FROM} on are its steady ones"
        )
    largest = max(parse([]).sweep)  # the CPU runs' micro-batch bound
    if len(set(args.batches)) < 2 or len(set(args.batches)) != len(args.batches):
        p.error("--batches must name two or more different batches (the job alternates between them)")
    if not all(1 <= b <= largest for b in args.batches):
        p.error(
            f"--batches must each be between 1 and {largest} (the time-to-target CPU runs' largest batch)"
        )
    torch.set_num_threads(1)
    print(h.idle_check("before"), flush=True)
    spec = ModelSpec(**MODELS["cpu"])
    data = ByteWindows(ByteCorpus().train, spec.context)
    points = [[i * args.run, args.batches[i % len(args.batches)]] for i in range(args.steps // args.run + 1)]
    schedule = {"type": "piecewise", "unit": "steps", "points": points}
    cfg = ds_config(schedule, parse([]))  # the CPU runs' setting
    engine = ds_adabatch.initialize(build_model(spec, seed=0), cfg, data)[0]
    steps: list[tuple[int, float]] = []
    for _ in range(args.steps):
        batch = engine.plan.global_batch_size
        began = time.perf_counter()
        engine.train_batch()
        steps.append((batch, time.perf_counter() - began))
    engine.close()
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"run": args.run, "steps": steps}, f)

    print(
        f"cpu model, batches {' '.join(map(str, args.batches))} in turns of {args.run} steps, {args.steps} steps"
    )
    for batch, kinds in sorted(profile(steps, args.run).items()):
        for which, ratios in kinds.items():
            print(
                f"batch {batch:>3}, {which:>7}: step k / the run's steady step: "
                + " ".join(f"{r:.3f}" for r in ratios)
            )
    runs = runs_of(steps)
    for batch in args.batches:
        steady = statistics.median(
            t for b, times in runs if b == batch for t in times[STEADY_FROM : args.run]
        )
        first = next(times for b, times in runs if b == batch)[:AFTER]
        print(
            f"batch {batch:>3}: steady {1e3 * steady:.2f} ms; the process's first steps / steady: "
            + " ".join(f"{t / steady:.3f}" for t in first)
        )
    print(h.idle_check("after", own_processes=1), flush=True)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

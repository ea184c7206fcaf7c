"""What a pause does to the step times the goodput schedule keeps, with and without the runtime's pause flag.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/pause_steps.py

One engine (world 1, the time-to-target CPU model, a constant batch ``--batch``, one pass per step)
trains ``--rounds`` rounds of ``--steps`` steps. Between two rounds the job pauses for about ``--pause``
seconds, the kinds in turns:

* ``evaluation``: forward passes of the same model over held-out windows (what a validation does);
* ``other work``: a matrix product of another size, over and over (another job's turn on the cores);
* ``idle``: a sleep.

Every step's time and the gap before it are recorded and then fed, in order, to two
:class:`~ds_adabatch.signals.ThroughputModel`\\ s as the runtime feeds them: one with the pause flag the
runtime computes (:func:`ds_adabatch.runtime.core.step_times.is_pause`, on the same gaps, for every
step), one without.
Printed, per pause kind, over its rounds:

* the median of the k-th step after the pause, k = 0..9, divided by the steady step (the median of every
  round's steps from the 12th on);
* the shape's kept median (what the fit rates it at) read 4 and 8 steps after the pause, where a
  decision may fall, divided by the steady step: median and worst over the rounds, with and without
  the flag; and the steps not kept.

The first round is a warm-up (no pause before it) and is not reported. Deterministic in what it
computes from the times; the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch
from goodput_step_cost import config  # the same single-device setting
from time_to_target import MODELS  # the model sizes the time-to-target runs train

import ds_adabatch
from ds_adabatch.runtime.core.step_times import PAUSE_GAPS, is_pause
from ds_adabatch.signals import ThroughputModel
from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model

KINDS = ("evaluation", "other work", "idle")
AFTER = 10  # steps after a pause profiled
READ_AT = (4, 8)  # steps after a pause at which the kept median is read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=19, help="rounds of steps (the first is a warm-up)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per round")
    p.add_argument("--pause", type=float, default=1.0, help="seconds of each pause")
    p.add_argument("--save", default=None, help="write the steps (round, index, seconds, gap) to this JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(h.idle_check("before"), flush=True)
    spec = ModelSpec(**MODELS["cpu"])
    corpus = ByteCorpus(max_bytes=8_000_000)
    data = ByteWindows(corpus.train, spec.context)
    held = ByteWindows(corpus.validation, spec.context)
    windows = torch.stack([held[i]["input_ids"] for i in range(64)])
    schedule = {"type": "constant", "value": args.batch}
    engine = ds_adabatch.initialize(build_model(spec, seed=0), config(schedule, args.batch, False), data)[0]
    other = torch.randn(384, 384)

    def pause(kind: str) -> None:
        until = time.perf_counter() + args.pause
        if kind == "idle":
            time.sleep(args.pause)
            return
        while time.perf_counter() < until:
            if kind == "evaluation":
                with torch.no_grad():
                    engine.module(input_ids=windows, labels=windows)
            else:
                other.matmul(other)

    # (round, index in round, step seconds, gap before it)
    steps: list[tuple[int, int, float, float]] = []
    ended = None
    for r in range(args.rounds):
        if r:
            pause(KINDS[(r - 1) % len(KINDS)])
        for i in range(args.steps):
            began = time.perf_counter()
            engine.train_batch()
            seconds = time.perf_counter() - began
            steps.append((r, i, seconds, 0.0 if ended is None else began - ended))
            ended = time.perf_counter()
    engine.close()
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"batch": args.batch, "kinds": KINDS, "steps": steps}, f)

    steady = statistics.median(t for r, i, t, _ in steps if i >= 12)
    flagged, plain = ThroughputModel(), ThroughputModel()
    gaps: list[float] = []
    read: dict[tuple[str, int, bool], list[float]] = {}
    flags = 0
    for k, (r, i, seconds, gap) in enumerate(steps):
        # As the runtime: every step but the run's first (no gap before it), against the recent gaps.
        paused = k > 0 and is_pause(gap, seconds, gaps[-PAUSE_GAPS:])
        flags += paused
        if k:
            gaps.append(gap)
        flagged.observe(args.batch, 1, 1, seconds, paused=paused)
        plain.observe(args.batch, 1, 1, seconds)
        if r and i + 1 in READ_AT:
            kind = KINDS[(r - 1) % len(KINDS)]
            for with_flag, model in ((True, flagged), (False, plain)):
                read.setdefault((kind, i + 1, with_flag), []).append(model.measured()[0][2] / steady)
    print(
        f"cpu model ({sum(p.numel() for p in engine.module.parameters()) / 1e6:.2f} M), batch {args.batch}: "
        f"{args.rounds - 1} pauses of {args.pause:g} s ({flags} flagged), steady step {1e3 * steady:.1f} ms"
    )
    for kind in KINDS:
        rounds = [r for r in range(1, args.rounds) if KINDS[(r - 1) % len(KINDS)] == kind]
        profile = [
            statistics.median(t for r, i, t, _ in steps if r in rounds and i == k) for k in range(AFTER)
        ]
        print(
            f"{kind:>10}, step k after the pause / steady: " + " ".join(f"{t / steady:.2f}" for t in profile)
        )
        for at in READ_AT:
            cells = []
            for with_flag in (True, False):
                values = read[(kind, at, with_flag)]
                cells.append(
                    f"{'with' if with_flag else 'without'} the flag {statistics.median(values):.3f} "
                    f"(worst {max(values):.3f})"
                )
            print(f"{'':>12}kept median / steady, {at} steps after: " + "; ".join(cells))
    print(f"steps not kept for following a pause: {flagged.settled_out} of {len(steps)}")
    print(h.idle_check("after", own_processes=1), flush=True)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

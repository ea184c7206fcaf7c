"""Our own Python in a steady optimizer step: ``train_batch`` against the same DeepSpeed engine, bare.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_cost.py [--steps 400 --stages 0,2]
    python benchmarks/host_cost.py --model large      # on one CUDA GPU (DS_ACCELERATOR=cuda)

A world of one (plain ``python``), the main job's small model (``--model``), global 16 = micro 8 x GAS 2,
a constant schedule (every step steady: no plan change, no collective). One ds_adabatch engine is built
per ZeRO stage, and three ways of running one optimizer step on it are interleaved step by step (the
order rotated every step, so drift in load hits them alike):

* ``bare``: DeepSpeed alone, ``engine.deepspeed``'s ``forward`` / ``backward`` / ``step`` on micro-batches
  collated beforehand, the boundary set as ``train_batch`` sets it;
* ``train_batch(it)``: ``engine.train_batch`` over an iterator of the same micro-batches: the step core
  (decide, plan, account, the step record), the passes' weighting and the loss bookkeeping;
* ``train_batch()``: ``engine.train_batch`` drawing its step from ds_adabatch's sampler and loader (the
  step's sample indices, cut for this rank, collated), as a script without ``data_iter`` runs it.

It prints the median step of each and the median of the per-step differences against ``bare`` (pairs
from the same rotation), which is the host cost of ours; and the time ``default_collate`` takes for the
step's micro-batches alone (work any loader does, bare or not). Then a cProfile of steady steps of the
two ``train_batch`` ways: the self time per step in ``ds_adabatch``'s own files and the heaviest
functions (cProfile inflates every Python call: an upper bound; the interleaved difference is the
figure). Last, a host-only table: the same ways with DeepSpeed's ``forward`` / ``backward`` / ``step``
replaced by stand-ins that return at once, on both sides alike, which leaves the Python around them
(``--clock cpu`` makes it steady on a busy machine). The goal is at most 0.3 ms of ours per steady step.
On a GPU the micro-batches live on the device for every way and each step ends with a synchronisation.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch
from torch.utils.data import default_collate

import ds_adabatch

MICRO, GAS = 8, 2


def build(stage: int, data, spec):
    """ds_adabatch's engine at a fixed plan (global MICRO x GAS) over ``data``."""
    adabatch = {"schedule": {"type": "constant", "value": MICRO * GAS}, "max_micro_batch_per_gpu": MICRO}
    cfg = h.ds_config(stage, adabatch, micro=MICRO, gas=GAS, world=1)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(spec=spec), cfg, data)
    return engine


def ways(engine, data) -> dict[str, Callable[[], object]]:
    """The three ways of running one optimizer step on ``engine`` (module docstring)."""
    ds = engine.deepspeed
    pool = [
        {
            k: v.to(ds.device)
            for k, v in default_collate([data[i] for i in range(j * MICRO, (j + 1) * MICRO)]).items()
        }
        for j in range(8)
    ]
    turn = {"bare": 0, "iter": 0}

    def micro_batches(way: str) -> list[dict[str, torch.Tensor]]:
        k = turn[way]
        turn[way] = (k + GAS) % len(pool)
        return [pool[(k + i) % len(pool)] for i in range(GAS)]

    def bare() -> None:
        batches = micro_batches("bare")
        for i, batch in enumerate(batches):
            ds.set_gradient_accumulation_boundary(i == len(batches) - 1)
            loss = ds(**batch).loss
            ds.backward(loss, scale_wrt_gas=False)
            ds.step()

    def ours_iter() -> object:
        return engine.train_batch(iter(micro_batches("iter")))

    return {"bare": bare, "train_batch(it)": ours_iter, "train_batch()": engine.train_batch}


def interleaved(
    steps: dict[str, Callable[[], object]], n: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Per-step seconds of each way on ``clock``, run in a rotating order ``n`` times."""
    names = list(steps)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(n):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t = clock()
            steps[name]()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a step's time on a GPU includes its kernels
            out[name].append(clock() - t)
    return out


def collate_cost(data, n: int) -> float:
    """Median seconds to collate one step's micro-batches (what a loader does whoever drives it)."""
    times = []
    for r in range(n):
        t = time.perf_counter()
        for j in range(GAS):
            default_collate([data[(r * GAS + j) * MICRO + i] for i in range(MICRO)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile(steps: dict[str, Callable[[], object]], n: int, top: int, clock: Callable[[], float]) -> None:
    """Self time per step in ds_adabatch's files for each ``train_batch`` way, heaviest functions first."""
    for name, step in steps.items():
        if name == "bare":
            continue
        prof = cProfile.Profile(clock)
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
        own, rows = 0.0, []
        for (path, line, fn), (_, calls, self_time, _, _) in pstats.Stats(prof).stats.items():
            if "/ds_adabatch/" in path:
                own += self_time
                rows.append((self_time, f"{path.split('/ds_adabatch/')[-1]}:{line} {fn}", calls))
        print(f"  cProfile, {name}: ds_adabatch self time {own / n * 1e3:.3f} ms per step; heaviest:")
        for self_time, where, calls in sorted(rows, reverse=True)[:top]:
            print(f"    {self_time / n * 1e3:7.3f} ms  {calls / n:5.1f} calls  {where}")


def without_deepspeed(engine) -> None:
    """Replace ``engine.deepspeed``'s ``forward`` / ``backward`` / ``step`` by stand-ins that return at
    once (a one-element loss), for every way alike: what is left of a step is the Python around them,
    ours and the bare loop's, measured to the microsecond on a busy machine too."""
    ds = engine.deepspeed
    weight = torch.zeros((), device=ds.device, requires_grad=True)
    # Instance attributes shadow the methods (nn.Module.__call__ calls self.forward).
    ds.forward = lambda *args, **kwargs: SimpleNamespace(loss=weight * 1.0)
    ds.backward = lambda loss, **kwargs: None
    ds.step = lambda *args, **kwargs: None


def table(title: str, times: dict[str, list[float]], clock: str) -> None:
    """Median step of each way and the median of its per-step differences against ``bare``."""
    bare = times["bare"]
    print(f"\n{title}, {len(bare)} interleaved steps of each way ({clock} time):")
    print("| way | median step | ours per step (median of paired differences) | ratio of medians |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        diff = statistics.median(t - b for t, b in zip(ts, bare))
        print(
            f"| {name} | {statistics.median(ts) * 1e3:.3f} ms | {diff * 1e3:+.3f} ms "
            f"| {statistics.median(ts) / statistics.median(bare):.3f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400, help="interleaved steps of each way")
    p.add_argument("--warmup", type=int, default=20, help="steps of each way before timing")
    p.add_argument("--profile-steps", type=int, default=100, help="profiled steps of each train_batch way")
    p.add_argument("--stages", default="0,2", help="comma-separated ZeRO stages")
    p.add_argument("--model", default="small", choices=sorted(h.MODELS))
    p.add_argument("--top", type=int, default=12, help="ds_adabatch functions listed per profile")
    p.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="wall: perf_counter (the figure, on an idle machine); cpu: this thread's CPU time (steadier "
        "on a loaded machine, blind to waits)",
    )
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(h.idle_check("before"))
    ds_adabatch.init_distributed()
    data, spec = h.lm_data(), h.MODELS[args.model]
    print(f"world 1, {args.model} model, global {MICRO * GAS} = micro {MICRO} x GAS {GAS}, constant schedule")
    print(f"collating one step's micro-batches alone: {collate_cost(data, 50) * 1e3:.3f} ms (median)")
    for stage in (int(s) for s in args.stages.split(",")):
        engine = build(stage, data, spec)
        steps = ways(engine, data)
        interleaved(steps, args.warmup, clock)
        table(f"ZeRO {stage}", interleaved(steps, args.steps, clock), args.clock)
        profile(steps, args.profile_steps, args.top, clock)
        # Our Python alone: the same steps with DeepSpeed's work taken out of both sides.
        without_deepspeed(engine)
        interleaved(steps, args.warmup, clock)
        table(f"ZeRO {stage}, host only", interleaved(steps, args.steps * 5, clock), args.clock)
        engine.close()
    print(h.idle_check("after", own_processes=1))


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

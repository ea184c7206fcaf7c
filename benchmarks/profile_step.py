"""Where a step's time goes: cProfile of ``train_batch``, the forward / backward / step loop over
ds_adabatch's loader, and the hand-written DeepSpeed loop (``overhead.py``'s three loops, small model).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py [--rounds 8 --steps 10]

A world of one (plain ``python``), ZeRO-2, global 16 = micro 8 x GAS 2. The loops are interleaved
(``--rounds`` rounds of ``--steps`` optimizer steps each, the order reversed every other round), each
under its own profiler. For each loop it prints the profiled time per step; the cumulative time per step
of DeepSpeed's ``forward`` / ``backward`` / ``step`` and of the ds_adabatch calls around them; and the
self time per step spent in ``ds_adabatch``'s own files (and ``torch.utils.data``, the hand-written
loop's loader) with the heaviest ``ds_adabatch`` functions. cProfile inflates every Python call, so
self times are upper bounds; ``overhead.py`` gives the wall-clock ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import overhead

import ds_adabatch

# Functions whose cumulative time is listed: DeepSpeed's calls and ds_adabatch's around them.
CUMULATIVE = {
    "deepspeed/runtime/engine.py": ("forward", "backward", "step"),
    "ds_adabatch/runtime/engine/data_parallel.py": ("train_batch", "_take_step_batch", "_complete_step"),
    "ds_adabatch/runtime/engine/loop.py": ("__next__", "begin_step", "backward", "step"),
    "ds_adabatch/runtime/core/passes.py": ("__init__", "backward"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per loop per round")
    p.add_argument("--top", type=int, default=8, help="ds_adabatch functions listed per loop by self time")
    args = p.parse_args()
    print(h.idle_check("before"))
    ds_adabatch.init_distributed()
    data, spec = h.lm_data(), h.MODELS["small"]
    loops = {
        "train_batch": overhead.adaptive_loop(1, data, spec)[1],
        "loop over our loader": overhead.adaptive_user_loop(1, data, spec)[1],
        "hand-written": overhead.plain_loop(1, 0, data, spec)[1],
    }
    for step in loops.values():
        h.time_steps(step, 3)  # warm-up
    profilers = {name: cProfile.Profile() for name in loops}
    for r in range(args.rounds):
        order = list(loops.items())
        for name, step in order if r % 2 == 0 else reversed(order):
            profilers[name].enable()
            for _ in range(args.steps):
                step()
            profilers[name].disable()
    n = args.rounds * args.steps
    for name, prof in profilers.items():
        stats = pstats.Stats(prof)
        own, loader, rows, cumulative = 0.0, 0.0, [], []
        for (path, line, fn), (_, calls, self_time, cum, _) in stats.stats.items():
            for suffix, names in CUMULATIVE.items():
                if path.endswith(suffix) and fn in names:
                    cumulative.append((cum, f"{suffix}:{line} {fn}", calls))
            if "/ds_adabatch/" in path:
                own += self_time
                rows.append((self_time, f"{path.split('/ds_adabatch/')[-1]}:{line} {fn}", calls))
            elif "torch/utils/data" in path:
                loader += self_time
        print(f"\n{name}: {stats.total_tt / n * 1e3:.1f} ms per step profiled")
        print("  cumulative per step:")
        for cum, where, calls in sorted(cumulative, reverse=True):
            print(f"  {cum / n * 1e3:8.2f} ms  {calls / n:5.1f} calls  {where}")
        print(
            f"  self time per step: ds_adabatch {own / n * 1e3:.3f} ms, torch.utils.data "
            f"{loader / n * 1e3:.3f} ms; heaviest ds_adabatch functions:"
        )
        for self_time, where, calls in sorted(rows, reverse=True)[: args.top]:
            print(f"  {self_time / n * 1e3:8.3f} ms  {calls / n:5.1f} calls  {where}")


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

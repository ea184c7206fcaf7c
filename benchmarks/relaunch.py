"""What changing the batch costs without an in-place change: stop the job, relaunch it from a checkpoint.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/relaunch.py            # 3 relaunches on 2 ranks

A first launch of the main job's model trains a few steps at global batch 32, times ``--changes`` plan
changes in place (``set_global_batch_size`` + ``next_plan``), and saves a checkpoint. Then each relaunch
starts new processes with torchrun (imports, process group, engine build, checkpoint load), switches to
global batch 64 and trains one step: its cost is the wall time from the launch to the end of that first
step, as a user waiting for the new batch pays it. Prints the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "FIRST_STEP_DONE_AT"


def job(args) -> None:
    """One launched job (rank 0 prints when its first step ended)."""
    import _harness as h
    import torch.distributed as dist

    import ds_adabatch

    ds_adabatch.init_distributed()
    world = dist.get_world_size()
    adabatch = {"schedule": {"type": "constant", "value": 32}, "max_micro_batch_per_gpu": 8}
    cfg = h.ds_config(2, adabatch, micro=8, gas=2, world=world)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    engine, *_ = ds_adabatch.initialize(h.lm_model(), cfg, h.lm_data(max_bytes=400_000))
    if args.resume:
        engine.load_checkpoint(args.dir)
        engine.set_global_batch_size(64, reason="relaunched with a new batch")
    float(engine.train_batch())
    if engine.global_rank == 0:
        print(f"{MARK} {time.time():.6f}", flush=True)
    if not args.resume:
        for _ in range(2):
            engine.train_batch()
        costs = []
        for i in range(args.changes):
            engine.set_global_batch_size(64 if i % 2 == 0 else 32)
            dist.barrier()
            t0 = time.perf_counter()
            engine.next_plan()
            costs.append(time.perf_counter() - t0)
            engine.train_batch()
        if engine.global_rank == 0:
            print(f"IN_PLACE_CHANGE_S {h.median(costs):.6f}", flush=True)
        engine.save_checkpoint(args.dir)
    engine.close()
    ds_adabatch.finish()  # a gloo group can abort a finished rank in the interpreter's teardown


def launch(nproc: int, *extra: str) -> tuple[float, str]:
    sys.path.insert(0, os.path.dirname(HERE))
    from tests._util import free_port  # the launching tests' helper

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += [f"--master-port={free_port()}", __file__, "--job", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
    if proc.returncode != 0:
        sys.exit(f"launch failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return t0, proc.stdout


def value(out: str, key: str) -> float:
    return next(float(line.split()[1]) for line in out.splitlines() if line.startswith(key))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=3, help="relaunches to time")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--changes", type=int, default=6, help="in-place plan changes to time")
    args = p.parse_args()
    if args.job:
        job(args)
        return

    sys.path.insert(0, HERE)
    import _harness as h

    before = h.idle_check("before")
    with tempfile.TemporaryDirectory() as tmp:
        _, out = launch(args.nproc, "--dir", tmp, "--changes", str(args.changes))
        in_place = value(out, "IN_PLACE_CHANGE_S")
        relaunch = []
        for _ in range(args.runs):
            t0, out = launch(args.nproc, "--dir", tmp, "--resume")
            relaunch.append(value(out, MARK) - t0)
    after = h.idle_check("after", own_processes=args.nproc)  # its own launches still weigh on the average
    print(f"\n{before}\n{after}\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| plan change in place (median of {args.changes}) | {in_place * 1e3:.2f} ms |")
    runs = ", ".join(f"{t:.1f}" for t in relaunch)
    print(f"| relaunch from a checkpoint to the end of its first step (s, each run) | {runs} |")
    print(f"| relaunch / in-place change (median) | {h.median(relaunch) / in_place:,.0f}x |")


if __name__ == "__main__":
    main()

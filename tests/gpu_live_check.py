"""Live elasticity on a CUDA GPU (NCCL): the checks a one-GPU machine can make, as one script.

    python tests/gpu_live_check.py OUT [--nproc N]

1. Whether NCCL forms a group of two ranks on one GPU (it refuses: "Duplicate GPU detected"), which
   decides whether a lost *peer* can be tested with NCCL on one GPU at all.
2. A worker crash on a healthy node under torchrun (``--max-restarts 1``), ZeRO 0, 1 and 2 in fp32 and
   ZeRO 2 in bf16, on the GPU with the NCCL backend: the restarted worker restores the newest snapshot
   from host memory (GPU -> host -> GPU), not a checkpoint, and the run ends exact against an
   uninterrupted run of the same job on the same world (same samples in every step, each once; final
   parameters within 1e-5).

Prints one line per check and writes OUT/summary.json. Runs on the CPU too (``DS_ACCELERATOR=cpu``,
gloo; ``--nproc 2`` makes the crash one of two ranks), skipping the NCCL check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cluster_checks import check_exact, ends, read_ledger, starts  # noqa: E402

JOB = HERE / "live_worker.py"
CASES = [("z0", 0, False), ("z1", 1, False), ("z2", 2, False), ("z2_bf16", 2, True)]


def _nccl_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        queue.put((rank, f"ok: {t[0].item():g}"))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - the error is the finding
        queue.put((rank, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"))


def nccl_two_ranks_on_one_gpu() -> str:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 29591, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 120
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            rank, text = queue.get(timeout=5)
            results[rank] = text
        except Exception:  # noqa: BLE001 - queue.Empty: a rank hung
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return "; ".join(f"rank {r}: {results.get(r, 'no answer (hung or died)')}" for r in (0, 1))


def _run(cmd: list[str], env: dict, log: Path, timeout: float) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def _torchrun(nproc: int, port: int, run_id: str, out: Path, stage: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return cmd + ["--rdzv-id", run_id, str(JOB), "run", str(out), str(stage)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        summary["device"] = torch.cuda.get_device_name(0)
        summary["nccl_two_ranks_one_gpu"] = nccl_two_ranks_on_one_gpu()
        print("NCCL, two ranks on one GPU:", summary["nccl_two_ranks_one_gpu"], flush=True)
    base = {**os.environ, "LIVE_TORCH_ADAM": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for port, (name, stage, bf16) in enumerate(CASES, start=29601):
        out, ref = args.out / name, args.out / f"{name}_reference"
        env = {**base, "LIVE_BF16": "1" if bf16 else "0"}
        # The reference: the same job on the same world, uninterrupted, live elasticity off.
        ref.mkdir(exist_ok=True)
        code = _run(
            _torchrun(args.nproc, port + 10, f"ref_{name}", ref, stage),
            {**env, "LIVE_LIVE": "0"},
            ref / "log.txt",
            600,
        )
        assert code == 0, (ref / "log.txt").read_text()[-3000:]
        reference = {
            stage: {"rows": read_ledger(ref / "ledger.jsonl"), "params": torch.load(ref / "final.pt")}
        }
        out.mkdir(exist_ok=True)
        env.update(
            LIVE_KILL=f"{args.nproc - 1}:6:2",
            LIVE_KILL_WHAT="worker",
            DS_ADABATCH_SNAPSHOT_DIR=str(out / "shm"),
        )
        cmd = _torchrun(args.nproc, port, f"gpu_{name}", out, stage)
        started = time.monotonic()
        code = _run(cmd, env, out / "log.txt", 600)
        result: dict = {"exit": code, "seconds": round(time.monotonic() - started, 1)}
        try:
            assert code == 0, (out / "log.txt").read_text()[-3000:]
            assert sorted(s["restart"] for s in starts(out)) == [0] * args.nproc + [1] * args.nproc
            result["resumed_from"] = [e["resumed_from"] for e in ends(out)]
            assert all(str(r).startswith("<host memory: step") for r in result["resumed_from"]), result
            rows = check_exact(out, reference, stage)
            result["steps"] = len({r["step"] for r in rows})
            result["redone"] = len(rows) - result["steps"]
            result["ok"] = True
        except AssertionError as err:
            result["ok"], result["why"] = False, str(err)[-1500:]
        summary[name] = result
        print(name, json.dumps(result), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [n for n, _, _ in CASES if not summary[n]["ok"]]
    print("FAILED:" if failed else "ALL PASSED", " ".join(failed), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

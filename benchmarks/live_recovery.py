"""Live elasticity against today's restart path, and what the snapshots cost (issue: live elasticity).

    python benchmarks/live_recovery.py recovery [--runs 3] [--stages 2,3]   # a node lost: live vs restart
    python benchmarks/live_recovery.py snapshots [--runs 3] [--stages 2,3]  # steady steps: snapshots on/off
    python benchmarks/live_recovery.py cost [--runs 3] [--stages 2,3]       # one snapshot's cost, one launch

``--stages``: the ZeRO stages measured, each in turn (default 2 and 3; under ZeRO 3 every parameter is
partitioned: the job sets ``stage3_param_persistence_threshold`` to 0). ``--hidden``: the model sizes of
``snapshots`` and ``cost`` (default 1024,3072; a small one for a quick smoke run).

``recovery``: the job of tests/live_worker.py (ZeRO 2 or 3, Adam, a ramping global batch, a checkpoint every
4 steps) on three "nodes" on this machine (one ``ds-adabatch-run`` agent each, c10d rendezvous over
loopback, each node its own snapshot folder); node 2 kills itself (agent and worker, SIGKILL) 3 ms into
step 6. ``live``: ``adabatch.live_elastic`` on; ``restart``: off, ``--max-restarts 1``, the survivors'
agents restart the workers, which resume from the last complete checkpoint. Launches alternate
(live, restart, live, ...). Reported per launch: kill -> first step completed on the smaller world,
the live path's phases, and the optimizer steps trained again.

``snapshots``: two nodes, no loss, 30 steps at a fixed global batch; the median step time (rank 0's
ledger, steps 6-30) with snapshots every step, and with ``snapshot_every: "auto"``, against the same job
with live elasticity off, per model size, launches alternating; plus the snapshot files' size per rank
(host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "live_worker.py"
# The config's defaults (heartbeat every 0.2 s, lost after 1 s without one); the tests use more slack.
DEFAULT_TIMING = {"LIVE_HEARTBEAT": "0.2", "LIVE_DEAD_AFTER": "1.0"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    return f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores"


def launch(out: Path, nodes: int, stage: int, env: dict, max_restarts: int) -> float:
    """``nodes`` agents of the job on this machine; returns the wall time of the launch."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    port = _port()
    conf = "join_timeout=120,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    procs = []
    started = time.monotonic()
    for k in range(nodes):
        cmd = [sys.executable, "-m", "ds_adabatch.launch", "--exit-barrier-timeout", "3"]
        cmd += ["--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--max-restarts", str(max_restarts)]
        cmd += ["--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += ["--rdzv-id", out.name, "--rdzv-conf", f"{conf},is_host={'true' if k == 0 else 'false'}"]
        cmd += [str(JOB), "run", str(out), str(stage)]
        node_env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "DS_ADABATCH_SNAPSHOT_DIR": str(out / f"shm{k}"),
            **env,
        }
        log = (out / f"node{k}.log").open("w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(0.3)
    for p in procs:
        p.wait(timeout=600)
    return time.monotonic() - started


def ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines() if line.strip()]


def recovery(runs: int, tmp: Path, stages: list[int], hiddens: list[int]) -> None:
    for stage in stages:
        _recovery(runs, tmp, stage)


def _recovery(runs: int, tmp: Path, stage: int) -> None:
    print(_load(), "before")
    results: dict[str, list[dict]] = {"live": [], "restart": []}
    for i in range(runs):
        for mode in ("live", "restart"):
            out = tmp / f"{mode}{i}z{stage}"
            env = {"LIVE_KILL": "2:6:3", "LIVE_LIVE": "1" if mode == "live" else "0", **DEFAULT_TIMING}
            wall = launch(out, 3, stage, env, max_restarts=0 if mode == "live" else 1)
            rows = ledger(out)
            kill = float((out / "kill-time").read_text().split()[0])
            first = next(r for r in rows if r["time"] > kill and r["world_size"] < 3)
            steps = {r["step"] for r in rows}
            result = {
                "kill_to_first_step_s": first["time"] - kill,
                "steps_redone": len(rows) - len(steps),
                "launch_s": wall,
            }
            if mode == "live":
                ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
                event = next(e for e in ends if e["origin"] == 0)["events"][0]
                result["phases"] = {k: round(v, 3) for k, v in event.items() if k.endswith("_s")}
            results[mode].append(result)
            print(f"ZeRO {stage}", mode, json.dumps(result), _load(), flush=True)
    for mode, rs in results.items():
        times = [r["kill_to_first_step_s"] for r in rs]
        print(
            f"ZeRO {stage} {mode}: kill -> first step on 2 ranks {', '.join(f'{t:.2f}' for t in times)} s (median {statistics.median(times):.2f}); steps redone {[r['steps_redone'] for r in rs]}"
        )
    ratios = [
        slow["kill_to_first_step_s"] / fast["kill_to_first_step_s"]
        for fast, slow in zip(results["live"], results["restart"])
    ]
    print(f"ZeRO {stage} restart / live per pair:", ", ".join(f"{x:.1f}x" for x in ratios))
    print(_load(), "after")


def snapshots(runs: int, tmp: Path, stages: list[int], hiddens: list[int]) -> None:
    for stage in stages:
        _snapshots(runs, tmp, stage, hiddens)


def _snapshots(runs: int, tmp: Path, stage: int, hiddens: list[int]) -> None:
    print(_load(), "before")
    for hidden in hiddens:
        params = 8 * hidden + hidden + hidden * hidden + hidden + hidden + 1
        meds: dict[str, list[float]] = {"off": [], "1": [], "auto": []}
        size, chosen = 0, []
        for i in range(runs):
            for mode in meds:
                out = tmp / f"snap{hidden}{mode}{i}z{stage}"
                env = {
                    "LIVE_LIVE": "0" if mode == "off" else "1",
                    "LIVE_HIDDEN": str(hidden),
                    "LIVE_FIXED": "12",
                }
                env.update(LIVE_SAMPLES=str(12 * 30), LIVE_SNAPSHOT_EVERY="1" if mode == "off" else mode)
                env["LIVE_SAVE_EVERY"] = "0"
                launch(out, 2, stage, env, max_restarts=0)
                rows = ledger(out)
                gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])][5:]
                meds[mode].append(statistics.median(gaps))
                ends = [json.loads(f.read_text()) for f in out.glob("end-*.json")]
                if mode == "1":
                    size = max(e["snapshot_bytes"] for e in ends)
                if mode == "auto":
                    chosen.append(ends[0]["snapshot_every"])
        base = statistics.median(meds["off"])
        for mode in ("1", "auto"):
            ratios = [a / b for a, b in zip(meds[mode], meds["off"])]
            print(
                f"{params / 1e6:.2f} M parameters, ZeRO {stage}, 2 nodes: step {base * 1e3:.0f} ms without snapshots; "
                f"snapshot_every {mode}{f' (chose {chosen})' if mode == 'auto' else ''}: "
                f"{', '.join(f'{r:.3f}' for r in ratios)}x per launch pair",
                flush=True,
            )
        print(
            f"  snapshot files per rank (own + buddy, 2 slots each): {size / 2**20:.1f} MiB; {_load()}",
            flush=True,
        )
    print(_load(), "after")


def cost(runs: int, tmp: Path, stages: list[int], hiddens: list[int]) -> None:
    """In one launch, interleaved: snapshots every 3rd step; per triple, (step with the snapshot + the
    step after it, which the buddy copy in flight may slow) - 2 x the third step = one snapshot's cost."""
    for stage in stages:
        _cost(runs, tmp, stage, hiddens)


def _cost(runs: int, tmp: Path, stage: int, hiddens: list[int]) -> None:
    print(_load(), "before")
    for hidden in hiddens:
        params = 8 * hidden + hidden + hidden * hidden + hidden + hidden + 1
        ratios, steps = [], []
        for i in range(runs):
            out = tmp / f"cost{hidden}_{i}z{stage}"
            env = {
                "LIVE_HIDDEN": str(hidden),
                "LIVE_FIXED": "12",
                "LIVE_SAMPLES": str(12 * 42),
                "LIVE_SNAPSHOT_EVERY": "3",
            }
            launch(out, 2, stage, env, max_restarts=0)
            rows = ledger(out)
            gap = {b["step"]: b["time"] - a["time"] for a, b in zip(rows, rows[1:])}
            # Steps 3k are snapshotted (after the step, inside train_batch).
            triples = [(gap[s], gap[s + 1], gap[s + 2]) for s in range(6, max(gap) - 2, 3) if s % 3 == 0]
            per = [(g1 + g2 - 2 * g3) / g3 for g1, g2, g3 in triples]
            ratios.append(statistics.median(per))
            steps.append(statistics.median(g3 for _, _, g3 in triples))
        out = tmp / f"auto{hidden}z{stage}"
        env.update(LIVE_SNAPSHOT_EVERY="auto")
        launch(out, 2, stage, env, max_restarts=0)
        chosen = sorted({json.loads(f.read_text())["snapshot_every"] for f in out.glob("end-*.json")})
        print(
            f"{params / 1e6:.2f} M parameters, ZeRO {stage}, 2 nodes: 'auto' chose every {chosen} step(s); clean step "
            f"{statistics.median(steps) * 1e3:.0f} ms; one "
            f"snapshot costs {', '.join(f'{r * 100:.1f}%' for r in ratios)} of a step per launch "
            f"(every step: that much; every k steps: that / k); {_load()}",
            flush=True,
        )
    print(_load(), "after")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["recovery", "snapshots", "cost"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated (0-3)")
    p.add_argument("--hidden", default="1024,3072", help="model widths of snapshots / cost, comma-separated")
    args = p.parse_args()
    stages = [int(x) for x in args.stages.split(",")]
    hiddens = [int(x) for x in args.hidden.split(",")]
    if any(s not in (0, 1, 2, 3) for s in stages):
        p.error(f"--stages {args.stages}: each stage must be 0, 1, 2 or 3")
    with tempfile.TemporaryDirectory(prefix="live_bench_") as tmp:
        run = {"recovery": recovery, "snapshots": snapshots, "cost": cost}[args.what]
        run(args.runs, Path(tmp), stages, hiddens)


if __name__ == "__main__":
    main()

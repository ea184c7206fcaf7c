"""Latency of the per-pass and per-step agreements of ds_adabatch against the number of ranks (gloo).

For each world size N it starts N processes with torchrun (the default gloo group and the agreement's
own gloo group, as the runtime builds them) and times, interleaved in rounds, the median wall time of
one call of:

- ``flags all-reduce (before)``: the out-of-memory agreement as it was, an all-reduce of N float32 flags;
- ``recursive doubling (now)``: :class:`ds_adabatch.runtime.distributed.agreement.HostAgreement` reducing
  ``[anyone failed, -predicted micro-batch limit]`` (max, max): what every reducing pass pays now;
- ``StepSync all-reduce``: ``comm.all_reduce_sum`` of ``--values`` float64 (the one collective a step
  issues when it has per-rank values to sum: token counts, noise-scale sums, a user function's answer,
  pending losses; its payload does not depend on N);

and prints, per method and N, the measured median next to the structural cost: rounds (message hops)
on the critical path, messages per rank and payload bytes. Then it fits, per method,

    wall(N) = R(N) * (h + s * max(0, N / cores - 1))

where R(N) is the method's structural round count (2(N-1) for a ring all-reduce, log2 N (+2 when N is not
a power of two) for recursive doubling), h the cost of one round when every rank has a core of its own
and s the oversubscription cost: with N processes on ``cores`` cores every round waits for about
N / cores context switches whatever the algorithm, so on one small machine wall time grows at least
linearly in N for both. The fit separates the two: h from the world sizes that fit the cores
(N <= cores), then s by least squares over the others. The projection for 256 to 16,384 ranks assumes one
core per rank (s = 0), ``--ranks-per-node`` ranks per node whose rounds cost the measured h, and
``--hop-us`` microseconds per round that crosses nodes (gloo over TCP on a datacentre network). On GPUs StepSync runs on NCCL, not gloo (its small all-reduces
use NCCL's tree or ring protocols), so its row projects the gloo case only.

    .venv/bin/python benchmarks/agreement_latency.py                       # 2 .. 64 processes
    .venv/bin/python benchmarks/agreement_latency.py --worlds 2,4 --passes 20 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_adabatch.runtime.distributed import comm  # noqa: E402
from ds_adabatch.runtime.distributed.agreement import HostAgreement, host_group  # noqa: E402

METHODS = ("flags all-reduce (before)", "recursive doubling (now)", "StepSync all-reduce")
PROJECT = (256, 1024, 4096, 16384)


def ring_rounds(n: int) -> int:
    return 2 * (n - 1)


def doubling_rounds(n: int) -> int:
    return HostAgreement(0, n).rounds


def structure(method: str, n: int, values: int) -> dict:
    """Rounds on the critical path, messages per rank (sent + received) and payload bytes per call."""
    if method == "recursive doubling (now)":
        agreement = HostAgreement(0, n)
        return {"rounds": agreement.rounds, "messages": agreement.messages, "payload_bytes": 16}
    payload = 4 * n if method.startswith("flags") else 8 * values
    # A ring all-reduce: reduce-scatter then all-gather, N - 1 steps each, a message each way per step.
    return {"rounds": ring_rounds(n), "messages": 4 * (n - 1), "payload_bytes": payload}


def worker(passes: int, rounds: int, values: int, out: str) -> None:
    """One rank of a measurement (under torchrun): rank 0 writes the medians to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    agreement = HostAgreement(rank, n, host_group())
    group = agreement.group

    def flags() -> None:
        t = torch.zeros(n, dtype=torch.float32)
        dist.all_reduce(t, group=group)
        t.tolist()

    def doubling() -> None:
        agreement.reduce([0, -(1 << 62)], ["max", "max"])

    def step_sync() -> None:
        comm.all_reduce_sum([0.5] * values, "cpu")[0].item()

    calls = dict(zip(METHODS, (flags, doubling, step_sync)))
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for call in calls.values():  # warm-up: connections, buffers
        for _ in range(3):
            call()
    for _ in range(rounds):
        for method, call in calls.items():
            dist.barrier()
            for _ in range(passes):
                start = time.perf_counter()
                call()
                times[method].append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({m: statistics.median(t) for m, t in times.items()}, f)
    comm.finish()  # ends the process: a gloo group can abort a finished one in teardown


def measure(n: int, passes: int, rounds: int, values: int) -> dict[str, float]:
    """``n`` ranks started by torchrun, the launcher of real jobs, which starts each worker in a session
    of its own. That matters on a shared machine: Linux's scheduler (autogroup) shares the CPU between
    sessions, so ranks started in the caller's session (multiprocessing, a bare subprocess) waited
    milliseconds for every wake-up while other work ran, which slowed gloo's point-to-point messages
    (2-4 ms per round trip on 2 ranks instead of 0.1 ms) more than its all-reduce. Idle, it should not."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "medians.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}"]
        cmd += [f"--master-port={comm_free_port()}", os.path.abspath(__file__), "--worker", out]
        cmd += ["--passes", str(passes), "--rounds", str(rounds), "--values", str(values)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"torchrun exited with {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
            )
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def comm_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(points: list[tuple[int, float]], rounds, cores: int) -> tuple[float, float]:
    """``(h, s)`` of wall = R(N) (h + s max(0, N / cores - 1)): h the mean per-round time of the world
    sizes within the cores, s the least-squares oversubscription cost per round and extra process of
    the others (clipped at 0: a cost is never negative)."""
    within = [t / rounds(n) for n, t in points if n <= cores and rounds(n)]
    if not within:
        raise ValueError(f"measure at least one world size of at most {cores} processes")
    h = statistics.mean(within)
    over = [(rounds(n) * (n / cores - 1), t - rounds(n) * h) for n, t in points if n > cores]
    denominator = sum(x * x for x, _ in over)
    s = max(sum(x * y for x, y in over) / denominator, 0.0) if denominator else 0.0
    return h, s


def project(method: str, n: int, h: float, hop: float, per_node: int) -> float:
    """Seconds per call on ``n`` ranks, one core each: node-local rounds at ``h``, the others at ``hop``."""
    if method == "recursive doubling (now)":
        local = int(math.log2(min(per_node, n))) if per_node & (per_node - 1) == 0 else 0
        total = doubling_rounds(n)
        return local * h + (total - local) * hop
    # A ring's every round waits for its slowest edge: once the ring spans nodes, every round crosses.
    total = ring_rounds(n)
    return total * (hop if n > per_node else h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8,16,32,64", help="comma-separated numbers of processes")
    p.add_argument("--passes", type=int, default=200, help="timed calls per method per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the methods")
    p.add_argument("--values", type=int, default=4, help="float64 values in the StepSync all-reduce")
    p.add_argument("--hop-us", type=float, default=30.0, help="assumed cross-node hop latency (us)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="assumed ranks per node")
    p.add_argument("--out", default=None, help="also write the measurements and fits as JSON here")
    p.add_argument("--load", default=None, help="fit and project the measurements of an earlier --out file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank of one measurement
    args = p.parse_args()
    if args.worker:
        worker(args.passes, args.rounds, args.values, args.worker)
        return

    cores = len(os.sched_getaffinity(0))
    worlds = [int(w) for w in args.worlds.split(",")]
    load = os.getloadavg()[0]
    print(f"{cores} cores, 1-minute load {load:.2f} at start (timings are only figures on an idle machine)")
    measured: dict[int, dict[str, float]] = {}
    if args.load:
        with open(args.load, encoding="utf-8") as f:
            saved = json.load(f)
        measured = {int(n): times for n, times in saved["measured"].items()}
        cores, load, worlds = saved["cores"], saved["load"], []
        print(f"measurements of {args.load}: {cores} cores, load {load:.2f} at their start")
    for n in worlds:
        try:
            measured[n] = measure(n, args.passes, args.rounds, args.values)
        except Exception as exc:  # noqa: BLE001 - report how far it got
            print(f"N={n}: did not run ({exc}); stopping here")
            break
        row = "  ".join(f"{m}: {measured[n][m] * 1e6:9.1f} us" for m in METHODS)
        print(f"N={n:3d}  {row}", flush=True)

    print(
        "\nmedian per call, and the structure of one call (rounds on the critical path / messages per "
        "rank / payload bytes)"
    )
    print(f"{'method':28s} {'N':>4s} {'median us':>10s} {'rounds':>7s} {'msgs':>6s} {'payload B':>9s}")
    for method in METHODS:
        for n, times in measured.items():
            s = structure(method, n, args.values)
            print(
                f"{method:28s} {n:4d} {times[method] * 1e6:10.1f} {s['rounds']:7d} {s['messages']:6d} "
                f"{s['payload_bytes']:9d}"
            )

    fits = {}
    print(
        f"\nfit: wall(N) = R(N) (h + s max(0, N / {cores} cores - 1)); projection: one core per rank, "
        f"{args.ranks_per_node} ranks per node, node-local hops at h, cross-node hops at {args.hop_us:g} us"
    )
    header = "".join(f"{n:>11d}" for n in PROJECT)
    print(f"{'method':28s} {'h us':>7s} {'s us':>7s} |{header}  (ms per call)")
    for method in METHODS:
        rounds = doubling_rounds if method == "recursive doubling (now)" else ring_rounds
        points = [(n, t[method]) for n, t in measured.items()]
        if not any(n <= cores for n, _ in points):
            print(f"{method:28s} (needs a world size of at most {cores} processes to fit)")
            continue
        h, s = fit(points, rounds, cores)
        proj = [project(method, n, h, args.hop_us * 1e-6, args.ranks_per_node) for n in PROJECT]
        fits[method] = {
            "round_s": h,
            "oversubscription_s": s,
            "projection_s": dict(zip(map(str, PROJECT), proj)),
        }
        cells = "".join(f"{t * 1e3:11.3f}" for t in proj)
        print(f"{method:28s} {h * 1e6:7.1f} {s * 1e6:7.2f} |{cells}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {"cores": cores, "load": load, "args": vars(args), "measured": measured, "fits": fits},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

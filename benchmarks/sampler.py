"""Throughput and memory of the elastic sampler with shuffling, for a small and a huge dataset.

Each (dataset size, global batch) case runs in its own subprocess so peak memory does not mix between
cases. In the subprocess the baseline is the resident set after importing the library (numpy included)
and before the sampler is built; the peak is the high-water mark after drawing. Each optimizer step
draws one global batch with ``next_batch`` and reads one rank's shard with ``indices(rank)``, which is
what every rank does per step; the rate counts the global batch's indices.

Usage::

    python benchmarks/sampler.py                       # N = 1e6 and 1e9, batches 1024 and 8192
    python benchmarks/sampler.py --sizes 1000000 --batches 4096 --draw 500000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

__all__ = ["main"]


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (None where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's resident-set high-water mark to the current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _peak_kib() -> int:
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _child(num_samples: int, batch: int, draw: int, world: int, max_micro: int) -> dict:
    bare = _status_kib("VmRSS")
    from ds_adabatch.data import ElasticSampler
    from ds_adabatch.plan import plan_batch

    plan = plan_batch(batch, world, max_micro, allow_uneven=batch % world != 0)
    baseline = _status_kib("VmRSS") or _peak_kib()
    # Without a reset, the peak would include whatever the imports touched and then freed.
    peak_was_reset = _reset_peak()
    peak_before = _peak_kib()

    sampler = ElasticSampler(num_samples, shuffle=True, seed=1234)
    drawn = 0
    start = time.perf_counter()
    while drawn < draw:
        global_batch = sampler.next_batch(plan)
        global_batch.indices(0)
        drawn += global_batch.size
    elapsed = time.perf_counter() - start

    peak = _peak_kib()
    over = peak - (baseline if peak_was_reset else peak_before)
    return {
        "num_samples": num_samples,
        "batch": batch,
        "world": world,
        "max_micro": max_micro,
        "drawn": drawn,
        "seconds": elapsed,
        "indices_per_s": drawn / elapsed,
        "import_kib": None if bare is None else baseline - bare,
        "baseline_kib": baseline,
        "peak_over_baseline_kib": max(0, over),
        "peak_reset": peak_was_reset,
    }


def _run_case(num_samples: int, batch: int, draw: int, world: int, max_micro: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(num_samples), str(batch), str(draw)]
    cmd += ["--world", str(world), "--max-micro", str(max_micro)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def main(argv: list[str] | None = None) -> None:
    """Run the cases and print a markdown table with the command that produced it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[10**6, 10**9], help="dataset sizes (samples)"
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1024, 8192], help="global batch sizes (samples)"
    )
    parser.add_argument("--draw", type=int, default=2 * 10**6, help="indices to draw per case (samples)")
    parser.add_argument("--world", type=int, default=8, help="data-parallel ranks of the plan")
    parser.add_argument("--max-micro", type=int, default=32, help="max micro-batch per GPU (samples)")
    parser.add_argument("--child", type=int, nargs=3, metavar=("N", "BATCH", "DRAW"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(_child(*args.child, world=args.world, max_micro=args.max_micro)))
        return

    rows = [_run_case(n, b, args.draw, args.world, args.max_micro) for n in args.sizes for b in args.batches]
    command = " ".join(["python", "benchmarks/sampler.py", *map(shlex.quote, argv or sys.argv[1:])])
    print(
        f"`{command}` on {platform.python_implementation()} {platform.python_version()}, {platform.machine()}"
    )
    print()
    print("| N (samples) | global batch | plan | indices drawn | indices/s | peak RSS over baseline (MiB) |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        plan = f"{r['world']} ranks, max micro {r['max_micro']}"
        print(
            f"| {r['num_samples']:,} | {r['batch']:,} | {plan} | {r['drawn']:,} | "
            f"{r['indices_per_s'] / 1e6:.2f} M | {_mib(r['peak_over_baseline_kib'])} |"
        )
    baselines = sorted({_mib(r["baseline_kib"]) for r in rows})
    imports = sorted({_mib(r["import_kib"]) for r in rows})
    print()
    print(
        f"Baseline = resident set after importing ds_adabatch.data (and with it numpy and the package's "
        f"other light layers), before the sampler is built: {', '.join(baselines)} MiB; those imports "
        f"took {', '.join(imports)} MiB over the bare interpreter."
    )
    if not all(r["peak_reset"] for r in rows):
        print("The peak could not be reset after the imports; the figures compare high-water marks instead.")


if __name__ == "__main__":
    main()

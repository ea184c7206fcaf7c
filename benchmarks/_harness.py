"""Shared pieces of the runtime benchmarks: the main job's model and data, configs, and timing.

Every benchmark here runs its variants interleaved in one launch (A, B, A, B, ...), so drift in machine
load affects them alike, and reports ratios of medians.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model  # noqa: E402

__all__ = ["MODELS", "ROOT", "ds_config", "idle_check", "lm_data", "lm_model", "median", "time_steps"]

SPEC = ModelSpec()
MODELS = {
    "small": ModelSpec(),  # the main job's model: 2 layers x width 128, 0.44 M parameters
    "large": ModelSpec(layers=4, width=512, heads=8),  # compute dominates: 12.7 M parameters
}


def lm_data(max_bytes: int = 4_000_000) -> ByteWindows:
    """Training windows of the main job's corpus (the first ``max_bytes`` of it)."""
    return ByteWindows(ByteCorpus(max_bytes=max_bytes).train, SPEC.context)


def lm_model(seed: int = 0, spec: ModelSpec = SPEC):
    return build_model(spec, seed=seed)


def idle_check(when: str, own_processes: int = 0) -> str:
    """One line with the 1-minute load average; warns when other work shared the cores.

    ``own_processes``: busy processes of the benchmark itself at this point (its ranks), which the
    load average counts too.
    """
    load = os.getloadavg()[0]
    line = f"load average {when}: {load:.2f} (1 min), {os.cpu_count()} cores"
    if load > own_processes + 0.5:
        line += "  WARNING: the machine was not idle; these timings are not figures"
    return line


def ds_config(stage: int, adabatch: dict, *, micro: int, gas: int, world: int) -> dict:
    """A ZeRO config with AdamW and the given adabatch section (batch keys for the plain engine)."""
    return {
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "adabatch": adabatch,
    }


def time_steps(step: Callable[[], object], n: int) -> list[float]:
    """Wall seconds of ``n`` calls of ``step`` (each call one optimizer step)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)

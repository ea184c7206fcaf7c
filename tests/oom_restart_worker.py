"""A ZeRO-3 job that runs out of memory mid-forward and finishes through a torchrun restart.

Usage: torchrun --nproc-per-node 2 --max-restarts 1 tests/oom_restart_worker.py OUT_DIR [--loop]
(run by tests/test_oom_restart.py). ``--loop`` trains with DeepSpeed's forward / backward / step loop
over the loader ``initialize`` returns instead of ``train_batch`` (runtime/engine/loop.py): the same error is
recorded from ``engine(x)`` and the restart resumes the same way. Every parameter is partitioned (``stage3_param_persistence_threshold``
0), so a forward gathers parameters before its first layer runs. The last rank fits 6 samples per
forward (``simulated_memory_limit(6, phase="mid_forward")``: the error comes after the first layer, past
the pass's agreement point). The global batch is 8 for 4 steps (micro 4), then 16: micro 8 fails on the
last rank, which records the lower limit next to the checkpoints and exits with code 75 (the other rank
fails in its next collective). torchrun starts both again; the job resumes from its last complete
checkpoint (every 2 steps) and finishes the epoch of 96 samples at micro 4. Rank 0 appends one JSON line
per step to OUT_DIR/ledger.jsonl. ``--no-checkpoint``: the job never saves or loads a checkpoint (and
runs in OUT_DIR): the record goes to ``adabatch_oom_records/`` there, and the restart reads it when its
engine is built and trains the epoch again from step 0 below the size that failed.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from engine_worker import Regression, ds_config, make_model, mse_loss  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

SAMPLES = 96


def record(engine, out_dir: str, restart: int) -> None:
    if engine.global_rank == 0:
        line = {
            "step": engine.global_steps,
            "samples": engine.global_samples,
            "indices": engine.last_step_batch.global_batch.all_indices(),
            "micro": engine.plan.micro_batch_per_gpu,
            "gas": engine.plan.gradient_accumulation_steps,
            "limit": engine.micro_batch_limit,
            "restart": restart,
        }
        with open(os.path.join(out_dir, "ledger.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def train_loop(engine, loader, out_dir: str, ckpt: str, restart: int) -> None:
    """DeepSpeed's tutorial loop; a checkpoint every 2 optimizer steps, between steps."""
    for batch in loader:
        engine.backward(mse_loss(engine, batch))
        steps = engine.global_steps
        engine.step()
        if engine.global_steps > steps:
            record(engine, out_dir, restart)
            if engine.global_steps % 2 == 0:
                engine.save_checkpoint(ckpt)


def main() -> int:
    out_dir = sys.argv[1]
    loop = "--loop" in sys.argv[2:]
    checkpoints = "--no-checkpoint" not in sys.argv[2:]
    if not checkpoints:
        os.chdir(out_dir)  # the records' default folder is in the working directory
    ckpt = os.path.join(out_dir, "ckpt")
    cfg = ds_config(3, extra={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    cfg["adabatch"].update(
        schedule={"type": "piecewise", "unit": "samples", "points": [[0, 8], [32, 16]]},
        max_micro_batch_per_gpu=8,
        allow_uneven=False,
    )
    engine, _, loader, _ = ds_adabatch.initialize(make_model(), cfg, Regression(n=SAMPLES), loss_fn=mse_loss)
    if checkpoints:
        engine.load_checkpoint(ckpt)  # none yet on the first start: a fresh start
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    limit = simulated_memory_limit(6, ranks=[engine.world_size - 1], phase="mid_forward").install()
    try:
        if loop:
            train_loop(engine, loader, out_dir, ckpt, restart)
        while engine.global_samples < SAMPLES:
            float(engine.train_batch())  # resolved on every rank, as a user reading the loss would
            record(engine, out_dir, restart)
            if checkpoints and engine.global_steps % 2 == 0:
                engine.save_checkpoint(ckpt)
    except ds_adabatch.UnrecoverableOutOfMemory as exc:
        print(f"rank {engine.global_rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        limit.remove()
    engine.close()
    return 0


if __name__ == "__main__":
    ds_adabatch.finish(main())

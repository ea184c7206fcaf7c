"""Checkpoint save, universal conversion and elastic load times for the main job's model.

Run on 2 ranks; for each ZeRO stage: a few steps, then ``engine.save_checkpoint`` (median of
``--saves``), then on rank 0 the conversion to DeepSpeed's universal format that a resume on another
world size triggers (``ds_adabatch.runtime.checkpoint.universal.ensure_universal``), then a load of that copy::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/checkpoint_times.py

Prints one JSON line per stage and writes them to ``benchmarks/results/checkpoint_times.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from _harness import ROOT, lm_data, lm_model, median

import ds_adabatch
from ds_adabatch.runtime.checkpoint import universal as elastic


def config(stage: int) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "adabatch": {
            "schedule": {"type": "constant", "value": 32},
            "max_micro_batch_per_gpu": 16,
            "loss_normalization": "token",
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="0,2,3")
    p.add_argument("--saves", type=int, default=3, help="saves timed per stage (median reported)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint_times.jsonl"))
    args = p.parse_args()
    import torch.distributed as dist

    ds_adabatch.init_distributed()
    data = lm_data(max_bytes=1_000_000)
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        engine, *_ = ds_adabatch.initialize(lm_model(), config(stage), data)
        folder = tempfile.mkdtemp(prefix="ckpt_bench_") if engine.global_rank == 0 else None
        folder = _bcast(folder)
        saves = []
        for _ in range(args.saves):
            engine.train_batch()
            dist.barrier()
            t = time.perf_counter()
            engine.save_checkpoint(folder, keep_last=1)
            saves.append(time.perf_counter() - t)
        tag = elastic.latest_complete_tag(folder)
        size = sum(
            os.path.getsize(os.path.join(folder, tag, f)) for f in os.listdir(os.path.join(folder, tag))
        )
        convert = None
        if stage > 0:
            dist.barrier()
            t = time.perf_counter()
            elastic.ensure_universal(folder, tag, engine.global_rank)
            convert = time.perf_counter() - t
        dist.barrier()
        t = time.perf_counter()
        fresh, *_ = ds_adabatch.initialize(lm_model(), config(stage), data)
        init = time.perf_counter() - t
        t = time.perf_counter()
        fresh.load_checkpoint(folder, tag=tag)  # same world size: DeepSpeed's own files
        load = time.perf_counter() - t
        row = {
            "zero_stage": stage,
            "world_size": engine.world_size,
            "params": sum(p.numel() for p in engine.module.parameters()),
            "checkpoint_bytes": size,
            "save_s_median": median(saves),
            "convert_universal_s": convert,
            "engine_init_s": init,
            "load_s": load,
        }
        rows.append(row)
        if engine.global_rank == 0:
            print(json.dumps(row), flush=True)
        engine.close()
        fresh.close()
        dist.barrier()
        if engine.global_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _bcast(value):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

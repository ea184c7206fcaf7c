"""What the checkpoint manifest costs: hashing at save, verifying at load.

Two parts, both in this one process (no launcher):

1. For state dicts of ``--sizes`` MB (float32 tensors): ``torch.save`` to a file as DeepSpeed's checkpoint
   engine does, then the manifest's work on that file (``checksum_file``: read back from the page cache
   and CRC-32), median of ``--repeats``; the ratio is the save's overhead.
2. The main job's model through the engine (world of one, ZeRO ``--stage``): ``save_checkpoint`` with its
   manifest, the same save's files hashed again (the manifest's share of it), and the verification a
   ``load_checkpoint`` runs before DeepSpeed reads anything::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/checkpoint_verify.py

Prints one JSON line per measurement and writes them to ``benchmarks/results/checkpoint_verify.jsonl``.
The files are in the page cache when hashed at save (just written); a load on a fresh node reads them from
the disk, and then the read, not the CRC, is the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
from _harness import ROOT, lm_data, lm_model, median

import ds_adabatch
from ds_adabatch.checkpoint_manifest import checksum_file, hash_folder
from ds_adabatch.runtime.checkpoint import universal as elastic
from ds_adabatch.runtime.checkpoint import verify as checkpoint_verify


def _state(mb: int) -> dict[str, torch.Tensor]:
    per = 1 << 20  # 4 MB tensors, like a model's layers
    n = max(1, mb * (1 << 20) // 4 // per)
    return {f"layer{i}": torch.randn(per) for i in range(n)}


def raw(sizes: list[int], repeats: int, folder: str) -> list[dict]:
    rows = []
    for mb in sizes:
        state = _state(mb)
        path = os.path.join(folder, f"state_{mb}.pt")
        saves, hashes = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            torch.save(state, path)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            size, _ = checksum_file(path)
            hashes.append(time.perf_counter() - t)
        row = {
            "what": "torch.save then checksum_file",
            "bytes": size,
            "save_s_median": median(saves),
            "hash_s_median": median(hashes),
            "hash_gb_per_s": size / median(hashes) / 1e9,
            "overhead": median(hashes) / median(saves),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        os.remove(path)
    return rows


def engine(stage: int, repeats: int, folder: str) -> dict:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "adabatch": {"schedule": {"type": "constant", "value": 16}, "max_micro_batch_per_gpu": 16},
    }
    eng, *_ = ds_adabatch.initialize(lm_model(), config, lm_data(max_bytes=200_000))
    saves, hashes, verifies = [], [], []
    for _ in range(repeats):
        eng.train_batch()
        t = time.perf_counter()
        eng.save_checkpoint(folder, keep_last=1)
        saves.append(time.perf_counter() - t)
        tag = elastic.latest_complete_tag(folder)
        t = time.perf_counter()
        files = hash_folder(os.path.join(folder, tag))
        hashes.append(time.perf_counter() - t)
        t = time.perf_counter()
        checkpoint_verify.choose_checkpoint(folder, None, 0, 1)
        verifies.append(time.perf_counter() - t)
    row = {
        "what": f"engine save_checkpoint, ZeRO {stage}, world 1",
        "params": sum(p.numel() for p in eng.module.parameters()),
        "bytes": sum(r.size for r in files.values()),
        "files": len(files),
        "save_s_median": median(saves),
        "manifest_hash_s_median": median(hashes),
        "load_verify_s_median": median(verifies),
        "overhead": median(hashes) / median(saves),
    }
    print(json.dumps(row), flush=True)
    eng.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,128,512", help="state-dict sizes in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint_verify.jsonl"))
    args = p.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    ds_adabatch.init_distributed()
    folder = tempfile.mkdtemp(prefix="ckpt_verify_bench_")
    try:
        rows = raw([int(s) for s in args.sizes.split(",")], args.repeats, folder)
        rows.append(engine(args.stage, args.repeats, os.path.join(folder, "engine")))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

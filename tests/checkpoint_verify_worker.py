"""Damaged checkpoints on real gloo ranks (driven by tests/test_checkpoint_verify.py).

Phases (``python -m torch.distributed.run ... checkpoint_verify_worker.py PHASE OUT``):

- ``save`` (2 ranks): a ZeRO 2 run saves at steps 2, 4 and 6 and trains on to step ``STEPS`` (the
  losses of the uninterrupted run). Rank 0 copies the folder and damages the copies (see ``DAMAGE``);
  then every copy is resumed here, on the same world size. Then a 2-stage pipeline saves twice, loses
  the end of a layer file of its newest checkpoint, and resumes.
- ``resume`` (1 rank): the same copies resumed on another world size (the checkpoint that verifies is
  converted to DeepSpeed's universal format), a copy whose records predate manifests, and one damaged
  universal copy (converted again).

Each resume writes ``<phase>_<case>.json`` per rank: the path returned, the step resumed at, the next
losses, the ds_adabatch log lines this rank emitted, and the error raised if any.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_worker import Regression, ckpt_config, make_model, mse_loss, write  # noqa: E402

import ds_adabatch  # noqa: E402

SAVES = (2, 4, 6)
STEPS = 8
STAGE = 2
MODEL = "mp_rank_00_model_states.pt"
SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
# case -> [(step of the damaged checkpoint, file, how)]
DAMAGE = {
    "truncated": [(6, MODEL, "truncate")],
    "bitflip": [(6, SHARD.format(1), "flip")],
    "deleted": [(6, SHARD.format(0), "delete"), (4, "adabatch_rng_rank1.pt", "flip")],
    "allbad": [(6, MODEL, "truncate"), (4, SHARD.format(1), "delete"), (2, MODEL, "flip")],
}


class Lines(logging.Handler):
    """The ds_adabatch log lines of this rank (warnings and above, as the default handler shows them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LINES = Lines()
logging.getLogger("ds_adabatch").addHandler(LINES)


def _engine():
    engine, *_ = ds_adabatch.initialize(
        make_model(), ckpt_config(STAGE, "linear"), Regression(), loss_fn=mse_loss
    )
    return engine


def damage(folder: str, step: int, name: str, how: str) -> None:
    path = os.path.join(folder, f"global_step{step}", name)
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(100)
    elif how == "delete":
        os.remove(path)
    else:  # one bit in the middle of the file
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))


def resume(out_dir: str, phase: str, case: str, folder: str | None = None) -> None:
    engine = _engine()
    del LINES.lines[:]
    got: dict = {"error": None, "error_type": None}
    try:
        path, _ = engine.load_checkpoint(os.path.join(out_dir, folder or case))
        got["path"] = os.path.relpath(path, out_dir)
        got["start"] = engine.global_steps
        got["losses"] = [float(engine.train_batch()) for _ in range(engine.global_steps, STEPS)]
    except ds_adabatch.CheckpointCorrupt as err:
        got.update(error=str(err), error_type=type(err).__name__, start=engine.global_steps)
        got["problems"] = [p.describe() for p in err.problems]
    got["lines"] = list(LINES.lines)
    write(out_dir, f"{phase}_{case}_rank{dist.get_rank()}", got)
    engine.close()


def phase_save(out_dir: str) -> None:
    folder = os.path.join(out_dir, "saved")
    engine = _engine()
    losses = []
    for step in range(STEPS):
        if step in SAVES:
            engine.save_checkpoint(folder)
        losses.append(float(engine.train_batch()))
    engine.close()
    if dist.get_rank() == 0:
        write(out_dir, "full", {"losses": losses})
        for case, damages in DAMAGE.items():
            shutil.copytree(folder, os.path.join(out_dir, case))
            for step, name, how in damages:
                damage(os.path.join(out_dir, case), step, name, how)
    dist.barrier()
    for case in DAMAGE:
        resume(out_dir, "w2", case)
    phase_pipeline(out_dir)


def phase_pipeline(out_dir: str) -> None:
    """2 stages: the newest checkpoint loses the end of a layer file the last stage wrote."""
    from deepspeed.pipe import PipelineModule

    def build():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss)
        config = {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 1},
            "adabatch": {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4},
        }
        return ds_adabatch.initialize(model, config, Regression())[0]

    folder = os.path.join(out_dir, "pipeline")
    engine = build()
    for _ in range(2):
        engine.train_batch()
        engine.save_checkpoint(folder)
    engine.close()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "global_step2", "adabatch_complete.json")) as f:
            files = json.load(f)["files"]
        name = next(n for n, r in sorted(files.items()) if n.startswith("layer_") and r["rank"] == 1)
        write(out_dir, "pipeline_damaged", {"name": name, "size": files[name]["size"], "files": files})
        damage(folder, 2, name, "truncate")
    dist.barrier()
    engine = build()
    del LINES.lines[:]
    path, _ = engine.load_checkpoint(folder)
    got = {"path": os.path.relpath(path, out_dir), "start": engine.global_steps, "lines": list(LINES.lines)}
    write(out_dir, f"pipeline_rank{dist.get_rank()}", got)
    engine.close()


def phase_resume(out_dir: str) -> None:
    # Records of a version without manifests: the same checkpoints, their "files" entries removed.
    legacy = os.path.join(out_dir, "legacy")
    shutil.copytree(os.path.join(out_dir, "saved"), legacy)
    for step in SAVES:
        marker = os.path.join(legacy, f"global_step{step}", "adabatch_complete.json")
        with open(marker) as f:
            record = json.load(f)
        record.pop("files")
        with open(marker, "w") as f:
            json.dump(record, f)
    for case in (*DAMAGE, "legacy"):
        resume(out_dir, "w1", case)
    # The universal copy the resume above cached loses a byte's worth of a bit: converted again.
    copy = os.path.join(out_dir, "truncated", "global_step4_universal")
    with open(os.path.join(copy, "adabatch_complete.json")) as f:
        name = sorted(n for n in json.load(f)["files"] if n.startswith("zero/"))[0]
    damage(os.path.join(out_dir, "truncated"), 4, os.path.join("..", "global_step4_universal", name), "flip")
    write(out_dir, "reconverted_file", {"name": name})
    resume(out_dir, "w1", "reconverted", folder="truncated")
    # One rank saves over a tag two ranks wrote (resumed from step 4, it reaches step 6 again): the old
    # world's shards and the universal copy converted from the old save go with it.
    resaved = os.path.join(out_dir, "resaved")
    shutil.copytree(os.path.join(out_dir, "saved"), resaved)
    engine = _engine()
    engine.load_checkpoint(resaved, tag="global_step6")  # caches global_step6_universal of the 2-rank save
    engine.close()
    engine = _engine()
    engine.load_checkpoint(resaved, tag="global_step4")
    while engine.global_steps < 6:
        engine.train_batch()
    had_copy = os.path.isdir(os.path.join(resaved, "global_step6_universal"))
    with open(os.path.join(resaved, "global_step6", "tokenizer.json"), "w") as f:
        f.write("{}")  # a file of the script's own: it stays
    engine.save_checkpoint(resaved)
    engine.close()
    write(
        out_dir,
        "resaved",
        {
            "had_copy": had_copy,
            "files": sorted(os.listdir(os.path.join(resaved, "global_step6"))),
            "copy_left": os.path.isdir(os.path.join(resaved, "global_step6_universal")),
        },
    )


def main() -> None:
    phase, out_dir = sys.argv[1], sys.argv[2]
    ds_adabatch.init_distributed()
    phase_save(out_dir) if phase == "save" else phase_resume(out_dir)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

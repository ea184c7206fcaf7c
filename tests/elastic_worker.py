"""Checkpoints across world sizes and crashes mid-save, on real gloo ranks (driven by tests/test_elastic.py).

Phases (``python -m torch.distributed.run ... elastic_worker.py PHASE OUT``):

- ``save``: ZeRO 0, 2 and 3 runs that save at step ``AT`` and keep training; every step's sample indices
  and loss are written (the ledger). Then a run whose last rank dies while writing its second save.
- ``resume``: each checkpoint saved by the *other* world size is resumed here (elastic: converted to
  universal for ZeRO 2/3 by the engine itself) and run to the end; on 1 rank also the crashed folder is
  resumed, and this world size's own ``save`` runs follow (for the opposite direction).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_worker import Regression, ckpt_config, ckpt_record, make_model, mse_loss, write  # noqa: E402

import ds_adabatch  # noqa: E402

STAGES = (0, 2, 3)
AT = 3
STEPS = 7


def _engine(stage: int):
    engine, *_ = ds_adabatch.initialize(
        make_model(), ckpt_config(stage, "linear"), Regression(), loss_fn=mse_loss
    )
    return engine


def phase_save(out_dir: str) -> None:
    world = dist.get_world_size()
    for stage in STAGES:
        folder = os.path.join(out_dir, f"w{world}_z{stage}")
        engine = _engine(stage)
        steps = []
        for k in range(STEPS):
            if k == AT:
                engine.save_checkpoint(folder)
            steps.append(ckpt_record(engine, engine.train_batch()))
        if engine.global_rank == 0:
            write(out_dir, f"w{world}_z{stage}_full", {"steps": steps, "world_size": world})
        engine.close()


def phase_crash(out_dir: str) -> None:
    """ZeRO 2: a complete save at step 2, then the last rank dies half-way through the save at step 4."""
    folder = os.path.join(out_dir, "crash")
    engine = _engine(2)
    last = dist.get_world_size() - 1
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(folder)
    for _ in range(2):
        engine.train_batch()
    if engine.global_rank == last:
        real = engine.deepspeed._save_zero_checkpoint

        def die_mid_save(save_path, tag):
            # The optimizer shard lands on disk (as a torn write would leave it), then the rank dies.
            real(save_path, tag)
            os._exit(17)

        engine.deepspeed._save_zero_checkpoint = die_mid_save
    engine.save_checkpoint(folder)
    raise AssertionError("the save that loses a rank must not return")


def phase_resume(out_dir: str) -> None:
    world = dist.get_world_size()
    other = 2 if world == 1 else 1
    for stage in STAGES:
        engine = _engine(stage)
        path, _ = engine.load_checkpoint(os.path.join(out_dir, f"w{other}_z{stage}"))
        start = engine.global_steps
        steps = []
        for _ in range(start, STEPS):
            steps.append(ckpt_record(engine, engine.train_batch()))
        if engine.global_rank == 0:
            write(
                out_dir,
                f"w{other}_z{stage}_resumed_w{world}",
                {"start": start, "steps": steps, "path": path},
            )
        engine.close()
    if world == 1:
        engine = _engine(2)
        path, _ = engine.load_checkpoint(os.path.join(out_dir, "crash"))
        write(out_dir, "crash_resumed", {"path": path, "start": engine.global_steps})
        engine.close()
        # The same folder again: the cached universal copy is reused, not converted anew.
        engine = _engine(2)
        mtime = os.path.getmtime(os.path.join(out_dir, "w2_z2", f"global_step{AT}_universal"))
        engine.load_checkpoint(os.path.join(out_dir, "w2_z2"))
        again = os.path.getmtime(os.path.join(out_dir, "w2_z2", f"global_step{AT}_universal"))
        write(out_dir, "universal_reused", {"before": mtime, "after": again, "steps": engine.global_steps})
        engine.close()
        phase_save(out_dir)


def main() -> None:
    phase, out_dir = sys.argv[1], sys.argv[2]
    ds_adabatch.init_distributed()
    if phase == "save":
        phase_save(out_dir)
        phase_crash(out_dir)
    else:
        phase_resume(out_dir)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

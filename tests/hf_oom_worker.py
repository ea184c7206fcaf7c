"""Out-of-memory recovery in AdaptiveBatchSizeTrainer (DeepSpeed), run by tests/test_oom.py.

Usage: torchrun --nproc-per-node 2 tests/hf_oom_worker.py OUT_DIR STAGE[,STAGE...]

Two trainings of the same model, data and config: one clean, one where the last rank's second forward
(the middle of step 0's accumulation) and the first forward of its retry run out of memory. Both write
their final parameters and per-step sample indices (rank 0: OUT_DIR/hf_oom_z<STAGE>.json). Then a run
that imposes an exited process's record (hf_oom_recorded.json), and a goodput run whose step 2 is re-run
after an OOM, with the step times its throughput model kept (hf_oom_timed.json).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import hf_worker  # noqa: E402
from hf_worker import IndexRegression, Regressor, StepRecorder, _args, flat  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer  # noqa: E402
from ds_adabatch.runtime.memory.restart_record import new_record, write_record  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

SAMPLES = 32


def train(out: Path, stage: int, faults: bool, record_failed: int | None = None) -> dict:
    hf_worker.ZERO_STAGE = stage
    adabatch = {"schedule": {"type": "constant", "value": 16}, "max_micro_batch_per_gpu": 4}
    config = hf_worker.ds_config(adabatch)
    config["zero_allow_untested_optimizer"] = True
    # Persistent parameters (DeepSpeed's default threshold): a ZeRO-3 forward then gathers nothing, so
    # an OOM in it is recoverable (with partitioned ones it is not: see tests/oom_worker.py).
    config["zero_optimization"] = {"stage": stage}
    args = _args(
        out,
        num_train_epochs=1,
        use_cpu=True,
        deepspeed=config,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        **({"save_strategy": "steps", "save_steps": 1} if record_failed else {}),
    )
    if record_failed and int(os.environ.get("RANK", "0")) == 1:
        # What a process that exited on an unrecoverable OOM at this size leaves in output_dir.
        write_record(str(out), new_record(None, record_failed, rank=1, where="test"))
    if record_failed:
        torch.distributed.barrier()
    trainer = AdaptiveBatchSizeTrainer(model=Regressor(), args=args, train_dataset=IndexRegression(SAMPLES))
    recorder = StepRecorder(trainer)
    trainer.add_callback(recorder)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    budget = simulated_memory_limit(10**9, ranks=[world - 1], fail_calls=[2, 3]) if faults else None
    if budget is not None:
        budget.install()
    try:
        trainer.train()
    finally:
        if budget is not None:
            budget.remove()
    params = flat(trainer.model_wrapped if stage == 3 else trainer.model).tolist()
    indices = [i for s in recorder.steps for m in s["indices"] for i in m]
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, indices)
    return {
        "records_left": sorted(p.name for p in out.glob("adabatch_oom_rank*.json")),
        "params": params,
        "plans": [s["plan"] for s in recorder.steps],
        "seen": [i for part in gathered for i in part],
        "steps": trainer.state.global_step,
    }


def train_timed(out: Path) -> dict:
    """goodput (start held by its warm-up) on a simulated flat step time; rank 1's first forward of step
    2 runs out of memory, so step 2 is re-run at micro 2 x gas 4. Returns the plans and the step times
    its throughput model kept, by shape."""
    from ds_adabatch.runtime.core.step_times import SIMULATED_STEP_TIME_ENV

    hf_worker.ZERO_STAGE = 2
    adabatch = {
        "schedule": {"type": "goodput", "start": 16, "warmup_steps": 100},
        "max_micro_batch_per_gpu": 4,
        "max_global_batch": 64,
    }
    config = hf_worker.ds_config(adabatch)
    config["zero_allow_untested_optimizer"] = True
    args = _args(out, num_train_epochs=1, use_cpu=True, deepspeed=config, optim="sgd", learning_rate=0.1)
    os.environ[SIMULATED_STEP_TIME_ENV] = "fixed=0.05"
    world = torch.distributed.get_world_size()
    budget = simulated_memory_limit(10**9, ranks=[world - 1], fail_calls=[5])
    budget.install()
    try:
        trainer = AdaptiveBatchSizeTrainer(model=Regressor(), args=args, train_dataset=IndexRegression(96))
        recorder = StepRecorder(trainer)
        trainer.add_callback(recorder)
        trainer.train()
    finally:
        budget.remove()
        del os.environ[SIMULATED_STEP_TIME_ENV]
    model = trainer.batch_state.controller.schedule.throughput
    return {
        "plans": [s["plan"] for s in recorder.steps],
        "kept": {f"{m}x{g}": n for m, g, _, n in model.measured(world)},
        "skip_first": model.skip_first,
    }


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    for stage in (int(s) for s in argv[1].split(",")):
        clean = train(out / f"clean{stage}", stage, faults=False)
        faulty = train(out / f"faulty{stage}", stage, faults=True)
        if int(os.environ.get("RANK", "0")) == 0:
            (out / f"hf_oom_z{stage}.json").write_text(json.dumps({"clean": clean, "faulty": faulty}))
    # A record an exited process left (failed at 4 samples per pass) is imposed from step 0, and deleted
    # once a checkpoint holds the lower limit.
    recorded = train(out / "recorded", 2, faults=False, record_failed=4)
    timed = train_timed(out / "timed")
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "hf_oom_recorded.json").write_text(json.dumps(recorded))
        (out / "hf_oom_timed.json").write_text(json.dumps(timed))


if __name__ == "__main__":
    main(sys.argv[1:])
    ds_adabatch.finish()

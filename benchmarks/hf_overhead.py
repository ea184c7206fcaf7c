"""Trainer overhead: ``AdaptiveBatchSizeTrainer`` with a constant schedule against ``transformers.Trainer``.

The same script, model (the main job's byte-level GPT-2, ``small`` or ``large`` as in
``benchmarks/overhead.py``), data, batch (``per_device_train_batch_size`` x ``gradient_accumulation_steps``
on every rank: global 32 = micro 8 x GAS 2 on 2 ranks) and ``TrainingArguments``; ours gets no schedule,
so its batch is that same constant. Each round trains a fresh ``Trainer`` and a fresh
``AdaptiveBatchSizeTrainer`` for ``--steps`` optimizer steps each, in alternating order, and a callback
times every optimizer step from one ``on_step_end`` to the next (data, forward/backward of every
micro-batch, optimizer step, the Trainer's logging every ``--logging-steps`` steps); the first
``--warmup`` steps of every run are left out. Per backend (DeepSpeed ZeRO-2 and plain DDP) it prints the
median step of each and the ratio ours / Trainer (goal: <= 1.01)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/hf_overhead.py

It prints the load average before and after (with a warning when the machine was not idle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

import ds_adabatch
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

MICRO, GAS = 8, 2


class StepTimes(TrainerCallback):
    """Wall seconds of every optimizer step after ``warmup`` ones (on_step_end to on_step_end)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._last: float | None = None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        now = time.perf_counter()
        if self._last is not None and state.global_step > self.warmup:
            self.times.append(now - self._last)
        self._last = now


def deepspeed_config() -> dict:
    """What a Trainer user writes: the batch keys and the optimizer filled from TrainingArguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
        "steps_per_print": 10**9,
    }


def run(cls: type, backend: str, args, data, out: str) -> list[float]:
    training_args = TrainingArguments(
        output_dir=out,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=args.logging_steps,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-3,
        use_cpu=True,
        seed=0,
        deepspeed=deepspeed_config() if backend == "zero2" else None,
    )
    trainer = cls(model=h.lm_model(spec=h.MODELS[args.model]), args=training_args, train_dataset=data)
    timer = StepTimes(args.warmup)
    trainer.add_callback(timer)
    trainer.train()
    if isinstance(trainer, AdaptiveBatchSizeTrainer):
        plan = trainer.batch_state.plan
        assert (plan.micro_batch_per_gpu, plan.gradient_accumulation_steps) == (MICRO, GAS), plan.describe()
    return timer.times


def measure(backend: str, args, data, out: str) -> dict:
    times: dict[str, list[float]] = {"Trainer": [], "AdaptiveBatchSizeTrainer": []}
    classes = [("Trainer", Trainer), ("AdaptiveBatchSizeTrainer", AdaptiveBatchSizeTrainer)]
    for r in range(args.rounds):
        for name, cls in classes if r % 2 == 0 else reversed(classes):
            dist.barrier()
            times[name] += run(cls, backend, args, data, os.path.join(out, f"{backend}_{name}_{r}"))
    from accelerate.state import AcceleratorState

    # accelerate 1.15 keeps one AcceleratorState per process: the next backend builds its own.
    AcceleratorState._reset_state(reset_partial_state=False)
    plain, ours = (statistics.median(times[n]) for n in ("Trainer", "AdaptiveBatchSizeTrainer"))
    return {"plain": plain, "ours": ours, "n": len(times["Trainer"]), "min": [min(times[n]) for n in times]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (one run of each per round)")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps at the start of each run")
    p.add_argument("--logging-steps", type=int, default=10, help="TrainingArguments.logging_steps of both")
    p.add_argument(
        "--model", default="small", choices=sorted(h.MODELS), help="the main job's model, or larger"
    )
    p.add_argument("--backends", default="zero2,ddp", help="comma-separated: zero2, ddp")
    args = p.parse_args()

    before = h.idle_check("before")
    ds_adabatch.init_distributed()  # the barriers between runs need the process group before any Trainer
    data = h.lm_data()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for backend in args.backends.split(","):
            results[backend] = measure(backend, args, data, out)
    world, rank = dist.get_world_size(), dist.get_rank()
    after = h.idle_check("after", own_processes=world)
    if rank == 0:
        print(f"\n{before}\n{after}")
        print(
            f"{world} ranks, model {args.model}, global {MICRO * GAS * world} = micro {MICRO} x gas {GAS}, "
            f"{args.rounds} interleaved rounds x {args.steps} timed steps per run\n"
        )
        print(
            "| backend | steps timed (each) | `Trainer` step | `AdaptiveBatchSizeTrainer` step | ratio of medians | ratio of minimums |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for backend, r in results.items():
            print(
                f"| {backend} | {r['n']} | {r['plain'] * 1e3:.1f} ms | {r['ours'] * 1e3:.1f} ms "
                f"| {r['ours'] / r['plain']:.3f} | {r['min'][1] / r['min'][0]:.3f} |"
            )


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

"""Counts the collectives and host reads of one Trainer optimizer step: ``Trainer`` against ours.

Usage: torchrun --nproc-per-node 2 tests/hf_collectives_worker.py OUT_DIR  (run by tests/test_hf_step_collectives.py)

Each case trains a few steps with a callback that measures every step from one ``on_step_end`` to the
next: data, forward/backward of every micro-batch, the optimizer step, the Trainer's logging (every
``LOGGING_STEPS`` steps, the same for both) and, for ours, the next step's decision. Collectives are
every ``c10d::*`` op the profiler records (DeepSpeed's and DDP's included); host reads are calls of
``Tensor.item`` / ``tolist`` / ``__float__`` / ``__int__`` / ``__bool__`` (each a synchronisation on a
GPU). Rank 0 writes, per case, the counts of every measured step to OUT_DIR/counts.json. The same
token-normalised cases (a GPT-2) run under DeepSpeed ZeRO-2, the sample-normalised ones under plain DDP
(one process, the accelerator state reset between).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from collectives_worker import HostReads  # noqa: E402
from hf_worker import Regressor, TokenWindows, ds_config, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer  # noqa: E402

MICRO, GAS = 4, 2
WARMUP, MEASURED = 2, 6
LOGGING_STEPS = 4
EVERY = 4  # log.every_steps of the JSONL case


class RegressionPoints(torch.utils.data.Dataset):
    """Points (x, 1) -> x: a model without **kwargs, so both trainers average over samples."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = (i % 97) / 97
        return {"x": torch.tensor([x, 1.0]), "labels": torch.tensor(x)}


class StepCounter(TrainerCallback):
    """Counts collectives and host reads from one ``on_step_end`` to the next, after a warm-up."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self._prof: Any = None
        self._reads: HostReads | None = None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._reads.__exit__(None, None, None)
            collectives = sum(1 for e in self._prof.events() if e.name.startswith("c10d::"))
            self.steps.append([collectives, self._reads.count])
            self._prof = None
        if WARMUP <= state.global_step < WARMUP + MEASURED:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()
            self._reads = HostReads().__enter__()


def run_case(out: str, backend: str, name: str, *, ours: bool, token: bool, **extra: Any) -> list[list[int]]:
    args = TrainingArguments(
        output_dir=os.path.join(out, f"{backend}_{name}"),
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=LOGGING_STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS,
        max_steps=WARMUP + MEASURED,
        learning_rate=1e-3,
        # The plain Trainer of transformers 4.57 fills DeepSpeed's "auto" warmup_num_steps with 0 without
        # a warmup, which deepspeed 0.19.8 refuses (5.18 fills 1); one warm-up step runs on every release.
        warmup_steps=1,
        use_cpu=True,
        deepspeed=ds_config(with_optimizer=True) if backend == "zero2" else None,
    )
    model = tiny_gpt2() if token else Regressor()
    data = TokenWindows(256) if token else RegressionPoints()
    cls = AdaptiveBatchSizeTrainer if ours else Trainer
    trainer = cls(model=model, args=args, train_dataset=data, **extra)
    counter = StepCounter()
    trainer.add_callback(counter)
    trainer.train()
    if ours:
        plan = trainer.batch_state.plan
        shape = (plan.micro_batch_per_gpu, plan.gradient_accumulation_steps)
        assert shape == (MICRO, GAS), f"{name}: ran {plan.describe()}, not micro {MICRO} x gas {GAS}"
    return counter.steps


def cases(out: str, backend: str) -> dict[str, list[list[int]]]:
    jsonl = {"schedule": {"type": "constant", "value": MICRO * GAS * 2}, "max_micro_batch_per_gpu": MICRO}
    jsonl["log"] = {"jsonl": os.path.join(out, f"{backend}_steps.jsonl"), "every_steps": EVERY}
    if backend == "zero2":  # GPT-2: both normalise by target tokens (num_items_in_batch)
        return {
            "plain token": run_case(out, backend, "plain_token", ours=False, token=True),
            "ours token": run_case(out, backend, "ours_token", ours=True, token=True),
            "ours token jsonl": run_case(
                out, backend, "ours_jsonl", ours=True, token=True, adabatch_config=jsonl
            ),
            "ours token scheduler": run_case(
                out, backend, "ours_fn", ours=True, token=True, batch_size_scheduler=lambda step, batch: batch
            ),
        }
    # A model without **kwargs: both normalise by samples.
    return {
        "plain sample": run_case(out, backend, "plain_sample", ours=False, token=False),
        "ours sample": run_case(out, backend, "ours_sample", ours=True, token=False),
        "ours sample jsonl": run_case(
            out, backend, "ours_jsonl", ours=True, token=False, adabatch_config=jsonl
        ),
    }


def main() -> None:
    from accelerate.state import AcceleratorState

    out = sys.argv[1]
    result: dict[str, Any] = {"warmup": WARMUP, "logging_steps": LOGGING_STEPS, "every_steps": EVERY}
    for backend in ("zero2", "ddp"):
        result[backend] = cases(out, backend)
        # accelerate 1.15 keeps one AcceleratorState per process: the next backend builds its own.
        AcceleratorState._reset_state(reset_partial_state=False)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "counts.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

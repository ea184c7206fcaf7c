"""Token-budget steps on real ranks, run under torchrun by tests/test_token_engine.py.

Usage: torchrun --nproc-per-node N tests/token_worker.py PHASE OUT_DIR
PHASE "train" (2 ranks): every case in one process group (ZeRO 0, 2, 3; token and sample means; a lazily
measured length_fn with 2 loader workers per rank);
PHASE "resume" (1 rank): continues the 2-rank checkpoint. Rank 0 writes OUT_DIR/<phase>_<case>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm as dist  # noqa: E402

import ds_adabatch  # noqa: E402

N, VOCAB, BUDGET = 60, 11, 64
# Token targets step by step: enough to finish epoch 0 and start epoch 1.
TARGETS = [150, 300, 90, 40, 500, 64, 200, 120]
RESUME_AT = 4  # checkpoint after this many steps


class Sequences(torch.utils.data.Dataset):
    """N sequences of 1..24 token ids; the label of each position is a fixed function of its id."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        # Heavy tail: most short, a few near the budget's longest row.
        self.lengths = [int(min(24, 1 + torch.empty(()).exponential_(generator=g) * 5)) for _ in range(N)]
        self.seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in self.lengths]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def collate(samples: list[torch.Tensor]) -> dict:
    """Pad to the longest sample; padded positions get label -100 (no target)."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s)] = s
        labels[r, : len(s)] = (s * 3 + 1) % VOCAB
    return {"input_ids": ids, "labels": labels}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))


def token_mean_loss(engine, batch) -> torch.Tensor:
    logits = engine(batch["input_ids"])
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )


def sample_mean_loss(engine, batch) -> torch.Tensor:
    """Mean over samples of each sample's mean token loss."""
    logits = engine(batch["input_ids"])
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), batch["labels"], ignore_index=-100, reduction="none"
    )
    mask = (batch["labels"] != -100).float()
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def count_tokens(batch) -> int:
    return int((batch["labels"] != -100).sum())


def config(stage: int, normalization: str, **extra) -> dict:
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.5}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "adabatch": {
            "schedule": {"type": "constant", "unit": "tokens", "value": TARGETS[0]},
            "micro_batch_tokens": BUDGET,
            "padding": "pad_to_longest",
            "loss_normalization": normalization,
            "data": {"shuffle": True, "seed": 5},
            **extra,
        },
    }


def reference(steps: list[list[int]], data: Sequences, normalization: str) -> torch.Tensor:
    """Plain PyTorch in one process: each step's samples as one big batch."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    for idx in steps:
        opt.zero_grad()
        losses = []
        for i in idx:
            s = data.seqs[i]
            losses.append(torch.nn.functional.cross_entropy(model(s), (s * 3 + 1) % VOCAB, reduction="sum"))
        if normalization == "token":
            loss = sum(losses) / sum(len(data.seqs[i]) for i in idx)
        else:
            loss = sum(l / len(data.seqs[i]) for l, i in zip(losses, idx)) / len(idx)  # noqa: E741
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def params(engine) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p) if engine.zero_optimization_stage() > 0 else None
        out.append((full if full is not None else p.detach()).float().flatten().cpu())
    return torch.cat(out)


def run(engine, targets: list[int]) -> dict:
    steps, epochs, passes, max_cost, counts, losses = [], [], [], 0, [], []
    for target in targets:
        engine.set_global_batch_size(target)
        losses.append(engine.train_batch())
        step = engine.last_step_batch.global_batch
        steps.append(step.indices.tolist())
        epochs.append(step.epoch)
        passes.append(step.passes)
        max_cost = max(max_cost, max(c for layout in step.layouts for c in layout.costs))
        mine = engine.last_step_batch
        counts.append([len(mine), engine.plan.gradient_accumulation_steps])
        # Every pass this rank ran stays within the budget as the collate actually padded it.
        for m in mine:
            assert m.batch["input_ids"].numel() <= BUDGET, m.batch["input_ids"].shape
    return {
        # Read after the loop (one collective on every rank), so the steps run as they do in training.
        "losses": [float(loss) for loss in losses],
        "steps": steps,
        "epochs": epochs,
        "passes": passes,
        "max_cost": max_cost,
        "counts": counts,
        "global_samples": engine.global_samples,
        "global_tokens": engine.global_tokens,
        "ds_global_samples": int(engine.deepspeed.global_samples),
    }


def write(out_dir: str, name: str, record: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(record, f)


def train(out_dir: str) -> None:
    data = Sequences()
    lines: list[str] = []  # rank 0's plan-change lines (INFO, the "ds_adabatch" logger)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda entry: lines.append(entry.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ds_adabatch").addHandler(handler)
    logging.getLogger("ds_adabatch").setLevel(logging.INFO)
    for stage, normalization in ((0, "token"), (1, "token"), (2, "token"), (3, "token"), (0, "sample")):
        lines.clear()
        loss_fn = token_mean_loss if normalization == "token" else sample_mean_loss
        engine, *_ = ds_adabatch.initialize(
            make_model(), config(stage, normalization), data, collate_fn=collate, loss_fn=loss_fn,
            token_count_fn=count_tokens, lengths=data.lengths,
        )  # fmt: skip
        record = run(engine, TARGETS[:RESUME_AT])
        record["data_state"] = engine.dataloader.state_dict()
        if stage == 0 and normalization == "token":
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"), tag="mid")
        rest = run(engine, TARGETS[RESUME_AT:])
        for key in ("losses", "steps", "epochs", "passes", "counts"):
            record[key] += rest[key]
        record.update({k: rest[k] for k in ("global_samples", "global_tokens", "ds_global_samples")})
        record["max_cost"] = max(record["max_cost"], rest["max_cost"])
        got = params(engine)
        want = reference(record["steps"], data, normalization)
        record["max_rel_err"] = float((got - want).abs().max() / want.abs().max())
        record["rest_steps"] = rest["steps"]
        record["params"] = got.tolist()
        record["lengths"] = data.lengths
        record["history"] = [e.to_dict() for e in engine.history]
        record["plan_lines"] = [line for line in lines if " -> " in line and "global batch" in line]
        write(out_dir, f"train_z{stage}_{normalization}", record)
        engine.close()
        dist.barrier()
    # A length_fn measured lazily, and 2 loader workers per rank, give the z0_token case's stream and
    # losses. The loader state is read with the next step prefetched by the workers.
    cfg = config(0, "token")
    cfg["adabatch"]["data"]["num_workers"] = 2
    engine, *_ = ds_adabatch.initialize(
        make_model(), cfg, data, collate_fn=collate, loss_fn=token_mean_loss,
        token_count_fn=count_tokens, length_fn=len,
    )  # fmt: skip
    record = run(engine, TARGETS[:RESUME_AT])
    record["data_state"] = engine.dataloader.state_dict()
    record["workers"] = len(engine.dataloader.worker_processes())
    rest = run(engine, TARGETS[RESUME_AT:])
    for key in ("losses", "steps"):
        record[key] += rest[key]
    record["params"] = params(engine).tolist()
    write(out_dir, "train_length_fn_workers", record)
    engine.close()
    # A token ramp with the LR scaled by the target: every step's multiplier is its target over the
    # start, also where a new target packs into the same samples and passes as the step before (as
    # these lengths do at steps 3 -> 4: 120 and 149 tokens, 12 samples each).
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 21, size=150)]
    rows_data = [torch.full((n,), 1.0) for n in lengths]
    engine, *_ = ds_adabatch.initialize(
        torch.nn.Linear(1, 1),
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "adabatch": {
                "schedule": {
                    "type": "linear",
                    "unit": "tokens",
                    "start": 60,
                    "end": 300,
                    "ramp_samples": 100,
                },
                "micro_batch_tokens": 40,
                "bucket_window": 16,
                "lr_scaling": {"rule": "linear", "reference_batch": 60},
            },
        },
        rows_data,
        lengths=lengths,
        collate_fn=lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
        loss_fn=lambda e, b: e(b.mean(1, keepdim=True)).mean(),
    )
    rows = []
    for _ in range(9):
        engine.next_plan()
        multiplier = engine.lr_multiplier
        engine.train_batch()
        step = engine.last_step_batch.global_batch
        rows.append(
            [step.target_tokens, multiplier, len(step.indices), engine.plan.gradient_accumulation_steps]
        )
    write(out_dir, "token_lr", {"rows": rows, "history": [e.to_dict() for e in engine.history]})
    engine.close()


def resume(out_dir: str) -> None:
    data = Sequences()
    engine, *_ = ds_adabatch.initialize(
        make_model(), config(0, "token"), data, collate_fn=collate, loss_fn=token_mean_loss,
        token_count_fn=count_tokens, lengths=data.lengths,
    )  # fmt: skip
    engine.load_checkpoint(os.path.join(out_dir, "ckpt"), tag="mid")
    record = run(engine, TARGETS[RESUME_AT:])
    record["params"] = params(engine).tolist()
    write(out_dir, "resume_z0_token", record)
    engine.close()


if __name__ == "__main__":
    phase, out = sys.argv[1], sys.argv[2]
    {"train": train, "resume": resume}[phase](out)
    ds_adabatch.finish()

"""The forward / backward / step loop against train_batch and a big-batch reference (2 ranks, one launch).

Usage: deepspeed --num_gpus 2 tests/loop_worker.py --phase exact --out OUT   (tests/test_loop.py)
       deepspeed --num_gpus 1 tests/loop_worker.py --phase resume --out OUT  (after exact: 1 rank)

Phase ``exact``:
* ZeRO 0, 2, 3 with the tutorial's own config (Adam, WarmupLR, clipping 1.0): one epoch of the
  tutorial's loop over the loader ``initialize`` returns, then the same config through ``train_batch``;
  the final parameters must agree (same plan sequence, same samples).
* ZeRO 2 with torch's Adam and a schedule of growing, uneven and GAS-changing plans: the loop's final parameters
  against plain PyTorch training the same global batches as one batch each. Mid-way, inside an optimizer
  step, a checkpoint is saved (``ckpt``): a resume starts that step again.
Phase ``resume``: the checkpoint on 1 rank, the loop to the end of the epoch; every sample of the epoch
exactly once over both runs, and the parameters against the reference of the combined samples.
Then that loop again with ``"managed_gradient_accumulation": false`` (``caller_owned``).
Rank 0 writes OUT/<case>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "ds_examples"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from cifar10_deepspeed import Net, SyntheticCIFAR, get_ds_config  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import ds_adabatch  # noqa: E402

N = 96
# Adam divides by sqrt(v) + eps: with a small eps, a coordinate whose gradient is ~0 moves by about lr on
# float32 rounding alone (the reference sums in another order), which says nothing about exactness.
EPS = 1e-2
SAVE_AT = (3, 1)  # (optimizer step, micro-batch) inside which the checkpoint is saved
REF_SECTION = {
    # 11 (6 + 5 over 2 ranks: uneven, micro 3 x gas 2), 16 (4 x 2), 24 (4 x 3), 36 (5 x 4), then the
    # epoch's last 9 samples (uneven): GAS changes every step
    "schedule": {"type": "linear", "start": 11, "end": 40, "ramp_samples": 60},
    "max_micro_batch_per_gpu": 5,
    "allow_uneven": True,
    "data": {"seed": 4},
}


def params(engine, stage: int) -> torch.Tensor:
    # Gathering a ZeRO partition is a collective: every rank calls this.
    return torch.cat(
        [
            (safe_get_full_fp32_param(p) if stage else p.detach()).float().flatten().cpu()
            for p in engine.module.parameters()
        ]
    )


def write(out: str, name: str, payload: dict) -> None:
    if torch.distributed.get_rank() == 0:
        Path(out, f"{name}.json").write_text(json.dumps(payload))


def tutorial_loop(engine, loader, *, epochs: int = 1, stop=None) -> list[list[int]]:
    """The tutorial's loop (criterion, engine(x), backward, step); returns each step's samples."""
    criterion = torch.nn.CrossEntropyLoss()
    ledger = []
    for _ in range(epochs):
        for i, data in enumerate(loader):
            inputs, labels = data[0].to(engine.device), data[1].to(engine.device)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            if stop is not None and stop(engine, i):
                return ledger
            steps = engine.global_steps
            engine.step()
            if engine.global_steps > steps:
                ledger.append(engine.last_step_batch.global_batch.all_indices())
    return ledger


def ref_config(stage: int) -> dict:
    # torch's Adam (DeepSpeed's "torch_adam"), so the plain-PyTorch reference runs the same update; an
    # Adam-family state also lets the ZeRO-2 checkpoint resume on 1 rank (DeepSpeed's universal
    # checkpoint converts only exp_avg / exp_avg_sq).
    return {
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.01, "eps": EPS, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "adabatch": REF_SECTION,
    }


def reference(ledger: list[list[int]], data: SyntheticCIFAR) -> torch.Tensor:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=EPS)
    for idx in ledger:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def phase_exact(args) -> None:
    data = SyntheticCIFAR(N)
    for stage in (0, 2, 3):
        args.stage = stage
        torch.manual_seed(0)
        net = Net()
        engine, _, loader, _ = ds_adabatch.initialize(
            args=args,
            model=net,
            model_parameters=net.parameters(),
            training_data=data,
            config=get_ds_config(args),
        )
        ledger = tutorial_loop(engine, loader)
        plans = [[e.step, e.new_global_batch, e.new_gradient_accumulation_steps] for e in engine.history]
        loop_params = params(engine, stage)
        engine.close()
        torch.manual_seed(0)
        engine, *_ = ds_adabatch.initialize(Net(), get_ds_config(args), data, loss_fn=_ce)
        batches = []
        while engine.global_samples < N:
            engine.train_batch()
            batches.append(engine.last_step_batch.global_batch.all_indices())
        step_params = params(engine, stage)
        write(
            args.out,
            f"tutorial_z{stage}",
            {
                "rel_err": rel(loop_params, step_params),
                "ledger": ledger,
                "train_batch_ledger": batches,
                "plans": plans,
                "train_batch_plans": [
                    [e.step, e.new_global_batch, e.new_gradient_accumulation_steps] for e in engine.history
                ],
            },
        )
        engine.close()

    # Adam, growing/uneven/GAS-changing plans, against the big-batch reference; a checkpoint mid-step.
    torch.manual_seed(0)
    net = Net()
    engine, _, loader, _ = ds_adabatch.initialize(net, ref_config(2), data)

    def save_inside_a_step(engine, i) -> bool:
        if (engine.global_steps, engine.loop.in_progress.current) == SAVE_AT:
            boundary = engine.is_gradient_accumulation_boundary()
            engine.save_checkpoint(os.path.join(args.out, "ckpt"))
            write(args.out, "saved", {"boundary": boundary, "gas": engine.plan.gradient_accumulation_steps})
        return False

    ledger = tutorial_loop(engine, loader, stop=save_inside_a_step)
    got = params(engine, 2)
    write(
        args.out,
        "reference",
        {
            "rel_err": rel(got, reference(ledger, data)),
            "params": got.tolist(),
            "ledger": ledger,
            "plans": [e.to_dict() for e in engine.history],
            "global_samples": engine.global_samples,
            "len_after_epoch": len(loader),
        },
    )
    engine.close()

    # The same loop under DeepSpeed's caller-owned accumulation (one DeepSpeed step() per optimizer
    # step, no boundary set): the same samples and the same update.
    torch.manual_seed(0)
    config = {**ref_config(2), "managed_gradient_accumulation": False}
    engine, _, loader, _ = ds_adabatch.initialize(Net(), config, data)
    caller_ledger = tutorial_loop(engine, loader)
    write(
        args.out,
        "caller_owned",
        {
            "rel_err": rel(params(engine, 2), got),
            "same_ledger": caller_ledger == ledger,
            "ds_global_steps": engine.deepspeed.global_steps,
            "global_steps": engine.global_steps,
        },
    )
    engine.close()

    # len(loader) at a constant batch of 20 over 96 samples on 2 ranks (micro 2 x gas 5, and the
    # epoch's last 16 samples as micro 4 x gas 2: 22 a rank): what each epoch then hands out, twice.
    section = {"schedule": {"type": "constant", "value": 20}, "max_micro_batch_per_gpu": 4}
    engine, _, loader, _ = ds_adabatch.initialize(Net(), {**ref_config(2), "adabatch": section}, data)
    lengths = []
    for _ in range(2):
        before = len(loader)
        handed = sum(1 for _ in _counted(engine, loader))
        lengths.append([before, handed])
    write(args.out, "loop_len", {"lengths": lengths})
    engine.close()


def phase_resume(args) -> None:
    data = SyntheticCIFAR(N)
    torch.manual_seed(0)
    engine, _, loader, _ = ds_adabatch.initialize(Net(), ref_config(2), data)
    engine.load_checkpoint(os.path.join(args.out, "ckpt"))
    resumed_at = engine.global_samples
    ledger = tutorial_loop(engine, loader)
    write(
        args.out,
        "resumed",
        {
            "params": params(engine, 2).tolist(),
            "ledger": ledger,
            "resumed_at_samples": resumed_at,
            "world_size": engine.world_size,
        },
    )
    engine.close()


def _counted(engine, loader):
    """One epoch of the tutorial loop, yielding once per micro-batch handed out."""
    for inputs, labels in loader:
        engine.backward(torch.nn.functional.cross_entropy(engine(inputs), labels))
        engine.step()
        yield None


def _ce(engine, batch):
    return torch.nn.functional.cross_entropy(engine(batch[0]), batch[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--phase", choices=["exact", "resume"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--stage", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    {"exact": phase_exact, "resume": phase_resume}[args.phase](args)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

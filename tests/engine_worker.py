"""Multi-rank engine checks, run under torchrun by tests/test_engine.py (one launch, many cases).

Usage: torchrun --nproc-per-node N tests/engine_worker.py PHASE OUT_DIR
Each case writes what it measured into OUT_DIR/<phase>_<case>.json (rank 0) so the pytest side asserts
with readable messages. Cases share one process group: each launch earns its start-up seconds.
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

import ds_adabatch  # noqa: E402

N_SAMPLES = 96
# Global batches requested step by step: growing, GAS 1 -> 4 -> 3, shrinking, uneven, padded (1 sample
# on 2 ranks), then a request larger than what is left of the epoch (the smaller tail batch).
SEQUENCE = [8, 32, 24, 6, 13, 1, 3, 16]


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = N_SAMPLES, dim: int = 5, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def mse_loss(model, batch):
    x, y = batch
    dtype = next(model.module.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def ds_config(stage: int, *, bf16: bool = False, extra: dict | None = None, lr: float = 0.1) -> dict:
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.5}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**6,
        "adabatch": {
            "schedule": {"type": "constant", "value": SEQUENCE[0]},
            "max_micro_batch_per_gpu": 4,
            "allow_uneven": True,
            "data": {"shuffle": True, "seed": 3},
        },
    }
    if extra:
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    return cfg


def full_params(engine) -> torch.Tensor:
    """All parameters as one fp32 vector (the fp32 master copy where DeepSpeed keeps one)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p) if engine.zero_optimization_stage() > 0 else None
        out.append((full if full is not None else p.detach()).float().flatten().cpu())
    return torch.cat(out)


def reference(batches: list[list[int]], data: Regression, lr: float = 0.1) -> torch.Tensor:
    """Plain PyTorch, one process: the same global batches, each one big batch."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for idx in batches:
        x, y = data.x[idx], data.y[idx]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run_sequence(stage: int, bf16: bool, out_dir: str, tag: str) -> None:
    data = Regression()
    engine, *_ = ds_adabatch.initialize(make_model(), ds_config(stage, bf16=bf16), data, loss_fn=mse_loss)
    batches, plans, losses = [], [], []
    for b in SEQUENCE:
        engine.set_global_batch_size(b)
        losses.append(float(engine.train_batch()))
        gb = engine.last_step_batch.global_batch
        batches.append(gb.all_indices())
        plans.append(
            [
                engine.plan.global_batch_size,
                engine.plan.micro_batch_per_gpu,
                engine.plan.gradient_accumulation_steps,
            ]
        )
    got = full_params(engine)
    if engine.global_rank == 0:
        want = reference(batches, data)
        torch.save(got, os.path.join(out_dir, f"{tag}_params.pt"))
        write(
            out_dir,
            tag,
            {
                "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                "batches": batches,
                "plans": plans,
                "losses": losses,
                "global_samples": engine.global_samples,
                "ds_global_samples": engine.deepspeed.global_samples,
                "history": [e.to_dict() for e in engine.history],
                "world_size": engine.world_size,
            },
        )
    engine.close()


def write(out_dir: str, name: str, payload: dict) -> None:
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(payload, f)


def phase_exact(out_dir: str) -> None:
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            run_sequence(stage, bf16, out_dir, f"exact_z{stage}_{'bf16' if bf16 else 'fp32'}")
    # The CPU-offload path of ZeRO 2 reads the optimizer's stored GAS.
    run_offload(out_dir)


def run_offload(out_dir: str) -> None:
    data = Regression()
    cfg = ds_config(2, extra={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, data, loss_fn=mse_loss)
    batches = []
    for b in SEQUENCE:
        engine.set_global_batch_size(b)
        engine.train_batch()
        batches.append(engine.last_step_batch.global_batch.all_indices())
    got = full_params(engine)
    if engine.global_rank == 0:
        want = reference(batches, data)
        write(
            out_dir, "exact_z2_offload", {"max_rel_err": float((got - want).abs().max() / want.abs().max())}
        )
    engine.close()


def main() -> None:
    phase, out_dir = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed()
    {"exact": phase_exact}[phase](out_dir)
    dist.barrier()


if __name__ == "__main__":
    main()

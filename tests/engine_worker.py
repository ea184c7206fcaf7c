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
    """Mean squared error over the micro-batch (cast to the model's dtype for bf16)."""
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


def run_sequence(stage: int, bf16: bool, out_dir: str, tag: str, extra: dict | None = None) -> None:
    """SEQUENCE through the engine, then the final parameters against the big-batch reference."""
    data = Regression()
    cfg = ds_config(stage, bf16=bf16, extra=extra)
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, data, loss_fn=mse_loss)
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


CALLER_OWNED = {"managed_gradient_accumulation": False}


def phase_exact(out_dir: str) -> None:
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            run_sequence(stage, bf16, out_dir, f"exact_z{stage}_{'bf16' if bf16 else 'fp32'}")
    # DeepSpeed's caller-owned accumulation: no boundary set, one step() per optimizer step. ZeRO 3
    # keeps its default overlap_comm (true), which DeepSpeed 0.19.8 accepts from stage 2 on.
    for stage in (0, 1, 2, 3):
        run_sequence(stage, False, out_dir, f"caller_z{stage}", CALLER_OWNED)
    # The CPU-offload path of ZeRO 2 reads the optimizer's stored GAS.
    run_offload(out_dir)
    run_workers(out_dir)
    run_data_iter(out_dir)
    run_iterable(out_dir)
    run_seesaw_lr(out_dir)


# A cosine LR schedule in samples (reference batch 4): warmup over 4 scheduler steps, then decay to
# 10% of the peak by step 50 (200 samples); the seesaw batch follows peak / base LR from 4 up to 32.
SEESAW_LR_CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 50,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
            "cos_min_ratio": 0.1,
        },
    },
    "adabatch": {
        "schedule": {"type": "seesaw", "start": 4},
        "max_micro_batch_per_gpu": 4,
        "allow_uneven": False,
        "max_global_batch": 32,
        "lr_scaling": {"rule": "sqrt"},
        "lr_schedule_unit": "samples",
    },
}
SEESAW_LR_SAMPLES = 240


def run_seesaw_lr(out_dir: str) -> None:
    """seesaw on a real cosine WarmupCosineLR: the batch and the LR DeepSpeed's optimizer applied."""
    cfg = ds_config(0, extra=SEESAW_LR_CONFIG)
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(n=400), loss_fn=mse_loss)
    rows = []
    while engine.global_samples < SEESAW_LR_SAMPLES:
        samples_before = engine.global_samples
        engine.train_batch()
        m = engine.last_metrics
        # The LR the optimizer actually held during the step, read from DeepSpeed's param groups.
        rows.append({"samples_before": samples_before, "batch": m.global_batch, "lr": m.lr})
    if engine.global_rank == 0:
        write(out_dir, "seesaw_lr", {"rows": rows, "config": cfg})
    engine.close()


def run_workers(out_dir: str) -> None:
    """The sequence with 2 loader worker processes per rank (prefetch across plan changes)."""
    extra = {"adabatch": {"data": {"shuffle": True, "seed": 3, "num_workers": 2}}}
    run_sequence(1, False, out_dir, "exact_z1_workers", extra)


def run_data_iter(out_dir: str) -> None:
    """train_batch(data_iter): the user's own micro-batches of uneven sizes, weighted by their real size."""
    data = Regression()
    engine, *_ = ds_adabatch.initialize(make_model(), ds_config(2), None, loss_fn=mse_loss)
    rank, world = engine.global_rank, engine.world_size
    # Each step: GAS micro-batches per rank of these sizes (rank-major), drawn from a fixed order.
    steps = [[[3, 1], [2, 2]], [[4, 4], [1, 3]], [[2, 1], [1, 1]]]
    pos, batches = 0, []
    for sizes in steps:
        engine.set_global_batch_size(8 * world)  # 4 per micro-batch (max micro) x 2 per rank
        assert engine.next_plan().gradient_accumulation_steps == 2  # 2 micro-batches per rank
        cuts, idx = [], []
        for r in range(world):
            row = []
            for n in sizes[r]:
                row.append(list(range(pos, pos + n)))
                idx += row[-1]
                pos += n
            cuts.append(row)
        micro = iter([(data.x[i], data.y[i]) for i in cuts[rank]])
        engine.train_batch(micro)
        batches.append(idx)
    got = full_params(engine)
    if rank == 0:
        want = reference(batches, data)
        write(
            out_dir,
            "data_iter_z2",
            {
                "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                "global_samples": engine.global_samples,
                "want_samples": pos,
            },
        )
    engine.close()


class Stream(torch.utils.data.IterableDataset):
    """Each rank streams its own disjoint half of Regression (sharding is the dataset's job)."""

    def __iter__(self):
        data = Regression()
        rank, world = dist.get_rank(), dist.get_world_size()
        for i in range(rank, len(data), world):
            yield data.x[i], data.y[i], torch.tensor(i)


def stream_loss(model, batch):
    x, y, _ = batch
    return mse_loss(model, (x, y))


def run_iterable(out_dir: str) -> None:
    engine, *_ = ds_adabatch.initialize(make_model(), ds_config(0), Stream(), loss_fn=stream_loss)
    seen = []
    for b in (8, 6, 12):
        engine.set_global_batch_size(b)
        engine.train_batch()
        for m in engine.last_step_batch.micro_batches:
            if m.num_samples:
                seen += [int(i) for i in m.batch[2]]
    gathered = [None] * engine.world_size
    dist.all_gather_object(gathered, seen)
    if engine.global_rank == 0:
        write(out_dir, "iterable_z0", {"seen": gathered, "global_samples": engine.global_samples})
    engine.close()


def run_offload(out_dir: str) -> None:
    """The sequence with ZeRO-2's optimizer offloaded to CPU (that path reads the optimizer's GAS)."""
    extra = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    run_sequence(2, False, out_dir, "exact_z2_offload", extra)


def grow(step: int, batch_size: int, interval: int = 2, increment: int = 1) -> int:
    """The seed's scheduler: +increment every interval steps (per device)."""
    if step % interval == 0 and step > 0:
        return batch_size + increment
    return batch_size


# --- token normalisation -------------------------------------------------------------------------
class MaskedTargets(torch.utils.data.Dataset):
    """Each sample has 3 targets of which 1-3 count (the rest masked): a loss averaged over tokens."""

    def __init__(self, n: int = 48, seed: int = 11):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)
        self.y = torch.randn(n, 3, generator=g)
        self.mask = (torch.arange(3)[None, :] < torch.randint(1, 4, (n, 1), generator=g)).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], self.mask[i]


def make_token_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def masked_loss(model, batch):
    x, y, m = batch
    return (((model(x) - y) ** 2) * m).sum() / m.sum()


def masked_loss_and_tokens(model, batch, extra: int = 0):
    """``(mean loss over target tokens, their count + extra)``: the tuple a loss_fn may return."""
    return masked_loss(model, batch), int(batch[2].sum()) + extra


def phase_tokens(out_dir: str) -> None:
    data = MaskedTargets()
    cfg = ds_config(2, extra={"adabatch": {"loss_normalization": "token"}})
    engine, *_ = ds_adabatch.initialize(
        make_token_model(),
        cfg,
        data,
        loss_fn=masked_loss_and_tokens,
        token_count_fn=lambda b: int(b[2].sum()),
    )
    batches = []
    for b in (8, 13, 6, 16):
        engine.set_global_batch_size(b)
        engine.train_batch()
        batches.append(engine.last_step_batch.global_batch.all_indices())
    got = full_params(engine)
    # A loss_fn whose num_tokens is not the count the weights were built from is refused before its
    # micro-batch's backward (on every rank: each has real samples in a step of 8).
    engine.loss_fn = lambda model, batch: masked_loss_and_tokens(model, batch, extra=1)
    try:
        engine.train_batch()
        refused = None
    except ValueError as err:
        refused = str(err)
    if engine.global_rank == 0:
        model = make_token_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        for idx in batches:
            opt.zero_grad()
            masked_loss(model, (data.x[idx], data.y[idx], data.mask[idx])).backward()
            opt.step()
        want = torch.cat([p.detach().flatten() for p in model.parameters()])
        write(
            out_dir,
            "tokens_z2",
            {
                "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                "tokens": engine.global_tokens,
                "want_tokens": int(sum(float(data.mask[idx].sum()) for idx in batches)),
                "refused": refused,
            },
        )
    engine.close()


# --- gradient-noise scale ------------------------------------------------------------------------
NOISE_DIM, NOISE_SIGMA = 8, 1.0
NOISE_TRUTH = ((NOISE_DIM + 1) * 1.0 + NOISE_DIM * NOISE_SIGMA**2) / 1.0
"""B_noise = tr(Sigma) / |G|^2 of GaussianRegression at w = 0 (|G| = 1): (n + 1) |G|^2 + n sigma^2."""
NOISE_ESTIMATE = {
    "schedule": {
        "type": "gradient_noise",
        "start": 64,
        "warmup_steps": 10**6,
        "measure_every": 1,
        "ema_beta": 0.9,
    },
    "max_micro_batch_per_gpu": 8,
}
"""The "adabatch" section that measures the noise scale at batch 64 and never moves the batch."""


class GaussianRegression(torch.utils.data.Dataset):
    """x ~ N(0, I_n), y = x . w* + eps: per-sample gradient (x.d - eps) x for 0.5 (x.w - y)^2."""

    def __init__(self, n: int = 64 * 80, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.w_star = torch.ones(NOISE_DIM) / NOISE_DIM**0.5  # |d| = 1 from w = 0
        self.x = torch.randn(n, NOISE_DIM, generator=g)
        self.y = self.x @ self.w_star + NOISE_SIGMA * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def half_mse(model, batch):
    x, y = batch
    return 0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()


def phase_noise(out_dir: str, stages=(0, 2, 3)) -> None:
    truth = NOISE_TRUTH
    # The last case: ZeRO 2 under caller-owned accumulation measures what the hand-set boundary does.
    for stage, caller in [(stage, False) for stage in stages] + [(2, True)]:
        torch.manual_seed(0)
        model = torch.nn.Linear(NOISE_DIM, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        extra = {"adabatch": {**NOISE_ESTIMATE, "allow_uneven": False}, **(CALLER_OWNED if caller else {})}
        cfg = ds_config(stage, lr=0.0, extra=extra)
        engine, *_ = ds_adabatch.initialize(model, cfg, GaussianRegression(), loss_fn=half_mse)
        for _ in range(60):
            engine.train_batch()
        if engine.global_rank == 0:
            write(
                out_dir,
                f"noise_z{stage}{'_caller' if caller else ''}",
                {
                    "estimate": engine.noise.noise_scale,
                    "truth": truth,
                    "plan": engine.plan.describe(),
                },
            )
        engine.close()


# --- checkpoints ---------------------------------------------------------------------------------
CKPT_STEPS, CKPT_AT = 6, 3


def make_dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


CKPT_SCHEDULES = {
    "linear": {"type": "linear", "start": 4, "end": 16, "ramp_samples": 40},
    "callable": {"type": "callable", "function": "engine_worker:grow", "start": 2, "per": "device"},
    "plateau": {
        "type": "loss_plateau",
        "start": 4,
        "window": 2,
        "patience": 1,
        "cooldown": 0,
        "threshold": 10.0,
        "factor": 1.5,
        "ema_beta": 0.5,
        "hold_while_lr_rises": False,  # this case's WarmupLR rises throughout the 6 steps
    },
    "noise": {
        "type": "gradient_noise",
        "start": 8,
        "scale": 1.0,
        # The geometry this 6-step case was tuned in (with Adam, "auto" would measure in Adam's).
        "geometry": "sgd",
        "warmup_steps": 2,
        "measure_every": 1,
        "hysteresis": 0.0,
        # A 6-step run: the batch must move for the resume to test the schedule's state, so the
        # confidence test (which waits for far more measurements) is off.
        "max_relative_error": None,
    },
    "seesaw": {"type": "seesaw", "start": 4},
}
CKPT_CASES = [(stage, "linear") for stage in (0, 1, 2, 3)] + [
    (0, "callable"),
    (0, "plateau"),
    (0, "noise"),
    (0, "seesaw"),
]
# The seesaw case needs an LR that decays within the 6 steps: peak at scheduler iteration 2 (12
# samples), then linear decay, so the batch grows 4 -> 5 -> 8 after the checkpoint at step 3.
SEESAW_CKPT_SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 6, "warmup_type": "linear"},
}


def ckpt_config(stage: int, schedule: str) -> dict:
    cfg = _ckpt_config(stage, schedule)
    if schedule == "seesaw":
        cfg["scheduler"] = SEESAW_CKPT_SCHEDULER
    return cfg


def _ckpt_config(stage: int, schedule: str) -> dict:
    return ds_config(
        stage,
        extra={
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": 0.01,
                    "warmup_num_steps": 5,
                    "warmup_type": "linear",
                },
            },
            "adabatch": {
                "schedule": CKPT_SCHEDULES[schedule],
                "max_micro_batch_per_gpu": 4,
                "lr_scaling": {"rule": "sqrt"},
                "lr_schedule_unit": "samples",
                "min_global_batch": 2,
                "max_global_batch": 32,
            },
        },
    )


def ckpt_record(engine, loss) -> dict:
    return {
        "loss": float(loss),
        "indices": engine.last_step_batch.global_batch.all_indices(),
        "plan": [
            engine.plan.global_batch_size,
            engine.plan.micro_batch_per_gpu,
            engine.plan.gradient_accumulation_steps,
        ],
        "lr": engine.get_lr()[0],
    }


def phase_ckpt_save(out_dir: str) -> None:
    for stage, schedule in CKPT_CASES:
        name = f"ckpt_{schedule}_z{stage}"
        engine, *_ = ds_adabatch.initialize(
            make_dropout_model(), ckpt_config(stage, schedule), Regression(), loss_fn=mse_loss
        )
        steps = []
        for k in range(CKPT_STEPS):
            if k == CKPT_AT:
                engine.save_checkpoint(os.path.join(out_dir, name))
            steps.append(ckpt_record(engine, engine.train_batch()))
        if engine.global_rank == 0:
            write(
                out_dir,
                f"{name}_full",
                {
                    "steps": steps,
                    "world_size": engine.world_size,
                    "history": [e.to_dict() for e in engine.history],
                },
            )
        engine.close()


def phase_ckpt_resume(out_dir: str) -> None:
    cases = CKPT_CASES if dist.get_world_size() > 1 else [(0, "linear")]
    for stage, schedule in cases:
        name = f"ckpt_{schedule}_z{stage}"
        engine, *_ = ds_adabatch.initialize(
            make_dropout_model(), ckpt_config(stage, schedule), Regression(), loss_fn=mse_loss
        )
        engine.load_checkpoint(os.path.join(out_dir, name))
        start = engine.global_steps
        steps = []
        for _ in range(start, CKPT_STEPS):
            steps.append(ckpt_record(engine, engine.train_batch()))
        if engine.global_rank == 0:
            write(out_dir, f"{name}_resumed_w{engine.world_size}", {"start": start, "steps": steps})
        engine.close()


def phase_single(out_dir: str) -> None:
    """One rank: the exactness sequence (compared with 2 ranks), cross-world resume, the LR schedule."""
    run_sequence(0, False, out_dir, "single_z0_fp32")
    run_sequence(2, False, out_dir, "single_z2_fp32")
    phase_ckpt_resume(out_dir)
    resume_universal(out_dir)
    phase_lr(out_dir)


def resume_universal(out_dir: str) -> None:
    """A 2-rank ZeRO-2 checkpoint, converted to DeepSpeed's universal format, resumed on this world size."""
    import subprocess

    name = "ckpt_linear_z2"
    folder = os.path.join(out_dir, name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(folder, f"global_step{CKPT_AT}"),
            "--output_folder",
            os.path.join(folder, f"global_step{CKPT_AT}_universal"),
            "--inject_missing_state",
        ],
        check=True,
        capture_output=True,
    )
    cfg = ckpt_config(2, "linear")
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = ds_adabatch.initialize(make_dropout_model(), cfg, Regression(), loss_fn=mse_loss)
    engine.load_checkpoint(folder, tag=f"global_step{CKPT_AT}_universal")
    start = engine.global_steps
    steps = []
    for _ in range(start, CKPT_STEPS):
        steps.append(ckpt_record(engine, engine.train_batch()))
    write(out_dir, f"{name}_universal_w{engine.world_size}", {"start": start, "steps": steps})
    engine.close()


LR_RAMP = {"type": "linear", "start": 4, "end": 16, "ramp_samples": 48}


def phase_lr(out_dir: str) -> None:
    cfg = ds_config(
        0,
        extra={
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": 0.1,
                    "warmup_num_steps": 10,
                    "warmup_type": "linear",
                },
            },
            "adabatch": {
                "schedule": LR_RAMP,
                "max_micro_batch_per_gpu": 4,
                "allow_uneven": False,
                "lr_scaling": {"rule": "sqrt", "reference_batch": 4},
                "lr_schedule_unit": "samples",
            },
            # Per-step metrics must reach whatever monitor the ds_config enables.
            "csv_monitor": {
                "enabled": True,
                "output_path": os.path.join(out_dir, "monitor"),
                "job_name": "lr",
            },
        },
    )
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(n=200), loss_fn=mse_loss)
    rows = []
    for _ in range(10):
        samples_before = engine.global_samples
        engine.train_batch()
        m = engine.last_metrics
        rows.append(
            {
                "samples_before": samples_before,
                "batch": m.global_batch,
                "lr": m.lr,
                "multiplier": m.lr_multiplier,
                "samples_after": m.samples,
            }
        )
    write(out_dir, "lr_ramp", {"rows": rows})
    engine.close()


PHASES = {
    "exact": lambda d: (phase_exact(d), phase_tokens(d), phase_noise(d), phase_ckpt_save(d)),
    "resume": phase_ckpt_resume,
    "single": phase_single,
}


def main() -> None:
    phase, out_dir = sys.argv[1], sys.argv[2]
    ds_adabatch.init_distributed()
    PHASES[phase](out_dir)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

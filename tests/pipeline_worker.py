"""Pipeline and tensor parallelism on real gloo ranks, run under torchrun by tests/test_pipeline.py.

Usage: torchrun --nproc-per-node N tests/pipeline_worker.py LAYOUT[,LAYOUT...] OUT_DIR
LAYOUT: ``pipe2x1`` (2 stages x 1 data-parallel, 2 processes), ``pipe2x2`` (2 stages x 2 data-parallel,
4 processes), ``tensor2x2`` (2 tensor x 2 data-parallel with the data-parallel engine and an mpu, 4
processes), ``pipe_tensor`` (3D: 2 stages x 2 tensor ranks x 1 data-parallel, 4 processes). Each case writes OUT_DIR/<layout>_<case>.json (rank 0) with what every rank measured, so the
pytest side asserts with readable messages. One launch runs every case of its layouts, in the order given
(layouts of the same process count share a launch; the data-parallel engine's ``tensor2x2`` goes before
the pipelines, whose process groups DeepSpeed keeps in module state).
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm as dist  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402
from engine_worker import Regression  # noqa: E402
from tensor_model import TensorBlock, TensorGrid, TensorParallelMLP, mlp3, mlp_3d, tensor_loss  # noqa: E402

import ds_adabatch  # noqa: E402

N_SAMPLES = 96
# Requested global batches per data-parallel size (max micro 4, uneven allowed): the micro-batch grows
# and shrinks, GAS goes 1 -> 4 -> 3, a split is uneven, a rank (data-parallel 2) or rows of a micro-batch
# (data-parallel 1) are pads, and the last request is larger than what is left of the epoch.
SEQUENCES = {1: [4, 16, 12, 6, 13, 1, 3, 16, 16, 16], 2: [8, 32, 24, 6, 13, 1, 3, 16]}
LR = 0.1


def layers(seed: int = 0) -> list[torch.nn.Module]:
    """Five layers: DeepSpeed's universal checkpoint of a pipeline expects a first and a last layer
    around at least one middle layer per stage (Megatron's embedding / blocks / final norm)."""
    torch.manual_seed(seed)
    return [
        torch.nn.Linear(5, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    ]


def mean_mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the rows it is given (the pipeline's loss_fn contract)."""
    return ((outputs.float() - labels) ** 2).mean()


def per_sample_mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One loss per row."""
    return ((outputs.float() - labels) ** 2).flatten()


def ds_config(zero: int, bf16: bool, extra: dict | None = None) -> dict:
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.5}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**6,
        "adabatch": {
            "schedule": {"type": "constant", "value": 4},
            "max_micro_batch_per_gpu": 4,
            "allow_uneven": True,
            "data": {"shuffle": True, "seed": 3},
        },
    }
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def pipeline_module(dp: int, *, loss_fn=mean_mse, dynamic: bool = False, build=layers) -> PipelineModule:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=dp)
    return PipelineModule(
        layers=build(), topology=topo, loss_fn=loss_fn, partition_method="uniform", dynamic_shape=dynamic
    )


def local_params(engine) -> torch.Tensor:
    """This stage's parameters in fp32 (DeepSpeed's fp32 master copy where it keeps one)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = (
            safe_get_full_fp32_param(p)
            if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled()
            else None
        )
        out.append((full if full is not None else p.detach()).float().flatten())
    return torch.cat(out) if out else torch.zeros(0)


def reference_layers(
    batches, data, *, build=layers, token_mask=None, steps_per_batch=None
) -> torch.nn.Sequential:
    """Plain PyTorch, one process, fp64: each global batch as one big batch (sample or token mean)."""
    model = torch.nn.Sequential(*build()).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    losses = []
    for idx in batches:
        opt.zero_grad()
        if token_mask is None:
            x, y = data.x[idx].double(), data.y[idx].double()
            loss = ((model(x) - y) ** 2).mean()
        else:
            loss = token_mask(model, idx)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return model, losses


def stage_error(engine, ref: torch.nn.Sequential) -> float:
    """Largest error of this stage's parameters against the same layers of the reference, relative to
    the reference's largest parameter."""
    start, stop = engine.module._local_start, engine.module._local_stop
    want = [p.detach().flatten() for layer in list(ref)[start:stop] for p in layer.parameters()]
    if not want:
        return 0.0
    want_t = torch.cat(want)
    got = local_params(engine).double()
    scale = max(float(torch.cat([p.detach().flatten() for p in ref.parameters()]).abs().max()), 1e-12)
    return float((got - want_t).abs().max()) / scale


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write(out_dir: str, name: str, payload: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(payload, f)


def rank_info(engine) -> dict:
    return {
        "rank": dist.get_rank(),
        "stage": engine.stage_id if hasattr(engine.deepspeed, "stage_id") else 0,
        "dp_rank": engine.dataloader.rank,
    }


def run_plans(engine, sequence: list[int]) -> tuple[list, list, list, list]:
    """Each requested global batch for one step: the global batches' indices, the plans, the returned
    losses and this process's micro-batches' indices."""
    batches, plans, losses, mine = [], [], [], []
    for b in sequence:
        engine.set_global_batch_size(b)
        losses.append(float(engine.train_batch()))
        step = engine.last_step_batch
        plan = engine.plan
        batches.append(step.global_batch.all_indices())
        plans.append([plan.global_batch_size, plan.micro_batch_per_gpu, plan.gradient_accumulation_steps])
        mine.append([list(m.indices) for m in step.micro_batches])
    return batches, plans, losses, mine


def run_sequence(out_dir: str, name: str, dp: int, zero: int, bf16: bool, *, loss_fn=mean_mse) -> None:
    """The layout's sequence of batches; final parameters and per-step losses against the reference."""
    data = Regression(n=N_SAMPLES)
    engine, *_ = ds_adabatch.initialize(pipeline_module(dp, loss_fn=loss_fn), ds_config(zero, bf16), data)
    batches, plans, losses, mine = run_plans(engine, SEQUENCES[dp])
    ref, ref_losses = reference_layers(batches, data)
    # DeepSpeed's own eval_batch still works on the trained pipeline (the plain loss, no weights).
    rows, gas = engine.plan.micro_batch_per_gpu, engine.plan.gradient_accumulation_steps
    x, y = data.x[:rows], data.y[:rows]
    x_in = x.to(torch.bfloat16) if bf16 else x
    eval_loss = float(engine.eval_batch(iter([(x_in, y)] * gas)))
    record = {
        **rank_info(engine),
        "eval_loss": eval_loss,
        "ref_eval_loss": float(((ref(x.double()) - y.double()) ** 2).mean()),
        "err": stage_error(engine, ref),
        "losses": losses,
        "micro_indices": mine,
        "samples": engine.global_samples,
        "ds_samples": engine.deepspeed.global_samples,
        "oom_recovery": [engine.oom_recovery, engine.last_metrics.oom_recovery],
    }
    write(
        out_dir,
        name,
        {
            "ranks": gather(record),
            "batches": batches,
            "plans": plans,
            "ref_losses": ref_losses,
            "reasons": [e.reason for e in engine.history],
        },
    )
    engine.close()


# Tokens: sequences of 6 ids whose targets are masked (-100) at random positions; the loss is the mean
# over the micro-batch's target tokens, the update the mean over the global batch's.
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = N_SAMPLES, seed: int = 11):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 32, (n, 6), generator=g)
        self.targets = torch.randint(0, 8, (n, 6), generator=g)
        keep = torch.rand(n, 6, generator=g) < 0.6
        keep[:, 0] = True
        self.targets[~keep] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], self.targets[i]


class Pool(torch.nn.Module):
    """Embedding output [batch, 6, 8] -> the same through a linear layer (per-token logits stage)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, h):
        return self.proj(torch.tanh(h))


def token_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Embedding(32, 8), Pool()]


def token_ce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        outputs.float().flatten(0, 1), labels.flatten(), ignore_index=-100
    )


def run_tokens(out_dir: str, dp: int) -> None:
    """loss_normalization "token": the update is the mean over the global batch's target tokens."""
    data = Tokens()
    cfg = ds_config(0, False, {"adabatch": {"loss_normalization": "token"}})
    engine, *_ = ds_adabatch.initialize(pipeline_module(dp, loss_fn=token_ce, build=token_layers), cfg, data)
    batches, losses = [], []
    for b in SEQUENCES[dp][:6]:
        engine.set_global_batch_size(b)
        losses.append(float(engine.train_batch()))
        batches.append(engine.last_step_batch.global_batch.all_indices())

    def token_mean(model, idx):
        out = model(data.ids[idx])
        return torch.nn.functional.cross_entropy(
            out.flatten(0, 1), data.targets[idx].flatten(), ignore_index=-100
        )

    ref, ref_losses = reference_layers(batches, data, build=token_layers, token_mask=token_mean)
    want_tokens = int((data.targets[[i for b in batches for i in b]] != -100).sum())
    record = {**rank_info(engine), "err": stage_error(engine, ref), "losses": losses}
    write(
        out_dir,
        f"tokens_dp{dp}",
        {
            "ranks": gather(record),
            "ref_losses": ref_losses,
            "tokens": engine.global_tokens,
            "want_tokens": want_tokens,
        },
    )
    engine.close()


def run_token_budget(out_dir: str, dp: int) -> None:
    """micro_batch_tokens with dynamic_shape: passes of different rows and lengths, token-mean update."""
    data = VarTokens()
    cfg = ds_config(
        0,
        False,
        {
            "adabatch": {
                "schedule": {"type": "constant", "value": 96, "unit": "tokens"},
                "max_micro_batch_per_gpu": None,
                "micro_batch_tokens": 24,
                "loss_normalization": "token",
            }
        },
    )
    model = pipeline_module(dp, loss_fn=token_ce, build=token_layers, dynamic=True)
    engine, *_ = ds_adabatch.initialize(model, cfg, data, collate_fn=pad_collate, lengths=data.lengths)
    batches, losses, shapes = [], [], set()
    for _ in range(6):
        losses.append(float(engine.train_batch()))
        step = engine.last_step_batch
        batches.append(step.global_batch.indices.tolist())
        shapes |= {tuple(m.batch[0].shape) for m in step.micro_batches}

    def token_mean(model, idx):
        ids, targets = pad_collate([data[i] for i in idx])
        out = model(ids)
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=-100)

    ref, ref_losses = reference_layers(batches, data, build=token_layers, token_mask=token_mean)
    record = {**rank_info(engine), "err": stage_error(engine, ref), "losses": losses, "shapes": len(shapes)}
    write(
        out_dir,
        f"token_budget_dp{dp}",
        {"ranks": gather(record), "ref_losses": ref_losses, "batches": batches},
    )
    engine.close()


class VarTokens(torch.utils.data.Dataset):
    """Sequences of 2..8 ids (their own targets shifted, last one masked)."""

    def __init__(self, n: int = 64, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, 9, (n,), generator=g).tolist()
        self.seqs = [torch.randint(0, 32, (n_,), generator=g) for n_ in self.lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i]


def pad_collate(samples):
    ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    targets = torch.nn.utils.rnn.pad_sequence([s % 8 for s in samples], batch_first=True, padding_value=-100)
    return ids, targets


def run_checkpoint(out_dir: str, dp: int, zero: int) -> None:
    """A linear ramp: 6 steps with a save after 3; a fresh engine resumes the save (same launch)."""
    data = Regression(n=N_SAMPLES)
    extra = {
        "adabatch": {
            "schedule": {"type": "linear", "start": 4, "end": 24, "ramp_samples": 40},
            "lr_scaling": {"rule": "sqrt"},
            "lr_schedule_unit": "samples",
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 8, "warmup_type": "linear"},
        },
        # DeepSpeed's universal conversion reads Adam's moments (exp_avg, exp_avg_sq).
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    save = os.path.join(out_dir, f"ckpt_z{zero}")
    steps = []

    def run(engine, n):
        for _ in range(n):
            samples_before = engine.global_samples
            loss = float(engine.train_batch())
            steps.append(
                {
                    "samples_before": samples_before,
                    "multiplier": engine.last_metrics.lr_multiplier,
                    "loss": loss,
                    "plan": [engine.plan.global_batch_size, engine.plan.gradient_accumulation_steps],
                    "indices": engine.last_step_batch.global_batch.all_indices(),
                    "lr": engine.last_metrics.lr,
                }
            )

    engine, *_ = ds_adabatch.initialize(pipeline_module(dp), ds_config(zero, False, extra), data)
    if dp == 1:
        run(engine, 3)
        engine.save_checkpoint(save, tag="step3")
        run(engine, 3)
        full = list(steps)
        engine.close()
        steps.clear()
        engine, *_ = ds_adabatch.initialize(pipeline_module(dp), ds_config(zero, False, extra), data)
        engine.load_checkpoint(save)
        start = engine.global_steps
        run(engine, 3)
        write(out_dir, f"ckpt_z{zero}_dp1", {"full": full, "resumed": steps, "start": start})
    else:  # another data-parallel size resumes the 1-replica save (universal conversion for ZeRO 1)
        engine.load_checkpoint(save)
        start = engine.global_steps
        run(engine, 3)
        write(
            out_dir, f"ckpt_z{zero}_dp2", {"resumed": steps, "start": start, "world_size": engine.world_size}
        )
    engine.close()


def run_schedules(out_dir: str, dp: int) -> None:
    """Schedules that read the loss (loss_plateau) and a user's function (agreed) under pipelining."""
    data = Regression(n=N_SAMPLES)
    out = {}
    for name, schedule in (
        (
            "plateau",
            {
                "type": "loss_plateau",
                "start": 2 * dp,
                "window": 2,
                "patience": 1,
                "cooldown": 0,
                "threshold": 10.0,
            },
        ),
        ("callable", {"type": "callable", "function": "pipeline_worker:grow", "start": 2 * dp}),
    ):
        extra = {
            "adabatch": {
                "schedule": schedule,
                "log": {"jsonl": os.path.join(out_dir, f"{name}_dp{dp}.jsonl")},
            }
        }
        engine, *_ = ds_adabatch.initialize(pipeline_module(dp), ds_config(0, False, extra), data)
        plans = []
        for _ in range(6):
            engine.train_batch()
            plans.append(engine.plan.global_batch_size)
        engine.close()
        out[name] = gather(plans)
    write(out_dir, f"schedules_dp{dp}", out)


def grow(step: int, batch_size: int) -> int:
    return batch_size + 2 * (dist.get_rank() + 1)  # differs by rank: rank 0's answer must be applied


def run_refusals(out_dir: str) -> None:
    """What a pipeline run cannot do is refused with a sentence before DeepSpeed builds anything."""
    data = Regression(n=N_SAMPLES)
    cases = {
        "zero2": (ds_config(2, False), data),
        "gradient_noise": (
            ds_config(0, False, {"adabatch": {"schedule": {"type": "gradient_noise", "start": 4}}}),
            data,
        ),
        "auto_micro": (ds_config(0, False, {"adabatch": {"max_micro_batch_per_gpu": "auto"}}), data),
        "iterable": (ds_config(0, False), IterableRegression()),
    }
    messages = {}
    for name, (cfg, train) in cases.items():
        try:
            ds_adabatch.initialize(pipeline_module(1), cfg, train)
            messages[name] = None
        except (ValueError, TypeError) as err:
            messages[name] = f"{type(err).__name__}: {err}"
    write(out_dir, "refusals", messages)


class IterableRegression(torch.utils.data.IterableDataset):
    def __iter__(self):
        data = Regression(n=8)
        return iter(zip(data.x, data.y))


def run_tensor(out_dir: str, grid: TensorGrid, zero: int, bf16: bool) -> None:
    data = Regression(n=N_SAMPLES)
    model = TensorParallelMLP(grid)
    engine, *_ = ds_adabatch.initialize(model, ds_config(zero, bf16), data, loss_fn=tensor_loss, mpu=grid)
    batches, plans, losses, mine = run_plans(engine, SEQUENCES[grid.dp])
    ref, ref_losses = reference_layers(batches, data, build=mlp3)
    info = {"rank": dist.get_rank(), "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank}
    name = f"tensor2x2_z{zero}_{'bf16' if bf16 else 'fp32'}"
    write_slices(
        out_dir,
        name,
        engine,
        model.reference_slices(ref),
        ref,
        info,
        (batches, plans, losses, mine),
        ref_losses,
    )


def write_slices(out_dir, name, engine, want, ref, info, run, ref_losses) -> None:
    """This rank's parameters against its slices of the reference (``want``), with what ``run_plans``
    returned (``run``); closes the engine."""
    batches, plans, losses, mine = run
    got = local_params(engine).double()
    scale = float(torch.cat([p.detach().flatten() for p in ref.parameters()]).abs().max())
    record = {
        **info,
        "err": float((got - want).abs().max()) / scale,
        "losses": losses,
        "micro_indices": mine,
        "samples": engine.global_samples,
    }
    payload = {"ranks": gather(record), "batches": batches, "plans": plans, "ref_losses": ref_losses}
    write(out_dir, name, payload)
    engine.close()


def run_pipe_tensor(out_dir: str, zero: int, bf16: bool) -> None:
    """3D: each stage's block split over its 2 tensor ranks (the grid's slice group), 1 replica."""
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    coord = topo.get_coord(dist.get_rank())
    holder: dict = {}

    def group():
        return holder["module"].mpu().get_slice_parallel_group()

    blocks = [
        TensorBlock(0, 2, coord.model, group, pre_tanh=False),
        TensorBlock(4, 2, coord.model, group, pre_tanh=True),
    ]
    module = PipelineModule(layers=blocks, topology=topo, loss_fn=mean_mse, partition_method="uniform")
    holder["module"] = module
    data = Regression(n=N_SAMPLES)
    engine, *_ = ds_adabatch.initialize(module, ds_config(zero, bf16), data)
    batches, plans, losses, mine = run_plans(engine, SEQUENCES[1])
    ref, ref_losses = reference_layers(batches, data, build=mlp_3d)
    want = blocks[engine.stage_id].reference_slices(ref)
    info = {**rank_info(engine), "tp_rank": coord.model}
    name = f"pipe_tensor_z{zero}_{'bf16' if bf16 else 'fp32'}"
    write_slices(out_dir, name, engine, want, ref, info, (batches, plans, losses, mine), ref_losses)


class TensorTokenModel(torch.nn.Module):
    """Token ids -> fixed 5-wide features -> ``TensorParallelMLP``: one output per position."""

    def __init__(self, grid: TensorGrid, vocab: int):
        super().__init__()
        self.register_buffer("features", torch.randn(vocab, 5, generator=torch.Generator().manual_seed(3)))
        self.mlp = TensorParallelMLP(grid)

    def forward(self, ids):
        return self.mlp(self.features[ids]).squeeze(-1)


def _token_target(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((ids * 3 + 1) % vocab).float() / vocab


def _tensor_token_loss(engine, batch):
    """Mean squared error over the micro-batch's target positions (pads carry label -100)."""
    mask = (batch["labels"] != -100).float()
    sq = (engine(batch["input_ids"]) - batch["target"]) ** 2
    return (sq * mask).sum() / mask.sum()


def run_tensor_token_oom(out_dir: str, grid: TensorGrid) -> None:
    """Token-budget steps under tensor parallelism, the last process (tensor rank 1 of replica 1) fitting
    40 tokens per forward, under ``torchrun --max-restarts 1``. Every pass agrees when it begins (the
    model's all-reduce inside the forward is no agreement point), so the first incarnation's OOM is
    recorded and ends the launch's workers (exit 75, no hang); the second imposes the record, cuts every
    pass below 40 tokens and trains the same samples to the token-mean reference."""
    import token_worker as tw

    from ds_adabatch.testing import simulated_memory_limit

    data = tw.Sequences()

    def collate(samples):
        batch = tw.collate(samples)
        batch["target"] = _token_target(batch["input_ids"], tw.VOCAB)
        return batch

    engine, *_ = ds_adabatch.initialize(
        TensorTokenModel(grid, tw.VOCAB), tw.config(0, "token"), data, collate_fn=collate,
        loss_fn=_tensor_token_loss, token_count_fn=tw.count_tokens, lengths=data.lengths, mpu=grid,
    )  # fmt: skip
    engine.load_checkpoint(os.path.join(out_dir, "tensor_oom_ckpt"))  # none yet: records go there
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    steps, budgets, retries = [], [], []
    with simulated_memory_limit(max_tokens_per_forward=40, ranks=[dist.get_world_size() - 1]):
        for target in tw.TARGETS[:5]:
            engine.set_global_batch_size(target)
            try:
                engine.train_batch()
            except ds_adabatch.UnrecoverableOutOfMemory as exc:
                print(f"rank {dist.get_rank()} incarnation {restart}: {exc}", flush=True)
                ds_adabatch.finish(exc.exit_code)
            mode = engine.oom_recovery
            step = engine.last_step_batch.global_batch
            steps.append(step.indices.tolist())
            budgets.append(step.budget)
            retries.append(engine.last_metrics.extra["oom_retries"])
    ref = torch.nn.Sequential(*mlp3()).double()
    features = engine.module.features.double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.5)
    for idx in steps:
        opt.zero_grad()
        seqs = [data.seqs[i] for i in idx]
        sq = [((ref(features[s]).squeeze(-1) - _token_target(s, tw.VOCAB).double()) ** 2).sum() for s in seqs]
        (sum(sq) / sum(len(s) for s in seqs)).backward()
        opt.step()
    want = engine.module.mlp.reference_slices(ref)
    got = local_params(engine).double()
    record = {
        "rank": dist.get_rank(),
        "err": float((got - want).abs().max() / want.abs().max()),
        "steps": steps,
        "budgets": budgets,
        "oom_retries": retries,
        "limit": engine.micro_batch_limit,
        "oom_recovery": mode,
    }
    write(out_dir, "tensor2x2_token_oom", {"restart": restart, "ranks": gather(record)})
    engine.close()


def main() -> None:
    layouts, out_dir = sys.argv[1].split(","), sys.argv[2]
    ds_adabatch.init_distributed()
    for layout in layouts:
        run_layout(layout, out_dir)


def run_layout(layout: str, out_dir: str) -> None:
    if layout == "pipe2x1":
        for zero in (0, 1):
            for bf16 in (False, True):
                run_sequence(out_dir, f"pipe2x1_z{zero}_{'bf16' if bf16 else 'fp32'}", 1, zero, bf16)
        run_sequence(out_dir, "pipe2x1_per_sample", 1, 0, False, loss_fn=per_sample_mse)
        run_tokens(out_dir, 1)
        run_token_budget(out_dir, 1)
        for zero in (0, 1):
            run_checkpoint(out_dir, 1, zero)
        run_schedules(out_dir, 1)
        run_refusals(out_dir)
    elif layout == "pipe2x2":
        for zero, bf16 in ((0, False), (1, False), (0, True), (1, True)):
            run_sequence(out_dir, f"pipe2x2_z{zero}_{'bf16' if bf16 else 'fp32'}", 2, zero, bf16)
        run_tokens(out_dir, 2)
        for zero in (0, 1):
            run_checkpoint(out_dir, 2, zero)
    elif layout == "tensor2x2":
        grid = TensorGrid(2)
        for zero, bf16 in ((0, False), (1, False), (0, True), (1, True), (2, False), (3, False), (3, True)):
            run_tensor(out_dir, grid, zero, bf16)
    elif layout == "pipe_tensor":
        for zero, bf16 in ((0, False), (1, False), (1, True)):
            run_pipe_tensor(out_dir, zero, bf16)
    elif layout == "tensor2x2_oom":
        run_tensor_token_oom(out_dir, TensorGrid(2))
    else:
        raise SystemExit(f"unknown layout {layout!r}")


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

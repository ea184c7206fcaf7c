"""Out-of-memory recovery on real gloo ranks, run under torchrun by tests/test_oom.py (one launch).

Usage: torchrun --nproc-per-node N tests/oom_worker.py OUT_DIR [CASE,CASE...|all] [HF_STAGE,HF_STAGE...]
(HF_STAGE: also run tests/hf_oom_worker.py's Trainer cases for those ZeRO stages, after these.)
Faults come from ds_adabatch.testing.simulated_memory_limit. Every case writes what it measured into
OUT_DIR/<case>.json (rank 0); tests/test_oom.py asserts on it.
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm as dist  # noqa: E402
from engine_worker import Regression, ds_config, full_params, make_model, mse_loss, reference, write  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

STAGES = {
    "z0": (0, {}),
    "z1": (1, {}),
    "z2": (2, {}),
    "z3": (3, {}),
    "z2_offload": (2, None),
    # Buckets of 50 elements: gradients are reduced during backward (and a weight of 80 elements
    # goes alone); the agreement runs before the first of those reduces.
    "z2_buckets": (2, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 50}}),
    # 2 loader workers: the prefetched next step (cut for the old plan) is dropped after a re-plan.
    "z1_workers": (1, {"adabatch": {"data": {"shuffle": True, "seed": 3, "num_workers": 2}}}),
    # bf16: DeepSpeed's BF16_Optimizer (ZeRO-0) and the ZeRO-2 optimizer's fp32 accumulation.
    "z0_bf16": (0, {"bf16": {"enabled": True}}),
    "z2_bf16": (2, {"bf16": {"enabled": True}}),
    # bf16 with fp32 gradient accumulation at ZeRO-1: DeepSpeed's BF16_Optimizer, reducing like ZeRO-0.
    "z1_bf16": (1, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}),
    # DeepSpeed's caller-owned accumulation: ZeRO 0/1 reduce only inside step(), where the last pass
    # agrees first; ZeRO 3 reduces every pass as under the managed boundary.
    "z0_caller": (0, {"managed_gradient_accumulation": False}),
    "z1_caller": (1, {"managed_gradient_accumulation": False}),
    "z3_caller": (3, {"managed_gradient_accumulation": False}),
}
"""Case name -> (ZeRO stage, extra ds_config); None means ZeRO-2 with the optimizer offloaded to CPU."""


def _config(stage: int, extra: dict | None, adabatch: dict) -> dict:
    if extra is None:
        extra = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    cfg = ds_config(stage, extra=extra)
    cfg["adabatch"].update(adabatch)
    return cfg


def _ledger(engine) -> list[int]:
    """Sample indices every rank trained in the last step (the attempt that completed), gathered."""
    mine = [i for m in engine.last_step_batch.micro_batches for i in m.indices]
    gathered: list = [None] * engine.world_size
    dist.all_gather_object(gathered, mine)
    return [i for part in gathered for i in part]


def _finish(engine, name: str, out_dir: str, batches: list[list[int]], seen: list[int], extra: dict) -> None:
    got = full_params(engine)
    if engine.global_rank == 0:
        want = reference(batches, Regression(n=48 * engine.world_size))
        payload = {
            "max_rel_err": float((got - want).abs().max() / want.abs().max()),
            "seen": seen,
            "batches": batches,
            "global_steps": engine.global_steps,
            "ds_global_steps": engine.deepspeed.global_steps,
            "global_samples": engine.global_samples,
            "history": [e.to_dict() for e in engine.history],
            "world_size": engine.world_size,
        }
        payload.update(extra)
        write(out_dir, name, payload)
    engine.close()


def run_recover(name: str, stage: int, extra: dict | None, out_dir: str) -> None:
    """Integer max micro 4: OOMs in the middle of the first step's accumulation, twice in a row, on the
    last rank only; then a clean step; then a backward OOM on rank 0 at the next step's first pass."""
    world = dist.get_world_size()
    last = world - 1
    cfg = _config(
        stage, extra, {"schedule": {"type": "constant", "value": 16 * world}, "allow_uneven": False}
    )
    cfg["adabatch"]["memory"] = {"grow_after_steps": 1}
    # A constant LR (the reference uses 0.1) whose scheduler counts its steps.
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.1, "warmup_num_steps": 1},
    }
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(n=48 * world), loss_fn=mse_loss)
    batches, seen, plans, retries = [], [], [], []
    scheduler = engine.deepspeed.lr_scheduler
    lr_start = scheduler.last_batch_iteration
    # Rank `last`: forwards 3 and 4 fail (micro 4 x gas 4: two micro-batches were accumulated, then the
    # retry at micro 2 fails on its first pass too) -> micro 1 x gas 16. After one clean step the limit
    # grows back to 2, then to 4; in step 2 rank 0's budget of 1 sample fails backward at 4 and at 2.
    fwd = simulated_memory_limit(10**9, ranks=[last], fail_calls=[3, 4])
    with fwd:
        for step in range(3):
            bwd = simulated_memory_limit(1, ranks=[0], phase="backward") if step == 2 else None
            if bwd is not None:
                bwd.install()
            try:
                engine.train_batch()
            finally:
                if bwd is not None:
                    bwd.remove()
            batches.append(engine.last_step_batch.global_batch.all_indices())
            seen += _ledger(engine)
            plans.append([engine.plan.micro_batch_per_gpu, engine.plan.gradient_accumulation_steps])
            retries.append(engine.last_metrics.extra["oom_retries"])
    _finish(
        engine,
        name,
        out_dir,
        batches,
        seen,
        {
            "plans": plans,
            "lr_steps": scheduler.last_batch_iteration - lr_start,
            "oom_retries": retries,
            "agreements": engine.memory_recovery.agreement.agreements,
        },
    )


def run_auto(name: str, stage: int, extra: dict | None, out_dir: str, phase: str) -> None:
    """'auto' from 16 with a budget of 6 samples on the last rank: converge, then grow back after the
    budget rises to 16 mid-run."""
    world = dist.get_world_size()
    adabatch = {
        "schedule": {"type": "constant", "value": 16 * world},
        "max_micro_batch_per_gpu": "auto",
        "allow_uneven": True,
        "memory": {"micro_batch_ceiling": 16, "grow_after_steps": 2},
    }
    n = 22 * 16 * world  # one epoch of 22 steps
    cfg = _config(stage, extra, adabatch)
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(n=n), loss_fn=mse_loss)
    batches, seen, micro, limits = [], [], [], []
    budget = simulated_memory_limit(6, ranks=[world - 1], phase=phase)
    with budget:
        for step in range(22):
            if step == 8:
                budget.max_samples_per_forward = 16
            engine.train_batch()
            batches.append(engine.last_step_batch.global_batch.all_indices())
            seen += _ledger(engine)
            micro.append(engine.plan.micro_batch_per_gpu)
            limits.append(engine.micro_batch_limit)
    data = Regression(n=n)
    got = full_params(engine)
    if engine.global_rank == 0:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        for idx in batches:
            opt.zero_grad()
            ((model(data.x[idx]) - data.y[idx]) ** 2).mean().backward()
            opt.step()
        want = torch.cat([p.detach().flatten() for p in model.parameters()])
        write(
            out_dir,
            name,
            {
                "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                "seen": seen,
                "micro": micro,
                "limits": limits,
                "global_steps": engine.global_steps,
                "ds_global_steps": engine.deepspeed.global_steps,
                "history": [e.to_dict() for e in engine.history],
                "world_size": world,
            },
        )
    # The learned limits travel in checkpoints: a fresh engine resumes with them.
    ckpt = [os.path.join(out_dir, f"{name}_ckpt")]
    dist.broadcast_object_list(ckpt, src=0)
    engine.memory_recovery.memory.set_key(2048)
    engine.memory_recovery.memory.on_oom(16)  # a second shape key, learned as 8
    engine.save_checkpoint(ckpt[0])
    limits_saved = engine.memory_recovery.memory.limits()
    engine.close()
    fresh, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(n=n), loss_fn=mse_loss)
    fresh.load_checkpoint(ckpt[0])
    if fresh.global_rank == 0:
        write(
            out_dir,
            f"{name}_resumed",
            {"saved": repr(limits_saved), "loaded": repr(fresh.memory_recovery.memory.limits())},
        )
    fresh.close()


def run_unrecoverable(out_dir: str) -> None:
    """An OOM inside the optimizer step (after the pass agreed) ends with a clear error on that rank that
    says what to change, exit code 1 and no record (a smaller micro-batch would fail the same way)."""
    cfg = _config(1, {}, {"schedule": {"type": "constant", "value": 8}})
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(), loss_fn=mse_loss)
    folder = os.path.join(out_dir, "unrecoverable_ckpt")
    engine.load_checkpoint(folder)  # none there: the folder records would go to
    opt = engine.deepspeed.optimizer
    original = opt.step

    def failing_step(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated out of memory in the optimizer step")

    opt.step = failing_step
    message, exit_code = "", None
    try:
        with simulated_memory_limit(10**9):  # arms the agreement on the CPU; nothing exceeds it
            engine.train_batch()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        message = f"{type(exc).__name__}: {exc}"
        exit_code = getattr(exc, "exit_code", None)
    opt.step = original
    dist.barrier()
    if engine.global_rank == 0:
        records = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        write(out_dir, "unrecoverable_z1", {"message": message, "exit_code": exit_code, "records": records})
    engine.close()


def run_data_iter(out_dir: str) -> None:
    """train_batch(data_iter), ZeRO-2: the last rank's second forward fails (mid-accumulation); the
    retry re-splits this rank's own micro-batches into the new plan's accumulation steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _config(2, {}, {"schedule": {"type": "constant", "value": 8 * world}, "allow_uneven": False})
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, None, loss_fn=mse_loss)
    data = Regression()
    pos, batches, plans = 0, [], []
    with simulated_memory_limit(10**9, ranks=[world - 1], fail_calls=[2]):
        for _ in range(3):
            gas = engine.next_plan().gradient_accumulation_steps
            mine = list(range(pos + rank * 8, pos + rank * 8 + 8))  # 8 samples per rank, cut into GAS
            size = 8 // gas
            micro = [(data.x[mine[k : k + size]], data.y[mine[k : k + size]]) for k in range(0, 8, size)]
            engine.train_batch(iter(micro))
            batches.append(list(range(pos, pos + 8 * world)))
            plans.append([engine.plan.micro_batch_per_gpu, engine.plan.gradient_accumulation_steps])
            pos += 8 * world
    got = full_params(engine)
    if rank == 0:
        want = reference(batches, data)
        write(
            out_dir,
            "data_iter_z2",
            {
                "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                "plans": plans,
                "global_samples": engine.global_samples,
            },
        )
    engine.close()


def run_iterable(out_dir: str) -> None:
    """An IterableDataset (each rank its own stream), ZeRO-0: after an OOM mid-accumulation the retry
    re-splits the samples this rank already drew; nothing more is drawn."""
    from engine_worker import Stream, stream_loss

    world = dist.get_world_size()
    cfg = _config(0, {}, {"schedule": {"type": "constant", "value": 8 * world}, "allow_uneven": False})
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Stream(), loss_fn=stream_loss)
    seen, batches = [], []
    with simulated_memory_limit(10**9, ranks=[world - 1], fail_calls=[2]):
        for _ in range(3):
            engine.train_batch()
            mine = [int(i) for m in engine.last_step_batch.micro_batches if m.num_samples for i in m.batch[2]]
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            batches.append([i for part in gathered for i in part])
            seen.append(gathered)
    got = full_params(engine)
    if engine.global_rank == 0:
        want = reference(batches, Regression())
        write(
            out_dir,
            "iterable_z0",
            {"max_rel_err": float((got - want).abs().max() / want.abs().max()), "seen": seen},
        )
    engine.close()


def run_partitioned_z3(out_dir: str) -> None:
    """ZeRO-3 with every parameter partitioned: a forward OOM on the last rank, after the forward's
    first parameter gather, cannot be recovered. That rank raises UnrecoverableOutOfMemory and exits;
    the other, inside a later gather, gets a connection error from gloo: the launch ends, no hang."""
    world = dist.get_world_size()
    extra = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    cfg = _config(3, extra, {"schedule": {"type": "constant", "value": 8 * world}})
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(), loss_fn=mse_loss)
    # At the start of backward: the forward's parameter gathers (the pass's agreement point) have run.
    with simulated_memory_limit(1, ranks=[world - 1], phase="backward"):
        engine.train_batch()


TOKEN_STAGES = {"tokens_z0": 0, "tokens_z2": 2, "tokens_z3": 3}


def run_tokens(name: str, stage: int, out_dir: str) -> None:
    """Token-budget steps (budget 64 tokens per pass) with the last rank fitting 40 tokens per forward
    for the first 5 steps: each OOM re-cuts the same samples with a lower token budget; after the limit
    is lifted the budget grows back. Then one sample longer than the last rank's limit: a clear error."""
    import token_worker as tw

    world = dist.get_world_size()
    last = world - 1
    data = tw.Sequences()
    cfg = tw.config(stage, "token", memory={"grow_after_steps": 2})
    engine, *_ = ds_adabatch.initialize(
        tw.make_model(), cfg, data, collate_fn=tw.collate, loss_fn=tw.token_mean_loss,
        token_count_fn=tw.count_tokens, lengths=data.lengths,
    )  # fmt: skip
    costs: list[int] = []  # tokens of every forward that completed on this rank while limited
    hook = engine.module.register_forward_hook(lambda m, args, out: costs.append(int(args[0].numel())))
    steps, seen, budgets, retries = [], [], [], []
    limit = simulated_memory_limit(max_tokens_per_forward=40, ranks=[last]).install()
    for k, target in enumerate(tw.TARGETS + tw.TARGETS[:4]):
        if k == 5:
            limit.remove()  # the memory is back: the budget grows to 64 again
        engine.set_global_batch_size(target)
        engine.train_batch()
        step = engine.last_step_batch.global_batch
        steps.append(step.indices.tolist())
        seen += _ledger(engine)
        budgets.append(step.budget)
        retries.append(engine.last_metrics.extra["oom_retries"])
        if k == 4:
            limited_costs = list(costs)
    hook.remove()
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, limited_costs)
    limited_costs = per_rank[last]
    got = tw.params(engine)
    want = tw.reference(steps, data, "token")
    record = {
        "max_rel_err": float((got - want).abs().max() / want.abs().max()),
        "steps": steps,
        "seen": seen,
        "budgets": budgets,
        "oom_retries": retries,
        "limited_costs": limited_costs,
        "learned": engine.micro_batch_limit,
        "history": [e.to_dict() for e in engine.history],
        "global_samples": engine.global_samples,
        "global_tokens": engine.global_tokens,
        "lengths": data.lengths,
    }
    engine.close()
    # A sample of more tokens than the last rank can hold cannot be cut: every rank raises the same error.
    engine, *_ = ds_adabatch.initialize(
        tw.make_model(), cfg, data, collate_fn=tw.collate, loss_fn=tw.token_mean_loss,
        token_count_fn=tw.count_tokens, lengths=data.lengths,
    )  # fmt: skip
    with simulated_memory_limit(max_tokens_per_forward=max(data.lengths) - 1, ranks=[last]):
        try:
            for target in tw.TARGETS:
                engine.set_global_batch_size(target)
                engine.train_batch()
            record["message"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test asserts on its type and text
            record["message"] = f"{type(exc).__name__}: {exc}"
    gathered: list = [None] * world
    dist.all_gather_object(gathered, record["message"])
    record["messages"] = gathered
    engine.close()
    if dist.get_rank() == 0:
        write(out_dir, name, record)
    dist.barrier()


def main() -> None:
    out_dir = sys.argv[1]
    ds_adabatch.init_distributed()
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else None
    for name, (stage, extra) in STAGES.items():
        if cases is None or f"recover_{name}" in cases:
            run_recover(f"recover_{name}", stage, extra, out_dir)
    if cases is None or "auto_z2" in cases:
        run_auto("auto_z2", 2, {}, out_dir, "backward")
    if cases is None or "auto_z0" in cases:
        run_auto("auto_z0", 0, {}, out_dir, "forward")
    if cases is None or "unrecoverable_z1" in cases:
        run_unrecoverable(out_dir)
    if cases is None or "data_iter_z2" in cases:
        run_data_iter(out_dir)
    if cases is None or "iterable_z0" in cases:
        run_iterable(out_dir)
    for name, stage in TOKEN_STAGES.items():
        if cases is None or name in cases:
            run_tokens(name, stage, out_dir)
    if cases is not None and "partitioned_z3" in cases:  # ends the process group: its own launch
        run_partitioned_z3(out_dir)
    if len(sys.argv) > 3:  # then the Trainer's cases (tests/hf_oom_worker.py) in the same process group
        import hf_oom_worker

        hf_oom_worker.main([out_dir, sys.argv[3]])


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

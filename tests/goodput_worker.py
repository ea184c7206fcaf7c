"""The goodput schedule on real ranks with a simulated step-time curve, run by tests/test_goodput_engine.py.

Usage: torchrun --nproc-per-node N tests/goodput_worker.py OUT_DIR [resume]
On 2 ranks: a flat curve (host-bound: a larger batch costs nothing more) through ``train_batch``, with a
fixed warm-up and with the default one, the host's own clock with one rank pausing, and an affine one (compute-bound) through DeepSpeed's forward /
backward / step loop. On 1 rank: micro = batch
(one pass per step), where the noise scale is measured by splitting a step in two, and AdaScale's gain as
the LR multiplier (``lr_scaling.rule`` "adascale") through the loop; with ``resume``, the
2-rank flat run's step-20 checkpoint continued on one rank. And token budgets (``micro_batch_tokens``,
tests/token_worker.py's variable-length sequences, ZeRO 0: its checkpoint loads on any world size): a flat curve on 2 ranks through
``train_batch``, its step-12 checkpoint continued on one rank by the ``resume`` launch. Each case writes its
batches, the samples of every step, the noise estimate and the exactness error into OUT_DIR/<case>.json
(rank 0); the curve comes in through DS_ADABATCH_SIMULATED_STEP_TIME, read when the engine is built.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import ds_adabatch  # noqa: E402
from ds_adabatch.runtime.core.step_times import SIMULATED_STEP_TIME_ENV  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import token_worker  # noqa: E402
from engine_worker import NOISE_DIM, GaussianRegression, full_params, half_mse  # noqa: E402

LR = 0.02
FLAT = "fixed=0.05"
AFFINE = "fixed=0.02,per_sample=0.002"


def config(
    stage: int,
    *,
    max_micro: int,
    start: int,
    max_batch: int,
    lr: float,
    jsonl: str,
    schedule: dict | None = None,
    lr_scaling: dict | None = None,
) -> dict:
    return {
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "adabatch": {
            "schedule": {
                "type": "goodput",
                "start": start,
                "decide_every": 4,
                "warmup_steps": 8,
                "ema_beta": 0.8,
                "max_relative_error": None,
                "geometry": "sgd",
                **(schedule or {}),
            },
            "max_micro_batch_per_gpu": max_micro,
            "max_global_batch": max_batch,
            "log": {"every_steps": 3, "jsonl": jsonl},
            "lr_scaling": lr_scaling or {"rule": "none"},
            "data": {"shuffle": True, "seed": 3},
        },
    }


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(NOISE_DIM, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def reference(
    batches: list[list[int]], data: GaussianRegression, lr: float, multipliers: list[float] | None = None
) -> torch.Tensor:
    """Plain PyTorch, one process: the same global batches, each one big batch (at ``lr`` times each
    step's LR multiplier, where given)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i, idx in enumerate(batches):
        if multipliers is not None:
            opt.param_groups[0]["lr"] = lr * multipliers[i]
        opt.zero_grad()
        half_mse(model, (data.x[idx], data.y[idx])).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def record(engine, batches: list, plans: list, noise: list, multipliers: list) -> None:
    plan = engine.plan
    batches.append(engine.last_step_batch.global_batch.all_indices())
    plans.append([plan.global_batch_size, plan.micro_batch_per_gpu, plan.gradient_accumulation_steps])
    noise.append(engine.noise.noise_scale)
    multipliers.append(engine.lr_coupling.multiplier)  # the step's: the next decision applies the next


def run_case(
    out_dir: str,
    name: str,
    curve: str,
    steps: int,
    *,
    loop: bool,
    lr: float = LR,
    save_at: int | None = None,
    resume_from: str | None = None,
    schedule: dict | None = None,
    lr_scaling: dict | None = None,
    pause_at: int | None = None,
    **shape: int,
) -> None:
    os.environ[SIMULATED_STEP_TIME_ENV] = curve  # "": the host's clock
    data = GaussianRegression()
    jsonl = os.path.join(out_dir, f"{name}.jsonl")
    cfg = config(0, lr=lr, jsonl=jsonl, schedule=schedule, lr_scaling=lr_scaling, **shape)
    engine, _, loader, _ = ds_adabatch.initialize(make_model(), cfg, data, loss_fn=half_mse)
    batches, plans, noise, multipliers = [], [], [], []
    resumed = None
    if resume_from is not None:  # the schedule's model and the stream continue (on any world size)
        engine.load_checkpoint(resume_from)
        schedule = engine.controller.schedule
        resumed = {
            "step": engine.global_steps,
            "batch": engine.plan.global_batch_size,
            "moves": schedule.moves,
            "predicts": schedule.throughput.predict(8, 1, engine.world_size),
        }
    losses: list = []  # train_batch's, resolved at the end
    seen: list = []  # the noise estimate each step's decision read (what "adascale" is given)
    if loop:
        fresh = True
        for x, y in loader:  # DeepSpeed's loop: the step counts when its last micro-batch steps
            if fresh:  # the step's first micro-batch: its plan is decided
                engine.next_plan()
                seen.append(engine.noise.noise_scale_or_inf)
                fresh = False
            before = engine.global_steps
            engine.backward(half_mse(engine, (x, y)))
            engine.step()
            if engine.global_steps > before:
                record(engine, batches, plans, noise, multipliers)
                fresh = True
                if engine.global_steps == save_at:
                    engine.save_checkpoint(os.path.join(out_dir, f"{name}_ckpt"))
            if engine.global_steps >= steps:
                break
    else:
        while engine.global_steps < steps:
            if engine.global_steps == pause_at and engine.global_rank == 1:
                time.sleep(0.5)  # rank 1 alone pauses (an evaluation): every rank's model hears of it
            engine.next_plan()
            seen.append(engine.noise.noise_scale_or_inf)
            losses.append(engine.train_batch())
            record(engine, batches, plans, noise, multipliers)
            if engine.global_steps == save_at:
                engine.save_checkpoint(os.path.join(out_dir, f"{name}_ckpt"))
    engine.resolve_losses()
    got = full_params(engine)
    schedule = engine.controller.schedule
    fit = schedule.throughput.fit(engine.world_size)
    if pause_at is not None:  # each rank's model, and the pauses each rank saw and each model heard of
        state = schedule.throughput.state_dict()
        mine = {"state": state, "rank_pauses": engine._step_times.pauses}
        mine.update(model_pauses=schedule.throughput.pauses, settled_out=schedule.throughput.settled_out)
        with open(os.path.join(out_dir, f"{name}_rank{engine.global_rank}.json"), "w") as f:
            json.dump(mine, f)
    if engine.global_rank == 0:
        before: list[list[int]] = []
        before_multipliers: list[float] = []
        if resume_from is not None:  # the saving run's steps up to the checkpoint, then these
            source = os.path.basename(resume_from).removesuffix("_ckpt")  # the saving case
            with open(os.path.join(out_dir, f"{source}.json")) as f:
                saved = json.load(f)
            before = saved["batches"][: resumed["step"]]
            before_multipliers = saved["multipliers"][: resumed["step"]]
        scaled = None if lr_scaling is None else before_multipliers + multipliers
        want = reference(before + batches, data, lr, scaled)
        payload = {
            "max_rel_err": float((got - want).abs().max() / want.abs().max()),
            "batches": batches,
            "plans": plans,
            "noise": noise,
            "multipliers": multipliers,
            "seen": seen[: len(batches)],
            "fit": None if fit is None else [fit.fixed, fit.per_pass, fit.per_sample],
            "history": [e.to_dict() for e in engine.history],
            "world_size": engine.world_size,
            "moves": schedule.moves,
            # The shapes fitted, and those of the noise-measuring split steps, kept apart from them.
            "shapes": [[m, g] for m, g, _, _ in schedule.throughput.measured(engine.world_size)],
            "measuring": [[m, g] for m, g, _, _ in schedule.throughput.state_dict()["measuring"]],
            "curve": curve,
            "spread": schedule.throughput.log_spread(),
            "resumed": resumed,
            "losses": [float(loss) for loss in losses],
            "params": got.tolist(),
        }
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(payload, f)
    engine.close()
    del os.environ[SIMULATED_STEP_TIME_ENV]


TOKEN_STEPS, TOKEN_SAVE_AT = 32, 12


def token_config(jsonl: str, budget: int) -> dict:
    """Goodput over token-budget steps (token_worker's SGD and token mean), the default warm-up."""
    cfg = token_worker.config(0, "token", max_global_batch=48, log={"every_steps": 1, "jsonl": jsonl})
    cfg["adabatch"]["micro_batch_tokens"] = budget
    cfg["adabatch"]["schedule"] = {
        "type": "goodput",
        "start": 4,
        "decide_every": 4,
        "max_relative_error": None,
        "geometry": "sgd",
    }
    return cfg


def run_token_case(
    out_dir: str, name: str, *, resume: bool = False, budget: int = token_worker.BUDGET
) -> None:
    """Token budgets and a flat curve: "tokens" on 2 ranks to step TOKEN_SAVE_AT (checkpoint) and on to
    TOKEN_STEPS; with ``resume``, on 1 rank from that checkpoint to TOKEN_STEPS; "tokens_single" on 1
    rank with a budget that holds a whole first step in one pass (measured as two half passes)."""
    os.environ[SIMULATED_STEP_TIME_ENV] = FLAT
    data = token_worker.Sequences()
    engine, *_ = ds_adabatch.initialize(
        token_worker.make_model(), token_config(os.path.join(out_dir, f"{name}.jsonl"), budget), data,
        collate_fn=token_worker.collate, loss_fn=token_worker.token_mean_loss,
        token_count_fn=token_worker.count_tokens, lengths=data.lengths,
    )  # fmt: skip
    if resume:
        engine.load_checkpoint(os.path.join(out_dir, "tokens_ckpt"))
    start_step = engine.global_steps
    steps, epochs, passes = [], [], []
    while engine.global_steps < TOKEN_STEPS:
        engine.train_batch()
        step = engine.last_step_batch.global_batch
        steps.append(step.indices.tolist())
        epochs.append(step.epoch)
        passes.append(step.passes)
        if name == "tokens" and engine.global_steps == TOKEN_SAVE_AT:
            engine.save_checkpoint(os.path.join(out_dir, "tokens_ckpt"))
    engine.resolve_losses()
    got = token_worker.params(engine)
    schedule = engine.controller.schedule
    if engine.global_rank == 0:
        before: list[list[int]] = []
        if resume:  # the 2-rank run's steps up to its checkpoint, then these
            with open(os.path.join(out_dir, "tokens.json")) as f:
                before = json.load(f)["steps"][:start_step]
        want = token_worker.reference(before + steps, data, "token")
        payload = {
            "max_rel_err": float((got - want).abs().max() / want.abs().max()),
            "start_step": start_step,
            "steps": steps,
            "epochs": epochs,
            "passes": passes,
            "history": [e.to_dict() for e in engine.history],
            "shapes": [[m, g, n] for m, g, _, n in schedule.throughput.measured(engine.world_size)],
            "world_size": engine.world_size,
            "n": len(data),
            "noise": engine.noise.noise_scale,
            "measuring": [[m, g] for m, g, _, _ in schedule.throughput.state_dict()["measuring"]],
        }
        if name == "tokens":  # what `ds-adabatch simulate --lengths` says this run does, step by step
            payload["simulated"] = simulated_token_steps(budget, data.lengths, sum(len(s) for s in steps))
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(payload, f)
    engine.close()
    del os.environ[SIMULATED_STEP_TIME_ENV]


def simulated_token_steps(budget: int, lengths: list[int], samples: int) -> list[list[int]]:
    """``[samples, passes per rank]`` of every step ``simulate`` forms for the "tokens" case's config on 2
    ranks over the same lengths and curve (the noise scale is given: the warm-up's decisions on step
    cost do not read it)."""
    from ds_adabatch.config import load_ds_config
    from ds_adabatch.data.simulated_steps import PackedSteps
    from ds_adabatch.schedules import simulate

    cfg = token_config("unused.jsonl", budget)
    cfg["adabatch"]["log"]["jsonl"] = None
    loaded = load_ds_config(cfg, world_size=2)
    rows = simulate(
        loaded, world_size=2, samples=samples, out_png=None, steps=PackedSteps(loaded, lengths),
        step_time=FLAT, noise_scale=100.0,
    )  # fmt: skip
    taken = [b["samples"] - a["samples"] for a, b in zip(rows, rows[1:])]
    return [[n, row["gradient_accumulation_steps"]] for n, row in zip(taken, rows)]


def main() -> None:
    out_dir = sys.argv[1]
    ds_adabatch.init_distributed()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and len(sys.argv) > 2 and sys.argv[2] == "resume":
        # The 2-rank flat run's step-20 checkpoint, resumed on one rank (micro 8: GAS doubles).
        ckpt = os.path.join(out_dir, "flat_ckpt")
        run_case(
            out_dir, "resumed", FLAT, 48, loop=False, resume_from=ckpt, max_micro=8, start=8, max_batch=64
        )
        run_token_case(out_dir, "tokens_resumed", resume=True)
        return
    if world == 1:  # micro = batch: one pass per step
        single = {"max_micro": 64, "start": 8, "max_batch": 64}
        run_case(out_dir, "single_flat", FLAT, 48, loop=False, save_at=13, **single)
        # Its step-13 checkpoint resumed on the same world: the steps split to measure the noise (a
        # cadence the checkpoint keeps), the estimate and the decisions continue as they were.
        ckpt = os.path.join(out_dir, "single_flat_ckpt")
        run_case(out_dir, "single_resumed", FLAT, 48, loop=False, resume_from=ckpt, **single)
        # AdaScale's gain as the LR (SGD: the gain itself), through DeepSpeed's forward / backward / step
        # loop, micro 4 (GAS measures the noise).
        adascale = {
            "max_micro": 4,
            "start": 8,
            "max_batch": 64,
            "lr_scaling": {"rule": "adascale", "gain_power": 1.0},
        }
        run_case(out_dir, "single_adascale", FLAT, 40, loop=True, save_at=13, **adascale)
        # Its step-13 checkpoint (a trial of 32 under way) resumed through the loop (GAS above 1) on the same world.
        ckpt = os.path.join(out_dir, "single_adascale_ckpt")
        run_case(out_dir, "single_adascale_resumed", FLAT, 40, loop=True, resume_from=ckpt, **adascale)
        run_token_case(out_dir, "tokens_single", budget=256)
        return
    run_case(out_dir, "flat", FLAT, 48, loop=False, save_at=20, max_micro=8, start=8, max_batch=64)
    # The default warm-up (20 steps at ema_beta 0.95): a free larger batch is taken on its cost alone.
    default_warmup = {"warmup_steps": None, "ema_beta": 0.95}
    # Then the same with the flat cost's step times scattered (jitter: what the schedule measures, not a
    # cost).
    for name, curve in (("flat_warmup", FLAT), ("flat_jitter", FLAT + ",jitter=0.25")):
        run_case(
            out_dir, name, curve, 24, loop=False, max_micro=8, start=8, max_batch=64, schedule=default_warmup
        )
    # The host's clock (no simulated curve), rank 1 pausing before step 10.
    run_case(out_dir, "paused", "", 16, loop=False, max_micro=8, start=8, max_batch=64, pause_at=10)
    # A small LR keeps the noise scale near its value at w = 0 (17), which the affine cost's peak follows.
    run_case(out_dir, "affine", AFFINE, 48, loop=True, lr=0.002, max_micro=8, start=8, max_batch=64)
    run_token_case(out_dir, "tokens")


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

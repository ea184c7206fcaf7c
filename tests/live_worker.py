"""A live-elastic job for tests/test_live_elastic.py and benchmarks/live_recovery.py.

    python -m torch.distributed.run --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d ... \\
        live_worker.py run OUT STAGE           # one node's worker
    python live_worker.py reference OUT STAGE  # the same job on one process (the exact reference)
    python live_worker.py replay OUT STAGE     # the batches OUT/ledger.jsonl trained, on one process
    torchrun --nproc-per-node 2 live_worker.py checks OUT 0   # what is covered / refused (one node)

The job: a small regression MLP, Adam with a warm-up LR schedule, a global batch ramping 6 -> 24 in
multiples of 6 (the same batches on 1, 2 or 3 ranks), ZeRO ``STAGE``, until SAMPLES samples. Rank 0
appends every step to OUT/ledger.jsonl (sample indices, loss, world size, pid); every process writes
OUT/start-<pid>.json when it starts and OUT/end-<pid>.json (its live recoveries) when it ends; rank 0
saves the final parameters to OUT/final.pt.

``LIVE_KILL=ORIGIN:STEP[:DELAY_MS]`` makes the process of first-world rank ORIGIN kill its node (its
torchrun agent, then itself, SIGKILL) DELAY_MS into step STEP of the first incarnation that trains, writing the time
to OUT/kill-time. ``LIVE_KILL_ALSO=ORIGIN[,ORIGIN]`` kills those ranks (and their agents) at the same
moment (both buddies; a node's second rank). ``LIVE_KILL_SIGNAL=STOP`` stops them instead (a hung node:
its sockets stay open). ``LIVE_KILL_WHAT=worker`` kills the worker alone (a crash on a healthy node:
torchrun restarts the workers). ``LIVE_UNEVEN=1`` lets a global batch split unevenly (4 ranks);
``LIVE_BF16=1`` trains in bf16.
``LIVE_SCHEDULE=goodput`` trains the ``goodput`` schedule (up to 48 samples) on the step-time curve of
``DS_ADABATCH_SIMULATED_STEP_TIME``; every process's end record then holds its throughput model.
``LIVE_WAIT_FOR=STEP:WORLD`` holds rank 0 before step STEP while the world is smaller than WORLD (until
torchrun restarts the workers for a node that rejoins).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ds_adabatch  # noqa: E402
from runners.train_lm import ledger_line  # noqa: E402

N = 480
SAMPLES = int(os.environ.get("LIVE_SAMPLES", "360"))
HIDDEN = int(os.environ.get("LIVE_HIDDEN", "32"))


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = N, dim: int = 8, seed: int = 11):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.sin(self.x[:, :2].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def mse(engine, batch):
    x, y = batch
    if os.environ.get("LIVE_BF16") == "1":
        x = x.to(torch.bfloat16)  # the model's dtype under bf16; the loss in fp32
    return ((engine(x).float() - y) ** 2).mean()


def config(stage: int, live: bool = True, persist: bool = False) -> dict:
    fixed = os.environ.get("LIVE_FIXED")  # a constant global batch (benchmarks/live_recovery.py)
    schedule = (
        {"type": "constant", "value": int(fixed)}
        if fixed
        else {"type": "linear", "start": 6, "end": 24, "ramp_samples": 120}
    )
    goodput = os.environ.get("LIVE_SCHEDULE") == "goodput"
    if goodput:  # its step times from DS_ADABATCH_SIMULATED_STEP_TIME (the job's environment)
        schedule = {"type": "goodput", "start": 6, "decide_every": 4}
    return {
        # LIVE_TORCH_ADAM=1: torch's Adam (on a GPU, no FusedAdam build: tests/gpu_live_check.py).
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.01, **({"torch_adam": True} if os.environ.get("LIVE_TORCH_ADAM") else {})},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 0.01,
                "warmup_num_steps": 6,
                "warmup_type": "linear",
            },
        },
        "gradient_clipping": 0.0,
        "bf16": {"enabled": os.environ.get("LIVE_BF16") == "1"},
        # ZeRO 3: every parameter partitioned (none kept whole for being small), gathered in each pass;
        # ``persist``: DeepSpeed's default, under which this model's small parameters stay whole.
        "zero_optimization": {
            "stage": stage,
            **({"stage3_param_persistence_threshold": 0} if stage == 3 and not persist else {}),
        },
        "steps_per_print": 10**6,
        "adabatch": {
            "schedule": schedule,
            "granularity": 6,
            "max_micro_batch_per_gpu": 4,
            **({"max_global_batch": 48} if goodput else {}),
            "lr_schedule_unit": "samples",
            "allow_uneven": os.environ.get("LIVE_UNEVEN") == "1",
            "data": {"shuffle": True, "seed": 5},
            "live_elastic": {
                "enabled": live,
                # Every step: a loss redoes at most the step in flight (benchmarks also try "auto").
                "snapshot_every": _every(os.environ.get("LIVE_SNAPSHOT_EVERY", "1")),
                # The default: DeepSpeed's initialize runs its collectives under it too, and on 2 loaded
                # cores a rank reached them more than 20 s after the others (lost and hung nodes are
                # found in seconds all the same: reset connections, the heartbeat watchdog).
                "collective_timeout_s": 60.0,
                # Generous on a shared 2-core machine: a starved heartbeat must not look like a loss.
                "heartbeat_period_s": float(os.environ.get("LIVE_HEARTBEAT", "0.2")),
                "dead_after_s": float(os.environ.get("LIVE_DEAD_AFTER", "2.0")),
            },
        },
    }


def _every(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _write(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _kill_plan(out: str, origin: int) -> tuple[int, float] | None:
    spec = os.environ.get("LIVE_KILL")
    # Only the incarnation that trains first kills (workers that torchrun restarts run this again and
    # find its kill-time). Not "restart count 0": torchrun may restart the workers before any step, when
    # the port its agent chose for their store was taken meanwhile (EADDRINUSE in rank 0's store), and
    # the job must still lose its node.
    if not spec or os.path.exists(os.path.join(out, "kill-time")):
        return None
    parts = spec.split(":")
    if int(parts[0]) != origin and str(origin) not in os.environ.get("LIVE_KILL_ALSO", "").split(","):
        return None
    return int(parts[1]), float(parts[2]) / 1000 if len(parts) > 2 else 0.0


def _folder_bytes(folder: str) -> int:
    """Bytes of the snapshot files in ``folder`` (0 without one). The other ranks' snapshots may be
    replaced while this counts (a restarted worker drops its earlier generation's files): a file that
    went away is not counted."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            if entry.name.endswith(".bin"):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
    return total


def run(out: str, stage: int) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ds_adabatch.init_distributed()
    origin = torch.distributed.get_rank()
    pid = os.getpid()
    _write(
        os.path.join(out, f"start-{pid}.json"),
        {"pid": pid, "origin": origin, "restart": restart, "time": time.time()},
    )
    live = os.environ.get("LIVE_LIVE", "1") == "1"
    engine, optimizer, loader, scheduler = ds_adabatch.initialize(
        make_model(), config(stage, live), Regression(), loss_fn=mse
    )
    ckpt = os.path.join(out, "ckpt")
    path, _ = engine.load_checkpoint(ckpt)
    first_step = engine.global_steps
    kill = _kill_plan(out, origin)
    agent = os.getppid()
    save_every = int(os.environ.get("LIVE_SAVE_EVERY", "4"))  # 0: never (the snapshot benchmarks)
    wait_for = os.environ.get("LIVE_WAIT_FOR", "")
    ledger = os.path.join(out, "ledger.jsonl")
    while engine.global_samples < SAMPLES:
        step = engine.global_steps + 1
        if kill is not None and step == kill[0]:
            threading.Timer(kill[1], _kill_node, args=(out, agent)).start()
            kill = None
        if wait_for and engine.rank == 0:
            at, world = (int(x) for x in wait_for.split(":"))
            while step == at and engine.world_size < world:
                time.sleep(0.05)  # until torchrun restarts this worker for the node that rejoins
        try:
            loss = float(engine.train_batch())
        except ds_adabatch.LiveRecoveryFailed as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            ds_adabatch.finish(exc.exit_code)
        if save_every and engine.global_steps % save_every == 0:
            engine.save_checkpoint(ckpt, keep_last=2)
        if engine.rank == 0:
            # The main job's ledger line, and which process wrote it.
            row = {**ledger_line(engine, loss), "pid": pid, "live_events": len(engine.live_events)}
            # The script keeps using the four objects initialize returned, across a shrink too.
            row["handles_ok"] = (
                optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
                and loader.state_dict()["sampler"]["samples_consumed"] == engine.global_samples
            )
            with open(ledger, "a") as f:
                f.write(json.dumps(row) + "\n")
    events = engine.live_events
    shm = os.environ.get("DS_ADABATCH_SNAPSHOT_DIR", "")
    snapshot_bytes = _folder_bytes(os.path.join(shm, os.environ.get("TORCHELASTIC_RUN_ID", ""))) if shm else 0
    final = whole_parameters(engine)  # every rank: a collective under ZeRO 3
    if engine.rank == 0:
        torch.save(final, os.path.join(out, "final.pt"))
    _write(
        os.path.join(out, f"end-{pid}.json"),
        {
            "pid": pid,
            "origin": origin,
            "rank": engine.rank,
            "restart": restart,
            "world_size": engine.world_size,
            "live_elastic": engine.live_elastic,
            "events": events,
            "resumed_from": path,
            "first_step": first_step,
            "snapshot_bytes": snapshot_bytes,
            "snapshot_every": engine.live_snapshot_every,
            "history": [h.reason for h in engine.history],
            **_goodput_state(engine),
        },
    )
    engine.close()


def _goodput_state(engine) -> dict:
    """The goodput schedule's moves and throughput model (every rank's must be the same), if it runs."""
    schedule = engine.controller.schedule
    if getattr(schedule, "name", None) != "goodput":
        return {}
    model = schedule.throughput
    measured = {w: [[m, g, n] for m, g, _, n in model.measured(w)] for w in (1, 2, 3)}
    return {"goodput": {"moves": schedule.moves, "measured": measured, "state": model.state_dict()}}


def replayed(ledger: str) -> dict:
    """A schedule that trains the batches a live job trained (the last record of each step in its
    ledger), by samples: the exact reference of a job whose batches follow its world and its clock."""
    last: dict[int, dict] = {}
    with open(ledger) as f:
        for line in f:
            row = json.loads(line)
            last[row["step"]] = row
    points = [[last[s]["samples"] - len(last[s]["indices"]), len(last[s]["indices"])] for s in sorted(last)]
    return {"type": "piecewise", "unit": "samples", "points": points}


def whole_parameters(engine) -> dict:
    """The model's parameters, whole (gathered from every rank's partition under ZeRO 3)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def checks(out: str) -> None:
    """Under ``torchrun --nproc-per-node 2`` (one node): what live elasticity covers and refuses, and
    what its snapshots leave in host memory."""
    ds_adabatch.init_distributed()
    result = {}
    for name, stage, kwargs in (
        ("zero3", 3, {}),
        ("optimizer_instance", 1, {"optimizer": "instance"}),
        ("zero1", 1, {}),
    ):
        cfg = config(stage)
        model = make_model()
        extra = {}
        if kwargs.get("optimizer") == "instance":
            cfg.pop("optimizer")
            cfg.pop("scheduler")
            extra["optimizer"] = torch.optim.Adam(model.parameters(), lr=0.01)
        engine, *_ = ds_adabatch.initialize(
            model=model, config=cfg, training_data=Regression(), loss_fn=mse, **extra
        )
        for _ in range(2):
            engine.train_batch()
        torch.distributed.barrier()  # every rank's last snapshot is written
        folder = os.path.join(os.environ["DS_ADABATCH_SNAPSHOT_DIR"], os.environ["TORCHELASTIC_RUN_ID"])
        files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        torch.distributed.barrier()  # every rank has listed them
        engine.close()
        torch.distributed.barrier()  # every rank has deleted its own files
        result[name] = {
            "live_elastic": engine.live_elastic,
            "snapshot_every": engine.live_snapshot_every,
            "files": files,
            "files_after_close": sorted(os.listdir(folder)) if os.path.isdir(folder) else [],
        }
    result["late"] = _late_rank()
    result["reform"] = _transient_fault(1)
    result["reform_zero3"] = _transient_fault(3)
    if torch.distributed.get_rank() == 0:
        _write(os.path.join(out, "checks.json"), result)


def _transient_fault(stage: int, steps: int = 8) -> dict:
    """A collective fails with every process alive (rank 1 cuts its own connections as step 4's first
    forward pass begins): the same two ranks re-form and go on (under ZeRO 3 the model is partitioned
    over the failed world: it is made whole from the snapshot and partitioned again; here with
    DeepSpeed's default persistence threshold, so its small parameters stay gathered between passes,
    where the cluster tests partition every one); the result against the same job run without the
    fault."""
    engine, optimizer, loader, scheduler = ds_adabatch.initialize(
        make_model(), config(stage, persist=True), Regression(), loss_fn=mse
    )
    # What lasts the run is not made again when the DeepSpeed engine is swapped (AdaptiveEngineBase._bind).
    lasting, first_deepspeed = (engine.loop, engine.checkpoints, engine.lr_coupling), engine.deepspeed
    for step in range(1, steps + 1):
        if step == 4 and engine.rank == 1:
            _cut_in_next_forward(engine)
        engine.train_batch()
    while engine.global_steps < steps:  # a step the recovery rolled back
        engine.train_batch()
    got = whole_parameters(engine)
    # The four objects initialize returned, still in use after the engine was rebuilt on the new world.
    handles = {
        "optimizer_lr": optimizer.param_groups[0]["lr"],
        "scheduler_lr": scheduler.get_last_lr()[0],
        "engine_lr": engine.lr_coupling.get_lr()[0],
        "optimizer_is_current": optimizer.current is engine.deepspeed.optimizer,
        "optimizer_state_keys": sorted(optimizer.state_dict())[:3],
        "loader_samples": loader.state_dict()["sampler"]["samples_consumed"],
        "engine_samples": engine.global_samples,
        "lasting_parts_kept": all(
            a is b for a, b in zip(lasting, (engine.loop, engine.checkpoints, engine.lr_coupling))
        ),
        "deepspeed_swapped": engine.deepspeed is not first_deepspeed,
    }
    events = [{k: e[k] for k in ("kind", "lost", "world_size", "steps_redone")} for e in engine.live_events]
    history = [h.reason for h in engine.history]
    engine.close()
    plain, *_ = ds_adabatch.initialize(
        make_model(), config(stage, live=False, persist=True), Regression(), loss_fn=mse
    )
    for _ in range(steps):
        plain.train_batch()
    want = whole_parameters(plain)
    rel = max(((got[n] - p).norm() / p.norm()).item() for n, p in want.items())
    plain.close()
    return {"events": events, "history": history, "relative_difference": rel, "handles": handles}


def _late_rank(timeout: float = 2.0, late: float = 5.0) -> dict:
    """Rank 1 reaches ``initialize`` and then its first step ``late`` seconds after rank 0 (an op built,
    a checkpoint read on one rank only), more than ``collective_timeout_s`` (``timeout``): the build, what
    precedes the first step and that step run under the process group's own timeout, and nothing fails.
    After it the configured timeout bounds a wait: rank 1 late by as much in step 3 is taken for a
    failure (a re-formed world, both processes alive)."""
    cfg = config(1)
    cfg["adabatch"]["live_elastic"]["collective_timeout_s"] = timeout
    rank = torch.distributed.get_rank()
    if rank == 1:
        time.sleep(late)
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(), loss_fn=mse)
    if rank == 1:
        time.sleep(late)
    before = []
    for step in range(1, 5):
        if step == 3 and rank == 1:
            time.sleep(late)
        engine.train_batch()
        if step == 2:
            before = list(engine.live_events)
    result = {
        "before": len(before),
        "events": [{k: e[k] for k in ("kind", "lost")} for e in engine.live_events],
        "steps": engine.global_steps,
    }
    engine.close()
    return result


def _cut_in_next_forward(engine) -> None:
    """Cut this process's connections of the live world as the next forward pass begins (a forward
    pre-hook on the model, removed once it ran): the fault lands inside that step, before its
    collectives, whatever the load of the machine (a timer's thread may run only steps later)."""
    handle = None

    def cut(module, args):
        handle.remove()
        engine._live_recovery.world.break_connections()

    handle = engine.module.register_forward_pre_hook(cut)


def _kill_node(out: str, agent: int) -> None:
    """A node's loss: its torchrun agent and this worker, SIGKILL, no goodbye (or SIGSTOP: hung)."""
    sig = signal.SIGSTOP if os.environ.get("LIVE_KILL_SIGNAL") == "STOP" else signal.SIGKILL
    with open(os.path.join(out, "kill-time"), "a") as f:
        f.write(f"{time.time()} {os.getpid()} {agent}\n")
    if agent > 1 and os.environ.get("LIVE_KILL_WHAT") != "worker":
        with contextlib.suppress(ProcessLookupError):  # a node's other rank got there first
            os.kill(agent, sig)
    os.kill(os.getpid(), sig)


def reference(out: str, stage: int, schedule: dict | None = None) -> None:
    """The same job, uninterrupted, in one process (``schedule``: in place of the job's)."""
    cfg = config(stage, live=False)
    if schedule is not None:
        cfg["adabatch"]["schedule"] = schedule
    engine, *_ = ds_adabatch.initialize(make_model(), cfg, Regression(), loss_fn=mse)
    rows = []
    while engine.global_samples < SAMPLES:
        loss = float(engine.train_batch())
        rows.append(
            {
                "step": engine.global_steps,
                "indices": engine.last_step_batch.global_batch.all_indices(),
                "loss": loss,
            }
        )
    torch.save(whole_parameters(engine), os.path.join(out, f"reference-z{stage}.pt"))
    with open(os.path.join(out, f"reference-z{stage}.json"), "w") as f:
        json.dump(rows, f)
    engine.close()


if __name__ == "__main__":
    mode, out_dir, zero = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(out_dir, exist_ok=True)
    if mode == "run":
        run(out_dir, zero)
    elif mode == "checks":
        checks(out_dir)
    elif mode == "replay":
        reference(out_dir, zero, replayed(os.path.join(out_dir, "ledger.jsonl")))
    else:
        for s in [zero] if zero >= 0 else [0, 1, 2, 3]:
            reference(out_dir, s)
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
            torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    ds_adabatch.finish()

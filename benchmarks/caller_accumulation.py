"""The step cost of DeepSpeed's caller-owned accumulation against the boundary set by hand.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/caller_accumulation.py \\
        [--stages 0,2,3 --rounds 10 --steps 20]

A world of one (plain ``python``), the main job's small model (``--model``), global 32 = micro 8 x GAS 4,
a constant schedule (every step steady). For each ZeRO stage two ds_adabatch engines are built from the
same model seed and data, differing only in how a step's accumulation ends:

* ``hand``: the default (DeepSpeed's managed accumulation): ``set_gradient_accumulation_boundary`` before
  every pass, ``step()`` after every pass (DeepSpeed updates at the boundary only);
* ``caller``: ``"managed_gradient_accumulation": false``: no boundary is set, ``step()`` once after the
  step's last pass (DeepSpeed reduces and updates there).

Their ``train_batch`` steps are interleaved in rounds (the order alternated every round, so drift in
load hits both alike). It prints each engine's median step, the ratio caller / hand (of the medians and
of the fastest rounds) and the load average before and after. Exactness is not measured here
(tests/test_engine.py does): two engines stepped in blocks in one process drift apart at rounding level
whichever modes they use (two hand-driven engines drift alike), so their parameters are not compared.
"""

from __future__ import annotations

import argparse
import os
import statistics

import _harness as h  # noqa: E402  (sets sys.path and DS_ACCELERATOR)
import torch

import ds_adabatch

MICRO, GAS = 8, 4


def build(stage: int, data, spec, *, caller: bool):
    """ds_adabatch's engine at a fixed plan (global MICRO x GAS), hand-driven or caller-owned."""
    adabatch = {"schedule": {"type": "constant", "value": MICRO * GAS}, "max_micro_batch_per_gpu": MICRO}
    cfg = h.ds_config(stage, adabatch, micro=MICRO, gas=GAS, world=1)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)
    if caller:
        cfg["managed_gradient_accumulation"] = False
    engine, *_ = ds_adabatch.initialize(h.lm_model(spec=spec), cfg, data)
    return engine


def run_stage(stage: int, data, spec, rounds: int, steps: int) -> tuple[float, float]:
    engines = {
        "hand": build(stage, data, spec, caller=False),
        "caller": build(stage, data, spec, caller=True),
    }
    assert not engines["caller"].deepspeed.managed_gradient_accumulation()
    for engine in engines.values():  # warm-up: lazily built state, first allocations
        h.time_steps(engine.train_batch, 2)
    times: dict[str, list[float]] = {name: [] for name in engines}
    per_round: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            got = h.time_steps(engines[name].train_batch, steps)
            times[name] += got
            per_round[name].append(statistics.median(got))
    hand, caller = h.median(times["hand"]), h.median(times["caller"])
    print(
        f"ZeRO-{stage}: hand {hand * 1e3:.2f} ms, caller {caller * 1e3:.2f} ms, ratio caller/hand "
        f"{caller / hand:.4f} (fastest rounds {min(per_round['caller']) / min(per_round['hand']):.4f})",
        flush=True,
    )
    for engine in engines.values():
        engine.close()
    return hand, caller


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", default="0,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per stage")
    parser.add_argument("--steps", type=int, default=20, help="train_batch steps per engine per round")
    parser.add_argument("--model", choices=sorted(h.MODELS), default="small")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(h.idle_check("before", own_processes=0), flush=True)
    print(
        f"world 1, model {args.model}, global {MICRO * GAS} = micro {MICRO} x GAS {GAS}, "
        f"{args.rounds} rounds x {args.steps} steps per engine, interleaved",
        flush=True,
    )
    data = h.lm_data()
    ds_adabatch.init_distributed()
    for stage in (int(s) for s in args.stages.split(",")):
        run_stage(stage, data, h.MODELS[args.model], args.rounds, args.steps)
    print(h.idle_check("after", own_processes=1), flush=True)
    ds_adabatch.finish()


if __name__ == "__main__":
    main()

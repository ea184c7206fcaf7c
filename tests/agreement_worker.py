"""Host agreements on 3 gloo ranks after an elastic (c10d) restart, run by tests/test_agreement.py.

Usage: torchrun --standalone --nproc-per-node 3 --max-restarts 1 tests/agreement_worker.py OUT_DIR
The first incarnation forms its groups through the restart-safe initialisation of
``ds_adabatch.init_distributed`` (its torch part: no DeepSpeed import, for a light launch) and rank 2
exits with code 3 (a crash); torchrun restarts all three, whose groups must form again in the agent's
store. Then
recursive-doubling reductions (3 ranks: one folded in) are checked against the values every rank drew,
and rank 0 writes OUT_DIR/agreement.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
from datetime import timedelta

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import ds_adabatch  # noqa: E402
from ds_adabatch.runtime.distributed.agreement import HostAgreement, host_group  # noqa: E402
from ds_adabatch.runtime.distributed.process_group import init_process_group_restart_safe  # noqa: E402


def main() -> None:
    assert init_process_group_restart_safe("gloo", timedelta(minutes=5)), "launched by torchrun's agent"
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    agreement = HostAgreement(rank, world, host_group())
    agreement.reduce([rank], ["sum"])  # the gloo group of agreements works in this incarnation too
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        if rank == world - 1:
            os._exit(3)  # a crash: the agent restarts every rank
        dist.barrier()  # waits for the crashed rank: the agent stops this incarnation
    mismatches, cases = [], 0
    for trial in range(40):
        draw = random.Random(trial)
        values = [[draw.randint(-(1 << 40), 1 << 40) for _ in range(4)] for _ in range(world)]
        ops = [draw.choice(["sum", "max", "min"]) for _ in range(4)]
        got = agreement.reduce(values[rank], ops)
        want = [{"sum": sum, "max": max, "min": min}[op](v[k] for v in values) for k, op in enumerate(ops)]
        cases += 1
        if got != want:
            mismatches.append({"trial": trial, "rank": rank, "got": got, "want": want})
    flags = agreement.gather_flags(2.0 + rank if rank == 1 else 0.0)
    everyone: list = [None] * world
    dist.all_gather_object(
        everyone, {"mismatches": mismatches, "messages": agreement.messages, "flags": flags}
    )
    if rank == 0:
        result = {
            "restart": restart,
            "world": world,
            "cases": cases,
            "rounds": agreement.rounds,
            "ranks": everyone,
        }
        with open(os.path.join(sys.argv[1], "agreement.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()

"""For tests/test_shm_buffer.py: on one machine's ranks, no ``/dev/shm`` buffer of DeepSpeed's CPU all-reduce
is left under this launch's name, and that all-reduce still works. Writes OUT/<mode>_rank<r>.json.

Modes: ``ours`` forms the group with ``ds_adabatch.init_distributed()``; ``deepspeed`` calls DeepSpeed's own
``deepspeed.init_distributed()`` first (as DeepSpeed's examples do), then ``ds_adabatch.initialize`` and a
few training steps.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import deepspeed.comm as ds_dist  # noqa: E402
import deepspeed.comm.comm as ds_comm  # noqa: E402

import ds_adabatch  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
engine = None
if mode == "ours":
    ds_adabatch.init_distributed()
else:
    deepspeed.init_distributed()
    mapped = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*")
    data = [(torch.randn(4), torch.randn(1)) for _ in range(64)]
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 0},
        "adabatch": {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4},
    }

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    engine, *_ = ds_adabatch.initialize(torch.nn.Linear(4, 1), config, data, loss_fn=loss_fn)
    for _ in range(2):
        engine.train_batch()
rank = torch.distributed.get_rank()
torch.distributed.barrier()  # every rank has removed its own name
left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*")
t = torch.full((1000,), float(rank + 1))
ds_dist.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce, through the mapped buffers
got = {"shm_op": ds_comm.cdb.shm_comm_op is not None, "left": left, "sum": t.unique().tolist()}
got["port"] = os.environ["MASTER_PORT"]
if engine is not None:
    got["existed_before_initialize"] = len(mapped)
    got["steps"] = engine.global_steps
    engine.close()
with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
    json.dump(got, f)
ds_adabatch.finish()

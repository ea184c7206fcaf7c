"""For tests/test_shm_buffer.py: after ``ds_adabatch.init_distributed()`` on one machine's ranks, no
``/dev/shm`` buffer of DeepSpeed's CPU all-reduce is left under this launch's name, and that all-reduce
still works. Writes OUT/rank<r>.json."""

from __future__ import annotations

import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed.comm as ds_dist  # noqa: E402
import deepspeed.comm.comm as ds_comm  # noqa: E402

import ds_adabatch  # noqa: E402

ds_adabatch.init_distributed()
rank = torch.distributed.get_rank()
torch.distributed.barrier()  # every rank has removed its own name
left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*")
t = torch.full((1000,), float(rank + 1))
ds_dist.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce, through the mapped buffers
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"shm_op": ds_comm.cdb.shm_comm_op is not None, "left": left, "sum": t.unique().tolist()}, f)

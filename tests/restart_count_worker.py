"""For tests/test_restart_count.py: the ranks of one world disagree on TORCHELASTIC_RESTART_COUNT (as when
one torchrun agent restarts its workers for a failure and another for the membership change it causes);
building the engine and training a step must not hang. Writes OUT/rank<r>.ok, then ends as docs/engine.md
asks every script to (engine.close(), ds_adabatch.finish())."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import live_worker  # noqa: E402

import ds_adabatch  # noqa: E402

ds_adabatch.init_distributed(timeout=timedelta(seconds=60))
rank = torch.distributed.get_rank()
if rank == 1:
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # restarted for a failure; rank 0 for the membership
cfg = live_worker.config(1, live=False)
engine, *_ = ds_adabatch.initialize(
    live_worker.make_model(), cfg, live_worker.Regression(), loss_fn=live_worker.mse
)
engine.train_batch()
open(os.path.join(sys.argv[1], f"rank{rank}.ok"), "w").close()
engine.close()
ds_adabatch.finish()  # gloo can otherwise abort a finished rank at teardown (docs/engine.md)

"""DeepSpeed's CPU all-reduce buffers in /dev/shm: ``ds_adabatch.init_distributed`` removes their names
once every rank has mapped them (DeepSpeed 0.19.8 never does: 66 MB per rank and launch were left)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import torchrun

pytestmark = pytest.mark.multirank

WORKER = Path(__file__).resolve().parent / "shm_buffer_worker.py"


def test_no_shm_buffer_is_left_and_the_shm_all_reduce_works(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "2")  # as the deepspeed launcher sets it: every rank on one machine
    proc = torchrun(WORKER, str(tmp_path), nproc=2, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["shm_op"], "DeepSpeed's CPU communication op was not loaded"
        assert got["left"] == [], got
        assert got["sum"] == [3.0], got

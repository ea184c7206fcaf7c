"""DeepSpeed's CPU all-reduce buffers in /dev/shm: their names are removed once every rank has mapped them
(DeepSpeed 0.19.8 never does: 66 MB per rank and launch were left), whoever formed the process group:
``ds_adabatch.init_distributed`` or DeepSpeed's own ``deepspeed.init_distributed()`` before
``ds_adabatch.initialize``. Two launches, side by side."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
from _util import outcome, side_by_side, torchrun

pytestmark = pytest.mark.multirank

WORKER = Path(__file__).resolve().parent / "shm_buffer_worker.py"
MODES = ("ours", "deepspeed")


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shm")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCAL_SIZE", "2")  # as the deepspeed launcher sets it: every rank on one machine
    try:
        lanes = [
            [(m, lambda m=m: torchrun(WORKER, m, str(out), nproc=2, cwd=out, timeout=300))] for m in MODES
        ]
        return out, side_by_side(*lanes)
    finally:
        mp.undo()


@pytest.mark.parametrize("mode", MODES)
def test_no_shm_buffer_is_left_and_the_shm_all_reduce_works(launches, mode):
    out, results = launches
    proc = outcome(results, mode)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for r in (0, 1):
        got = json.loads((out / f"{mode}_rank{r}.json").read_text())
        assert got["shm_op"], "DeepSpeed's CPU communication op was not loaded"
        assert got["left"] == [], got
        assert got["sum"] == [3.0], got
        if mode == "deepspeed":
            assert got["existed_before_initialize"] == 2, "deepspeed.init_distributed() made no buffers"
            assert got["steps"] == 2
        # And after the launch ended (ds_adabatch.finish), nothing under its name either.
        assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{got['port']}_*") == []

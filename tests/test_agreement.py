"""The host agreement (recursive doubling) and restart-safe process groups under an elastic restart.

One launch, ``torchrun --standalone`` (the c10d rendezvous, whose agent hosts the workers' store and
keeps it across restarts) of 3 ranks with ``--max-restarts 1``: a rank crashes after the groups formed,
all three restart, form their groups again and check reductions against every rank's values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_adabatch.runtime.distributed.agreement import HostAgreement

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent


def test_structure_is_logarithmic_with_a_constant_payload():
    # Rounds on the critical path: log2 N for a power of two, + 2 when ranks must be folded in.
    assert [HostAgreement(0, n).rounds for n in (1, 2, 3, 4, 8, 4096, 4097)] == [0, 1, 3, 2, 3, 12, 14]
    assert HostAgreement(4096, 4097).messages == 2 and HostAgreement(0, 4097).messages == 26
    with pytest.raises(ValueError, match="unknown operation"):
        HostAgreement(0, 1).reduce([1], ["mean"])


def test_reductions_are_exact_on_every_rank_after_an_elastic_restart(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    cmd += ["--max-restarts=1", "--monitor-interval=1", str(HERE / "agreement_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the restarted job failed:\n{log[-5000:]}"
    assert "connectFullMesh" not in log
    result = json.loads((tmp_path / "agreement.json").read_text())
    assert result["restart"] == 1, "the checks must run in the restarted incarnation"
    assert result["rounds"] == 3 and result["cases"] == 40
    for rank, got in enumerate(result["ranks"]):
        assert got["mismatches"] == [], f"rank {rank}: {got['mismatches'][:3]}"
        assert got["flags"] == [0.0, 3.0, 0.0], "which rank reported, and its value, reach every rank"
    assert [r["messages"] for r in result["ranks"]] == [4, 2, 2], "rank 2 is folded into rank 0"

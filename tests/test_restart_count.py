"""Ranks that disagree on torchrun's restart count build the engine together (no collective on some ranks
only): seen as a 10-minute hang of the restart path, one agent restarting its worker for the failure
(count 1) and the other for the membership change that followed (count 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import torchrun

pytestmark = pytest.mark.multirank

WORKER = Path(__file__).resolve().parent / "restart_count_worker.py"


def test_engine_builds_when_ranks_disagree_on_the_restart_count(tmp_path):
    proc = torchrun(WORKER, str(tmp_path), nproc=2, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]

"""``runners/train_pipe.py`` as the README runs it: 2 stages on 2 processes, then resumed on 4 (2 x 2).

The README's two commands (``torchrun --nproc-per-node 2 ... --pipeline-stages 2 --config
ds_configs/pipe_ramp.json``, then ``--nproc-per-node 4 ... --resume DIR --save-dir DIR``), shortened with
``--samples`` and written under a temporary folder: the first saves at its end, the second resumes
from that checkpoint on twice the replicas and carries the sample count on; the ledger holds every
sample of the run at most once, and the metrics file one line per step of each run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _util import torchrun

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "runners" / "train_pipe.py"


def _run(nproc: int, *args: str) -> str:
    proc = torchrun(RUNNER, *args, "--no-progress", nproc=nproc, cwd=ROOT, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train_pipe.py {' '.join(args)} failed:\n{log[-4000:]}"
    return log


def test_the_readme_commands_train_and_resume_on_twice_the_replicas(tmp_path):
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger.jsonl"
    common = ["--pipeline-stages", "2", "--ledger", str(ledger), "--save-dir", str(ckpt)]
    first = _run(
        2, *common, "--config", "ds_configs/pipe_ramp.json", "--samples", "160", "--out", str(tmp_path / "a")
    )
    done = re.search(r"done: (\d+) steps, (\d+) samples on 2 stages x 1 replicas", first)
    assert done, first[-3000:]
    second = _run(4, *common, "--resume", str(ckpt), "--samples", "320", "--out", str(tmp_path / "b"))
    assert f"resumed from {ckpt}" in second, second[-3000:]
    assert "global batch 8 -> 16" in second and "on 2 replicas" in second, "the ramp goes on over 2 replicas"
    resumed = re.search(r"done: (\d+) steps, (\d+) samples on 2 stages x 2 replicas", second)
    assert resumed, second[-3000:]
    assert int(resumed.group(1)) > int(done.group(1)) and int(resumed.group(2)) >= 320
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    seen = [i for r in rows for i in r["indices"]]
    assert len(seen) == len(set(seen)) == int(resumed.group(2)), "every sample of the run at most once"
    first_steps = int(done.group(1))
    for out, steps in ((tmp_path / "a", first_steps), (tmp_path / "b", int(resumed.group(1)) - first_steps)):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == steps, f"{out}: one metrics line per step of the run, {len(lines)} for {steps}"

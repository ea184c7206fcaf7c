"""An out-of-memory error that ends the process does not end the job: ZeRO-3 through a torchrun restart.

One launch, ``torchrun --nproc-per-node 2 --max-restarts 1`` of ``tests/oom_restart_worker.py``: rank 1
runs out of memory mid-forward after a ZeRO-3 parameter gather (not recoverable inside the step), records
the lower limit next to the checkpoints and exits with code 75; torchrun starts both ranks again, their
process group forms (restart-safe store namespace), the job resumes from its last complete checkpoint,
plans below the micro-batch that failed and finishes the epoch. Once with ``train_batch``, once with
DeepSpeed's forward / backward / step loop over the loader ``initialize`` returns (the error comes from
``engine(x)`` in the script's own code). A third launch never checkpoints: the record goes to the default
folder in the working directory and the restart trains the epoch again from step 0 below the failed size.

The three launches are separate, as described; the module's fixture runs them side by side on the two
cores (starting only those the selected tests read), and each test asserts on its own launch.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest
from _util import launches_for, outcome, side_by_side, torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
CASES = {"train_batch": [], "loop": ["--loop"], "no_checkpoint": ["--no-checkpoint"]}  # worker arguments
LANES = (("train_batch", "no_checkpoint"), ("loop",))  # side by side, each one launch after the other
RUNS_OF = {  # the launches each test reads
    "test_zero3_mid_forward_oom_finishes_through_a_restart_exactly_once[train_batch]": {"train_batch"},
    "test_zero3_mid_forward_oom_finishes_through_a_restart_exactly_once[loop]": {"loop"},
    "test_without_a_checkpoint_folder_the_record_goes_to_the_default_folder_and_the_restart_succeeds": {
        "no_checkpoint"
    },
}


def _launch(out: Path, *extra: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    script = HERE / "oom_restart_worker.py"
    proc = torchrun(script, str(out), *extra, cwd=HERE, timeout=600, launcher_args=["--max-restarts=1"])
    (out / "launch.log").write_text(proc.stdout + proc.stderr)
    return out, proc


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> dict:
    """The selected tests' launches, side by side: case -> (its folder, the finished launch) or its error."""
    wanted = launches_for(request, __name__, RUNS_OF)
    outs = {case: tmp_path_factory.mktemp(case) for case in CASES if case in wanted}
    lanes = [
        [(c, functools.partial(_launch, outs[c], *CASES[c])) for c in lane if c in outs] for lane in LANES
    ]
    return side_by_side(*lanes)


@pytest.mark.parametrize("way", ["train_batch", "loop"])
def test_zero3_mid_forward_oom_finishes_through_a_restart_exactly_once(launches, way):
    out, proc = outcome(launches, way)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the job did not finish through the restart:\n{log[-5000:]}"
    where = "in the forward of micro-batch 0 of step 4" if way == "loop" else "in micro-batch 0 of step 4"
    assert f"UnrecoverableOutOfMemory: out of memory on rank 1 {where}" in log, log[-5000:]
    assert "exitcode: 75" in log, "the failing rank must exit with the documented code 75"
    assert "connectFullMesh" not in log, "the restarted ranks must form their process group"
    assert "could not recover at 8 samples per pass" in log, "the next start reads the record"

    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    before = [r for r in rows if r["restart"] == 0]
    after = [r for r in rows if r["restart"] == 1]
    assert before and after, f"one step before and after the restart at least: {rows}"
    resumed_from = after[0]["step"] - 1
    assert resumed_from == 4 and before[-1]["step"] == 4, "resumed from the last complete checkpoint"
    final = [r for r in before if r["step"] <= resumed_from] + after
    assert [r["step"] for r in final] == list(range(1, 9))
    seen = [i for r in final for i in r["indices"]]
    assert sorted(seen) == list(range(96)), (
        "every sample of the epoch exactly once, counting from the checkpoint"
    )
    assert final[-1]["samples"] == 96
    # Step 5 (batch 16) failed at micro 8 on rank 1; after the restart it runs at micro 4 x GAS 2.
    assert all(r["micro"] < 8 and r["limit"] < 8 for r in after), after
    assert after[0]["micro"] * after[0]["gas"] * 2 == 16, "the same global batch"
    assert not list((out / "ckpt").glob("adabatch_oom_rank*.json")), (
        "the record goes once a complete checkpoint holds what it taught"
    )


def test_without_a_checkpoint_folder_the_record_goes_to_the_default_folder_and_the_restart_succeeds(launches):
    out, proc = outcome(launches, "no_checkpoint")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the job did not finish through the restart:\n{log[-5000:]}"
    assert "exitcode: 75" in log, "the failing rank must exit with the documented code 75, not 1"
    records = list((out / "adabatch_oom_records").glob("adabatch_oom_rank*.json"))
    assert [p.name for p in records] == ["adabatch_oom_rank1.json"], records
    assert "starts from step 0 again (no checkpoint folder is known" in log, log[-5000:]
    assert "could not recover at 8 samples per pass" in log, "the next start reads the record when built"
    record = json.loads(records[0].read_text())
    assert record["failed"] == 8 and record["run"], record

    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    after = [r for r in rows if r["restart"] == 1]
    assert [r["step"] for r in after] == list(range(1, 9)), "the whole epoch again, from step 0"
    assert sorted(i for r in after for i in r["indices"]) == list(range(96))
    assert all(r["micro"] < 8 and r["limit"] < 8 for r in after), after

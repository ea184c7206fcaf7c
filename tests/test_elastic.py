"""Resume on another world size (ZeRO 0, 2, 3, no hand conversion) and crash-safe checkpoints.

Three launches of ``tests/elastic_worker.py`` serve every test: 2 ranks save (and one rank dies mid-save
at the end, so that launch fails on purpose); 1 rank resumes the 2-rank checkpoints and saves its own;
2 ranks resume those.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _util import read_result, torchrun

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
WORKER = HERE / "elastic_worker.py"
STAGES = (0, 2, 3)
AT = 3


def _launch(nproc: int, phase: str, out: Path, *, expect_rc: int = 0) -> str:
    proc = torchrun(WORKER, phase, str(out), nproc=nproc, cwd=HERE, timeout=600)
    log = proc.stdout + proc.stderr
    (out / f"{phase}_w{nproc}.log").write_text(log)
    if (proc.returncode == 0) != (expect_rc == 0):
        pytest.fail(f"elastic worker {phase!r} on {nproc} ranks: exit {proc.returncode}\n{log[-4000:]}")
    return log


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic")
    log = _launch(2, "save", out, expect_rc=1)
    assert "(exitcode: 17)" in log, (
        f"the save launch must end with rank 1's deliberate death mid-save:\n{log[-3000:]}"
    )
    _launch(1, "resume", out)
    _launch(2, "resume", out)
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(results, stage, saved, resumed):
    full = read_result(results, f"w{saved}_z{stage}_full")
    got = read_result(results, f"w{saved}_z{stage}_resumed_w{resumed}")
    assert got["start"] == AT, f"resumed at step {got['start']}, saved at {AT}"
    want = full["steps"][AT:]
    assert len(got["steps"]) == len(want)
    # The ledger: from the checkpoint on, the same samples in the same steps - none lost, none twice.
    assert [s["indices"] for s in got["steps"]] == [s["indices"] for s in want]
    seen = [i for s in full["steps"][:AT] for i in s["indices"]] + [
        i for s in got["steps"] for i in s["indices"]
    ]
    assert len(seen) == len(set(seen)), "a sample was trained twice within the epoch"
    assert [s["plan"][0] for s in got["steps"]] == [s["plan"][0] for s in want], "global batches"
    # Losses continue from the checkpoint's weights and optimizer state (not a restart).
    for a, b in zip(got["steps"], want):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (a["loss"], b["loss"])
        assert math.isclose(a["lr"], b["lr"], rel_tol=1e-9)
    universal = results / f"w{saved}_z{stage}" / f"global_step{AT}_universal"
    assert universal.is_dir() == (stage > 0), (
        "ZeRO 1-3 converts (cached beside the original); ZeRO 0 needs not"
    )


def test_rank_dying_mid_save_leaves_the_previous_checkpoint(results):
    folder = results / "crash"
    assert (folder / "global_step4").is_dir(), "the interrupted save started writing"
    assert not (folder / "global_step4" / "adabatch_complete.json").exists()
    assert (folder / "global_step2" / "adabatch_complete.json").exists()
    assert (folder / "latest").read_text() == "global_step2", "latest must name the last complete save"
    got = read_result(results, "crash_resumed")
    assert got["start"] == 2 and got["path"].endswith("global_step2_universal/mp_rank_00_model_states.pt")


def test_universal_copy_is_reused(results):
    got = read_result(results, "universal_reused")
    assert got["steps"] == AT
    assert got["before"] == got["after"], "the cached universal copy was converted again"

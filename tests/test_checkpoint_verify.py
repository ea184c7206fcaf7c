"""Damaged checkpoints: a resume falls back to the newest one that verifies, with one line naming the file.

Two launches of ``tests/checkpoint_verify_worker.py`` serve every test: 2 ranks save checkpoints at steps
2, 4 and 6 (ZeRO 2), damage copies of the folder (a truncated file, a flipped bit, a deleted file and a
damaged older one, every checkpoint damaged) and resume each copy on 2 ranks; then 1 rank resumes the same
copies (through the universal conversion) and a copy whose records predate manifests.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from _util import read_result, torchrun

from ds_adabatch.checkpoint_manifest import checksum_file, read_manifest, verify_folder

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

HERE = Path(__file__).parent
WORKER = HERE / "checkpoint_verify_worker.py"
MODEL = "mp_rank_00_model_states.pt"
SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _launch(nproc: int, phase: str, out: Path) -> None:
    proc = torchrun(WORKER, phase, str(out), nproc=nproc, cwd=HERE, timeout=600)
    log = proc.stdout + proc.stderr
    (out / f"{phase}.log").write_text(log)
    if proc.returncode != 0:
        pytest.fail(
            f"checkpoint verify worker {phase!r} on {nproc} ranks: exit {proc.returncode}\n{log[-4000:]}"
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify")
    _launch(2, "save", out)
    _launch(1, "resume", out)
    return out


def _written(out: Path, step: int, name: str):
    """The size and CRC-32 the save recorded for ``name`` (read from the undamaged folder)."""
    return read_manifest(str(out / "saved" / f"global_step{step}"))[name]


def _crc_now(out: Path, case: str, step: int, name: str) -> int:
    return checksum_file(str(out / case / f"global_step{step}" / name))[1]


def _expected_problems(out: Path, case: str) -> list[str]:
    """What is wrong with each damaged checkpoint of ``case``, newest first, in the words of the line."""
    model6, shard1, model2 = (
        _written(out, 6, MODEL),
        _written(out, 4, SHARD.format(1)),
        _written(out, 2, MODEL),
    )
    folder = out / case
    if case == "truncated":
        return [f"checkpoint {folder}/global_step6: {MODEL} is truncated (100 bytes, expected {model6.size})"]
    if case == "bitflip":
        want = _written(out, 6, SHARD.format(1)).crc32
        got = _crc_now(out, case, 6, SHARD.format(1))
        return [
            f"checkpoint {folder}/global_step6: {SHARD.format(1)} fails its checksum "
            f"(crc32 {got:08x}, expected {want:08x})"
        ]
    if case == "deleted":
        rng = _written(out, 4, "adabatch_rng_rank1.pt").crc32
        return [
            f"checkpoint {folder}/global_step6: {SHARD.format(0)} is missing",
            f"checkpoint {folder}/global_step4: adabatch_rng_rank1.pt fails its checksum "
            f"(crc32 {_crc_now(out, case, 4, 'adabatch_rng_rank1.pt'):08x}, expected {rng:08x})",
        ]
    assert case == "allbad"
    assert shard1.size > 0
    return [
        f"checkpoint {folder}/global_step6: {MODEL} is truncated (100 bytes, expected {model6.size})",
        f"checkpoint {folder}/global_step4: {SHARD.format(1)} is missing",
        f"checkpoint {folder}/global_step2: {MODEL} fails its checksum "
        f"(crc32 {_crc_now(out, case, 2, MODEL):08x}, expected {model2.crc32:08x})",
    ]


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("case,step", [("truncated", 4), ("bitflip", 4), ("deleted", 2)])
def test_damaged_newest_checkpoint_falls_back_with_one_line(results, world, case, step):
    line = "; ".join(_expected_problems(results, case)) + f"; resuming from global_step{step} (step {step})"
    full = read_result(results, "full")["losses"]
    for rank in range(world):
        got = read_result(results, f"w{world}_{case}_rank{rank}")
        assert got["error"] is None, got["error"]
        assert got["start"] == step, f"rank {rank} resumed at step {got['start']}, expected {step}"
        universal = "_universal" if world == 1 else ""  # another world size: the good one is converted
        assert got["path"] == f"{case}/global_step{step}{universal}/{MODEL}", got["path"]
        # The fallback's state was loaded, not the damaged one's: the run goes on as the uninterrupted one.
        for a, b in zip(got["losses"], full[step:], strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (got["losses"], full[step:])
        fallback = [x for x in got["lines"] if "resuming from" in x]
        assert fallback == ([line] if rank == 0 else []), got["lines"]
    if world == 1:
        assert not (results / case / "global_step6_universal").exists(), "a damaged checkpoint was converted"


@pytest.mark.parametrize("world", [2, 1])
def test_every_checkpoint_damaged_stops_before_training(results, world):
    details = "; ".join(_expected_problems(results, "allbad"))
    want = (
        f"no checkpoint in {results / 'allbad'} verifies, so nothing was loaded ({details}): restore the "
        "damaged files, or start without resuming"
    )
    for rank in range(world):
        got = read_result(results, f"w{world}_allbad_rank{rank}")
        assert got["error_type"] == "CheckpointCorrupt"
        assert got["error"] == want
        assert got["start"] == 0 and got["lines"] == [], got


def test_checkpoint_without_manifest_loads_unverified_said_once(results):
    got = read_result(results, "w1_legacy_rank0")
    assert got["start"] == 6 and got["error"] is None
    said = [x for x in got["lines"] if "manifest" in x]
    assert said == [
        f"checkpoint {results / 'legacy'}/global_step6 was saved without a manifest (before ds_adabatch "
        "verified checkpoints): loading it unverified"
    ]


def test_each_file_is_listed_by_the_rank_that_wrote_it(results):
    # The contract with DeepSpeed 0.19.8 (runtime/checkpoint/verify.py, recording_writes): every file of a
    # checkpoint is written through engine.checkpoint_engine.save, where the rank that writes it is seen.
    # Were it written another way, rank 0 would list it (hashing it after the save) and this would fail.
    files = read_manifest(str(results / "saved" / "global_step6"))
    assert {n: r.rank for n, r in files.items()} == {
        MODEL: 0,
        SHARD.format(0): 0,
        SHARD.format(1): 1,
        "adabatch_rng_rank0.pt": 0,
        "adabatch_rng_rank1.pt": 1,
    }


def test_verify_reports_each_checkpoint_and_the_converted_copy_verifies(results):
    lines, ok = verify_folder(str(results / "truncated"))
    assert not ok
    universal = read_manifest(str(results / "truncated" / "global_step4_universal"))
    assert universal and MODEL in universal and "zero_pp_rank_0_mp_rank_00_optim_states.pt" not in universal
    size = sum(r.size for r in universal.values())
    assert lines[:2] == [
        f"global_step6: BAD, {MODEL} is truncated (100 bytes, expected {_written(results, 6, MODEL).size})",
        f"global_step4_universal: ok, step 4, {len(universal)} files, {size / 1e3:.1f} kB",
    ], lines
    assert len(lines) == 4 and lines[2].startswith("global_step4: ok, step 4, 5 files")
    assert verify_folder(str(results / "saved"))[1]
    assert os.path.isfile(results / "saved" / "global_step6" / "adabatch_complete.json")


def test_pipeline_checkpoint_lists_every_stage_and_falls_back(results):
    damaged = read_result(results, "pipeline_damaged")
    writers = {r["rank"] for n, r in damaged["files"].items() if n.startswith("layer_")}
    assert writers == {0, 1}, "each stage's layer files are in the manifest, by the rank that wrote them"
    assert {"adabatch_rng_rank0.pt", "adabatch_rng_rank1.pt"} <= set(damaged["files"])
    line = (
        f"checkpoint {results / 'pipeline'}/global_step2: {damaged['name']} is truncated (100 bytes, expected "
        f"{damaged['size']}); resuming from global_step1 (step 1)"
    )
    for rank in (0, 1):
        got = read_result(results, f"pipeline_rank{rank}")
        assert got["start"] == 1 and got["path"].startswith("pipeline/global_step1/"), got
        assert [x for x in got["lines"] if "resuming from" in x] == ([line] if rank == 0 else []), got[
            "lines"
        ]


def test_a_damaged_universal_copy_is_converted_again(results):
    name = read_result(results, "reconverted_file")["name"]
    got = read_result(results, "w1_reconverted_rank0")
    assert got["error"] is None and got["start"] == 4, got
    copy = results / "truncated" / "global_step4_universal"
    said = [x for x in got["lines"] if "cached universal copy" in x]
    assert len(said) == 1 and said[0].startswith(
        f"the cached universal copy {copy} fails verification ({name} "
    ), said
    assert said[0].endswith("): converting it again"), said
    assert verify_folder(str(results / "truncated"))[0][1].startswith("global_step4_universal: ok")


def test_a_save_over_a_tag_of_another_world_leaves_none_of_its_files(results):
    r = read_result(results, "resaved")
    assert r["had_copy"], "the 2-rank save's universal copy existed before the save over its tag"
    assert SHARD.format(0) in r["files"] and SHARD.format(1) not in r["files"], r["files"]
    assert "adabatch_rng_rank1.pt" not in r["files"] and "tokenizer.json" in r["files"], r["files"]
    assert not r["copy_left"], "the universal copy of the old save must go with it"
    lines, ok = verify_folder(str(results / "resaved"))
    assert ok and lines[0].startswith("global_step6: ok, step 6, 4 files"), (
        lines
    )  # model, shard, RNG, tokenizer


def test_a_save_over_a_tag_removes_what_a_save_writes_and_nothing_else(tmp_path):
    from ds_adabatch.runtime.checkpoint.save_load import _clear_tag

    written = [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "layer_01-model_00-model_states.pt",  # a pipeline's layer
        "layer_0_expert_0_mp_rank_00_model_states.pt",
        "adabatch_rng_rank1.pt",
        "adabatch_complete.json",
    ]
    tag = tmp_path / "global_step6"
    tag.mkdir()
    for name in [*written, "tokenizer.json"]:
        (tag / name).write_text("x")
    made, by_hand = tmp_path / "global_step6_universal", tmp_path / "global_step4_universal"
    for copy in (made, by_hand):
        copy.mkdir()
    (made / "adabatch_complete.json").write_text("{}")
    _clear_tag(str(tmp_path), "global_step6")
    _clear_tag(str(tmp_path), "global_step4")  # a copy without our record (DeepSpeed's converter) stays
    assert sorted(p.name for p in tag.iterdir()) == ["tokenizer.json"]
    assert not made.exists() and by_hand.exists()


def test_a_tag_must_name_a_folder_inside_the_save_folder():
    from ds_adabatch.runtime.checkpoint.save_load import _check_tag

    _check_tag("global_step6")
    _check_tag("run1/global_step6")
    for bad in ("", ".", "..", "../elsewhere", "/tmp/x"):
        with pytest.raises(ValueError, match="inside the save folder"):
            _check_tag(bad)

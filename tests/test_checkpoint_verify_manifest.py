"""The checkpoint manifest and ``ds-adabatch verify CKPT_DIR``, in one process on folders written here."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ds_adabatch import cli
from ds_adabatch.checkpoint_manifest import (
    COMPLETE_FILE,
    FileProblem,
    FileRecord,
    assign_checks,
    check_files,
    checksum_file,
    merge_parts,
    read_manifest,
    write_part,
)

ROOT = Path(__file__).resolve().parent.parent


def _bytes(n: int, seed: int) -> bytes:
    pattern = bytes((i * 31 + seed) % 251 for i in range(251))
    return (pattern * (n // 251 + 1))[:n]


def _checkpoint(save_dir: Path, step: int, *, manifest: bool = True) -> Path:
    """A checkpoint as two ranks save it: rank 0's model file, one shard per rank, a file no rank
    recorded, the parts merged and the completion record written (without ``files`` if not ``manifest``)."""
    folder = save_dir / f"global_step{step}"
    (folder / "sub").mkdir(parents=True)
    for name, n, rank in (("model.pt", 3000, 0), ("shard_0.pt", 1500, 0), ("shard_1.pt", 1700, 1)):
        (folder / name).write_bytes(_bytes(n, step + rank))
    (folder / "sub" / "script.py").write_text("print('recovery')\n")
    write_part(str(folder), 0, [str(folder / "model.pt"), str(folder / "shard_0.pt"), "/elsewhere/x.pt"])
    write_part(str(folder), 1, [str(folder / "shard_1.pt")])
    files = merge_parts(str(folder))
    record = {"version": 1, "tag": folder.name, "world_size": 2, "zero_stage": 2, "global_steps": step}
    record.update(global_samples=8 * step, saved_at=1.0 * step)
    if manifest:
        record["files"] = {n: {"size": r.size, "crc32": r.crc32, "rank": r.rank} for n, r in files.items()}
    (folder / COMPLETE_FILE).write_text(json.dumps(record))
    return folder


def test_the_manifest_lists_every_file_with_its_writer_size_and_crc(tmp_path):
    folder = _checkpoint(tmp_path, 4)
    files = read_manifest(str(folder))
    assert sorted(files) == ["model.pt", "shard_0.pt", "shard_1.pt", "sub/script.py"]
    assert {n: r.rank for n, r in files.items()} == {
        "model.pt": 0,
        "shard_0.pt": 0,
        "shard_1.pt": 1,
        "sub/script.py": 0,  # no rank recorded it: rank 0 hashed it when merging
    }
    data = (folder / "shard_1.pt").read_bytes()
    assert files["shard_1.pt"] == FileRecord(len(data), zlib.crc32(data), 1)
    assert not list(folder.glob("adabatch_manifest_rank*")), "the parts are merged away"
    assert check_files(str(folder), files) == []


def test_checksum_reads_files_larger_than_one_chunk(tmp_path):
    path = tmp_path / "big.bin"
    data = _bytes(20 << 20, 3)  # 20 MiB: many chunks
    path.write_bytes(data)
    assert checksum_file(str(path)) == (len(data), zlib.crc32(data))


def test_each_kind_of_damage_is_named(tmp_path):
    folder = _checkpoint(tmp_path, 4)
    files = read_manifest(str(folder))
    with open(folder / "model.pt", "r+b") as f:
        f.truncate(100)
    (folder / "shard_0.pt").unlink()
    data = bytearray((folder / "shard_1.pt").read_bytes())
    data[800] ^= 0x01  # one bit, same size
    (folder / "shard_1.pt").write_bytes(bytes(data))
    with open(folder / "sub" / "script.py", "a") as f:
        f.write("#")
    problems = check_files(str(folder), files)
    flipped = zlib.crc32(bytes(data))
    assert problems == [
        FileProblem("global_step4", "model.pt", "truncated", 3000, 100),
        FileProblem("global_step4", "shard_0.pt", "missing", 1500),
        FileProblem("global_step4", "shard_1.pt", "checksum", files["shard_1.pt"].crc32, flipped),
        FileProblem(
            "global_step4",
            "sub/script.py",
            "size",
            files["sub/script.py"].size,
            files["sub/script.py"].size + 1,
        ),
    ]
    assert [p.describe() for p in problems] == [
        "model.pt is truncated (100 bytes, expected 3000)",
        "shard_0.pt is missing",
        f"shard_1.pt fails its checksum (crc32 {flipped:08x}, expected {files['shard_1.pt'].crc32:08x})",
        f"sub/script.py has {files['sub/script.py'].size + 1} bytes, expected {files['sub/script.py'].size}",
    ]
    # A rank hashes only its share; sizes it checks everywhere.
    assert [p.name for p in check_files(str(folder), files, checksums=["model.pt"])] == [
        "model.pt",
        "shard_0.pt",
        "sub/script.py",
    ]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ranks_of_a_load_hash_every_file_once(world):
    files = {f"f{i}": FileRecord(10, 0, i % 4) for i in range(9)}
    shares = [assign_checks(files, r, world) for r in range(world)]
    assert sorted(n for share in shares for n in share) == sorted(files)
    if world == 2:  # on the world size that saved, a rank hashes what its rank number wrote
        assert shares[1] == [n for n, r in files.items() if r.rank in (1, 3)]


def _verify(folder: Path, capsys) -> tuple[int, list[str]]:
    code = cli.main(["verify", str(folder)])
    return code, capsys.readouterr().out.splitlines()


def test_verify_prints_one_line_per_checkpoint_and_exits_1_on_damage(tmp_path, capsys):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step, manifest=step != 2)
    (tmp_path / "global_step8").mkdir()  # a save that did not finish
    (tmp_path / "global_step8" / "model.pt").write_bytes(b"x")
    code, lines = _verify(tmp_path, capsys)
    assert code == 0
    assert lines == [
        "global_step8: incomplete (no adabatch_complete.json: its save did not finish), skipped",
        "global_step6: ok, step 6, 4 files, 6.2 kB",
        "global_step4: ok, step 4, 4 files, 6.2 kB",
        "global_step2: unverified (saved without a manifest), step 2",
    ]
    with open(tmp_path / "global_step6" / "model.pt", "r+b") as f:
        f.truncate(10)
    code, lines = _verify(tmp_path, capsys)
    assert code == 1
    assert lines[1] == "global_step6: BAD, model.pt is truncated (10 bytes, expected 3000)"
    assert lines[2].startswith("global_step4: ok")


def test_verify_of_one_checkpoint_folder_and_of_a_damaged_record(tmp_path, capsys):
    for step in (4, 6):
        _checkpoint(tmp_path, step)
    assert _verify(tmp_path / "global_step4", capsys) == (0, ["global_step4: ok, step 4, 4 files, 6.2 kB"])
    (tmp_path / "global_step6" / "adabatch_complete.json").write_text("{not json")
    code, lines = _verify(tmp_path, capsys)
    assert code == 1 and lines[0] == "global_step6: BAD, its adabatch_complete.json cannot be read (damaged)"
    assert lines[1].startswith("global_step4: ok")


def test_verify_names_a_trainer_checkpoint_unverified(tmp_path, capsys):
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text("{}")
    assert _verify(tmp_path, capsys) == (
        0,
        ["checkpoint-8: unverified (a Hugging Face Trainer checkpoint: no manifest)"],
    )


def test_verify_of_a_folder_without_checkpoints_exits_1(tmp_path, capsys):
    assert _verify(tmp_path, capsys) == (1, [f"{tmp_path}: no complete checkpoint"])
    assert _verify(tmp_path / "absent", capsys) == (1, [f"{tmp_path / 'absent'}: no such folder"])


def test_verify_imports_neither_torch_nor_deepspeed(tmp_path):
    _checkpoint(tmp_path, 2)
    code = (
        "import sys; from ds_adabatch import cli; rc = cli.main(['verify', sys.argv[1]]); "
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("global_step2: ok")


def test_a_universal_copy_is_reused_only_for_the_save_it_was_converted_from(tmp_path):
    from ds_adabatch.checkpoint_manifest import COMPLETE_FILE, hash_folder, manifest_json
    from ds_adabatch.runtime.checkpoint import universal

    src, out = tmp_path / "global_step6", tmp_path / "global_step6_universal"
    src.mkdir()
    out.mkdir()
    (src / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    (out / "weights.pt").write_bytes(b"y")
    (out / universal._SOURCE_FILE).write_text(json.dumps(universal._source_fingerprint(str(src))))
    (out / COMPLETE_FILE).write_text(json.dumps({"files": manifest_json(hash_folder(str(out)))}))
    assert not universal._needs_conversion(str(out), str(src))
    (src / COMPLETE_FILE).write_text("{}")  # the source's own record is not part of what it saved
    assert not universal._needs_conversion(str(out), str(src))
    (src / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"z")  # saved over since
    assert universal._needs_conversion(str(out), str(src))
    (out / universal._SOURCE_FILE).write_text("{damaged")  # an unreadable record of its source
    assert universal._needs_conversion(str(out), str(src))
    (out / universal._SOURCE_FILE).unlink()  # a copy made before copies recorded their source
    (out / COMPLETE_FILE).write_text(json.dumps({"files": manifest_json(hash_folder(str(out)))}))
    assert not universal._needs_conversion(str(out), str(src)), "trusted where it verifies"

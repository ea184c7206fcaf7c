"""The manifest of a checkpoint: every file's size and CRC-32, so a load can tell a damaged file.

Each rank records the files it wrote (hashed right after writing, while they are still in the page
cache) in ``<tag>/adabatch_manifest_rank<r>.json``; once every rank finished, rank 0 merges those parts,
adds the files no rank recorded (DeepSpeed's recovery scripts, say), and the merged manifest goes into
the tag's completion record ``adabatch_complete.json``. A checkpoint whose record has no ``files`` entry
was written before manifests existed: it loads unverified.

Standard library only, so that ``ds-adabatch verify`` checks a folder without importing torch.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "COMPLETE_FILE",
    "atomic_write",
    "CheckpointCorrupt",
    "FileProblem",
    "FileRecord",
    "assign_checks",
    "check_files",
    "checksum_file",
    "describe_skipped",
    "hash_folder",
    "merge_parts",
    "read_manifest",
    "read_record",
    "verify_folder",
    "write_part",
]

COMPLETE_FILE = "adabatch_complete.json"
PART_PREFIX = "adabatch_manifest_rank"
UNIVERSAL_SUFFIX = "_universal"
_CHUNK = 1 << 20


class CheckpointCorrupt(RuntimeError):
    """No checkpoint that a load may use verifies against its manifest (nothing was loaded).

    ``problems`` holds the first damaged file of each checkpoint tried, newest first.
    """

    def __init__(self, message: str, problems: list[FileProblem]) -> None:
        super().__init__(message)
        self.problems = problems


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as it was written."""

    size: int
    """Bytes."""
    crc32: int
    """``zlib.crc32`` of its bytes."""
    rank: int
    """The global rank that wrote it (a load checks it on that rank, modulo the world size)."""


@dataclass(frozen=True)
class FileProblem:
    """A file of a checkpoint that is not as its manifest says."""

    tag: str
    name: str
    """Path inside the tag's folder."""
    kind: str
    """``"missing"``, ``"truncated"``, ``"size"`` (larger than written) or ``"checksum"``."""
    expected: int
    """The size written (bytes), or for ``"checksum"`` the CRC-32 written."""
    found: int = 0
    """The size found, or for ``"checksum"`` the CRC-32 computed."""

    def describe(self) -> str:
        """``<name> is truncated (100 bytes, expected 4096)`` and the like."""
        if self.kind == "missing":
            return f"{self.name} is missing"
        if self.kind == "truncated":
            return f"{self.name} is truncated ({self.found} bytes, expected {self.expected})"
        if self.kind == "size":
            return f"{self.name} has {self.found} bytes, expected {self.expected}"
        return f"{self.name} fails its checksum (crc32 {self.found:08x}, expected {self.expected:08x})"


def checksum_file(path: str) -> tuple[int, int]:
    """``(size, crc32)`` of the file at ``path``, read in 1 MiB chunks."""
    crc = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def write_part(folder: str, rank: int, paths: Iterable[str]) -> None:
    """Record the files ``rank`` wrote into ``folder`` (paths outside it are not part of the checkpoint)."""
    root = os.path.realpath(folder)
    records = {}
    for path in paths:
        rel = os.path.relpath(os.path.realpath(path), root)
        if rel.startswith(os.pardir) or not os.path.isfile(path):
            continue
        size, crc = checksum_file(path)
        records[rel.replace(os.sep, "/")] = {"size": size, "crc32": crc, "rank": rank}
    atomic_write(os.path.join(folder, f"{PART_PREFIX}{rank}.json"), json.dumps(records))


def merge_parts(folder: str, rank: int = 0) -> dict[str, FileRecord]:
    """The whole checkpoint's manifest: every rank's part, plus every other file of ``folder`` (hashed
    here, as written by ``rank``). The parts are deleted."""
    files: dict[str, FileRecord] = {}
    parts = [n for n in os.listdir(folder) if n.startswith(PART_PREFIX) and n.endswith(".json")]
    for name in sorted(parts):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            files.update({k: FileRecord(**v) for k, v in json.load(f).items()})
    for rel in _walk(folder):
        if rel not in files:
            size, crc = checksum_file(os.path.join(folder, rel))
            files[rel] = FileRecord(size, crc, rank)
    for name in parts:
        os.remove(os.path.join(folder, name))
    return files


def hash_folder(folder: str, rank: int = 0) -> dict[str, FileRecord]:
    """A manifest of every file in ``folder`` (but its completion record), as written by ``rank``."""
    return {rel: FileRecord(*checksum_file(os.path.join(folder, rel)), rank) for rel in _walk(folder)}


def _walk(folder: str) -> list[str]:
    found = []
    for here, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(here, name), folder).replace(os.sep, "/")
            if rel == COMPLETE_FILE or name.startswith(PART_PREFIX) or ".tmp" in name:
                continue
            found.append(rel)
    return sorted(found)


def read_record(folder: str) -> dict | None:
    """The completion record of the checkpoint in ``folder`` as written, or None if it has none
    (incomplete) or it cannot be read."""
    try:
        with open(os.path.join(folder, COMPLETE_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_manifest(folder: str) -> dict[str, FileRecord] | None:
    """The manifest in the completion record of ``folder``; None when the checkpoint has none (written
    before manifests existed, or incomplete)."""
    record = read_record(folder)
    if record is None or not isinstance(record.get("files"), dict):
        return None
    return {name: FileRecord(**entry) for name, entry in record["files"].items()}


def manifest_json(files: dict[str, FileRecord]) -> dict[str, dict[str, int]]:
    """The manifest as it is stored in the completion record."""
    return {n: {"size": r.size, "crc32": r.crc32, "rank": r.rank} for n, r in sorted(files.items())}


def check_files(
    folder: str, files: dict[str, FileRecord], checksums: Iterable[str] | None = None
) -> list[FileProblem]:
    """Problems of ``folder`` against its manifest: every file's size, and the CRC-32 of those named in
    ``checksums`` (all when None). Sorted by file name; empty when everything verifies."""
    tag = os.path.basename(os.path.normpath(folder))
    hashed = set(files) if checksums is None else set(checksums)
    problems = []
    for name, want in sorted(files.items()):
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(FileProblem(tag, name, "missing", want.size))
            continue
        if size != want.size:
            problems.append(
                FileProblem(tag, name, "truncated" if size < want.size else "size", want.size, size)
            )
        elif name in hashed:
            try:
                _, crc = checksum_file(path)
            except OSError:  # removed (or made unreadable) since its size was read
                problems.append(FileProblem(tag, name, "missing", want.size))
                continue
            if crc != want.crc32:
                problems.append(FileProblem(tag, name, "checksum", want.crc32, crc))
    return problems


def assign_checks(files: dict[str, FileRecord], rank: int, world: int) -> list[str]:
    """The files whose CRC-32 ``rank`` of ``world`` checks at a load: those its rank number wrote at the
    save (the files it reads again on the same world size), by writer rank modulo ``world``, so that
    together the ranks check every file once."""
    return [name for name, r in files.items() if r.rank % world == rank]


def describe_skipped(skipped: list[FileProblem], save_dir: str) -> str:
    """``checkpoint DIR/global_step8: X is missing; checkpoint DIR/global_step6: ...`` (the first problem
    of each checkpoint)."""
    return "; ".join(f"checkpoint {os.path.join(save_dir, p.tag)}: {p.describe()}" for p in skipped)


def verify_folder(save_dir: str) -> tuple[list[str], bool]:
    """Check every checkpoint in ``save_dir`` completely (``ds-adabatch verify``): one line per
    checkpoint folder, newest first, and whether all complete ones verify (False also when there is
    none). Folders without a completion record are listed as incomplete and do not count; a record that
    cannot be read is BAD. ``save_dir`` may also be one checkpoint's own folder."""
    if not os.path.isdir(save_dir):
        return [f"{save_dir}: no such folder"], False
    entries = []
    # One checkpoint's own folder (a tag: it holds the completion record) is checked as itself.
    own = os.path.exists(os.path.join(save_dir, COMPLETE_FILE))
    parent = os.path.dirname(os.path.normpath(save_dir)) if own else save_dir
    names = [os.path.basename(os.path.normpath(save_dir))] if own else os.listdir(save_dir)
    for name in names:
        folder = os.path.join(parent, name)
        if not os.path.isdir(folder):
            continue
        record = read_record(folder)
        named = re.fullmatch(r"global_step(\d+)(?:_universal)?", name)
        step = record.get("global_steps", -1) if record else int(named.group(1)) if named else -1
        entries.append((step, name, folder, record))
    lines, ok, complete = [], True, 0
    for step, name, folder, record in sorted(entries, key=lambda e: (e[0], e[1]), reverse=True):
        if record is None and os.path.isfile(os.path.join(folder, "trainer_state.json")):
            complete += 1  # written by transformers' Trainer, which keeps no manifest
            lines.append(f"{name}: unverified (a Hugging Face Trainer checkpoint: no manifest)")
            continue
        if record is None and os.path.exists(os.path.join(folder, COMPLETE_FILE)):
            ok = False  # the save finished, and its record has been damaged since: nothing vouches for it
            lines.append(f"{name}: BAD, its {COMPLETE_FILE} cannot be read (damaged)")
            continue
        if record is None:
            if any(n.endswith((".pt", ".json")) for n in os.listdir(folder)):
                lines.append(f"{name}: incomplete (no {COMPLETE_FILE}: its save did not finish), skipped")
            continue
        complete += 1
        files = read_manifest(folder)
        if files is None:
            lines.append(f"{name}: unverified (saved without a manifest), step {step}")
            continue
        problems = check_files(folder, files)
        if problems:
            ok = False
            lines.append(f"{name}: BAD, " + "; ".join(p.describe() for p in problems))
        else:
            size = sum(r.size for r in files.values())
            lines.append(f"{name}: ok, step {step}, {len(files)} files, {_size_text(size)}")
    if complete == 0:
        lines.append(f"{save_dir}: no complete checkpoint")
        ok = False
    return lines, ok


def _size_text(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one (fsync, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

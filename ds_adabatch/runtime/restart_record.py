"""What a process that had to exit on an out-of-memory error leaves for the next start, next to the checkpoints.

An out-of-memory error after a pass's agreement point (ZeRO-3 after a parameter gather, ZeRO-1/2 after a
gradient bucket was reduced during backward, the optimizer step) cannot be re-planned inside the step:
the other ranks may be inside a later collective. The failing rank writes
``<checkpoint folder>/adabatch_oom_rank<r>.json`` (the memory key, the size that failed in the limit's
unit, where) and its process exits with :data:`OOM_RESTART_EXIT_CODE`. The next start
(``torchrun --max-restarts``, or a person) calls ``load_checkpoint`` on that folder: every rank reads
every record there and plans below the size that failed, whatever checkpoint it resumes from
(:meth:`~ds_adabatch.runtime.memory.MicroBatchMemory.impose`). Once a checkpoint holding that knowledge is
complete, rank 0 deletes the records it was built from.

The checkpoint folder is the one of the engine's last ``save_checkpoint`` or ``load_checkpoint`` call
(a ``load_checkpoint`` that found no checkpoint counts: the main job's ``--resume`` folder).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass

__all__ = [
    "OOM_RESTART_EXIT_CODE",
    "OomRecord",
    "new_record",
    "read_records",
    "remove_records",
    "write_record",
]

OOM_RESTART_EXIT_CODE = 75
"""Exit status of a process that ended on an unrecoverable out-of-memory error after recording the
limit it learned (``EX_TEMPFAIL``: start it again; the next start plans below the size that failed)."""

_VERSION = 1
_PATTERN = "adabatch_oom_rank*.json"


@dataclass(frozen=True)
class OomRecord:
    """One unrecoverable out-of-memory error, as written by the rank that raised it."""

    key: str
    """``repr`` of the memory key (``engine.set_memory_key``) in force."""
    failed: int
    """The size that failed, in the limit's unit (samples per pass, or tokens per pass)."""
    rank: int
    where: str
    """Where it happened, as the error message says it (the micro-batch and step, or the optimizer step)."""
    written_at: float


def write_record(folder: str, record: OomRecord) -> str:
    """Write ``record`` atomically into ``folder``; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"adabatch_oom_rank{record.rank}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": _VERSION, **asdict(record)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader sees the old record or the new one, never half of one
    return path


def read_records(folder: str) -> list[tuple[str, OomRecord]]:
    """Every record in ``folder`` as ``(path, record)``, oldest first; unreadable files are skipped
    (a record is advice: a start never fails on one)."""
    found = []
    for path in glob.glob(os.path.join(folder, _PATTERN)):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if data.pop("version", None) != _VERSION:
                continue
            found.append((path, OomRecord(**data)))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda item: item[1].written_at)


def remove_records(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def new_record(key: Hashable, failed: int, *, rank: int, where: str) -> OomRecord:
    return OomRecord(key=repr(key), failed=int(failed), rank=rank, where=where, written_at=time.time())

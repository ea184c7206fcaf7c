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
import logging
import os
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass
from typing import Any

from .memory import parse_key

__all__ = [
    "OOM_RESTART_EXIT_CODE",
    "OomRecord",
    "RestartRecords",
    "new_record",
    "read_records",
    "remove_records",
    "write_record",
]

logger = logging.getLogger("ds_adabatch")

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


class RestartRecords:
    """One engine's side of the records: where to write, and which records it imposed (per rank)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.folder: str | None = None  # the checkpoint folder of the last save or load
        self._imposed: dict[str, float] = {}  # path -> written_at of the records imposed on the limits

    def record(self, error: Any, key: Hashable, failed: int, *, where: str) -> None:
        """Write this rank's record and say so in ``error`` (an ``UnrecoverableOutOfMemory``, whose
        ``exit_code`` becomes :data:`OOM_RESTART_EXIT_CODE`); without a folder it only says why not."""
        if self.folder is None:
            error.args = (
                f"{error.args[0]}. The limit is not recorded: no checkpoint folder is known (call "
                "save_checkpoint or load_checkpoint before training), so a restart would fail the same way",
            )
            return
        path = write_record(self.folder, new_record(key, failed, rank=self.rank, where=where))
        error.exit_code, error.record = OOM_RESTART_EXIT_CODE, path
        error.args = (
            f"{error.args[0]}. Recorded in {path}: end this process with exit code {error.exit_code} "
            f"(ds_adabatch.finish(exc.exit_code)); the next start (torchrun --max-restarts) resumes from "
            f"the last complete checkpoint in {self.folder} and plans below {failed}",
        )

    def impose(self, folder: str, memory: Any, unit: str) -> None:
        """Impose every record in ``folder`` not imposed yet on ``memory`` (a ``MicroBatchMemory``)."""
        self.folder = folder
        for path, record in read_records(folder):
            if self._imposed.get(path) == record.written_at:
                continue
            self._imposed[path] = record.written_at
            memory.impose(parse_key(record.key), record.failed)
            if self.rank == 0:
                logger.warning(
                    "out-of-memory record %s: rank %d could not recover at %d %s per pass (%s); "
                    "planning below it",
                    path, record.rank, record.failed, unit, record.where,
                )  # fmt: skip

    def saved(self, folder: str) -> None:
        """A complete checkpoint in ``folder`` holds what the imposed records taught: rank 0 deletes them."""
        self.folder = folder
        if self.rank == 0 and self._imposed:
            remove_records(list(self._imposed))
        self._imposed = {}

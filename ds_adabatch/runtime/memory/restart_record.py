"""What a process that had to exit on an out-of-memory error leaves for the next start.

An out-of-memory error after a pass's agreement point (ZeRO-3 after a parameter gather, ZeRO-1/2 after a
gradient bucket was reduced during backward; any pass under tensor parallelism; the forward / backward /
step loop) cannot be re-planned inside the step: the other ranks may be inside a later collective. The
failing rank writes ``adabatch_oom_rank<r>.json`` (the memory key, the size that failed in the limit's
unit, where) and its process exits with :data:`OOM_RESTART_EXIT_CODE`. The next start plans below the
size that failed (:meth:`~ds_adabatch.runtime.memory.limit.MicroBatchMemory.impose`). (An error inside the
optimizer step is not recorded: a smaller micro-batch does not shrink it; the error says what does.)

Where the record goes, and where the next start finds it:

- ``adabatch.memory.record_dir`` when set: written there, read when the engine is built;
- else the checkpoint folder of the engine's last ``save_checkpoint`` or ``load_checkpoint`` call (a
  ``load_checkpoint`` that found no checkpoint counts: the job's ``--resume`` folder), read by the next
  start's ``load_checkpoint`` of that folder;
- else (no checkpoint call yet) ``adabatch_oom_records/`` in the working directory, read when the
  engine is built only by a restart of the same launch (torchrun's ``TORCHELASTIC_RESTART_COUNT`` above
  0 and the same ``TORCHELASTIC_RUN_ID``), which begins from step 0 again: a new launch ignores them.

Each read is merged over every rank (one gather), so every rank plans below the same sizes even where a
folder is local to one node. Once a complete checkpoint holds what the records taught, each rank deletes
the records it read.
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
from typing import TYPE_CHECKING, Any

from .limit import parse_key

if TYPE_CHECKING:
    from .limit import MicroBatchMemory
    from .oom import UnrecoverableOutOfMemory

__all__ = [
    "DEFAULT_RECORD_DIR",
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

DEFAULT_RECORD_DIR = "adabatch_oom_records"
"""Where records go before any checkpoint folder is known (relative to the working directory)."""


@dataclass(frozen=True)
class OomRecord:
    """One unrecoverable out-of-memory error, as written by the rank that raised it."""

    key: str
    """``repr`` of the memory key (``engine.set_memory_key``) in force."""
    failed: int
    """The size that failed, in the limit's unit (samples per pass, or tokens per pass)."""
    rank: int
    where: str
    """Where it happened, as the error message says it (the micro-batch and step)."""
    written_at: float
    run: str = ""
    """The launch that wrote it (torchrun's ``TORCHELASTIC_RUN_ID``; empty without torchrun)."""
    good: int = 0
    """The largest size that had completed a step under ``key`` (0: none), where the next start plans."""


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


def new_record(key: Hashable, failed: int, *, rank: int, where: str, good: int = 0) -> OomRecord:
    return OomRecord(
        key=repr(key),
        failed=int(failed),
        rank=rank,
        where=where,
        written_at=time.time(),
        run=_run_id(),
        good=int(good),
    )


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def _gather(records: list[OomRecord]) -> list[OomRecord]:
    """Every rank's ``records``, merged (one gather over the host group; nothing in a world of one)."""
    from ..distributed.agreement import host_group

    group = host_group()
    if group is None:
        return records
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records, group=group)
    merged = {(r.rank, r.written_at): r for mine in everyone for r in mine}
    return sorted(merged.values(), key=lambda r: r.written_at)


class RestartRecords:
    """One engine's side of the records: where to write, and which records it imposed (per rank).

    ``record_dir``: ``adabatch.memory.record_dir`` (None: the checkpoint folder, else the default folder).
    """

    def __init__(self, rank: int, record_dir: str | None = None) -> None:
        self.rank = rank
        self.record_dir = record_dir
        self.folder: str | None = None  # the checkpoint folder of the last save or load
        # The working directory of this start, whatever the script does with it later.
        self.default_dir = os.path.abspath(DEFAULT_RECORD_DIR)
        self._imposed: set[tuple[int, float]] = set()  # (rank, written_at) of records imposed
        self._read: list[str] = []  # paths this rank read records from (deleted once a checkpoint holds them)

    def record(
        self, error: UnrecoverableOutOfMemory, key: Hashable, failed: int, *, where: str, good: int = 0
    ) -> None:
        """Write this rank's record and say so in ``error`` (an ``UnrecoverableOutOfMemory``, whose
        ``exit_code`` becomes :data:`OOM_RESTART_EXIT_CODE`); ``good``: the largest size that ran clean."""
        folder = self.record_dir or self.folder or self.default_dir
        path = write_record(folder, new_record(key, failed, rank=self.rank, where=where, good=good))
        error.exit_code, error.record = OOM_RESTART_EXIT_CODE, path
        if self.folder is not None:
            resume = f"resumes from the last complete checkpoint in {self.folder}"
        else:
            resume = (
                "starts from step 0 again (no checkpoint folder is known: save_checkpoint or "
                "load_checkpoint was never called)"
            )
        error.args = (
            f"{error.args[0]}. Recorded in {path}: end this process with exit code {error.exit_code} "
            f"(ds_adabatch.finish(exc.exit_code)); the next start (torchrun --max-restarts) {resume} and "
            f"plans below {failed}",
        )

    def start(self, memory: MicroBatchMemory, unit: str) -> None:
        """At engine construction, on every rank: impose the records in ``record_dir``, or, on a
        restart, those this launch left in the default folder before it knew a checkpoint folder."""
        if self.record_dir is not None:
            self._impose(self.record_dir, memory, unit, same_run=False)
            return
        # The default folder counts only in a restart of this launch (a new launch keeps other
        # launches' records out). Every rank gathers, also with nothing to add: torchrun's agents can
        # disagree on the restart count (a failure restarts one node's workers with the count + 1; the
        # membership change it causes restarts another node's with the count unchanged), and a gather
        # on some ranks only would leave the others waiting in their next collective.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        self._impose(self.default_dir, memory, unit, same_run=True, read=restarted)

    def impose(self, folder: str, memory: MicroBatchMemory, unit: str) -> None:
        """Impose every record in ``folder`` not imposed yet on ``memory`` (a ``MicroBatchMemory``), and
        record there from now on (unless ``record_dir`` is set). On every rank."""
        self.folder = folder
        self._impose(folder, memory, unit, same_run=False)

    def _impose(
        self, folder: str, memory: MicroBatchMemory, unit: str, *, same_run: bool, read: bool = True
    ) -> None:
        run = _run_id()
        found = [(p, r) for p, r in read_records(folder) if not same_run or r.run == run] if read else []
        self._read += [p for p, _ in found if p not in self._read]
        for record in _gather([r for _, r in found]):
            ident = (record.rank, record.written_at)
            if ident in self._imposed:
                continue
            self._imposed.add(ident)
            memory.impose(parse_key(record.key), record.failed, record.good)
            if self.rank == 0:
                logger.warning(
                    "out-of-memory record of rank %d in %s: it could not recover at %d %s per pass (%s); "
                    "planning below it",
                    record.rank, folder, record.failed, unit, record.where,
                )  # fmt: skip

    def saved(self, folder: str) -> None:
        """A complete checkpoint in ``folder`` holds what the imposed records taught: each rank deletes
        the records it read."""
        self.folder = folder
        if self._imposed:
            remove_records(self._read)
        self._read = []
        self._imposed = set()

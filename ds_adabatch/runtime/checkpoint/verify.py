"""Checkpoints that verify themselves: the manifest written at save, checked by every rank at load.

At save each rank hashes the files it wrote (DeepSpeed's, through its checkpoint engine, and the RNG
file) right after writing them and records them in a part of the manifest; rank 0 merges the parts into
the completion record (:mod:`ds_adabatch.checkpoint_manifest`). At load, before DeepSpeed reads
anything, every rank checks the size of every file and the CRC-32 of the files its rank number wrote;
one all-gather makes the verdict the same everywhere. A damaged newest checkpoint is skipped for the
newest one that verifies, with one line on rank 0; when none verifies, :class:`CheckpointCorrupt` is
raised on every rank before anything is loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from ... import checkpoint_manifest as manifest
from ...checkpoint_manifest import CheckpointCorrupt
from . import universal as elastic_ckpt

__all__ = ["CheckpointCorrupt", "choose_checkpoint", "recording_writes", "verify_tag"]

logger = logging.getLogger("ds_adabatch")


@contextlib.contextmanager
def recording_writes(ds_engine) -> Iterator[list[str]]:
    """The paths DeepSpeed's checkpoint engine writes while inside (listed as each write ends).

    DeepSpeed 0.19.8 writes every file of a checkpoint (model states, ZeRO shards, pipeline layers,
    MoE experts) through ``engine.checkpoint_engine.save(state_dict, path)``; the instance's ``save`` is
    wrapped for the duration of one ``save_checkpoint`` and restored after.
    """
    written: list[str] = []
    engine = getattr(ds_engine, "checkpoint_engine", None)
    if engine is None or engine.is_decoupled():
        # A decoupled (asynchronous) engine finishes its writes later: nothing is hashed here, and the
        # files no part lists are hashed by rank 0 when the checkpoint is marked complete.
        yield written
        return
    previous = vars(engine).get("save")  # a wrapper someone else installed stays in place
    real = engine.save

    def save(state_dict, path, *args, **kwargs):
        result = real(state_dict, path, *args, **kwargs)
        written.append(str(path))
        return result

    engine.save = save
    try:
        yield written
    finally:
        if previous is None:
            del engine.save  # the class's method again
        else:
            engine.save = previous


def verify_tag(load_dir: str, tag: str, rank: int, world: int) -> manifest.FileProblem | None | bool:
    """Collective: the first problem any rank found in ``tag`` (the same on every rank); None when it
    verifies; False when it has no manifest (saved before manifests existed: unverified)."""
    folder = os.path.join(load_dir, tag)
    files = manifest.read_manifest(folder)
    found: manifest.FileProblem | None | bool = False
    if files is not None:
        problems = manifest.check_files(folder, files, manifest.assign_checks(files, rank, world))
        found = problems[0] if problems else None
    gathered = _all_gather(found)
    for got in gathered:  # rank order: every rank picks the same one
        if isinstance(got, manifest.FileProblem):
            return got
    return None if any(got is None for got in gathered) else False


def choose_checkpoint(load_dir: str, tag: str | None, rank: int, world: int) -> str | None:
    """Collective: the tag a load reads. ``tag`` None: the newest complete checkpoint that verifies
    (None when there is no complete checkpoint); a damaged newer one is skipped with one line on rank 0.
    A named ``tag`` must verify. Raises :class:`CheckpointCorrupt` when nothing usable verifies."""
    if tag is not None:
        candidates = [tag]
    else:
        candidates = [i.tag for i in reversed(elastic_ckpt.complete_checkpoints(load_dir))]
        if not candidates:  # a folder written before completion records: DeepSpeed's ``latest``
            latest = elastic_ckpt.latest_complete_tag(load_dir)
            candidates = [latest] if latest else []
        if not candidates:
            return None
    skipped: list[manifest.FileProblem] = []
    for candidate in candidates:
        verdict = verify_tag(load_dir, candidate, rank, world)
        if isinstance(verdict, manifest.FileProblem):
            skipped.append(verdict)
            continue
        if rank == 0:
            _report(load_dir, candidate, verdict, skipped)
        return candidate
    what = (
        f"checkpoint {os.path.join(load_dir, tag)} does not verify"
        if tag
        else f"no checkpoint in {load_dir} verifies"
    )
    raise CheckpointCorrupt(
        f"{what}, so nothing was loaded "
        f"({manifest.describe_skipped(skipped, load_dir)}): restore the damaged files, or start without "
        "resuming",
        skipped,
    )


def _report(load_dir: str, tag: str, verdict: bool | None, skipped: list[manifest.FileProblem]) -> None:
    info = elastic_ckpt.read_marker(load_dir, tag)
    step = f" (step {info.global_steps})" if info is not None else ""
    if skipped:
        logger.warning("%s; resuming from %s%s", manifest.describe_skipped(skipped, load_dir), tag, step)
    if verdict is False and os.path.isdir(os.path.join(load_dir, tag)):
        logger.warning(
            "checkpoint %s was saved without a manifest (before ds_adabatch verified checkpoints): "
            "loading it unverified",
            os.path.join(load_dir, tag),
        )


def _all_gather(value: object) -> list[object]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out

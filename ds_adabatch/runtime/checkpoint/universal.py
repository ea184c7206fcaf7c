"""Crash-safe checkpoint folders and resume on another data-parallel size, ZeRO 0-3.

A checkpoint tag counts as complete only once every rank finished writing it: after the ranks meet at a
barrier, rank 0 writes ``<tag>/adabatch_complete.json`` (the tag's world size, ZeRO stage, step and
samples) and only then points DeepSpeed's ``latest`` file at the tag (atomically). A rank that dies while
saving leaves a tag without that file, and :func:`latest_complete_tag` skips it. The record also holds the
checkpoint's manifest (every file's size and CRC-32: :mod:`ds_adabatch.checkpoint_manifest`), which a
load checks first (:mod:`ds_adabatch.runtime.checkpoint.verify`).

DeepSpeed 0.19.8 refuses to load a ZeRO 1-3 checkpoint on another data-parallel size. For that case
:func:`ensure_universal` converts the tag to DeepSpeed's universal format once (on rank 0, the others wait
at a barrier) into ``<tag>_universal`` beside it, with a manifest of its own, and later resumes reuse that
copy while it verifies.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass

from ... import checkpoint_manifest as manifest
from ..distributed import comm

__all__ = [
    "CheckpointInfo",
    "complete_checkpoints",
    "conversion_needed",
    "ensure_universal",
    "latest_complete_tag",
    "prune_checkpoints",
    "saved_layout",
    "universal_refusal",
]

logger = logging.getLogger("ds_adabatch")

COMPLETE_FILE = manifest.COMPLETE_FILE
UNIVERSAL_SUFFIX = manifest.UNIVERSAL_SUFFIX
_MARKER_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    """What a complete checkpoint tag holds (read from its ``adabatch_complete.json``)."""

    tag: str
    world_size: int
    """Data-parallel ranks that wrote it."""
    zero_stage: int
    global_steps: int
    """Optimizer steps taken before the save."""
    global_samples: int
    """Training samples consumed before the save."""
    saved_at: float
    """Unix time (seconds) at which the last rank finished writing."""


def mark_complete(
    save_dir: str,
    info: CheckpointInfo,
    *,
    update_latest: bool = True,
    files: dict[str, manifest.FileRecord] | None = None,
    folder: str | None = None,
) -> None:
    """Rank 0, after every rank finished writing ``info.tag``: the marker (with the checkpoint's
    manifest ``files``), then ``latest``. ``folder``: where the marker goes when not ``<save_dir>/<tag>``."""
    payload = {"version": _MARKER_VERSION, **asdict(info)}
    if files is not None:
        payload["files"] = manifest.manifest_json(files)
    folder = folder or os.path.join(save_dir, info.tag)
    manifest.atomic_write(os.path.join(folder, COMPLETE_FILE), json.dumps(payload))
    if update_latest:
        manifest.atomic_write(os.path.join(save_dir, "latest"), info.tag)


def read_marker(save_dir: str, tag: str) -> CheckpointInfo | None:
    """The tag's completion record, or ``None`` when the tag is incomplete (or not ours)."""
    data = manifest.read_record(os.path.join(save_dir, tag))
    if data is None or data.pop("version", None) != _MARKER_VERSION:
        return None
    data.pop("files", None)  # the manifest: read by checkpoint_manifest.read_manifest
    try:
        return CheckpointInfo(**data)
    except TypeError:  # a record of another layout: not one this version wrote
        return None


def complete_checkpoints(save_dir: str) -> list[CheckpointInfo]:
    """Every complete checkpoint tag in ``save_dir``, oldest first (by step, then save time)."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir) if not n.endswith(UNIVERSAL_SUFFIX)]
    found = [read_marker(save_dir, name) for name in names]
    return sorted((i for i in found if i is not None), key=lambda i: (i.global_steps, i.saved_at))


def latest_complete_tag(save_dir: str) -> str | None:
    """The tag a resume should load: the newest complete one.

    Folders written before completion markers existed (no tag has one) fall back to DeepSpeed's
    ``latest`` file. Returns ``None`` when there is nothing to resume from.
    """
    complete = complete_checkpoints(save_dir)
    if complete:
        return complete[-1].tag
    latest = os.path.join(save_dir, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            return f.read().strip() or None
    return None


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Rank 0: delete all but the newest ``keep_last`` complete tags, their universal copies, and
    incomplete tags older than the newest complete one (left by a crash mid-save). Returns what went."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    complete = complete_checkpoints(save_dir)
    if not complete:
        return []
    keep = {i.tag for i in complete[-keep_last:]}
    newest = complete[-1]
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not os.path.isdir(path) or name in keep:
            continue
        base = name[: -len(UNIVERSAL_SUFFIX)] if name.endswith(UNIVERSAL_SUFFIX) else name
        if base in keep:
            continue
        info = read_marker(save_dir, base)
        if info is None:
            # Incomplete: only tags DeepSpeed named by step, and older than the newest complete save.
            m = re.fullmatch(r"global_step(\d+)", base)
            if m is None or int(m.group(1)) >= newest.global_steps:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    if removed:
        logger.info("checkpoints: removed %s (keeping the last %d)", ", ".join(removed), keep_last)
    return removed


def saved_layout(save_dir: str, tag: str) -> tuple[int, int] | None:
    """``(data-parallel size, ZeRO stage)`` that wrote ``tag``, or ``None`` when it cannot be told."""
    info = read_marker(save_dir, tag)
    if info is not None:
        return info.world_size, info.zero_stage
    folder = os.path.join(save_dir, tag)
    optim = glob.glob(os.path.join(folder, "*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    if optim:
        return len(optim), -1  # some ZeRO stage >= 1; the stage itself is not in the file names
    return None


def conversion_needed(ds_engine: object, save_dir: str, tag: str, world_size: int) -> tuple[int, int] | None:
    """``tag``'s saved layout (:func:`saved_layout`) where loading it into ``ds_engine`` on ``world_size``
    data-parallel ranks needs the universal format: ZeRO 1-3 state written by another number of ranks,
    not already a universal copy or load. None: it loads as it is."""
    if (
        tag.endswith(UNIVERSAL_SUFFIX)
        or not ds_engine.zero_optimization_stage()  # type: ignore[attr-defined]
        or ds_engine.load_universal_checkpoint()  # type: ignore[attr-defined]
    ):
        return None
    layout = saved_layout(save_dir, tag)
    return layout if layout is not None and layout[0] != world_size else None


def universal_refusal(ds_engine: object, written_by: int) -> str | None:
    """Why a checkpoint written by ``written_by`` data-parallel ranks is not loaded into ``ds_engine``
    through the universal format, or None. DeepSpeed 0.19.8's ZeRO 3 universal load restores one
    optimizer parameter group correctly, not several: it gives every group the first group's settings
    (its weight decay included) and, measured on a 2 -> 1 rank resume of a GPT-2 whose biases and
    LayerNorm weights the Trainer puts in a group without weight decay, left those off by about 2% after
    the next step, where the one-group run matched to 1e-6."""
    groups = len(getattr(getattr(ds_engine, "optimizer", None), "param_groups", ()) or ())
    if ds_engine.zero_optimization_stage() != 3 or groups < 2:  # type: ignore[attr-defined]
        return None
    return (
        f"the checkpoint was written by {written_by} data-parallel ranks and this run's optimizer has "
        f"{groups} parameter groups under ZeRO 3, whose state DeepSpeed 0.19.8's universal checkpoint "
        f"restores wrongly beyond the first group: resume on {written_by} ranks, or build the optimizer "
        'with one parameter group (an "optimizer" section in the DeepSpeed config, or one group of '
        "your own), or use ZeRO 1 or 2"
    )


def ensure_universal(save_dir: str, tag: str, rank: int, info: CheckpointInfo | None = None) -> str:
    """The universal-format copy of ``tag`` (``<tag>_universal``), converting it once if needed.

    Call on every rank: rank 0 converts (with DeepSpeed's ``ds_to_universal``, in process) while the
    others wait at a barrier. The copy is written under a temporary name and renamed when done, so a
    crash mid-conversion never leaves a half copy that a later resume would reuse. Its completion record
    (what lets a later resume reuse it) is the tag's, or ``info`` where the tag has none (a checkpoint
    DeepSpeed's own ``save_checkpoint`` wrote, such as the Trainer's).
    """
    out_tag = tag + UNIVERSAL_SUFFIX
    out = os.path.join(save_dir, out_tag)
    error = ""
    if rank == 0 and _needs_conversion(out, os.path.join(save_dir, tag)):
        try:
            started = time.perf_counter()
            _convert(os.path.join(save_dir, tag), out, read_marker(save_dir, tag) or info)
            logger.warning(
                "converted checkpoint %s to DeepSpeed's universal format in %.1f s (cached as %s)",
                tag,
                time.perf_counter() - started,
                out_tag,
            )
        except KeyError as err:
            error = f"KeyError: {err}"
            if err.args and err.args[0] in ("exp_avg", "exp_avg_sq"):
                error = (
                    "DeepSpeed 0.19.8's universal checkpoint converts only an Adam-family optimizer state "
                    f"(exp_avg, exp_avg_sq) and this one has no {err.args[0]!r} (SGD, for instance): resume "
                    "on the data-parallel size that saved it, use ZeRO stage 0 (whose checkpoint loads on "
                    "any size), or an Adam-family optimizer"
                )
        except Exception as err:  # reported on every rank below, not as a hang at the barrier
            error = f"{type(err).__name__}: {err}"
    error = comm.gather_text(error)[0]  # rank 0's, on every rank (the barrier the others wait at)
    if error:
        raise RuntimeError(f"converting checkpoint {os.path.join(save_dir, tag)} to universal: {error}")
    return out_tag


_SOURCE_FILE = "adabatch_universal_source.json"
"""In a universal copy: the files of the tag it was converted from (name, size, modification time)."""


def _source_fingerprint(src: str) -> list[list[object]]:
    """The files of checkpoint folder ``src`` as a save left them: a save over the tag changes it."""
    entries = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name != COMPLETE_FILE and os.path.isfile(path):
            stat = os.stat(path)
            entries.append([name, stat.st_size, stat.st_mtime_ns])
    return entries


def _needs_conversion(out: str, src: str) -> bool:
    """Rank 0: no complete universal copy at ``out``, one converted from another save of the tag at
    ``src`` (saved over since; a copy made before copies recorded their source is trusted), or one that
    fails its manifest (converted again)."""
    if not os.path.isfile(os.path.join(out, COMPLETE_FILE)):
        return True
    source = os.path.join(out, _SOURCE_FILE)
    try:
        with open(source, encoding="utf-8") as f:
            stale = json.load(f) != _source_fingerprint(src)
    except FileNotFoundError:
        stale = False  # a copy made before copies recorded their source: trusted where it verifies
    except (OSError, ValueError):
        stale = True  # an unreadable record of its source
    if stale:
        logger.warning(
            "the cached universal copy %s is not of the checkpoint %s as it is now: converting it again",
            out,
            src,
        )
        return True
    files = manifest.read_manifest(out)
    problems = manifest.check_files(out, files) if files is not None else []
    if problems:
        logger.warning(
            "the cached universal copy %s fails verification (%s): converting it again",
            out,
            problems[0].describe(),
        )
    return bool(problems)


def _convert(src: str, out: str, info: CheckpointInfo | None) -> None:
    # deepspeed.checkpoint.ds_to_universal.main (0.19.8) takes its argparse namespace; one worker per
    # pass keeps it in this process (no forked pool inside a process that holds a process group).
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    args = Namespace(
        input_folder=src,
        output_folder=tmp,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    # The adabatch RNG files travel with the copy; its completion record gets the copy's own manifest
    # (the source's would name files the copy does not have).
    for f in glob.glob(os.path.join(src, "adabatch_*")):
        if os.path.basename(f) != COMPLETE_FILE and not os.path.basename(f).startswith(manifest.PART_PREFIX):
            shutil.copy2(f, tmp)
    with open(os.path.join(tmp, _SOURCE_FILE), "w", encoding="utf-8") as f:
        json.dump(_source_fingerprint(src), f)
    if info is not None:
        mark_complete(
            os.path.dirname(out), info, update_latest=False, files=manifest.hash_folder(tmp), folder=tmp
        )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    # ds_to_universal names the temporary folder in ``latest_universal``: point it at the final one.
    manifest.atomic_write(os.path.join(os.path.dirname(out), "latest_universal"), os.path.basename(out))

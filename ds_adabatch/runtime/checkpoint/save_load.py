"""Checkpoints of an adaptive engine (data-parallel or pipeline): DeepSpeed's plus the adabatch state.

The adabatch state (plan, schedule state, sampler cursor, exact sample and token counts, history, LR
coupling, signals) travels inside DeepSpeed's ``client_state`` under the key ``"ds_adabatch"``; each
rank's RNG state is written beside DeepSpeed's files (``adabatch_rng_rank{r}.pt``) so a resume on the same
world size continues bit-identically. All counts are global, so a resume on another world size
re-shards the same sample stream (the section itself: :mod:`.run_state`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ... import checkpoint_manifest as manifest
from .. import deepspeed_internals as internals
from ..distributed import comm
from . import universal as elastic_ckpt
from . import verify as checkpoint_verify
from .run_state import STATE_KEY, CheckpointedEngine, RunState, processes

__all__ = ["EngineCheckpoints", "HostSnapshots"]

logger = logging.getLogger("ds_adabatch")


class HostSnapshots(Protocol):
    """Live recovery's host-memory snapshots, as a checkpoint load sees them (``live/recovery.py``)."""

    restored_step: int | None
    """The step this process restored from host memory at start (None: none)."""

    def snapshot_now(self) -> None: ...


class EngineCheckpoints:
    """``save_checkpoint`` / ``load_checkpoint`` of one adaptive engine, and its adabatch section.

    Args:
        engine: the engine checkpointed (its public state, :class:`CheckpointedEngine`).
        data_state: the loader's state to save (see :class:`RunState`).
    """

    def __init__(self, engine: CheckpointedEngine, data_state: Callable[[], Any]) -> None:
        self.engine = engine
        self.run_state = RunState(engine, data_state)
        self.live: HostSnapshots | None = None
        """Live recovery's snapshots while it is armed: a load never goes back behind them."""

    # -- save ----------------------------------------------------------------------------------------
    def save(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        *,
        keep_last: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """The engine's ``save_checkpoint`` (its docstring says what a save writes and when)."""
        engine = self.engine
        ds = engine.deepspeed
        engine.resolve_losses()  # the saved signals (last loss, its EMA) must include every step
        tag = str(tag) if tag is not None else f"global_step{ds.global_steps}"
        state = dict(client_state or {})
        state[STATE_KEY] = engine.adabatch_state_dict()
        save_latest = kwargs.pop("save_latest", True)
        # DeepSpeed 0.19.8's save_checkpoint has rank 0 write ``latest`` before the other ranks are
        # known to have finished; that file is written below, after the barrier, instead.
        _check_tag(tag)
        clear_earlier_saves(save_dir, [tag], ds.local_rank)
        with checkpoint_verify.recording_writes(ds) as written:
            result = ds.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False, **kwargs)
        # Per-rank RNG streams (dropout, ...) make a same-world-size resume bit-identical.
        folder = os.path.join(save_dir, tag)
        os.makedirs(folder, exist_ok=True)
        written.append(os.path.join(folder, f"adabatch_rng_rank{engine.rank}.pt"))
        torch.save(_rng_state(), written[-1])
        # This rank's part of the manifest: the files it wrote, hashed while still in the page cache.
        manifest.write_part(folder, engine.rank, written)
        comm.barrier()  # every rank has written all of its files
        if engine.rank == 0:
            self._mark_complete(save_dir, tag, folder, save_latest, keep_last)
        engine.memory_recovery.checkpoint_saved(save_dir)  # out-of-memory records it now holds go
        comm.barrier()
        return result

    def _mark_complete(
        self, save_dir: str, tag: str, folder: str, save_latest: bool, keep_last: int | None
    ) -> None:
        """Rank 0, after every rank wrote: the manifest merged, the completion record, old ones pruned."""
        engine = self.engine
        files = manifest.merge_parts(folder)
        info = elastic_ckpt.CheckpointInfo(
            tag=tag,
            world_size=engine.world_size,
            zero_stage=int(engine.deepspeed.zero_optimization_stage()),
            global_steps=engine.global_steps,
            global_samples=engine.global_samples,
            saved_at=time.time(),
        )
        elastic_ckpt.mark_complete(save_dir, info, update_latest=save_latest, files=files)
        if keep_last is not None:
            elastic_ckpt.prune_checkpoints(save_dir, keep_last)

    # -- load ----------------------------------------------------------------------------------------
    def load(
        self, load_dir: str, tag: str | None = None, *, elastic: bool = True, **kwargs: Any
    ) -> tuple[str | None, dict]:
        """The engine's ``load_checkpoint`` (its docstring says what is loaded and verified)."""
        engine = self.engine
        engine.resolve_losses()  # nothing pending may be folded into the loaded state later
        engine.memory_recovery.use_checkpoint_dir(load_dir)  # limits an exited process recorded there
        live = self.live
        if live is not None and live.restored_step is not None and tag is None:
            # This incarnation restored a newer state from host memory (live_recovery.py): a checkpoint
            # is never newer than the snapshot of the step before the failure.
            newest = elastic_ckpt.latest_complete_tag(load_dir)
            info = elastic_ckpt.read_marker(load_dir, newest) if newest else None
            if info is None or info.global_steps <= live.restored_step:
                return f"<host memory: step {live.restored_step}>", {}
        # Every rank checks its share of the files against the checkpoint's manifest before DeepSpeed
        # reads any; a damaged newest checkpoint gives way to the newest that verifies.
        tag = checkpoint_verify.choose_checkpoint(load_dir, tag, engine.rank, processes())
        if tag is None:
            return None, {}
        tag, universal = self._readable_tag(load_dir, tag, elastic)
        ds = engine.deepspeed
        # A converted checkpoint is read through DeepSpeed's universal path, switched on for this load only.
        with internals.loading_universal_checkpoint(ds) if universal else contextlib.nullcontext():
            path, client_state = ds.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is None:
            return None, {}
        client_state = dict(client_state or {})
        state = client_state.pop(STATE_KEY, None)
        if kwargs.get("load_module_only"):
            return path, client_state  # weights only: the run's batch and data state start fresh
        if state is None:
            raise ValueError(
                f"checkpoint {path} has no ds_adabatch state: was it saved by engine.save_checkpoint?"
            )
        engine.load_adabatch_state_dict(state)
        if live is not None:
            live.snapshot_now()  # the loaded state replaces what the snapshots held
        self._restore_rng(path, state)
        return path, client_state

    def _readable_tag(self, load_dir: str, tag: str, elastic: bool) -> tuple[str, bool]:
        """The tag DeepSpeed loads, and whether through its universal path: a ZeRO 1-3 checkpoint of
        another data-parallel size is converted first (``elastic``; otherwise a ``ValueError``)."""
        engine = self.engine
        ds = engine.deepspeed
        universal = tag.endswith(elastic_ckpt.UNIVERSAL_SUFFIX) and not ds.load_universal_checkpoint()
        layout = elastic_ckpt.conversion_needed(ds, load_dir, tag, engine.world_size)
        if layout is not None:
            if not elastic:
                raise ValueError(
                    f"checkpoint {os.path.join(load_dir, tag)} was written by {layout[0]} data-parallel "
                    f"ranks and this run has {engine.world_size}: pass elastic=True to convert it"
                )
            if refusal := elastic_ckpt.universal_refusal(ds, layout[0]):
                raise ValueError(f"checkpoint {os.path.join(load_dir, tag)}: {refusal}")
            tag = elastic_ckpt.ensure_universal(load_dir, tag, engine.rank)
            universal = True
        return tag, universal

    def _restore_rng(self, path: str, state: dict[str, Any]) -> None:
        """This rank's RNG state, where the checkpoint was written by the same layout of processes."""
        engine = self.engine
        rng_file = os.path.join(os.path.dirname(path), f"adabatch_rng_rank{engine.rank}.pt")
        same_layout = state["world_size"] == engine.world_size and (
            state.get("processes", state["world_size"]) == processes()
        )
        if same_layout and os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_SAVED_NAME = re.compile(r".*[_-](model|optim)_states\.pt$|adabatch_.*")
"""What a save writes into a tag folder: DeepSpeed's model and optimizer states (per rank, per layer of a
pipeline, per expert) and ours (RNG states, manifest parts, the completion record)."""


def _check_tag(tag: str) -> None:
    """A tag names one folder inside the save folder."""
    norm = os.path.normpath(tag)
    if not tag or norm in (".", "..") or norm.startswith(("..", os.sep)) or os.path.isabs(tag):
        raise ValueError(f"checkpoint tag {tag!r} must name a folder inside the save folder")


def clear_earlier_saves(save_dir: str, tags: list[str], local_rank: int) -> None:
    """Every rank's part before a save into ``save_dir`` under ``tags`` (the engine's ``save_checkpoint``,
    and the Trainer's over a checkpoint folder it wrote before): every rank is in the save, so done
    reading the checkpoint a load just took from there; then each node's first process (``local_rank``
    0, for a folder that is not shared) clears what earlier saves of the tags left (:func:`_clear_tag`),
    and every rank learns of an error there (else the others would wait at a barrier)."""
    comm.barrier()
    error = ""
    if local_rank == 0:
        for tag in tags:
            try:
                _clear_tag(save_dir, tag)
            except OSError as err:
                error = error or f"clearing the earlier save of {os.path.join(save_dir, tag)}: {err}"
    if errors := [e for e in comm.gather_text(error) if e]:
        raise RuntimeError(errors[0])


def _clear_tag(save_dir: str, tag: str) -> None:
    """Before a save over an existing tag (a run resumed from an older checkpoint reaches the same step,
    possibly on another number of ranks): the files an earlier save wrote there go (the record first, so
    a crash mid-way leaves the tag incomplete), and the universal copy converted from it, so that neither
    a shard of the old world nor the old copy is read with the new save. Files of other names (a
    tokenizer the script put there) stay, as does a universal copy this package did not make."""
    folder = os.path.join(save_dir, tag)
    copy = folder + elastic_ckpt.UNIVERSAL_SUFFIX
    record = os.path.join(copy, elastic_ckpt.COMPLETE_FILE)
    if os.path.isfile(record):
        shutil.rmtree(copy, ignore_errors=True)  # another node's process may be removing it too
        if os.path.exists(record):
            raise PermissionError(f"cannot remove the universal copy {copy} of the earlier save")
    if not os.path.isdir(folder):
        return
    with contextlib.suppress(FileNotFoundError):  # another node's process may be clearing too
        os.remove(os.path.join(folder, elastic_ckpt.COMPLETE_FILE))
    for name in os.listdir(folder):
        if _SAVED_NAME.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))

"""Checkpoints of an adaptive engine (data-parallel or pipeline): DeepSpeed's plus the adabatch state.

The adabatch state (plan, schedule state, sampler cursor, exact sample and token counts, history, LR
coupling, signals) travels inside DeepSpeed's ``client_state`` under the key ``"ds_adabatch"``; each
rank's RNG state is written beside DeepSpeed's files (``adabatch_rng_rank{r}.pt``) so a resume on the same
world size continues bit-identically. All counts are global, so a resume on another world size
re-shards the same sample stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch

from ... import checkpoint_manifest as manifest
from ...plan import PlanError
from .. import deepspeed_internals as internals
from ..core.metrics import PlanChange
from ..distributed import comm
from . import universal as elastic_ckpt
from . import verify as checkpoint_verify

__all__ = ["CheckpointMixin"]

logger = logging.getLogger("ds_adabatch")

_STATE_VERSION = 1
_STATE_KEY = "ds_adabatch"


class CheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` and the state they carry (mixed into the engine)."""

    def adabatch_state_dict(self) -> dict[str, Any]:
        """The adabatch part of a checkpoint (global counts only, so a resume can re-shard)."""
        return {
            "version": _STATE_VERSION,
            "world_size": self.world_size,
            # Processes of the whole job (data-parallel ranks x pipeline stages x tensor ranks): the
            # per-process RNG files are restored only where the layout is the same.
            "processes": _processes(),
            "global_batch": self.plan.global_batch_size,
            "scheduled_batch": self.core.scheduled_batch,
            "plan": self.plan.to_dict(),
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "global_tokens": self.global_tokens,
            "history": [e.to_dict() for e in self.history],
            "override": self.core.override,
            "controller": self.controller.state_dict(),
            "data": self._checkpoint_data_state(),
            "lr": self.lr_coupling.state_dict(),
            "loss_ema": self.loss_ema.state_dict(),
            "noise": self.noise.state_dict(),
            "last_loss": self.last_loss,
            "last_grad_norm": self.last_grad_norm,
            "memory": self.memory_recovery.memory.state_dict(),
        }

    def _checkpoint_data_state(self) -> Any:
        """The loader's state; inside a step of the forward / backward / step loop, as it was before
        that step (a resume trains the step again from its start; partial gradients are not saved)."""
        loop = getattr(self, "_loop", None)
        if loop is not None:
            return loop.data_state
        return None if self.dataloader is None else self.dataloader.state_dict()

    def load_adabatch_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"checkpoint holds ds_adabatch state version {state.get('version')!r}; this version "
                f"reads {_STATE_VERSION}"
            )
        self.global_steps = state["global_steps"]
        self.global_samples = state["global_samples"]
        self.global_tokens = state["global_tokens"]
        self.history = [PlanChange(**e) for e in state["history"]]
        self.core.override = tuple(state["override"]) if state["override"] else None
        self.controller.load_state_dict(state["controller"])
        if self.dataloader is not None and state.get("data") is not None:
            self.dataloader.load_state_dict(state["data"])
        self.loss_ema.load_state_dict(state["loss_ema"])
        self.noise.load_state_dict(state["noise"])
        self.last_loss = state["last_loss"]
        self.last_grad_norm = state["last_grad_norm"]
        if state.get("memory") is not None:  # checkpoints written before the memory section have none
            self.memory_recovery.memory.load_state_dict(state["memory"])
        # Token-budget steps resume at the scheduled token target (the sample count varies per step).
        saved = state["scheduled_batch"] if self.token_budget else state["global_batch"]
        batch = self.controller.resume_batch(saved, state["world_size"])
        if batch != saved and self.rank == 0:
            logger.warning(
                "resuming on %d ranks (checkpoint: %d): continuing with global batch %d instead of %d",
                self.world_size,
                state["world_size"],
                batch,
                saved,
            )
        try:
            plan = self._plan_for(batch)
        except PlanError as err:  # pragma: no cover - rounding above guarantees a plan
            raise ValueError(f"cannot resume: {err}") from err
        self.core.scheduled_batch = batch
        self._decided_step = None
        self._apply_plan(plan, reason="resume", record=False)
        self.deepspeed.global_samples = self.global_samples
        self.lr_coupling.set_samples(self.global_samples)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        *,
        keep_last: int | None = None,
        **kwargs,
    ):
        """DeepSpeed's ``save_checkpoint`` plus the adabatch state and each rank's RNG state.

        Call on every rank, as with DeepSpeed. The checkpoint becomes visible to ``load_checkpoint``
        (and DeepSpeed's ``latest`` file points at it) only after every rank finished writing: a rank
        that dies mid-save leaves the previous checkpoint as the one a resume loads. ``keep_last=K``
        then deletes all but the newest K complete checkpoints (and their converted copies). Each rank
        records the size and CRC-32 of every file it wrote, and the checkpoint's completion record holds
        them all (its manifest), so that a load can tell a damaged file.
        """
        ds = self.deepspeed
        self.resolve_losses()  # the saved signals (last loss, its EMA) must include every step
        tag = str(tag) if tag is not None else f"global_step{ds.global_steps}"
        state = dict(client_state or {})
        state[_STATE_KEY] = self.adabatch_state_dict()
        save_latest = kwargs.pop("save_latest", True)
        # DeepSpeed 0.19.8's save_checkpoint has rank 0 write ``latest`` before the other ranks are
        # known to have finished; that file is written below, after the barrier, instead.
        if self.rank == 0:
            # A save over an existing tag (a run resumed from an older checkpoint reaches the same step):
            # the old record goes first, so that a crash mid-save leaves the tag incomplete.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(save_dir, tag, elastic_ckpt.COMPLETE_FILE))
        with checkpoint_verify.recording_writes(ds) as written:
            result = ds.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False, **kwargs)
        # Per-rank RNG streams (dropout, ...) make a same-world-size resume bit-identical.
        folder = os.path.join(save_dir, tag)
        os.makedirs(folder, exist_ok=True)
        written.append(os.path.join(folder, f"adabatch_rng_rank{self.rank}.pt"))
        torch.save(_rng_state(), written[-1])
        # This rank's part of the manifest: the files it wrote, hashed while still in the page cache.
        manifest.write_part(folder, self.rank, written)
        comm.barrier()  # every rank has written all of its files
        if self.rank == 0:
            files = manifest.merge_parts(folder)
            info = elastic_ckpt.CheckpointInfo(
                tag=tag,
                world_size=self.world_size,
                zero_stage=int(ds.zero_optimization_stage()),
                global_steps=self.global_steps,
                global_samples=self.global_samples,
                saved_at=time.time(),
            )
            elastic_ckpt.mark_complete(save_dir, info, update_latest=save_latest, files=files)
            if keep_last is not None:
                elastic_ckpt.prune_checkpoints(save_dir, keep_last)
        self.memory_recovery.checkpoint_saved(save_dir)  # out-of-memory records it now holds go
        comm.barrier()
        return result

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, *, elastic: bool = True, **kwargs
    ) -> tuple[str | None, dict]:
        """DeepSpeed's ``load_checkpoint``, then the adabatch state; returns ``(path, client_state)``.

        Without ``tag`` the newest *complete* checkpoint in ``load_dir`` is loaded (``(None, {})``
        when there is none). On another data-parallel size the sample stream continues where it
        stopped and the global batch is re-planned; for ZeRO 1-3 the checkpoint is first converted to
        DeepSpeed's universal format (once, on rank 0; cached as ``<tag>_universal`` and reused) unless
        ``elastic=False``, which raises instead. The client state returned excludes the adabatch entry.

        Before DeepSpeed reads anything, the ranks check the checkpoint's files against its manifest
        (sizes everywhere, each file's CRC-32 on one rank). Without ``tag``, a damaged newest checkpoint
        is skipped for the newest one that verifies (one warning on rank 0 names the file and the step
        resumed from; the path returned is that checkpoint's); when none verifies, or the ``tag`` named
        does not, :class:`~ds_adabatch.CheckpointCorrupt` is raised on every rank and nothing is loaded.
        A checkpoint saved before manifests existed loads unverified (said once).
        """
        loop = getattr(self, "_loop", None)
        if loop is not None:
            if loop.passes is not None:
                raise RuntimeError(
                    "load_checkpoint() inside an optimizer step of the forward / backward / step loop: "
                    "its partial gradients would be mixed into the loaded state; load before the loop or "
                    "after the engine.step() that ends a step (engine.is_gradient_accumulation_boundary())"
                )
            self._loop = None  # a step taken but not started: the loaded cursor replaces it
        self.resolve_losses()  # nothing pending may be folded into the loaded state later
        self.memory_recovery.use_checkpoint_dir(load_dir)  # limits an exited process recorded there
        live = self._live_recovery
        if live is not None and live.restored_step is not None and tag is None:
            # This incarnation restored a newer state from host memory (live_recovery.py): a checkpoint
            # is never newer than the snapshot of the step before the failure.
            newest = elastic_ckpt.latest_complete_tag(load_dir)
            info = elastic_ckpt.read_marker(load_dir, newest) if newest else None
            if info is None or info.global_steps <= live.restored_step:
                return f"<host memory: step {live.restored_step}>", {}
        ds = self.deepspeed
        # Every rank checks its share of the files against the checkpoint's manifest before DeepSpeed
        # reads any; a damaged newest checkpoint gives way to the newest that verifies.
        tag = checkpoint_verify.choose_checkpoint(load_dir, tag, self.rank, _processes())
        if tag is None:
            return None, {}
        universal = tag.endswith(elastic_ckpt.UNIVERSAL_SUFFIX) and not ds.load_universal_checkpoint()
        layout = elastic_ckpt.saved_layout(load_dir, tag)
        if (
            not universal
            and layout is not None
            and layout[0] != self.world_size
            and ds.zero_optimization_stage() > 0
            and not ds.load_universal_checkpoint()
        ):
            if not elastic:
                raise ValueError(
                    f"checkpoint {os.path.join(load_dir, tag)} was written by {layout[0]} data-parallel "
                    f"ranks and this run has {self.world_size}: pass elastic=True to convert it"
                )
            tag = elastic_ckpt.ensure_universal(load_dir, tag, self.rank)
            universal = True
        # A converted checkpoint is read through DeepSpeed's universal path, switched on for this load only.
        with internals.loading_universal_checkpoint(ds) if universal else contextlib.nullcontext():
            path, client_state = ds.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is None:
            return None, {}
        client_state = dict(client_state or {})
        state = client_state.pop(_STATE_KEY, None)
        if kwargs.get("load_module_only"):
            return path, client_state  # weights only: the run's batch and data state start fresh
        if state is None:
            raise ValueError(
                f"checkpoint {path} has no ds_adabatch state: was it saved by engine.save_checkpoint?"
            )
        self.load_adabatch_state_dict(state)
        if live is not None:
            live.snapshot_now()  # the loaded state replaces what the snapshots held
        rng_file = os.path.join(os.path.dirname(path), f"adabatch_rng_rank{self.rank}.pt")
        same_layout = state["world_size"] == self.world_size and (
            state.get("processes", state["world_size"]) == _processes()
        )
        if same_layout and os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return path, client_state


def _processes() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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

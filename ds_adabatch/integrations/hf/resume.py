"""A Trainer checkpoint resumed on another number of data-parallel ranks under DeepSpeed ZeRO 1-3.

transformers hands a resumed run's checkpoint folder to the DeepSpeed engine's ``load_checkpoint``, and
DeepSpeed 0.19.8 refuses ZeRO optimizer state partitioned over another number of ranks
(``ZeRORuntimeException: ... Automatic adjustment of ZeRO's optimizer state partitioning with a new world
size is not currently supported``). :class:`UniversalResume` does what ``ds_adabatch.initialize``'s
engines do there: it converts the folder's DeepSpeed tag to DeepSpeed's universal format first
(:func:`~ds_adabatch.runtime.checkpoint.universal.ensure_universal`: on rank 0 while the others wait,
into ``<tag>_universal`` beside it, with a ``latest_universal`` file naming it) and has DeepSpeed read
that copy for this one load. ZeRO stage 0 checkpoints, and those of the same number of ranks, load as
they are. The batch schedule and the sample cursor (``adabatch_state.json``) resume on any number of
ranks either way.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from ds_adabatch.runtime import deepspeed_internals as internals
from ds_adabatch.runtime.checkpoint.save_load import clear_earlier_saves
from ds_adabatch.runtime.checkpoint.universal import (
    UNIVERSAL_SUFFIX,
    CheckpointInfo,
    conversion_needed,
    ensure_universal,
    universal_refusal,
)

from .state import STATE_FILE

__all__ = ["UniversalResume", "clear_earlier_save"]


def clear_earlier_save(checkpoint: str, local_rank: int) -> None:
    """Before the Trainer saves a DeepSpeed checkpoint into the folder ``checkpoint`` (every rank calls
    it): the shards an earlier save of that folder left in its DeepSpeed tag folders go, with the
    universal copies made of them, as before the engine's own saves. A run resumed from an older
    checkpoint, perhaps on another number of ranks, that reaches the same step saves there again; a rank
    of the old world's shard left beside the new save would be read by a later resume's conversion."""
    tags: list[str] = []
    if local_rank == 0 and os.path.isdir(checkpoint):
        tags = sorted(
            name
            for name in os.listdir(checkpoint)
            if name.startswith("global_step")
            and not name.endswith(UNIVERSAL_SUFFIX)
            and os.path.isdir(os.path.join(checkpoint, name))
        )
    clear_earlier_saves(checkpoint, tags, local_rank)


class UniversalResume:
    """Converts a resumed checkpoint written by another number of ranks before transformers loads it.

    The Trainer says which folder a run resumes from (:meth:`expect`), then, as it assigns the DeepSpeed
    engine right before loading it, :meth:`engine_assigned`; once loaded, :meth:`loaded` switches
    DeepSpeed's universal load off again (later loads, such as the best model's at the end, read what
    this run wrote)."""

    def __init__(self) -> None:
        self._pending: str | None = None
        self._switch: contextlib.AbstractContextManager[None] | None = None

    def expect(self, checkpoint: str | None) -> None:
        """The folder this ``train()`` resumes from (None: a fresh start)."""
        self.loaded()  # a load that failed before (an error inside it) left the switch on
        self._pending = checkpoint

    def engine_assigned(self, engine: Any, world_size: int, rank: int) -> None:
        """Every rank, before transformers loads the expected folder into ``engine``: where its ZeRO 1-3
        state was written by another number than ``world_size`` of data-parallel ranks, convert it and
        switch DeepSpeed's universal load on. An engine without an optimizer (``evaluate``'s, after a
        ``train()`` that failed before its engine) loads no training state: nothing to convert."""
        checkpoint, self._pending = self._pending, None
        self.loaded()
        if checkpoint is None or getattr(engine, "optimizer", None) is None or not os.path.isdir(checkpoint):
            return
        tag = _latest_tag(checkpoint)
        layout = None if tag is None else conversion_needed(engine, checkpoint, tag, world_size)
        if tag is None or layout is None:
            return
        if refusal := universal_refusal(engine, layout[0]):
            raise ValueError(f"resume_from_checkpoint {checkpoint}: {refusal}")
        ensure_universal(checkpoint, tag, rank, _record(checkpoint, tag, layout))
        switch = internals.loading_universal_checkpoint(engine)
        switch.__enter__()
        self._switch = switch

    @contextlib.contextmanager
    def loading(self, checkpoint: str | None, engine: Any, args: Any) -> Iterator[None]:
        """Around a load of ``checkpoint`` into ``engine`` other than ``train()``'s (the best model's at
        the end: written before a resume, by another number of ranks), ``args`` the Trainer's."""
        if engine is None or checkpoint is None:
            yield
            return
        self.expect(checkpoint)
        self.engine_assigned(engine, args.world_size, args.process_index)
        try:
            yield
        finally:
            self.loaded()

    def loaded(self) -> None:
        """After transformers loaded the checkpoint: DeepSpeed's universal load off again."""
        switch, self._switch = self._switch, None
        if switch is not None:
            switch.__exit__(None, None, None)


def _latest_tag(checkpoint: str) -> str | None:
    """The DeepSpeed tag a Trainer checkpoint folder's ``latest`` file names (None: not a DeepSpeed one)."""
    try:
        with open(os.path.join(checkpoint, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    return tag if tag and os.path.isdir(os.path.join(checkpoint, tag)) else None


def _record(checkpoint: str, tag: str, layout: tuple[int, int]) -> CheckpointInfo:
    """The completion record a Trainer checkpoint lacks (DeepSpeed's own ``save_checkpoint`` wrote it), for
    its universal copy, so that a later resume reuses the copy: the ranks and ZeRO stage that wrote it
    (-1: some stage above 0), its step and samples (``trainer_state.json``, ``adabatch_state.json``)."""

    def read(name: str) -> dict[str, Any]:
        try:
            with open(os.path.join(checkpoint, name)) as f:
                value = json.load(f)
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    sampler = read(STATE_FILE).get("data", {}).get("sampler", {})
    return CheckpointInfo(
        tag=tag,
        world_size=layout[0],
        zero_stage=layout[1],
        global_steps=int(read("trainer_state.json").get("global_step", 0)),
        global_samples=int(sampler.get("samples_consumed", 0)) if isinstance(sampler, dict) else 0,
        saved_at=os.path.getmtime(os.path.join(checkpoint, tag)),
    )

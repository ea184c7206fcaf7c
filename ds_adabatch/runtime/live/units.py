"""The shapes a snapshot is read into and assembled as: what one rank owns (:class:`Unit`, made of
:class:`Piece`) and the whole state of one snapshot step on the new world (:class:`Assembled`). Shared by
the ZeRO 0-2 snapshots (:mod:`ds_adabatch.runtime.live.snapshot`) and ZeRO 3's
(:mod:`ds_adabatch.runtime.live.zero3`), which both import it and not each other's internals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Assembled", "Piece", "Unit"]


@dataclass
class Piece:
    """A parameter's slice inside a flat fp32 tensor: its name, where the slice starts in the parameter
    (``lp_start``), how many elements, and where it starts in the flat tensor (``hp_start``)."""

    name: str
    lp_start: int
    numel: int
    hp_start: int


@dataclass
class Unit:
    """One flat fp32 tensor this rank owns and the optimizer whose ``state`` holds its moments."""

    hp: torch.Tensor
    optimizer: Any
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Assembled:
    """The state of one snapshot step, whole, on every rank of the new world."""

    step: int
    family: str
    full: dict[str, dict[str, torch.Tensor]]
    """Per parameter name: ``{"fp32": weights, key: optimizer state, ...}``, full shapes."""
    meta: dict[str, Any]

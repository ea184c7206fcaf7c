"""The few collectives the runtime issues, over DeepSpeed's communication layer.

Each call packs its values into one tensor so one optimizer step costs at most two extra small
collectives (a broadcast of the decided batch size and an all-reduce of sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["all_reduce_sum", "barrier", "broadcast_int"]


def _dist():
    import deepspeed.comm as dist

    return dist


def _ready() -> bool:
    dist = _dist()
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: Sequence[float | torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Sum each value over all ranks; returns float64 scalars in the same order."""
    packed = torch.stack(
        [
            v.detach().to(device=device, dtype=torch.float64).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.tensor(float(v), dtype=torch.float64, device=device)
            for v in values
        ]
    )
    if _ready():
        _dist().all_reduce(packed)
    return list(packed.unbind())


def broadcast_int(value: int, device: torch.device | str, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank."""
    if not _ready():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    _dist().broadcast(t, src)
    return int(t.item())


def barrier() -> None:
    if _ready():
        _dist().barrier()

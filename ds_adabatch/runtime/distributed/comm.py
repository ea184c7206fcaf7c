"""The few collectives ds_adabatch issues, over ``torch.distributed``.

DeepSpeed's communication layer (``deepspeed.comm``, 0.19.8) runs on ``torch.distributed``'s default
process group, so these work under DeepSpeed, under plain DDP (the Hugging Face integration) and in a
single process. Each call packs its values into one tensor: one optimizer step costs at most two extra
small collectives; a steady step issues none (see :mod:`ds_adabatch.runtime.core.sync`). One of them, a
measured step's noise-scale sums, is issued without waiting, so it overlaps the next step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "CollectiveError",
    "all_reduce_sum",
    "all_reduce_sum_async",
    "barrier",
    "broadcast_int",
    "finish",
    "gather_text",
    "wait_for",
]


class CollectiveError(RuntimeError):
    """A collective that ds_adabatch issued without waiting failed when it was waited for (a peer lost,
    hung or cut off). Raised from the backend's error, which is its ``__cause__``: live recovery tells a
    lost peer by this type, not by the words of the backend's message."""


def wait_for(work: object, what: str) -> None:
    """``work.wait()`` of an asynchronous ``torch.distributed`` operation; its failure raised as
    :class:`CollectiveError` (``what`` names the operation)."""
    try:
        work.wait()  # type: ignore[attr-defined]
    except RuntimeError as err:
        raise CollectiveError(f"{what} failed: {err}") from err


def _active() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _pack(values: Sequence[float | torch.Tensor], device: torch.device | str) -> torch.Tensor:
    return torch.stack(
        [
            v.detach().to(device=device, dtype=torch.float64).reshape(())
            if isinstance(v, torch.Tensor)
            # A fill on the device, not a host-to-device copy (which would synchronise a GPU).
            else torch.full((), float(v), dtype=torch.float64, device=device)
            for v in values
        ]
    )


def all_reduce_sum(values: Sequence[float | torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Each value summed over all ranks, as float64 scalars on ``device``, in one collective."""
    packed = _pack(values, device)
    if _active():
        torch.distributed.all_reduce(packed)
    return list(packed.unbind())


def all_reduce_sum_async(
    values: Sequence[float | torch.Tensor], device: torch.device | str
) -> Callable[[], list[torch.Tensor]]:
    """:func:`all_reduce_sum` issued now without waiting for it: returns a function that waits and
    gives the sums. The values are copied when it is issued."""
    packed = _pack(values, device)
    work = torch.distributed.all_reduce(packed, async_op=True) if _active() else None

    def wait() -> list[torch.Tensor]:
        if work is not None:
            wait_for(work, "the step's all-reduce")
        return list(packed.unbind())

    return wait


def broadcast_int(value: int, device: torch.device | str, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (batch-shape decisions are taken identically everywhere)."""
    if not _active():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    torch.distributed.broadcast(t, src)
    return int(t.item())


def gather_text(text: str) -> list[str]:
    """Every rank's ``text``, in rank order, on every rank (``[text]`` without a group)."""
    if not _active():
        return [text]
    everyone: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, text)
    return [str(t) for t in everyone]


def barrier() -> None:
    if _active():
        torch.distributed.barrier()


def finish(exit_code: int = 0) -> None:
    """End a finished training process cleanly: the last call of a rank's script. It does not return.

    Waits for every rank (a barrier), destroys every process group, flushes ``logging`` and the standard
    streams, then ends the process with ``exit_code`` *without* the interpreter's teardown. A non-zero
    ``exit_code`` ends this rank without waiting for the others (they may be inside a collective it will
    never join, e.g. after ``UnrecoverableOutOfMemory``: ``finish(exc.exit_code)``); the launcher then
    stops them, and ``torchrun --max-restarts`` starts the job again. A gloo
    process group (DeepSpeed's CPU accelerator, and the flag group of out-of-memory recovery on GPUs)
    can abort a rank that already finished its work while the interpreter shuts down ("terminate called
    without an active exception", SIGABRT), even after ``destroy_process_group()``; a launcher reports
    that as a failed job, and an elastic one (``torchrun --max-restarts``) starts it again.

    Because the teardown is skipped, ``atexit`` handlers and object finalisers do not run: close files,
    metrics writers (``engine.close()``) and experiment trackers before calling it. Call it on every rank.
    """
    dist = torch.distributed
    if exit_code == 0 and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        _remove_cpu_shm_buffer_name()
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream: nothing more can be written to it anyway.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(exit_code)


def _remove_cpu_shm_buffer_name() -> None:
    """After the barrier of :func:`finish`: this rank's ``/dev/shm`` buffer name of DeepSpeed's CPU
    all-reduce, if DeepSpeed's layer was started where :func:`ds_adabatch.init_distributed` never saw it
    (``initialize(..., dist_init_required=False)``, the Hugging Face Trainer). Every rank has long mapped
    its peers' buffers (while the group formed)."""
    if "deepspeed.comm.comm" not in sys.modules:
        return  # DeepSpeed's layer never started in this process: it made no buffer
    from .process_group import cpu_shm_buffer_name

    with contextlib.suppress(OSError):
        os.remove(cpu_shm_buffer_name())

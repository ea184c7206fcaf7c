"""Stand-ins for the accelerator that the runtime reads in its place: installed from outside, never imported.

On a machine without a GPU nothing raises a recoverable out-of-memory error and there is no allocator to
read, so the out-of-memory agreement and the peak-memory predictor would have nothing to work on.
:func:`ds_adabatch.testing.simulated_memory_limit` (or any object with the same counters) stands in: while
installed it registers here, and the runtime asks this module — not the testing module — whether one is
installed and which allocator to read. The runtime therefore never imports test code, and a stand-in of
a user's own (a recorded allocator trace, say) works the same way.

A memory stand-in offers ``memory_allocated()``, ``max_memory_allocated()``,
``reset_peak_memory_stats()``, ``total_memory()`` and ``applies_here() -> bool`` (whether it simulates
this rank's device).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "MemoryStandIn",
    "first_batched",
    "install_oom_stand_in",
    "memory_stand_in",
    "oom_stand_in_installed",
    "remove_oom_stand_in",
]


class MemoryStandIn(Protocol):
    """The allocator counters the peak-memory predictor reads (as DeepSpeed's accelerator offers them)."""

    def memory_allocated(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def total_memory(self) -> int | None: ...
    def applies_here(self) -> bool: ...


_oom_stand_ins: list[Any] = []  # installed out-of-memory stand-ins, oldest first
_memories: list[MemoryStandIn] = []  # those of them that also simulate an allocator, newest last


def install_oom_stand_in(stand_in: Any, *, simulates_memory: bool) -> None:
    """Register ``stand_in``: out-of-memory errors can now be raised on this machine (the agreement arms
    itself), and with ``simulates_memory`` its counters replace the accelerator's."""
    if stand_in not in _oom_stand_ins:
        _oom_stand_ins.append(stand_in)
    if simulates_memory and stand_in not in _memories:
        _memories.append(stand_in)


def remove_oom_stand_in(stand_in: Any) -> None:
    """Unregister ``stand_in`` (no error if it was not registered)."""
    if stand_in in _oom_stand_ins:
        _oom_stand_ins.remove(stand_in)
    if stand_in in _memories:
        _memories.remove(stand_in)


def oom_stand_in_installed() -> bool:
    """Whether a stand-in that raises out-of-memory errors is installed in this process."""
    return bool(_oom_stand_ins)


def memory_stand_in() -> MemoryStandIn | None:
    """The newest installed memory stand-in that applies to this rank, else None."""
    for stand_in in reversed(_memories):
        if stand_in.applies_here():
            return stand_in
    return None


def first_batched(value: Any) -> torch.Tensor | None:
    """The first tensor with at least one dimension in a call's arguments (tensors, dicts, sequences):
    the tensor whose leading dimension is a pass's number of samples."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_batched(item)
            if found is not None:
                return found
    return None

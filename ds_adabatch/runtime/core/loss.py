"""``StepLoss``: what ``train_batch()`` returns — one step's global-mean loss, read when it is needed.

The exact mean over a global batch needs every rank's loss sum. Summing them at every step would cost a
collective and, on a GPU, a host synchronisation that stops the CPU from queuing the next step's
kernels. So each step's loss sum stays on the device; the runtime sums the pending ones over ranks in one
small all-reduce every ``adabatch.log.every_steps`` steps (riding along with any collective a step issues
anyway), and a ``StepLoss`` holds the value once that happened.

Reading an unresolved ``StepLoss`` (``float(loss)``, ``loss.item()``, ``f"{loss:.3f}"``, comparisons,
arithmetic) resolves every pending step at once, which is a collective: read it on every rank, as in
``loss = float(engine.train_batch())`` inside the training loop. Code that reads it on one rank only
(``if rank == 0: print(loss)``) should read it on steps where ``loss.resolved`` is true on every rank —
those whose step count is a multiple of ``log.every_steps`` — or read ``engine.last_metrics``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepLoss"]


@functools.total_ordering
class StepLoss:
    """The mean loss over one optimizer step's global batch, identical on every rank once resolved.

    Behaves as a number: ``float()``, ``.item()``, formatting, comparisons and arithmetic with numbers
    read the value (resolving it first if needed). ``.tensor()`` gives a 0-dim float64 tensor.
    """

    __slots__ = ("_resolve", "_value", "step")

    def __init__(self, step: int, resolve: Callable[[], Any]) -> None:
        self.step = step
        """The optimizer step (0-based) whose loss this is."""
        self._resolve = resolve
        self._value: float | None = None

    @property
    def resolved(self) -> bool:
        """Whether the value is known on this rank (reading it then issues no collective)."""
        return self._value is not None

    def set_value(self, value: float) -> None:
        """Called by the runtime when the step's all-reduced loss is known."""
        self._value = float(value)

    def item(self) -> float:
        """The value, resolving every pending step's loss first if needed (a collective)."""
        if self._value is None:
            self._resolve()
        if self._value is None:
            raise RuntimeError(f"the loss of step {self.step} could not be resolved")
        return self._value

    def __float__(self) -> float:
        return self.item()

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.item(), dtype=torch.float64)

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        value = f"{self._value:.6g}" if self._value is not None else "unresolved"
        return f"StepLoss(step={self.step}, {value})"

    def __str__(self) -> str:
        return str(self.item())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StepLoss, int, float)):
            return self.item() == float(other)
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, (StepLoss, int, float)):
            return self.item() < float(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable until resolved

    def __add__(self, other: Any) -> float:
        return self.item() + float(other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> float:
        return self.item() - float(other)

    def __rsub__(self, other: Any) -> float:
        return float(other) - self.item()

    def __mul__(self, other: Any) -> float:
        return self.item() * float(other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> float:
        return self.item() / float(other)

    def __rtruediv__(self, other: Any) -> float:
        return float(other) / self.item()

    def __neg__(self) -> float:
        return -self.item()

    def __round__(self, ndigits: int | None = None) -> float:
        return round(self.item(), ndigits)

"""Gradient norms for the noise-scale estimate, read during the ordinary backward passes.

A tensor hook on each parameter sees the gradient of the current backward pass before it is
accumulated or reduced — under every ZeRO stage, because DeepSpeed 0.19.8 reduces gradients in
post-accumulation hooks. Divided by the micro-batch's loss weight, that is the gradient of one
micro-batch's mean loss on this rank (the small batch). The reduced gradient of the whole global batch
(the big batch) comes from DeepSpeed's global gradient norm (ZeRO 1-3, bf16) or, under plain ZeRO 0,
from the all-reduced ``.grad`` tensors before ``step()`` clears them. No extra forward or backward pass.

Everything stays on the device until the step's one all-reduce: the hooks add squared norms into a
device scalar, so a GPU is never synchronised per parameter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["NoiseProbe", "loss_scale"]


def loss_scale(ds_engine: Any) -> float:
    """fp16 multiplies the loss by a dynamic scale before backward; bf16 and fp32 use 1."""
    if not ds_engine.fp16_enabled():
        return 1.0
    opt = ds_engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(opt, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 1.0


class NoiseProbe:
    """Collects one optimizer step's small- and big-batch squared gradient norms on this rank."""

    def __init__(self, ds_engine: Any) -> None:
        self.ds = ds_engine
        device = ds_engine.device
        self._acc = torch.zeros((), dtype=torch.float32, device=device)
        self._sq_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._n = 0
        self._inv_b = 0.0
        self._weight = 0.0
        self._samples = 0
        self._big: torch.Tensor | None = None
        self._handles = [
            p.register_hook(self._hook) for p in ds_engine.module.parameters() if p.requires_grad
        ]

    def _hook(self, grad: torch.Tensor) -> None:
        self._acc.add_(grad.detach().float().pow(2).sum())

    def begin(self, weight: float, samples: int) -> None:
        """Before a micro-batch's backward: its loss weight and real sample count."""
        self._acc.zero_()
        self._weight = weight
        self._samples = samples

    def end(self) -> None:
        """After the backward: fold the micro-batch's squared norm in (pads are skipped)."""
        if self._samples <= 0 or self._weight <= 0:
            return
        scale = self._weight * loss_scale(self.ds)
        self._sq_sum.add_(self._acc.double() / (scale * scale))
        self._n += 1
        self._inv_b += 1.0 / self._samples

    def read_reduced_norm(self) -> None:
        """After the last micro-batch's backward, before ``step()``."""
        if self.ds.zero_optimization_stage() != 0:
            return
        grads = [
            p.grad.detach().float().pow(2).sum() for p in self.ds.module.parameters() if p.grad is not None
        ]
        if grads:
            self._big = torch.stack(grads).sum().double() / loss_scale(self.ds) ** 2

    def reduced_sq_norm(self) -> float | None:
        """The big batch's squared gradient norm (the same on every rank), after ``step()``."""
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None if self._big is None else float(self._big)
        norm = float(norm)
        return norm * norm if math.isfinite(norm) else None

    def local_sums(self) -> list[torch.Tensor | float]:
        """This rank's (sum of small-batch squared norms, micro-batches measured, sum of 1/size)."""
        return [self._sq_sum, float(self._n), self._inv_b]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

"""Gradient norms for the noise-scale estimate, read during the ordinary backward passes.

A tensor hook on each parameter sees the gradient of the current backward pass before it is
accumulated or reduced: under every ZeRO stage, because DeepSpeed 0.19.8 reduces gradients in
post-accumulation hooks, and under torch DDP, whose reducer also runs after accumulation. Divided by
the micro-batch's loss weight, that is the gradient of one micro-batch's mean loss on this rank (the
small batch). The reduced gradient of the whole global batch (the big batch) comes from DeepSpeed's
global gradient norm (ZeRO 1-3, bf16) or, under plain ZeRO 0 and DDP, from the all-reduced ``.grad``
tensors before the optimizer step clears them. No extra forward or backward pass.

Everything stays on the device until the step's one all-reduce: the hooks add squared norms into a
device scalar, so a GPU is never synchronised per parameter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ds_adabatch.signals import GradientNoiseEstimator

__all__ = ["NoiseCadence", "NoiseProbe", "loss_scale", "update_estimator"]

logger = logging.getLogger("ds_adabatch")


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
    """Collects one optimizer step's small- and big-batch squared gradient norms on this rank.

    Args:
        parameters: the model's parameters; a hook on each trainable one reads its micro-batch gradient.
        device: where the running sums live (the parameters' device).
        grad_scale: the factor the loss was multiplied by before backward (fp16's loss scale), read at
            each use; ``None``: 1.
        reduced_norm: returns the big batch's gradient norm after the step (DeepSpeed's global norm),
            or ``None`` where it has none; ``None`` (the argument): use :meth:`read_reduced_norm`.
        read_grads: whether :meth:`read_reduced_norm` reads the reduced ``.grad`` tensors (where
            ``reduced_norm`` may have no value).

    :meth:`for_deepspeed` builds one for a DeepSpeed engine.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        device: torch.device | str,
        *,
        grad_scale: Callable[[], float] | None = None,
        reduced_norm: Callable[[], Any] | None = None,
        read_grads: bool = True,
    ) -> None:
        self.params = [p for p in parameters if p.requires_grad]
        self._grad_scale = grad_scale or (lambda: 1.0)
        self._reduced_norm = reduced_norm
        self.read_grads = read_grads
        self._acc = torch.zeros((), dtype=torch.float32, device=device)
        self._sq_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._n = 0
        self._inv_b = 0.0
        self._weight = 0.0
        self._samples = 0
        self._big: torch.Tensor | None = None
        self._handles = [p.register_hook(self._hook) for p in self.params]

    @classmethod
    def for_deepspeed(cls, ds_engine: Any) -> NoiseProbe:
        """Hooks on the engine's module; the big batch from DeepSpeed's global gradient norm (ZeRO 1-3,
        bf16) or, under plain ZeRO 0, from the all-reduced ``.grad`` tensors."""
        return cls(
            ds_engine.module.parameters(),
            ds_engine.device,
            grad_scale=lambda: loss_scale(ds_engine),
            reduced_norm=ds_engine.get_global_grad_norm,
            read_grads=ds_engine.zero_optimization_stage() == 0,
        )

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
        scale = self._weight * self._grad_scale()
        self._sq_sum.add_(self._acc.double() / (scale * scale))
        self._n += 1
        self._inv_b += 1.0 / self._samples

    def read_reduced_norm(self) -> None:
        """After the last micro-batch's backward (gradients reduced), before the optimizer step."""
        if not self.read_grads:
            return
        grads = [p.grad.detach().float().pow(2).sum() for p in self.params if p.grad is not None]
        if grads:
            self._big = torch.stack(grads).sum().double() / self._grad_scale() ** 2

    def reduced_sq_norm(self) -> float | None:
        """The big batch's squared gradient norm (the same on every rank), after the step."""
        return self.reduced_sq_norm_later()()

    def reduced_sq_norm_later(self) -> Callable[[], float | None]:
        """Capture the big batch's norm now (after the step) without reading it on the host.

        Returns a function that gives :meth:`reduced_sq_norm`'s value when called, so a GPU is only
        synchronised when the measurement is folded into the estimate.
        """
        norm = self._reduced_norm() if self._reduced_norm is not None else None
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().clone()  # DeepSpeed may reuse its buffer in the next step
        big = self._big

        def value() -> float | None:
            if norm is None:
                return None if big is None else float(big)
            n = float(norm)
            return n * n if math.isfinite(n) else None

        return value

    def local_sums(self) -> list[torch.Tensor | float]:
        """This rank's (sum of small-batch squared norms, micro-batches measured, sum of 1/size)."""
        return [self._sq_sum, float(self._n), self._inv_b]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def update_estimator(
    estimator: GradientNoiseEstimator, sums: Sequence[Any], total_samples: int, sq_big: float | None
) -> None:
    """Feed one step's measurement to ``estimator``.

    ``sums`` are :meth:`NoiseProbe.local_sums` summed over ranks, ``total_samples`` the global batch's
    real samples and ``sq_big`` :meth:`NoiseProbe.reduced_sq_norm`. The small batch is the harmonic mean
    of the measured micro-batch sizes; nothing is fed when no micro-batch was measured, the big norm is
    missing, or the global batch is not larger than the small one.
    """
    sq_sum, n_micro, inv_b_sum = (float(s) for s in sums)
    if n_micro < 1 or sq_big is None:
        return
    b_small = n_micro / inv_b_sum
    if total_samples <= b_small:
        return
    estimator.update(b_small, sq_sum / n_micro, total_samples, sq_big)


class NoiseCadence:
    """Which optimizer steps measure the noise scale: every ``measure_every`` steps of a
    ``gradient_noise`` schedule, when the step has at least two micro-batches over all ranks (the
    estimator compares one micro-batch with the whole global batch).

    A due step with a single micro-batch in total is skipped with a warning, once per run: the schedule
    then holds its batch until a step can be measured.
    """

    def __init__(self, schedule_config: Any) -> None:
        self.every = int(schedule_config.measure_every) if schedule_config.type == "gradient_noise" else 0
        self.warned = False

    def due(self, step: int, world_size: int, gradient_accumulation_steps: int) -> bool:
        """Whether optimizer step ``step`` (completed steps before it) is measured."""
        if not self.every or step % self.every:
            return False
        if world_size * gradient_accumulation_steps > 1:
            return True
        if not self.warned:
            self.warned = True
            logger.warning(
                "gradient_noise: step %d is a single micro-batch on a single rank, so the noise scale "
                "cannot be measured and the batch holds; make max_micro_batch_per_gpu smaller than the "
                "global batch (two or more accumulation steps) or train on more ranks",
                step,
            )
        return False

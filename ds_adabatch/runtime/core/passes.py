"""One optimizer step's passes on the data-parallel engine: the exact weights, backward, the loss sum.

Both ways of driving :class:`~ds_adabatch.runtime.AdaptiveBatchEngine` run a step's micro-batches
through one :class:`StepPasses`:

* ``engine.train_batch()`` runs them itself (forward through ``loss_fn``), in one call;
* the forward / backward / step loop (:mod:`.loop`) runs them across the user's calls:
  ``engine(x)`` -> ``engine.backward(loss)`` -> ``engine.step()`` for every micro-batch the loader
  hands out.

Either way each micro-batch's mean loss is weighted by ``count × W / total`` (``count``: its real samples,
or target tokens; ``total``: the global batch's over the ``W`` data-parallel ranks) and handed to
DeepSpeed's ``backward(..., scale_wrt_gas=False)``; summed over the micro-batches and averaged over the
ranks by DeepSpeed, that is exactly the mean gradient over the global batch (``weights.py``).

Who ends the accumulation depends on the ds_config. By default (DeepSpeed's managed accumulation) the
boundary is set explicitly before every pass and ``step()`` follows every pass (DeepSpeed updates only
on the boundary). With ``"managed_gradient_accumulation": false`` (DeepSpeed >= 0.19.4) the caller owns
the boundary: no boundary is set, and ``step()`` is called once, after the step's last pass
(:meth:`StepPasses.step`). Both give the same update (docs/deepspeed.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..noise.probe import NoiseProbe
    from .lr import BatchCoupledLR
    from .sync import StepSync

__all__ = ["StepPasses"]

_FLOAT64 = torch.float64

Measured = tuple[list[Any], Callable[[], float | None]]


class PassHost(Protocol):
    """What :class:`StepPasses` reads of the engine that runs the passes (both adaptive engines)."""

    deepspeed: Any
    """The DeepSpeed engine: ``backward``, ``step``, the accumulation boundary."""
    world_size: int
    global_samples: int
    counts_tokens: bool
    counts_here: bool
    by_token: bool
    step_sync: StepSync
    lr_coupling: BatchCoupledLR

    def count_tokens(self, batch: Any) -> int: ...

    def start_noise_probe(self) -> NoiseProbe: ...


class StepPasses:
    """The weights, the noise probe and the loss sum of one step's micro-batches on this rank.

    Creating it settles the step's totals: from the sampler when it knows the global batch's size, else
    summed over replicas in the step's one collective (token counts, a user iterator's sizes). It also
    tells the LR coupling the samples this step consumes (DeepSpeed steps the scheduler inside the
    boundary ``step()``).

    Args:
        engine: the adaptive engine (its DeepSpeed engine, sync, counters and token counter are used).
        micro: ``(batch, real samples)`` of each micro-batch of the step on this rank, pads with 0.
        total_samples: the global batch's real samples when every rank knows it (None: summed here).
        measure: whether this step measures the gradient-noise scale.
    """

    def __init__(
        self, engine: PassHost, micro: list[tuple[Any, int]], total_samples: int | None, measure: bool
    ) -> None:
        self.engine = engine
        self.ds = ds = engine.deepspeed
        samples = [n for _, n in micro]
        self.samples = samples
        # Tokens are counted on the loader's host tensors: no device read.
        tokens = [engine.count_tokens(b) if n else 0 for b, n in micro] if engine.counts_tokens else []
        self.counts = tokens if engine.by_token else samples
        if total_samples is not None and not engine.counts_tokens:
            # The sampler gave every rank the global batch's size: nothing to agree on.
            total, total_tokens = total_samples, 0
        else:
            # Per-rank counts: one collective, which also carries whatever StepSync has queued. Each
            # replica counts once (tensor ranks of a replica hold the same micro-batches).
            mine = [float(sum(samples)), float(sum(self.counts)), float(sum(tokens))]
            totals = engine.step_sync.reduce(mine if engine.counts_here else [0.0, 0.0, 0.0])
            total_samples = int(totals[0]) if total_samples is None else total_samples
            total, total_tokens = int(totals[1]), int(totals[2])
        if total <= 0:
            raise ValueError("the global batch has no samples (or no target tokens) to train on")
        self.total_samples, self.total, self.total_tokens = total_samples, total, total_tokens
        # DeepSpeed steps the LR scheduler inside the boundary step(); in "samples" mode it must
        # already see the samples this step consumes.
        engine.lr_coupling.set_samples(engine.global_samples + total_samples)
        self.probe = engine.start_noise_probe() if measure else None
        self.loss_sum = torch.zeros((), dtype=_FLOAT64, device=ds.device)
        self.last = len(micro) - 1
        self.scale = engine.world_size / total  # loss weight = count * W / total (weights.py)
        # DeepSpeed 0.19.8 DeepSpeedEngine.managed_gradient_accumulation() (public): False when the
        # config hands the boundary to the caller (every step() ends the accumulation).
        self.caller_owned = not ds.managed_gradient_accumulation()

    def set_boundary(self, index: int) -> None:
        """Before micro-batch ``index``'s forward: whether its ``step()`` is the optimizer step.

        DeepSpeed 0.19.8 decides the boundary from ``micro_steps % GAS`` unless it is set explicitly; a
        GAS change with ``micro_steps`` not a multiple of the new GAS would fire early and mix
        micro-batches of two steps. Setting it for every micro-batch avoids that. Under caller-owned
        accumulation there is no boundary to set (DeepSpeed refuses one): :meth:`step` ends it.
        """
        if not self.caller_owned:
            self.ds.set_gradient_accumulation_boundary(index == self.last)

    def backward(self, index: int, loss: torch.Tensor, **kwargs: Any) -> Any:
        """DeepSpeed's backward of micro-batch ``index``'s mean ``loss``, weighted for the exact mean."""
        count = self.counts[index]
        weight = count * self.scale
        probe = self.probe
        if probe is not None:
            probe.begin(weight, self.samples[index])
        out = self.ds.backward(loss * weight, scale_wrt_gas=False, **kwargs)
        if probe is not None:
            probe.end()
            if index == self.last:
                probe.read_reduced_norm()
        if count:
            # One fused op: loss_sum += loss * count (float64, on the device).
            self.loss_sum.add_(loss.detach(), alpha=count)
        return out

    def step(self, index: int, lr_kwargs: Any = None) -> bool:
        """DeepSpeed's ``step()`` after micro-batch ``index``'s backward; True when it was the optimizer
        step. Managed accumulation: after every pass (a micro-step until the boundary set by
        :meth:`set_boundary`). Caller-owned: only after the last pass, where it is the boundary
        (reduction, update, LR step); the passes before it only accumulate."""
        last = index == self.last
        if last or not self.caller_owned:
            self.ds.step(lr_kwargs=lr_kwargs)
        return last

    def close(self) -> None:
        """After the last pass (or an error): the probe stopped, DeepSpeed's own boundary rule back."""
        if self.probe is not None:
            self.probe.stop()
        if not self.caller_owned:
            self.ds.set_gradient_accumulation_boundary(None)

    def result(self) -> tuple[torch.Tensor, int, int, int, Measured | None]:
        """``(loss sum, tokens, real samples, total, noise sums)`` of the completed step."""
        if not self.engine.counts_here:
            self.loss_sum.zero_()  # this replica's loss is counted on its tensor rank 0
        probe = self.probe
        measured = (probe.local_sums(), probe.reduced_sq_norm_later()) if probe is not None else None
        return self.loss_sum, self.total_tokens, self.total_samples, self.total, measured

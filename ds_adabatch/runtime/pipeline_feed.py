"""What the pipeline engine hands DeepSpeed's ``PipelineEngine``: equal-shape micro-batches and exact weights.

DeepSpeed 0.19.8's ``PipelineEngine.train_batch`` draws ``gradient_accumulation_steps`` items
``(inputs, labels)`` from an iterator on the first and the last stage, calls the module's
``loss_fn(outputs, labels)`` on the last stage, divides that loss by GAS in backward
(``DeepSpeedEngine.backward``, ``scale_wrt_gas=True``) and averages gradients over the data-parallel
replicas: every micro-batch weighs the same, whatever its real sample count. So:

* :func:`pad_rows` brings every micro-batch of a step to the plan's micro-batch (the stages exchange
  activation shapes once; a shape that changes inside a step would abort in the transport or compute
  on a stale buffer), repeating the first row; a pad row is weighted 0.
* :class:`WeightedPipelineLoss` replaces the module's ``loss_fn``. It calls the user's
  ``loss_fn(outputs, labels)`` on the real rows only and returns ``loss × count × GAS × dp / total``
  (``count``: the micro-batch's real samples, or target tokens; ``total``: the global batch's). After
  DeepSpeed's ``1 / GAS`` and its data-parallel mean, the update is exactly the mean gradient over the
  global batch, and DeepSpeed's own aggregated loss (``_aggregate_total_loss``: the sum over
  micro-batches, ``/ GAS``, the data-parallel mean, broadcast to every stage) is exactly the global mean
  loss, so reading it needs no collective of ours.

The weights never travel through DeepSpeed: the last stage runs its forward passes in micro-batch order,
so the wrapper takes each pass's ``(real rows, count)`` from a host-side queue filled before the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["WeightedPipelineLoss", "check_pipeline_batch", "pad_rows", "rows_of"]


def check_pipeline_batch(batch: Any) -> None:
    """Raise a clear error unless ``batch`` is ``(inputs, labels)`` as ``PipelineEngine`` reads it."""
    ok = isinstance(batch, (tuple, list)) and len(batch) == 2
    if ok:
        for part in batch:
            tensors = part if isinstance(part, (tuple, list)) else (part,)
            ok = ok and bool(tensors) and all(isinstance(t, torch.Tensor) for t in tensors)
    if not ok:
        raise TypeError(
            "under pipeline parallelism a collated micro-batch must be (inputs, labels), each a tensor "
            "or a tuple of tensors with the samples along dimension 0 (what DeepSpeed's PipelineEngine "
            f"feeds its first and last stage); collate_fn returned {_describe(batch)}"
        )


def rows_of(batch: Any) -> int:
    """Samples along dimension 0 of a checked ``(inputs, labels)`` micro-batch."""
    first = batch[0] if isinstance(batch[0], torch.Tensor) else batch[0][0]
    return int(first.shape[0])


def pad_rows(batch: Any, rows: int) -> Any:
    """``batch`` with every tensor brought to ``rows`` rows by repeating its first row (zero-weight pads)."""
    have = rows_of(batch)
    if have == rows:
        return batch
    if have > rows:  # pragma: no cover - plans never hand out more rows than their micro-batch
        raise ValueError(f"a micro-batch of {have} samples does not fit the plan's {rows}")
    return type(batch)(_pad(part, rows - have) for part in batch)


def _pad(part: Any, extra: int) -> Any:
    if isinstance(part, torch.Tensor):
        return torch.cat([part, part[:1].expand(extra, *part.shape[1:])])
    return type(part)(_pad(t, extra) for t in part)


def _take(value: Any, rows: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 0 or value.shape[0] == rows else value[:rows]
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, rows) for v in value)
    return value


def _mean(out: Any) -> Any:
    """The micro-batch's mean loss from what a loss_fn returns (a mean, per-row losses, (loss, tokens))."""
    if isinstance(out, tuple):
        out = out[0]
    return out.mean() if isinstance(out, torch.Tensor) and out.dim() == 1 else out


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:3])})"
    return f"a {type(value).__name__}"


class WeightedPipelineLoss:
    """The module's ``loss_fn`` for one run: the user's loss on real rows, weighted for the exact mean.

    ``user_loss(outputs, labels)`` returns the mean loss over its rows (a scalar; with token
    normalisation the mean over their target tokens, or ``(loss, num_tokens)``), or one loss per row
    (shape ``[rows]``, sample normalisation only), which is summed.
    """

    def __init__(self, user_loss: Callable[[Any, Any], Any], *, by_token: bool) -> None:
        self.user_loss = user_loss
        self.by_token = by_token
        self._queue: deque[tuple[int, float]] = deque()

    def expect(self, passes: Sequence[tuple[int, float]]) -> None:
        """The coming step's passes, in order: ``(real rows, weight)`` with weight = count × GAS × dp / total."""
        self._queue.clear()
        self._queue.extend(passes)

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        if not self._queue:
            if not torch.is_grad_enabled():  # DeepSpeed's eval_batch (under no_grad): the plain mean
                return _mean(self.user_loss(outputs, labels))
            raise RuntimeError(
                "the pipeline's loss_fn ran outside an adaptive step: call engine.train_batch(), not "
                "the DeepSpeed engine's own train_batch"
            )
        rows, weight = self._queue.popleft()
        # A pad pass (no real row) still runs backward through its first row, weighted 0, so every
        # stage receives the gradient it waits for.
        keep = max(rows, 1)
        out = self.user_loss(_take(outputs, keep), _take(labels, keep))
        if isinstance(out, tuple):  # (mean loss, num_tokens): the count was taken when feeding
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.dim() > 1:
            raise TypeError(
                "the pipeline's loss_fn(outputs, labels) must return a tensor: the mean loss over the "
                f"micro-batch (a scalar) or one loss per sample (shape [{keep}]); got {_describe(out)}"
            )
        out = out.float()
        if out.dim() == 1:
            if self.by_token or out.shape[0] != keep:
                raise TypeError(
                    f"the pipeline's loss_fn returned {out.shape[0]} values for {keep} samples; return "
                    "the mean (a scalar)"
                    + (' over target tokens with loss_normalization "token"' if self.by_token else "")
                    + " or one loss per sample"
                )
            # weight is count × GAS·dp / total with count = rows: per sample that is weight / rows.
            return out.sum() * (weight / keep)
        return out * weight

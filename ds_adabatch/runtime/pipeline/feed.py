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

from ..core.weights import loss_of

__all__ = ["WeightedPipelineLoss", "check_pipeline_batch", "loss_reduction", "pad_rows", "rows_of"]


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


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:3])})"
    return f"a {type(value).__name__}"


def loss_reduction(loss_fn: Any) -> str:
    """How ``loss_fn`` reduces its rows: ``"mean"`` (the default), ``"sum"`` or ``"none"``.

    Read from a loss module's ``reduction`` (``torch.nn.CrossEntropyLoss(reduction="sum")``) or a
    ``functools.partial``'s ``reduction=`` keyword (``partial(F.cross_entropy, reduction="none")``); a
    plain function is taken to return the mean (or one loss per row, told apart by its shape).
    """
    while True:
        reduction = getattr(loss_fn, "reduction", None)
        if isinstance(reduction, str):
            break
        keywords = getattr(loss_fn, "keywords", None)  # functools.partial
        if isinstance(keywords, dict) and isinstance(keywords.get("reduction"), str):
            reduction = keywords["reduction"]
            break
        inner = getattr(loss_fn, "func", None)
        if inner is None:
            return "mean"
        loss_fn = inner
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"the pipeline's loss_fn reduces with {reduction!r}; use reduction='mean', 'sum' or 'none'"
        )
    return reduction


class WeightedPipelineLoss(torch.nn.Module):
    """The module's ``loss_fn`` for one run: the user's loss on real rows, weighted for the exact mean.

    ``user_loss(outputs, labels)`` may be a function, a ``functools.partial`` or a loss module
    (``torch.nn.CrossEntropyLoss()``; it stays a child module, so ``.to()`` moves its buffers). What it
    returns is read by its reduction (:func:`loss_reduction`):

    * ``"mean"``: the mean loss over its rows (a scalar; with token normalisation the mean over their
      target tokens, or ``(loss, num_tokens)``), or one loss per row (shape ``[rows]``, sample
      normalisation only), which is averaged;
    * ``"sum"``: the sum over its rows (or over their target tokens), divided by their count;
    * ``"none"``: one loss per element; each row's loss is the mean of its elements (sample
      normalisation), or all elements are summed and divided by the target tokens (token normalisation,
      where ignored positions contribute 0, as ``cross_entropy(..., reduction="none")`` gives them).

    It is a ``torch.nn.Module`` because DeepSpeed's ``PipelineModule`` keeps a loss module as a child:
    torch refuses to put anything else in that slot.
    """

    def __init__(self, user_loss: Callable[[Any, Any], Any], *, by_token: bool) -> None:
        super().__init__()
        self.user_loss = user_loss
        self.reduction = loss_reduction(user_loss)
        self.by_token = by_token
        self._queue: deque[tuple[int, float, float]] = deque()

    def expect(self, passes: Sequence[tuple[int, float, float]]) -> None:
        """The coming step's passes, in order: ``(real rows, count, weight)`` with count the rows (or
        target tokens) and weight = count × GAS × dp / total."""
        self._queue.clear()
        self._queue.extend(passes)

    def forward(self, outputs: Any, labels: Any) -> torch.Tensor:
        if not self._queue:
            if not torch.is_grad_enabled():  # DeepSpeed's eval_batch (under no_grad): the plain mean
                out = self.user_loss(outputs, labels)
                rows = rows_of((outputs, labels)) if isinstance(outputs, torch.Tensor) else 1
                return self._mean(out, rows, rows) if not self.by_token or self.reduction == "mean" else out
            raise RuntimeError(
                "the pipeline's loss_fn ran outside an adaptive step: call engine.train_batch(), not "
                "the DeepSpeed engine's own train_batch"
            )
        rows, count, weight = self._queue.popleft()
        # A pad pass (no real row) still runs backward through its first row, weighted 0, so every
        # stage receives the gradient it waits for.
        keep = max(rows, 1)
        out = self.user_loss(_take(outputs, keep), _take(labels, keep))
        counted = count if self.by_token and rows else None
        out = loss_of(
            out, counted, "the pipeline's loss_fn", "labels != -100 of the labels, or token_count_fn"
        )
        return self._mean(out, keep, max(count, 1)) * weight

    def _mean(self, out: Any, rows: int, count: float) -> torch.Tensor:
        """The pass's mean loss over its ``rows`` (or ``count`` target tokens) from ``out`` as reduced."""
        if isinstance(out, tuple):  # (mean loss, num_tokens) in eval_batch: nothing to weigh
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                "the pipeline's loss_fn(outputs, labels) must return a tensor: the mean loss over the "
                f"micro-batch (a scalar) or one loss per sample (shape [{rows}]); got {_describe(out)}"
            )
        out = out.float()
        if self.reduction == "sum":
            if out.dim():
                raise TypeError(f"the pipeline's loss_fn reduces by 'sum' but returned {_describe(out)}")
            return out / count
        if self.reduction == "none" and out.dim():
            if self.by_token:  # ignored positions are 0: the sum over the pass's target tokens
                return out.sum() / count
            return out.reshape(out.shape[0], -1).mean(dim=1).mean()  # each row: its elements' mean
        if out.dim() == 0:
            return out
        if out.dim() == 1 and out.shape[0] == rows and not self.by_token:
            return out.mean()  # one loss per row
        raise TypeError(
            "the pipeline's loss_fn(outputs, labels) must return a tensor: the mean loss (a scalar)"
            + (' over target tokens with loss_normalization "token"' if self.by_token else "")
            + f" or one loss per sample (shape [{rows}]), or be built with reduction='sum' or 'none'; "
            f"it returned {_describe(out)} for {rows} samples"
        )

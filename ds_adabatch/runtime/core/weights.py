"""Loss weights that make every optimizer step the exact mean over the global batch.

DeepSpeed averages gradients over the ``W`` data-parallel ranks and, by default, divides each
micro-batch loss by the gradient-accumulation steps. Neither is right when micro-batches differ in size
(uneven plans, the smaller epoch-tail batch, zero-weight pads) or when the loss is a mean over tokens.
The runtime therefore calls ``engine.backward(loss * weight, scale_wrt_gas=False)`` with

    weight = count * W / total

where ``count`` is the micro-batch's real samples (or target tokens) and ``total`` the global batch's,
summed over all ranks. Summed over micro-batches and averaged over ranks this is exactly
``(1 / total) * sum of per-item gradients``: the gradient one big batch would give.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["default_token_count", "loss_of", "loss_weight", "make_token_counter", "pipeline_token_count"]

IGNORE_INDEX = -100


def loss_weight(count: int, world_size: int, total: int) -> float:
    """``count * world_size / total``; 0 for a pad (``count == 0``)."""
    if total <= 0:
        raise ValueError(f"the global batch holds no samples or tokens to average over (total={total})")
    return count * world_size / total


def loss_of(
    out: Any,
    counted: float | None,
    who: str,
    counter: str = "labels != -100, shifted by one for causal LMs, or token_count_fn",
) -> Any:
    """The loss in what a loss function returned: ``out`` itself, or the first item of a tuple.

    Every micro-batch's weight needs the global batch's target tokens, summed over ranks before the
    step's first forward, so they are counted from the batches (``counter`` says how), never from the
    loss. A ``(loss, num_tokens)`` pair's count (a whole number of any type; a one-element tensor is
    read to the host) is checked against that count (``counted``; None: not checked, as under sample
    normalisation or for a pad): where they differ, the weights would not give the mean over the tokens
    the loss averages, so it is refused with what to pass. A second item that is no whole number
    (logits, an auxiliary loss) is no count; other tuples (``(loss, logits, ...)``) give their first item.
    """
    if not isinstance(out, tuple) or not out:
        return out
    loss = out[0]
    if counted is None or len(out) != 2:
        return loss
    tokens = _count_in(out[1])
    if tokens is None:
        return loss
    if tokens != int(counted):
        raise ValueError(
            f"{who} returned num_tokens={int(tokens)} for a micro-batch whose target tokens were counted as "
            f"{int(counted)} ({counter}) before its forward: the weights of an exact token mean need every "
            "count before the step's first forward, so they cannot come from the loss. Pass "
            "token_count_fn=... to ds_adabatch.initialize that counts the tokens your loss averages over"
        )
    return loss


def _count_in(value: Any) -> int | None:
    """``value`` as a token count where it is one: a whole number (an int, a numpy integer, an integral
    float, or a one-element tensor holding one, read to the host); None for anything else (logits, an
    auxiliary loss such as 0.01)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(value)
    return None


def default_token_count(batch: Any, *, shifted: bool) -> int:
    """Target tokens of a Hugging Face style batch: ``labels != -100``.

    Causal language models (``*ForCausalLM``) shift labels by one inside ``forward``, so their loss
    averages over ``labels[..., 1:]``; ``shifted`` selects that count.
    """
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise ValueError(
            'loss_normalization "token" needs batches that are dicts with a "labels" tensor, or a '
            "token_count_fn passed to ds_adabatch.initialize that counts the target tokens of a "
            "micro-batch (the weights need every count before the step's first forward, so a count "
            "returned by loss_fn cannot stand in for it)"
        )
    labels = batch["labels"]
    if shifted:
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def make_token_counter(module: Any) -> Callable[[Any], int]:
    """The default token counter for ``module``: shifted for causal LMs, plain otherwise."""
    shifted = "CausalLM" in type(module).__name__ or "LMHead" in type(module).__name__

    def count(batch: Any) -> int:
        return default_token_count(batch, shifted=shifted)

    return count


def pipeline_token_count(batch: Any) -> int:
    """Target tokens of a pipeline micro-batch ``(inputs, labels)``: ``labels != -100`` (the first
    labels tensor when labels are a tuple), unshifted: a pipeline's loss_fn gets labels as they are."""
    labels = batch[1]
    if isinstance(labels, (tuple, list)):
        labels = labels[0]
    return int((labels != IGNORE_INDEX).sum())

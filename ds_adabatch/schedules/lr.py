"""Learning-rate coupling: how the LR scales when the global batch changes.

``linear`` keeps the LR per sample constant (Goyal et al. 2017, SGD); ``sqrt`` keeps the update's noise
constant (the usual rule for Adam-type optimizers); ``none`` leaves the LR schedule alone.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCALING_RULES", "lr_multiplier"]

LR_SCALING_RULES = ("none", "linear", "sqrt")


def lr_multiplier(rule: str, global_batch: int | float, reference_batch: int | float) -> float:
    """The factor to multiply the scheduled LR by at ``global_batch``.

    ``none`` -> 1, ``linear`` -> B / reference, ``sqrt`` -> sqrt(B / reference); ``reference_batch`` is
    the batch the LR schedule was tuned for (samples per optimizer step).

    Raises:
        ValueError: unknown rule, or a batch that is not a positive number.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"unknown lr_scaling rule {rule!r}; use one of {', '.join(LR_SCALING_RULES)}")
    for name, value in (("global_batch", global_batch), ("reference_batch", reference_batch)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if rule == "none":
        return 1.0
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)

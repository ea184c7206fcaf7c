"""Learning-rate coupling: how the LR scales when the global batch changes.

``linear`` keeps the LR per sample constant (Goyal et al. 2017, SGD); ``sqrt`` keeps the update's noise
constant (the usual rule for Adam-type optimizers); ``none`` leaves the LR schedule alone.

``adascale`` follows the measured gradient-noise scale instead of the batch alone: AdaScale's gain
(Johnson et al., ICML '20) at batch ``B`` against the reference ``B0``,

    gain = (B / B0) x (B_noise + B0) / (B_noise + B)

is 1 where the gradient has no noise (a larger batch takes the same step) and ``B / B0`` where it is all
noise (the ``linear`` rule), i.e. the batch ratio times Pollux's statistical efficiency. The multiplier
is ``gain ** gain_power``: ``gain_power`` 0.5 (the default) is AdaptDL's form for Adam-type optimizers,
which meets ``sqrt`` where the noise dominates; 1 is AdaScale's own rule for SGD. Before the first noise
estimate the gain is 1 (the reference batch's LR); where the estimate's smoothed |G|^2 is not positive
(the gradient reads as all noise) it is ``B / B0``. Only the schedules that measure the noise scale
(``gradient_noise``, ``goodput``) can drive it.
"""

from __future__ import annotations

import math
import numbers

from ..signals.efficiency import statistical_efficiency

__all__ = ["LR_SCALING_RULES", "NOISE_DRIVEN_RULES", "adascale_gain", "lr_multiplier"]

LR_SCALING_RULES = ("none", "linear", "sqrt", "adascale")
NOISE_DRIVEN_RULES = frozenset({"adascale"})
"""Rules whose multiplier also follows the gradient-noise scale (re-applied before every step)."""


def adascale_gain(batch: float, reference_batch: float, noise_scale: float | None) -> float:
    """AdaScale's gain at ``batch`` against ``reference_batch`` (module docstring): between 1 (no noise)
    and ``batch / reference_batch`` (all noise, ``noise_scale`` ``inf``); 1 where no estimate exists yet
    (``noise_scale`` None, NaN or negative)."""
    if noise_scale is None or math.isnan(noise_scale) or noise_scale < 0:
        return 1.0
    if math.isinf(noise_scale):
        return batch / reference_batch
    return batch / reference_batch * statistical_efficiency(batch, noise_scale, reference_batch)


def lr_multiplier(
    rule: str,
    global_batch: int | float,
    reference_batch: int | float,
    *,
    noise_scale: float | None = None,
    gain_power: float = 0.5,
) -> float:
    """The factor to multiply the scheduled LR by at ``global_batch``.

    ``none`` -> 1, ``linear`` -> B / reference, ``sqrt`` -> sqrt(B / reference), ``adascale`` ->
    :func:`adascale_gain` ``** gain_power`` at ``noise_scale``; ``reference_batch`` is the batch the LR
    schedule was tuned for (samples per optimizer step).

    Raises:
        ValueError: unknown rule, a batch that is not a positive number, or a ``gain_power`` outside
            (0, 1].
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"unknown lr_scaling rule {rule!r}; use one of {', '.join(LR_SCALING_RULES)}")
    for name, value in (("global_batch", global_batch), ("reference_batch", reference_batch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if rule == "none":
        return 1.0
    if rule == "adascale":
        if not 0.0 < gain_power <= 1.0:
            raise ValueError(f"gain_power must be in (0, 1], got {gain_power!r}")
        return adascale_gain(global_batch, reference_batch, noise_scale) ** gain_power
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)

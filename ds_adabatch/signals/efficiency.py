"""Statistical efficiency: how much of a larger batch's samples count, from the gradient-noise scale.

Pollux (Qiao et al., OSDI '21, after McCandlish et al. 2018) defines the efficiency of training at
global batch ``M`` relative to a reference batch ``M0`` as::

    EFFICIENCY(M) = (B_noise + M0) / (B_noise + M)

where ``B_noise`` is the gradient-noise scale (samples). The reason: with the learning rate scaled to the
batch, reaching a given loss takes about ``S_min (1 + B_noise / M)`` optimizer steps at batch ``M``, i.e.
``E_min (1 + M / B_noise)`` samples, proportional to ``B_noise + M``. A sample at batch ``M`` therefore
makes ``(B_noise + M0) / (B_noise + M)`` of the progress a sample makes at ``M0``: 1 at ``M0``, close to
1 while ``M`` is well below ``B_noise`` (each sample still counts fully), and falling as ``1 / M`` beyond
it (the extra samples mostly average away noise that was already small). Goodput, the progress per
second, is then ``throughput(M) x EFFICIENCY(M)`` in "samples at ``M0``" per second.

``B_noise`` is the estimate the runtime already measures for ``gradient_noise``
(:class:`~ds_adabatch.signals.GradientNoiseEstimator`), in Adam's geometry for Adam-type optimizers, as
Pollux measures it with the optimizer's preconditioner: the noise of the step the optimizer takes.
"""

from __future__ import annotations

import math

__all__ = ["efficiency_form", "statistical_efficiency"]


def statistical_efficiency(
    batch: float, noise_scale: float, reference_batch: float, exponent: float = 1.0
) -> float:
    """``((noise_scale + reference_batch) / (noise_scale + batch)) ** exponent`` (module docstring); all
    in samples. ``exponent`` 1 is Pollux's efficiency, 0.5 the one under square-root LR scaling.

    Raises:
        ValueError: a batch is not positive, the noise scale is negative or not finite, or the exponent
            is not in (0, 1].
    """
    if not batch > 0 or not reference_batch > 0:
        raise ValueError(f"batches must be > 0 samples, got {batch!r} and reference {reference_batch!r}")
    if not (math.isfinite(noise_scale) and noise_scale >= 0):
        raise ValueError(f"the noise scale must be a finite number >= 0 samples, got {noise_scale!r}")
    if not 0.0 < exponent <= 1.0:
        raise ValueError(f"the exponent must be in (0, 1], got {exponent!r}")
    ratio = (noise_scale + reference_batch) / (noise_scale + batch)
    return ratio if exponent == 1.0 else ratio**exponent


def efficiency_form(efficiency: str, lr_rule: str | None) -> str:
    """The form a ``goodput`` schedule's ``efficiency`` setting selects: ``"linear"`` (Pollux's) or
    ``"sqrt"``; ``"auto"`` is ``"sqrt"`` where the LR follows the batch as its square root (``lr_rule``,
    the batch-only rule the section's ``lr_scaling`` meets), else ``"linear"``."""
    if efficiency == "auto":
        return "sqrt" if lr_rule == "sqrt" else "linear"
    return efficiency

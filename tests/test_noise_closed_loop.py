"""The ``gradient_noise`` schedule in a closed loop: controller, estimator and measurements, no DeepSpeed.

Linear regression with a closed-form noise scale (x ~ N(0, I_8), y = x . w* + N(0, 1), |w*| = 1,
0.5 (x . w - y)^2 at w = 0): B_noise = (n + 1) |G|^2 + n sigma^2 = 17, so the sgd geometry's default
``scale`` 0.5 aims at 8.5. Every step draws the step's samples, forms what the runtime measures on 2 ranks (the mean squared
norm of each micro-batch's mean gradient, the squared norm of the global mean), feeds the estimator
the schedule configures and asks the real controller for the next batch. The weights stay at 0 (learning
rate 0), so the truth never moves and any excursion is the controller acting on noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.plan import plan_batch
from ds_adabatch.schedules import BatchSizeController, ScheduleContext
from ds_adabatch.signals import GradientNoiseEstimator

DIM, SIGMA, WORLD = 8, 1.0, 2
W_STAR = np.ones(DIM) / math.sqrt(DIM)
TRUTH = (DIM + 1) + DIM * SIGMA**2
TARGET = 0.5 * TRUTH  # the sgd geometry's default scale
RUNS, STEPS = 200, 400


def closed_loop(seed: int, section: dict, steps: int = STEPS) -> list[int]:
    """The global batch of every step of one run (stops early once it passes 64 x the target)."""
    rng = np.random.default_rng(seed)
    config = AdaBatchConfig.model_validate(section)
    controller = BatchSizeController(config, WORLD)
    estimator = GradientNoiseEstimator(**config.schedule.estimator_settings())
    batch, samples, batches = controller.initial_global_batch(), 0, []
    for step in range(steps):
        ctx = ScheduleContext(
            step=step,
            samples=samples,
            global_batch=batch,
            world_size=WORLD,
            noise_scale=estimator.noise_scale,
            noise_scale_error=estimator.relative_error,
        )
        batch = controller.next_global_batch(ctx).global_batch
        batches.append(batch)
        if batch > 64 * TARGET:
            break
        plan = plan_batch(batch, WORLD, config.max_micro_batch_per_gpu)
        micro, gas = plan.micro_batch_per_gpu, plan.gradient_accumulation_steps
        x = rng.standard_normal((WORLD * gas, micro, DIM))
        y = x @ W_STAR + SIGMA * rng.standard_normal((WORLD * gas, micro))
        grads = -(y[..., None] * x).mean(axis=1)  # each micro-batch's mean gradient at w = 0
        if WORLD * gas > 1:
            small = float((grads**2).sum(axis=1).mean())
            big = float((grads.mean(axis=0) ** 2).sum())
            estimator.update(micro, small, batch, big)
        samples += batch
    return batches


def _runs(start: int, max_micro: int) -> list[list[int]]:
    # The loop measures plain gradients: the sgd geometry, whose default scale is 0.5.
    schedule = {"type": "gradient_noise", "start": start, "geometry": "sgd"}
    section = {"schedule": schedule, "max_micro_batch_per_gpu": max_micro}
    return [closed_loop(seed, section) for seed in range(RUNS)]


@pytest.mark.parametrize(("start", "max_micro"), [(2, 1), (2, 4), (8, 4)])
def test_default_gradient_noise_schedule_never_runs_away(start, max_micro):
    runs = _runs(start, max_micro)
    peaks = [max(b) for b in runs]
    over = [(seed, peak) for seed, peak in enumerate(peaks) if peak > 4 * TARGET]
    assert not over, (
        f"start {start}, micro <= {max_micro}: {len(over)} of {RUNS} runs went above 4 x the target "
        f"{TARGET} (seed, peak): {over[:10]}"
    )
    # Safe must not mean stuck: most runs end near the target.
    finals = sorted(b[-1] for b in runs)
    median = finals[len(finals) // 2]
    assert TARGET / 2 <= median <= 2 * TARGET, f"start {start}: median final batch {median}, target {TARGET}"

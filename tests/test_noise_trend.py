"""The noise estimate read at its trend's value now (``ds_adabatch.signals.noise_trend``)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from ds_adabatch.config.schedules import ScheduleConfig
from ds_adabatch.signals import GradientNoiseEstimator
from ds_adabatch.signals.noise_trend import MAX_FACTOR, extrapolate


def measure(
    est: GradientNoiseEstimator, rng: random.Random, scale: float, b_small=4.0, b_big=8.0, spread=0.1
):
    """One measurement of a gradient whose noise scale is ``scale`` (|G|^2 1), each squared norm
    scattered by ``spread`` (relative, lognormal)."""
    g2, trace = 1.0, scale

    def norm(b):
        return (g2 + trace / b) * math.exp(rng.gauss(0.0, spread))

    est.update(b_small, norm(b_small), b_big, norm(b_big))


def test_a_growing_noise_scale_is_read_near_its_value_now_and_a_steady_one_as_it_is():
    """B_noise doubling every 17 measurements (every ~300 steps where one step in 17 is measured), 60
    measurements, 30 seeds: the plain estimate lags (reads it ~1.7x low on average), the trend reads it
    within 15% on average; a steady B_noise reads exactly as the plain estimate nearly always."""
    plain, now = [], []
    for seed in range(30):
        rng = random.Random(seed)
        est = GradientNoiseEstimator(0.95, trend=True)
        for i in range(60):
            measure(est, rng, 10.0 * 2 ** (i / 17), spread=0.02)
        true = 10.0 * 2 ** (59 / 17)
        plain.append(math.log(est.noise_scale / true))
        now.append(math.log(est.noise_scale_now / true))
        assert est.relative_error_now >= est.relative_error
    assert sum(plain) / len(plain) < math.log(1 / 1.4), plain  # the lag the trend is for
    assert abs(sum(now) / len(now)) < math.log(1.15), now
    rng = random.Random(0)
    steady = GradientNoiseEstimator(0.95, trend=True)
    read_as_is = 0
    for _ in range(200):
        measure(steady, rng, 30.0, spread=0.02)
        read_as_is += steady.noise_scale_now == steady.noise_scale
    assert read_as_is >= 180, read_as_is  # the 2-sigma test lets few through
    assert abs(steady.noise_scale_now / 30.0 - 1) < 0.3


def test_the_trend_is_bounded_off_by_default_and_survives_a_checkpoint():
    # Read at ages 19 and 9: 10 and 40 extrapolate to ~150 (k 1.9), bounded to 4x; a difference within
    # twice its standard error is none.
    long = SimpleNamespace(noise_scale=10.0, relative_error=0.1, mean_age=19.0)
    short = SimpleNamespace(noise_scale=40.0, relative_error=0.15, mean_age=9.0)
    assert extrapolate(long, short) == (
        pytest.approx(10.0 * MAX_FACTOR),
        pytest.approx(math.sqrt(0.01 + 1.9**2 * 0.0125 / 3)),
    )
    assert extrapolate(long, SimpleNamespace(noise_scale=12.0, relative_error=0.3, mean_age=9.0)) == (
        10.0,
        0.1,
    )
    assert extrapolate(long, SimpleNamespace(noise_scale=None, relative_error=math.inf, mean_age=0.0)) == (
        10.0,
        0.1,
    )
    rng = random.Random(1)
    fast = GradientNoiseEstimator(0.95, trend=True)
    for i in range(40):
        measure(fast, rng, 2.0 * 2 ** (i / 5), spread=0.005)
    assert fast.noise_scale_now > 2 * fast.noise_scale
    plain = GradientNoiseEstimator(0.95)
    for i in range(80):
        measure(plain, random.Random(i), 2.0 * 2 ** (i / 3))
    assert plain.trend is None and plain.noise_scale_now == plain.noise_scale
    again = GradientNoiseEstimator(0.95, trend=True)
    again.load_state_dict(fast.state_dict())
    assert again.noise_scale_now == fast.noise_scale_now and again.mean_age == fast.mean_age
    # A state written without the trend: the twin starts empty and the estimate reads as it is.
    restored = GradientNoiseEstimator(0.95, trend=True)
    restored.load_state_dict(plain.state_dict())
    assert restored.noise_scale_now == plain.noise_scale


def test_goodput_config_turns_it_on():
    schedule = TypeAdapter(ScheduleConfig).validate_python(
        {"type": "goodput", "start": 8, "noise_trend": True}
    )
    settings = schedule.estimator_settings()
    assert settings["trend"] is True
    assert GradientNoiseEstimator(**settings).trend is not None

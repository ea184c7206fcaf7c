"""A device whose speed changes: the throughput model reads every shape at the speed now
(ds_adabatch.signals.drift), and the simulated curves' ``drift`` that tests and benchmarks run on."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.plan import plan_batch
from ds_adabatch.schedules import BatchSizeController, ScheduleContext
from ds_adabatch.signals import SimulatedDevice, ThroughputModel, parse_step_time_curve
from ds_adabatch.signals.drift import DeviceDrift


def _run(drift: DeviceDrift, key, times) -> int:
    return [drift.add(key, t) for t in times][-1]


def test_a_runs_speed_change_reads_the_times_before_it_at_the_speed_now():
    drift = DeviceDrift(window=8)
    first = _run(drift, (16, 1, 1), [0.055] * 6)
    eights = _run(drift, (8, 1, 1), [0.030] * 12)  # the lead (4) and a first window
    assert (first, eights) == (1, 2)
    assert drift.since(first) == 1.0  # the run is too short to tell its windows apart
    assert _run(drift, (8, 1, 1), [0.045] * 8) == eights  # the device got 1.5x slower while 8 ran
    assert drift.since(first) == pytest.approx(1.5) and drift.since(0) == pytest.approx(1.5)
    assert drift.since(eights) == 1.0  # the run going on is read as it runs
    # A later run's change multiplies in; a run back to 16 starts its own.
    later = _run(drift, (24, 1, 1), [0.07] * 12 + [0.035] * 8)
    assert drift.since(first) == pytest.approx(0.75) and drift.since(eights) == pytest.approx(0.5)
    assert _run(drift, (16, 1, 1), [0.03] * 3) == later + 1
    assert drift.since(later) == 1.0 and drift.since(first) == pytest.approx(0.75)
    # It survives a checkpoint.
    again = DeviceDrift(window=8)
    again.load_state_dict(drift.state_dict())
    assert again.since(first) == pytest.approx(0.75) and again.since(later) == 1.0
    assert again.add((16, 1, 1), 0.03) == later + 1 and again.add((8, 1, 1), 0.03) == later + 2


def test_a_change_within_the_times_scatter_is_not_a_speed_change():
    rng = random.Random(0)
    scattered = DeviceDrift(window=8)
    first = _run(scattered, (16, 1, 1), [0.05] * 5)
    _run(scattered, (8, 1, 1), [0.03 * math.exp(0.2 * rng.gauss(0, 1)) for _ in range(40)])
    assert scattered.since(first) == 1.0
    # The same change with a small scatter is read.
    clear = DeviceDrift(window=8)
    first = _run(clear, (16, 1, 1), [0.05] * 5)
    _run(clear, (8, 1, 1), [0.03 * (1 + 0.01 * rng.uniform(-1, 1)) for _ in range(12)])
    _run(clear, (8, 1, 1), [0.036 * (1 + 0.01 * rng.uniform(-1, 1)) for _ in range(8)])
    assert clear.since(first) == pytest.approx(1.2, rel=0.02)


def test_the_throughput_model_fits_and_rates_the_shapes_at_the_speed_now():
    model = ThroughputModel()
    for _ in range(6):
        model.observe(8, 1, 1, 0.030)
    for _ in range(6):
        model.observe(16, 1, 1, 0.055)
    for _ in range(30):
        model.observe(8, 1, 1, 0.030)
    assert model.measured(1) == [(8, 1, 0.030, 8), (16, 1, pytest.approx(0.055), 5)]
    slow = model.rated_time(32, 1, 1)
    for _ in range(20):  # the device runs 1.5x slower from here
        model.observe(8, 1, 1, 0.045)
    assert model.measured(1) == [(8, 1, 0.045, 8), (16, 1, pytest.approx(0.0825), 5)]
    assert model.rated_time(32, 1, 1) == pytest.approx(1.5 * slow)
    # The runs are in its state; a state written before them loads with none (no change known).
    again = ThroughputModel()
    again.load_state_dict(model.state_dict())
    assert again.measured(1) == model.measured(1)
    old = model.state_dict()
    del old["runs"], old["drift"]
    older = ThroughputModel()
    older.load_state_dict(old)
    assert older.measured(1) == [(8, 1, 0.045, 8), (16, 1, pytest.approx(0.055), 5)]
    # A shape's times from runs at two speeds are each read at the speed now.
    model = ThroughputModel()
    for seconds, micro, steps in ((0.030, 8, 4), (0.055, 16, 5), (0.030, 8, 12), (0.045, 8, 8)):
        for _ in range(steps):
            model.observe(micro, 1, 1, seconds)
    model.observe(16, 1, 1, 0.0825)  # 16 again, at the slower speed: its times before read alike
    assert model.measured(1)[1] == (16, 1, pytest.approx(0.0825), 5)


def test_goodput_does_not_move_on_a_device_that_slowed_down():
    """Batch 8 is the optimum (a compute-bound step, a small noise scale); after the warm-up's trial of
    16 the device runs 1.6x slower. Read as they were measured, 16's times rated it 10% above 8 and the
    schedule moved; read at the speed now, it stays."""
    section = AdaBatchConfig.model_validate(
        {
            "schedule": {"type": "goodput", "start": 8},
            "max_micro_batch_per_gpu": 64,
            "max_global_batch": 64,
            "lr_scaling": {"rule": "sqrt"},
        }
    )
    controller = BatchSizeController(section, 1)
    schedule = controller.schedule
    batch, batches = controller.initial_global_batch(), []
    for step in range(200):
        known = step >= 20
        ctx = ScheduleContext(
            step=step,
            samples=0,
            global_batch=batch,
            world_size=1,
            noise_scale=6.0 if known else None,
            noise_scale_error=0.1 if known else None,
            micro_batch_limit=64,
        )
        batch = controller.next_global_batch(ctx).global_batch
        batches.append(batch)
        plan = plan_batch(batch, 1, 64)
        speed = 1.6 if step >= 60 else 1.0
        seconds = speed * (0.0093 + 0.00276 * plan.micro_batch_per_gpu)
        schedule.throughput.observe(plan.micro_batch_per_gpu, plan.gradient_accumulation_steps, 1, seconds)
    assert 16 in batches[:20] and batches[20:] == [8] * 180, batches


def test_a_simulated_device_drifts_every_drift_steps_and_is_the_curve_without_a_drift():
    plain = parse_step_time_curve("fixed=0.01,per_sample=0.001,jitter=0.1")
    device, rng = SimulatedDevice(plain, random.Random(3)), random.Random(3)
    assert [device.measure(8, 2) for _ in range(5)] == [plain.measure(8, 2, rng) for _ in range(5)]
    curve = parse_step_time_curve("fixed=0.02,drift=0.3,drift_steps=10")
    assert (curve.drift, curve.drift_steps) == (0.3, 10) and "every 10 steps on average" in curve.describe()
    device = SimulatedDevice(curve, random.Random(0))
    times = [device.measure(8, 1) for _ in range(40000)]
    changes = [k for k in range(1, len(times)) if times[k] != times[k - 1]]
    assert 3600 < len(changes) < 4400  # one step in 10 on average
    assert len({k % 10 for k in changes}) == 10  # at any step, not on a grid
    logs = [math.log(times[k] / 0.02) for k in changes]
    assert statistics.fmean(logs) == pytest.approx(-(0.3**2) / 2, abs=0.02)
    assert statistics.stdev(logs) == pytest.approx(0.3, rel=0.05)
    for bad in ("fixed=0.02,drift_steps=0", "fixed=0.02,drift_steps=2.5"):
        with pytest.raises(ValueError, match="drift_steps must be a whole number"):
            parse_step_time_curve(bad)
    with pytest.raises(ValueError, match="drift must be a finite number >= 0"):
        parse_step_time_curve("fixed=0.02,drift=-1")


def test_with_no_runs_kept_every_shape_is_read_as_it_was_measured(monkeypatch):
    from ds_adabatch.signals import drift as module

    monkeypatch.setattr(module, "RUNS_KEPT", 0)
    model = ThroughputModel()
    for seconds, micro, steps in ((0.030, 8, 6), (0.055, 16, 6), (0.030, 8, 12), (0.045, 8, 8)):
        for _ in range(steps):
            model.observe(micro, 1, 1, seconds)
    assert model.measured(1) == [(8, 1, 0.045, 8), (16, 1, 0.055, 5)]

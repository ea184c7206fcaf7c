"""Signals (loss EMA, gradient-noise estimator) and the schedules that feed on them."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.config.schedules import ScheduleConfig
from ds_adabatch.schedules import BatchSizeController, ScheduleContext, build_schedule
from ds_adabatch.signals import EmaLoss, GradientNoiseEstimator

SCHEDULES = TypeAdapter(ScheduleConfig)


def plateau_rule(lo=1, hi=None, **fields):
    cfg = SCHEDULES.validate_python({"type": "loss_plateau", **fields})
    return build_schedule(cfg, world_size=1, min_global_batch=lo, max_global_batch=hi)


def feed(rule, losses, *, step0=1):
    """One evaluation per loss; returns the rule's batch after each."""
    return [
        rule(ScheduleContext(step=step0 + i, samples=0, global_batch=16, world_size=1, loss=loss))
        for i, loss in enumerate(losses)
    ]


# ---------------------------------------------------------------- EmaLoss


def test_ema_is_bias_corrected():
    ema = EmaLoss(beta=0.9)
    assert ema.value is None
    assert ema.update(2.0) == pytest.approx(2.0), "the first value must not be pulled towards 0"
    for _ in range(20):
        ema.update(2.0)
    assert ema.value == pytest.approx(2.0)
    two = EmaLoss(beta=0.5)
    two.update(1.0)
    # raw = 0.5 * (0.5 * 1) + 0.5 * 3 = 1.75, corrected by 1 - 0.25.
    assert two.update(torch.tensor(3.0)) == pytest.approx(1.75 / 0.75)


def test_ema_skips_non_finite_losses():
    ema = EmaLoss(beta=0.9)
    ema.update(1.0)
    assert ema.update(math.nan) == pytest.approx(1.0)
    assert ema.update(math.inf) == pytest.approx(1.0)
    assert (ema.count, ema.skipped) == (1, 2)


def test_ema_state_round_trip():
    ema = EmaLoss(beta=0.8)
    for x in (3.0, 2.5, 2.7):
        ema.update(x)
    twin = EmaLoss(beta=0.8)
    twin.load_state_dict(ema.state_dict())
    assert twin.update(2.2) == ema.update(2.2)
    other = EmaLoss(beta=0.5)
    other.load_state_dict(twin.state_dict())
    assert other.value == pytest.approx(twin.value), "a changed beta restarts from the restored value"
    with pytest.raises(ValueError, match="version"):
        twin.load_state_dict({**ema.state_dict(), "version": 7})
    with pytest.raises(ValueError, match="EmaLoss"):
        twin.load_state_dict(GradientNoiseEstimator().state_dict())


# ---------------------------------------------------------------- GradientNoiseEstimator


def test_estimator_recovers_exact_expectations():
    # Feed E|g_b|^2 = |G|^2 + tr / b exactly: both terms come back exactly.
    g2, trace = 2.0, 60.0
    est = GradientNoiseEstimator(ema_beta=0.9)
    assert est.noise_scale is None
    for b_small, b_big in ((4, 64), (8, 32), (1, 2)):
        est.update(b_small, g2 + trace / b_small, b_big, g2 + trace / b_big)
    assert est.grad_sq_norm == pytest.approx(g2)
    assert est.trace_sigma == pytest.approx(trace)
    assert est.noise_scale == pytest.approx(30.0)


def test_estimator_guards():
    est = GradientNoiseEstimator()
    with pytest.raises(ValueError, match="0 < b_small < b_big"):
        est.update(8, 1.0, 8, 1.0)
    assert est.update(4, math.inf, 16, 1.0) is None and est.skipped == 1
    # A noisy measurement can make the |G|^2 estimate negative: no noise scale then.
    est.update(4, 5.0, 16, 1.0)
    assert est.grad_sq_norm is not None and est.grad_sq_norm < 0
    assert est.noise_scale is None


def test_estimator_state_round_trip():
    est = GradientNoiseEstimator(ema_beta=0.9)
    for i in range(5):
        est.update(4, 5.0 + i, 64, 1.5)
    twin = GradientNoiseEstimator(ema_beta=0.9)
    twin.load_state_dict(est.state_dict())
    assert twin.update(4, 6.0, 64, 1.4) == est.update(4, 6.0, 64, 1.4)
    other = GradientNoiseEstimator(ema_beta=0.5)
    other.load_state_dict(est.state_dict())
    assert other.noise_scale == pytest.approx(est.noise_scale)


@pytest.mark.parametrize("seed", [0, 1])
def test_estimator_on_linear_regression_matches_closed_form(seed):
    # Linear regression, x ~ N(0, I_n), label noise sigma, d = w - w*: the per-sample gradient is
    # (x.d - eps) x, so |G|^2 = |d|^2 and tr(Sigma) = (n + 1)|d|^2 + n sigma^2.
    gen = torch.Generator().manual_seed(seed)
    n, sigma, micro, micros, measurements = 8, 0.5, 4, 16, 1500
    d = torch.randn(n, generator=gen, dtype=torch.float64)
    d *= 1.5 / d.norm()
    true_g2 = float(d @ d)
    true_trace = (n + 1) * true_g2 + n * sigma**2
    big = micro * micros
    x = torch.randn(measurements, big, n, generator=gen, dtype=torch.float64)
    eps = sigma * torch.randn(measurements, big, generator=gen, dtype=torch.float64)
    grads = (x @ d - eps).unsqueeze(-1) * x  # per-sample gradients, [measurement, sample, n]
    small = grads.view(measurements, micros, micro, n).mean(2)  # one gradient per micro-batch
    sq_small = small.pow(2).sum(-1).mean(-1)  # mean over micro-batches (and ranks) of |g_small|^2
    sq_big = grads.mean(1).pow(2).sum(-1)  # |g_big|^2 of the step's full gradient

    est = GradientNoiseEstimator(ema_beta=0.99)
    for m in range(measurements):
        est.update(micro, sq_small[m], big, sq_big[m])
    truth = true_trace / true_g2
    assert est.grad_sq_norm == pytest.approx(true_g2, rel=0.2)
    assert est.trace_sigma == pytest.approx(true_trace, rel=0.2)
    assert abs(est.noise_scale - truth) / truth < 0.2, f"B_simple {est.noise_scale:.2f} vs truth {truth:.2f}"


def test_estimator_memory_counts_samples_not_measurements():
    # reference 16: a measurement of 64 samples decays the past as four of 16 samples do.
    by_samples = GradientNoiseEstimator(ema_beta=0.9, reference_batch=16)
    by_steps = GradientNoiseEstimator(ema_beta=0.9)
    for est in (by_samples, by_steps):
        est.update(4, 2.0 + 60.0 / 4, 16, 2.0 + 60.0 / 16)  # B_simple 30
        est.update(4, 1.0 + 60.0 / 4, 64, 1.0 + 60.0 / 64)  # B_simple 60
    # The 64-sample measurement weighs 1 - 0.9^4 = 0.344 against the first's 0.1 x 0.9^4 = 0.066.
    w_old, w_new = 0.1 * 0.9**4, 1 - 0.9**4
    g2 = (2.0 * w_old + 1.0 * w_new) / (w_old + w_new)
    assert by_samples.grad_sq_norm == pytest.approx(g2)
    assert by_steps.grad_sq_norm == pytest.approx((2.0 * 0.09 + 1.0 * 0.1) / 0.19)
    assert by_samples.effective_measurements == pytest.approx((w_old + w_new) ** 2 / (w_old**2 + w_new**2))


def test_estimator_relative_error_shrinks_with_evidence():
    rng = torch.Generator().manual_seed(0)
    est = GradientNoiseEstimator(ema_beta=0.99)
    assert est.relative_error == math.inf
    errors = []
    for _ in range(400):
        noise = float(torch.randn((), generator=rng)) * 0.3
        est.update(4, (1.0 + noise) + 60.0 / 4, 64, (1.0 + noise) + 60.0 / 64)
        errors.append(est.relative_error)
    assert errors[0] == math.inf, "one measurement has no spread to judge"
    assert errors[10] > errors[100] > errors[399] > 0, errors[::50]
    # Identical measurements: the estimate is exact.
    exact = GradientNoiseEstimator()
    for _ in range(3):
        exact.update(4, 2.0 + 60.0 / 4, 64, 2.0 + 60.0 / 64)
    assert exact.relative_error == pytest.approx(0.0, abs=1e-6)


def test_estimator_reads_version_1_state_with_an_unknown_error():
    v1 = {
        "kind": "GradientNoiseEstimator",
        "version": 1,
        "ema_beta": 0.9,
        "grad_sq_norm_raw": 0.1 * 2.0 * (1 + 0.9),  # two measurements of |G|^2 2 and tr 60
        "trace_sigma_raw": 0.1 * 60.0 * (1 + 0.9),
        "count": 2,
        "skipped": 1,
    }
    est = GradientNoiseEstimator(ema_beta=0.9)
    est.load_state_dict(v1)
    assert est.noise_scale == pytest.approx(30.0) and est.count == 2 and est.skipped == 1
    assert est.relative_error == math.inf, "version 1 kept no spread: the error is unknown"
    with pytest.raises(ValueError, match="version"):
        est.load_state_dict({**est.state_dict(), "version": 9})


# ---------------------------------------------------------------- loss_plateau


def test_plateau_acts_after_patience_then_cools_down():
    rule = plateau_rule(start=16, window=3, patience=2, cooldown=1, ema_beta=0.0)
    # window fills at the 3rd loss; plateau streak 1, 2 -> x2; one evaluation of cooldown; again.
    assert feed(rule, [1.0] * 8) == [16, 16, 16, 32, 32, 32, 64, 64]


def test_plateau_holds_on_a_decreasing_loss():
    rng = random.Random(0)
    losses = [4.0 * math.exp(-k / 40) + rng.uniform(-0.005, 0.005) for k in range(120)]
    assert set(feed(plateau_rule(start=16), losses)) == {16}


def test_plateau_smoothing_sees_through_noise():
    rng = random.Random(1)
    noisy_flat = [2.0 + rng.uniform(-0.08, 0.08) for _ in range(60)]
    smoothed = feed(plateau_rule(start=16, ema_beta=0.9), noisy_flat)
    raw = feed(plateau_rule(start=16, ema_beta=0.0), noisy_flat)
    assert smoothed[-1] > 16, "the EMA-smoothed loss is flat: the batch must grow"
    assert raw[-1] == 16, "raw noisy losses never look flat for `patience` evaluations"


def test_plateau_change_measures_differ_on_oscillation():
    # 1.0, 1.2, 1.0, ...: no net change, but a large step-to-step change.
    oscillating = [1.0 + 0.2 * (k % 2) for k in range(7)]
    net = plateau_rule(start=16, window=3, patience=1, cooldown=10, ema_beta=0.0, change="net")
    steps = plateau_rule(start=16, window=3, patience=1, cooldown=10, ema_beta=0.0, change="mean_abs_step")
    assert feed(net, oscillating)[-1] == 32
    assert feed(steps, oscillating)[-1] == 16


def test_plateau_relative_is_scale_free_and_absolute_is_not():
    base = [2.0, 1.99, 1.985, 1.983, 1.982, 1.9815]
    for scale, grows in ((1.0, True), (100.0, True)):
        rule = plateau_rule(start=16, window=3, patience=1, ema_beta=0.0, threshold=0.01)
        assert (feed(rule, [scale * v for v in base])[-1] > 16) is grows
    for scale, grows in ((1.0, True), (100.0, False)):
        rule = plateau_rule(start=16, window=3, patience=1, ema_beta=0.0, threshold=0.01, relative=False)
        assert (feed(rule, [scale * v for v in base])[-1] > 16) is grows


def test_plateau_shrink_floor_and_bounds():
    rule = plateau_rule(
        lo=8,
        hi=40,
        start=20,
        direction="shrink",
        floor_on_shrink=True,
        window=2,
        patience=1,
        cooldown=0,
        ema_beta=0.0,
    )
    assert feed(rule, [1.0, 1.0, 1.0, 1.0]) == [20, 10, 8, 8]
    grow = plateau_rule(lo=8, hi=40, start=20, window=2, patience=1, cooldown=0, ema_beta=0.0, factor=1.5)
    assert feed(grow, [1.0, 1.0, 1.0, 1.0]) == [20, 30, 40, 40]


def test_plateau_otherwise_factor_and_missing_losses():
    rule = plateau_rule(hi=30, start=20, window=3, otherwise_factor=1.25, ema_beta=0.0)
    assert feed(rule, [5.0, 4.0, None, math.nan, 3.0]) == [25, 30, 30, 30, 30]
    assert rule.ema_count == 3, "missing and non-finite losses must not enter the history"


def test_plateau_state_round_trip():
    rng = random.Random(2)
    losses = [1.0 + rng.uniform(-0.002, 0.002) for _ in range(30)]

    def make():
        return plateau_rule(hi=4096, start=16, window=4, patience=2, cooldown=3)

    straight = feed(make(), losses)
    first = make()
    head = feed(first, losses[:13])
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + feed(resumed, losses[13:], step0=14) == straight
    assert max(straight) > 16


class SeedOracle:
    """The seed's AdaptiveBatchSize rule, restated: window of 5 raw losses, mean |change| < 0.01 ->
    halve (floored, at least min); otherwise x1.1 while below max. Called once per epoch."""

    def __init__(self, initial=32, max_bs=1024, min_bs=8):
        self.bs, self.max_bs, self.min_bs, self.seen = initial, max_bs, min_bs, []

    def adjust(self, loss):
        self.seen.append(loss)
        stable = False
        if len(self.seen) >= 5:
            last = self.seen[-5:]
            changes = [abs(last[i] - last[i - 1]) for i in range(1, 5)]
            stable = sum(changes) / len(changes) < 0.01
        if stable:
            self.bs = max(self.min_bs, self.bs // 2)
        elif self.bs < self.max_bs:
            self.bs = min(self.max_bs, self.bs * 1.1)
        return self.bs


SEED_PARAMETERS = {
    "type": "loss_plateau",
    "start": 32,
    "direction": "shrink",
    "factor": 2.0,
    "floor_on_shrink": True,
    "ema_beta": 0.0,
    "window": 5,
    "change": "mean_abs_step",
    "relative": False,
    "threshold": 0.01,
    "patience": 1,
    "cooldown": 0,
    "otherwise_factor": 1.1,
}

_loss_walks = st.lists(
    st.one_of(st.floats(-0.004, 0.004), st.floats(-0.3, 0.3)), min_size=1, max_size=90
).map(lambda deltas: [2.0 + sum(deltas[: i + 1]) for i in range(len(deltas))])


@given(losses=_loss_walks)
def test_seed_parameters_reproduce_the_seed_rule(losses):
    oracle = SeedOracle()
    cfg = AdaBatchConfig.model_validate(
        {
            "schedule": SEED_PARAMETERS,
            "max_micro_batch_per_gpu": 64,
            "min_global_batch": 8,
            "max_global_batch": 1024,
        }
    )
    controller = BatchSizeController(cfg, 1)
    rule = controller.schedule
    batch = controller.initial_global_batch()
    for epoch, loss in enumerate(losses, start=1):
        expected = oracle.adjust(loss)
        decision = controller.next_global_batch(
            ScheduleContext(step=epoch, samples=0, global_batch=batch, world_size=1, loss=loss)
        )
        batch = decision.global_batch
        assert rule.current == expected, f"epoch {epoch}: rule at {rule.current}, seed at {expected}"
        assert batch == math.floor(expected + 0.5), f"epoch {epoch}: planned {batch} for seed {expected}"


def test_seed_parameters_on_a_converging_run():
    # Falls fast (grow x1.1 each epoch), then flattens (halve while flat, floored).
    losses = [3.0 - 0.3 * k for k in range(6)] + [1.2 + 0.001 * (-1) ** k for k in range(8)]
    oracle = SeedOracle()
    rule = plateau_rule(lo=8, hi=1024, **{k: v for k, v in SEED_PARAMETERS.items() if k != "type"})
    assert feed(rule, losses) == [oracle.adjust(x) for x in losses]
    assert rule.current == 8


# ---------------------------------------------------------------- gradient_noise


def noise_rule(**fields):
    # scale 1.0, two-way moves and no change cap pinned: these tests are about warm-up, hysteresis and
    # state, not the default scale, grow-only policy or change cap (which have their own tests below).
    fields = {"scale": 1.0, "grow_only": False, "max_change_factor": None, **fields}
    cfg = SCHEDULES.validate_python({"type": "gradient_noise", "start": 100, **fields})
    return build_schedule(cfg, world_size=1)


def at(rule, step, noise, batch=100):
    return rule(ScheduleContext(step=step, samples=0, global_batch=batch, world_size=1, noise_scale=noise))


def test_gradient_noise_waits_for_warmup_and_an_estimate():
    rule = noise_rule(warmup_steps=50)
    assert rule.requires == {"noise_scale"}
    assert at(rule, 49, 400.0) == 100
    assert at(rule, 50, None) == 100
    assert at(rule, 50, math.nan) == 100
    assert at(rule, 50, 400.0) == 400


def test_gradient_noise_hysteresis_and_scale():
    rule = noise_rule(warmup_steps=0, hysteresis=0.2)
    # band for a batch of 100: [83.3, 120]
    assert [at(rule, 1, b) for b in (115.0, 119.9, 85.0)] == [100, 100, 100]
    assert at(rule, 1, 125.0) == 125
    assert at(rule, 1, 80.0) == 80
    half = noise_rule(warmup_steps=0, scale=0.5)
    assert at(half, 1, 400.0) == 200
    assert at(half, 1, 230.0) == 100, "0.5 x 230 = 115 is inside the band"


def test_gradient_noise_through_the_controller():
    cfg = AdaBatchConfig.model_validate(
        {
            "schedule": {
                "type": "gradient_noise",
                "start": 64,
                "scale": 1.0,
                "warmup_steps": 3,
                "measure_every": 2,
            },
            "max_micro_batch_per_gpu": 16,
            "max_global_batch": 1024,
            "granularity": 32,
            "max_change_factor": 2.0,
        }
    )
    controller = BatchSizeController(cfg, 4)
    assert controller.schedule.measure_every == 2 and controller.schedule.ema_beta == 0.95
    batches, batch = [], controller.initial_global_batch()
    for step in range(8):
        decision = controller.next_global_batch(
            ScheduleContext(step=step, samples=0, global_batch=batch, world_size=4, noise_scale=900.0)
        )
        batch = decision.global_batch
        batches.append(batch)
    # warm-up for steps 0-2, then doubling per step (capped) up to 900 -> nearest multiple of 32.
    assert batches == [64, 64, 64, 128, 256, 512, 896, 896]


def test_gradient_noise_state_round_trip():
    rule = noise_rule(warmup_steps=0)
    at(rule, 1, 300.0)
    twin = noise_rule(warmup_steps=0)
    twin.load_state_dict(rule.state_dict())
    expected = {
        "kind": "GradientNoiseSchedule",
        "version": 2,
        "last_target": 300.0,
        "last_direction": 1,
        "moves": 1,
    }
    assert twin.state_dict() == rule.state_dict() == expected


def test_gradient_noise_reads_version_1_state_without_a_direction():
    rule = noise_rule(warmup_steps=0)
    rule.load_state_dict({"kind": "GradientNoiseSchedule", "version": 1, "last_target": 20.5, "moves": 3})
    assert (rule.last_target, rule.last_direction, rule.moves) == (20.5, 0, 3)
    with pytest.raises(ValueError, match="last_direction"):
        rule.load_state_dict({**rule.state_dict(), "last_direction": 2})


def test_gradient_noise_default_scale_follows_the_measured_geometry():
    def rule(**fields):
        cfg = SCHEDULES.validate_python({"type": "gradient_noise", "start": 8, **fields})
        return build_schedule(cfg, world_size=1)

    assert (rule(geometry="sgd").scale, rule(geometry="adam").scale) == (0.5, 0.2)
    auto = rule()
    assert auto.geometry is None and auto.scale == 0.2, "unresolved auto: the adam default"
    auto.use_geometry("sgd")
    assert (auto.geometry, auto.scale) == ("sgd", 0.5), "auto resolved to sgd: the sgd default"
    given = rule(scale=0.7)
    given.use_geometry("sgd")
    assert given.scale == 0.7, "a configured scale is kept whatever the geometry"


def test_gradient_noise_defaults_grow_only():
    cfg = {"type": "gradient_noise", "start": 8, "geometry": "sgd"}
    rule = build_schedule(SCHEDULES.validate_python(cfg), world_size=1)
    assert rule.grow_only is True
    rule.warmup_steps = 0
    # 0.5 x 30 = 15 is above 8 x 1.2 = 9.6, so it grows; a later fall never shrinks it.
    assert at(rule, 1, 30.0, batch=8) == 15.0
    assert at(rule, 2, 10.0, batch=16) == 16
    assert at(rule, 3, 36.0, batch=16) == 16, "0.5 x 36 = 18 is inside 16's band upwards"
    assert at(rule, 4, 40.0, batch=16) == 20.0


def test_gradient_noise_grow_only_holds_every_fall():
    rule = noise_rule(warmup_steps=0, grow_only=True)
    assert [at(rule, s, b) for s, b in enumerate((50.0, 10.0, 82.0, 119.0), 1)] == [100] * 4
    assert at(rule, 5, 121.0) == 121.0
    assert rule.moves == 1 and rule.last_direction == 1


def test_gradient_noise_holds_until_the_estimate_is_confident():
    rule = noise_rule(warmup_steps=0, max_relative_error=0.35)

    def with_error(error):
        ctx = ScheduleContext(
            step=1, samples=0, global_batch=100, world_size=1, noise_scale=400.0, noise_scale_error=error
        )
        return rule(ctx)

    assert with_error(math.inf) == 100
    assert with_error(0.36) == 100
    assert "not yet confident" in rule.last_reason
    assert with_error(0.35) == 400.0
    assert with_error(None) == 400.0, "a caller that does not measure the error is not held"


def test_gradient_noise_default_change_cap_doubles_at_most():
    rule = build_schedule(SCHEDULES.validate_python({"type": "gradient_noise", "start": 8}), world_size=1)
    assert rule.max_change_factor == 2.0 and rule.max_relative_error == 0.35
    rule.warmup_steps = 0
    assert at(rule, 1, 1000.0, batch=8) == 16.0
    assert "capped" in rule.last_reason
    assert rule.last_target == 200.0, "the reversal test remembers the uncapped target (0.2 x 1000)"
    assert at(rule, 2, 1000.0, batch=16) == 32.0
    cfg = SCHEDULES.validate_python({"type": "gradient_noise", "start": 8})
    assert cfg.estimator_settings() == {"ema_beta": 0.95, "reference_batch": 8.0, "trend": False}
    tiny = SCHEDULES.validate_python({"type": "gradient_noise", "start": 2})
    assert tiny.estimator_settings()["reference_batch"] == 8.0
    big = SCHEDULES.validate_python({"type": "gradient_noise", "start": 256})
    assert big.estimator_settings()["reference_batch"] == 256.0


def through_granularity(rule, estimates, start=16, granularity=8):
    """The batches a rule plans for a sequence of estimates, rounded as the controller rounds."""
    batch, batches = start, []
    for step, estimate in enumerate(estimates, 1):
        wanted = at(rule, step, estimate, batch=batch)
        batch = max(granularity, math.floor(wanted / granularity + 0.5) * granularity)
        batches.append(batch)
    return batches


def test_gradient_noise_cannot_flip_between_rounding_neighbours():
    # A target jittering +-3% around 20, the midpoint of 16 and 24 with granularity 8: both 16 -> 24
    # (+50%) and 24 -> 16 leave the 20% band around the current batch, yet neither is a real move.
    jitter = [20.6, 19.4] * 20
    two_way = noise_rule(warmup_steps=0, hysteresis=0.2)
    batches = through_granularity(two_way, jitter)
    assert batches == [24] * len(jitter), "the first move sticks; reversals stay within 20% of 20.6"
    assert two_way.moves == 1
    # A real fall of the estimate (beyond the band of the target that set the batch) still shrinks it.
    assert through_granularity(two_way, [16.0], start=24) == [16]
    assert two_way.last_direction == -1


def test_gradient_noise_reversal_test_does_not_block_capped_moves():
    # max_change_factor can leave the batch far below the last target; moving on in the same direction
    # is not a reversal, so the band around the last target must not hold it.
    rule = noise_rule(warmup_steps=0)
    assert at(rule, 1, 900.0, batch=100) == 900.0
    assert at(rule, 2, 900.0, batch=200) == 900.0
    # And a reversal beyond the band is a move.
    assert at(rule, 3, 500.0, batch=900) == 500.0


def test_noise_cadence_measures_every_n_steps_and_warns_once_when_it_cannot(caplog):
    import logging

    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.runtime.noise.probe import NoiseCadence

    def schedule(spec):
        return AdaBatchConfig.model_validate({"schedule": spec, "max_micro_batch_per_gpu": 4}).schedule

    cadence = NoiseCadence(schedule({"type": "gradient_noise", "start": 8, "measure_every": 2}))
    assert [cadence.due(step, 2, 1) for step in range(5)] == [True, False, True, False, True]
    assert [cadence.due(step, 1, 3) for step in range(4)] == [True, False, True, False]
    lib = logging.getLogger("ds_adabatch")
    attach = not lib.propagate  # initialize() may have stopped propagation to the root's handler
    if attach:
        lib.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="ds_adabatch"):
            assert not cadence.due(6, 1, 1) and not cadence.due(8, 1, 1)
    finally:
        if attach:
            lib.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if "cannot be measured" in r.getMessage()]
    assert len(warnings) == 1 and "max_micro_batch_per_gpu" in warnings[0], warnings
    assert "the batch holds until a step of two or more passes" in warnings[0], warnings
    assert cadence.due(10, 1, 2), "measuring resumes once a step has two micro-batches"
    constant = NoiseCadence(schedule({"type": "constant", "value": 8}))
    assert not any(constant.due(step, 2, 2) for step in range(4))

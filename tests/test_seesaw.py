"""The seesaw schedule against the paper's rule, its base-LR curves, its config checks and its state.

Seesaw (arXiv 2510.14717): where the base schedule would multiply the LR by a < 1, multiply the batch by
1 / a and the LR by sqrt(a). Everything here is pure (one process, no DeepSpeed engine); the 2-rank run
where DeepSpeed applies the LR is in test_engine.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ds_adabatch.config import ConfigError, load_ds_config
from ds_adabatch.schedules import (
    BatchSizeController,
    DeepSpeedSchedulerCurve,
    ScheduleContext,
    ScheduleError,
    base_lr_from_ds_config,
    seesaw_batch,
    simulate,
)

PEAK = 1e-3


class StepDecay:
    """A step schedule: the LR halves every 1,000 samples (1e-3, 5e-4, 2.5e-4, ...)."""

    def base_lr(self, samples: int) -> float:
        return PEAK * 0.5 ** (samples // 1000)


def _config(schedule: dict, *, scheduler: dict | None = None, **adabatch) -> dict:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": PEAK}},
        "adabatch": {
            "schedule": schedule,
            "max_global_batch": 512,
            "max_micro_batch_per_gpu": 4,
            "lr_scaling": {"rule": "sqrt"},
            "lr_schedule_unit": "samples",
            **adabatch,
        },
    }
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return cfg


def _controller(schedule: dict, source, **adabatch) -> BatchSizeController:
    loaded = load_ds_config(_config(schedule, **adabatch))
    controller = BatchSizeController(loaded.adabatch, world_size=1)
    controller.schedule.bind_base_lr(source)
    return controller


def _run(controller: BatchSizeController, source, samples: int, *, start_step: int = 0, start=(0, None)):
    """(samples, batch, applied LR) per step, the LR by the runtime's sqrt coupling to the start batch."""
    consumed, batch = start
    batch = batch or controller.initial_global_batch()
    rows = []
    step = start_step
    while consumed < samples:
        ctx = ScheduleContext(step=step, samples=consumed, global_batch=batch, world_size=1)
        batch = controller.next_global_batch(ctx).global_batch
        rows.append((consumed, batch, source.base_lr(consumed) * math.sqrt(batch / 8)))
        consumed += batch
        step += 1
    return rows


def test_step_schedule_follows_the_paper_rule():
    # Each halving of the base LR becomes x2 batch and a 1/sqrt(2) LR cut, discrete or continuous.
    source = StepDecay()
    for discrete in (True, False):
        rows = _run(_controller({"type": "seesaw", "start": 8, "discrete": discrete}, source), source, 5000)
        for samples, batch, lr in rows:
            halvings = samples // 1000
            assert batch == 8 * 2**halvings, (discrete, samples, batch)
            assert lr == pytest.approx(PEAK / math.sqrt(2) ** halvings, rel=1e-12)
        # The paper's statement between phases: batch x2, LR x 1/sqrt(2).
        phases = sorted({(b, lr) for _, b, lr in rows})
        for (b0, lr0), (b1, lr1) in zip(phases, phases[1:]):
            assert b1 == 2 * b0 and lr1 == pytest.approx(lr0 / math.sqrt(2), rel=1e-12)


COSINE = {
    "type": "WarmupCosineLR",
    "params": {"total_num_steps": 500, "warmup_num_steps": 50, "warmup_type": "linear", "cos_min_ratio": 0.1},
}


@pytest.mark.parametrize("discrete", [False, True])
def test_cosine_schedule_follows_the_paper_rule(discrete):
    curve = DeepSpeedSchedulerCurve(COSINE, optimizer_lr=PEAK, reference_batch=8)
    controller = _controller({"type": "seesaw", "start": 8, "discrete": discrete}, curve, granularity=8)
    rows = _run(controller, curve, 4000)
    peak = 0.0
    for samples, batch, lr in rows[1:]:  # step 0 runs the initial batch without asking the rule
        base = curve.base_lr(samples)
        peak = max(peak, base)
        alpha = 1.0 if base >= peak else peak / base
        want = 8 * alpha if not discrete else 8 * 2 ** math.floor(math.log2(alpha) + 1e-9)
        # Rounded to granularity 8 (nearest plannable): the LR follows the batch actually planned.
        assert abs(batch - min(want, 512)) <= 4, (samples, batch, want)
        assert lr == pytest.approx(base * math.sqrt(batch / 8), rel=1e-12)
        if not discrete and batch == want:
            assert lr == pytest.approx(peak / math.sqrt(alpha), rel=1e-12), "peak / sqrt(alpha)"
    batches = [b for _, b, _ in rows]
    assert batches == sorted(batches), "a cosine decay only grows the batch"
    assert batches[-1] == 80 if not discrete else batches[-1] == 64, batches[-1]
    if discrete:
        assert set(batches) <= {8, 16, 32, 64}, "the discrete form moves in whole doublings"


def test_max_global_batch_falls_back_to_plain_lr_decay():
    source = StepDecay()
    controller = _controller({"type": "seesaw", "start": 8}, source, max_global_batch=32)
    rows = _run(controller, source, 8000)
    capped = [(s, lr) for s, b, lr in rows if b == 32 and s >= 2000]
    assert capped[-1][0] >= 5000, "the batch stays at max_global_batch"
    for s, lr in capped:
        # Multiplier fixed at sqrt(32 / 8) = 2: the LR is the base schedule's, decaying.
        assert lr == pytest.approx(2 * source.base_lr(s), rel=1e-12)
    assert capped[-1][1] < capped[0][1] / 4


def test_seesaw_batch_rounding_of_the_decay():
    assert seesaw_batch(8, 0.5, discrete=True) == 8  # warmup: alpha < 1 counts as 1
    assert seesaw_batch(8, 2.0, discrete=True) == 16
    assert seesaw_batch(8, 3.99, discrete=True) == 16
    assert seesaw_batch(8, 3.0, discrete=True, factor=3.0) == 24
    assert seesaw_batch(8, 3.0, discrete=False) == 24


def test_resume_continues_the_same_sequence():
    curve = DeepSpeedSchedulerCurve(COSINE, optimizer_lr=PEAK, reference_batch=8)
    schedule = {"type": "seesaw", "start": 8}
    full = _run(_controller(schedule, curve, granularity=8), curve, 4000)
    first = _controller(schedule, curve, granularity=8)
    head = _run(first, curve, 2400)
    state = copy.deepcopy(first.state_dict())
    assert state["schedule"]["kind"] == "SeesawSchedule" and state["schedule"]["peak"] > 0
    second = _controller(schedule, curve, granularity=8)
    second.load_state_dict(state)
    consumed = head[-1][0] + head[-1][1]
    tail = _run(second, curve, 4000, start_step=len(head), start=(consumed, head[-1][1]))
    assert head + tail == full


def test_unbound_schedule_says_what_to_do():
    loaded = load_ds_config(_config({"type": "seesaw", "start": 8}))
    controller = BatchSizeController(loaded.adabatch, world_size=1)
    ctx = ScheduleContext(step=1, samples=8, global_batch=8, world_size=1)
    with pytest.raises(ScheduleError, match="bind_base_lr"):
        controller.next_global_batch(ctx)


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"lr_schedule_unit": "steps"}, "adabatch.lr_schedule_unit"),
        ({"lr_scaling": {"rule": "none"}}, "adabatch.lr_scaling.rule"),
        ({"lr_scaling": {"rule": "sqrt", "reference_batch": 16}}, "adabatch.lr_scaling.reference_batch"),
    ],
)
def test_config_needs_a_samples_keyed_sqrt_coupled_lr(change, path):
    with pytest.raises(ConfigError) as err:
        load_ds_config(_config({"type": "seesaw", "start": 8}, **change))
    assert path in str(err.value)


@pytest.mark.parametrize(
    "section",
    [
        COSINE,
        {"type": "WarmupLR", "params": {"warmup_max_lr": PEAK, "warmup_num_steps": 30, "warmup_type": "log"}},
        {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": PEAK, "warmup_num_steps": 30, "total_num_steps": 300},
        },
    ],
)
def test_curve_matches_deepspeed_scheduler_in_samples(section):
    # The closed form equals DeepSpeed's own scheduler stepped by the runtime's samples-mode wrapper.
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

    from ds_adabatch.runtime.core.lr import BatchCoupledLR, CurrentBaseLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    scheduler = cls[section["type"]](opt, **section["params"])
    coupled = BatchCoupledLR(opt, scheduler, unit="samples", reference_batch=8, rule="sqrt")
    real = CurrentBaseLR(coupled)
    curve = base_lr_from_ds_config({"optimizer": {"params": {"lr": PEAK}}, "scheduler": section}, 8)
    samples, batch = 0, 8
    while samples < 3000:
        coupled.set_global_batch(batch)
        assert real.base_lr(samples) == pytest.approx(curve.base_lr(samples), rel=1e-12, abs=1e-18)
        assert opt.param_groups[0]["lr"] == pytest.approx(curve.base_lr(samples) * math.sqrt(batch / 8))
        coupled.set_samples(samples + batch)
        coupled.step()
        samples += batch
        batch = 8 + 8 * (samples // 500)  # any batch sequence: the curve is keyed on samples only
    with pytest.raises(ValueError, match="only the current base LR"):
        real.base_lr(samples + 8)


def test_simulate_plots_batch_and_applied_lr(tmp_path):
    loaded = load_ds_config(_config({"type": "seesaw", "start": 8}, scheduler=COSINE, granularity=8))
    rows = simulate(loaded, world_size=2, samples=4000, out_png=tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert rows[-1]["global_batch"] == 80
    curve = DeepSpeedSchedulerCurve(COSINE, optimizer_lr=PEAK, reference_batch=8)
    for r in rows:
        assert r["lr"] == pytest.approx(curve.base_lr(r["samples"]) * math.sqrt(r["global_batch"] / 8))
    # Without a scheduler section the base LR is the optimizer's constant LR: nothing decays.
    flat = simulate(
        load_ds_config(_config({"type": "seesaw", "start": 8})), world_size=1, samples=400, out_png=None
    )
    assert {r["global_batch"] for r in flat} == {8}
    bad = _config({"type": "seesaw", "start": 8}, scheduler={"type": "OneCycle", "params": {}})
    with pytest.raises(ValueError, match="OneCycle"):
        simulate(load_ds_config(bad), world_size=1, samples=400, out_png=None)

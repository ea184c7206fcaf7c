"""``BatchCoupledLR.set_multiplier``: a caller's own LR multiplier, held through scheduler steps and
checkpoints until the next plan change applies the rule's again."""

from __future__ import annotations

import math

import pytest
import torch

from ds_adabatch.runtime.core.lr import BatchCoupledLR


def _coupled():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return opt, BatchCoupledLR(opt, scheduler, unit="steps", reference_batch=8, rule="sqrt")


def test_a_callers_multiplier_is_applied_and_survives_scheduler_steps_and_a_checkpoint():
    opt, coupled = _coupled()
    assert coupled.set_global_batch(32) == pytest.approx(2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert coupled.set_multiplier(1.25) == 1.25
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)
    coupled.step()  # the scheduler sees the unscaled LR (0.1 -> 0.05); the multiplier is applied again
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 1.25)
    state = coupled.state_dict()
    assert state["multiplier"] == 1.25

    opt2, restored = _coupled()
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # what an optimizer checkpoint restores
    restored.load_state_dict(state)
    restored.set_global_batch(8)  # a plan change applies the rule's multiplier again (sqrt(8/8) = 1)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "2"])
def test_a_multiplier_that_is_not_a_positive_finite_number_is_refused(bad):
    opt, coupled = _coupled()
    with pytest.raises(ValueError, match="finite number > 0"):
        coupled.set_multiplier(bad)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and coupled.multiplier == 1.0


# -- lr_scaling.rule "adascale": AdaScale's gain at the measured noise scale -------------------------


def _gain(batch, reference, noise):
    return batch / reference * (noise + reference) / (noise + batch)


@pytest.mark.parametrize("power", [0.5, 1.0])
def test_adascale_follows_the_noise_scale_between_one_and_the_linear_rule(power):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    coupled = BatchCoupledLR(opt, None, unit="steps", reference_batch=8, rule="adascale", gain_power=power)
    assert coupled.follows_noise
    # No estimate yet: the reference batch's LR at any batch.
    assert coupled.set_global_batch(64) == 1.0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    coupled.observe_noise(24.0)
    want = _gain(64, 8, 24.0) ** power
    assert coupled.set_global_batch(64) == pytest.approx(want)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * want)
    # A noiseless gradient: a larger batch takes the same step; all noise: the linear rule (^ power).
    coupled.observe_noise(0.0)
    assert coupled.set_global_batch(64) == pytest.approx(1.0)
    coupled.observe_noise(1e12)
    assert coupled.set_global_batch(64) == pytest.approx(8.0**power, rel=1e-6)
    # The reference batch itself keeps its LR whatever the noise.
    coupled.observe_noise(3.0)
    assert coupled.set_global_batch(8) == pytest.approx(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_adascale_multiplier_of_the_shared_rule_function():
    from ds_adabatch.schedules.lr import adascale_gain, lr_multiplier

    assert adascale_gain(32, 8, None) == 1.0
    assert adascale_gain(32, 8, math.nan) == 1.0
    assert lr_multiplier("adascale", 32, 8, noise_scale=16.0) == pytest.approx(_gain(32, 8, 16.0) ** 0.5)
    assert lr_multiplier("adascale", 32, 8, noise_scale=16.0, gain_power=1.0) == pytest.approx(
        _gain(32, 8, 16.0)
    )
    assert not BatchCoupledLR(None, None, unit="steps", reference_batch=8, rule="sqrt").follows_noise
    with pytest.raises(ValueError, match="gain_power"):
        lr_multiplier("adascale", 32, 8, noise_scale=16.0, gain_power=0.0)


@pytest.mark.parametrize(("power", "exponent"), [(0.5, 0.5), (1.0, 1.0)])
def test_goodputs_auto_efficiency_pairs_adascale_with_the_rule_its_gain_meets(power, exponent):
    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.schedules import BatchSizeController

    section = AdaBatchConfig.model_validate(
        {
            "schedule": {"type": "goodput", "start": 8},
            "max_micro_batch_per_gpu": 8,
            "max_global_batch": 64,
            "lr_scaling": {"rule": "adascale", "gain_power": power},
        }
    )
    controller = BatchSizeController(section, world_size=1)
    assert controller.schedule.efficiency_exponent == exponent


def test_simulate_applies_adascale_at_the_fixed_noise_scale():
    from types import SimpleNamespace

    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.schedules import simulate

    section = AdaBatchConfig.model_validate(
        {
            "schedule": {
                "type": "gradient_noise",
                "start": 8,
                "scale": 1.0,
                "warmup_steps": 2,
                "max_change_factor": None,
            },
            "max_micro_batch_per_gpu": 8,
            "max_global_batch": 64,
            "lr_scaling": {"rule": "adascale"},
        }
    )
    rows = simulate(
        SimpleNamespace(adabatch=section), world_size=1, samples=400, out_png=None, noise_scale=40.0
    )
    assert any(r["global_batch"] != 8 for r in rows), [r["global_batch"] for r in rows]
    for r in rows:
        assert r["lr_multiplier"] == pytest.approx(_gain(r["global_batch"], 8, 40.0) ** 0.5)

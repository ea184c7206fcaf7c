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

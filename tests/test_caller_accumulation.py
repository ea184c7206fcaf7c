"""DeepSpeed's caller-owned accumulation (``"managed_gradient_accumulation": false``): what is refused.

What it trains is checked on real ranks with the other exactness cases: ``tests/test_engine.py``
(``caller_z0`` .. ``caller_z3``: exact against the big-batch reference and equal to the boundary set by
hand) and ``tests/test_oom.py`` (``z0_caller``, ``z1_caller``, ``z3_caller``: out-of-memory recovery).
Here, in one process: the combinations DeepSpeed 0.19.8 asserts against inside its engine are refused
by ``initialize`` with the key to change, before any process group starts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ds_adabatch
from ds_adabatch.config import ConfigError
from ds_adabatch.config.parallel import caller_accumulation_problems

ADABATCH = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}


def _config(**top) -> dict:
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "managed_gradient_accumulation": False,
        "adabatch": ADABATCH,
        **top,
    }


def _paths(ds: dict, **kw) -> list[str]:
    return [p.path for p in caller_accumulation_problems(ds, **kw)]


def test_accepted_combinations():
    assert _paths({}) == [] and _paths({"managed_gradient_accumulation": True}) == []
    for stage in (0, 1, 2, 3):
        assert _paths({"managed_gradient_accumulation": False, "zero_optimization": {"stage": stage}}) == []
    # DeepSpeed 0.19.8 overlaps communication under caller-owned accumulation from stage 2 on.
    for stage in (2, 3):
        zero = {"stage": stage, "overlap_comm": True}
        assert _paths({"managed_gradient_accumulation": False, "zero_optimization": zero}) == []
    # Managed accumulation (the default) is not restricted by any of this.
    zero = {"stage": 1, "overlap_comm": True}
    assert _paths({"zero_optimization": zero, "compile": {"deepcompile": True}}, pipelined=True) == []


def test_refused_combinations_name_the_key():
    off = {"managed_gradient_accumulation": False}
    for stage in (0, 1):
        assert _paths({**off, "zero_optimization": {"stage": stage, "overlap_comm": True}}) == [
            "zero_optimization.overlap_comm"
        ]
    assert _paths({**off, "compile": {"deepcompile": True}}) == ["compile.deepcompile"]
    assert _paths(off, pipelined=True) == ["managed_gradient_accumulation"]
    assert _paths({"managed_gradient_accumulation": "no"}) == ["managed_gradient_accumulation"]


def test_the_noise_scale_is_refused_at_zero_0_only():
    # Measured on 2 ranks: at ZeRO 0 the estimate read after the last backward was 12.8 against 16.8 with
    # the boundary set by hand (truth 17), the local gradients being unreduced there; ZeRO 2 and 3 agreed.
    off = {"managed_gradient_accumulation": False}
    for kind in ("gradient_noise", "goodput"):
        schedule = SimpleNamespace(type=kind)
        problems = caller_accumulation_problems(off, schedule=schedule)
        assert [p.path for p in problems] == ["managed_gradient_accumulation"]
        assert kind in problems[0].message and "ZeRO stage 1 or more" in problems[0].message
        for stage in (1, 2, 3):
            assert _paths({**off, "zero_optimization": {"stage": stage}}, schedule=schedule) == []
    assert _paths(off, schedule=SimpleNamespace(type="linear")) == []


def test_initialize_refuses_before_any_process_group():
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    cfg = _config(zero_optimization={"stage": 1, "overlap_comm": True})
    with pytest.raises(ConfigError) as info:
        ds_adabatch.initialize(model, cfg, data, loss_fn=lambda engine, batch: engine(batch[0]).mean())
    message = str(info.value)
    assert "zero_optimization.overlap_comm" in message and "set overlap_comm to false" in message, message
    assert [p.path for p in info.value.problems] == ["zero_optimization.overlap_comm"]
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized()), (
        "the refusal must come before any process group starts"
    )

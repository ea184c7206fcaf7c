"""``ds_adabatch.initialize`` in one process: errors before any process group, and a plain `python` run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ds_adabatch

GOOD = {
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "adabatch": {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2},
}


def _no_group() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_bad_config_fails_before_any_process_group():
    bad = {**GOOD, "adabatch": {"schedule": {"type": "linear", "start": 8}, "max_micro_batch_per_gpu": 0}}
    with pytest.raises(ds_adabatch.ConfigError) as err:
        ds_adabatch.initialize(torch.nn.Linear(2, 1), bad)
    msg = str(err.value)
    assert "adabatch.schedule.end" in msg and "adabatch.max_micro_batch_per_gpu" in msg, msg
    assert _no_group(), "a config error must be raised before a process group is created"


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com"),
        ({"bf16": {"enabled": True, "loss_scale": 1}}, "bf16.loss_scale"),
    ],
)
def test_bad_deepspeed_section_fails_before_any_process_group(section, path):
    with pytest.raises(ds_adabatch.ConfigError) as err:
        ds_adabatch.initialize(torch.nn.Linear(2, 1), {**GOOD, **section})
    assert path in str(err.value), str(err.value)
    assert _no_group(), "DeepSpeed's own sections must be checked before a process group is created"


@pytest.mark.parametrize(
    ("adabatch", "path"),
    [
        (
            {"schedule": {"type": "linear", "start": 8, "end": 128, "ramp_samples": 64}},
            "adabatch.schedule.end",
        ),
        (
            {"schedule": {"type": "gradient_noise", "start": 8}, "max_global_batch": 100},
            "adabatch.max_global_batch",
        ),
    ],
)
def test_drop_last_with_a_batch_beyond_the_dataset_fails_before_any_process_group(adabatch, path):
    config = {**GOOD, "adabatch": {**adabatch, "max_micro_batch_per_gpu": 4, "data": {"drop_last": True}}}
    data = [(torch.zeros(2), torch.zeros(1))] * 64
    with pytest.raises(ds_adabatch.ConfigError) as err:
        ds_adabatch.initialize(torch.nn.Linear(2, 1), config, data)
    assert path in str(err.value) and "64 samples" in str(err.value), str(err.value)
    assert _no_group()
    # DeepSpeed's own dataloader_drop_last sets it where the section does not, and is named.
    config = {**GOOD, "dataloader_drop_last": True, "adabatch": {**adabatch, "max_micro_batch_per_gpu": 4}}
    with pytest.raises(ds_adabatch.ConfigError) as err:
        ds_adabatch.initialize(torch.nn.Linear(2, 1), config, data)
    assert "with dataloader_drop_last true" in str(err.value), str(err.value)
    assert _no_group()


def test_drop_last_accepts_what_never_asks_for_more_than_the_dataset():
    from ds_adabatch.config import load_ds_config
    from ds_adabatch.data.loader_setup import drop_last_problems

    def problems(section: dict) -> list:
        cfg = load_ds_config({"adabatch": {"max_micro_batch_per_gpu": 4, **section}}).adabatch
        return drop_last_problems(cfg, 100, drop_last=True)

    # A fixed schedule within the dataset: a larger max_global_batch is never reached.
    assert problems({"schedule": {"type": "constant", "value": 8}, "max_global_batch": 1024}) == []
    # Token budgets: a step takes what the epoch holds.
    assert problems({"schedule": {"type": "constant", "value": 200}, "micro_batch_tokens": 40}) == []
    # An adaptive rule: its max_global_batch is what it may reach.
    noisy = problems({"schedule": {"type": "gradient_noise", "start": 8}, "max_global_batch": 128})
    assert [p.path for p in noisy] == ["adabatch.max_global_batch"]


def test_deepspeed_sections_are_checked_without_judging_the_batch_keys_for_one_rank():
    from ds_adabatch.config import load_ds_config
    from ds_adabatch.runtime.initialize.sections import check_deepspeed_sections

    # DeepSpeed's own 2-rank keys (8 = micro 4 x gas 1 x 2 ranks): right for the world they are run on,
    # which is checked once it is known; the early check of the other sections must not refuse them.
    two_ranks = {
        **GOOD,
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
    }
    two_ranks["adabatch"] = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    check_deepspeed_sections(load_ds_config(two_ranks))
    assert load_ds_config(two_ranks, world_size=2).plan.gradient_accumulation_steps == 1
    with pytest.raises(ds_adabatch.ConfigError, match="zero_optimization.stage"):
        check_deepspeed_sections(load_ds_config({**two_ranks, "zero_optimization": {"stage": 5}}))


@pytest.mark.parametrize("client", [False, True])
def test_zero_with_an_untested_optimizer_fails_before_any_process_group(client):
    model = torch.nn.Linear(2, 1)
    config = {**GOOD, "zero_optimization": {"stage": 2}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if client else None
    if client:
        del config["optimizer"]
    with pytest.raises(ds_adabatch.ConfigError, match="zero_allow_untested_optimizer"):
        ds_adabatch.initialize(model, config, optimizer=optimizer)
    assert _no_group()


def test_missing_adabatch_section_is_a_config_error():
    with pytest.raises(ds_adabatch.ConfigError, match="adabatch"):
        ds_adabatch.initialize(torch.nn.Linear(2, 1), {"optimizer": GOOD["optimizer"]})
    assert _no_group()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "not a model"}, "torch.nn.Module"),
        ({"training_data": 42}, "map-style dataset"),
        ({"training_data": []}, "empty"),
        ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    args = {"model": torch.nn.Linear(2, 1), "config": GOOD, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        ds_adabatch.initialize(args.pop("model"), args.pop("config"), args.pop("training_data", None), **args)
    assert _no_group()


SCRIPT = textwrap.dedent(
    """
    import torch, ds_adabatch
    data = torch.utils.data.TensorDataset(torch.randn(10, 2), torch.randn(10, 1))
    loss = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()
    config = {CONFIG}
    engine, *_ = ds_adabatch.initialize(torch.nn.Linear(2, 1), config, data, loss_fn=loss)
    for _ in range(4):
        engine.train_batch()
    print("steps", engine.global_steps, "samples", engine.global_samples, "world", engine.world_size)
    """
)


def _run_script(config: dict) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["DS_ACCELERATOR"] = "cpu"
    code = SCRIPT.replace("{CONFIG}", repr(config))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_plain_python_run_is_a_world_of_one_and_no_optimizer_is_a_clear_error():
    ok = _run_script(GOOD)
    assert ok.returncode == 0, ok.stderr[-3000:]
    # 4 + 4, the epoch tail of 2, then the first batch of epoch 1.
    assert "steps 4 samples 14 world 1" in ok.stdout, ok.stdout

    no_opt = _run_script({"adabatch": GOOD["adabatch"]})
    assert no_opt.returncode != 0
    assert "ConfigError" in no_opt.stderr and "optimizer" in no_opt.stderr, no_opt.stderr[-2000:]

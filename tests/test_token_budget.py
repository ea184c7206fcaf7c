"""Token-budget steps in one process: config, lengths, packing, exactly-once, resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_adabatch.config import ConfigError, load_ds_config
from ds_adabatch.data.packing import micro_batch_cost, pack_step
from ds_adabatch.data.tokens import SampleLengths, TokenBudgetSampler

_BASE = {"train_batch_size": "auto", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _load(section: dict, world_size: int = 2):
    return load_ds_config({**_BASE, "adabatch": section}, world_size=world_size)


def test_config_token_budget_keys() -> None:
    cfg = _load(
        {
            "schedule": {
                "type": "linear",
                "unit": "tokens",
                "start": 4097,
                "end": 65536,
                "ramp_samples": 100,
            },
            "micro_batch_tokens": 1024,
            "padding": "packed",
            "bucket_window": 64,
        }
    ).adabatch
    assert cfg.token_budget and cfg.schedule.batch_unit == "tokens" and cfg.padding == "packed"
    assert cfg.max_micro_batch_per_gpu is None
    # Piecewise's unit is its clock, not the batch's unit.
    piece = {"type": "piecewise", "unit": "tokens", "points": [[0, 8]]}
    assert _load({"schedule": piece, "max_micro_batch_per_gpu": 4}).adabatch.schedule.batch_unit == "samples"


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"schedule": {"type": "constant", "value": 8}}, "adabatch.max_micro_batch_per_gpu"),
        ({"schedule": {"type": "constant", "value": 8, "unit": "tokens"}, "max_micro_batch_per_gpu": 4}, "adabatch.schedule.unit"),
        ({"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4, "padding": "packed"}, "adabatch.padding"),
        ({"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4, "bucket_window": 8}, "adabatch.bucket_window"),
        (
            {"schedule": {"type": "constant", "value": 8}, "micro_batch_tokens": 64, "max_micro_batch_per_gpu": "auto", "memory": {"recover_from_oom": True}},
            "adabatch.max_micro_batch_per_gpu",
        ),
        ({"schedule": {"type": "constant", "value": 8}, "micro_batch_tokens": 0}, "adabatch.micro_batch_tokens"),
        (
            {"schedule": {"type": "constant", "value": 64, "unit": "tokens"}, "micro_batch_tokens": 64, "lr_schedule_unit": "samples"},
            "adabatch.lr_schedule_unit",
        ),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(section: dict, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(section)
    assert path in {p.path for p in err.value.problems}


def test_too_long_sample_is_named_or_truncated() -> None:
    lengths = np.array([5, 7, 300, 4])
    with pytest.raises(ValueError, match="sample 2 has length 300"):
        TokenBudgetSampler(SampleLengths(4, lengths=lengths), micro_batch_tokens=64)
    # Lazily measured: the error comes at the step that reaches the sample.
    data = [[0] * n for n in lengths]
    lazy = TokenBudgetSampler(
        SampleLengths(4, length_fn=len, dataset=data), micro_batch_tokens=64, shuffle=False
    )
    with pytest.raises(ValueError, match="sample 2 has length 300"):
        lazy.next_step(1000, 2)
    cut = TokenBudgetSampler(
        SampleLengths(4, lengths=lengths), micro_batch_tokens=64, truncate=True, shuffle=False
    )
    step = cut.next_step(1000, 2)
    assert step.size == 4 and step.tokens == 5 + 7 + 64 + 4
    with pytest.raises(ValueError, match="length 0"):
        SampleLengths(2, lengths=[3, 0])


def test_length_fn_is_lazy_and_cached() -> None:
    calls: list[int] = []

    class Data:
        def __len__(self) -> int:
            return 10**7

        def __getitem__(self, i: int) -> int:
            calls.append(i)
            return i

    lengths = SampleLengths(10**7, length_fn=lambda i: i % 97 + 1, dataset=Data())
    sampler = TokenBudgetSampler(lengths, micro_batch_tokens=512)
    assert calls == []  # nothing measured at start-up
    step = sampler.next_step(4096, 4)
    assert 0 < len(calls) < 1000 and len(set(calls)) == len(calls)
    before = len(calls)
    lengths.get(step.indices)
    assert len(calls) == before  # cached


def _check_step(step, budget: int, padding: str, world: int, lengths: np.ndarray) -> None:
    passes = {len(layout.micro_batches) for layout in step.layouts}
    assert passes == {step.passes} and len(step.layouts) == world
    seen = []
    for layout in step.layouts:
        for micro, cost in zip(layout.micro_batches, layout.costs):
            if micro:
                assert cost == micro_batch_cost(np.minimum(lengths[list(micro)], budget), padding)
            assert cost <= budget
            seen += micro
    assert sorted(seen) == sorted(step.indices.tolist())
    # The minimal number of passes for the micro-batches formed.
    real = sum(1 for layout in step.layouts for m in layout.micro_batches if m)
    assert step.passes == -(-real // world)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    seed=st.integers(0, 2**32),
    budget=st.integers(16, 400),
    padding=st.sampled_from(["pad_to_longest", "packed"]),
    window=st.sampled_from([0, 1, 7, 64]),
    targets=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    worlds=st.lists(st.integers(1, 8), min_size=1, max_size=12),
    drop_last=st.booleans(),
    max_micro=st.sampled_from([None, 3]),
)
def test_exactly_once_within_budget_any_world(
    n, seed, budget, padding, window, targets, worlds, drop_last, max_micro
) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, budget + 1, n)
    make = lambda: TokenBudgetSampler(  # noqa: E731
        SampleLengths(n, lengths=lengths), micro_batch_tokens=budget, padding=padding, bucket_window=window,
        seed=seed, drop_last=drop_last, max_micro_batch=max_micro,
    )  # fmt: skip
    sampler = make()
    per_epoch: dict[int, list[int]] = {}
    streams = []
    for k in range(40):
        target, world = targets[k % len(targets)], worlds[k % len(worlds)]
        if k == 20:  # resume from the state on another world size
            state = sampler.state_dict()
            sampler = make()
            sampler.load_state_dict(state)
        step = sampler.next_step(target, world)
        _check_step(step, budget, padding, world, lengths)
        if max_micro is not None:
            assert all(len(m) <= max_micro for layout in step.layouts for m in layout.micro_batches)
        # Target met unless the epoch ran out.
        assert step.tokens >= target or step.stop == n
        assert step.tokens - int(lengths[step.indices[-1]]) < target
        per_epoch.setdefault(step.epoch, []).extend(step.indices.tolist())
        streams.append((step.epoch, step.indices.tolist()))
    assert sampler.samples_consumed == sum(len(i) for _, i in streams)
    for epoch, got in per_epoch.items():
        assert len(got) == len(set(got))  # never twice
        if epoch < max(per_epoch):  # a finished epoch: every sample once, except a dropped tail
            assert len(got) + (0 if not drop_last else n - len(got)) == n
            if not drop_last:
                assert sorted(got) == list(range(n))
    # The stream does not depend on the world sizes.
    other = make()
    again = [other.next_step(targets[k % len(targets)], 1) for k in range(40)]
    assert [(s.epoch, s.indices.tolist()) for s in again] == streams


def test_balanced_assignment_and_bucketing_reduce_padding() -> None:
    rng = np.random.default_rng(0)
    n = 4000
    lengths = np.clip((rng.pareto(1.2, n) * 40 + 16).astype(int), 16, 1024)
    plain = TokenBudgetSampler(SampleLengths(n, lengths=lengths), micro_batch_tokens=2048)
    bucketed = TokenBudgetSampler(
        SampleLengths(n, lengths=lengths), micro_batch_tokens=2048, bucket_window=1024
    )
    pad_plain = pad_bucket = real = 0
    for _ in range(20):
        a, b = plain.next_step(16384, 4), bucketed.next_step(16384, 4)
        loads = [layout.padded_tokens for layout in a.layouts]
        # Greedy longest-first: no rank carries more than the mean plus one micro-batch.
        assert max(loads) <= sum(loads) / len(loads) + 2048
        pad_plain += a.padded_tokens
        pad_bucket += b.padded_tokens
        real += b.tokens
    assert pad_bucket < pad_plain


def test_state_dict_refuses_another_stream() -> None:
    lengths = SampleLengths(10, lengths=np.arange(1, 11))
    a = TokenBudgetSampler(lengths, micro_batch_tokens=32, seed=1)
    a.next_step(20, 2)
    b = TokenBudgetSampler(lengths, micro_batch_tokens=32, seed=2)
    with pytest.raises(ValueError, match="seed=1"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**a.state_dict(), "version": 99})


def test_pack_step_pads_with_the_shortest_sample() -> None:
    layouts = pack_step(np.array([10, 11, 12]), np.array([30, 5, 30]), world_size=4, budget=40)
    assert [len(layout.micro_batches) for layout in layouts] == [1, 1, 1, 1]
    # 30 + 30 exceed 40 padded to the longest: three micro-batches, one pad running the 5-token sample.
    assert sum(1 for layout in layouts if layout.micro_batches == ((),)) == 1
    assert sorted(layout.costs[0] for layout in layouts) == [5, 5, 30, 30]


def test_sample_unit_steps_take_that_many_samples() -> None:
    lengths = np.arange(1, 11)
    sampler = TokenBudgetSampler(
        SampleLengths(10, lengths=lengths), micro_batch_tokens=20, step_unit="samples", shuffle=False
    )
    sizes = [sampler.next_step(4, 2).size for _ in range(4)]
    assert sizes == [4, 4, 2, 4]  # the epoch's last step is the smaller remainder
    dropping = TokenBudgetSampler(
        SampleLengths(10, lengths=lengths), micro_batch_tokens=20, step_unit="samples", drop_last=True
    )
    steps = [dropping.next_step(4, 3) for _ in range(3)]
    assert [s.size for s in steps] == [4, 4, 4] and steps[2].epoch == 1 and dropping.samples_skipped == 2


def test_cli_describes_and_simulate_refuses_token_budgets(tmp_path, capsys) -> None:
    import json

    from ds_adabatch.cli import main

    path = tmp_path / "tokens.json"
    section = {"schedule": {"type": "constant", "unit": "tokens", "value": 4096}, "micro_batch_tokens": 512}
    path.write_text(json.dumps({**_BASE, "adabatch": section}))
    assert main(["validate", str(path), "--world-size", "2"]) == 0
    assert "micro-batches of at most 512 tokens" in capsys.readouterr().out
    assert (
        main(
            ["simulate", str(path), "--world-size", "2", "--samples", "10", "--out", str(tmp_path / "p.png")]
        )
        == 2
    )
    assert "micro_batch_tokens" in capsys.readouterr().err


def test_trainer_refuses_a_token_budget_instead_of_ignoring_it() -> None:
    from types import SimpleNamespace

    from ds_adabatch.integrations._trainer_setup import build_batch_state

    section = {"schedule": {"type": "constant", "unit": "tokens", "value": 4096}, "micro_batch_tokens": 512}
    args = SimpleNamespace(
        world_size=1, process_index=0, per_device_train_batch_size=2, deepspeed={**_BASE, "adabatch": section}
    )
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        build_batch_state(
            args,
            list(range(8)),
            list,
            batch_size_scheduler=None,
            gradient_accumulation_steps=1,
            max_micro_batch_per_gpu=None,
        )

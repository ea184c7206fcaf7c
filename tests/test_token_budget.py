"""Token-budget steps in one process: config, lengths, packing, exactly-once, resume, loader workers."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.multiprocessing as torch_mp
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


# -- TokenBudgetLoader with worker processes -----------------------------------------------------------
# The datasets live at module level so that worker processes can unpickle them under any start method.

_N, _BUDGET = 40, 48
_LENGTHS = np.random.default_rng(3).integers(1, 25, _N)


class _TokenRows(torch.utils.data.Dataset):
    """Sample ``i`` is ``100 * i + arange(length_i)``; it raises (or counts loads) when armed."""

    def __init__(self, *, armed=None, bad_index: int = -1, counts=None) -> None:
        self.armed, self.bad_index, self.counts = armed, bad_index, counts

    def __len__(self) -> int:
        return _N

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.counts is not None:
            self.counts[i] += 1
        if self.armed is not None and self.armed.value and i == self.bad_index:
            raise KeyError(f"sample {i} is unreadable")
        return 100 * i + torch.arange(int(_LENGTHS[i]))


def _pad_rows(samples: list[torch.Tensor]) -> dict:
    ids = torch.full((len(samples), max(len(s) for s in samples)), -1, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s)] = s
    return {"ids": ids, "mask": ids >= 0}


def _token_loader(rank: int, world: int, num_workers: int, dataset=None, **sampler_kw):
    from ds_adabatch.data import TokenBudgetLoader

    kw = {"seed": 7, "micro_batch_tokens": _BUDGET} | sampler_kw
    sampler = TokenBudgetSampler(SampleLengths(_N, lengths=_LENGTHS), **kw)
    return TokenBudgetLoader(
        dataset if dataset is not None else _TokenRows(), sampler, rank=rank, world_size=world,
        collate_fn=_pad_rows, num_workers=num_workers,
    )  # fmt: skip


def _take(loader, target: int):
    return loader.next_step(loader.plan_for_tokens(target))


def _assert_same_step(got, want, where: str) -> None:
    """Same plan, epoch, samples per pass, weights and bit-identical collated tensors."""
    assert (got.plan, got.epoch, got.rank) == (want.plan, want.epoch, want.rank), where
    assert got.global_batch.indices.tolist() == want.global_batch.indices.tolist(), where
    assert [(m.indices, m.num_samples) for m in got] == [(m.indices, m.num_samples) for m in want], (
        f"{where}: passes {[m.indices for m in got]} instead of {[m.indices for m in want]}"
    )
    pad = got.global_batch.pad_index
    for k, (a, b) in enumerate(zip(got, want)):
        # Row r of a pass starts at 100 * (its sample): the pass holds its indices, a pad the pad sample.
        first = a.batch["ids"][:, 0].tolist()
        assert first == [100 * i for i in (a.indices or (pad,))], f"{where}, pass {k}: wrong samples"
        assert a.batch.keys() == b.batch.keys(), where
        for key in a.batch:
            assert torch.equal(a.batch[key], b.batch[key]), f"{where}, pass {k}: collated {key!r} differs"


# Targets that grow, shrink, repeat (so a prefetched step is used) and change while a step is prefetched;
# small ones leave rank 1 with zero-weight pads. 40 samples of ~12 tokens: about three epochs.
_TARGETS = [60, 60, 60, 200, 200, 12, 12, 12, 1, 1, 300, 90, 90, 90, 30, 30, 150, 150, 150, 8, 8, 8, 500]


@pytest.mark.parametrize(
    "sampler_kw",
    [{}, {"drop_last": True, "bucket_window": 8}, {"padding": "packed", "max_micro_batch": 3}],
    ids=["plain", "drop_last-bucketed", "packed-capped"],
)
def test_token_loader_workers_serve_the_inline_stream(sampler_kw: dict) -> None:
    world = 2
    inline = [_token_loader(r, world, 0, **sampler_kw) for r in range(world)]
    pooled = [_token_loader(r, world, 2, **sampler_kw) for r in range(world)]
    per_epoch: dict[int, list[int]] = {}
    pads = 0
    with pooled[0], pooled[1]:
        for k, target in enumerate(_TARGETS):
            for r in range(world):
                got, want = _take(pooled[r], target), _take(inline[r], target)
                _assert_same_step(got, want, f"step {k} (target {target}), rank {r}")
                pads += sum(m.is_pad for m in got)
                per_epoch.setdefault(got.epoch, []).extend(i for m in got for i in m.indices)
            assert all(len(p.worker_processes()) == 2 for p in pooled), "the workers did not run"
        for p, q in zip(pooled, inline):
            assert p.sampler.state_dict() == q.sampler.state_dict(), "a prefetched step was counted"
    assert pads > 0, "the targets must give some rank a zero-weight pad"
    assert len(per_epoch) >= 3, "the targets must run past two epoch ends"
    for epoch in sorted(per_epoch)[:-1]:  # every finished epoch: each sample once (a dropped tail aside)
        got = per_epoch[epoch]
        assert len(got) == len(set(got)), f"epoch {epoch} served a sample twice"
        if not sampler_kw.get("drop_last"):
            assert sorted(got) == list(range(_N)), f"epoch {epoch} missed samples"
    assert all(p.worker_processes() == [] for p in pooled), "close() left workers running"


def test_token_loader_uses_the_prefetched_step_and_drops_it_on_a_new_target() -> None:
    counts = torch_mp.get_context("fork").RawArray("q", _N)
    reference = _token_loader(0, 1, 0, shuffle=False)
    with _token_loader(0, 1, 2, _TokenRows(counts=counts), shuffle=False) as loader:
        served: list[int] = []
        for _ in range(4):
            step = _take(loader, 60)
            _assert_same_step(step, _take(reference, 60), "same target")
            served += [i for m in step for i in m.indices]
        # Each sample was loaded once: the served steps were the prefetched ones, not loaded again.
        assert max(counts) == 1 and sum(counts) >= len(served), list(counts)
        loader.plan_for_tokens(200)  # the engine asks for another target while a step of 60 is queued
        assert loader._steps.queued_key is None, "the step of the old target was not dropped"
        step = loader.next_step(loader.plan_for_tokens(200))
        _assert_same_step(step, _take(reference, 200), "after the target change")


def test_token_loader_resumes_from_a_state_taken_with_a_step_prefetched() -> None:
    world = 2

    def inline_from(state: dict, rank: int):
        loader = _token_loader(rank, world, 0)
        loader.load_state_dict(state)
        return loader

    reference = _token_loader(0, world, 0)
    with _token_loader(0, world, 2) as first:
        for target in _TARGETS[:6]:
            _take(first, target)
            _take(reference, target)
        assert first._steps.queued_key is not None, "no step was prefetched"
        state = first.state_dict()
        assert state == reference.state_dict(), "the prefetched, uncommitted step was counted"
        # Going on, then rewinding the same loader to the saved state while a step is prefetched.
        for target in _TARGETS[6:9]:
            _take(first, target)
        assert first._steps.queued_key is not None
        first.load_state_dict(state)
        check = inline_from(state, 0)
        for k, target in enumerate(_TARGETS[6:12]):
            _assert_same_step(_take(first, target), _take(check, target), f"rewound step {k}")
    for r in range(world):  # a fresh loader per rank, resumed from rank 0's state
        with _token_loader(r, world, 2) as resumed:
            resumed.load_state_dict(state)
            check = inline_from(state, r)
            for k, target in enumerate(_TARGETS[6:16]):
                _assert_same_step(_take(resumed, target), _take(check, target), f"resumed step {k}, rank {r}")


def test_token_loader_worker_error_names_the_samples_and_consumes_nothing() -> None:
    armed = torch_mp.get_context("fork").RawValue("b", 1)
    reference = _token_loader(0, 1, 0, shuffle=False)
    first = _take(reference, 60)
    bad = reference.peek_step(60).micro_batches(0)[0][-1]  # a sample of the second step
    with _token_loader(0, 1, 2, _TokenRows(armed=armed, bad_index=bad), shuffle=False) as loader:
        _assert_same_step(_take(loader, 60), first, "before the failure")
        plan = loader.plan_for_tokens(60)
        with pytest.raises(RuntimeError, match=rf"samples \[[0-9, ]*\b{bad}\b[0-9, ]*\]") as err:
            loader.next_step(plan)
        assert f"sample {bad} is unreadable" in str(err.value), "the worker's traceback is missing"
        assert loader.sampler.state_dict() == reference.sampler.state_dict(), "a failed step was consumed"
        armed.value = 0
        _assert_same_step(loader.next_step(plan), _take(reference, 60), "the retry")


def test_token_loader_close_and_with_block_stop_the_workers() -> None:
    seen: list = []
    with pytest.raises(ZeroDivisionError), _token_loader(0, 1, 2) as loader:
        _take(loader, 60)
        seen += loader.worker_processes()
        raise ZeroDivisionError
    assert len(seen) == 2 and not any(p.is_alive() for p in seen), "workers outlived the with block"
    with pytest.raises(RuntimeError, match="closed"):
        _take(loader, 60)
    loader.close()  # twice is fine
    unclosed = _token_loader(0, 1, 2)
    _take(unclosed, 60)
    procs = unclosed.worker_processes()
    del unclosed
    gc.collect()
    assert procs and not any(p.is_alive() for p in procs), "an unreferenced loader left its workers running"
    with pytest.raises(ValueError, match="num_workers"):
        _token_loader(0, 1, -1)


@pytest.mark.parametrize("unit", ["tokens", "samples"])
def test_token_budget_targets_are_not_rounded_to_the_world_size(unit) -> None:
    from ds_adabatch.schedules import BatchSizeController

    section = {
        "schedule": {"type": "linear", "unit": unit, "start": 100, "end": 1001, "ramp_samples": 1000},
        "micro_batch_tokens": 64,
    }
    from ds_adabatch.schedules.base import ScheduleContext

    targets = {}
    for world in (1, 2, 3):
        controller = BatchSizeController(_load(section, world_size=world).adabatch, world)
        ctx = ScheduleContext(step=1, samples=1000, global_batch=100, world_size=world)
        targets[world] = [controller.initial_global_batch(), controller.next_global_batch(ctx).global_batch]
    # A resume on another world size keeps the same targets, so the same steps.
    assert targets[1] == targets[2] == targets[3] == [100, 1001], targets


@pytest.mark.parametrize("padding", ["pad_to_longest", "packed"])
def test_a_single_pass_is_halved_for_a_noise_measurement(padding: str) -> None:
    lengths = np.array([5, 9, 3, 7, 2, 8, 4])
    sampler = TokenBudgetSampler(
        SampleLengths(7, lengths=lengths), micro_batch_tokens=80, padding=padding, step_unit="samples"
    )
    step = sampler.next_step(5, 1)
    assert step.passes == 1, step
    halves = sampler.halve(step)
    first, second = halves.micro_batches(0)
    # The step's samples, order and counts: only the passes differ, the first holding the larger half.
    assert first + second == step.micro_batches(0)[0] and (len(first), len(second)) == (3, 2)
    assert np.array_equal(halves.indices, step.indices) and halves.tokens == step.tokens
    assert halves.budget == step.budget and halves.passes == 2
    cost = {int(i): int(n) for i, n in zip(step.indices, step.lengths)}
    for part, paid in zip((first, second), halves.layouts[0].costs):
        assert paid == micro_batch_cost([cost[i] for i in part], padding) <= 80
    # Only a single pass on a single rank, of two samples or more.
    with pytest.raises(ValueError, match="single pass"):
        sampler.halve(halves)
    with pytest.raises(ValueError, match="single pass"):
        sampler.halve(sampler.next_step(2, 2))

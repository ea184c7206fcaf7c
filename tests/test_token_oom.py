"""Out-of-memory re-cutting of token-budget steps, in one process: packing under a learned budget, the
re-plan rule, the agreement's pass index and the simulated token limit. The 2-rank runs are in
tests/oom_worker.py (``tokens_*`` cases, asserted in tests/test_oom.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_adabatch.data.packing import micro_batch_cost, pack_step
from ds_adabatch.data.tokens import SampleLengths, TokenBudgetSampler
from ds_adabatch.runtime.distributed.agreement import HostAgreement
from ds_adabatch.runtime.memory.limit import MicroBatchMemory
from ds_adabatch.runtime.memory.oom import OomAgreement, UnrecoverableOutOfMemory
from ds_adabatch.runtime.memory.recovery import replan_token_step_after_oom
from ds_adabatch.testing import simulated_memory_limit


def _sampler(lengths, budget=64, padding="pad_to_longest", **kw) -> TokenBudgetSampler:
    lengths = np.asarray(lengths)
    return TokenBudgetSampler(
        SampleLengths(len(lengths), lengths=lengths), micro_batch_tokens=budget, padding=padding, **kw
    )


def test_a_sample_above_a_lowered_budget_runs_alone_but_the_configured_budget_still_errors() -> None:
    idx, lengths = np.arange(4), np.array([30, 12, 12, 5])
    with pytest.raises(ValueError, match="sample 0 has length 30"):
        pack_step(idx, lengths, world_size=1, budget=24)
    (layout,) = pack_step(idx, lengths, world_size=1, budget=24, oversize_alone=True)
    # 30 alone (above 24, within micro_batch_tokens); 2 x 12 = 24 fits; 3 x 12 would not.
    assert layout.micro_batches == ((0,), (1, 2), (3,)) and layout.costs == (30, 24, 5)
    (packed,) = pack_step(idx, lengths, world_size=1, budget=24, padding="packed", oversize_alone=True)
    assert packed.micro_batches[0] == (0,) and max(packed.costs[1:]) <= 24
    with pytest.raises(ValueError, match="sample 0 has length 70 tokens, above micro_batch_tokens 64"):
        _sampler([70, 10])
    sampler = _sampler([40, 10, 10])
    sampler.pass_budget = 20
    step = sampler.next_step(60, 1)
    assert step.budget == 20 and step.layouts[0].micro_batches == ((0,), (1, 2))
    with pytest.raises(ValueError, match="pass_budget"):
        _sampler([10]).pass_budget = 65


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 60),
    seed=st.integers(0, 10**6),
    padding=st.sampled_from(["pad_to_longest", "packed"]),
    world=st.integers(1, 4),
    budget=st.integers(2, 63),
)
def test_repack_keeps_the_samples_and_bounds_every_pass_of_several(n, seed, padding, world, budget) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 33, n)
    sampler = _sampler(lengths, padding=padding)
    step = sampler.peek_step(int(lengths.sum()), world)
    sampler.pass_budget = budget
    cut = sampler.repack(step)
    assert cut.budget == budget and step.budget == 64
    assert cut.indices is step.indices and cut.size == step.size and cut.tokens == step.tokens
    seen = []
    for layout in cut.layouts:
        assert len(layout.micro_batches) == cut.passes
        for micro, cost in zip(layout.micro_batches, layout.costs):
            seen += micro
            if len(micro) > 1:
                assert cost <= budget
            if micro:
                assert cost == micro_batch_cost(lengths[list(micro)], padding)
    assert sorted(seen) == sorted(step.indices.tolist())
    # The sampler commits the re-cut step like the original: the stream goes on from the same place.
    sampler.commit(cut)
    assert sampler.position == step.stop and sampler.tokens_consumed == step.tokens


def test_replan_halves_the_failed_pass_and_names_a_single_sample_pass_unrecoverable() -> None:
    lengths = [8] * 8 + [20]
    sampler = _sampler(lengths, budget=64, shuffle=False)
    memory = MicroBatchMemory(64, 64, grow_after_steps=1)
    step = sampler.peek_step(sum(lengths), 2)
    # Rank 1 failed in its first pass: the most expensive one it holds.
    cost, samples = step.pass_cost(1, 0)
    assert samples > 1
    cut, reason, line = replan_token_step_after_oom(memory, sampler, step, {1: 0}, number=7)
    assert memory.limit == cost // 2 == sampler.pass_budget == cut.budget
    assert f"at {cost} tokens per pass" in reason and "same samples" in line and "step 7" in line
    assert all(
        c <= cost // 2 for lay in cut.layouts for m, c in zip(lay.micro_batches, lay.costs) if len(m) > 1
    )
    assert cut.passes > step.passes
    # Where the failing rank does not know the pass (the optimizer step), every pass of it counts.
    memory2 = MicroBatchMemory(64, 64)
    sampler2 = _sampler(lengths, budget=64, shuffle=False)
    replan_token_step_after_oom(memory2, sampler2, step, {0: None, 1: None}, number=0)
    assert memory2.limit == step.largest_pass // 2
    # A pass of one sample cannot be cut smaller.
    single = sampler.repack(step, 20)
    where = next(
        (r, p) for r, lay in enumerate(single.layouts) for p, m in enumerate(lay.micro_batches) if m == (8,)
    )
    with pytest.raises(
        UnrecoverableOutOfMemory, match=r"rank \d in step 3, in a pass of one sample \(20 tokens"
    ):
        replan_token_step_after_oom(memory, sampler, single, {where[0]: where[1]}, number=3)


def test_the_agreement_carries_the_failed_pass_index() -> None:
    class _Engine:  # only what OomAgreement wraps: no collective runs at world size 1
        pass

    agreement = OomAgreement.__new__(OomAgreement)
    agreement.rank, agreement.world_size, agreement._agreed, agreement.agreements = 0, 1, False, 0
    agreement.failed_passes = {}
    agreement.host, agreement.local_verdict = HostAgreement(0, 1), None
    assert agreement.report_oom("here", 3) == [0] and agreement.failed_passes == {0: 3}
    agreement.begin_pass()
    assert agreement.report_oom("here") == [0] and agreement.failed_passes == {0: None}


def test_simulated_token_limit_counts_padded_tokens() -> None:
    model = torch.nn.Embedding(10, 2)
    with simulated_memory_limit(max_tokens_per_forward=12) as limit:
        model(torch.zeros(3, 4, dtype=torch.long))  # 12 tokens: fits
        with pytest.raises(torch.OutOfMemoryError, match="13 tokens|15 tokens"):
            model(torch.zeros(3, 5, dtype=torch.long))
        limit.max_tokens_per_forward = 20
        model(torch.zeros(4, 5, dtype=torch.long))
    assert limit.raised == 1
    with pytest.raises(ValueError, match="max_tokens_per_forward"):
        simulated_memory_limit()

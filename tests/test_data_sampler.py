"""ElasticSampler: exactly-once global batches for any sequence of plans, on any world size, resumable.

Ranks are simulated as arguments: one sampler builds the global batch and every rank's shard is read
from it, as each rank's own sampler would compute it.
"""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ds_adabatch.data import ElasticSampler, GlobalBatch, epoch_order
from ds_adabatch.plan import BatchPlan, plan_batch

# -- helpers --------------------------------------------------------------------------------------------


def make_plan(batch: int, world: int, max_micro: int) -> BatchPlan:
    """An even plan where one exists, else an uneven one (so any batch size works on any world size)."""
    return plan_batch(batch, world, max_micro, allow_uneven=batch % world != 0)


def slot_order(batch: GlobalBatch) -> list[int]:
    """The global batch read back from the ranks' shards in slot order (step-major)."""
    shards = batch.rank_indices()
    out: list[int] = []
    for step in range(batch.gradient_accumulation_steps):
        for rank in range(batch.world_size):
            out.extend(shards[rank][step])
    return out


def check_shards(batch: GlobalBatch) -> None:
    """Every rank's shard has the plan's micro-batch sizes and the shards tile the global batch."""
    for rank in range(batch.world_size):
        sizes = [len(step) for step in batch.indices(rank)]
        assert tuple(sizes) == batch.plan.micro_batch_sizes(rank), (
            f"rank {rank} got micro-batches of {sizes} samples but the plan says {batch.plan.micro_batch_sizes(rank)}"
        )
    assert slot_order(batch) == batch.all_indices(), (
        "the shards read in slot order differ from the global batch"
    )
    assert len(batch.all_indices()) == batch.size


def expected_stream(n: int, sizes: list[int], *, seed: int, shuffle: bool, drop_last: bool) -> list[tuple]:
    """The spec, written out plainly: ``(epoch, start, indices, skipped)`` per requested global batch."""
    epoch, pos, out = 0, 0, []
    for want in sizes:
        skipped = 0
        if pos == n:
            epoch, pos = epoch + 1, 0
        if want > n - pos and drop_last:
            skipped, epoch, pos = n - pos, epoch + 1, 0
        take = min(want, n - pos)
        order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
        out.append((epoch, pos, order.take(pos, pos + take).tolist(), skipped))
        pos += take
    return out


def batch_sizes(n: int, drop_last: bool) -> st.SearchStrategy[int]:
    # Small batches, batches near the dataset size (tails every epoch) and, without drop_last, larger ones.
    top = n if drop_last else 2 * n
    return st.one_of(
        st.integers(1, min(64, top)), st.integers(1, max(1, n // 3)), st.integers(max(1, n // 3), top)
    )


@st.composite
def runs(draw, max_batches: int = 20):
    n = draw(st.integers(1, 10_000))
    drop_last = draw(st.booleans())
    sizes = draw(st.lists(batch_sizes(n, drop_last), min_size=1, max_size=max_batches))
    return n, drop_last, sizes


def splits(count: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """``(world_size, max_micro_batch_per_gpu)`` per batch: world sizes changing between batches."""
    return st.lists(
        st.tuples(st.integers(1, 64), st.integers(1, 64)),
        min_size=count,
        max_size=count,
    )


# -- literal cases --------------------------------------------------------------------------------------


def test_literal_even_batches_then_uneven_tail() -> None:
    # 10 samples, global batch 4 on 2 ranks with max micro 1: two steps of one sample per rank.
    sampler = ElasticSampler(10, shuffle=False)
    plan = plan_batch(4, 2, 1)
    shards = [sampler.next_batch(plan).rank_indices() for _ in range(3)]
    assert shards[0] == [[[0], [2]], [[1], [3]]]
    assert shards[1] == [[[4], [6]], [[5], [7]]]
    # Only 2 samples remain: the tail is replanned as 2 = 1 x 1 on 2 ranks.
    assert shards[2] == [[[8]], [[9]]]
    assert sampler.epoch == 0 and sampler.train_coverage == 1.0 and sampler.fractional_epoch == 1.0
    nxt = sampler.next_batch(plan)
    assert (nxt.epoch, nxt.rank_indices()) == (1, [[[0], [2]], [[1], [3]]])
    assert sampler.fractional_epoch == pytest.approx(1.4)


def test_literal_uneven_tail_within_a_step() -> None:
    # 7 samples, 4 per batch on 2 ranks, max micro 2: the remainder 3 gives rank 0 two, rank 1 one.
    sampler = ElasticSampler(7, shuffle=False)
    plan = plan_batch(4, 2, 2)
    first, tail = sampler.next_batch(plan), sampler.next_batch(plan)
    assert first.rank_indices() == [[[0, 1]], [[2, 3]]]
    assert tail.rank_indices() == [[[4, 5]], [[6]]]
    assert tail.is_tail and tail.plan.global_batch_size == 3 and tail.requested_plan == plan


def test_literal_tail_with_pads() -> None:
    # 5 samples on 4 ranks, one each: the tail of 1 leaves ranks 1..3 an empty (pad) slot.
    sampler = ElasticSampler(5, shuffle=False)
    plan = plan_batch(4, 4, 1)
    assert sampler.next_batch(plan).rank_indices() == [[[0]], [[1]], [[2]], [[3]]]
    tail = sampler.next_batch(plan)
    assert tail.rank_indices() == [[[4]], [[]], [[]], [[]]]
    assert [tail.micro_batch_sizes(r) for r in range(4)] == [(1,), (0,), (0,), (0,)]
    assert tail.plan.has_padding and tail.size == 1


def test_literal_drop_last_skips_the_remainder() -> None:
    sampler = ElasticSampler(5, shuffle=False, drop_last=True)
    plan = plan_batch(4, 4, 1)
    assert sampler.next_batch(plan).all_indices() == [0, 1, 2, 3]
    assert sampler.train_coverage == 0.8
    nxt = sampler.next_batch(plan)
    assert (nxt.epoch, nxt.all_indices(), nxt.skipped) == (1, [0, 1, 2, 3], 1)
    assert (sampler.samples_consumed, sampler.samples_skipped) == (8, 1)


def test_literal_growing_batch_with_accumulation() -> None:
    # 12 samples: 2 (1 rank), then 6 on 2 ranks with max micro 1 (3 steps), then 4 on 3 ranks uneven.
    sampler = ElasticSampler(12, shuffle=False)
    assert sampler.next_batch(plan_batch(2, 1, 2)).rank_indices() == [[[0, 1]]]
    assert sampler.next_batch(plan_batch(6, 2, 1)).rank_indices() == [[[2], [4], [6]], [[3], [5], [7]]]
    last = sampler.next_batch(plan_batch(4, 3, 1, allow_uneven=True))
    # 4 samples in 2 steps of 3 slots: step 0 = 8, 9, 10; step 1 = 11 on rank 0, pads on ranks 1, 2.
    assert last.rank_indices() == [[[8], [11]], [[9], []], [[10], []]]


# -- properties -----------------------------------------------------------------------------------------


@given(run=runs(), data=st.data())
def test_every_sample_once_per_epoch_on_any_plans(run, data) -> None:
    n, drop_last, sizes = run
    split = data.draw(splits(len(sizes)))
    seed = data.draw(st.integers(0, 2**32))
    sampler = ElasticSampler(n, seed=seed, drop_last=drop_last)
    seen: dict[int, list[int]] = {}
    skipped_before: dict[int, int] = {}
    for want, (world, max_micro) in zip(sizes, split):
        batch = sampler.next_batch(make_plan(want, world, max_micro))
        check_shards(batch)
        if batch.plan.has_padding:
            event("a batch with pad slots")
        if batch.is_tail or batch.skipped:
            event("an epoch tail (replanned or skipped)")
        seen.setdefault(batch.epoch, []).extend(slot_order(batch))
        if batch.skipped:
            skipped_before[batch.epoch] = batch.skipped
    last = max(seen)
    event(f"epochs reached: {min(last, 3)}{'+' if last >= 3 else ''}")
    total_skipped = 0
    for epoch, indices in seen.items():
        assert len(set(indices)) == len(indices), f"epoch {epoch} repeats a sample"
        assert all(0 <= i < n for i in indices)
        if epoch < last or sampler.position == n:  # a finished epoch
            skipped = skipped_before.get(epoch + 1, 0)
            total_skipped += skipped
            assert len(indices) + skipped == n, (
                f"epoch {epoch}: {len(indices)} samples used and {skipped} skipped of {n}"
            )
            if not drop_last:
                assert skipped == 0
    for epoch in range(last):
        assert epoch in seen or skipped_before.get(epoch + 1) == n, f"epoch {epoch} vanished"
    assert sampler.samples_consumed == sum(len(v) for v in seen.values())
    assert sampler.samples_skipped == total_skipped
    assert 0.0 < sampler.train_coverage <= 1.0
    assert sampler.fractional_epoch == pytest.approx(sampler.epoch + sampler.train_coverage)


@given(run=runs(), data=st.data())
def test_global_batches_do_not_depend_on_the_split(run, data) -> None:
    n, drop_last, sizes = run
    shuffle = data.draw(st.booleans())
    spec = expected_stream(n, sizes, seed=3, shuffle=shuffle, drop_last=drop_last)
    for _ in range(2):
        split = data.draw(splits(len(sizes)))
        sampler = ElasticSampler(n, seed=3, shuffle=shuffle, drop_last=drop_last)
        for want, (world, max_micro), (epoch, start, indices, skipped) in zip(sizes, split, spec):
            batch = sampler.next_batch(make_plan(want, world, max_micro))
            assert (batch.epoch, batch.start, batch.skipped) == (epoch, start, skipped)
            assert slot_order(batch) == indices, (
                f"global batch of {want} on {world} ranks (max micro {max_micro}) differs from the "
                f"world-independent order"
            )
            assert set(batch.all_indices()) == set(indices)


@given(run=runs(max_batches=12), data=st.data())
@settings(max_examples=100)
def test_resume_continues_the_same_stream(run, data) -> None:
    n, drop_last, sizes = run
    split = data.draw(splits(len(sizes)))
    stop_after = data.draw(st.integers(0, len(sizes)))
    new_worlds = data.draw(splits(len(sizes)))

    straight = ElasticSampler(n, seed=9, drop_last=drop_last)
    expected = [straight.next_batch(make_plan(b, w, m)).all_indices() for b, (w, m) in zip(sizes, split)]

    first = ElasticSampler(n, seed=9, drop_last=drop_last)
    got = [first.next_batch(make_plan(b, w, m)).all_indices() for b, (w, m) in zip(sizes[:stop_after], split)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints go through JSON-like storage
    second = ElasticSampler(n, seed=9, drop_last=drop_last)
    second.load_state_dict(state)
    assert (second.epoch, second.train_coverage) == (first.epoch, first.train_coverage)
    for b, (w, m) in zip(sizes[stop_after:], new_worlds[stop_after:]):
        got.append(second.next_batch(make_plan(b, w, m)).all_indices())
    assert got == expected, f"resuming after {stop_after} batches changed the stream"
    assert second.state_dict() == straight.state_dict()


# -- cursor, peeking, counters --------------------------------------------------------------------------


def test_peek_does_not_advance_and_commit_checks_the_cursor() -> None:
    sampler = ElasticSampler(50, seed=1)
    plan = plan_batch(8, 2, 4)
    peeked = sampler.peek_batch(plan)
    assert sampler.samples_consumed == 0 and sampler.peek_plan(plan) == plan
    after = sampler.peek_batch(plan, after=peeked)
    assert sampler.next_batch(plan) == peeked
    assert sampler.next_batch(plan) == after
    with pytest.raises(ValueError, match="peek again"):
        sampler.commit(peeked)
    other = ElasticSampler(50, seed=2)
    with pytest.raises(ValueError, match="peek again"):
        other.commit(sampler.peek_batch(plan))  # a batch of another stream


def test_peek_plan_reports_the_tail_replan() -> None:
    sampler = ElasticSampler(10, shuffle=False)
    plan = plan_batch(8, 2, 4)
    sampler.next_batch(plan)
    tail = sampler.peek_plan(plan)
    assert tail.global_batch_size == 2 and tail.world_size == 2
    assert sampler.next_batch(plan).plan == tail


def test_coverage_is_one_at_epoch_end_and_rolls_over_lazily() -> None:
    sampler = ElasticSampler(10, shuffle=False)
    plan = plan_batch(5, 1, 5)
    logged = []
    for _ in range(4):
        sampler.next_batch(plan)
        logged.append((sampler.epoch, sampler.train_coverage, sampler.fractional_epoch))
    assert logged == [(0, 0.5, 0.5), (0, 1.0, 1.0), (1, 0.5, 1.5), (1, 1.0, 2.0)]
    assert sampler.samples_consumed == 20


def test_batch_larger_than_dataset() -> None:
    sampler = ElasticSampler(3, shuffle=False)
    batch = sampler.next_batch(plan_batch(8, 2, 4))
    assert batch.rank_indices() == [[[0, 1]], [[2]]] and batch.is_tail
    dropping = ElasticSampler(3, drop_last=True)
    with pytest.raises(ValueError, match="drop_last"):
        dropping.next_batch(plan_batch(8, 2, 4))


# -- validation and state -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 1.5}, "num_samples"),
        ({"num_samples": True}, "num_samples"),
        ({"num_samples": 5, "seed": -3}, "seed"),
        ({"num_samples": 5, "shuffle": "yes"}, "shuffle"),
        ({"num_samples": 5, "drop_last": 1}, "drop_last"),
    ],
)
def test_constructor_names_the_bad_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ElasticSampler(**kwargs)


def test_bad_plan_and_rank_are_refused() -> None:
    sampler = ElasticSampler(5)
    with pytest.raises(TypeError, match="BatchPlan"):
        sampler.next_batch(4)  # type: ignore[arg-type]
    batch = sampler.next_batch(plan_batch(2, 2, 1))
    with pytest.raises(ValueError, match="rank"):
        batch.indices(2)


def test_state_is_global_counts_with_a_version() -> None:
    sampler = ElasticSampler(10, seed=4, drop_last=True)
    sampler.next_batch(plan_batch(4, 2, 2))
    assert sampler.state_dict() == {
        "version": 1,
        "num_samples": 10,
        "seed": 4,
        "shuffle": True,
        "drop_last": True,
        "epoch": 0,
        "position": 4,
        "samples_consumed": 4,
        "samples_skipped": 0,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_samples": 11}, r"num_samples=11.*the same dataset \(11 samples\)"),
        ({"seed": 5}, "seed=5.*set adabatch.data.seed"),
        ({"shuffle": False}, "shuffle=False.*set adabatch.data.shuffle to false"),
        ({"version": 2}, "version"),
        ({"position": 11}, "position"),
        ({"epoch": -1}, "epoch"),
    ],
)
def test_incompatible_state_is_refused_with_a_sentence(change: dict, message: str) -> None:
    state = ElasticSampler(10, seed=4).state_dict() | change
    with pytest.raises(ValueError, match=message):
        ElasticSampler(10, seed=4).load_state_dict(state)


def test_incomplete_state_is_refused() -> None:
    state = ElasticSampler(10).state_dict()
    del state["position"]
    with pytest.raises(ValueError, match="lacks position"):
        ElasticSampler(10).load_state_dict(state)
    with pytest.raises(ValueError, match="mapping"):
        ElasticSampler(10).load_state_dict([1, 2])  # type: ignore[arg-type]


def test_other_drop_last_is_accepted_with_a_warning() -> None:
    state = ElasticSampler(10, drop_last=True).state_dict()
    sampler = ElasticSampler(10, drop_last=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler.load_state_dict(state)
    assert any("drop_last" in str(w.message) for w in caught)
    assert sampler.drop_last is False


def test_sampler_handles_a_billion_samples() -> None:
    sampler = ElasticSampler(10**9, seed=1)
    batch = sampler.next_batch(plan_batch(4096, 8, 64))
    indices = batch.all_indices()
    assert len(set(indices)) == 4096 and all(0 <= i < 10**9 for i in indices)
    assert sampler.train_coverage == pytest.approx(4096 / 10**9)

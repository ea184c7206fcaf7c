"""ElasticDataLoader: this rank's collated micro-batches, with worker processes, across plan changes.

The datasets return their index, so a collated micro-batch shows exactly which samples were served.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch.multiprocessing as torch_mp
from torch.utils.data import Dataset, IterableDataset, default_collate

from ds_adabatch.data import ElasticDataLoader, ElasticSampler, MicroBatch, StepBatch
from ds_adabatch.plan import BatchPlan, plan_batch

# -- datasets (module level, so that spawned workers can unpickle them) ---------------------------------


class IndexDataset(Dataset):
    """``dataset[i] == i``; optionally counts loads per index and fails or dies on one index."""

    def __init__(self, n: int, *, counts=None, armed=None, bad_index: int = -1, die: bool = False) -> None:
        self.n, self.counts, self.armed, self.bad_index, self.die = n, counts, armed, bad_index, die

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.counts is not None:
            self.counts[i] += 1
        if self.armed is not None and self.armed.value and i == self.bad_index:
            if self.die:
                os._exit(3)
            raise KeyError(f"sample {i} is broken")
        return i


class BatchedReads(IndexDataset):
    def __getitems__(self, indices: list[int]) -> list[int]:
        return [i + 1000 for i in indices]


class Stream(IterableDataset):
    """Yields 0..n-1 on every pass and records the epochs it was told about."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def __iter__(self):
        return iter(range(self.n))

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


_WORKER_ID = None


def remember_worker_id(worker_id: int) -> None:
    global _WORKER_ID
    _WORKER_ID = worker_id


def collate_with_worker_id(samples: list[int]):
    return default_collate(samples), _WORKER_ID


# -- helpers --------------------------------------------------------------------------------------------


def uneven(batch: int, world: int, max_micro: int) -> BatchPlan:
    return plan_batch(batch, world, max_micro, allow_uneven=True)


# Growing, shrinking, non-integer factors, uneven, pads (1 sample on 2 ranks), several epoch tails of 37.
PLANS = (
    [plan_batch(4, 2, 2)] * 3
    + [plan_batch(6, 2, 1)] * 2
    + [uneven(3, 2, 1), uneven(1, 2, 1), uneven(1, 2, 1)]
    + [plan_batch(8, 2, 4)] * 4
    + [uneven(5, 2, 2)] * 3
    + [plan_batch(10, 2, 2)] * 6
    + [uneven(7, 2, 1)] * 4
)


def check_step(step: StepBatch, reference, rank: int) -> list[int]:
    """The step is this rank's shard of the reference global batch; returns the real indices served."""
    assert step.global_batch == reference, f"rank {rank} served {step.global_batch!r}, expected {reference!r}"
    assert step.plan == reference.plan and step.epoch == reference.epoch and step.rank == rank
    expected = reference.indices(rank)
    assert len(step) == len(expected) == reference.gradient_accumulation_steps
    served = []
    for micro, indices in zip(step, expected):
        assert isinstance(micro, MicroBatch)
        assert list(micro.indices) == indices and micro.num_samples == len(indices)
        if indices:
            assert micro.batch.tolist() == indices, f"collated {micro.batch.tolist()} for indices {indices}"
        else:
            assert micro.is_pad, "an empty slot must be a zero-weight pad"
            assert micro.batch.tolist() == [reference.all_indices()[0]], "a pad holds one real sample"
        served.extend(indices)
    assert step.num_samples == len(served)
    return served


# -- map-style datasets with workers --------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_serves_exactly_the_sampler_stream_across_plan_changes(num_workers: int) -> None:
    n = 37
    reference = ElasticSampler(n, seed=5)
    loaders = [
        ElasticDataLoader(
            IndexDataset(n), ElasticSampler(n, seed=5), rank=r, world_size=2, num_workers=num_workers
        )
        for r in range(2)
    ]
    per_epoch: dict[int, list[int]] = {}
    try:
        for plan in PLANS:
            batch = reference.next_batch(plan)
            steps = [loader.next_step(plan) for loader in loaders]
            served = [i for rank, step in enumerate(steps) for i in check_step(step, batch, rank)]
            assert sorted(served) == sorted(batch.all_indices())
            per_epoch.setdefault(batch.epoch, []).extend(served)
        if num_workers:
            assert all(len(loader.worker_processes()) == num_workers for loader in loaders)
    finally:
        for loader in loaders:
            loader.close()
    assert max(per_epoch) >= 2, "the plan sequence should cross several epochs"
    for epoch, served in per_epoch.items():
        assert len(set(served)) == len(served), f"epoch {epoch} served a sample twice"
        if epoch < max(per_epoch):
            assert sorted(served) == list(range(n)), f"epoch {epoch} missed samples"
    for loader in loaders:
        assert loader.sampler.state_dict() == reference.state_dict(), "the loader consumed a different amount"
        assert loader.worker_processes() == []


def test_prefetch_is_used_for_an_unchanged_plan_and_dropped_for_a_new_one() -> None:
    n = 200
    counts = torch_mp.get_context("fork").RawArray("q", n)
    plan = plan_batch(8, 1, 2)
    served = 0
    with ElasticDataLoader(
        IndexDataset(n, counts=counts), ElasticSampler(n, shuffle=False), rank=0, world_size=1, num_workers=2
    ) as loader:
        for _ in range(10):
            served += loader.next_step(plan).num_samples
        # Workers load every sample once: the served steps plus at most the one step prefetched.
        assert served <= sum(counts) <= served + 8
        assert max(counts) == 1, "a prefetched micro-batch was loaded again instead of reused"
        bigger = plan_batch(12, 1, 4)
        step = loader.next_step(bigger)
        assert [len(m.indices) for m in step] == [4, 4, 4], "a micro-batch of the old plan's size was served"
        assert list(step[0].indices) == [80, 81, 82, 83], "the dropped prefetch consumed samples"


def test_a_failed_load_consumes_nothing_and_can_be_retried() -> None:
    armed = torch_mp.get_context("fork").RawValue("b", 1)
    dataset = IndexDataset(20, armed=armed, bad_index=5)
    plan = plan_batch(4, 1, 2)
    with ElasticDataLoader(
        dataset, ElasticSampler(20, shuffle=False), rank=0, world_size=1, num_workers=2
    ) as loader:
        assert [list(m.indices) for m in loader.next_step(plan)] == [[0, 1], [2, 3]]
        with pytest.raises(RuntimeError, match="sample 5 is broken"):
            loader.next_step(plan)
        assert loader.sampler.samples_consumed == 4, "a step that failed to load was consumed"
        armed.value = 0
        assert [list(m.indices) for m in loader.next_step(plan)] == [[4, 5], [6, 7]]


def test_a_dead_worker_is_reported_and_the_pool_restarts() -> None:
    armed = torch_mp.get_context("fork").RawValue("b", 1)
    dataset = IndexDataset(20, armed=armed, bad_index=2, die=True)
    plan = plan_batch(4, 1, 4)
    with ElasticDataLoader(
        dataset, ElasticSampler(20, shuffle=False), rank=0, world_size=1, num_workers=2
    ) as loader:
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            loader.next_step(plan)
        assert loader.worker_processes() == [] and loader.sampler.samples_consumed == 0
        armed.value = 0
        assert list(loader.next_step(plan)[0].indices) == [0, 1, 2, 3]


def test_workers_stop_when_the_with_block_raises() -> None:
    seen: list = []

    def train() -> None:
        with ElasticDataLoader(
            IndexDataset(10), ElasticSampler(10), rank=0, world_size=1, num_workers=2
        ) as loader:
            seen.append(loader)
            loader.next_step(plan_batch(2, 1, 1))
            seen.extend(loader.worker_processes())
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        train()
    loader, procs = seen[0], seen[1:]
    assert len(procs) == 2 and not any(p.is_alive() for p in procs), "worker processes outlived the loader"
    with pytest.raises(RuntimeError, match="closed"):
        loader.next_step(plan_batch(2, 1, 1))
    loader.close()  # closing twice is fine


def test_workers_stop_when_an_unclosed_loader_is_collected() -> None:
    loader = ElasticDataLoader(IndexDataset(10), ElasticSampler(10), rank=0, world_size=1, num_workers=2)
    loader.next_step(plan_batch(2, 1, 1))
    procs = loader.worker_processes()
    del loader
    gc.collect()
    assert not any(p.is_alive() for p in procs), "an unreferenced loader left its workers running"


def test_worker_init_fn_and_spawn_context() -> None:
    plan = plan_batch(6, 2, 1)
    with ElasticDataLoader(
        IndexDataset(12),
        ElasticSampler(12, seed=2),
        rank=1,
        world_size=2,
        num_workers=1,
        multiprocessing_context="spawn",
        worker_init_fn=remember_worker_id,
        collate_fn=collate_with_worker_id,
    ) as loader:
        reference = ElasticSampler(12, seed=2)
        for _ in range(3):
            step = loader.next_step(plan)
            expected = reference.next_batch(plan).indices(1)
            assert [m.batch[0].tolist() for m in step] == expected
            assert {m.batch[1] for m in step} == {0}, "worker_init_fn did not run in the worker"


def test_getitems_is_used_for_batched_reads() -> None:
    loader = ElasticDataLoader(BatchedReads(6), ElasticSampler(6, shuffle=False), rank=0, world_size=1)
    assert loader.next_step(plan_batch(3, 1, 3))[0].batch.tolist() == [1000, 1001, 1002]


def test_loader_state_resumes_on_another_world_size() -> None:
    n = 30
    first = ElasticDataLoader(IndexDataset(n), ElasticSampler(n, seed=1), rank=0, world_size=1)
    for _ in range(3):
        first.next_step(plan_batch(4, 1, 2))
    state = first.state_dict()
    assert state["version"] == 1 and state["sampler"]["samples_consumed"] == 12
    reference = ElasticSampler(n, seed=1)
    reference.load_state_dict(state["sampler"])
    for rank in range(2):
        resumed = ElasticDataLoader(
            IndexDataset(n), ElasticSampler(n, seed=1), rank=rank, world_size=2, num_workers=0
        )
        resumed.load_state_dict(state)
        check_step(resumed.next_step(plan_batch(6, 2, 3)), reference.peek_batch(plan_batch(6, 2, 3)), rank)
    with pytest.raises(ValueError, match="seed=1"):
        ElasticDataLoader(IndexDataset(n), ElasticSampler(n, seed=2), rank=0, world_size=1).load_state_dict(
            state
        )


# -- IterableDataset ------------------------------------------------------------------------------------


def test_iterable_dataset_draws_per_plan_and_restarts_at_exhaustion() -> None:
    stream = Stream(5)
    loader = ElasticDataLoader(stream, rank=0, world_size=2)
    step = loader.next_step(plan_batch(8, 2, 2))  # rank 0 draws 2 + 2
    assert [m.batch.tolist() for m in step] == [[0, 1], [2, 3]]
    assert [m.indices for m in step] == [(0, 1), (2, 3)] and step.global_batch is None
    step = loader.next_step(plan_batch(6, 2, 3))  # 3 more: 4, then the stream restarts
    assert step[0].batch.tolist() == [4, 0, 1] and loader.epoch == 1 and stream.epochs == [1]
    assert loader.samples_drawn == 7


def test_iterable_pads_use_a_real_sample_without_losing_it() -> None:
    loader = ElasticDataLoader(Stream(5), rank=1, world_size=2)
    step = loader.next_step(uneven(1, 2, 1))  # rank 1 has only a pad and nothing drawn yet
    assert step[0].is_pad and step[0].batch.tolist() == [0]
    step = loader.next_step(plan_batch(4, 2, 2))
    assert step[0].batch.tolist() == [0, 1], "the sample peeked for a pad was lost"
    step = loader.next_step(uneven(3, 2, 2))  # rank 1 gets one real sample
    assert step[0].batch.tolist() == [2]
    assert loader.next_step(uneven(1, 2, 1))[0].batch.tolist() == [2], "the pad reuses the last sample"


def test_iterable_state_warns_that_it_cannot_resume_exactly() -> None:
    loader = ElasticDataLoader(Stream(5), rank=0, world_size=1)
    loader.next_step(plan_batch(3, 1, 3))
    state = loader.state_dict()
    assert state == {"version": 1, "kind": "iterable", "epoch": 0, "samples_drawn": 3}
    fresh = ElasticDataLoader(Stream(5), rank=0, world_size=1)
    with pytest.warns(UserWarning, match="cannot resume exactly"):
        fresh.load_state_dict(state)
    assert fresh.samples_drawn == 3


def test_empty_iterable_is_an_error() -> None:
    loader = ElasticDataLoader(Stream(0), rank=0, world_size=1)
    with pytest.raises(ValueError, match="empty"):
        loader.next_step(plan_batch(1, 1, 1))


# -- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "sampler", "kwargs", "message"),
    [
        (Stream(3), ElasticSampler(3), {}, "sampler=None"),
        (Stream(3), None, {"num_workers": 1}, "num_workers=0"),
        (IndexDataset(3), None, {}, "sampler"),
        (IndexDataset(3), ElasticSampler(4), {}, "has 3"),
        (IndexDataset(3), ElasticSampler(3), {"rank": 2}, "rank"),
        (IndexDataset(3), ElasticSampler(3), {"num_workers": -1}, "num_workers"),
        (IndexDataset(3), ElasticSampler(3), {"timeout": -1}, "timeout"),
        (IndexDataset(3), ElasticSampler(3), {"multiprocessing_context": "nope"}, "multiprocessing_context"),
    ],
)
def test_bad_arguments_are_refused(dataset, sampler, kwargs: dict, message: str) -> None:
    kwargs = {"rank": 0, "world_size": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        ElasticDataLoader(dataset, sampler, **kwargs)


def test_plan_for_another_world_size_is_refused() -> None:
    loader = ElasticDataLoader(IndexDataset(8), ElasticSampler(8), rank=0, world_size=2)
    with pytest.raises(ValueError, match="world_size=2"):
        loader.next_step(plan_batch(4, 4, 1))
    assert loader.peek_plan(plan_batch(4, 2, 2)).global_batch_size == 4


def test_sampler_import_does_not_import_torch() -> None:
    code = "import sys, ds_adabatch.data; ds_adabatch.data.ElasticSampler(3); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing the sampler pulled in torch"


def test_lazy_exports() -> None:
    import ds_adabatch.data as data

    assert data.StepBatch is StepBatch and data.MicroBatch is MicroBatch
    assert all(getattr(data, name) is not None for name in data.__all__)
    with pytest.raises(AttributeError):
        _ = data.NoSuchThing


# -- one rank's loader from a sample order (data.loader_setup) ------------------------------------------


def test_build_rank_loader_follows_the_order_and_the_token_sampler():
    from ds_adabatch.config import AdaBatchConfig
    from ds_adabatch.data.loader_setup import DataOrder, build_rank_loader
    from ds_adabatch.data.rank_loader import RankLoader
    from ds_adabatch.data.token_loader import TokenBudgetLoader
    from ds_adabatch.data.tokens import SampleLengths, TokenBudgetSampler

    section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    data = AdaBatchConfig.model_validate({**section, "data": {"seed": 7, "drop_last": True}}).data
    plan = plan_batch(8, 2, 4)
    for order in (data, DataOrder(shuffle=True, seed=7, drop_last=True, num_workers=0)):
        built = [
            build_rank_loader(IndexDataset(20), order, rank=r, world_size=2, collate_fn=list) for r in (0, 1)
        ]
        direct = [
            ElasticDataLoader(
                IndexDataset(20),
                ElasticSampler(20, seed=7, drop_last=True),
                rank=r,
                world_size=2,
                collate_fn=list,
            )
            for r in (0, 1)
        ]
        for loader in built:
            assert isinstance(loader, ElasticDataLoader) and isinstance(loader, RankLoader)
            assert loader.sampler.seed == 7 and loader.sampler.drop_last
        for _ in range(3):  # the same samples, rank by rank, as the loader built by hand
            got = [[m.batch for m in loader.next_step(plan)] for loader in built]
            want = [[m.batch for m in loader.next_step(plan)] for loader in direct]
            assert got == want
    stream = build_rank_loader(Stream(6), data, rank=0, world_size=1, collate_fn=list)
    assert isinstance(stream, ElasticDataLoader) and stream.sampler is None, (
        "an IterableDataset has no sampler"
    )
    assert build_rank_loader(None, data, rank=0, world_size=1, collate_fn=list) is None
    sampler = TokenBudgetSampler(SampleLengths(6, lengths=[3] * 6), micro_batch_tokens=6, shuffle=False)
    tokens = build_rank_loader(
        list(range(6)), data, token_sampler=sampler, rank=1, world_size=2, collate_fn=list
    )
    assert isinstance(tokens, TokenBudgetLoader) and isinstance(tokens, RankLoader)
    assert tokens.sampler is sampler and (tokens.rank, tokens.world_size, tokens.num_workers) == (1, 2, 0)
    with tokens:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        tokens.next_step(tokens.plan_for_tokens(6))

"""The keyed epoch order: a bijection on 0..N-1 that depends on (seed, epoch) only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_adabatch.data import MAX_NUM_SAMPLES, epoch_order

ASSORTED_N = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 97, 128, 1000, 1021, 4096, 65521, 65536, 65537]


@pytest.mark.parametrize("n", ASSORTED_N)
def test_shuffle_is_a_permutation(n: int) -> None:
    for seed, epoch in [(0, 0), (7, 3)]:
        got = epoch_order(n, seed=seed, epoch=epoch).take(0, n)
        assert got.dtype == np.int64
        assert np.array_equal(np.sort(got), np.arange(n)), (
            f"N={n} seed={seed} epoch={epoch}: not a permutation"
        )


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1021, 4096])
def test_scalar_and_vector_paths_agree(n: int) -> None:
    order = epoch_order(n, seed=11, epoch=2)
    assert [order[p] for p in range(n)] == order.take(0, n).tolist()
    assert list(order) == order.take(0, n).tolist()
    assert order[-1] == order[n - 1]


@given(
    n=st.integers(1, 10**6),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 10**6),
    data=st.data(),
)
def test_any_range_of_positions_matches_positionwise_lookup(n: int, seed: int, epoch: int, data) -> None:
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, min(n, start + 300)))
    order = epoch_order(n, seed=seed, epoch=epoch)
    got = order.take(start, stop).tolist()
    assert got == [order[p] for p in range(start, stop)]
    assert all(0 <= i < n for i in got) and len(set(got)) == len(got)


def test_no_shuffle_is_identity() -> None:
    order = epoch_order(10, seed=5, epoch=9, shuffle=False)
    assert order.take(0, 10).tolist() == list(range(10))
    assert order.take(3, 6).tolist() == [3, 4, 5]
    assert order[7] == 7


def test_shuffle_is_far_from_identity() -> None:
    n = 10**5
    got = epoch_order(n, seed=0, epoch=0).take(0, n).astype(np.float64)
    # Both sequences are permutations of 0..N-1, so they are their own ranks and Pearson is Spearman.
    rho = np.corrcoef(np.arange(n, dtype=np.float64), got)[0, 1]
    assert abs(rho) < 0.02, f"Spearman rho {rho:.4f} between position and index: shuffle looks ordered"
    fixed = int(np.sum(got == np.arange(n)))
    assert fixed < 20, f"{fixed} fixed points in a shuffle of {n}; a random permutation has about 1"


def test_seeds_and_epochs_give_different_orders() -> None:
    n = 1000
    base = epoch_order(n, seed=1, epoch=0).take(0, n)
    for other in [
        epoch_order(n, seed=2, epoch=0),
        epoch_order(n, seed=1, epoch=1),
        epoch_order(n, seed=0, epoch=1),
        epoch_order(n, seed=2**64 - 1, epoch=0),
    ]:
        got = other.take(0, n)
        same = int(np.sum(got == base))
        assert same < 20, f"{other!r} agrees with seed 1 epoch 0 at {same} of {n} positions"
    assert np.array_equal(epoch_order(n, seed=1, epoch=0).take(0, n), base), "the order is not deterministic"


def test_huge_dataset_costs_no_memory_and_stays_in_range() -> None:
    for n in [10**9, 10**12 + 39, MAX_NUM_SAMPLES]:
        order = epoch_order(n, seed=3, epoch=1)
        start = n - 5000
        got = order.take(start, n)
        assert got.min() >= 0 and got.max() < n
        assert len(np.unique(got)) == got.size
        assert got[:50].tolist() == [order[p] for p in range(start, start + 50)]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": MAX_NUM_SAMPLES + 1}, "num_samples"),
        ({"num_samples": 2.0}, "num_samples"),
        ({"num_samples": 5, "seed": -1}, "seed"),
        ({"num_samples": 5, "epoch": -1}, "epoch"),
        ({"num_samples": 5, "seed": "1"}, "seed"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        epoch_order(**kwargs)


def test_bad_positions_are_refused() -> None:
    order = epoch_order(10)
    with pytest.raises(ValueError, match="position"):
        order[10]
    with pytest.raises(ValueError, match="stop"):
        order.take(5, 11)
    with pytest.raises(ValueError, match="stop"):
        order.take(5, 4)


def test_takes_of_any_size_equal_one_take_of_the_epoch_across_cached_blocks():
    import numpy as np

    from ds_adabatch.data.order import epoch_order

    order = epoch_order(20_000, seed=3, epoch=1)
    whole = order.take(0, 20_000)
    assert sorted(whole.tolist()) == list(range(20_000))
    for size in (1, 37, 4096, 5000):  # inside a block, across a block's end, whole blocks
        pieces = np.concatenate([order.take(i, min(i + size, 20_000)) for i in range(0, 20_000, size)])
        assert (pieces == whole).all(), size
    piece = order.take(10, 20)
    piece[:] = -1  # a caller's copy: the cached block is not changed through it
    assert (order.take(10, 20) == whole[10:20]).all()
    assert [order[p] for p in range(0, 20_000, 997)] == whole[::997].tolist()

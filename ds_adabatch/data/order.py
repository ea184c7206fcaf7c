"""The global sample order of one epoch: a keyed permutation of ``0 .. N-1`` computed index by index.

The order is a function of ``(num_samples, seed, epoch, shuffle)`` only, never of the world size or of
how batches are split, so every rank computes the same order on its own and no permutation array is ever
stored: a dataset of 10**9 samples costs the same memory as one of 10**3.

With ``shuffle=True`` position ``p`` maps to ``order[p]`` through a Feistel network over the smallest
power-of-two domain ``2**k >= N`` (at least 4). Each round splits the ``k``-bit value into a high and a
low part, mixes the low part with a round key through the splitmix64 finaliser and xors the result into
the high part; the halves swap widths every round, so odd ``k`` needs no padding. A Feistel network is a
bijection on ``[0, 2**k)`` whatever its round function, and *cycle-walking* (apply it again while the value
lands in ``[N, 2**k)``) restricts it to a bijection on ``[0, N)``. Because ``2**k < 2 N`` for ``N >= 3``,
the expected number of walks is below two.

Round keys come from ``(seed, epoch)`` through splitmix64, so every epoch has its own order.
:meth:`EpochOrder.take` maps a whole range of positions at once with numpy, cycle-walking included.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["MAX_NUM_SAMPLES", "EpochOrder", "epoch_order"]

MAX_NUM_SAMPLES = 2**62
"""Largest supported dataset (samples); indices must fit a signed 64-bit integer with room to walk."""

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64-bit fixed point)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_ROUNDS = 6  # four rounds already make a pseudo-random permutation; two more steady small domains


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers with full avalanche."""
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    # Seed and epoch are mixed in separately (not added) so that (seed, epoch + 1) and (seed + 1, epoch)
    # do not collide.
    state = _mix64((seed + _GAMMA) & _MASK64) ^ _mix64((epoch * _GAMMA + _MUL1) & _MASK64)
    return tuple(_mix64((state + (r + 1) * _GAMMA) & _MASK64) for r in range(_ROUNDS))


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


_BLOCK = 4096  # positions computed together by take() (32 KiB of indices)


class EpochOrder:
    """The order in which the samples of one epoch are visited: ``order[p]`` is the index at position ``p``.

    Construct with :func:`epoch_order`. Positions and indices are both in ``0 .. num_samples - 1``.
    Indexing (``order[p]``) is pure Python; :meth:`take` maps a range of positions at once with numpy and
    is what samplers use.
    """

    __slots__ = ("_block", "_bits", "_keys", "_np_keys", "epoch", "num_samples", "seed", "shuffle")

    def __init__(self, num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 1, MAX_NUM_SAMPLES)
        self.seed = _check_int("seed", seed, 0, _MASK64)
        self.epoch = _check_int("epoch", epoch, 0, _MASK64)
        self.shuffle = bool(shuffle)
        # At least 2 bits, so that even N = 1 or 2 goes through a real mixing network.
        self._bits = max(2, (self.num_samples - 1).bit_length())
        self._keys = _round_keys(self.seed, self.epoch)
        self._np_keys = tuple(np.uint64(k) for k in self._keys)
        # The block of positions the last take() fell in, computed at once: a step's take() of a few
        # dozen positions then costs a slice, not a Feistel network's numpy calls on a tiny array.
        self._block: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"EpochOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
            f"shuffle={self.shuffle})"
        )

    def __getitem__(self, position: int) -> int:
        """The sample index at ``position`` (pure Python; negative positions count from the end)."""
        p = _check_int("position", position, -self.num_samples, self.num_samples - 1)
        if p < 0:
            p += self.num_samples
        if not self.shuffle:
            return p
        x = self._permute(p)
        while x >= self.num_samples:  # cycle-walk out of [N, 2**k)
            x = self._permute(x)
        return x

    def __iter__(self) -> Iterator[int]:
        """Iterate over the whole epoch in chunks computed with :meth:`take` (memory stays bounded)."""
        chunk = 1 << 16
        for start in range(0, self.num_samples, chunk):
            yield from self.take(start, min(start + chunk, self.num_samples)).tolist()

    def _permute(self, x: int) -> int:
        hi_bits = self._bits - self._bits // 2
        lo_bits = self._bits // 2
        for key in self._keys:
            hi, lo = x >> lo_bits, x & ((1 << lo_bits) - 1)
            f = _mix64(lo ^ key) & ((1 << hi_bits) - 1)
            x = (lo << hi_bits) | (hi ^ f)
            hi_bits, lo_bits = lo_bits, hi_bits
        return x

    def _permute_array(self, x: np.ndarray) -> np.ndarray:
        """The Feistel network on a uint64 array (same arithmetic as :meth:`_permute`, wrapping multiply)."""
        hi_bits = self._bits - self._bits // 2
        lo_bits = self._bits // 2
        s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
        m1, m2 = np.uint64(_MUL1), np.uint64(_MUL2)
        for key in self._np_keys:
            lo_shift, hi_shift = np.uint64(lo_bits), np.uint64(hi_bits)
            hi = x >> lo_shift
            lo = x & np.uint64((1 << lo_bits) - 1)
            z = lo ^ key
            z ^= z >> s30
            z *= m1
            z ^= z >> s27
            z *= m2
            z ^= z >> s31
            z &= np.uint64((1 << hi_bits) - 1)
            z ^= hi
            lo <<= hi_shift
            lo |= z
            x = lo
            hi_bits, lo_bits = lo_bits, hi_bits
        return x

    def take(self, start: int, stop: int) -> np.ndarray:
        """Indices at positions ``start .. stop - 1`` as an ``int64`` array (vectorised, cycle-walking too)."""
        start = _check_int("start", start, 0, self.num_samples)
        stop = _check_int("stop", stop, start, self.num_samples)
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        first = start - start % _BLOCK
        if stop <= first + _BLOCK:  # within one block (positions first .. first + _BLOCK - 1)
            if self._block is None or self._block[0] != first:
                self._block = (first, self._take(first, min(first + _BLOCK, self.num_samples)))
            return self._block[1][start - first : stop - first].copy()
        return self._take(start, stop)

    def _take(self, start: int, stop: int) -> np.ndarray:
        n = np.uint64(self.num_samples)
        out = self._permute_array(np.arange(start, stop, dtype=np.uint64))
        walk = np.flatnonzero(out >= n)
        while walk.size:
            moved = self._permute_array(out[walk])
            out[walk] = moved
            walk = walk[moved >= n]
        return out.astype(np.int64)


def epoch_order(num_samples: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> EpochOrder:
    """The global sample order of ``epoch``: identity when ``shuffle`` is false, else a keyed permutation.

    Args:
        num_samples: Samples in the dataset, ``1 .. 2**62``.
        seed: Run seed, ``0 .. 2**64 - 1``; with ``epoch`` it selects the permutation.
        epoch: Epoch number (0-based), ``0 .. 2**64 - 1``.
        shuffle: False gives ``0, 1, ..., num_samples - 1`` in every epoch.

    Raises:
        ValueError: an argument is not an integer in its range (the message names it).
    """
    return EpochOrder(num_samples, seed=seed, epoch=epoch, shuffle=shuffle)

"""A few host integers agreed by every rank in O(log N) message rounds, with a payload that does not grow.

The out-of-memory agreement (:mod:`ds_adabatch.runtime.memory.oom`) runs before the first DeepSpeed collective
of every reducing pass. It used to all-reduce one flag per rank: a payload of ``world`` values, and gloo
reduces a CPU tensor with a ring whose latency grows with the number of ranks. What every rank needs in
a pass where nothing failed is one number (did anyone fail?) and, for the memory predictor, one more
(the smallest micro-batch limit any rank predicts; sent negated, so both travel as a maximum).
:class:`HostAgreement` reduces such a short vector of int64 values, each element with its own
operation (sum, max or min), by recursive doubling over point-to-point messages on a gloo group:

- with ``N`` ranks, ``P`` the largest power of two <= ``N``: rank ``r >= P`` first hands its values to
  ``r - P``; the ``P`` ranks then exchange with partner ``r XOR 2^k`` for ``k = 0 .. log2(P) - 1``,
  combining after each round; finally ``r - P`` hands the result back to ``r``. Critical path:
  ``log2(P)`` rounds, plus 2 when ``N`` is not a power of two; each message carries the same few
  values (8 bytes each) whatever ``N``.
- hierarchical for free: launchers number a node's ranks consecutively, so with a power-of-two number of
  ranks per node ``L``, the first ``log2(L)`` rounds pair ranks of the same node and only the last
  ``log2(N / L)`` cross nodes.
- integer operations are exact and commutative: every rank ends with bit-identical results, so
  decisions taken from them are the same everywhere.

Which ranks failed (and in which micro-batch) travels only when one did, in a second exchange (the
one-flag-per-rank all-reduce) that the first one's result announces to every rank at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HostAgreement", "host_group"]

_OPS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
_GROUP: dict[str, Any] = {}  # the process's gloo group for host agreements, per default group


class HostAgreement:
    """Reduces a short int64 vector over every rank of ``group`` by recursive doubling.

    Args:
        rank, world_size: this rank and the number of ranks in ``group`` (global ranks).
        group: a gloo process group over every rank (:func:`host_group`); None with one rank.
    """

    def __init__(self, rank: int, world_size: int, group: ProcessGroup | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.power = 1 << (world_size.bit_length() - 1)  # largest power of two <= world_size
        self.exchanges = 0  # reductions issued (tests and benchmarks read it)

    # -- structure (what a benchmark reports next to the measured latency) ------------------------
    @property
    def rounds(self) -> int:
        """Message rounds on the critical path of one reduction."""
        if self.world_size == 1:
            return 0
        return self.power.bit_length() - 1 + (2 if self.power != self.world_size else 0)

    @property
    def messages(self) -> int:
        """Messages this rank sends plus receives in one reduction."""
        if self.world_size == 1:
            return 0
        if self.rank >= self.power:
            return 2
        steps = self.power.bit_length() - 1
        return 2 * steps + (2 if self.rank < self.world_size - self.power else 0)

    # -- the reduction -------------------------------------------------------------------------------
    def reduce(self, values: Sequence[int], ops: Sequence[str]) -> list[int]:
        """Every rank's ``values`` combined element by element with ``ops`` (``"sum"``, ``"max"``,
        ``"min"``); identical on every rank. A collective: call it on every rank, with the same ops."""
        if len(values) != len(ops):
            raise ValueError(f"{len(values)} values but {len(ops)} operations")
        combine = _combiner(tuple(ops))
        self.exchanges += 1
        if self.world_size == 1:
            return [int(v) for v in values]
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64)  # host memory
        rank, power = self.rank, self.power
        if rank >= power:
            # Folded in: the partner below the power of two reduces for this rank.
            self._send(mine, rank - power)
            self._recv(mine, rank - power)
            return mine.tolist()
        extra = rank + power
        if extra < self.world_size:
            mine = combine(mine, self._recv(torch.empty_like(mine), extra))
        mask = 1
        while mask < power:
            partner = rank ^ mask
            theirs = self._sendrecv(mine, partner)
            mine = combine(mine, theirs)
            mask <<= 1
        if extra < self.world_size:
            self._send(mine, extra)
        return mine.tolist()

    def gather_flags(self, flag: float) -> list[float]:
        """Every rank's ``flag``, one value per rank (a payload of ``world_size`` values): the second
        exchange, issued only when the reduction says that some rank has something to report."""
        flags = torch.zeros(self.world_size, dtype=torch.float32)
        flags[self.rank] = flag
        if self.world_size > 1:
            torch.distributed.all_reduce(flags, group=self.group)
        return flags.tolist()

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        torch.distributed.send(tensor, peer, group=self.group)

    def _recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        torch.distributed.recv(tensor, peer, group=self.group)
        return tensor

    def _sendrecv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        # Both sides post their send before receiving: neither waits for the other to start.
        sent = torch.distributed.isend(tensor, peer, group=self.group)
        theirs = self._recv(torch.empty_like(tensor), peer)
        comm.wait_for(sent, "the agreement's send")
        return theirs


@functools.lru_cache(maxsize=64)
def _combiner(ops: tuple[str, ...]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One function combining two value vectors element by element (one tensor operation per kind of
    operation: a round costs a few microseconds of host time, not one operation per element)."""
    unknown = set(ops) - set(_OPS)
    if unknown:
        raise ValueError(f"unknown operation(s) {sorted(unknown)}: use 'sum', 'max' or 'min'")
    if len(set(ops)) == 1:
        return _OPS[ops[0]]
    masks = {op: torch.tensor([o == op for o in ops]) for op in set(ops)}

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a
        for op, mask in masks.items():
            out = torch.where(mask, _OPS[op](a, b), out)
        return out

    return combine


def host_group() -> ProcessGroup | None:
    """The process's gloo group over every rank, for host-side agreements (None in a world of one).

    Created on first use, by every rank at the same point (``new_group`` is a collective), and shared by
    every engine of the process. It is gloo whatever the default group is: on GPUs the flags never touch
    the device, and its point-to-point messages never interleave with DeepSpeed's collectives on the
    default group. Its keys derive from the default group's store, which
    :func:`ds_adabatch.init_distributed` makes restart-safe under torchrun.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    default = dist.group.WORLD
    cached = _GROUP.get("group")
    if cached is None or _GROUP.get("default") is not default:
        cached = dist.new_group(backend="gloo")
        _GROUP.update(group=cached, default=default)
    return cached

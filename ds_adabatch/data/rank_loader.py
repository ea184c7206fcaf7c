"""What one rank's two loaders share, and the contract of the samplers they read.

:class:`~ds_adabatch.data.ElasticDataLoader` (steps cut by samples) and
:class:`~ds_adabatch.data.TokenBudgetLoader` (steps cut by a token budget) are both a
:class:`RankLoader`: this rank's place in the data-parallel group, the collate function, the step loader
that loads micro-batches in this process or in worker processes, and the loader's lifetime. Each says
how a step is formed from its sampler; both samplers walk the same seeded global order and keep the
stream's position as global counts (:class:`SampleStream`), which is what the runtime and the Trainer
read between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torch.utils.data import default_collate

from ._workers import StepLoader, WorkerOptions

if TYPE_CHECKING:  # pragma: no cover
    from ds_adabatch.plan import BatchPlan

    from .step_batch import StepBatch

__all__ = ["RankLoader", "SampleStream", "check_collate_fn"]

_L = TypeVar("_L", bound="RankLoader")


class SampleStream(Protocol):
    """The global sample stream as both samplers keep it (``ElasticSampler``, ``TokenBudgetSampler``):
    global counts, identical on every rank, resumable on any world size."""

    @property
    def num_samples(self) -> int:
        """Samples in one epoch of the dataset."""
        ...

    @property
    def epoch(self) -> int:
        """The epoch the next step is drawn from."""
        ...

    @property
    def position(self) -> int:
        """Samples of the current epoch's order already handed out (or skipped)."""
        ...

    @property
    def samples_consumed(self) -> int:
        """Samples trained over all epochs."""
        ...

    @property
    def train_coverage(self) -> float:
        """The current epoch's share handed out, in [0, 1]."""
        ...

    @property
    def fractional_epoch(self) -> float:
        """Completed epochs plus :attr:`train_coverage`."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def check_collate_fn(collate_fn: object) -> None:
    """Refuse a ``collate_fn`` that cannot be called."""
    if collate_fn is not None and not callable(collate_fn):
        raise ValueError(f"collate_fn must be callable, got {collate_fn!r}")


class RankLoader(ABC):
    """One rank's collated micro-batches of each optimizer step (see the module docstring).

    A subclass checks its own arguments, sets ``_rank`` and ``_world_size`` and calls
    :meth:`_start_loading`; the worker pool starts at the first step and lives until :meth:`close` (or
    the end of a ``with`` block, or garbage collection).
    """

    _rank: int
    _world_size: int
    _collate: Callable[[list[Any]], Any]
    _steps: StepLoader
    _closed: bool

    def _start_loading(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None,
        options: WorkerOptions,
        *,
        seed: int,
    ) -> None:
        """The collate function (default ``torch.utils.data.default_collate``) and the step loader."""
        self._collate = collate_fn if collate_fn is not None else default_collate
        self._steps = StepLoader(dataset, self._collate, options, seed=seed, rank=self._rank)
        self._closed = False

    # -- where the rank stands -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's data-parallel rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the steps are cut for."""
        return self._world_size

    @property
    def num_workers(self) -> int:
        """Worker processes loading micro-batches (0: loaded in this process)."""
        return self._steps.num_workers

    def worker_processes(self) -> list[Any]:
        """The live worker processes (empty before the first step and after :meth:`close`)."""
        return self._steps.processes()

    # -- what each loader says for itself -------------------------------------------------------------
    @property
    @abstractmethod
    def sampler(self) -> Any:
        """The sampler the steps are drawn from."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch the next step is drawn from."""

    @abstractmethod
    def peek_plan(self, plan: BatchPlan) -> BatchPlan:
        """The plan :meth:`next_step` would use for ``plan``; consumes nothing."""

    @abstractmethod
    def next_step(self, plan: BatchPlan, *, load: bool = True) -> StepBatch:
        """This rank's collated micro-batches of the next step under ``plan``."""

    @abstractmethod
    def reload(self, step: StepBatch, plan: BatchPlan) -> StepBatch:
        """``step``'s samples again, cut for ``plan``; consumes nothing."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The stream's global counts (resumable on any world size), versioned."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``."""

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker processes (idempotent). The loader cannot load afterwards."""
        self._closed = True
        self._steps.close()

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

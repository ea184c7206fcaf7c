"""Worker processes that load and collate micro-batches for the per-rank loaders.

:class:`WorkerPool`: a task is a list of dataset indices; its result is
``collate_fn([dataset[i] for i in indices])``. Tasks go to all workers through one queue (an idle worker
takes the next one) and results come back tagged with the task id, so they may arrive in any order. A task
can be dropped after submission: its result is discarded when it arrives, and workers skip dropped tasks
they have not started yet (every task carries the generation it was submitted in; dropping bumps a shared
generation counter).

:class:`StepLoader`: what :class:`~ds_adabatch.data.ElasticDataLoader` and
:class:`~ds_adabatch.data.TokenBudgetLoader` share. A step is given as this rank's *slots*, one list of
dataset indices per accumulation step (empty for a zero-weight pad, which runs the step's pad sample),
and is loaded in the training process or, with workers, one task per slot (all pads of a step share one
task). After a step's tasks are queued, one step ahead may be queued too (*prefetch*); the next
:meth:`StepLoader.load` uses it when it asks for the same step (same key) and drops it otherwise.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as torch_mp

__all__: list[str] = []

_POLL_S = 1.0  # how often a blocked wait looks at worker liveness and the parent process
_JOIN_S = 5.0  # how long close() waits for a worker to exit before terminating it


def describe_indices(indices: Sequence[int], limit: int = 16) -> str:
    """``[3, 17, 4]`` for an error message; a long list is cut after ``limit`` indices."""
    shown = ", ".join(str(int(i)) for i in indices[:limit])
    more = f", ... ({len(indices)} samples)" if len(indices) > limit else ""
    return f"[{shown}{more}]"


def fetch_samples(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """``dataset[i]`` for each index, through ``__getitems__`` when the dataset batches its reads."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(list(indices)))
    return [dataset[i] for i in indices]


def _worker_loop(
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    tasks: Any,
    results: Any,
    generation: Any,
    worker_id: int,
    seed: int,
    worker_init_fn: Callable[[int], None] | None,
    parent_pid: int,
) -> None:
    try:
        # One intra-op thread per worker, as torch's DataLoader does: the workers already run in
        # parallel and oversubscribing the cores slows the training process.
        torch.set_num_threads(1)
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
    except Exception:
        results.put((None, worker_id, traceback.format_exc()))
        return
    try:
        while True:
            try:
                task = tasks.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent_pid:  # the training process died without closing us
                    return
                continue
            if task is None:
                break
            task_id, task_generation, indices = task
            if task_generation < generation.value:
                continue  # dropped before it started: nobody will read the result
            try:
                results.put((task_id, collate_fn(fetch_samples(dataset, indices)), None))
            except Exception:
                results.put((task_id, None, traceback.format_exc()))
    except KeyboardInterrupt:
        pass  # the training process handles Ctrl-C and closes the pool
    # Results still buffered for a parent that stopped listening must not keep this process alive.
    results.cancel_join_thread()


class WorkerPool:
    """``num_workers`` processes serving load-and-collate tasks; see the module docstring."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        *,
        num_workers: int,
        context: Any,
        base_seed: int,
        worker_init_fn: Callable[[int], None] | None,
        timeout: float,
    ) -> None:
        self._tasks = context.Queue()
        self._results = context.Queue()
        # A raw shared integer: only this process writes it, workers only compare against it.
        self._generation = context.RawValue("q", 0)
        self._timeout = timeout
        self._ids = itertools.count()
        self._live: dict[int, list[int]] = {}  # submitted, not yet returned or dropped: their indices
        self._ready: dict[int, tuple[Any, str | None]] = {}
        self._closed = False
        self._procs = []
        try:
            for worker_id in range(num_workers):
                proc = context.Process(
                    target=_worker_loop,
                    args=(
                        dataset,
                        collate_fn,
                        self._tasks,
                        self._results,
                        self._generation,
                        worker_id,
                        (base_seed + worker_id) % 2**63,
                        worker_init_fn,
                        os.getpid(),
                    ),
                    name=f"ds_adabatch-data-{worker_id}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def processes(self) -> list[Any]:
        """The worker processes (for tests and diagnostics)."""
        return list(self._procs)

    def submit(self, indices: Sequence[int]) -> int:
        """Queue one load-and-collate task; returns its id."""
        task_id = next(self._ids)
        self._live[task_id] = list(indices)
        self._tasks.put((task_id, self._generation.value, self._live[task_id]))
        return task_id

    def drop(self, task_ids: Iterable[int]) -> None:
        """Forget tasks: their results are discarded and unstarted ones are skipped by the workers."""
        for task_id in task_ids:
            self._live.pop(task_id, None)
            self._ready.pop(task_id, None)
        self._generation.value += 1

    def drop_all(self) -> None:
        self.drop(list(self._live))

    def result(self, task_id: int) -> Any:
        """Wait for a task's collated batch.

        Raises:
            RuntimeError: the task failed in the worker (the message names its sample indices and holds
                the worker's traceback), a worker died, or ``timeout`` seconds passed without the result.
        """
        if task_id not in self._live:
            raise KeyError(f"task {task_id} was never submitted or was dropped")
        samples = describe_indices(self._live[task_id])
        start = time.monotonic()
        while task_id not in self._ready:
            try:
                got_id, value, error = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()
                if self._timeout and time.monotonic() - start > self._timeout:
                    raise RuntimeError(
                        f"no micro-batch (samples {samples}) from the data workers in "
                        f"{self._timeout:g} s; raise the loader's timeout or look for a slow dataset"
                    ) from None
                continue
            if got_id is None:  # a worker failed during start-up and has exited
                self.close()
                raise RuntimeError(f"data worker {value} failed to start:\n{error}")
            if got_id in self._live:
                self._ready[got_id] = (value, error)
            # Anything else is the result of a dropped task: discarding it is the point of dropping.
        value, error = self._ready.pop(task_id)
        del self._live[task_id]
        if error is not None:
            raise RuntimeError(f"a data worker failed to load the micro-batch of samples {samples}:\n{error}")
        return value

    def _check_alive(self) -> None:
        dead = [p for p in self._procs if p.exitcode is not None]
        if dead:
            codes = ", ".join(f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in dead)
            self.close()
            raise RuntimeError(f"data worker(s) exited unexpectedly: {codes}")

    def close(self) -> None:
        """Stop the workers (idempotent): ask nicely, then terminate any that do not exit in time."""
        if self._closed:
            return
        self._closed = True
        self._live.clear()
        self._ready.clear()
        for _ in self._procs:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                break  # the queue is already unusable; terminate below
        deadline = time.monotonic() + _JOIN_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=_JOIN_S)
        for q in (self._tasks, self._results):
            q.cancel_join_thread()
            q.close()


# -- what both per-rank loaders share --------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerOptions:
    """A loader's worker settings, checked (see :class:`~ds_adabatch.data.ElasticDataLoader` for each)."""

    num_workers: int
    context: Any
    worker_init_fn: Callable[[int], None] | None
    timeout: float
    prefetch: bool

    @classmethod
    def checked(
        cls,
        num_workers: object,
        multiprocessing_context: str | Any | None,
        worker_init_fn: object,
        timeout: object,
        prefetch: object,
    ) -> WorkerOptions:
        """The options, or a ``ValueError`` naming the argument to change."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise ValueError(f"worker_init_fn must be callable, got {worker_init_fn!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        if isinstance(multiprocessing_context, str):
            try:
                multiprocessing_context = torch_mp.get_context(multiprocessing_context)
            except ValueError as err:
                raise ValueError(f"multiprocessing_context: {err}") from None
        context = multiprocessing_context or torch_mp.get_context()
        return cls(num_workers, context, worker_init_fn, float(timeout), bool(prefetch))  # type: ignore[arg-type]


Slots = Sequence[Sequence[int]]
"""One rank's micro-batches of a step: dataset indices per accumulation step, empty for a pad."""


@dataclass
class _Queued:
    """Submitted tasks of one step: one task id per slot (the pads of a step share one)."""

    key: Any
    task_ids: list[int]


class StepLoader:
    """Loads one rank's slots of a step, in this process or through a :class:`WorkerPool`.

    Args:
        dataset, collate_fn: What a slot is read from and collated with.
        options: The worker settings.
        seed, rank: The run's seed and this rank: worker seeds depend on them only, so a rerun repeats
            any randomness inside ``__getitem__`` (augmentation) while ranks differ.

    The pool starts at the first :meth:`load` with workers and is restarted by the next one after a worker
    died. It is stopped by :meth:`close` or when this object is garbage-collected.
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        options: WorkerOptions,
        *,
        seed: int,
        rank: int,
    ) -> None:
        self._dataset, self._collate, self._options = dataset, collate_fn, options
        self._base_seed = (seed * 0x9E3779B97F4A7C15 + 1_000_003 * rank) % 2**63
        self._pool: WorkerPool | None = None
        self._queued: _Queued | None = None

    @property
    def num_workers(self) -> int:
        return self._options.num_workers

    @property
    def queued_key(self) -> Any:
        """The key of the step loading ahead (``None`` when there is none)."""
        return None if self._queued is None else self._queued.key

    def processes(self) -> list[Any]:
        """The live worker processes (empty before the first load and after :meth:`close`)."""
        return [] if self._pool is None or self._pool.closed else self._pool.processes()

    def load_inline(self, slots: Slots, pad_index: int) -> list[Any]:
        """The collated slots, read in this process (the pads of a step share one object)."""
        pad: Any = None
        collated = []
        for indices in slots:
            if indices:
                collated.append(self._collate(fetch_samples(self._dataset, indices)))
                continue
            if pad is None:
                pad = self._collate(fetch_samples(self._dataset, [pad_index]))
            collated.append(pad)
        return collated

    def load(
        self,
        key: Any,
        slots: Slots,
        pad_index: int,
        *,
        ahead: Callable[[], tuple[Any, Slots, int] | None] | None = None,
    ) -> list[Any]:
        """The collated slots of the step ``key`` (the queued step when its key is equal).

        With workers and prefetch on, ``ahead()`` is called once this step's tasks are queued; it returns
        ``(key, slots, pad_index)`` of the step to queue next, or ``None`` for none.

        Raises:
            RuntimeError: a worker failed (the message names the samples) or died; nothing stays queued.
        """
        if self._options.num_workers == 0:
            return self.load_inline(slots, pad_index)
        if self._pool is None or self._pool.closed:  # first load, or the pool broke on a dead worker
            self._queued = None
            self._start_pool()
        pool = self._pool
        assert pool is not None
        current, self._queued = self._queued, None
        if current is None or current.key != key:
            if current is not None:  # speculation missed: another step was asked for
                pool.drop(current.task_ids)
            current = _Queued(key, self._submit(slots, pad_index))
        try:
            if self._options.prefetch and ahead is not None:
                following = ahead()
                if following is not None:
                    self._queued = _Queued(following[0], self._submit(following[1], following[2]))
            results: dict[int, Any] = {}
            for task_id in current.task_ids:
                if task_id not in results:
                    results[task_id] = pool.result(task_id)
        except BaseException:
            # Nothing was handed out; forget every outstanding task so a retry starts clean.
            self._queued = None
            if not pool.closed:
                pool.drop_all()
            raise
        return [results[t] for t in current.task_ids]

    def drop_queued(self) -> None:
        """Forget the step loading ahead (its results are discarded)."""
        if self._queued is not None and self._pool is not None and not self._pool.closed:
            self._pool.drop(self._queued.task_ids)
        self._queued = None

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._queued = None
        if self._pool is not None:
            self._pool.close()

    def _submit(self, slots: Slots, pad_index: int) -> list[int]:
        assert self._pool is not None
        pad_id: int | None = None
        task_ids = []
        for indices in slots:
            if indices:
                task_ids.append(self._pool.submit(indices))
                continue
            if pad_id is None:  # all pad slots of the step share one loaded sample
                pad_id = self._pool.submit([pad_index])
            task_ids.append(pad_id)
        return task_ids

    def _start_pool(self) -> None:
        options = self._options
        self._pool = WorkerPool(
            self._dataset,
            self._collate,
            num_workers=options.num_workers,
            context=options.context,
            base_seed=self._base_seed,
            worker_init_fn=options.worker_init_fn,
            timeout=options.timeout,
        )
        # Stop the workers when the loader is garbage-collected or the interpreter exits without close().
        weakref.finalize(self, self._pool.close)

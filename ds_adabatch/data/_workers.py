"""Worker processes that load and collate micro-batches for :class:`~ds_adabatch.data.ElasticDataLoader`.

A task is a list of dataset indices; its result is ``collate_fn([dataset[i] for i in indices])``. Tasks go
to all workers through one queue (an idle worker takes the next one) and results come back tagged with
the task id, so they may arrive in any order. A task can be dropped after submission: its result is
discarded when it arrives, and workers skip dropped tasks they have not started yet (every task carries
the generation it was submitted in; dropping bumps a shared generation counter).
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

__all__: list[str] = []

_POLL_S = 1.0  # how often a blocked wait looks at worker liveness and the parent process
_JOIN_S = 5.0  # how long close() waits for a worker to exit before terminating it


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
        self._live: set[int] = set()
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
        self._live.add(task_id)
        self._tasks.put((task_id, self._generation.value, list(indices)))
        return task_id

    def drop(self, task_ids: Iterable[int]) -> None:
        """Forget tasks: their results are discarded and unstarted ones are skipped by the workers."""
        for task_id in task_ids:
            self._live.discard(task_id)
            self._ready.pop(task_id, None)
        self._generation.value += 1

    def drop_all(self) -> None:
        self.drop(list(self._live))

    def result(self, task_id: int) -> Any:
        """Wait for a task's collated batch.

        Raises:
            RuntimeError: the task failed in the worker (the worker's traceback is in the message), a
                worker died, or ``timeout`` seconds passed without the result.
        """
        if task_id not in self._live:
            raise KeyError(f"task {task_id} was never submitted or was dropped")
        start = time.monotonic()
        while task_id not in self._ready:
            try:
                got_id, value, error = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()
                if self._timeout and time.monotonic() - start > self._timeout:
                    raise RuntimeError(
                        f"no micro-batch from the data workers in {self._timeout:g} s; raise the "
                        f"loader's timeout or look for a slow dataset"
                    ) from None
                continue
            if got_id is None:  # a worker failed during start-up and has exited
                self.close()
                raise RuntimeError(f"data worker {value} failed to start:\n{error}")
            if got_id in self._live:
                self._ready[got_id] = (value, error)
            # Anything else is the result of a dropped task: discarding it is the point of dropping.
        value, error = self._ready.pop(task_id)
        self._live.discard(task_id)
        if error is not None:
            raise RuntimeError(f"a data worker failed to load a micro-batch:\n{error}")
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

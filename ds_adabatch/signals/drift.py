"""How much faster or slower the device runs now than when a step time was kept.

A shape's step times are kept while it runs; once the job moves on, they stay as they were, while the
device's speed can change: on the 2-core CPU benchmark, whose policies train in turns, batch 8 ran
363.7 samples/s at one decision and read 241.9 at a later one of the same run, and a shape measured
in the fast stretch (16 at 369.6) then looked as fast as ever beside it. Compared as they are, such
times move a schedule on the machine's weather rather than on the shapes' costs (the throughput model
then rated 32 at twice 8's samples per second, and the job tried it).

The speed change is read where the shape is constant: within a run, the consecutive steps of one
shape. Its drift is the median of its last ``window`` kept times over the median of ``window`` kept
times near its start (after its first ``window // 2``, which can still pay a new shape's one-off
costs), counted only where the two windows are apart (a run of at least ``window // 2 + 2 x window``
kept times) and differ by more than twice the standard error of the ratio of two medians, from the
scatter within the windows; else 1. The device is taken as running at one speed across a change of
shape, so a step time kept before runs ``r1, r2, ..., rn`` (the current one last) is read at that time
times the product of their drifts: the speed now over the speed then, as the shapes that ran since
measured it; a shape's median is taken over its times so read, whichever of its runs they come from.
With exact times every drift is 1 and nothing changes.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["RUNS_KEPT", "DeviceDrift", "log_variance"]

RUNS_KEPT = 64
"""The latest runs kept (a run: consecutive kept step times of one shape); a time kept before them is
corrected by their drifts alone. 0 keeps none: every time is read as it was measured (what the
benchmarks compare against)."""

Key = tuple[int, int, int]


def log_variance(groups: Iterable[Iterable[float]]) -> float:
    """The variance of one time's log about its group's, read robustly from the median of the
    differences between two log times of one group (for normal scatter ``sigma`` their magnitude has
    median ``0.6745 x sqrt(2) x sigma``), so a slow step now and then does not widen it; 0 where no
    group has two times."""
    differences: list[float] = []
    for times in groups:
        logs = [math.log(t) for t in times]
        differences.extend(abs(a - b) for a, b in itertools.combinations(logs, 2))
    if not differences:
        return 0.0
    return (statistics.median(differences) / (0.6745 * math.sqrt(2.0))) ** 2


class _Run:
    """Consecutive kept step times of one shape: how many, the first ones (up to the lead and a
    window), the last ``window``."""

    __slots__ = ("ended", "first", "kept", "key", "last")

    def __init__(self, key: Key, window: int) -> None:
        self.key = key
        self.kept = 0
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=window)
        self.ended: float | None = None  # its drift, once another run followed (it changes no more)

    def add(self, seconds: float, window: int) -> None:
        self.kept += 1
        if len(self.first) < window // 2 + window:
            self.first.append(seconds)
        self.last.append(seconds)

    def drift(self, window: int) -> float:
        """The run's speed change (module docstring): its last window's median over its first one's,
        or 1 where the run is too short or the change within what its scatter explains."""
        if self.ended is not None:
            return self.ended
        lead = window // 2
        if self.kept < lead + 2 * window:
            return 1.0
        start, end = self.first[lead:], list(self.last)
        change = math.log(statistics.median(end) / statistics.median(start))
        variance = log_variance((start, end))
        # The variance of a median of n normal draws is about pi / 2 times their mean's.
        error = math.sqrt(variance * math.pi / 2.0 * (1.0 / len(start) + 1.0 / len(end)))
        return math.exp(change) if abs(change) > 2.0 * error else 1.0


class DeviceDrift:
    """The runs of the latest kept step times, and the speed change since each (module docstring).
    Feed it every kept time, in order (:meth:`add`, which names the run the time joined);
    :meth:`since` is what a time of that run is multiplied by to be read at today's speed.

    Args:
        window: the throughput model's window (its medians' number of times).
    """

    def __init__(self, window: int) -> None:
        self.window = int(window)
        self._runs: deque[_Run] = deque(maxlen=RUNS_KEPT)
        self._serial = 0  # the latest run's number (runs are numbered from 1)
        self._factors: dict[int, float] = {}

    def add(self, key: Key, seconds: float) -> int:
        """One kept step time of shape ``key`` (after every one before it); returns its run's number."""
        if not self._runs.maxlen:
            return 0
        if not self._runs or self._runs[-1].key != key:
            if self._runs:
                self._runs[-1].ended = self._runs[-1].drift(self.window)
            self._serial += 1
            self._runs.append(_Run(key, self.window))
        self._runs[-1].add(float(seconds), self.window)
        self._factors.clear()
        return self._serial

    def since(self, serial: int) -> float:
        """The product of the drifts of the kept runs after run ``serial``: all of them for a run before
        them (or 0, a time whose run is not known); 1 for the run going on."""
        if serial not in self._factors:
            factor, number = 1.0, self._serial
            for run in reversed(self._runs):
                if number <= serial:
                    break
                factor *= run.drift(self.window)
                number -= 1
            self._factors[serial] = factor
        return self._factors[serial]

    def state_dict(self) -> dict[str, Any]:
        runs = [[*run.key, run.kept, list(run.first), list(run.last)] for run in self._runs]
        return {"serial": self._serial, "runs": runs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._runs.clear()
        self._factors.clear()
        self._serial = int(state["serial"])
        for m, g, w, kept, first, last in state["runs"]:  # beyond RUNS_KEPT the oldest drop out
            run = _Run((int(m), int(g), int(w)), self.window)
            run.kept, run.first = int(kept), [float(t) for t in first]
            run.last.extend(float(t) for t in last)
            if self._runs:
                self._runs[-1].ended = self._runs[-1].drift(self.window)
            self._runs.append(run)

"""StepSync's order of results: what is queued is summed once, and callbacks run oldest first, whether
the all-reduce is waited for at once (``reduce``) or issued early and completed later (``reduce_later``).

One process (no process group: the sums are the values themselves); the collectives themselves are
counted over two gloo ranks in ``test_step_collectives.py``.
"""

from __future__ import annotations

import torch

from ds_adabatch.runtime.core.sync import StepSync


def _recorder(log: list, name: str):
    return lambda sums: log.append((name, [float(v) for v in sums]))


def test_reduce_later_runs_its_callbacks_only_when_completed():
    sync = StepSync("cpu")
    log: list = []
    sync.defer([1.0, torch.tensor(2.0)], _recorder(log, "noise"))
    sync.defer([3.0], _recorder(log, "loss"))
    sync.reduce_later()
    assert log == [] and sync.pending, "an all-reduce issued without waiting must not report yet"
    assert sync.collectives == 1
    sync.complete()
    assert log == [("noise", [1.0, 2.0]), ("loss", [3.0])]
    assert not sync.pending
    sync.complete()  # nothing in flight: nothing happens
    assert len(log) == 2 and sync.collectives == 1


def test_reduce_completes_what_is_in_flight_first_and_keeps_the_order():
    sync = StepSync("cpu")
    log: list = []
    sync.defer([1.0], _recorder(log, "step 1"))
    sync.reduce_later()
    sync.defer([2.0], _recorder(log, "step 2"))
    out = sync.reduce([5.0, 6.0])
    assert [float(v) for v in out] == [5.0, 6.0]
    assert [name for name, _ in log] == ["step 1", "step 2"]
    assert sync.collectives == 2


def test_reduce_later_with_nothing_queued_issues_nothing_but_completes():
    sync = StepSync("cpu")
    log: list = []
    sync.defer([1.0], _recorder(log, "a"))
    sync.reduce_later()
    sync.reduce_later()  # completes the first, has nothing new to issue
    assert log == [("a", [1.0])] and sync.collectives == 1 and not sync.pending


def test_values_are_copied_when_the_all_reduce_is_issued():
    sync = StepSync("cpu")
    log: list = []
    t = torch.tensor(4.0)
    sync.defer([t], _recorder(log, "a"))
    sync.reduce_later()
    t.zero_()  # the next step reuses the tensor before this one is completed
    sync.complete()
    assert log == [("a", [4.0])]

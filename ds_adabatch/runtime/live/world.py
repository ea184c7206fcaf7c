"""The generations of a live-elastic job's world: heartbeats, survivor agreement, the new group.

Why (torch 2.13, DeepSpeed 0.19.8, gloo or NCCL). Under torchrun with one agent per node and the c10d
rendezvous, a node's loss leaves the other nodes' workers running: their next collective fails
("Connection reset by peer"), or times out where the pending operation waits on another survivor.
This module re-forms the world among the survivors **in the same processes**, on the store torchrun's
agent hosts for the workers (the one :mod:`.process_group` forms generation 0 in), under a prefix per
generation::

    <namespace>/live<n>/gen<g>/group/...   the default group of generation g (g >= 1)
    <namespace>/live<n>/hb/<origin>   a counter each process adds to every heartbeat_period_s
    <namespace>/live<n>/gen<g>/join/<origin>, .../members   the agreement on generation g

    <namespace>/live<n>/gen<g>/ports/<origin>   the TCP ports its gloo groups listen on

(``n`` counts the live engines built in this process: a second engine's generation g must not read the
addresses a first one's generation g left in the store.)

Detection. A lost node's peers usually see "Connection reset by peer" in the collective they were in;
the first to see it cuts its own connections of the failed generation (:mod:`.live_sockets`), so every
survivor blocked on *it* fails at once too. A node that goes silent without closing its sockets (power,
network, a hung or stopped process) is caught by the watchdog in the heartbeat thread: once a step has
run past ``max(dead_after_s, 2 x the typical step)``, it reads the members' heartbeat counters, and one
that has not moved for ``dead_after_s`` breaks the generation's collectives (gloo: the cut; NCCL: the
groups aborted), which sends every survivor to the agreement. The collective timeout bounds what
neither catches.

``origin`` is a process's rank in generation 0; members are listed by origin. The agreement: every
survivor writes its ``join`` key; a member that has not joined counts as lost once its heartbeat counter
has not moved for ``dead_after_s`` (counters, not clocks: nodes' clocks may differ); once every member
has joined or is lost, the lowest survivor proposes the member list with a compare-and-set, and everyone
adopts whatever the key holds (so two survivors with different views still agree). A process left out
(it was too slow, e.g. stopped) raises :class:`LeftOut` and must exit.

DeepSpeed runs its data-parallel collectives on its world group (``deepspeed.utils.groups``), a clone of the
world that ``_clone_world_group`` makes with ``dist.new_group(ranks)`` and no timeout, i.e. torch's
default (30 minutes for gloo) whatever the default group has; :meth:`LiveWorld.seed_deepspeed_group`
fills that cache with a clone that has the configured timeout, so a hung peer is bounded.

The configured timeout takes effect once the first training step is done (:meth:`LiveWorld.arm`). Until
then the groups of generation 0 (the default group, formed before the config was read; DeepSpeed's clone;
the snapshots' group) and the store keep DeepSpeed's process-group timeout (``DEEPSPEED_TIMEOUT`` minutes,
10 by default; the configured one where it is longer): the ranks reach the engine's build and what a
script does before its first step (loading a checkpoint, building an op on one rank) and their first
step's one-off work minutes apart, where no snapshot exists yet to go on from, and a short timeout there
would only fail a healthy start.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from deepspeed.constants import default_pg_timeout

from .. import deepspeed_internals as internals
from ..distributed.process_group import RestartSafeNamespace
from .sockets import cut_connections, listening_ports

__all__ = ["LeftOut", "LiveWorld", "StoreLost", "teardown_process_groups"]

logger = logging.getLogger("ds_adabatch")


_worlds_made = 0


class LeftOut(RuntimeError):
    """This process was not admitted to the survivors' new world (it was too slow to join)."""


class StoreLost(RuntimeError):
    """The launcher's store cannot be reached: the node hosting it is lost (take the restart path)."""


class _Heartbeat:
    """A thread that adds 1 to ``key`` every ``period`` seconds, on a store client of its own, and then
    calls ``watch(store)`` (the watchdog)."""

    def __init__(
        self,
        namespace: RestartSafeNamespace,
        key: str,
        period: float,
        watch: Callable[[torch.distributed.Store], None] | None = None,
    ) -> None:
        self._namespace, self._key, self._period, self._watch = namespace, key, period, watch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_adabatch-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = self._namespace.client(timedelta(seconds=max(5.0, 10 * self._period)))
        except Exception:  # noqa: BLE001 - the store is gone: the agreement will say so
            return
        while not self._stop.is_set():
            # A missed beat is harmless; the store's host may be lost (the agreement says so).
            with contextlib.suppress(Exception):
                store.add(self._key, 1)
            if self._watch is not None:
                try:
                    self._watch(store)
                except Exception as err:  # noqa: BLE001 - the watchdog must never end the heartbeat
                    logger.debug("live watchdog: %s", err)
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()


def _silent(
    seen: dict[int, tuple[int, float]], counts: dict[int, int], now: float, dead_after: float
) -> list[int]:
    """Record each process's heartbeat ``counts`` in ``seen`` (count, when it last moved); return those
    whose count has not moved for ``dead_after`` seconds."""
    silent = []
    for r, count in counts.items():
        last = seen.get(r)
        if last is None or last[0] != count:
            seen[r] = (count, now)
        elif now - last[1] >= dead_after:
            silent.append(r)
    return silent


class LiveWorld:
    """This process's view of the live-elastic world (see the module docstring).

    Args:
        namespace: where generation 0 was formed (:func:`.process_group.restart_safe_namespace`).
        backend: of the default group (``"gloo"``, ``"nccl"``).
        timeout: of every collective of every group formed here, once the first step is done (:meth:`arm`).
        heartbeat_period, dead_after, agree_timeout: seconds (``adabatch.live_elastic``).
    """

    def __init__(
        self,
        namespace: RestartSafeNamespace,
        *,
        backend: str,
        timeout: timedelta,
        heartbeat_period: float,
        dead_after: float,
        agree_timeout: float,
    ) -> None:
        dist = torch.distributed
        self.namespace = namespace
        self.backend = backend
        self.configured_timeout = timeout
        self.startup_timeout = max(timeout, default_pg_timeout)
        self._armed = False
        self._startup_groups: list[Any] = []
        self.dead_after = dead_after
        self.agree_timeout = agree_timeout
        self.origin = dist.get_rank()
        self.members: list[int] = list(range(dist.get_world_size()))
        self.generation = 0
        self.store = namespace.client(self.startup_timeout)
        # Where rank 0 of this incarnation hosts the workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
        # the server lives in the default group's store object: keep it when that group is destroyed.
        self._default_store = torch.distributed.distributed_c10d._get_default_store()
        # Keys of each engine built in this process apart (every rank builds the same engines in order).
        global _worlds_made
        _worlds_made += 1
        self._live = f"{namespace.prefix}/live{_worlds_made}"
        self.job_id = self._job_id()
        self.incarnation = self._incarnation()
        # The watchdog's view (written by the main thread, read by the heartbeat thread).
        self._step_began: float | None = None
        self._step_times: deque[float] = deque(maxlen=8)
        self._watched: dict[int, tuple[int, float]] = {}
        self._ports: tuple[set[int], set[int]] = (set(), set())
        self.broken_by_watchdog: str | None = None
        # One cut at a time: the main thread's, after a failed step, returns only once a cut the
        # watchdog (or any other thread) started is done, before the failed world is torn down.
        self._cutting = threading.Lock()
        self._heartbeat = _Heartbeat(
            namespace, f"{self._live}/hb/{self.origin}", heartbeat_period, watch=self._watch
        )

    # ---------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self.members.index(self.origin)

    @property
    def size(self) -> int:
        return len(self.members)

    def _job_id(self) -> str:
        """The job's id, torchrun's ``--rdzv-id``: snapshots are filed under it, so the workers that
        torchrun restarts (a node joining, the restart path) find them, and a launch with another id
        never does."""
        return os.environ.get("TORCHELASTIC_RUN_ID", "none")

    def _incarnation(self) -> str:
        """An id of this incarnation of the workers, agreed through the store (rank 0 draws it)."""
        key = f"{self._live}/incarnation"
        if self.origin == 0:
            self.store.set(key, uuid.uuid4().hex)
        return self.store.get(key).decode()

    @property
    def timeout(self) -> timedelta:
        """The timeout of the groups formed now: the configured one once :meth:`arm` ran, the startup
        one before (module docstring)."""
        return self.configured_timeout if self._armed else self.startup_timeout

    def new_group(self, backend: str | None = None) -> Any:
        """A group of the whole current world with :attr:`timeout` (armed with the rest if formed before
        the first step). Every member calls it at the same point."""
        group = torch.distributed.new_group(
            ranks=list(range(self.size)), timeout=self.timeout, backend=backend
        )
        if not self._armed:
            self._startup_groups.append(group)
        return group

    def arm(self) -> None:
        """From now on (the first training step is done) every group of this world and the store time
        out after the configured timeout. Generation 0's default group was formed before this config was
        read, and ds_adabatch's own collectives run on it (a step's loss): a wait there that the cut does
        not end (seen: a gloo all-reduce of the process that cut its own connections) would outlast the
        agreement; bounded as every later generation. Idempotent."""
        if self._armed:
            return
        self._armed = True
        # torch's private distributed_c10d._set_pg_timeout (read in 2.13.0; tests/test_torch_compat.py).
        for group in [None, *self._startup_groups]:
            torch.distributed.distributed_c10d._set_pg_timeout(self.configured_timeout, group)
        self._startup_groups.clear()
        self.store.set_timeout(self.configured_timeout)

    def seed_deepspeed_group(self) -> None:
        """Put a world clone with our timeout where DeepSpeed looks for its data-parallel group."""
        # DeepSpeed otherwise makes its clone with torch's default timeout (30 minutes on gloo), which
        # would let a hung peer stall the survivors for that long.
        internals.seed_world_group(self.new_group())

    # ---------------------------------------------------------------------------------------------
    def agree_on_survivors(self) -> tuple[list[int], list[int]]:
        """Agree with the other survivors on the next generation's members; returns (members, lost).

        Raises :class:`LeftOut` when the others formed it without this process, :class:`StoreLost`
        when the store cannot be reached, TimeoutError past ``agree_timeout``.
        """
        g = self.generation + 1
        base = f"{self._live}/gen{g}"
        old = list(self.members)
        deadline = time.monotonic() + self.agree_timeout
        try:
            self.store.set(f"{base}/join/{self.origin}", b"1")
            beats = {r: (self._beat(r), time.monotonic()) for r in old if r != self.origin}
            members_key = f"{base}/members"
            while True:
                if self.store.check([members_key]):
                    break
                joined = [r for r in old if self.store.check([f"{base}/join/{r}"])]
                counts = {r: self._beat(r) for r in old if r not in joined}
                now = time.monotonic()
                lost = _silent(beats, counts, now, self.dead_after)
                if len(joined) + len(lost) == len(old):
                    if self.origin == min(joined):
                        self.store.compare_set(members_key, "", ",".join(map(str, joined)))
                    break
                if now > deadline:
                    raise TimeoutError(
                        f"the survivors did not agree on generation {g} within {self.agree_timeout:g} s "
                        "(adabatch.live_elastic.agree_timeout_s)"
                    )
                time.sleep(0.02)
            remaining = max(0.1, deadline - time.monotonic())
            self.store.wait([members_key], timedelta(seconds=remaining))
            members = [int(x) for x in self.store.get(members_key).decode().split(",")]
        except (TimeoutError, LeftOut):
            raise
        except Exception as err:  # noqa: BLE001 - a DistStoreError / network error: the store's host
            raise StoreLost(
                f"the launcher's store at {self.namespace.host}:{self.namespace.port}: {err}"
            ) from err
        if self.origin not in members:
            raise LeftOut(
                f"process {self.origin} was left out of generation {g} (members {members}): it was "
                "too slow to rejoin"
            )
        return members, [r for r in old if r not in members]

    def _beat(self, origin: int) -> int:
        return self.store.add(f"{self._live}/hb/{origin}", 0)

    def form(self, members: list[int]) -> None:
        """Form the next generation's default group among ``members`` (after the old one is torn down)."""
        self.generation += 1
        self.members = members
        store = torch.distributed.PrefixStore(f"{self._live}/gen{self.generation}/group/", self.store)
        torch.distributed.init_process_group(
            self.backend, store=store, rank=self.rank, world_size=self.size, timeout=self.timeout
        )
        # Ranks as the launcher would have set them for this world (DeepSpeed reads RANK/WORLD_SIZE
        # in places, e.g. its logging and its accelerator's device selection).
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.rank), str(self.size)

    # ---------------------------------------------------------------------------------------------
    def publish_ports(self) -> None:
        """Tell the members which ports this process's groups listen on, and learn theirs (once the
        generation's groups exist: every member calls this at the same point)."""
        mine = listening_ports() - {self.namespace.port}
        base = f"{self._live}/gen{self.generation}/ports"
        self.store.set(f"{base}/{self.origin}", ",".join(map(str, sorted(mine))))
        theirs: set[int] = set()
        keys = [f"{base}/{r}" for r in self.members if r != self.origin]
        if keys:
            self.store.wait(keys, self.timeout)
            for value in self.store.multi_get(keys):
                theirs.update(int(x) for x in value.decode().split(",") if x)
        self._ports = (theirs, mine)  # each side left the store's port out

    def break_connections(self) -> int:
        """Make every pending operation of this generation's groups fail now, here and in the peers
        blocked on this process (gloo: cut the connections; NCCL: abort the groups). Returns the
        number of connections cut. Safe from any thread (the watchdog's, a fault injected in a test)
        while the main thread fails and recovers: see :func:`.sockets.cut_connections`."""
        with self._cutting:
            peer_ports, own_ports = self._ports
            cut = cut_connections(peer_ports, own_ports)
            if self.backend == "nccl" and torch.distributed.is_initialized():
                with contextlib.suppress(Exception):
                    torch.distributed.distributed_c10d._abort_process_group()
        return cut

    def step_began(self) -> None:
        self._watched = {}
        self._step_began = time.monotonic()

    def step_ended(self, seconds: float | None) -> None:
        self._step_began = None
        if seconds is not None:
            self._step_times.append(seconds)

    def _watch(self, store: torch.distributed.Store) -> None:
        """The watchdog (heartbeat thread): in an overdue step, a member silent for ``dead_after_s``
        breaks this generation's collectives."""
        began = self._step_began
        if began is None:
            return
        now = time.monotonic()
        typical = sorted(self._step_times)[len(self._step_times) // 2] if self._step_times else 0.0
        if now - began < max(self.dead_after, 2 * typical):
            return
        others = [r for r in self.members if r != self.origin]
        raw = store.multi_get([f"{self._live}/hb/{r}" for r in others])
        counts = {r: int(value.decode() or 0) for r, value in zip(others, raw, strict=True)}
        silent = _silent(self._watched, counts, now, self.dead_after)
        if silent and self._step_began == began:
            self._step_began = None
            self.broken_by_watchdog = (
                f"process(es) {silent} silent for {self.dead_after:g} s (adabatch.live_elastic.dead_after_s) "
                f"in a step running {now - began:.1f} s"
            )
            cut = self.break_connections()
            logger.warning(
                "live watchdog: %s: breaking generation %d's collectives (%d connection(s) cut)",
                self.broken_by_watchdog,
                self.generation,
                cut,
            )

    def close(self) -> None:
        self._heartbeat.stop()


def teardown_process_groups(model: torch.nn.Module | None) -> None:
    """Release every process group of the failed generation, in this process.

    DeepSpeed's ``destroy_process_group`` destroys torch's groups and drops the references its
    ``groups`` module caches (0.19.8: ``_release_process_group_references``). Each parameter still
    carries the old data-parallel group and fragment map (``tensor_fragment.link_hp_params``) and the
    failed step's partial gradient: both go. The last references gone, a collection closes the old
    gloo pairs, so a peer still blocked in the old group fails at once instead of at its timeout.
    """
    import deepspeed.comm as ds_dist

    try:
        ds_dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - a broken group may fail to destroy: it is dropped anyway
        logger.debug("destroying the failed process group: %s", err)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if model is not None:
        for p in model.parameters():
            internals.drop_failed_world_refs(p)
            p.grad = None
    gc.collect()

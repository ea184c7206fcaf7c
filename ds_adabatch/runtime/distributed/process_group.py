"""Process groups that form again after ``torchrun --max-restarts`` restarts the workers.

Why (torch 2.13, DeepSpeed 0.19.8). Under torchrun the workers do not host the key-value store their
process group is formed through: ``TORCHELASTIC_USE_AGENT_STORE=True`` tells them that
``MASTER_ADDR:MASTER_PORT`` is a TCP store the elastic agent hosts (the static rendezvous: on node 0 at
``--master-port``; the c10d rendezvous: on the node whose agent is rendezvous rank 0, at a port it
picked, not the ``--rdzv-endpoint``), and that store outlives the workers. A restarted incarnation
forms its gloo group under the same keys as the one before (``torch.distributed.rendezvous``'s
``_create_c10d_store`` adds no prefix there), so a rank can read the address a dead worker published and
fail with "Gloo connectFullMesh failed ... Connection refused", or wait forever: measured, 3 of 4
restarts of a 2-rank job failed. ``TORCHELASTIC_RESTART_COUNT`` is no cure by itself: each agent
counts its own restarts, and a membership change (a node joining an elastic job) restarts the workers
without counting, so agents that joined at different times disagree on it.

The cure used here: before the group forms, the ranks of this incarnation agree on a fresh namespace
in that store (:func:`_fresh_namespace`) and the group is built on a ``PrefixStore`` of it. Rank 0 draws
a random token and publishes it; every other rank answers under that token with a random nonce of its
own and waits until rank 0 echoes the nonce back. A token read from a previous incarnation is never
echoed with this incarnation's nonce, so a rank that read one reads again until it sees the new token.
Every group created later with ``torch.distributed.new_group`` (DeepSpeed's, and the gloo group of the
out-of-memory agreement) derives its keys from the default group's store, so it is restart-safe too.

Launches where the workers' store is fresh anyway (the ``deepspeed`` launcher, torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts it) and a plain ``python`` process (a world of one)
are initialised as DeepSpeed always did.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .op_builds import guard_jit_builds

__all__ = [
    "RestartSafeNamespace",
    "init_distributed",
    "init_process_group_restart_safe",
    "restart_safe_namespace",
]

_PREFIX = "ds_adabatch/pg"


@dataclass(frozen=True)
class RestartSafeNamespace:
    """Where this incarnation's default group was formed: the store torchrun's workers share (the agent's,
    with the token agreed for this incarnation; or one rank 0 hosts for this incarnation alone, token
    empty)."""

    host: str
    port: int
    token: str

    @property
    def prefix(self) -> str:
        """The store prefix every key of this incarnation lives under (ends without a slash)."""
        return f"{_PREFIX}/{self.token}" if self.token else f"{_PREFIX}/own"

    def client(self, timeout: timedelta) -> torch.distributed.TCPStore:
        """A new client of the agent's store (one per thread that uses it)."""
        return torch.distributed.TCPStore(self.host, self.port, is_master=False, timeout=timeout)


_namespace: RestartSafeNamespace | None = None


def restart_safe_namespace() -> RestartSafeNamespace | None:
    """The store and namespace of this process's default group under torchrun (set by
    :func:`init_distributed`); None when the group was formed another way (another launcher, the user,
    a world of one)."""
    return _namespace


_shm_name_removed = False


def cpu_shm_buffer_name() -> str:
    """The ``/dev/shm`` name of this rank's buffer of DeepSpeed's CPU all-reduce (DeepSpeed 0.19.8
    ``shm_initialize`` in ``csrc/cpu/comm/shm.cpp``: uid, ``MASTER_ADDR``, ``MASTER_PORT``, global rank)."""
    return "_".join(
        (
            "/dev/shm/deepspeed_allreduce_buffer",
            str(os.getuid()),
            os.environ.get("MASTER_ADDR", ""),
            os.environ.get("MASTER_PORT", ""),
            str(torch.distributed.get_rank()),
        )
    )


def _unlink_cpu_shm_buffer() -> None:
    """Remove the name of this rank's buffer of DeepSpeed's CPU all-reduce, which nothing else does.

    DeepSpeed 0.19.8 (CPU accelerator, every rank on one machine: ``LOCAL_SIZE`` = world size) gives
    each rank a 66 MB file ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
    that its peers map once, while DeepSpeed's communication layer starts (``TorchBackend.__init__``, in
    ``deepspeed.init_distributed()``, whoever calls it); no exit removes it, so every launch left 66 MB per
    rank of host memory behind (a day of test runs filled a 24 GB machine). Once every rank has mapped
    its peers' (the barrier), the names are not needed: the mappings outlive them, and nothing is left
    behind even when a process is killed. Once per process: the ranks call it alike, so the barrier is
    reached by all or none.
    """
    global _shm_name_removed
    import deepspeed.comm.comm as ds_comm

    cdb = getattr(ds_comm, "cdb", None)
    size = torch.distributed.get_world_size()
    if (
        _shm_name_removed
        or getattr(cdb, "shm_comm_op", None) is None
        or os.environ.get("LOCAL_SIZE") != str(size)
    ):
        return  # the same on every rank: the barrier below is reached by all or none
    torch.distributed.barrier()
    _shm_name_removed = True
    with contextlib.suppress(OSError):
        os.remove(cpu_shm_buffer_name())


def init_distributed(dist_backend: str | None = None, *, timeout: timedelta | None = None) -> None:
    """Initialise ``torch.distributed`` and DeepSpeed's communication layer, restart-safe under torchrun.

    ``ds_adabatch.initialize`` calls it; call it yourself in place of ``deepspeed.init_distributed()``
    when your script needs the process group before that. Under a torchrun whose agent hosts the
    workers' store (the default) every incarnation forms its group in a namespace of its own, so
    ``torchrun --max-restarts`` restarts (and elastic membership changes) form a working group;
    elsewhere it is ``deepspeed.init_distributed()``. Without a launcher (``python train.py``) it makes a
    world of one. When ``torch.distributed`` is already initialised (by the script, or by
    ``deepspeed.init_distributed()``) it only completes DeepSpeed's layer and removes the ``/dev/shm``
    name of DeepSpeed's CPU all-reduce buffer (see below). Call it on every rank.

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``, ...; None: the DeepSpeed accelerator's backend.
        timeout: of the process group's operations; None: DeepSpeed's default (``DEEPSPEED_TIMEOUT``
            minutes, 10 unless set).
    """
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout

    timeout = timeout or default_pg_timeout
    guard_jit_builds()  # DeepSpeed's CPU backend loads a JIT-built op while the group forms
    if torch.distributed.is_initialized():
        if not ds_dist.is_initialized():
            deepspeed.init_distributed(dist_backend=dist_backend, timeout=timeout)
        # Also when the script called deepspeed.init_distributed() itself: its buffer name goes here.
        _unlink_cpu_shm_buffer()
        return
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # A plain `python train.py` (no launcher) is a world of one; without these variables
        # DeepSpeed would try MPI discovery.
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = dist_backend or get_accelerator().communication_backend_name()
    init_process_group_restart_safe(
        backend, timeout, **_device_binding(int(os.environ.get("WORLD_SIZE", "1")))
    )
    # With torch.distributed initialised, DeepSpeed 0.19.8's init_distributed only wraps the group
    # (comm.init_distributed: "The user initialized torch.dist themselves"); otherwise it forms it.
    deepspeed.init_distributed(dist_backend=dist_backend, timeout=timeout)
    _unlink_cpu_shm_buffer()
    global _namespace
    if _namespace is None and "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_PORT" in os.environ:
        # torchrun with a workers' store of this incarnation's own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
        # rank 0 hosts it): fresh for every incarnation, so no token is needed.
        _namespace = RestartSafeNamespace(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), "")


def init_process_group_restart_safe(backend: str, timeout: timedelta, **kwargs: Any) -> bool:
    """``torch.distributed.init_process_group`` in a fresh namespace of the agent's store when torchrun's
    agent hosts the workers' store (see above); returns False, initialising nothing, otherwise. Reads
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``kwargs`` go to ``init_process_group``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    namespace = _fresh_namespace(base, rank, world, timeout)
    store = torch.distributed.PrefixStore(f"{_PREFIX}/{namespace}/", base)
    torch.distributed.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )
    global _namespace
    _namespace = RestartSafeNamespace(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), namespace)
    return True


def _fresh_namespace(store: torch.distributed.Store, rank: int, world: int, timeout: timedelta) -> str:
    """A token every rank of this incarnation agrees on and no earlier incarnation used (see above)."""
    leader = f"{_PREFIX}/leader"
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(leader, token)
        joins = [f"{_PREFIX}/{token}/join/{r}" for r in range(1, world)]
        if joins:
            # Keys under a token drawn just now can only be this incarnation's: waiting is safe.
            store.wait(joins, timeout)
            store.multi_set([f"{_PREFIX}/{token}/ack/{r}" for r in range(1, world)], store.multi_get(joins))
        return token
    nonce = uuid.uuid4().hex.encode()
    deadline = time.monotonic() + timeout.total_seconds()
    joined = None
    while time.monotonic() < deadline:
        token = store.get(leader).decode()  # blocks until the first incarnation's rank 0 wrote it
        ack = f"{_PREFIX}/{token}/ack/{rank}"
        if token != joined:
            store.set(f"{_PREFIX}/{token}/join/{rank}", nonce)
            joined = token
        try:
            store.wait([ack], timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - a store timeout (DistStoreError): read the token again
            continue
        if store.get(ack) == nonce:
            return token
        # An echo of another nonce: a previous incarnation's token. This one's rank 0 replaces it.
        time.sleep(0.05)
    raise RuntimeError(
        f"rank {rank}: rank 0 of this launch did not publish its process-group namespace in the store at "
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout}; check that "
        "every rank was started by the same launch (raise DEEPSPEED_TIMEOUT, in minutes, if rank 0 is slow "
        "to start)"
    )


def _device_binding(world: int) -> dict[str, Any]:
    """``device_id`` as DeepSpeed 0.19.8 passes it (``TorchBackend.init_process_group``): CUDA only, not
    for a world of one, not on torch 2.6.0 < v < 2.7.1 (a hang there)."""
    import inspect

    from deepspeed.accelerator import get_accelerator
    from packaging import version

    if world == 1 or get_accelerator().device_name() != "cuda":
        return {}
    if "device_id" not in inspect.signature(torch.distributed.init_process_group).parameters:
        return {}
    if version.parse("2.6.0") < version.parse(torch.__version__) < version.parse("2.7.1"):
        return {}
    return {"device_id": get_accelerator().device(int(os.environ.get("LOCAL_RANK", 0)))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

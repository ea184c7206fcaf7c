"""Breaking a failed generation's gloo connections, so no survivor waits on them (Linux).

Why: a gloo operation blocked on a peer returns only when that peer's socket closes or the group's
timeout passes, and neither ``abort()`` nor ``shutdown()`` of a torch 2.13 ``ProcessGroupGloo`` wakes
it. Where a survivor detects the loss first and re-forms, another survivor may be blocked on *it*
(not on the lost node) until the timeout: seen with a GPT-2 job, 20 s instead of milliseconds. Each
process therefore publishes the ports its gloo groups listen on, and a ``shutdown(2)`` of every TCP
connection of this process to one of those ports (or accepted on one of its own) wakes every pending
gloo operation on both ends at once. Connections to anything else (the launcher's store, a logger's
service) are left alone.

The process's sockets are found through ``/proc/self/fd`` and ``/proc/self/net/tcp{,6}``; elsewhere
:func:`listening_ports` is empty and :func:`cut_connections` cuts nothing (the timeouts still bound
every wait).
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["cut_connections", "listening_ports"]

_LISTEN, _ESTABLISHED = "0A", "01"


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for this network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def _own_sockets() -> dict[int, int]:
    """inode -> fd of this process's sockets."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                found[int(target[len("socket:[") : -1])] = int(fd)
    return found


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (its gloo groups' listeners among them)."""
    table = _tcp_table()
    return {table[i][0] for i in _own_sockets() if i in table and table[i][2] == _LISTEN}


def cut_connections(peer_ports: set[int], own_ports: set[int]) -> int:
    """Shut down this process's established TCP connections to any of ``peer_ports`` or accepted on
    any of ``own_ports``; returns how many. ``shutdown`` (not ``close``) so the descriptors stay
    valid for the threads that use them: their pending reads and writes fail at once.

    The sockets are listed first and shut down after: in between, a descriptor may be closed (the first
    cut fails the step, the failed world is torn down) and its number reused by another socket, e.g. a
    listener of the next generation's group. Each is therefore shut down through a duplicate that is
    checked to be the very socket listed (its inode), never by its number alone."""
    table = _tcp_table()
    cut = 0
    for inode, fd in _own_sockets().items():
        entry = table.get(inode)
        if entry is None or entry[2] != _ESTABLISHED:
            continue
        local, remote, _ = entry
        if remote not in peer_ports and local not in own_ports:
            continue
        cut += _shutdown_if_same(fd, inode)
    return cut


def _shutdown_if_same(fd: int, inode: int) -> int:
    """Shut down the socket at ``fd`` if it still is the socket ``inode``; returns 1 if it was."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed since it was listed
        return 0
    try:
        # The duplicate holds the socket open: what it refers to cannot change under the check.
        if os.fstat(dup).st_ino != inode:
            return 0
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return 0
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.close()

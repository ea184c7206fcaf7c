"""Breaking a generation's gloo connections (``runtime/live/sockets.py``), with two real processes.

A gloo operation blocked on a peer wakes only when that peer's socket closes (torch 2.13's
``ProcessGroupGloo.abort()`` does not wake it): cutting the connections must wake it within
milliseconds, whether the peer cuts (the first survivor to see a loss) or another thread of the
blocked process does (the watchdog), and must leave the launcher's store and every other connection
of the process working.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "live_sockets_worker.py"

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/net/tcp"), reason="needs Linux's /proc/self/net/tcp"
)


def _echo_service() -> tuple[socket.socket, int]:
    """A stand-in for a logger's service: echoes what each connection sends."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: c.sendall(c.recv(4)), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.parametrize("mode", ["peer", "self"])
def test_cut_wakes_a_blocked_collective_and_spares_the_rest(tmp_path, mode):
    # Hosted here, as torchrun's agent hosts it: the workers are its clients.
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    server, service_port = _echo_service()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), mode, str(store.port), str(service_port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        server.close()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    cutter = r1 if mode == "peer" else r0
    assert cutter["cut"] >= 1
    assert r0["raised"] is not None and "closed" in r0["raised"].lower(), r0
    assert r0["peer_failure"] is True, r0
    # Blocked for the 0.5 s before the cut, not for the group's 30 s timeout.
    assert r0["blocked_s"] < 5.0, r0
    for r in (r0, r1):
        assert r["listening"], "the gloo group's listener was not found among the process's sockets"
        assert r["store_after"] and r["service_after"] == "ping"


def test_a_cut_spares_a_socket_that_took_a_listed_connections_number(monkeypatch):
    """The cutting thread (the watchdog's) lists the sockets, then shuts them down one by one; the first
    cut fails the main thread's step, which may tear the world down and open the next generation's
    sockets before the rest are shut down. A listed connection's descriptor number, closed and reused
    by a new listener meanwhile, must not get the new listener shut down (gloo aborts the process:
    ``accept: Invalid argument``); a listed connection still open is cut."""
    from ds_adabatch.runtime.live import sockets

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    closed_later = socket.create_connection(("127.0.0.1", port))
    still_open = socket.create_connection(("127.0.0.1", port))
    accepted = [server.accept()[0] for _ in range(2)]
    table, listed = sockets._tcp_table(), sockets._own_sockets()  # the cutter's listing
    number = closed_later.fileno()
    assert number in listed.values() and still_open.fileno() in listed.values()
    closed_later.close()
    reused = socket.create_server(("127.0.0.1", 0))  # usually given the lowest free number: that one
    if reused.fileno() != number:
        os.dup2(reused.fileno(), number)
        reused.close()
        reused = socket.socket(fileno=number)
    # The cutter resumes with what it listed.
    monkeypatch.setattr(sockets, "_tcp_table", lambda: table)
    monkeypatch.setattr(sockets, "_own_sockets", lambda: listed)
    try:
        assert sockets.cut_connections({port}, set()) == 1
        still_open.settimeout(5)
        assert still_open.recv(1) == b""  # shut down: reads end at once
        reused.settimeout(5)
        with socket.create_connection(reused.getsockname()) as client:
            conn, _ = reused.accept()  # the listener still accepts
            conn.close()
            assert client is not None
    finally:
        for s in (reused, still_open, server, *accepted):
            s.close()

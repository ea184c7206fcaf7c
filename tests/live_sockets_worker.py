"""Two gloo processes for tests/test_live_sockets.py: one blocked in an all-reduce the other never joins.

    python live_sockets_worker.py RANK MODE STORE_PORT SERVICE_PORT OUT

MODE ``peer``: rank 1 cuts its connections (publishing its ports like ``LiveWorld`` does) while rank 0
waits on it. MODE ``self``: a thread of rank 0 cuts rank 0's own connections while its main thread
waits. Each rank also holds a connection to SERVICE_PORT (a stand-in for a logger's service) that must
survive, and the store (hosted by the test) must keep working. Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_adabatch.runtime.live.recovery import is_peer_failure  # noqa: E402
from ds_adabatch.runtime.live.sockets import cut_connections, listening_ports  # noqa: E402


def main(rank: int, mode: str, store_port: int, service_port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    service = socket.create_connection(("127.0.0.1", service_port))
    t = torch.ones(64)
    dist.all_reduce(t)
    mine = listening_ports() - {store_port}
    store.set(f"ports{rank}", ",".join(map(str, sorted(mine))))
    peer = {int(x) for x in store.get(f"ports{1 - rank}").decode().split(",") if x}
    result: dict = {"listening": sorted(mine)}
    cutter = None
    if rank == 1:
        if mode == "peer":
            time.sleep(0.5)
            result["cut"] = cut_connections(peer, mine)
        store.wait(["done0"], timedelta(seconds=30))
    else:
        if mode == "self":

            def cut() -> None:
                time.sleep(0.5)
                result["cut"] = cut_connections(peer, mine)

            cutter = threading.Thread(target=cut, daemon=True)
            cutter.start()
        started = time.monotonic()
        try:
            dist.all_reduce(t)  # rank 1 never joins
            result["raised"] = None
        except RuntimeError as err:
            result["raised"] = str(err)
            # Told from a user's error by where it was raised (inside torch.distributed), not its words.
            result["peer_failure"] = is_peer_failure(err)
        result["blocked_s"] = time.monotonic() - started
        if cutter is not None:
            # The all-reduce wakes as the first socket closes, before the cut has counted them all.
            cutter.join(timeout=30)
        store.set("done0", b"1")
    # What must survive the cut: the store, and a connection to something else.
    result["store_after"] = store.get(f"ports{1 - rank}").decode()
    service.sendall(b"ping")
    result["service_after"] = service.recv(4).decode()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the group is broken: no clean destroy


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

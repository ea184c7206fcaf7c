"""Live elasticity on a network-namespace cluster: a lost node costs the survivors seconds, no sample and
no restart (``adabatch.live_elastic``; tests/live_worker.py is the job).

Three nodes (namespaces) x one or two ranks, each node its own ``ds-adabatch-run`` agent (run here as
``python -m ds_adabatch.launch``: torchrun, c10d rendezvous, ``--nnodes 1:N`` for the job's N nodes)
and its own snapshot folder (its "host memory"). A node kills itself (agent and worker, SIGKILL; or SIGSTOP: hung) a few
milliseconds into a step chosen from a seed. Checked for every job:

- the survivors are the processes that started (no worker restarted), and they end on the smaller world;
- the trajectory (the last record of every step) trains every sample of the run once, the samples of
  each step those of an uninterrupted one-process run, and the final parameters equal that run's
  (fp32, 1e-5 relative): the rollback and the re-done steps lose and repeat nothing;
- at most one step is trained again.

Launch 1 runs seven jobs side by side: ZeRO 1 on two nodes x two ranks loses a node (two ranks); ZeRO 3,
two nodes x two ranks, loses a node (its partitioned model made whole from the snapshots and partitioned
again over the two survivors); ZeRO 0
has node 2 hang (its sockets stay open: the watchdog must catch it, long before the collective
timeout); ZeRO 2 loses nodes 1 and 2 at once (node 2's partition and its only copy, on node 1), so the
survivor takes the restart path and resumes from the last complete checkpoint, still exact; ZeRO 1
loses node 0, the store's host: the launch ends in seconds, and launched again on nodes 1 and 2 the
job restores from their host memory; on one node x two ranks, ZeRO 2, a worker crashes: torchrun
restarts both, and they restore from the node's host memory; the ``goodput`` schedule on a simulated
step-time curve, ZeRO 2, loses node 2 and goes on deciding on the survivors, its throughput model right on
the smaller world (checked exact against one process replaying its batches). Launch 2: ZeRO 2 loses node 2, then node 2 comes back: torchrun
restarts every worker, they restore from the survivors' host memory (no checkpoint, no step redone)
and finish on three ranks.

Needs root and iproute2's ``ip``; skipped with the reason otherwise (CI runs as root and installs ``ip``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cluster_checks import (
    check_exact,
    ends,
    load_reference,
    netns_cluster,
    read_ledger,
    starts,
    trajectory,
    wait_processes,
    why_no_netns,
)

from ds_adabatch.signals import ThroughputModel, parse_step_time_curve

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "live_worker.py"

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.slow,
    pytest.mark.skipif(why_no_netns() is not None, reason=why_no_netns() or ""),
]


def kill_point(seed: int) -> str:
    """``STEP:DELAY_MS`` for a seed: a step of the ramp (not one that saves a checkpoint), 0-8 ms in."""
    rng = random.Random(seed)
    step = rng.choice([5, 6, 7, 9, 10])
    return f"{step}:{rng.uniform(0, 8):.1f}"


def launch_job(
    cluster,
    k: int,
    out: Path,
    stage: int,
    port: int,
    log: str,
    env: dict,
    nproc: int = 1,
    host: int = 0,
    nodes: int = 3,
) -> subprocess.Popen:
    """Node ``k``'s agent of the job writing to ``out`` (``nproc`` ranks; node ``host`` hosts the
    launcher's store; at most ``nodes`` nodes: a round that has them all closes at once)."""
    # A round closes `last_call_timeout` after its first nodes joined, and a node whose keep-alive is
    # late `keep_alive_max_attempt` times is taken as gone: on 2 loaded cores (every job's agents and
    # workers starting at once, DeepSpeed building its ops) a node joined a first round after 8 s, and
    # the run went on without it; so the first round waits long enough for every node.
    conf = "join_timeout=120,last_call_timeout=30,keep_alive_interval=1,keep_alive_max_attempt=10"
    launcher = ["-m", "ds_adabatch.launch", "--exit-barrier-timeout", "5"]
    launcher += [
        "--nnodes",
        f"1:{nodes}",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
    ]
    launcher += [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{cluster.addr(host)}:{port}",
        "--rdzv-id",
        out.name,
    ]
    # The nodes share the host's hostname: each is told its own address (torchrun infers it on a cluster).
    launcher += [
        "--local-addr",
        cluster.addr(k),
        "--rdzv-conf",
        f"{conf},is_host={'true' if k == host else 'false'}",
    ]
    node_env = {"DS_ADABATCH_SNAPSHOT_DIR": str(out / f"shm{k}"), **env}
    return cluster.launch(k, launcher, ["run", str(out), str(stage)], out / log, env=node_env)


def kill_time(out: Path) -> float:
    return float((out / "kill-time").read_text().split()[0])


def check_survived_in_place(out: Path, world: int = 3, lost: int = 1) -> dict:
    """Nobody restarted: the processes that ended are those that started, minus the lost node's."""
    started, ended = starts(out), ends(out)
    assert len(started) == world, f"a worker was restarted: {started}"
    assert {e["pid"] for e in ended} <= {s["pid"] for s in started}
    assert sorted(e["origin"] for e in ended) == list(range(world - lost))
    for e in ended:
        assert e["world_size"] == world - lost and e["live_elastic"] == "on"
        assert len(e["events"]) == 1 and e["events"][0]["lost"] == list(range(world - lost, world))
        assert e["events"][0]["steps_redone"] <= 1
        assert any(h.startswith("shrink: lost") for h in e["history"])
    # The script's optimizer, LR scheduler and loader (initialize's) kept working across the shrink.
    rows = read_ledger(out / "ledger.jsonl")
    assert rows and all(r["handles_ok"] for r in rows), [r for r in rows if not r["handles_ok"]][:2]
    return next(e for e in ended if e["origin"] == 0)["events"][0]


@pytest.fixture(scope="module")
def cluster():
    with netns_cluster(3, JOB, tag="l") as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same job uninterrupted in one process, ZeRO 0, 1, 2 and 3 (one launch)."""
    out = tmp_path_factory.mktemp("live_reference")
    return one_process(out, "reference", -1, (0, 1, 2, 3))


def one_process(out: Path, mode: str, stage: int, stages: tuple[int, ...]) -> dict:
    """``live_worker.py MODE OUT STAGE`` in one process (-1: every stage), and the reference it wrote."""
    proc = subprocess.run(
        [sys.executable, str(JOB), mode, str(out), str(stage)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return load_reference(out, stages)


GOODPUT_CURVE = "fixed=0.02,per_sample=0.002"
# name: (ZeRO stage, rendezvous port, ranks per node, nodes, environment)
JOBS = {
    # Two nodes x two ranks: node 1 (ranks 2 and 3) lost; their copies are on node 0.
    "z1x2": (1, 29712, 2, 2, {"LIVE_KILL": f"2:{kill_point(2)}", "LIVE_KILL_ALSO": "3", "LIVE_UNEVEN": "1"}),
    # ZeRO 3, two nodes x two ranks, node 1 lost: the partitions of 4 ranks re-partitioned over 2.
    "z3x2": (3, 29718, 2, 2, {"LIVE_KILL": f"2:{kill_point(8)}", "LIVE_KILL_ALSO": "3", "LIVE_UNEVEN": "1"}),
    "both": (2, 29713, 1, 3, {"LIVE_KILL": f"2:{kill_point(3)}", "LIVE_KILL_ALSO": "1"}),
    # ZeRO 0, node 2 hangs (SIGSTOP: its sockets stay open, nothing resets): the watchdog catches it.
    "hung": (0, 29714, 1, 3, {"LIVE_KILL": f"2:{kill_point(5)}", "LIVE_KILL_SIGNAL": "STOP"}),
    # Node 0 (the store's host) lost: the job ends; nodes 1 and 2 launched again restore from their
    # host memory (node 0's partition has its copy on node 2).
    "store": (1, 29715, 1, 3, {"LIVE_KILL": f"0:{kill_point(6)}"}),
    # One node x two ranks, ZeRO 2: rank 1's worker crashes (its node is healthy): torchrun restarts
    # both workers, which restore from the node's host memory.
    "crash": (2, 29717, 2, 1, {"LIVE_KILL": f"1:{kill_point(7)}", "LIVE_KILL_WHAT": "worker"}),
    # ZeRO 2, the goodput schedule on a simulated compute-bound curve, node 2 lost in step 10: its
    # warm-up trial of batch 12 (steps 4-8) is judged on 3 ranks (or, where the snapshot restored is from
    # inside it, on 2), then the survivors go on deciding.
    "goodput": (
        2,
        29719,
        1,
        3,
        {
            "LIVE_KILL": "2:10:2.0",
            "LIVE_SCHEDULE": "goodput",
            "DS_ADABATCH_SIMULATED_STEP_TIME": GOODPUT_CURVE,
        },
    ),
}
RELAUNCH_PORT = 29716


def wait_spawned(procs: list[subprocess.Popen], timeout: float) -> None:
    """Until every agent in ``procs`` has started its workers, which it does once its first rendezvous
    round has closed (or one ended, or ``timeout`` seconds passed: the checks then say what went
    wrong)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(children(p.pid) for p in procs):
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.1)


def children(pid: int) -> list[str]:
    """The child processes of ``pid`` (``ip netns exec`` runs the agent in its own process)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += (task / "children").read_text().split()
    return found


def node_logs(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("node*.log")))


@pytest.fixture(scope="module")
def launch_one(cluster, tmp_path_factory) -> dict[str, Path]:
    """The jobs of JOBS side by side, one launch."""
    outs: dict[str, Path] = {}
    procs: dict[str, list[subprocess.Popen]] = {}
    for name, (stage, port, nproc, nodes, env) in JOBS.items():
        out = outs[name] = tmp_path_factory.mktemp(f"live_{name}")
        procs[name] = []
        for k in range(nodes):
            procs[name].append(
                launch_job(cluster, k, out, stage, port, f"node{k}.log", env, nproc, nodes=nodes)
            )
            time.sleep(0.3)
        # One job's rendezvous at a time: with every agent starting at once on 2 loaded cores, the last
        # job's last agent joined more than 30 s after the others had, its first round closed without
        # it and torchrun restarted the workers when it came. The next job's agents start once this
        # job's round has closed (its workers then start beside the next agents).
        wait_spawned(procs[name], 120)
    codes = {"store": wait_processes(procs["store"], 300)}
    store = outs["store"]
    (store / "ended").write_text(str(time.time()))
    stage, _, _, _, env = JOBS["store"]
    relaunch = [
        launch_job(cluster, k, store, stage, RELAUNCH_PORT, f"relaunch{k}.log", env, host=1, nodes=2)
        for k in (1, 2)
    ]
    survivors = {name: p[:2] if name == "hung" else p for name, p in procs.items() if name != "store"}
    for name, ps in survivors.items():
        codes[name] = wait_processes(ps, 420)
    codes["relaunch"] = wait_processes(relaunch, 300)
    # The hung node's processes are still stopped: end them.
    for p in procs["hung"][2:]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for name, out in outs.items():
        (out / "codes.json").write_text(json.dumps(codes[name]))
        if name != "store":
            # Node 0 (the survivor, the store's host) ends 0; the killed agents end by SIGKILL.
            assert codes[name][0] == 0, f"{name}:\n{node_logs(out)}"
    assert codes["relaunch"] == [0, 0], node_logs(store)
    return outs


@pytest.mark.parametrize("name,stage,world,lost", [("z1x2", 1, 4, 2), ("z3x2", 3, 4, 2), ("hung", 0, 3, 1)])
def test_node_lost_survivors_go_on_in_place(launch_one, reference, name, stage, world, lost):
    out = launch_one[name]
    event = check_survived_in_place(out, world, lost)
    rows = check_exact(out, reference, stage)
    assert rows[-1]["world_size"] == world - lost and rows[0]["world_size"] == world
    assert len({r["pid"] for r in rows}) == 1, "rank 0 was restarted"
    # Numbered as the step lines number steps (the first train_batch() is step 0): the worker kills its
    # node during the train_batch() that follows its (kill step - 1)th; a loss felt in the snapshot
    # exchange after that step is the next one's.
    kill_step = int(JOBS[name][4]["LIVE_KILL"].split(":")[1])
    assert event["failed_step"] in (kill_step - 1, kill_step), (event, kill_step)
    assert event["failed_step"] - event["rolled_back_to"] == event["steps_redone"], event
    first_after = next(r for r in rows if r["world_size"] == 2)
    print(
        f"ZeRO {stage}: loss in step {event['failed_step']}, first resumed step {first_after['time'] - kill_time(out):.2f} s "
        f"after the kill; phases {json.dumps({k: round(v, 3) for k, v in event.items() if k.endswith('_s')})}"
    )


def test_hung_node_caught_by_the_watchdog_before_the_timeout(launch_one):
    """A stopped node resets no connection: the survivors' watchdog (heartbeat silent for dead_after_s,
    2 s here, in an overdue step) breaks the step's collectives well before the 60 s timeout."""
    out = launch_one["hung"]
    log = "\n".join(p.read_text() for p in sorted(out.glob("node*.log")))  # whole: the line is early
    assert "live watchdog: process(es) [2] silent for 2 s" in log, node_logs(out)
    rows = read_ledger(out / "ledger.jsonl")
    first_after = next(r for r in rows if r["world_size"] == 2)
    waited = first_after["time"] - kill_time(out)
    assert waited < 15.0, f"first step on the survivors {waited:.1f} s after the node hung"
    print(f"hung node: first resumed step {waited:.2f} s after SIGSTOP")


def test_store_host_lost_ends_the_launch_and_a_relaunch_restores_from_memory(launch_one, reference):
    """Node 0 hosts the launcher's store: without it torchrun's agents on the other nodes fail (they
    say "The connection to the C10d store has failed") and stop their workers, in seconds, no hang.
    Launched again on the two survivors (same --rdzv-id), the job restores the newest snapshot from
    their host memory, not the checkpoint, and ends exact."""
    out = launch_one["store"]
    codes = json.loads((out / "codes.json").read_text())
    assert codes[1] != 0 and codes[2] != 0, codes
    for k in (1, 2):
        assert "The connection to the C10d store has failed" in (out / f"node{k}.log").read_text()
    ended = float((out / "ended").read_text()) - kill_time(out)
    assert ended < 60, f"the launch ended {ended:.1f} s after the store's host was lost"
    rows = check_exact(out, reference, 1)
    relaunched = [e for e in ends(out)]
    assert len(relaunched) == 2 and all(e["world_size"] == 2 for e in relaunched), relaunched
    for e in relaunched:
        assert str(e["resumed_from"]).startswith("<host memory: step"), e
    assert rows[-1]["world_size"] == 2
    print(
        f"store lost: the launch ended {ended:.1f} s after the kill; relaunch restored {relaunched[0]['resumed_from']}"
    )


def test_worker_crash_on_a_healthy_node_restores_from_host_memory(launch_one, reference):
    out = launch_one["crash"]
    assert sorted(s["restart"] for s in starts(out)) == [0, 0, 1, 1], starts(out)
    for end in ends(out):
        assert str(end["resumed_from"]).startswith("<host memory: step"), end
    rows = check_exact(out, reference, 2)
    assert len(rows) - len(trajectory(rows)) <= 1


def test_node_and_its_buddy_lost_take_the_restart_path(launch_one, reference):
    out = launch_one["both"]
    log = (out / "node0.log").read_text()
    assert "live recovery not possible, taking the restart path" in log
    assert "no snapshot step whose every partition a survivor holds" in log
    rows = check_exact(out, reference, 2)
    restarted = [r for r in rows if r["restart"] > 0]
    assert restarted and all(r["world_size"] == 1 for r in restarted)
    (end,) = ends(out)
    assert end["restart"] == 1 and "global_step" in str(end["resumed_from"]), end
    assert end["first_step"] % 4 == 0 and end["first_step"] > 0, "resumed from a checkpoint step"


def test_goodput_goes_on_over_a_lost_node_and_predicts_the_smaller_world(launch_one):
    """The goodput schedule survives a lost node in place: every sample once, the final parameters those
    of one process training the same batches (the job's batches follow its world and its clock, so its
    reference is a replay of them), every survivor's throughput model the same, and that model right on
    the smaller world from its first shape there: it carries the slope measured on 3 ranks (a rank's
    passes cost the same), so it predicts the curve's every shape on 2 ranks, where a model fitted on the
    one shape measured there would call every larger batch free and try it."""
    out = launch_one["goodput"]
    check_survived_in_place(out, 3, 1)
    rows = check_exact(out, one_process(out, "replay", 2, (2,)), 2)
    assert rows[0]["world_size"] == 3 and rows[-1]["world_size"] == 2
    survivors = ends(out)
    states = [e["goodput"]["state"] for e in survivors]
    assert all(state == states[0] for state in states), "the survivors' throughput models differ"
    measured = survivors[0]["goodput"]["measured"]
    assert len(measured["3"]) >= 2 and measured["2"], measured
    model = ThroughputModel()
    model.load_state_dict(states[0])
    curve = parse_step_time_curve(GOODPUT_CURVE)
    for micro, gas in [(1, 1), (3, 2), (4, 3), (4, 6)]:
        assert model.predict(micro, gas, 2) == pytest.approx(curve.predict(micro, gas), rel=1e-6)
    history = survivors[0]["history"]
    shrink = next(i for i, h in enumerate(history) if h.startswith("shrink"))
    after = history[shrink + 1 :]
    # No batch chosen on the smaller world is undone. A trial open in the snapshot restored (taken before
    # the 3-rank verdict, say) is tried there anew, as on a resume, and may be: then it is the first change.
    for h in (h for h in after if "not kept" in h):
        batch = h.split("trial of batch ", 1)[1].split()[0]
        opened = [e for e in history[:shrink] if f"-> batch {batch}:" in e and "(a trial" in e]
        assert h is after[0] and opened, (history[:shrink], after)
    print(f"goodput over a lost node: measured {measured}; after the shrink: {after}")


def test_node_lost_then_rejoins(cluster, reference, tmp_path):
    """ZeRO 2: node 2 lost, the survivors go on, node 2 returns: the job ends on three ranks, exact."""
    out = tmp_path / "grow"
    out.mkdir()
    env = {"LIVE_KILL": f"2:{kill_point(4)}", "LIVE_WAIT_FOR": "14:3"}
    procs = [launch_job(cluster, k, out, 2, 29721, f"node{k}.log", env) for k in range(3)]
    deadline = time.monotonic() + 300
    while not (out / "kill-time").exists():
        assert time.monotonic() < deadline and procs[0].poll() is None, (out / "node0.log").read_text()[
            -4000:
        ]
        time.sleep(0.1)
    # The node comes back with empty host memory (its snapshots died with it).
    rows = []
    while not any(r["world_size"] == 2 for r in rows):
        assert time.monotonic() < deadline, (out / "node0.log").read_text()[-4000:]
        time.sleep(0.2)
        rows = read_ledger(out / "ledger.jsonl")
    survivors = {s["pid"] for s in starts(out) if s["origin"] < 2}
    procs.append(launch_job(cluster, 2, out, 2, 29721, "node2-back.log", {"LIVE_WAIT_FOR": "14:3"}))
    codes = wait_processes([procs[0], procs[1], procs[3]], 360)
    assert codes == [0, 0, 0], (out / "node0.log").read_text()[-4000:]

    rows = check_exact(out, reference, 2)
    shrunk = [r for r in rows if r["world_size"] == 2]
    assert shrunk and {r["pid"] for r in rows[: rows.index(shrunk[-1]) + 1]} == {rows[0]["pid"]}
    assert rows[-1]["world_size"] == 3
    # The survivors kept their processes through the shrink; torchrun restarted them for the join.
    assert {e["pid"] for e in ends(out)}.isdisjoint(survivors)
    for end in ends(out):
        assert str(end["resumed_from"]).startswith("<host memory: step"), end
        assert end["first_step"] == shrunk[-1]["step"], "the grow trained a step again or skipped one"
    redone = len(rows) - len(trajectory(rows))
    assert redone <= 1
    print(
        f"grow: restored step {shrunk[-1]['step']} from host memory on 3 ranks; {redone} step(s) redone in all"
    )

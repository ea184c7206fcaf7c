"""The main job across "nodes": network namespaces on a private bridge (scripts/netns-cluster.sh).

- static: ``torchrun --nnodes 2 --node-rank k`` and the ``deepspeed`` launcher's no-ssh mode (one rank
  per node) train step for step what one node
  with two ranks trains (same global batches, same sample indices, losses within fp32 tolerance);
- elastic: ``torchrun --nnodes 1:2 --rdzv-backend c10d --max-restarts 3`` on two nodes; node B's
  processes are killed mid-run, node A's agent restarts the job on one rank, which resumes from the last
  complete checkpoint by itself (ZeRO 2 and 3: converted to the universal format on the way). The
  per-sample ledger shows every sample of the run trained exactly once, counting from the checkpoint.

Needs root and iproute2's ``ip``; skipped with the reason otherwise (CI runs as root and installs ``ip``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _cluster_checks import (
    check_resumed_exactly_once,
    job_args,
    netns_cluster,
    read_ledger,
    same_steps,
    small_config,
    wait_for_two_node_steps,
    wait_processes,
    why_no_netns,
)
from _util import torchrun

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "runners" / "train_lm.py"
STATIC_SAMPLES = 400
PORT = 29500  # each namespace has its own ports: no race with anything else on the machine


pytestmark = [
    pytest.mark.multirank,
    pytest.mark.slow,
    pytest.mark.skipif(why_no_netns() is not None, reason=why_no_netns() or ""),
]


@pytest.fixture(scope="module")
def cluster():
    with netns_cluster(2, JOB) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One node, two ranks over loopback: the run every multi-node run must reproduce."""
    tmp = tmp_path_factory.mktemp("single_node")
    out = tmp / "run"
    out.mkdir()
    proc = torchrun(JOB, *job_args(str(small_config(tmp, 2)), str(out)), nproc=2, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return read_ledger(out / "ledger.jsonl")


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_static_two_nodes_equal_one_node(cluster, reference, tmp_path, launcher):
    out = tmp_path / "run"
    out.mkdir()
    args = job_args(str(small_config(tmp_path, 2)), str(out))
    args[args.index("--samples") + 1] = str(STATIC_SAMPLES)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    procs = []
    for k in range(2):
        if launcher == "torchrun":
            argv = [
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(k),
                "--nproc-per-node",
                "1",
            ]
            argv += ["--master-addr", cluster.addr(0), "--master-port", str(PORT)]
        else:
            # The deepspeed launcher's no-ssh mode: one launcher per node, each told its rank.
            argv = ["-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh"]
            argv += ["--node_rank", str(k), "--master_addr", cluster.addr(0), "--master_port", str(PORT)]
        procs.append(cluster.launch(k, argv, args, tmp_path / f"node{k}.log"))
    codes = wait_processes(procs, 300)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-4000:]
    got = read_ledger(out / "ledger.jsonl")
    assert all(r["world_size"] == 2 for r in got)
    assert got[-1]["samples"] >= STATIC_SAMPLES and len(got) < len(reference)
    same_steps(got, reference, rel=1e-5)


# ZeRO 2's restart path (a lost node, the survivors restarted, the checkpoint converted to universal and
# resumed on fewer ranks, every sample once) runs in tests/test_live_elastic.py, where a node and its
# buddy are lost together.
@pytest.mark.parametrize("stage", [0, 3])
def test_node_loss_resumes_on_one_node(cluster, reference, tmp_path, stage):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    args = job_args(str(small_config(tmp_path, stage)), str(out))
    args += ["--save-dir", str(ckpt), "--resume", str(ckpt), "--save-every", "4", "--keep-last", "2"]
    ledger = out / "ledger.jsonl"
    procs = []
    for k in range(2):
        launcher = ["-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"]
        launcher += ["--max-restarts", "3", "--monitor-interval", "1", "--rdzv-backend", "c10d"]
        launcher += ["--rdzv-endpoint", f"{cluster.addr(0)}:{PORT}", "--rdzv-id", "job"]
        # The netns nodes share the host's hostname, so the store host and each node's address are
        # given explicitly (on a real cluster torchrun infers both from the hostname).
        launcher += ["--local-addr", cluster.addr(k)]
        # Dead-node detection after 3 missed 1 s heartbeats; a 2 s last call for late joiners.
        conf = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
        launcher += ["--rdzv-conf", f"{conf},is_host={'true' if k == 0 else 'false'}"]
        procs.append(cluster.launch(k, launcher, args, tmp_path / f"node{k}.log"))
    try:
        wait_for_two_node_steps(ledger, procs[0], tmp_path / "node0.log", timeout=240)
        killed_at = time.time()
        cluster.kill_node(1)
        codes = wait_processes(procs[:1], 300)
    finally:
        cluster.kill_node(0)
        cluster.kill_node(1)
    log = (tmp_path / "node0.log").read_text()
    assert codes == [0], log[-4000:]

    final, after = check_resumed_exactly_once(read_ledger(ledger), save_every=4)
    resumed_from = after[0]["step"] - 1
    # Same samples step for step as the undisturbed run; losses continue from the checkpoint's state.
    same_steps(final, reference, rel=2e-3)
    if stage > 0:
        assert (ckpt / f"global_step{resumed_from}_universal").is_dir() or "universal" in log
    print(
        f"ZeRO {stage}: node lost at {killed_at:.3f}, first resumed step {after[0]['time'] - killed_at:.1f} s later"
    )

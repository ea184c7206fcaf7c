"""What the multi-node tests share: the network-namespace cluster, the small main job they run and the
checks of its per-sample ledger.

Used by tests/test_cluster.py (network namespaces, processes) and tests/test_container.py (the same in
containers): the job, the config and every check on the ledger are the same for both.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from _util import private_octet

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 2400  # the whole run: about 40 steps of a batch ramping 8 -> 64 over 256 samples
SMALL_MODEL = ["--layers", "1", "--width", "64", "--context", "32", "--max-bytes", "200000"]


def why_no_netns() -> str | None:
    """Why network-namespace nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "the network-namespace cluster needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "the network-namespace cluster needs iproute2's `ip` (apt-get install iproute2)"
    return None


def small_config(folder: Path, stage: int) -> Path:
    """The main job's config (ds_configs/lm_ramp.json) at ZeRO ``stage``, ramp over 256 samples."""
    config = json.loads((ROOT / "ds_configs" / "lm_ramp.json").read_text())
    config["adabatch"]["schedule"]["ramp_samples"] = 256
    config["zero_optimization"] = {"stage": stage}
    path = folder / f"lm_z{stage}.json"
    path.write_text(json.dumps(config))
    return path


def job_args(config: str, out: str, samples: int = SAMPLES) -> list[str]:
    """Options of runners/train_lm.py for a small run writing its ledger to ``out``/ledger.jsonl."""
    return ["--config", config, "--samples", str(samples), *SMALL_MODEL, "--out", out, "--no-progress"] + [
        "--ledger",
        f"{out}/ledger.jsonl",
    ]


def read_ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def same_steps(got: list[dict], want: list[dict], rel: float) -> None:
    """``got`` trains, step for step, the samples of ``want`` with losses within ``rel``."""
    assert [r["step"] for r in got] == [r["step"] for r in want[: len(got)]]
    for a, b in zip(got, want):
        assert a["indices"] == b["indices"], f"step {a['step']}: different samples"
        assert math.isclose(a["loss"], b["loss"], rel_tol=rel), (
            f"step {a['step']}: {a['loss']} vs {b['loss']}"
        )


def check_resumed_exactly_once(
    rows: list[dict], save_every: int, samples: int = SAMPLES
) -> tuple[list, list]:
    """The ledger of a run that lost a node and went on alone after a worker restart.

    Checks that the restarted run went on with one rank, resumed right after a checkpoint step, and that
    the trajectory that counts (the first run up to that checkpoint, then the resumed run) trained every
    sample at most once and ``samples`` of them in all. Returns (that trajectory, the resumed steps).
    """
    before = [r for r in rows if r["restart"] == 0]
    after = [r for r in rows if r["restart"] > 0]
    assert after and all(r["world_size"] == 1 for r in after), "node A went on alone after the loss"
    resumed_from = after[0]["step"] - 1
    assert resumed_from % save_every == 0 and resumed_from >= save_every, (
        f"resumed after step {resumed_from}: not a checkpoint"
    )
    assert resumed_from <= before[-1]["step"]
    final = [r for r in before if r["step"] <= resumed_from] + after
    assert [r["step"] for r in final] == list(range(1, len(final) + 1))
    seen = [i for r in final for i in r["indices"]]
    assert len(seen) == len(set(seen)), "a sample was trained twice within the epoch"
    assert final[-1]["samples"] == len(seen) >= samples, "samples lost"
    return final, after


def wait_for_two_node_steps(
    ledger: Path, proc: subprocess.Popen, log: Path, timeout: float, steps: int = 6
) -> None:
    """Until the ledger has ``steps`` steps trained by 2 ranks; fails if ``proc`` (node A) ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_ledger(ledger) if ledger.exists() else []
        if sum(r["world_size"] == 2 for r in rows) >= steps:
            return
        assert proc.poll() is None, log.read_text()[-6000:]
        time.sleep(0.05)
    raise AssertionError(f"the 2-node elastic job never made {steps} steps:\n" + log.read_text()[-6000:])


class Cluster:
    """Nodes ``NAME-n0`` .. of scripts/netns-cluster.sh; :meth:`launch` runs ``job`` on one of them."""

    def __init__(self, name: str, subnet: str, nodes: int, job: Path):
        self.name, self.subnet, self.nodes, self.job = name, subnet, nodes, job

    def ns(self, k: int) -> str:
        return f"{self.name}-n{k}"

    def addr(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    def launch(
        self, k: int, launcher_args: list[str], job_argv: list[str], log: Path, env: dict | None = None
    ) -> subprocess.Popen:
        """``python LAUNCHER_ARGS JOB JOB_ARGS`` on node ``k`` (its own session, output to ``log``)."""
        env = dict(
            os.environ,
            DS_ACCELERATOR="cpu",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="eth0",  # the node's own interface, not the host's
            PYTHONPATH=str(ROOT),
            **(env or {}),
        )
        cmd = ["ip", "netns", "exec", self.ns(k), sys.executable, *launcher_args, str(self.job), *job_argv]
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill_node(self, k: int) -> None:
        """Node loss: every process in node ``k``'s namespace, SIGKILL."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(k)], capture_output=True, text=True).stdout
        for pid in out.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def netns_cluster(nodes: int, job: Path, tag: str = ""):
    """A cluster of ``nodes`` network namespaces for the duration of the block, always removed."""
    script = ROOT / "scripts" / "netns-cluster.sh"
    name = f"dsab{tag}{os.getpid() % 100000}"
    subnet = f"10.{213 + len(tag)}.{private_octet()}"
    up = subprocess.run(
        ["bash", str(script), "up", str(nodes), name, subnet], capture_output=True, text=True, timeout=60
    )
    try:
        assert up.returncode == 0, f"netns-cluster.sh up failed:\n{up.stdout}{up.stderr}"
        yield Cluster(name, subnet, nodes, job)
    finally:
        subprocess.run(["bash", str(script), "down", name], capture_output=True, timeout=60)
        # DeepSpeed's CPU communication op keeps a 66 MB buffer per process in /dev/shm, named after
        # the master address, and only a clean exit unlinks it: the workers these tests kill leave
        # theirs behind.
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{subnet}.*"):
            with contextlib.suppress(OSError):
                os.remove(leftover)


def wait_processes(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes of ``procs``; any still running after ``timeout`` seconds is killed (its session)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    return codes


def trajectory(rows: list[dict]) -> list[dict]:
    """The steps that count: the last record of each step (a step trained again replaces its record)."""
    last: dict[int, dict] = {}
    for row in rows:
        last[row["step"]] = row
    return [last[s] for s in sorted(last)]


def load_reference(folder: Path, stages) -> dict:
    """What ``live_worker.py reference`` wrote: per stage, the rows of each step and the final parameters."""
    return {
        s: {
            "rows": json.loads((folder / f"reference-z{s}.json").read_text()),
            "params": torch.load(folder / f"reference-z{s}.pt"),
        }
        for s in stages
    }


def check_exact(out: Path, reference: dict, stage: int) -> list[dict]:
    """A live job's ledger and final parameters against the uninterrupted reference: the same samples
    in every step, each once, parameters within 1e-5 relative; returns the ledger's rows."""
    rows = read_ledger(out / "ledger.jsonl")
    final = trajectory(rows)
    ref_rows = reference[stage]["rows"]
    assert [r["step"] for r in final] == [r["step"] for r in ref_rows]
    for got, want in zip(final, ref_rows):
        assert got["indices"] == want["indices"], f"step {got['step']}: other samples than the reference"
    seen = [i for r in final for i in r["indices"]]
    assert len(seen) == len(set(seen)) == final[-1]["samples"], "a sample lost or trained twice"
    got = torch.load(out / "final.pt")
    want = reference[stage]["params"]
    rel = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    assert rel <= 1e-5, f"final parameters {rel:.2e} from the uninterrupted run"
    print(
        f"{out.name}: final parameters {rel:.1e} from the reference; {len(rows) - len(final)} step(s) redone"
    )
    return rows


def ends(out: Path) -> list[dict]:
    """What each live worker wrote when it ended (end-<pid>.json)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("end-*.json"))]


def starts(out: Path) -> list[dict]:
    """What each live worker wrote when it started (start-<pid>.json)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("start-*.json"))]

"""The image, built and run with the README's commands (scripts/image.sh).

- build: ``image.sh build`` builds docker/Dockerfile (and the Debian base when there is none); a second
  build of the same content reuses the image, and the tag follows every file the image copies;
- the ops compiled into the image (``image.sh exec``): a container loads them as built, compiling nothing;
  its torch is the wheelhouse's (the CPU build) where the image was built with one holding it;
- the main job on 2 ranks in one container (``image.sh run``): every sample once, the batch ramping;
  its ledger is the reference of the next test;
- docker/pytorchjob.yaml (``image.sh cluster``): the manifest's command line with the training
  operator's PET_* environment, one container per network namespace, torchrun elastic; node B's
  container is killed mid-run, node A resumes alone from the last complete checkpoint on the volume
  both mount, and the ledger shows every sample trained exactly once counting from that checkpoint,
  the same samples step for step as the single-container run.

Skipped with the reason where podman is missing (CI installs it: .ci/run), and the cluster where there is
no root or no ``ip``. Containers and namespaces are removed also when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cluster_checks import (
    SAMPLES,
    check_resumed_exactly_once,
    job_args,
    read_ledger,
    same_steps,
    small_config,
    wait_for_two_node_steps,
    why_no_netns,
)
from _util import private_octet

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SH = ROOT / "scripts" / "image.sh"
NETNS = ROOT / "scripts" / "netns-cluster.sh"
BUILD_TIMEOUT = 1800  # a cold machine: Debian base, packages, torch, DeepSpeed's CPU ops compiled
RUN_TIMEOUT = 420


def _why_not() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman; CI does: .ci/run)"
    base_missing = subprocess.run(["podman", "image", "exists", "localhost/bookworm-base"]).returncode != 0
    if base_missing and (os.geteuid() != 0 or shutil.which("debootstrap") is None):
        return "the Debian base image is missing and building it needs root and debootstrap"
    return None


WHY_NOT = _why_not()
pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
]


def _image_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable)  # the cluster's manifest reader needs pyyaml
    return subprocess.run(
        ["bash", str(IMAGE_SH), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def image() -> str:
    started = time.monotonic()
    proc = _image_sh("build", timeout=BUILD_TIMEOUT)
    assert proc.returncode == 0, f"image.sh build failed:\n{proc.stderr[-6000:]}"
    print(f"image.sh build: {time.monotonic() - started:.0f} s")
    return proc.stdout.split()[-1]


def test_build_reuses_the_image_until_its_content_changes(image, tmp_path):
    started = time.monotonic()
    again = _image_sh("build", timeout=600)
    took = time.monotonic() - started
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.split()[-1] == image and "up to date" in again.stderr, again.stderr[-2000:]
    print(f"image.sh build, cached: {took:.1f} s")
    label = _label(image, "ds_adabatch.content")
    assert image.endswith(":" + label), f"{image} carries the content label {label!r}"

    # A copy of the checkout maps to the same tag; one changed file of the package gives another.
    copy = tmp_path / "checkout"
    for name in ("scripts", "docker", "ds_adabatch", "runners", "ds_configs"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md", ".dockerignore"):
        shutil.copy(ROOT / name, copy / name)
    tag = subprocess.run(["bash", str(copy / "scripts" / "image.sh"), "tag"], capture_output=True, text=True)
    assert tag.stdout.split()[-1] == image, tag.stderr[-2000:]
    with (copy / "ds_adabatch" / "_version.py").open("a") as f:
        f.write("# changed\n")
    changed = subprocess.run(
        ["bash", str(copy / "scripts" / "image.sh"), "tag"], capture_output=True, text=True
    )
    assert changed.stdout.split()[-1] not in ("", image), "a changed package must not reuse the image"


LOAD_THE_OPS = """
import glob, json, os
import torch
from deepspeed.accelerator import get_accelerator
def stamps():
    return {p: os.stat(p).st_mtime_ns for p in sorted(glob.glob("/opt/torch_extensions/*/*.so"))}
before = stamps()
for op in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(op).load()
print(json.dumps({"before": before, "after": stamps(), "cxx": os.environ.get("CXX"), "torch": torch.__version__}))
"""


def test_the_images_ops_load_as_built(image):
    """The ops compiled into the image are the ones a container loads: built by the image's own ``CXX``
    (the compiler that drops ``-g``), so torch's JIT finds them up to date and compiles nothing on start.
    Built by another command, ninja would rebuild them in every container (a .so with a new mtime)."""
    proc = _image_sh(
        "exec",
        "--image",
        image,
        "--",
        "env",
        "DS_ACCELERATOR=cpu",
        "python",
        "-c",
        LOAD_THE_OPS,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(seen["before"]) == [
        "/opt/torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so",
        "/opt/torch_extensions/fused_adam/fused_adam.so",
    ], seen
    assert seen["after"] == seen["before"], f"a container rebuilt the image's ops: {seen}"
    assert seen["cxx"] == "/usr/local/bin/c++-without-debug-info", seen
    # Where the image was built with a wheelhouse holding a build of the Dockerfile's torch (image.sh
    # labels the image with the wheelhouse's file names), the image has that build: a build must not
    # reuse a layer that installed torch from the index instead.
    pinned = re.search(r"^ARG TORCH=torch==(\S+)$", (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert pinned, "docker/Dockerfile no longer pins torch as ARG TORCH=torch==VERSION"
    wheels = _label(image, "ds_adabatch.wheelhouse").split()
    builds = [w.split("-")[1] for w in wheels if w.startswith("torch-") and w.endswith(".whl")]
    builds = [b for b in builds if b.split("+")[0] == pinned.group(1)]
    if builds:
        assert seen["torch"] in builds, f"the image's torch is {seen['torch']}, not the wheelhouse's {builds}"


def _label(image: str, key: str) -> str:
    """The image's label ``key`` ("" where it has none)."""
    inspect = ["podman", "image", "inspect", "--format", f'{{{{index .Labels "{key}"}}}}', image]
    out = subprocess.run(inspect, capture_output=True, text=True).stdout.strip()
    return "" if out == "<no value>" else out


@pytest.fixture(scope="module")
def reference(image, tmp_path_factory) -> tuple[list[dict], Path]:
    """The small main job on 2 ranks in one container: ``image.sh run``."""
    data = tmp_path_factory.mktemp("container_run")
    small_config(data, 2)
    name = f"dsabr{os.getpid() % 100000}"
    args = job_args("/data/lm_z2.json", "/data/run")
    started = time.monotonic()
    try:
        proc = _image_sh(
            "run", "--image", image, "--data", str(data), "--name", name, *args, timeout=RUN_TIMEOUT
        )
    finally:  # a timed-out client leaves its container running
        subprocess.run(["podman", "rm", "-f", "--ignore", name], capture_output=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    print(f"image.sh run (2 ranks, {SAMPLES} samples): {time.monotonic() - started:.0f} s")
    return read_ledger(data / "run" / "ledger.jsonl"), data / "run"


def test_main_job_runs_in_the_container(reference):
    rows, out = reference
    assert all(r["world_size"] == 2 for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    seen = [i for r in rows for i in r["indices"]]
    assert len(seen) == len(set(seen)) and rows[-1]["samples"] == len(seen) >= SAMPLES
    batches = [len(r["indices"]) for r in rows]
    assert batches[0] == 8 and max(batches) == 64, f"the global batch did not ramp 8 -> 64: {batches}"
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "metrics.jsonl").is_file() and (out / "metrics.png").is_file()


@pytest.mark.skipif(why_no_netns() is not None, reason=why_no_netns() or "")
def test_pytorchjob_loses_a_node_and_resumes_exactly_once(image, reference, tmp_path):
    data = tmp_path / "volume"
    data.mkdir()
    small_config(data, 2)
    # The manifest's command line, with the small job's options appended (the later option wins).
    extra = job_args("/data/lm_z2.json", "/data/run") + ["--save-every", "4"]
    name = f"dsabc{os.getpid() % 100000}"
    subnet = f"10.214.{private_octet()}"
    log = tmp_path / "cluster.log"
    argv = ["bash", str(IMAGE_SH), "cluster", "--image", image, "--nproc", "1", "--data", str(data)]
    argv += ["--name", name, "--subnet", subnet, "--", *extra]
    env = dict(os.environ, PYTHON=sys.executable)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    ledger = data / "run" / "ledger.jsonl"
    try:
        wait_for_two_node_steps(ledger, proc, log, timeout=RUN_TIMEOUT)
        killed = time.monotonic()
        subprocess.run(["podman", "kill", f"{name}-worker-1"], capture_output=True, timeout=60)
        code = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # image.sh cluster removes what it made on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        names = [f"{name}-worker-{k}" for k in range(2)]
        subprocess.run(["podman", "rm", "-f", "--ignore", *names], capture_output=True, timeout=120)
        subprocess.run(["bash", str(NETNS), "down", name], capture_output=True, timeout=60)
    text = log.read_text()
    assert code == 0, text[-6000:]
    print(
        f"image.sh cluster: {time.monotonic() - started:.0f} s, {time.monotonic() - killed:.0f} s after the loss"
    )

    # What ran is the manifest's: its command line and the operator's environment.
    assert "torchrun runners/train_lm.py --config=ds_configs/lm_ramp.json" in text
    assert "PET_NNODES=1:4" in text and "PET_RDZV_ENDPOINT=ds-adabatch-lm-worker-0:23456" in text
    rows = read_ledger(ledger)
    assert sum(r["world_size"] == 2 for r in rows) >= 6, "the two containers formed one world first"
    final, after = check_resumed_exactly_once(rows, save_every=4)
    same_steps(final, reference[0], rel=2e-3)
    # Nothing is left behind: no container, no namespace.
    left = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True
    ).stdout
    assert name not in left
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

"""Helpers shared by the tests that launch processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: Path, *args: str, nproc: int = 2, cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``nproc`` CPU ranks (gloo, one thread each).

    The free port can be taken by another process before torchrun binds it: that launch is retried once
    on a new port. Returns the finished process (stdout and stderr captured as text).
    """
    # PYTHONFAULTHANDLER: a rank that dies on a signal prints every thread's Python stack first.
    env = dict(
        os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"
    )

    def launch() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd += [f"--master-port={free_port()}", str(script), *args]
        return run_killing_group(cmd, cwd=cwd, env=env, timeout=timeout)

    proc = launch()
    if proc.returncode != 0 and "address already in use" in (proc.stdout + proc.stderr).lower():
        proc = launch()
    return proc


def run_killing_group(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on timeout every
    process of it (a launcher's workers included) is killed before ``TimeoutExpired`` is raised, so a
    hung launch leaves no workers behind to hold ports and cores for the tests after it."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def failure_excerpt(proc: subprocess.CompletedProcess[str], limit: int = 4000) -> str:
    """The part of a failed launch's output that tells why: a crashed rank's stacks (the faulthandler's
    "Fatal Python error" block, which other ranks' tracebacks would push out of a plain tail) and the tail."""
    log = proc.stdout + proc.stderr
    crash = log.find("Fatal Python error")
    head = log[crash : crash + limit] + "\n[...]\n" if crash >= 0 else ""
    return head + log[-limit:]


def torchrun_or_fail(script: Path, *args: str, what: str, nproc: int = 2, cwd: Path, timeout: float) -> None:
    """:func:`torchrun` that fails the calling test (or fixture) with :func:`failure_excerpt` when the
    launch does not exit 0; ``what`` names the launch in that message."""
    import pytest

    proc = torchrun(script, *args, nproc=nproc, cwd=cwd, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{failure_excerpt(proc)}")


def read_result(results: Path, name: str) -> dict:
    """The JSON record ``name`` a launched worker wrote into ``results`` (fails clearly if it wrote none)."""
    path = results / f"{name}.json"
    assert path.exists(), f"the worker wrote no {path.name}; see the logs in {results}"
    return json.loads(path.read_text())

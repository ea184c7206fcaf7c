"""Helpers shared by the tests that launch processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_octet() -> int:
    """A number in 0..249 that no other pytest-xdist worker of this run returns (for a private subnet:
    two workers' namespaces, and the shared-memory files named after their addresses, never collide)."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % workers
    return (os.getpid() % max(1, 250 // workers)) * workers + index


def torchrun(
    script: Path, *args: str, nproc: int = 2, cwd: Path, timeout: float, launcher_args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``nproc`` CPU ranks (gloo, one thread each);
    ``launcher_args`` go to torchrun (``--max-restarts=1``, say).

    The free port can be taken by another process before torchrun binds it: that launch is retried once
    on a new port. Returns the finished process (stdout and stderr captured as text).
    """
    # PYTHONFAULTHANDLER: a rank that dies on a signal prints every thread's Python stack first.
    env = dict(
        os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"
    )

    def launch() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd += [f"--master-port={free_port()}", *launcher_args, str(script), *args]
        return run_killing_group(cmd, cwd=cwd, env=env, timeout=timeout)

    proc = launch()
    if proc.returncode != 0 and "address already in use" in (proc.stdout + proc.stderr).lower():
        proc = launch()
    return proc


# The launches run_killing_group has in flight, and whether an interrupted side_by_side called them off.
_IN_FLIGHT: set[subprocess.Popen] = set()
_IN_FLIGHT_LOCK = threading.Lock()
_CANCELLED = threading.Event()


class LaunchesCancelled(RuntimeError):
    """A launch that an interrupted :func:`side_by_side` called off (killed, or never started)."""


def run_killing_group(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on timeout every
    process of it (a launcher's workers included) is killed before ``TimeoutExpired`` is raised, so a
    hung launch leaves no workers behind to hold ports and cores for the tests after it. Inside the lanes
    of an interrupted :func:`side_by_side`, it raises :class:`LaunchesCancelled` instead."""
    with _IN_FLIGHT_LOCK:
        if _CANCELLED.is_set():
            raise LaunchesCancelled(f"not started (side_by_side was interrupted): {cmd}")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
        )
        _IN_FLIGHT.add(proc)
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
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(proc)
    if _CANCELLED.is_set():
        raise LaunchesCancelled(f"killed (side_by_side was interrupted): {cmd}")
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


def launches_for(request, module: str, runs_of: dict[str, set[str]]) -> set[str]:
    """The launches that the tests of ``module`` selected in this session read, so that a module's fixture
    starts only those. ``runs_of`` maps a test's name with its parameters (``"test_x[a]"``) or without
    (every parametrization) to the names of the launches it reads."""
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(getattr(item, "module", None), "__name__", "") == module:
            wanted |= runs_of.get(item.name, runs_of.get(item.originalname, set()))
    return wanted


def side_by_side(*lanes: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, Any]:
    """Run the ``lanes`` at once, one thread each, so that their launches share the cores; a lane makes
    its ``(name, call)`` launches one after the other. Returns each name's result, or the exception its
    call raised (``pytest.fail``'s included: a lane goes on with its next launch), which :func:`outcome`
    raises again in the test that reads it. If the wait is interrupted, every launch in flight
    (:func:`run_killing_group`) is killed and the lanes start no more."""
    results: dict[str, Any] = {}

    def run(lane: Sequence[tuple[str, Callable[[], Any]]]) -> None:
        for name, call in lane:
            try:
                results[name] = call()
            except BaseException as exc:  # pytest.fail raises a BaseException
                results[name] = exc

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(lanes)))
    try:
        for future in [pool.submit(run, lane) for lane in lanes]:
            future.result()
    except BaseException:
        with _IN_FLIGHT_LOCK:
            _CANCELLED.set()
            for proc in _IN_FLIGHT:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        pool.shutdown(wait=True)
        _CANCELLED.clear()
    return results


def outcome(results: dict[str, Any], name: str) -> Any:
    """``results[name]`` of :func:`side_by_side`; fails the calling test with the error of that launch if
    it raised one (with ``pytest.fail``'s message, else the traceback)."""
    import pytest

    assert name in results, f"launch {name!r} was not started: the module's fixture does not know this test"
    got = results[name]
    if isinstance(got, pytest.fail.Exception):
        pytest.fail(got.msg, pytrace=False)
    if isinstance(got, BaseException):
        pytest.fail("".join(traceback.format_exception(got)), pytrace=False)
    return got

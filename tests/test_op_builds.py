"""The guard around DeepSpeed's JIT op loads (ds_adabatch/runtime/distributed/op_builds.py): a build lock left by a
killed process no longer stops every later start.

The unit tests use real files, locks and processes in a temporary directory. The last test starts 2 ranks
whose CPU backend loads DeepSpeed's shared-memory op from a build directory holding such a lock: without
the guard both ranks would wait for it forever on torch 2.13 and older; on torch 2.14 and newer the file is
torch's own advisory lock, which the ranks take although it is there, and the guard leaves it alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _util import free_port, run_killing_group
from torch.utils import cpp_extension

from ds_adabatch.runtime.distributed import op_builds

pytestmark = pytest.mark.matrix

HERE = Path(__file__).parent


def _lock(directory: Path, age_s: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_dead_process_lock_is_removed_with_a_warning(tmp_path, caplog):
    lock = _lock(tmp_path / "op", age_s=60)
    with caplog.at_level(logging.WARNING, logger="ds_adabatch"):
        assert op_builds.clear_stale_build_lock(str(tmp_path / "op")) is True
    assert not lock.exists()
    assert str(lock) in caplog.text and "no running build holds" in caplog.text
    assert op_builds.clear_stale_build_lock(str(tmp_path / "op")) is False  # nothing to do


def test_a_fresh_lock_is_waited_for_not_removed(tmp_path):
    lock = _lock(tmp_path / "op", age_s=0)
    removed_by_owner = threading.Timer(0.5, lock.unlink)
    removed_by_owner.start()
    started = time.monotonic()
    assert op_builds.clear_stale_build_lock(str(tmp_path / "op"), poll_s=0.05) is False
    assert time.monotonic() - started >= 0.4, "it must wait for the owner, not remove a live lock"


def test_an_old_lock_of_a_running_build_is_waited_for(tmp_path):
    directory = tmp_path / "op"
    lock = _lock(directory, age_s=60)
    ninja = tmp_path / "ninja"  # a process named like torch's build tool, working in the directory
    shutil.copy(shutil.which("sleep"), ninja)
    build = subprocess.Popen([str(ninja), "1.5"], cwd=directory)
    try:
        time.sleep(0.2)
        assert op_builds._build_runs_in(str(directory))
        started = time.monotonic()
        assert op_builds.clear_stale_build_lock(str(directory), poll_s=0.05) is True
        assert build.poll() is not None, "the lock was removed while its build still ran"
        assert time.monotonic() - started >= 0.5
        assert not lock.exists()
    finally:
        build.kill()
        build.wait()
    other = subprocess.Popen(["sleep", "5"], cwd=directory)  # not a build tool: does not count
    try:
        assert not op_builds._build_runs_in(str(directory))
    finally:
        other.kill()
        other.wait()


def test_the_guard_is_installed_exactly_where_torch_waits_for_the_lock_file_to_go():
    from deepspeed.ops.op_builder.builder import OpBuilder

    from ds_adabatch.runtime.distributed.torch_compat import jit_build_lock_is_advisory

    # torch 2.14.0 replaced FileBaton (a lock file whose existence blocks) with FileLock (an advisory lock).
    advisory = hasattr(cpp_extension, "FileLock")
    assert jit_build_lock_is_advisory() is advisory
    op_builds.guard_jit_builds()
    assert getattr(OpBuilder.jit_load, op_builds._GUARDED, False) is not advisory


def test_guarded_loads_run_one_at_a_time_after_the_stale_lock_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = Path(op_builds.build_directory("some_op"))
    lock = _lock(directory, age_s=60)
    inside, overlaps = [], []

    def jit_load(self):
        assert not lock.exists(), "the load ran before the stale lock was cleared"
        inside.append(1)
        overlaps.append(len(inside))
        time.sleep(0.2)
        inside.pop()
        return self.name

    class Builder:
        name = "some_op"

    load = op_builds._guarded(jit_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(load(Builder()))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["some_op"] * 3 and max(overlaps) == 1


WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import ds_adabatch
    ds_adabatch.init_distributed()
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    with open(f"formed_{torch.distributed.get_rank()}", "w") as f:
        f.write(str(int(t.item())))
    ds_adabatch.finish()
    """
)


def test_a_launch_starts_although_a_killed_process_left_the_shm_op_lock(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # The op built (or found) once in the usual place, then copied with its timestamps: no rebuild. One
    # process checks that DeepSpeed's CPU accelerator offers the op here and loads it.
    build = textwrap.dedent(
        """
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from ds_adabatch.runtime.distributed.op_builds import build_directory, guard_jit_builds
        guard_jit_builds()
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            raise SystemExit(3)
        builder.load()
        print(build_directory(builder.NAME))
        """
    )
    done = subprocess.run([sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.fail(
            "DeepSpeed's CPU shared-memory op is not compatible here: the launch below would not load it"
        )
    assert done.returncode == 0, done.stderr[-3000:]
    built = Path(done.stdout.strip().splitlines()[-1])
    extensions = tmp_path / "extensions"  # TORCH_EXTENSIONS_DIR holds the ops' directories directly
    shutil.copytree(built, extensions / built.name, symlinks=True)
    lock = _lock(extensions / built.name, age_s=60)

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
    ]
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    proc = run_killing_group([*cmd, str(script)], cwd=tmp_path, env=env, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    formed = [
        (tmp_path / f"formed_{r}").read_text() if (tmp_path / f"formed_{r}").exists() else None
        for r in (0, 1)
    ]
    assert formed == ["2", "2"], f"each rank's all-reduce over both ranks: {formed}\n{log[-4000:]}"
    if hasattr(cpp_extension, "FileLock"):
        # torch 2.14 and newer: the file is torch's advisory lock, which died with the killed process; the
        # guard is off, and a lock file another process may hold is never removed.
        assert "no running build holds" not in log and lock.exists(), log[-4000:]
    else:
        assert "removed" in log and "no running build holds" in log and not lock.exists(), log[-4000:]


def test_an_arch_list_deepspeed_cannot_read_is_a_config_error_before_the_build(monkeypatch):
    """DeepSpeed 0.19.8 parses TORCH_CUDA_ARCH_LIST only while it JIT-builds the optimizer's CUDA op, and
    an entry such as Hopper images' "9.0a" stops it with a bare ValueError; the check names the fix first,
    and only where that build will happen."""
    from ds_adabatch.config import ConfigError, load_ds_config

    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;10.0f+PTX")
    (problem,) = op_builds.cuda_arch_list_problems(adam, "cuda", client_optimizer=False)
    assert problem.path == "optimizer.type"
    assert (
        "['9.0a', '10.0f+PTX']" in problem.message
        and "TORCH_CUDA_ARCH_LIST='8.0;9.0;10.0+PTX'" in problem.message
    )
    assert "torch_adam: true" in problem.message
    (lamb,) = op_builds.cuda_arch_list_problems(
        {"optimizer": {"type": "Lamb"}}, "cuda", client_optimizer=False
    )
    assert "torch_adam" not in lamb.message
    # No build, no problem: torch's AdamW, the optimizer offloaded, an optimizer instance, another accelerator,
    # another optimizer, or an arch list DeepSpeed reads.
    torch_adam = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    offloaded = {**adam, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert op_builds.cuda_arch_list_problems(torch_adam, "cuda", client_optimizer=False) == []
    assert op_builds.cuda_arch_list_problems(offloaded, "cuda", client_optimizer=False) == []
    assert op_builds.cuda_arch_list_problems(adam, "cuda", client_optimizer=True) == []
    assert op_builds.cuda_arch_list_problems(adam, "cpu", client_optimizer=False) == []
    assert (
        op_builds.cuda_arch_list_problems({"optimizer": {"type": "SGD"}}, "cuda", client_optimizer=False)
        == []
    )
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert op_builds.cuda_arch_list_problems(adam, "cuda", client_optimizer=False) == []
    # As initialize reports it: a ConfigError naming the variable, not DeepSpeed's traceback.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    loaded = load_ds_config(
        {
            **adam,
            "train_batch_size": 8,
            "adabatch": {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 8},
        }
    )
    problems = op_builds.cuda_arch_list_problems(loaded.deepspeed, "cuda", client_optimizer=False)
    assert "TORCH_CUDA_ARCH_LIST='9.0'" in str(ConfigError(problems, loaded.source))

"""``adabatch.live_elastic``: its config, the launcher it needs, what it covers and refuses (one node).

The recovery itself (a node lost, the survivors going on, a node rejoining) is tested on a network-
namespace cluster in tests/test_live_elastic.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _util import free_port, torchrun

import ds_adabatch
from ds_adabatch.launch import _script_index
from ds_adabatch.runtime.distributed.comm import CollectiveError
from ds_adabatch.runtime.live.recovery import is_peer_failure

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "live_worker.py"


def _config(live: dict) -> dict:
    return {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "adabatch": {
            "schedule": {"type": "constant", "value": 8},
            "max_micro_batch_per_gpu": 4,
            "live_elastic": live,
        },
    }


def test_defaults_are_off_and_bounded():
    live = ds_adabatch.load_ds_config(_config({})).adabatch.live_elastic
    assert live.enabled is False and live.snapshot_every == "auto"
    assert live.agree_timeout == 2 * live.collective_timeout_s + 5 > live.collective_timeout_s


@pytest.mark.parametrize(
    "live,path,words",
    [
        (
            {"dead_after_s": 0.5, "heartbeat_period_s": 0.2},
            "adabatch.live_elastic.dead_after_s",
            "3 x heartbeat",
        ),
        (
            {"collective_timeout_s": 30, "agree_timeout_s": 30},
            "adabatch.live_elastic.agree_timeout_s",
            "exceed",
        ),
        ({"snapshot_every": 0}, "adabatch.live_elastic.snapshot_every", ">= 1"),
        ({"enabled": "yes"}, "adabatch.live_elastic.enabled", "true or false"),
        ({"snapshots": 2}, "adabatch.live_elastic.snapshots", "not a known key"),
    ],
)
def test_bad_live_elastic_config_names_the_key(live, path, words):
    with pytest.raises(ds_adabatch.ConfigError) as err:
        ds_adabatch.load_ds_config(_config(live))
    text = str(err.value)
    assert path in text and words in text, text


def test_peer_failures_are_told_by_what_failed_not_by_their_words():
    # A wait on a collective of ds_adabatch's own, and torch's distributed error types, are failures of a
    # collective; so is an error raised inside torch.distributed (a real one: tests/test_live_sockets.py).
    assert is_peer_failure(CollectiveError("the step's all-reduce failed"))
    with pytest.raises(RuntimeError) as store_error:  # nothing listens there: the store's network error
        torch.distributed.TCPStore("127.0.0.1", free_port(), 2, is_master=False, timeout=timedelta(seconds=1))
    assert is_peer_failure(store_error.value), repr(store_error.value)
    # The user's own errors are theirs, whatever they say: raised from a loss function or a dataset.
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:41234"
    for text in (gloo, "socket timed out reading shard 7", "mat1 and mat2 shapes cannot be multiplied"):

        def loss_fn(engine, batch, text=text):
            raise RuntimeError(text)

        with pytest.raises(RuntimeError) as user_error:
            loss_fn(None, None)
        assert not is_peer_failure(user_error.value), text
    assert not is_peer_failure(ValueError("Connection reset by peer"))
    assert not is_peer_failure(ds_adabatch.LiveRecoveryFailed("timed out"))


def _raised_from(tmp_path, module: str, statement: str) -> RuntimeError:
    """The error of ``statement`` run in a function of a file whose module is ``module`` (``handle.wait``
    there is a C call that raises, as torch's work object's wait does: no Python frame of its own)."""
    path = tmp_path / f"{module.replace('.', '_')}_{abs(hash(statement))}.py"
    path.write_text(f"def run(handle, torch):\n    {statement}\n")
    scope = {"__name__": module}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    handle = types.SimpleNamespace(wait=functools.partial(torch.empty, -1))
    with pytest.raises(RuntimeError) as raised:
        scope["run"](handle, torch)
    return raised.value


def test_a_wait_on_a_collective_handle_in_deepspeeds_zero_code_is_a_peer_failure(tmp_path):
    # ZeRO 3's persistent parameters are gathered after the step by DeepSpeed's own handle.wait() on the
    # work torch.distributed returned (partition_parameters.py, DeepSpeed 0.19.8): that statement failing
    # is a collective's failure. The same error from another statement there, or from a user's own
    # handle.wait(), is not.
    zero = "deepspeed.runtime.zero.partition_parameters"
    assert is_peer_failure(_raised_from(tmp_path, zero, "handle.wait()"))
    assert not is_peer_failure(_raised_from(tmp_path, zero, "torch.empty(-1)"))
    assert not is_peer_failure(_raised_from(tmp_path, "train", "handle.wait()"))
    assert not is_peer_failure(torch.OutOfMemoryError("CUDA out of memory"))


def test_launcher_finds_the_script_after_torchrun_options():
    argv = ["--nnodes", "1:3", "--exit-barrier-timeout", "5", "--rdzv-conf", "a=1,b=2", "--standalone"]
    argv += ["--max-restarts=2", "train.py", "--nnodes", "7"]
    assert argv[_script_index(argv)] == "train.py"
    assert _script_index(["train.py"]) == 0
    assert _script_index(["--exit-barrier-timeout=3", "-m", "pkg"]) == 2  # -m is a flag: pkg is the module


def test_launcher_runs_a_job_and_sets_its_store(tmp_path):
    """``python -m ds_adabatch.launch`` is torchrun: the script runs under its agent, with a workers'
    store of each incarnation's own (a node can join) and the exit barrier it was given."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "print('env', os.environ['TORCHELASTIC_RUN_ID'], os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE'),"
        " os.environ['TORCHELASTIC_USE_AGENT_STORE'], sys.argv[1:])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ds_adabatch.launch", "--exit-barrier-timeout", "2", "--standalone"]
        + ["--nproc-per-node", "1", str(script), "--nnodes", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "LOGLEVEL": "INFO"},  # the agent's log says how long its exit barrier waits
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("env"))
    assert line.endswith("1 False ['--nnodes', 'x']"), line
    assert "Waiting 2.0 seconds for other agents to finish" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.multirank
def test_what_live_recovery_covers_on_one_node(tmp_path, monkeypatch):
    """An optimizer instance is refused (the restart path, said once); ZeRO 1 and ZeRO 3 are covered and
    their snapshots live in the node's folder until the engine is closed; a transient fault (a collective
    fails, nobody lost) re-forms the same world, and the four objects initialize returned stay usable;
    under ZeRO 3 the re-formed world partitions the model again from the snapshot, exact."""
    monkeypatch.setenv("DS_ADABATCH_SNAPSHOT_DIR", str(tmp_path / "shm"))
    proc = torchrun(WORKER, "checks", str(tmp_path), "0", nproc=2, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads((tmp_path / "checks.json").read_text())
    assert got["optimizer_instance"]["live_elastic"].startswith("off:an optimizer or LR scheduler instance")
    warning = "adabatch.live_elastic is enabled but not available with an optimizer or LR scheduler instance"
    assert proc.stderr.count(warning) == 1
    assert got["optimizer_instance"]["snapshot_every"] is None  # live recovery off: no snapshots
    for stage in ("zero1", "zero3"):
        assert got[stage]["live_elastic"] == "on", got[stage]
        assert got[stage]["snapshot_every"] == 1, got[stage]  # live_elastic.snapshot_every, in force
        # Two ranks, each its own partition in two alternating slots (data + metadata); no buddy copy
        # on one node (a node's loss takes both ranks).
        files = got[stage]["files"]
        assert (
            len([f for f in files if f.endswith(".bin")]) == 4
            and len([f for f in files if f.endswith(".meta")]) == 4
        ), (stage, files)
        assert got[stage]["files_after_close"] == [], stage
    # A rank minutes late to the build or the first step is no failure; late in a step, it is one.
    late = got["late"]
    assert late["before"] == 0 and late["steps"] == 4, late
    assert [e["kind"] for e in late["events"]] == ["reform"] and late["events"][0]["lost"] == [], late
    zero3 = got["reform_zero3"]
    assert [e["kind"] for e in zero3["events"]] == ["reform"] and zero3["relative_difference"] <= 1e-6, zero3
    assert zero3["handles"]["loader_samples"] == zero3["handles"]["engine_samples"] > 0, zero3
    # A collective failed with both processes alive: they re-formed the same world and went on, exact.
    reform = got["reform"]
    assert [e["kind"] for e in reform["events"]] == ["reform"], reform
    assert reform["events"][0]["lost"] == [] and reform["events"][0]["world_size"] == 2
    assert any(
        h.startswith("reform: a collective failed with all 2 processes alive") for h in reform["history"]
    )
    assert reform["relative_difference"] <= 1e-6, reform
    # The engine, optimizer, LR scheduler and loader initialize returned are still the script's after the
    # DeepSpeed engine was rebuilt: the optimizer is the current one, all three agree on the LR, and the
    # loader reads the rebuilt loader's cursor.
    handles = reform["handles"]
    assert handles["optimizer_is_current"] is True, handles
    assert handles["optimizer_lr"] == handles["scheduler_lr"] == handles["engine_lr"] > 0, handles
    assert handles["loader_samples"] == handles["engine_samples"] > 0, handles
    assert handles["optimizer_state_keys"], handles
    # The engine swapped the DeepSpeed engine inside; its loop, checkpoints and LR wrapper are the same.
    assert handles["deepspeed_swapped"] is True and handles["lasting_parts_kept"] is True, handles

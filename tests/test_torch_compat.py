"""The torch names ds_adabatch relies on, as it uses them, in the torch this test runs on.

scripts/test_torch_matrix.sh runs this on each torch release setup.py accepts: the live-recovery and
launcher paths that use them need network namespaces or several machines, so the focused suite does not
launch them, and a release that renamed one would otherwise fail only there.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytestmark = pytest.mark.matrix


def test_private_distributed_names_the_runtime_calls():
    from torch.distributed import distributed_c10d

    # live_world.LiveWorld: the default group's store, and the NCCL abort when a peer is lost.
    assert callable(distributed_c10d._get_default_store)
    assert list(inspect.signature(distributed_c10d._abort_process_group).parameters) == ["group"]
    # LiveWorld: generation 0's default group bounded by collective_timeout_s.
    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters) == ["timeout", "group"]
    for method in ("set", "get", "add", "check", "wait", "multi_get", "multi_set", "compare_set"):
        assert hasattr(torch.distributed.TCPStore, method), method
    assert hasattr(torch.distributed, "PrefixStore")


def test_the_launcher_hooks_ds_adabatch_run_uses():
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.run import get_args_parser

    # launch.main: the agent class is read from the module when launch_agent builds it, and takes
    # exit_barrier_timeout; the launcher's options are read from its parser; the store variable exists.
    assert "LocalElasticAgent(" in inspect.getsource(launcher_api.launch_agent)
    assert "exit_barrier_timeout" in inspect.signature(launcher_api.LocalElasticAgent.__init__).parameters
    assert "--nproc-per-node" in get_args_parser()._option_string_actions
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in inspect.getsource(dynamic_rendezvous)


def test_host_memory_snapshots_and_the_op_build_directory(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    from ds_adabatch.runtime.distributed.op_builds import build_directory

    # live_snapshot: a tensor backed by a shared file, seen by a second mapping of the same file.
    path = str(tmp_path / "slot")
    first = torch.from_file(path, shared=True, size=4, dtype=torch.float32)
    first.copy_(torch.arange(4.0))
    assert torch.from_file(path, shared=True, size=4, dtype=torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    # op_builds: torch's build directory of an op, under TORCH_EXTENSIONS_DIR.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_directory("some_op") == str(tmp_path / "ext" / "some_op")
    assert list(inspect.signature(cpp_extension._get_build_directory).parameters) == ["name", "verbose"]

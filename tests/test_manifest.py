"""docker/pytorchjob.yaml against the Kubeflow training operator's PyTorchJob (kubeflow.org/v1) fields."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml (a dev dependency) reads the manifest")

ROOT = Path(__file__).resolve().parents[1]

# The v1 API's field names (training operator, pkg/apis/kubeflow.org/v1): what this manifest may use.
SPEC_KEYS = {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
ELASTIC_KEYS = {
    "minReplicas",
    "maxReplicas",
    "rdzvBackend",
    "rdzvPort",
    "rdzvHost",
    "rdzvId",
    "rdzvConf",
    "standalone",
    "nProcPerNode",
    "maxRestarts",
    "metrics",
}
REPLICA_KEYS = {"replicas", "restartPolicy", "template"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
RDZV_BACKENDS = {"c10d", "etcd", "etcd-v2"}


def test_pytorchjob_manifest_fields():
    job = yaml.safe_load((ROOT / "docker" / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert set(spec) <= SPEC_KEYS, f"unknown spec fields: {set(spec) - SPEC_KEYS}"
    elastic = spec["elasticPolicy"]
    assert set(elastic) <= ELASTIC_KEYS, f"unknown elasticPolicy fields: {set(elastic) - ELASTIC_KEYS}"
    assert elastic["rdzvBackend"] == "c10d" and elastic["rdzvBackend"] in RDZV_BACKENDS
    assert isinstance(spec["nprocPerNode"], str), "nprocPerNode is a string in the v1 API"
    replicas = spec["pytorchReplicaSpecs"]
    # Elastic jobs are Worker-only: every pod is alike and the rendezvous, not a Master, forms the world.
    assert set(replicas) == {"Worker"}
    worker = replicas["Worker"]
    assert set(worker) <= REPLICA_KEYS
    assert worker["restartPolicy"] in RESTART_POLICIES
    assert 1 <= elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert elastic["maxRestarts"] >= 1
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch", (
        "the operator injects its settings into the container named pytorch"
    )


def test_pytorchjob_runs_the_main_job_with_elastic_resume():
    from runners.train_lm import parse_args

    job = yaml.safe_load((ROOT / "docker" / "pytorchjob.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    script, *job_args = container["args"]
    assert (ROOT / script).is_file()
    args = parse_args(job_args)
    assert (ROOT / args.config).is_file()
    assert args.save_dir and args.save_dir == args.resume, "a restarted pod must resume what the job saves"
    assert args.save_every > 0 and args.keep_last >= 1
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(args.save_dir.startswith(m + "/") for m in mounts), (
        "checkpoints must live on the shared volume"
    )


def _pod_runner():
    """docker/podman_pytorchjob.py: the operator's environment and a pod's command line, from the manifest."""
    spec = importlib.util.spec_from_file_location(
        "podman_pytorchjob", ROOT / "docker" / "podman_pytorchjob.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchrun_takes_its_settings_from_the_operators_environment(monkeypatch):
    """The pod's bare ``torchrun`` command becomes the elastic launch the manifest describes."""
    from torch.distributed.run import config_from_args, parse_args

    runner = _pod_runner()
    job = runner.load_job(ROOT / "docker" / "pytorchjob.yaml")
    env = runner.operator_env(job)
    assert env["PET_NNODES"] == "1:4" and env["PYTHONUNBUFFERED"] == "1"
    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it for the whole session
    command = runner.pod_command(job)
    assert command[0] == "torchrun"
    config, script, script_args = config_from_args(parse_args(command[1:]))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 4, 8)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "ds-adabatch-lm-worker-0:23456"
    assert config.max_restarts == 10 and config.rdzv_configs["last_call_timeout"] == "10"
    # torchrun starts ``python -u SCRIPT ARGS``: the manifest's script and arguments, untouched.
    assert script == sys.executable and script_args[-(len(command) - 1) :] == command[1:]

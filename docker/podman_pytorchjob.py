"""Run a PyTorchJob manifest's Worker pods as podman containers, one per network namespace.

Each container gets what the Kubeflow training operator gives a pod of an elastic ``PyTorchJob``
(kubeflow.org/v1; training-operator v1.9, ``pkg/controller.v1/pytorch``: ``setPodEnv`` in envvar.go,
``ElasticEnvVarGenerator`` in elastic.go, defaults in ``pkg/apis/kubeflow.org/v1/pytorch_defaults.go``):

- the ``PET_*`` variables torchrun reads as its defaults: ``PET_NPROC_PER_NODE`` (``nprocPerNode``),
  ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port of pytorchjob-port, default 23456>``),
  ``PET_RDZV_BACKEND``, ``PET_NNODES`` (``min:max``), ``PET_MAX_RESTARTS``, ``PET_RDZV_ID`` and
  ``PET_RDZV_CONF`` when set, ``PET_STANDALONE``; and ``PYTHONUNBUFFERED=1``;
- the pod's hostname ``<job>-worker-<k>``, which every pod resolves (the operator's per-replica
  Service), so that torchrun finds the rendezvous host and each node's address as on Kubernetes;
- the container's ``command`` + ``args`` verbatim, with the options given here appended;
- every ``persistentVolumeClaim`` volume as one host folder shared by all pods.

Node ``k`` is the network namespace ``NAME-n<k>`` of scripts/netns-cluster.sh. A container stopped
with ``podman kill NAME-worker-<k>`` is a lost node: it is not restarted. The run ends when every
container has ended; the exit status is worker 0's (an elastic Worker-only job succeeds with it).
Usually started by ``bash scripts/image.sh cluster``, which passes the podman options.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NETNS = ROOT / "scripts" / "netns-cluster.sh"
DEFAULT_PORT = 23456  # PyTorchJobDefaultPort, given to the port named pytorchjob-port
PORT_NAME = "pytorchjob-port"

__all__ = ["PodmanCluster", "load_job", "operator_env", "pod_command", "pod_name", "worker_container"]


def load_job(path: str | Path) -> dict:
    """The manifest, refused with a sentence unless it is an elastic Worker-only PyTorchJob."""
    job = yaml.safe_load(Path(path).read_text())
    if job.get("kind") != "PyTorchJob" or "elasticPolicy" not in job.get("spec", {}):
        raise ValueError(f"{path}: not an elastic PyTorchJob (kind PyTorchJob with spec.elasticPolicy)")
    if set(job["spec"].get("pytorchReplicaSpecs", {})) != {"Worker"}:
        raise ValueError(f"{path}: only Worker replicas are run here (an elastic job has no Master)")
    return job


def worker_container(job: dict) -> dict:
    """The Worker pod's container named ``pytorch`` (the one the operator configures)."""
    containers = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    for container in containers:
        if container["name"] == "pytorch":
            return container
    raise ValueError("the Worker pod has no container named pytorch, which the operator requires")


def pod_name(job: dict, k: int) -> str:
    return f"{job['metadata']['name']}-worker-{k}"


def pod_command(job: dict) -> list[str]:
    """The container's ``command`` followed by its ``args``, as the pod runs them."""
    container = worker_container(job)
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def operator_env(job: dict) -> dict[str, str]:
    """The container's own ``env``, then what the operator appends (later entries win, as in a pod)."""
    spec, elastic = job["spec"], job["spec"]["elasticPolicy"]
    container = worker_container(job)
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    env["PYTHONUNBUFFERED"] = "1"
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = str(spec["nprocPerNode"])
    port = next(
        (p["containerPort"] for p in container.get("ports", []) if p.get("name") == PORT_NAME), DEFAULT_PORT
    )
    env["PET_RDZV_ENDPOINT"] = f"{elastic.get('rdzvHost', pod_name(job, 0))}:{elastic.get('rdzvPort', port)}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    # Defaults of setElasticPolicy: a missing bound takes the other, both missing take the replicas.
    replicas = job["spec"]["pytorchReplicaSpecs"]["Worker"].get("replicas", 1)
    low = elastic.get("minReplicas", elastic.get("maxReplicas", replicas))
    high = elastic.get("maxReplicas", low)
    env["PET_NNODES"] = f"{low}:{high}"
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if "nProcPerNode" in elastic:
        env["PET_NPROC_PER_NODE"] = str(elastic["nProcPerNode"])
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = str(elastic["rdzvId"])
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    if elastic.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


class PodmanCluster:
    """The job's Worker pods as containers ``NAME-worker-<k>`` in namespaces ``NAME-n<k>``."""

    def __init__(
        self,
        job: dict,
        *,
        image: str,
        nodes: int,
        name: str,
        data: Path,
        subnet: str,
        podman: list[str],
        run_opts: list[str],
    ) -> None:
        self.job, self.image, self.nodes, self.name = job, image, nodes, name
        self.data, self.subnet, self.podman, self.run_opts = data, subnet, podman, run_opts
        self.procs: list[subprocess.Popen] = []
        self.relays: list[threading.Thread] = []

    def container(self, k: int) -> str:
        return f"{self.name}-worker-{k}"

    def addr(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    def up(self) -> None:
        subprocess.run(
            ["bash", str(NETNS), "up", str(self.nodes), self.name, self.subnet],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def podman_run(self, k: int, env: dict[str, str], job_args: list[str]) -> list[str]:
        """The ``podman run`` command line of pod ``k``."""
        container = worker_container(self.job)
        argv = [*self.podman, "run", "--rm", "--name", self.container(k), *self.run_opts]
        argv += ["--network", f"ns:/var/run/netns/{self.name}-n{k}", "--hostname", pod_name(self.job, k)]
        argv += [f"--add-host={pod_name(self.job, j)}:{self.addr(j)}" for j in range(self.nodes)]
        argv += [f"--env={key}={value}" for key, value in env.items()]
        argv += self.volume_opts(container)
        if container.get("workingDir"):
            argv += ["--workdir", container["workingDir"]]
        return [*argv, self.image, *pod_command(self.job), *job_args]

    def volume_opts(self, container: dict) -> list[str]:
        volumes = {
            v["name"]: v
            for v in self.job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].get("volumes", [])
        }
        claims = [v for v in volumes.values() if "persistentVolumeClaim" in v]
        opts = []
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                # One claim: the data folder itself; several: a folder per claim inside it.
                host = (
                    self.data
                    if len(claims) == 1
                    else self.data / volume["persistentVolumeClaim"]["claimName"]
                )
                host.mkdir(parents=True, exist_ok=True)
                opts += ["-v", f"{host.resolve()}:{mount['mountPath']}"]
            elif "emptyDir" in volume:
                opts += ["--tmpfs", mount["mountPath"]]
            else:
                raise ValueError(
                    f"volume {mount['name']}: only persistentVolumeClaim and emptyDir are run here"
                )
        return opts

    def start(self, env: dict[str, str], job_args: list[str]) -> None:
        for k in range(self.nodes):
            proc = subprocess.Popen(
                self.podman_run(k, env, job_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            relay = threading.Thread(target=_relay, args=(proc, f"[worker-{k}] "), daemon=True)
            relay.start()
            self.procs.append(proc)
            self.relays.append(relay)

    def wait(self) -> list[int]:
        codes = [proc.wait() for proc in self.procs]
        for relay in self.relays:  # every line of every pod is out before the summary
            relay.join(timeout=10)
        return codes

    def down(self) -> None:
        """Remove the containers and the namespaces, whatever state they are in."""
        names = [self.container(k) for k in range(self.nodes)]
        subprocess.run([*self.podman, "rm", "-f", "--ignore", *names], capture_output=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        subprocess.run(["bash", str(NETNS), "down", self.name], capture_output=True)


def _relay(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True, help="image to run in place of the manifest's")
    p.add_argument("--manifest", default=str(ROOT / "docker" / "pytorchjob.yaml"))
    p.add_argument("--nodes", type=int, default=None, help="pods to start (default: the Worker replicas)")
    p.add_argument("--nproc", default=None, help="processes per pod, in place of spec.nprocPerNode")
    p.add_argument("--data", default=str(ROOT / "runs" / "cluster"), help="host folder of the job's volume")
    p.add_argument("--name", default="dsab", help="prefix of the namespaces and containers")
    p.add_argument("--subnet", default="10.213.0", help="the nodes' /24 (a private range)")
    p.add_argument("--podman", default="podman", help="the podman command (with global options)")
    p.add_argument("--run-opt", default="", help="options for every podman run, as one string")
    p.add_argument("job_args", nargs="*", help="options appended to the manifest's command line")
    args = p.parse_args(argv)

    try:
        job = load_job(args.manifest)
        spec = job["spec"]
        high = spec["elasticPolicy"].get(
            "maxReplicas", spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1)
        )
        nodes = args.nodes or spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1)
        if not 1 <= nodes <= min(high, 250):
            raise ValueError(f"--nodes {nodes}: the manifest's job takes 1 to {high} pods (maxReplicas)")
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {args.manifest}: {err}", file=sys.stderr)
        return 2
    if args.nproc is not None:
        spec["nprocPerNode"] = str(args.nproc)
    cluster = PodmanCluster(
        job,
        image=args.image,
        nodes=nodes,
        name=args.name,
        data=Path(args.data),
        subnet=args.subnet,
        podman=shlex.split(args.podman),
        run_opts=shlex.split(args.run_opt),
    )
    env = operator_env(job)
    print(f"[cluster] {nodes} pods of {job['metadata']['name']}: {' '.join(pod_command(job))}", flush=True)
    if args.job_args:
        print(f"[cluster] appended: {' '.join(args.job_args)}", flush=True)
    print("[cluster] " + " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("PET_")), flush=True)
    # A terminated run still removes what it made (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        cluster.up()
    except subprocess.CalledProcessError:
        # Namespaces of that name that exist already belong to another run: nothing is removed.
        print(f"error: scripts/netns-cluster.sh could not make {args.name}-n* (above)", file=sys.stderr)
        return 1
    try:
        cluster.start(env, args.job_args)
        codes = cluster.wait()
    finally:
        cluster.down()
    print("[cluster] exit: " + ", ".join(f"worker-{k} {c}" for k, c in enumerate(codes)), flush=True)
    return codes[0]


if __name__ == "__main__":
    sys.exit(main())

"""Karpenter on the real control plane: its kwok cloud provider (sigs.k8s.io/karpenter/kwok, built by
build-karpenter.sh), for the tests of the backend's Karpenter replacement mode. Registered in
tests/control/conftest.py.

The kwok cloud provider is Karpenter's own controllers (provisioning from pending pods, the
NodeClaim lifecycle, drain and termination) with a cloud whose "instance" is a Node object,
annotated kwok.x-k8s.io/node=fake, so the control plane's kwok runs it like any test node (Ready,
lease, pods). Its one instance type here is p5.48xlarge as the GPU pool's nodes are
(INSTANCE_TYPES), in zone us-west-2a, on-demand.

``karpenter`` (session-scoped) installs the CRDs of its version (NodePool, NodeClaim, NodeOverlay,
CapacityBuffer, KWOKNodeClass; replacing the NodeClaim and NodePool CRDs build.sh's v1.14.1
installed), starts the controller with leader election off, as the ServiceAccount
kube-system:karpenter bound to cluster-admin (so its requests are not the code under test's in
``KubeCluster.requests``), and stops it by PID at the end. ``gpu_pool`` (per test, registered
in tests/control/conftest.py too) makes the GPU pool's NodePool ``gpu`` from the kit's example
(deploy/overlays/example-karpenter/gpu-nodepool: the pool label and GPU taint in its template,
p5.48xlarge, its disruption settings) with a KWOKNodeClass in place of its EC2NodeClass
(``kwok_gpu_pool``), and deletes them (and so Karpenter's nodes) when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from control.kube.cluster import KubeCluster, wait_for
from control.kube.control_plane import (
    ControlPlane,
    _die_with_parent,
    built_or_skip,
    free_port,
    run_build_script,
    write_kubeconfig,
)
from control.support import REPO

BUILD_SCRIPT = Path(__file__).resolve().parent / "build-karpenter.sh"
#: Who Karpenter acts as (KubeCluster.requests leaves kube-system's ServiceAccounts out).
IDENTITY = ("kube-system", "karpenter")
CLAIMS = "/apis/karpenter.sh/v1/nodeclaims"
NODEPOOL = "/apis/karpenter.sh/v1/nodepools/gpu"
NODECLASS = "/apis/karpenter.kwok.sh/v1alpha1/kwoknodeclasses/default"
EXAMPLE_NODEPOOL = REPO / "deploy" / "overlays" / "example-karpenter" / "gpu-nodepool" / "nodepool-gpu.yaml"


def _offering(zone: str, capacity_type: str, price: float) -> dict:
    return {
        "Price": price,
        "Available": True,
        "Requirements": [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity_type]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]},
        ],
    }


#: The kwok provider's instance types (--instance-types-file-path): the GPU pool's p5.48xlarge.
INSTANCE_TYPES = [
    {
        "name": "p5.48xlarge",
        "offerings": [_offering("us-west-2a", "on-demand", 98.32)],
        "architecture": "amd64",
        "operatingSystems": ["linux"],
        "resources": {
            "cpu": "192",
            "memory": "2000Gi",
            "ephemeral-storage": "3800Gi",
            "pods": "110",
            "nvidia.com/gpu": "8",
            "vpc.amazonaws.com/efa": "32",
        },
    }
]


FORWARD = Path(__file__).with_name("forward.py")


def _forward(mode: str, a: str, b: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FORWARD), mode, a, b], stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)  # fmt: skip


def _get_over_unix(path: Path, url: str) -> int | None:
    """The HTTP status of GET ``url`` on the server behind the Unix socket ``path``, or None."""
    import http.client
    import socket

    class Connection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.settimeout(2)
            self.sock.connect(str(path))

    try:
        conn = Connection("localhost")
        conn.request("GET", url)
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


def build() -> Path:
    """Build (or reuse) Karpenter; return its cache directory (bin/karpenter, crds/)."""
    return run_build_script(BUILD_SCRIPT)


class Karpenter:
    """The running controller: ``start`` and ``stop``; ``log_tail`` for a failure message."""

    def __init__(self, cache: Path, plane: ControlPlane):
        self.cache, self.plane = cache, plane
        self.workdir = plane.workdir / "karpenter"
        self.proc: subprocess.Popen | None = None
        self.pipes: list[subprocess.Popen] = []

    @property
    def log(self) -> Path:
        return self.workdir / "karpenter.log"

    def install_crds(self) -> None:
        crds = sorted((self.cache / "crds").glob("*.yaml"))
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", *[f"--filename={c}" for c in crds])
        for crd in crds:
            self.plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"--filename={crd}")

    def kubeconfig(self, kube: KubeCluster) -> Path:
        namespace, name = IDENTITY
        kube.apply([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "test-karpenter"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
             "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        ], manager="test-harness")  # fmt: skip
        token = kube.token_for(IDENTITY, expiration_seconds=48 * 3600)
        # Inside Karpenter's network namespace the apiserver is a pipe on the same port (FORWARD).
        return write_kubeconfig(self.workdir / "kubeconfig", self.plane.server, self.plane.pki / "ca.crt",
                                token=token, namespace=namespace)  # fmt: skip

    def start(self, timeout: float = 120) -> Karpenter:
        self.workdir.mkdir(parents=True, exist_ok=True)
        kube = KubeCluster(self.plane)
        self.install_crds()
        types = self.workdir / "instance-types.json"
        types.write_text(json.dumps(INSTANCE_TYPES, indent=1))
        health = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")},
            "KUBECONFIG": str(self.kubeconfig(kube)),
            "SYSTEM_NAMESPACE": IDENTITY[0],
            "DISABLE_LEADER_ELECTION": "true",
            "METRICS_PORT": str(free_port()),
            "HEALTH_PROBE_PORT": str(health),
            "INSTANCE_TYPES_FILE_PATH": str(types),
            "LOG_LEVEL": "debug",
            # Provision as soon as the pods of a launch are pending (defaults: 1 s idle, 10 s max).
            "BATCH_IDLE_DURATION": "1s",
            "BATCH_MAX_DURATION": "3s",
        }
        # Karpenter binds its metrics and health servers on every interface (it has no flag for the
        # address), so it runs in a network namespace of its own, with only loopback. Pipes over
        # Unix sockets (forward.py) carry its apiserver connection out and its health check in.
        api_sock, health_sock = self.workdir / "apiserver.sock", self.workdir / "health.sock"
        api_port = self.plane.ports["apiserver"]
        self.pipes.append(_forward("unix-to-tcp", str(api_sock), str(api_port)))
        wait_for(api_sock.exists, timeout=30, what="the apiserver pipe")
        inside = (
            "ip link set lo up && "
            f'"$0" {FORWARD} tcp-to-unix {api_port} {api_sock} & '
            f'"$0" {FORWARD} unix-to-tcp {health_sock} {health} & '
            f'"$0" {FORWARD} wait-tcp {api_port} && '
            f"exec {self.cache / 'bin' / 'karpenter'}"
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-c", inside, sys.executable],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.workdir,
                preexec_fn=_die_with_parent,
            )
        (self.plane.workdir / "pids").open("a").write(f"karpenter {self.proc.pid}\n")

        def ready() -> bool:
            self.check_alive()
            return _get_over_unix(health_sock, "/readyz") == 200

        try:
            wait_for(ready, timeout=timeout, what="Karpenter ready (/readyz)", interval=0.5)
        except AssertionError as e:
            raise RuntimeError(f"{e}: {self.log_tail()}") from None
        return self

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"Karpenter ended (exit {self.proc.returncode}): {self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        for pipe in self.pipes:
            pipe.kill()
            pipe.wait(timeout=5)
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def karpenter(control_plane):
    """Karpenter (kwok cloud provider) running against the shared control plane."""
    controller = Karpenter(built_or_skip(build, "Karpenter"), control_plane)
    try:
        yield controller.start()
    finally:
        controller.stop()


def kwok_gpu_pool() -> dict:
    """The kit's example NodePool ``gpu`` (deploy/overlays/example-karpenter/gpu-nodepool), as it is
    but for what only AWS has: the KWOKNodeClass for its EC2NodeClass, on-demand only (the kwok
    provider offers no reservation), no consolidation while a test runs, a smaller limit."""
    import yaml

    pool = yaml.safe_load(EXAMPLE_NODEPOOL.read_text())
    template = pool["spec"]["template"]["spec"]
    template["nodeClassRef"] = {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"}
    for requirement in template["requirements"]:
        if requirement["key"] == "karpenter.sh/capacity-type":
            requirement["values"] = ["on-demand"]
    # Karpenter removes no node of its own accord while a test runs.
    pool["spec"]["disruption"]["consolidateAfter"] = "Never"
    pool["spec"]["limits"] = {"nvidia.com/gpu": "64"}
    return pool


@pytest.fixture
def gpu_pool(karpenter, kube):
    """The NodePool ``gpu`` (the kit's example, kwok_gpu_pool) with its KWOKNodeClass; deleted at
    the end, and its nodes with it."""
    kube.apply([
        {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": "default"}},
        kwok_gpu_pool(),
    ], manager="test-harness")  # fmt: skip
    yield kube
    kube._delete(NODEPOOL)  # its NodeClaims go with it (owner references): Karpenter ends their nodes
    try:
        wait_for(lambda: not kube.get(CLAIMS)["items"], timeout=180, what="the NodePool's NodeClaims gone")
    finally:
        kube._delete(NODECLASS)
        karpenter.check_alive()


def karpenter_nodes(kube) -> dict[str, dict]:
    """The nodes Karpenter made, by name."""
    return {n["metadata"]["name"]: n for n in kube.nodes() if "karpenter.sh/nodepool" in n["metadata"]["labels"]}

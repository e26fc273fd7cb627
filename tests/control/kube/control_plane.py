"""A real Kubernetes control plane on 127.0.0.1, for the EKS tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok, built from source by build.sh.

``ControlPlane.start(workdir)`` makes the certificates (openssl), starts the five processes with
their data under ``workdir`` and waits until the apiserver is ready and the controllers run;
``stop()`` ends them by PID (SIGTERM, then SIGKILL). Each process also gets PR_SET_PDEATHSIG, so a
killed pytest takes its control plane with it.

The apiserver runs as EKS's does where it matters to this project: TLS, service-account tokens
(TokenRequest), ``--authorization-mode=Node,RBAC``, the default admission plugins (PodSecurity and
ValidatingAdmissionPolicy among them) plus NodeRestriction, and an audit log (``audit_records``)
that records who asked for what, as the tests' request assertions need.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
STAGES = HERE / "stages.yaml"
#: kwok manages only the nodes carrying this annotation.
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
#: The node lifecycle controller marks a node whose lease stopped Unknown after this long (EKS: 40 s).
#: kwok renews each lease every quarter of its duration (3 s), well inside it.
NODE_MONITOR_GRACE_S = 10
NODE_LEASE_DURATION_S = 12
#: The node names whose heartbeat is lost: keys of this ConfigMap in kube-node-lease.
LOST_NODES_CONFIGMAP = "test-lost-nodes"
#: A lost node's heartbeat never reaches the apiserver: kwok (which keeps renewing the lease of a
#: node it no longer manages) is refused the renewal of the leases LOST_NODES_CONFIGMAP names, so
#: the real node lifecycle controller sees the node stop reporting. (The lease itself is left
#: alone: a write to it that does not renew it trips the controller's lease circuit breaker.)
LOST_NODE_POLICY = f"""
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {{name: test-lost-node-heartbeats}}
spec:
  failurePolicy: Fail
  paramKind: {{apiVersion: v1, kind: ConfigMap}}
  matchConstraints:
    resourceRules:
    - apiGroups: ["coordination.k8s.io"]
      apiVersions: ["v1"]
      operations: ["UPDATE"]
      resources: ["leases"]
  validations:
  - expression: >-
      request.userInfo.username != 'kwok' || !has(params.data) || !(object.metadata.name in params.data)
    message: the node is lost, its heartbeat does not reach the apiserver
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {{name: test-lost-node-heartbeats}}
spec:
  policyName: test-lost-node-heartbeats
  paramRef: {{name: {LOST_NODES_CONFIGMAP}, namespace: kube-node-lease, parameterNotFoundAction: Allow}}
  validationActions: [Deny]
"""


class ControlPlaneUnavailable(RuntimeError):
    """The control plane cannot be built here (no Go, no module proxy)."""


def run_build_script(script: Path) -> Path:
    """Run one of this folder's build scripts (build.sh, build-karpenter.sh): build or reuse its
    cache and return the cache directory. Exit 3 (no Go, no module proxy) is ControlPlaneUnavailable."""
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode == 3:
        raise ControlPlaneUnavailable(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no Go")
    if proc.returncode != 0:
        raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def build() -> Path:
    """Build (or reuse) the cached binaries; return the cache directory holding bin/."""
    return run_build_script(BUILD_SCRIPT)


def built_or_skip(build_cache, what: str) -> Path:
    """``build_cache()``'s directory; where it cannot be built here, skip the test, or fail it
    under CI=true."""
    import pytest

    try:
        return build_cache()
    except ControlPlaneUnavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {what} cannot be built: {e}")
        pytest.skip(f"no {what}: {e}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setsid()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(pki: Path) -> None:
    """A CA; the apiserver's serving certificate; client certificates for the admin, the controller
    manager, the scheduler and kwok; the service-account signing key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=fsdp-resilience-test-ca", cwd=pki)  # fmt: skip
    (pki / "san.cnf").write_text(
        "[ext]\nsubjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n"
    )
    clients = {
        "apiserver": ("/CN=kube-apiserver", "san"),
        "admin": ("/O=system:masters/CN=kubernetes-admin", None),
        "harness": ("/O=system:masters/CN=test-harness", None),
        "controller-manager": ("/CN=system:kube-controller-manager", None),
        "scheduler": ("/CN=system:kube-scheduler", None),
        "kwok": ("/O=system:masters/CN=kwok", None),
    }
    for name, (subject, ext) in clients.items():
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subject, cwd=pki)  # fmt: skip
        extra = ["-extfile", "san.cnf", "-extensions", "ext"] if ext else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", *extra, cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
                     token: str | None = None, namespace: str = "default") -> Path:  # fmt: skip
    user: dict = {}
    if cert:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user", "namespace": namespace}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config, indent=1))
    return path


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  users: ["system:kube-scheduler", "system:kube-controller-manager", "kwok", "system:apiserver"]
- level: None
  userGroups: ["system:nodes"]
- level: None
  resources: [{group: "coordination.k8s.io", resources: ["leases"]}]
- level: Metadata
"""


@dataclass
class ControlPlane:
    cache: Path
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    #: The deploy kit the last test applied (KubeCluster.load prunes what the next one lacks).
    applied_kit: list[dict] = field(default_factory=list)
    #: The tests' short node heartbeat; the scale benchmark (bench/control_plane/eks_scale.py) sets
    #: EKS's (40 s lease, 50 s grace): kwok renewing 1,024 leases every 3 s would load 2 cores.
    node_lease_duration_s: int = NODE_LEASE_DURATION_S
    node_monitor_grace_s: int = NODE_MONITOR_GRACE_S

    @property
    def bin(self) -> Path:
        return self.cache / "bin"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def harness_kubeconfig(self) -> Path:
        return self.workdir / "harness.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def version(self) -> str:
        return json.loads((self.cache / "build.json").read_text())["kubernetes"]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, emulated_version: str | None = None) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_certificates(self.pki)
        self.ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver", "kwok")}
        server = self.server
        for name in ("admin", "harness", "controller-manager", "scheduler", "kwok"):
            write_kubeconfig(self.workdir / f"{name}.kubeconfig", server, self.pki / "ca.crt",
                             cert=self.pki / f"{name}.crt", key=self.pki / f"{name}.key")  # fmt: skip
        (self.workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        self._spawn("etcd", [
            str(self.bin / "etcd"), "--data-dir", str(self.workdir / "etcd"), "--name", "test",
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"test={peer_url}", "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        self._wait_http(f"{etcd_url}/health", "etcd", 30)
        pki = self.pki
        apiserver = [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--endpoint-reconciler-type=none",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            # As EKS's apiserver: privileged pods (aws-node, kube-proxy) are allowed by the apiserver;
            # what refuses them in the training namespace is the kit's policy.
            "--allow-privileged=true",
            f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            "--profiling=false",
        ]
        if emulated_version:
            apiserver.append(f"--emulated-version=kube={emulated_version}")
        self._spawn("kube-apiserver", apiserver)
        self._wait_ready(120)
        # Karpenter's CRDs, so the NodeClaim path runs on the real apiserver (built by build.sh).
        crds = sorted((self.cache / "karpenter-crds").glob("*.yaml"))
        if crds:
            self.kubectl("apply", "--server-side", *[f"--filename={c}" for c in crds])
        self.kubectl("apply", "--server-side", "-f", "-", input=LOST_NODE_POLICY)
        common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0", "--profiling=false"]
        if emulated_version:
            common.append(f"--emulated-version=kube={emulated_version}")
        self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), *common,
            f"--kubeconfig={self.workdir / 'controller-manager.kubeconfig'}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--controllers=*",
            "--node-monitor-period=1s",
            f"--node-monitor-grace-period={self.node_monitor_grace_s}s",
            "--concurrent-job-syncs=5",
        ])  # fmt: skip
        self._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), *common,
            f"--kubeconfig={self.workdir / 'scheduler.kubeconfig'}",
        ])  # fmt: skip
        self._spawn("kwok", [
            str(self.bin / "kwok"),
            f"--kubeconfig={self.workdir / 'kwok.kubeconfig'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
            f"--config={STAGES}",
            f"--server-address=127.0.0.1:{self.ports['kwok']}",
            f"--node-lease-duration-seconds={self.node_lease_duration_s}",
        ])  # fmt: skip
        return self

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=5)
        for proc in self.procs.values():
            if proc.stdout:
                proc.stdout.close()
        self.procs.clear()

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"control plane process(es) ended: {dead}; logs: {self.logs_tail(list(dead))}")

    def logs_tail(self, names: list[str] | None = None, lines: int = 30) -> str:
        out = []
        for name in names or list(self.procs):
            log = self.workdir / f"{name}.log"
            if log.exists():
                out.append(f"--- {name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # -- helpers ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the process owns it)
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        log.close()
        (self.workdir / "pids").open("a").write(f"{name} {self.procs[name].pid}\n")

    def _wait_http(self, url: str, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                return
            except OSError:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} not ready after {timeout}s: {self.logs_tail([what])}") from None
                time.sleep(0.2)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "harness.crt"), str(self.pki / "harness.key"))
        return ctx

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ctx = self.ssl_context()
        while True:
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", timeout=5, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready after {timeout}s: {self.logs_tail(['kube-apiserver'])}")
            time.sleep(0.3)

    def kubectl(self, *args: str, input: str | None = None, kubeconfig: Path | None = None) -> str:
        proc = subprocess.run(
            [str(self.bin / "kubectl"), f"--kubeconfig={kubeconfig or self.harness_kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def audit_records(self, since_offset: int = 0) -> list[dict]:
        """The audit log's records from byte ``since_offset`` (the apiserver writes it synchronously)."""
        if not self.audit_log.exists():
            return []
        with self.audit_log.open("rb") as f:
            f.seek(since_offset)
            return [json.loads(line) for line in f.read().splitlines() if line.strip()]

    def audit_offset(self) -> int:
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

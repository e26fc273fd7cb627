"""An EKS cluster as far as this machine can have one, for the EKS path's tests: a real
Kubernetes control plane (tests/control/kube: kube-apiserver, kube-controller-manager,
kube-scheduler built from source, etcd, kwok for the nodes), AWS in moto's server, node groups as
Auto Scaling groups whose instances are the cluster's kwok nodes, and TrainingPodPlayer, which plays
the training pods' part on the run dir (FSx is a temp folder): it commits checkpoints and writes
events with the run contract, then ends each pod, through kwok, with the exit code a scenario asks
for.

Import the fixtures into a test module with
``from control.fakes.eks_cluster import aws, cluster  # noqa: F401``.

``cluster`` is the control plane with the rendered deploy kit applied (deploy/overlays/example,
``kubectl apply --server-side``): the real RBAC authorizer, the kit's ValidatingAdmissionPolicies
(real CEL), Pod Security admission from its namespace labels; tasks call with a real token of the
worker's ServiceAccount and triggers with the triggerer's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    Event,
    EventLog,
    FailureClass,
    RunConfig,
    failure_class_for_exit,
)

from control.fakes.saved_checkpoints import save_checkpoint
from control.kube.cluster import KubeCluster, UserInfo, service_account_user, wait_for

NS = "fsdp-training"
POOL = {"fsdp-resilience/pool": "gpu"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
MANAGED_TAG = {"Key": "fsdp-resilience/managed", "Value": "true", "PropagateAtLaunch": True}
REGION = "us-west-2"
REPO = Path(__file__).resolve().parents[3]
#: The Airflow identities the kit grants to (deploy/base/rbac.yaml).
WORKER = service_account_user("airflow", "airflow-worker")
TRIGGERER = service_account_user("airflow", "airflow-triggerer")


@pytest.fixture(scope="module")
def aws():
    """moto in server mode on 127.0.0.1 (reachable by every boto3 and aiobotocore client), and an
    Airflow connection ``aws_fake`` to it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its state per process, not per server: start every module from an empty account.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": url,
        "AIRFLOW_CONN_AWS_FAKE": json.dumps(
            {"conn_type": "aws", "extra": {"region_name": REGION, "endpoint_url": url}}
        ),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def permissive_cluster(kube, tmp_path, monkeypatch):
    """The control plane with an Airflow connection ``kubernetes_fake`` that acts as the cluster
    admin (no RBAC limits), for tests of the client layer alone: the backend's tests use
    ``cluster``."""
    kube.ensure_namespace(NS)
    kube.ensure_service_account(NS, "fsdp-training")
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_FAKE", kube.airflow_connection(kube.kubeconfig(tmp_path / "kubeconfig"), namespace=NS)
    )
    return kube


# ---------------------------------------------------------------------------------------------
# The strict cluster: the deploy kit loaded, and each caller with its own token.

#: Who Kubernetes requests made in this context act as instead of the kubeconfig's identity: a
#: bearer token, and the user that token's ServiceAccount impersonates (None: the token's own
#: ServiceAccount). Set by ``acting_as`` and by the triggers' patched ``run``.
ACTING_TOKEN: contextvars.ContextVar[tuple[str, UserInfo | None] | None] = contextvars.ContextVar(
    "acting_token", default=None
)
#: The ServiceAccount that authenticates the identities that are not ServiceAccounts (IAM roles
#: that an EKS access entry maps to Kubernetes groups): it may impersonate users and groups, and the
#: apiserver then authorizes and admits each request as the impersonated user.
IMPERSONATOR = ("kube-system", "test-impersonator")


def _deploy_tree_stamp(root: Path) -> tuple:
    return tuple(
        sorted((str(f), f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    )


@functools.cache
def _render_cached(overlay: str, stamp: tuple) -> tuple:
    if str(REPO / "deploy") not in sys.path:
        sys.path.insert(0, str(REPO / "deploy"))
    import render

    return tuple(render.render(REPO / "deploy" / "overlays" / overlay))


def render_kit(overlay: str = "example") -> list[dict]:
    """The deploy kit's objects for ``overlay``, rendered with kubectl's kustomize (deploy/render.py);
    rendered again whenever a file under deploy/ changed."""
    return [json.loads(json.dumps(o)) for o in _render_cached(overlay, _deploy_tree_stamp(REPO / "deploy"))]


def _with_acting_token(headers):
    acting = ACTING_TOKEN.get()
    if acting is None:
        return headers
    token, user = acting
    # The clients name the header "authorization" (the kubeconfig's api_key): replace any spelling.
    # Impersonate-Group goes once per group: the clients' own header types (urllib3's
    # HTTPHeaderDict, aiohttp's CIMultiDict) keep repeated headers.
    kept = [(k, v) for k, v in (headers or {}).items() if k.lower() != "authorization"]
    pairs = [*kept, ("Authorization", f"Bearer {token}")]
    if user is not None:
        pairs.append(("Impersonate-User", user.username))
        pairs.extend(("Impersonate-Group", group) for group in user.groups)
    return pairs


def _impersonator_token(kube: KubeCluster) -> str:
    """A token of IMPERSONATOR, which the cluster admin allows to impersonate users, groups and
    ServiceAccounts (and nothing else)."""
    namespace, name = IMPERSONATOR
    rules = [{"apiGroups": [""], "resources": ["users", "groups", "serviceaccounts"], "verbs": ["impersonate"]}]
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
    kube.apply(
        [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
             "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
             "roleRef": role_ref, "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        ],
        manager="test-harness",
    )  # fmt: skip
    return kube.token_for((namespace, name))


def credentials_for(kube: KubeCluster, user: UserInfo) -> tuple[str, UserInfo | None]:
    """What a request as ``user`` carries: a ServiceAccount's own real token, or for any other
    user (an IAM role, as EKS authenticates it) the impersonator's token and ``user`` to
    impersonate. The apiserver adds system:authenticated to an impersonated user's groups itself."""
    if user.username.startswith("system:serviceaccount:"):
        return kube.token_for(user), None
    groups = tuple(g for g in user.groups if g != "system:authenticated")
    return _impersonator_token(kube), UserInfo(user.username, groups)


def swap_tokens_in_clients(monkeypatch) -> None:
    """Make every ``kubernetes`` and ``kubernetes_asyncio`` request act as ACTING_TOKEN says when
    it is set in the calling context (the clients' REST layer is where the Authorization header
    is finally put together): its bearer token, and the Impersonate-* headers of the user its
    ServiceAccount impersonates."""
    import kubernetes.client.rest
    import kubernetes_asyncio.client.rest
    from multidict import CIMultiDict
    from urllib3 import HTTPHeaderDict

    sync_request = kubernetes.client.rest.RESTClientObject.request
    async_request = kubernetes_asyncio.client.rest.RESTClientObject.request

    def request(self, method, url, query_params=None, headers=None, *args, **kwargs):
        pairs = _with_acting_token(headers)
        if pairs is not headers:
            headers = HTTPHeaderDict()
            for k, v in pairs:
                headers.add(k, v)
        return sync_request(self, method, url, query_params, headers, *args, **kwargs)

    async def request_async(self, method, url, query_params=None, headers=None, *args, **kwargs):
        pairs = _with_acting_token(headers)
        if pairs is not headers:
            headers = CIMultiDict(pairs)
        return await async_request(self, method, url, query_params, headers, *args, **kwargs)

    monkeypatch.setattr(kubernetes.client.rest.RESTClientObject, "request", request)
    monkeypatch.setattr(kubernetes_asyncio.client.rest.RESTClientObject, "request", request_async)


def run_triggers_as(kube: KubeCluster, user: UserInfo, monkeypatch) -> None:
    """Triggers call Kubernetes as ``user`` (the triggerer): each trigger's ``run`` sets
    ACTING_TOKEN first. It is set in the task that iterates the trigger, which has a context of
    its own (dag.test runs each trigger in ``asyncio.run``, the triggerer in a task per trigger),
    so it never leaks into the tasks; ``asyncio.to_thread`` copies the context into its thread, so
    NodeCapacityTrigger's sync ``backend.capacity`` call carries the token too."""
    from fsdp_resilience.control.triggers.node_capacity import NodeCapacityTrigger
    from fsdp_resilience.control.triggers.spare_pool import SparePoolTrigger
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger

    credentials = credentials_for(kube, user)
    for trigger in (TrainingProgressTrigger, NodeCapacityTrigger, SparePoolTrigger):
        original = trigger.run

        async def run(self, _original=original):
            ACTING_TOKEN.set(credentials)
            async for event in _original(self):
                yield event

        monkeypatch.setattr(trigger, "run", run)


@contextlib.contextmanager
def acting_as(kube: KubeCluster, user: UserInfo):
    """Kubernetes calls made inside this block (in this thread, and in what it starts with a copy of
    its context) act as ``user``: a ServiceAccount with its own real token, any other user (an IAM
    role mapped to groups by an EKS access entry) impersonated by IMPERSONATOR. Needs
    swap_tokens_in_clients (cluster does it)."""
    reset = ACTING_TOKEN.set(credentials_for(kube, user))
    try:
        yield
    finally:
        ACTING_TOKEN.reset(reset)


def start_strict_cluster(kube: KubeCluster, tmp_path, monkeypatch, overlay: str = "example") -> KubeCluster:
    """``overlay``'s rendered kit applied to the control plane, an Airflow connection
    ``kubernetes_fake`` whose kubeconfig carries the worker's token, and the triggers calling as
    the triggerer."""
    kube.load(render_kit(overlay))
    kubeconfig = kube.kubeconfig(tmp_path / "kubeconfig", namespace=NS, user=WORKER)
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_FAKE", kube.airflow_connection(kubeconfig, namespace=NS))
    swap_tokens_in_clients(monkeypatch)
    run_triggers_as(kube, TRIGGERER, monkeypatch)
    return kube


@pytest.fixture
def cluster(kube, tmp_path, monkeypatch):
    """The real control plane as strict as the deploy kit makes EKS (deploy/overlays/example,
    rendered now and applied server-side): the RBAC authorizer with the kit's Roles and bindings,
    its ValidatingAdmissionPolicies (node writes, pod security; real CEL), Pod Security admission
    from its namespace labels, and the ServiceAccounts, PVCs and PriorityClasses it makes. Tasks
    call with a real token of the worker's ServiceAccount (the ``kubernetes_fake`` connection's
    kubeconfig); triggers with the triggerer's (run_triggers_as: each trigger's ``run`` sets
    ACTING_TOKEN, and the clients' REST layer swaps the Authorization header for it;
    swap_tokens_in_clients). ``acting_as(kube, user)`` does the same for a block of test code. Use
    ``start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")`` for another overlay."""
    return start_strict_cluster(kube, tmp_path, monkeypatch)


def make_asg(name: str, size: int, tagged: bool = True) -> list[str]:
    """An Auto Scaling group of ``size`` instances, as a managed node group has."""
    import boto3

    ec2 = boto3.client("ec2")
    template = ec2.create_launch_template(
        LaunchTemplateName=f"{name}-lt", LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    boto3.client("autoscaling").create_auto_scaling_group(
        AutoScalingGroupName=name,
        MinSize=size,
        MaxSize=size + 2,
        DesiredCapacity=size,
        LaunchTemplate={"LaunchTemplateId": template},
        AvailabilityZones=[f"{REGION}a"],
        Tags=[{**MANAGED_TAG, "ResourceId": name, "ResourceType": "auto-scaling-group"}] if tagged else [],
    )
    return asg_instances(name)


def asg_instances(name: str) -> list[str]:
    import boto3

    group = boto3.client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][
        0
    ]
    return sorted(i["InstanceId"] for i in group["Instances"] if i["LifecycleState"] == "InService")


#: The node conditions the EKS node monitoring agent reports.
MONITORING_AGENT_CONDITIONS = (
    "AcceleratedHardwareReady",
    "NetworkingReady",
    "StorageReady",
    "KernelReady",
    "ContainerRuntimeReady",
)


def add_gpu_node(kube: KubeCluster, name: str, instance: str | None = None, **kw) -> dict:
    """A p5.48xlarge node of the GPU pool (labels, taint, GPUs, EFA devices and the allocatable CPU
    and memory left after EKS's kube-reserved, as on EKS), in zone us-west-2a, with the EKS node
    monitoring agent's conditions healthy unless ``conditions`` says otherwise."""
    conditions = kw.pop("conditions", None) or []
    given = {c["type"] for c in conditions}
    healthy = [
        {"type": t, "status": "True", "reason": f"{t}Healthy"} for t in MONITORING_AGENT_CONDITIONS if t not in given
    ]
    return kube.add_node(
        name,
        labels={
            **POOL,
            "node.kubernetes.io/instance-type": "p5.48xlarge",
            "topology.kubernetes.io/zone": f"{REGION}a",
            "topology.kubernetes.io/region": REGION,
        },
        conditions=[*healthy, *conditions],
        taints=[GPU_TAINT],
        allocatable={"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32, "cpu": "191450m", "memory": "1990Gi"},
        provider_id=f"aws:///{REGION}a/{instance}" if instance else None,
        **kw,
    )


#: The error a pod's rank reports before its launcher ends with each failure class.
FAULT_ERRORS = {
    FailureClass.RESTARTS_EXHAUSTED: "CUDA error: uncorrectable ECC error encountered",
    FailureClass.STORAGE_ERROR: "OSError: [Errno 28] No space left on device: '/fsx/runs'",
    FailureClass.NON_FINITE: "the loss is nan at step 10 after 2 rollbacks to the newest verified checkpoint",
    FailureClass.USER_ERROR: "ValueError: the same error at the same step twice",
}


def commit_checkpoint(run_dir: str | Path, step: int, world_size: int) -> None:
    """A checkpoint as the ranks leave it (a shard each with its checksum record, DCP's
    .metadata) and rank 0's commit."""
    save_checkpoint(run_dir, step, world_size)


def _env(pod: dict, name: str) -> str | None:
    for container in pod["spec"]["containers"]:
        for env in container.get("env") or []:
            if env["name"] == name:
                return env.get("value")
    return None


#: Scenario results beyond exit codes: a hot spare's launcher that parks (it waits in the
#: rendezvous and ends 0 when node 0 of its launch does), and a node that stops reporting once node
#: 0 committed up to ``fail_at_step`` (``KubeCluster.lose_node``: its pod stays Terminating).
PARK = "park"
LOSE_NODE = "lose_node"


def _completion_index(pod: dict) -> int:
    return int((pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-completion-index", 0))


def _job_of(pod: dict) -> str:
    return (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name", "")


class TrainingPodPlayer:
    """Plays the pods of the fake cluster: what ``python -m fsdp_resilience.training.launch`` would leave in the run
    dir and which exit code it would end with, per (launch id, node index), as ``scenario`` says.

    ``scenario(launch_id, index, node_name) -> exit code`` decides; a training pod first writes
    ``launch_begin``, commits checkpoints (node 0, as rank 0 does) up to the run's last step when it
    exits 0, or up to ``fail_at_step`` otherwise, and logs a fault on its node (with the error of the
    exit code's failure class) before a non-zero exit and its ``final`` event. Exit 73
    (``already_running``) is the launch lock refusing the pod: it writes nothing and exits at once.
    ``None``: commit up to ``fail_at_step`` and keep running (until the job controller, a cancel or
    an eviction stops the pod). Evaluation pods write ``eval.json`` for the checkpoint they were
    given (``--checkpoint``), recorded in ``evaluated``. With ``asg``, a new Ready node joins for
    every new instance of that Auto Scaling group (the node group's replacement registering with
    the cluster); with ``ccm`` too, a node whose instance left the group is deleted (the cloud node
    lifecycle controller; PodGC then fails its pods).

    Hot spares: ``PARK`` parks the pod (``launch_begin`` with standby, then it waits) until node 0
    of its launch exits 0, when it ends 0 with a successful ``final``; ``LOSE_NODE`` has the pod's
    node stop reporting once node 0's commits reach ``fail_at_step``. ``midway(cfg, launch_id)``,
    when given, is called by node 0 once it committed up to ``fail_at_step`` in a launch that ends
    well, before it commits the rest (training goes on while the control plane does its part).
    ``threaded`` plays each pod in a thread of its own (needed when one waits for another's).
    """

    def __init__(
        self,
        kube: KubeCluster,
        scenario: Callable[[str, int, str], int | str | None],
        fail_at_step: int = 10,
        asg: str | None = None,
        after_commits: Callable[[RunConfig], None] | None = None,
        *,
        ccm: bool = False,
        midway: Callable[[RunConfig, str], None] | None = None,
        threaded: bool = False,
    ):
        self.kube, self.scenario, self.fail_at_step, self.asg = kube, scenario, fail_at_step, asg
        self.ccm, self.midway, self.threaded = ccm, midway, threaded
        self.parked: dict[str, list[tuple[str, EventLog]]] = {}  # launch id -> (pod, its events) parked
        self.deleted_nodes: list[str] = []  # nodes the cloud node lifecycle controller deleted (ccm)
        self._parked_lock = threading.Lock()
        self.after_commits = after_commits  # called by node 0 once its commits are done (to damage one)
        self.handled: set[str] = set()
        self._first_played: set[str] = set()  # jobs whose node 0 pod was played
        self._first_seen: dict[str, float] = {}  # pod -> when it was first seen running, waiting
        self.joined: list[str] = []
        self.evaluated: list[str] = []  # the checkpoint of each evaluation pod
        self._known_instances = set(asg_instances(asg)) if asg else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="training-pod-player", daemon=True)

    def __enter__(self) -> "TrainingPodPlayer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            if self.asg:
                self._join_new_nodes()
            running = [p for p in self.kube.pods(NS) if p["status"].get("phase") == "Running"]
            for pod in sorted(running, key=_completion_index):
                name = pod["metadata"]["name"]
                if name in self.handled or self._waits_for_node_0(pod):
                    continue
                self.handled.add(name)
                if _completion_index(pod) == 0:
                    self._first_played.add(_job_of(pod))
                if self.threaded:
                    threading.Thread(target=self._play, args=(pod,), name=f"pod-{name}", daemon=True).start()
                else:
                    self._play(pod)

    def _waits_for_node_0(self, pod: dict) -> bool:
        """Played one at a time, a pod of node > 0 waits for node 0's commits: play it only after
        node 0's pod of its job (else the two would wait for each other until a timeout), unless
        node 0 has not run for a few seconds (a scenario where it never does)."""
        if self.threaded or _completion_index(pod) == 0 or _job_of(pod) in self._first_played:
            return False
        seen = self._first_seen.setdefault(pod["metadata"]["name"], time.monotonic())
        return time.monotonic() - seen < 5.0

    def _join_new_nodes(self) -> None:
        current = set(asg_instances(self.asg))
        for instance in sorted(current - self._known_instances):
            self._known_instances.add(instance)
            name = f"gpu-new-{len(self.joined)}"
            add_gpu_node(self.kube, name, instance)
            self.joined.append(name)
        if self.ccm:
            for node in self.kube.nodes():
                provider = node["spec"].get("providerID") or ""
                instance = provider.rsplit("/", 1)[-1]
                if instance in self._known_instances and instance not in current:
                    self.kube.remove_node(node["metadata"]["name"])
                    self.deleted_nodes.append(node["metadata"]["name"])

    def _play(self, pod: dict) -> None:
        node = pod["spec"]["nodeName"]
        labels = pod["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/component") == "evaluation":
            command = pod["spec"]["containers"][0]["command"]
            run_dir = Path(command[command.index("--config") + 1]).parent
            # The checkpoint the control plane named (it verified it), else the newest committed.
            named = command[command.index("--checkpoint") + 1] if "--checkpoint" in command else None
            info = next(c for c in reversed(CheckpointCatalog(run_dir).committed()) if named in (None, c.checkpoint_id))
            self.evaluated.append(info.checkpoint_id)
            (run_dir / "eval.json").write_text(
                json.dumps(
                    {
                        "checkpoint_id": info.checkpoint_id,
                        "step": info.step,
                        "val_loss": 2.5,
                        "perplexity": 12.18,
                        "saved_world_size": 4,
                    }
                )
            )
            self.kube.terminate_pod(NS, pod["metadata"]["name"], 0)
            return
        cfg = RunConfig.from_json(_env(pod, "TRAINING_RUN_CONFIG"))
        launch_id = _env(pod, "TRAINING_LAUNCH_ID")
        index = int(labels["batch.kubernetes.io/job-completion-index"])
        code = self.scenario(launch_id, index, node)
        if code is not None and failure_class_for_exit(code) is FailureClass.ALREADY_RUNNING:
            # Refused at once by the launch lock another launcher holds: no event, nothing written.
            self.kube.terminate_pod(NS, pod["metadata"]["name"], code)
            return
        events = EventLog(cfg.layout.events, run_id=cfg.run_id, node_rank=index, launch_id=launch_id, node_id=node)
        if code == PARK:
            events.emit(Event.LAUNCH_BEGIN, restart_mode=cfg.restart_mode, standby=True)
            with self._parked_lock:
                self.parked.setdefault(launch_id, []).append((pod["metadata"]["name"], events))
            return
        events.emit(Event.LAUNCH_BEGIN, restart_mode=cfg.restart_mode)
        last = cfg.steps if code == 0 else self.fail_at_step
        if index == 0:
            newest = CheckpointCatalog(cfg.run_dir).latest()
            halfway = self.fail_at_step if code == 0 and self.midway else None
            for step in range(cfg.checkpoint_interval, last + 1, cfg.checkpoint_interval):
                if not newest or step > newest.step:
                    commit_checkpoint(cfg.run_dir, step, cfg.nodes * cfg.procs_per_node)
                if step == halfway:
                    self.midway(cfg, launch_id)
            if self.after_commits:
                self.after_commits(cfg)
        else:
            # Wait for node 0's commits, as the ranks of one job do at each collective save.
            wait_for(
                lambda: (
                    (CheckpointCatalog(cfg.run_dir).latest() or None)
                    and CheckpointCatalog(cfg.run_dir).latest().step >= last - last % cfg.checkpoint_interval
                ),
                what="node 0's commits",
            )
        if code == LOSE_NODE:
            self.kube.lose_node(node)
            return
        if code is None:
            return
        failure = failure_class_for_exit(code)
        if code != 0:
            events.emit(
                Event.FAULT_DETECTED,
                kind="exception",
                step=last,
                rank=index * cfg.procs_per_node,
                error=FAULT_ERRORS.get(failure, f"the launcher ended {failure.value}"),
                failure_class=failure.value,
            )
        events.emit(Event.FINAL, exit_code=code, failure_class=failure.value)
        self.kube.terminate_pod(NS, pod["metadata"]["name"], code)
        if index == 0 and code == 0:  # the launch ended well: its spares' launchers end 0 too
            with self._parked_lock:
                parked = self.parked.pop(launch_id, [])
            for name, spare_events in parked:
                spare_events.emit(Event.FINAL, exit_code=0, failure_class=FailureClass.SUCCESS.value)
                self.kube.terminate_pod(NS, name, 0)


#: The pods' tolerations in these tests: the GPU pool's taint, as by default, and a lost node's
#: pods evicted 2 s after it is tainted unreachable or not-ready instead of Kubernetes' 300 s
#: default (the DefaultTolerationSeconds admission plugin's), so a node loss plays out in seconds.
#: Users can set the same through PodTemplateSettings.tolerations.
TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2},
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2},
]


def backend_for(tmp_path, **kw):
    """An ``EksBackend`` on this cluster (the ``kubernetes_fake`` and ``aws_fake`` connections),
    FSx mounted at ``tmp_path/fsx``, the pods tolerating a lost node for 2 s (TOLERATIONS)."""
    from fsdp_resilience.control.backends import get_backend

    pod = {"fsx_mount_path": str(tmp_path / "fsx"), "tolerations": TOLERATIONS, **kw.pop("pod", {})}
    kw = {"kubernetes_conn_id": "kubernetes_fake", "aws_conn_id": "aws_fake", "region_name": "us-west-2", **kw}
    return get_backend("eks", image="example.com/fsdp-training:test", namespace=NS, pod=pod, **kw)


def run_config(tmp_path, run_id="llm", nodes=2, **kw) -> RunConfig:
    """A run on this cluster: 8 ranks a node, its run dir and dataset on the FSx folder."""
    fsx = tmp_path / "fsx"
    return RunConfig.from_dict(
        {
            "run_id": run_id,
            "run_dir": str(fsx / "runs" / run_id),
            "dataset_dir": str(fsx / "datasets" / "c4"),
            "nodes": nodes,
            "procs_per_node": 8,
            "stall_timeout_s": 600,
            **kw,
        }
    )
